"""The update a DeepSpeed run applies, reproduced by ``jaxzero.interop.deepspeed.adamw``.

Real DeepSpeed 0.19.8 runs whose ds_config leaves ``gradient_clipping`` out (DeepSpeed then
clips at global norm 1.0), ZeRO 1, 2 and 3, saved after step 3 and trained on to step 5
(``tests/fixtures/deepspeed_default_clipping``, made by ``tests/make_ds_fixture.py``), are
continued in jaxzero on 8 devices and compared with DeepSpeed's own steps 4 and 5. Settings
jaxzero cannot reproduce are refused by name; ``write_checkpoint`` records the clipping.
"""

import dataclasses
import json
import os
import sys

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
    jax_to_deepspeed,
    read_checkpoint,
    to_train_state,
    write_checkpoint,
)

pytestmark = pytest.mark.interop  # torch and DeepSpeed (tests/conftest.py)
torch = require("torch", "torch")

FIXTURE = os.path.join(FIXTURES, "deepspeed_default_clipping")
DEFAULT_LINE = (
    "gradient_clipping = 1.0 (DeepSpeed default, key absent): optax.clip_by_global_norm(1) on "
    "the averaged gradient, before AdamW"
)


def run_dir(stage):
    d = os.path.join(FIXTURE, f"z{stage}")
    if not os.path.isfile(os.path.join(d, "losses.json")):
        missing(f"fixture case deepspeed_default_clipping/z{stage}", d)
    with open(os.path.join(d, "losses.json")) as f:
        info = json.load(f)
    return d, info, np.load(os.path.join(d, "trajectory.npz"))


def ds_ckpt(stage):
    return read_checkpoint(os.path.join(run_dir(stage)[0], "ckpt"))


def mlp_c(p, b):
    """tests/ds_worker.py's MlpC (Linear(32, 64), tanh, Linear(64, 16)) with its MSE loss."""
    h = jnp.tanh(b["x"] @ p["fc1.weight"].T + p["fc1.bias"])
    return jnp.mean((h @ p["fc2.weight"].T + p["fc2.bias"] - b["y"]) ** 2)


def batch(k):
    """Step k+1's global batch: both ranks' examples (DeepSpeed averages the ranks' means)."""
    data = np.load(os.path.join(FIXTURE, "data.npz"))
    return {"x": data["x"][k].reshape(-1, 32), "y": data["y"][k].reshape(-1, 16)}


def continue_run(ckpt, tx, stage):
    """jaxzero at ``stage`` on 8 devices, from the step-3 checkpoint through steps 4 and 5:
    ``[(params, grad_norm)]`` after each."""
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(8), stage=stage)
    state = to_train_state(ckpt, zero)
    step = jz.make_train_step(mlp_c, zero)
    out = []
    for k in (3, 4):
        state, metrics = step(state, batch(k))
        out.append((jax.device_get(state.params), float(metrics["grad_norm"])))
    return out


