"""DeepSpeed's lr schedulers, fp16 dynamic loss scaling and L2 Adam, continued by jaxzero.

Real DeepSpeed 0.19.8 runs (``tests/fixtures/deepspeed_configs``, made by
``tests/make_ds_configs_fixture.py``), saved after step 3 and trained on to step 5, are read
with jaxzero's DeepSpeed reader and continued 2 steps on 8 devices with
``jaxzero.interop.deepspeed.adamw`` (and ``loss_scale`` for fp16); the params are compared
with DeepSpeed's own after step 5, and the lr, betas and loss scale with what DeepSpeed used.
"""

import dataclasses
import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FIXTURES, missing, require

import jaxzero as jz
from jaxzero.interop.deepspeed import (
    DeepSpeedSettingError,
    adamw,
    deepspeed_to_jax,
    loss_scale,
    read_checkpoint,
    to_train_state,
    write_checkpoint,
)
from jaxzero.interop.deepspeed.chain import settings_of

pytestmark = pytest.mark.interop  # torch and DeepSpeed (tests/conftest.py)
torch = require("torch", "torch")

FIXTURE = os.path.join(FIXTURES, "deepspeed_configs")
SCHEDULERS = {  # fixture case: the scheduler it runs
    "warmup_lr": "WarmupLR",
    "warmup_decay_lr": "WarmupDecayLR",
    "warmup_cosine_lr": "WarmupCosineLR",
    "one_cycle": "OneCycle",
    "lr_range_test": "LRRangeTest",
}


@dataclasses.dataclass
class Case:
    ckpt: object
    info: dict  # losses.json
    traj: object  # DeepSpeed's params after steps 4 and 5
    config: dict  # the ds_config
    data: object

    @property
    def stage(self):
        return self.config["zero_optimization"]["stage"]

    def batch(self, k):
        """Step k+1's global batch: both ranks' examples."""
        return {"x": self.data["x"][k].reshape(-1, 32), "y": self.data["y"][k].reshape(-1, 16)}


def case(name) -> Case:
    d = os.path.join(FIXTURE, name)
    if not os.path.isfile(os.path.join(d, "losses.json")):
        missing(f"fixture case deepspeed_configs/{name}", d)
    with open(os.path.join(d, "losses.json")) as f:
        info = json.load(f)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)["ds_config"]
    own = os.path.join(FIXTURE, f"data_{name}.npz")
    data = np.load(own if os.path.isfile(own) else os.path.join(FIXTURE, "data.npz"))
    traj = np.load(os.path.join(d, "trajectory.npz"))
    return Case(read_checkpoint(os.path.join(d, "ckpt")), info, traj, config, data)


def mlp_c(p, b):
    """tests/ds_worker.py's MlpC with its MSE loss: the input cast to the params' dtype and the
    output back to float32, as the worker does (a no-op in fp32)."""
    dt = p["fc1.weight"].dtype
    h = jnp.tanh(b["x"].astype(dt) @ p["fc1.weight"].T + p["fc1.bias"])
    out = (h @ p["fc2.weight"].T + p["fc2.bias"]).astype(jnp.float32)
    return jnp.mean((out - b["y"]) ** 2)


def continue_run(c: Case, tx, **zero_kw):
    """jaxzero at the run's stage on 8 devices from the step-3 checkpoint through steps 4 and
    5: ``[(state, metrics)]`` on the host, the start state first (its metrics None)."""
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(8), stage=c.stage, **zero_kw)
    state = to_train_state(c.ckpt, zero)
    step = jz.make_train_step(mlp_c, zero)
    out = [(jax.device_get(state), None)]  # on the host: each step donates its input state
    for k in (3, 4):
        state, metrics = step(state, c.batch(k))
        out.append((jax.device_get(state), jax.device_get(metrics)))
    return out


def master(state):
    return state.master if state.master is not None else state.params