def max_diff(params, traj, k):
    return max(
        float(np.abs(np.asarray(v) - traj[f"params/{k}/{n}"]).max()) for n, v in params.items()
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_default_clipping_continues_like_deepspeed(stage):
    """A DeepSpeed run whose config leaves gradient_clipping out (every gradient norm above 1,
    so DeepSpeed clips at its default 1.0), continued 2 steps by jaxzero at the same stage on 8
    devices with ``adamw(ckpt)``: the params equal DeepSpeed's own steps 4 and 5 within 1e-6,
    and jaxzero's gradient norms DeepSpeed's. ``adamw`` says it reproduced the default."""
    _, info, traj = run_dir(stage)
    assert min(info["grad_norms"]) > 1.0, info["grad_norms"]  # the clipping acts on every step
    ckpt = ds_ckpt(stage)
    assert "gradient_clipping" not in ckpt.ds_config
    assert ckpt.gradient_clipping == (None if stage == 3 else 1.0)  # ZeRO 1/2 files record it
    reported = []
    tx = adamw(ckpt, None, report=reported.append)
    assert len(reported) == 1 and DEFAULT_LINE in reported[0].splitlines()
    for k, (params, norm) in zip((4, 5), continue_run(ckpt, tx, stage), strict=True):
        np.testing.assert_allclose(norm, info["grad_norms"][k - 1], rtol=1e-6)
        for n, want in ((n, traj[f"params/{k}/{n}"]) for n in ckpt.param_names):
            # DeepSpeed's params from the fixture: torch's Adam rounds in its own order
            np.testing.assert_allclose(params[n], want, rtol=0, atol=1e-6, err_msg=f"{k} {n}")


def test_deepspeed_continuation_without_the_clipping_drifts():
    """The same continuation with plain AdamW (what ``adamw`` built before it read
    gradient_clipping) is more than 1e-4 from DeepSpeed's params after 2 steps (measured 8.3e-3),
    so the test above fails without the clipping."""
    _, _, traj = run_dir(2)
    ckpt = ds_ckpt(2)
    decay = {n: n.endswith("weight") for n in ckpt.param_names}
    plain = optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay)
    (_, _), (params, _) = continue_run(ckpt, plain, 2)
    assert max_diff(params, traj, 5) > 1e-4


# --------------------------------------------------------------------------- refusals
def with_config(ckpt, **changes):
    return dataclasses.replace(ckpt, ds_config={**ckpt.ds_config, **changes})