def want(c: Case, k):
    return {n: c.traj[f"params/{k}/{n}"] for n in c.ckpt.param_names}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_deepspeed_scheduler_continues_like_deepspeed(name):
    """Each DeepSpeed lr scheduler: ``adamw(ckpt)`` reports it, its lr (OneCycle: and betas)
    at steps 4 and 5 are the ones DeepSpeed used, and the continued params equal DeepSpeed's
    after steps 4 and 5 within 1e-6."""
    c = case(name)
    assert c.ckpt.lr_scheduler == {"last_batch_iteration": 2}
    reported = []
    tx = adamw(c.ckpt, None, report=reported.append)
    line = next(x for x in reported[0].splitlines() if x.startswith("scheduler = "))
    assert line.startswith(f"scheduler = '{SCHEDULERS[name]}' (set): the lr of every param")
    assert "continuing from scheduler iteration 2" in line
    sched = settings_of(tx).schedule
    for count in (3, 4):  # the optax count before steps 4 and 5
        for g, s in enumerate(sched.groups):
            np.testing.assert_allclose(float(s.lr(count)), c.info["lrs"][count][g], rtol=1e-6)
            if s.b1 is not None:
                beta1, beta2 = c.info["betas"][count][g]
                np.testing.assert_allclose(float(s.b1(count)), beta1, rtol=1e-6)
                assert s.b2 == beta2
    steps = continue_run(c, tx)[1:]
    for k, (state, metrics) in zip((4, 5), steps, strict=True):
        np.testing.assert_allclose(metrics["grad_norm"], c.info["grad_norms"][k - 1], rtol=1e-5)
        # DeepSpeed's params from the fixture: torch's Adam rounds in its own order
        chex.assert_trees_all_close(master(state), want(c, k), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_deepspeed_scheduler_from_the_first_step(name):
    """The same schedules built from the bare ds_config for a run from its first step (the
    param groups at the optimizer's lr) give DeepSpeed's lr on each of its 5 steps: WarmupLR's
    log warm-up from warmup_min_lr 0 gives lr 0 on steps 1 and 2, WarmupCosineLR 0 on step 1."""
    c = case(name)
    groups = [{**g, "lr": c.config["optimizer"]["params"]["lr"]} for g in c.ckpt.param_groups]
    groups = [{**g, "betas": c.config["optimizer"]["params"]["betas"]} for g in groups]
    tx = adamw(groups, None, ds_config=c.config, report=None)
    sched = settings_of(tx).schedule
    got = [[float(s.lr(t)) for s in sched.groups] for t in range(5)]
    # DeepSpeed's lrs from the fixture, a float32 formula against torch's float64 one
    np.testing.assert_allclose(got, c.info["lrs"], rtol=1e-6, atol=0)
    if name == "warmup_lr":
        assert got[0] == got[1] == [0.0, 0.0] and got[2][0] > 0


def test_deepspeed_adam_l2_continues_like_deepspeed():
    """Adam with ``adam_w_mode: false`` (torch Adam inside ZeRO 1: the weight decay is added to
    the gradient before the moments): read, reported as L2, continued within 1e-6 of
    DeepSpeed's params after steps 4 and 5."""
    c = case("adam_l2")
    assert c.ckpt.l2_weight_decay and c.ckpt.zero_stage == 1
    reported = []
    tx = adamw(c.ckpt, None, report=reported.append)
    assert "(Adam, L2: decay added to the gradient)" in reported[0]
    assert "adam_w_mode = False (set): L2: optax.add_decayed_weights before" in reported[0]
    for k, (state, _) in zip((4, 5), continue_run(c, tx)[1:], strict=True):
        # DeepSpeed's params from the fixture: torch's Adam rounds in its own order
        chex.assert_trees_all_close(master(state), want(c, k), atol=1e-6, rtol=0)


def test_deepspeed_continuations_without_the_setting_drift():
    """The continuations above fail without the settings: decoupled AdamW on the L2 run, and
    the saved (constant) lr on the WarmupDecayLR run, are more than 1e-4 from DeepSpeed's
    params after step 5."""
    c = case("adam_l2")
    decay = {n: n.endswith("weight") for n in c.ckpt.param_names}
    clip = optax.clip_by_global_norm(1.0)
    adamw_tx = optax.chain(
        clip, optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay)
    )
    state = continue_run(c, adamw_tx)[-1][0]
    assert max(np.abs(v - want(c, 5)[n]).max() for n, v in master(state).items()) > 1e-4
    c = case("warmup_decay_lr")
    lr = c.ckpt.param_groups[0]["lr"]
    constant = optax.chain(
        clip, optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay)
    )
    state = continue_run(c, constant)[-1][0]
    assert max(np.abs(v - want(c, 5)[n]).max() for n, v in master(state).items()) > 1e-4


def scaler_state(after: dict):
    """jaxzero's loss-scale state of DeepSpeed's scaler after a step (losses.json)."""
    return (
        after["cur_scale"],
        after["cur_iter"] - after["last_overflow_iter"] - 1,
        after["cur_hysteresis"],
    )


def test_deepspeed_fp16_dynamic_loss_scale_continues_like_deepspeed():
    """An fp16 run with dynamic loss scaling (step 1 overflowed: hysteresis 2 -> 1): jaxzero
    starts from the checkpoint's scaler (scale 4096, 2 clean steps, hysteresis 1, 1 skipped
    step), skips step 4 and halves the scale (the hysteresis is spent), applies step 5 without
    growing it, as DeepSpeed did: the scaler state and skipped steps after each step are
    DeepSpeed's, and the params after step 5 are within 1e-4 of DeepSpeed's (fp16 compute
    rounds differently; a skip decided otherwise moves them by about the lr, 1e-2)."""
    c = case("fp16_dynamic")
    assert c.ckpt.dtype == "fp16" and c.ckpt.skipped_steps == 1
    ls = loss_scale(c.ckpt)
    assert (ls.init_scale, ls.window, ls.hysteresis, ls.growth) == (4096.0, 2, 2, "since_overflow")
    tx = adamw(c.ckpt, None, report=None)
    (start, _), *steps = continue_run(c, tx, precision="fp16", loss_scale=ls)
    s = start.loss_scale
    assert (float(s.scale), int(s.good_steps), int(s.hysteresis_left)) == scaler_state(
        c.info["loss_scaler_after"][2]
    )
    assert int(start.skipped) == 1 and int(start.step) == 2  # DeepSpeed's Adam took 2 steps
    for k, (state, metrics) in zip((4, 5), steps, strict=True):
        s = state.loss_scale
        got = (float(s.scale), int(s.good_steps), int(s.hysteresis_left))
        assert got == scaler_state(c.info["loss_scaler_after"][k - 1]), k
        assert int(metrics["skipped"]) == c.info["skipped_steps"][k - 1]
        assert bool(metrics["finite"]) == (k == 5)
    # the skipped step leaves the master untouched: exactly equal
    chex.assert_trees_all_close(master(steps[0][0]), master(start), atol=0, rtol=0)
    # DeepSpeed's params from the fixture, after an fp16 forward and backward of its own
    chex.assert_trees_all_close(master(steps[1][0]), want(c, 5), atol=1e-4, rtol=0)


def test_dynamic_loss_scale_matches_deepspeeds_scaler():
    """``DynamicLossScale(growth="since_overflow")`` against DeepSpeed's own
    ``DynamicLossScaler.update_scale`` on random overflow sequences, for windows 1-3,
    hysteresis 1-3 and both ``consecutive_hysteresis``: the scale, the hysteresis left and the
    clean steps since the last overflow agree after every step."""
    require("deepspeed", "torch")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.fp16 import loss_scaler as dsl

    dsl.dist = type("Rank0", (), {"get_rank": staticmethod(lambda: 0)})  # no process group
    rng = np.random.default_rng(0)
    for window, hyst, consecutive in [
        (w, h, c) for w in (1, 2, 3) for h in (1, 2, 3) for c in (False, True)
    ]:
        ds = dsl.DynamicLossScaler(
            2.0**10, window, 1.0, hyst, consecutive, raise_error_at_min_scale=False
        )
        ours = jz.DynamicLossScale(
            2.0**10,
            window=window,
            hysteresis=hyst,
            growth="since_overflow",
            consecutive_hysteresis=consecutive,
        )
        s = ours.init()
        for overflow in rng.random(40) < 0.3:
            ds.update_scale(bool(overflow))
            s = ours.update(s, jnp.asarray(not overflow))
            good = ds.cur_iter - ds.last_overflow_iter - 1
            assert (float(s.scale), int(s.good_steps), int(s.hysteresis_left)) == (
                ds.cur_scale,
                good,
                ds.cur_hysteresis,
            ), (window, hyst, consecutive)