REFUSED = {  # allow= key: (stage, edit, message)
    "fp16": (
        2,
        lambda c: with_config(c, fp16={"enabled": True, "fp16_master_weights_and_grads": True}),
        r"fp16 = 'fp16_master_weights_and_grads': the master weights and gradients are fp16",
    ),
    "scheduler": (
        2,
        lambda c: with_config(c, scheduler={"type": "StepLR", "params": {"step_size": 2}}),
        r"scheduler = 'StepLR': not one of DeepSpeed's own schedulers",
    ),
    "lr_scheduler": (
        2,
        lambda c: dataclasses.replace(c, lr_scheduler={"last_epoch": 3}),
        r"lr_scheduler = 'client scheduler'",
    ),
    "gradient_allreduce_op": (
        2,
        lambda c: with_config(c, gradient_allreduce_op="sum"),
        r"gradient_allreduce_op = 'sum': DeepSpeed sums the ranks' gradients",
    ),
    "gradient_predivide_factor": (
        3,
        lambda c: with_config(c, gradient_predivide_factor=2.0),  # == the world size
        r"gradient_predivide_factor = 2.0: DeepSpeed 0.19.8's ZeRO-3 divides",
    ),
    "zero_optimization.zenflow": (
        2,
        lambda c: with_config(c, zero_optimization={"stage": 2, "zenflow": {"topk_ratio": 0.1}}),
        r"zero_optimization.zenflow = 'enabled'",
    ),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_deepspeed_setting_not_reproduced_is_refused_by_name(key):
    """Each setting that changes the update and that the chain does not reproduce is refused
    with DeepSpeedSettingError naming it, before anything is built or reported; ``allow=[key]``
    accepts it and reports it as not reproduced."""
    stage, edit, pattern = REFUSED[key]
    bad = edit(ds_ckpt(stage))
    reported = []
    with pytest.raises(DeepSpeedSettingError, match=pattern) as err:
        adamw(bad, None, report=reported.append)
    assert reported == [] and f"allow=['{key}']" in str(err.value)
    adamw(bad, None, allow=[key], report=reported.append)
    assert f"{key}" in reported[0] and "NOT reproduced (allowed by the caller)" in reported[0]


def test_deepspeed_settings_misuse_and_no_effect_settings():
    """A gradient_clipping that is not a number, and ``allow`` entries that name nothing to
    allow, are errors; settings that do not change the update are accepted and reported so."""
    ckpt = ds_ckpt(2)
    with pytest.raises(DeepSpeedSettingError, match=r"ds_config\['gradient_clipping'\] = 'auto'"):
        adamw(with_config(ckpt, gradient_clipping="auto"), None, report=None)
    with pytest.raises(ValueError, match=r"allow=\['scheduler'\]: the config does not set"):
        adamw(ckpt, None, allow=["scheduler"], report=None)
    with pytest.raises(ValueError, match=r"allow=\['gradient_clipping'\]: only"):
        adamw(ckpt, None, allow=["gradient_clipping"], report=None)
    reported = []
    fine = with_config(ckpt, prescale_gradients=True, gradient_predivide_factor=4.0)
    adamw(fine, None, report=reported.append)
    assert "prescale_gradients = True (set): no effect on the update" in reported[0]
    z3 = with_config(ds_ckpt(3), gradient_allreduce_op="sum")
    adamw(z3, None, report=reported.append)
    assert "(ZeRO-3 averages whatever this says)" in reported[1]
    adamw(ckpt.param_groups, None, ds_config={}, report=reported.append)  # a bare config
    assert DEFAULT_LINE in reported[2].splitlines()


# --------------------------------------------------------------------------- the way back
def test_deepspeed_write_records_or_checks_the_clipping(tmp_path):
    """``write_checkpoint`` of a state whose chain ``adamw`` built records the chain's clipping
    (ds_config and the ZeRO 1/2 files' clip_grad, which DeepSpeed continues with); a config
    that clips otherwise is refused before anything is written; a chain built elsewhere needs
    the config to say; ``to_train_state`` refuses a chain that clips otherwise than the run."""
    ckpt = ds_ckpt(2)
    mesh = jz.data_parallel_mesh(2)
    zero = jz.ZeRO(adamw(ckpt, None, report=None), mesh, stage=2)
    state = to_train_state(ckpt, zero)
    write_checkpoint(tmp_path / "a", state, stage=2, world_size=2, zero=zero)
    back = read_checkpoint(tmp_path / "a")
    assert back.ds_config["gradient_clipping"] == 1.0 and back.gradient_clipping == 1.0
    cfg = {k: v for k, v in ckpt.ds_config.items()}  # no gradient_clipping: DeepSpeed's 1.0
    write_checkpoint(tmp_path / "b", state, stage=2, world_size=2, zero=zero, ds_config=cfg)
    assert read_checkpoint(tmp_path / "b").gradient_clipping == 1.0
    off = {**cfg, "gradient_clipping": 0.0}
    with pytest.raises(DeepSpeedSettingError, match=r"sets gradient_clipping = 0.0, but zero.tx"):
        write_checkpoint(tmp_path / "c", state, stage=2, world_size=2, zero=zero, ds_config=off)
    assert not (tmp_path / "c").exists()

    unclipped = jz.ZeRO(adamw(ckpt.param_groups, None, report=None), mesh, stage=2)
    with pytest.raises(DeepSpeedSettingError, match="zero.tx clips gradients at no norm but"):
        to_train_state(ckpt, unclipped)
    state0 = to_train_state(dataclasses.replace(ckpt, gradient_clipping=0.0), unclipped)
    with pytest.raises(DeepSpeedSettingError, match="leaves gradient_clipping out, so Deep"):
        write_checkpoint(
            tmp_path / "d", state0, stage=2, world_size=2, zero=unclipped, ds_config=cfg
        )

    elsewhere = jz.ZeRO(optax.adamw(1e-2, b1=0.9, b2=0.95), mesh, stage=2)
    state1 = to_train_state(ckpt, elsewhere)
    kw = dict(stage=2, world_size=2, zero=elsewhere, param_groups=ckpt.param_groups)
    with pytest.raises(DeepSpeedSettingError, match="cannot tell whether the optimizer clips"):
        write_checkpoint(tmp_path / "e", state1, **kw)
    write_checkpoint(tmp_path / "f", state1, **kw, ds_config={**cfg, "gradient_clipping": 0.5})
    assert read_checkpoint(tmp_path / "f").gradient_clipping == 0.5


def test_deepspeed_convert_round_trip_keeps_the_clipping(tmp_path):
    """``deepspeed2jax`` lists the reproduced settings in its summary and records the
    clipping; ``jax2deepspeed`` rebuilds the same chain (the Orbax state restores) and writes
    it back: gradient_clipping 1.0 in the config and the files, arrays bitwise."""
    src = os.path.join(run_dir(2)[0], "ckpt")
    res = deepspeed_to_jax(src, tmp_path / "jz", stage=2, devices=8)
    assert f"update: {DEFAULT_LINE}" in res.summary().splitlines()
    jax_to_deepspeed(tmp_path / "jz", tmp_path / "back", stage=3, world_size=2, devices=8)
    a, b = read_checkpoint(src), read_checkpoint(tmp_path / "back")
    assert b.ds_config["gradient_clipping"] == 1.0 and b.zero_stage == 3
    for f in ("params", "exp_avg", "exp_avg_sq"):
        for n, v in getattr(a, f).items():
            np.testing.assert_array_equal(getattr(b, f)[n], v, err_msg=f"{f} {n}")


def test_deepspeed_continues_a_written_checkpoint_with_the_clipping(tmp_path):
    """jaxzero's step 4 from the ZeRO-2 run, written for ZeRO 2 at W=2 with the recorded
    clipping, loads into real DeepSpeed (the run's own config, no gradient_clipping key), whose
    step 5 equals DeepSpeed's uninterrupted step 5 within 1e-6."""
    require("deepspeed", "torch")
    sys.path.insert(0, os.path.dirname(__file__))
    import ds_worker

    _, _, traj = run_dir(2)
    ckpt = ds_ckpt(2)
    zero = jz.ZeRO(adamw(ckpt, None, report=None), jz.data_parallel_mesh(8), stage=2)
    state, _ = jz.make_train_step(mlp_c, zero)(to_train_state(ckpt, zero), batch(3))
    write_checkpoint(tmp_path / "jz4", state, stage=2, world_size=2, zero=zero)
    data = np.load(os.path.join(FIXTURE, "data.npz"))
    np.savez(tmp_path / "step5.npz", x=data["x"][4:5], y=data["y"][4:5])
    with open(os.path.join(FIXTURE, "config.json")) as f:
        setup = json.load(f)
    job = {
        "model": "mlp_c",
        "config": setup["ds_config"]["2"],
        "groups": setup["groups"],
        "load": str(tmp_path / "jz4"),
        "data": str(tmp_path / "step5.npz"),
        "steps": 1,
        "out": str(tmp_path / "ds5"),
    }
    ds_worker.launch([job], str(tmp_path))
    after = read_checkpoint(tmp_path / "ds5")
    assert after.step == 5 and after.gradient_clipping == 1.0
    assert max_diff(after.params, traj, 5) < 1e-6


def test_deepspeed_chain_without_clipping_keeps_its_structure():
    """Without clipping the chain's state has the structure ``adamw`` gave before it read the
    clipping (flat ``chain(scale_by_adam, masked decay, lr)``), so earlier jaxzero checkpoints
    of it restore; with clipping one empty clip state comes first."""
    ckpt = ds_ckpt(2)
    params = {n: jnp.zeros(v.shape) for n, v in ckpt.params.items()}
    decay = {n: n.endswith("weight") for n in params}
    parts = [
        optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
        optax.add_decayed_weights(0.1, mask=decay),
        optax.scale_by_learning_rate(1e-2),
    ]
    unclipped = adamw(ckpt.param_groups, None, report=None)
    clipped = adamw(ckpt, None, report=None)
    structure = lambda tx: jax.tree.structure(tx.init(params))
    assert structure(unclipped) == structure(optax.chain(*parts))
    assert structure(clipped) == structure(optax.chain(optax.clip_by_global_norm(1.0), *parts))