@pytest.mark.parametrize(
    "name,key", [("warmup_lr", "scheduler"), ("fp16_dynamic", "fp16"), ("adam_l2", "adam_w_mode")]
)
def test_deepspeed_convert_and_write_refuse_what_they_cannot_carry(tmp_path, name, key):
    """``deepspeed2jax`` (whose way back writes no scheduler state, no loss scaler and AdamW
    only) refuses these runs naming the setting, before writing anything; ``write_checkpoint``
    of a state whose chain reproduces them refuses too."""
    c = case(name)
    src = os.path.join(FIXTURE, name, "ckpt")
    with pytest.raises(DeepSpeedSettingError, match=f"the run uses .*{key}"):
        deepspeed_to_jax(src, tmp_path / "out", stage=2, devices=8)
    assert not (tmp_path / "out").exists()
    kw = {"precision": "fp16", "loss_scale": loss_scale(c.ckpt)} if name == "fp16_dynamic" else {}
    zero = jz.ZeRO(adamw(c.ckpt, None, report=None), jz.data_parallel_mesh(2), stage=2, **kw)
    state = to_train_state(c.ckpt, zero)
    with pytest.raises(DeepSpeedSettingError, match=f"zero.tx reproduces .*{key}"):
        write_checkpoint(tmp_path / "w", state, stage=2, world_size=2, zero=zero)
    assert not (tmp_path / "w").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def with_scheduler(ckpt, sched, **changes):
    return dataclasses.replace(ckpt, ds_config={**ckpt.ds_config, "scheduler": sched}, **changes)


def test_deepspeed_scheduler_misuse_is_refused_by_name():
    """What the schedules cannot reproduce, or what DeepSpeed would not run, fails with
    DeepSpeedSettingError naming the problem before anything is built: a torch scheduler
    name, unknown or missing parameters, saved lr that the config's schedule does not give;
    an fp16 run continued by a ZeRO without its loss scale."""
    ckpt = case("warmup_lr").ckpt
    sched = ckpt.ds_config["scheduler"]
    cases = [
        ({"type": "StepLR", "params": {"step_size": 2}}, "scheduler = 'StepLR': not one of"),
        ({"type": "WarmupLR", "params": {"warmup_steps": 3}}, r"takes no \['warmup_steps'\]"),
        ({"type": "WarmupDecayLR", "params": {}}, r"\['total_num_steps'\] must be set"),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "must be a positive int"),
        ({**sched, "params": {"warmup_num_steps": 4}}, "param group 0 saved lr = 0.01, but"),
    ]
    for bad, pattern in cases:
        reported = []
        with pytest.raises(DeepSpeedSettingError, match=pattern):
            adamw(with_scheduler(ckpt, bad), None, report=reported.append)
        assert reported == []
    early = with_scheduler(ckpt, sched, lr_scheduler={"last_batch_iteration": 0})
    with pytest.raises(DeepSpeedSettingError, match="gives 0.0 at iteration 0"):
        adamw(early, None, report=None)
    fp16 = case("fp16_dynamic").ckpt
    zero = jz.ZeRO(
        adamw(fp16, None, report=None), jz.data_parallel_mesh(2), stage=2, precision="fp16"
    )
    with pytest.raises(
        DeepSpeedSettingError, match="loss_scale=jaxzero.interop.deepspeed.loss_scale"
    ):
        to_train_state(fp16, zero)
