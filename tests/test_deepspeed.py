"""DeepSpeed ZeRO checkpoints in and out (jaxzero.interop.deepspeed), checked against the real
DeepSpeed 0.19.8 fixtures of tests/fixtures/E_deepspeed, against torch.optim.AdamW run here,
and against real DeepSpeed (2 gloo processes on 127.0.0.1) loading what jaxzero writes.

Expected numbers come from the fixtures, torch or DeepSpeed, never from jaxzero.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import missing, require

import jaxzero as jz
from jaxzero.interop.deepspeed import DeepSpeedCheckpointError, read_checkpoint
from jaxzero.interop.deepspeed import pickled as dspickle
from jaxzero.interop.deepspeed.jax_state import adamw, from_train_state, to_train_state
from jaxzero.interop.deepspeed.writer import write_checkpoint
from jaxzero.interop.safe_pickle import UnsafeFileError, load_torch_file

pytestmark = pytest.mark.interop  # torch and DeepSpeed (tests/conftest.py)
torch = require("torch", "torch")

FIXTURES = [
    "z1_mlp_a_ws2_fp32",
    "z2_mlp_a_ws2_fp32",
    "z3_mlp_a_ws2_fp32",
    "z2_mlp_b_ws2_fp32",
    "z3_mlp_b_ws2_fp32",
    "z2_mlp_a_ws2_bf16",
]
FP32 = [f for f in FIXTURES if f.endswith("fp32")]


def fixture(fixtures_dir, name):
    d = os.path.join(fixtures_dir, "E_deepspeed", name)
    if not os.path.isfile(os.path.join(d, "hparams.json")):
        missing(f"fixture case E_deepspeed/{name}", d)
    with open(os.path.join(d, "hparams.json")) as f:
        hp = json.load(f)
    return d, hp, np.load(os.path.join(d, "trajectory.npz"))


# --------------------------------------------------------------------------- (a) reading
def raw_partitions(ckpt_dir, hp):
    """Each param's fp32/exp_avg/exp_avg_sq straight from DeepSpeed's rank files: the simple
    layouts of these fixtures (no alignment padding), concatenated by hand."""
    step = os.path.join(ckpt_dir, "step3")
    prefix = "bf16_" if hp["dtype"] == "bf16" else ""
    ranks = [
        dspickle.load(
            os.path.join(step, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"), "t"
        )["optimizer_state_dict"]
        for r in range(hp["world_size"])
    ]
    out = {}
    shapes = hp["param_shapes"]
    for g, names in enumerate(hp["param_groups"]):
        if hp["zero_stage"] < 3:
            fp32 = torch.cat([o["single_partition_of_fp32_groups"][g] for o in ranks])
            st = [o["base_optimizer_state"]["state"][g] for o in ranks]
            m = torch.cat([s["exp_avg"] for s in st])
            v = torch.cat([s["exp_avg_sq"] for s in st])
            pos = 0
            for n in names:
                k = int(np.prod(shapes[n]))
                out[n] = [
                    t[pos : pos + k].reshape(shapes[n]).detach().numpy() for t in (fp32, m, v)
                ]
                pos += k
        else:
            pos = 0
            for n in names:
                k = int(np.prod(shapes[n]))
                c = -(-k // len(ranks))
                cols = []
                for key in ("fp32", "exp_avg", "exp_avg_sq"):
                    parts = [
                        (
                            o["fp32_flat_groups"][g]
                            if key == "fp32"
                            else o["optimizer_state_dict"]["state"][g][key]
                        )[pos : pos + c]
                        for o in ranks
                    ]
                    cols.append(torch.cat(parts)[:k].reshape(shapes[n]).detach().numpy())
                out[n] = cols
                pos += c
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_deepspeed_fixture_reads_exactly(fixtures_dir, name):
    """Params and moments bitwise == trajectory.npz at k=3 and == the rank files; step 3;
    groups, stage, world size, dtype as in hparams.json; buffers and compute weights."""
    d, hp, traj = fixture(fixtures_dir, name)
    ckpt = read_checkpoint(os.path.join(d, "ckpt"))
    assert ckpt.step == 3 and ckpt.global_steps == 3
    assert (ckpt.zero_stage, ckpt.world_size) == (hp["zero_stage"], hp["world_size"])
    assert ckpt.ds_version == hp["deepspeed_version"] and ckpt.ds_config == hp["ds_config"]
    assert ckpt.dtype == hp["dtype"] and ckpt.optimizer == "FusedAdam"
    assert [g["names"] for g in ckpt.param_groups] == hp["param_groups"]
    for g, wd in zip(ckpt.param_groups, hp["weight_decay_groups"], strict=True):
        assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (
            hp["lr"],
            hp["betas"],
            hp["eps"],
            wd,
        )
    assert sorted(ckpt.params) == sorted(hp["param_names"])
    raw = raw_partitions(os.path.join(d, "ckpt"), hp)
    for n in hp["param_names"]:
        for i, field in enumerate(("params", "exp_avg", "exp_avg_sq")):
            got = getattr(ckpt, field)[n]
            assert got.dtype == np.float32 and got.shape == tuple(hp["param_shapes"][n])
            np.testing.assert_array_equal(got, traj[f"{field}/3/{n}"], err_msg=f"{field} {n}")
            np.testing.assert_array_equal(got, raw[n][i], err_msg=f"raw {field} {n}")
        module = ckpt.module[n]
        assert str(module.dtype) == ("bfloat16" if hp["dtype"] == "bf16" else "float32")
        np.testing.assert_array_equal(module.astype(np.float32), traj[f"module/3/{n}"])
    if hp["model"] == "mlp_b":
        assert list(ckpt.buffers) == ["in_scale"] and ckpt.buffers["in_scale"].shape == (32,)
    else:
        assert ckpt.buffers == {}


def test_deepspeed_reader_and_writer_need_no_deepspeed(fixtures_dir, tmp_path):
    """read_checkpoint and write_checkpoint work where `import deepspeed` fails."""
    d, _, _ = fixture(fixtures_dir, "z3_mlp_b_ws2_fp32")
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from jaxzero.interop.deepspeed import read_checkpoint, write_checkpoint\n"
        f"c = read_checkpoint({os.path.join(d, 'ckpt')!r})\n"
        f"write_checkpoint({str(tmp_path / 'out')!r}, c, stage=2, world_size=2)\n"
        f"b = read_checkpoint({str(tmp_path / 'out')!r})\n"
        "assert 'deepspeed' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
        "print('ok', b.step, b.zero_stage, sorted(b.params) == sorted(c.params))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", "3", "2", "True"]


# --------------------------------------------------------------------------- models
def mlp_a(p, b):
    h = jnp.tanh(b["x"] @ p["fc1.weight"].T + p["fc1.bias"])
    return jnp.mean((h @ p["fc2.weight"].T + p["fc2.bias"] - b["y"]) ** 2)


def mlp_b(p, b, in_scale):
    h = (b["x"] * in_scale) @ p["fc1.weight"].T + p["fc1.bias"]
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-5) * p["ln.weight"] + p["ln.bias"]
    h = jax.nn.gelu(h, approximate=False)
    h = jax.nn.gelu(h @ p["fc2.weight"].T + p["fc2.bias"], approximate=False)
    logits = h @ p["fc3.weight"].T + p["fc3.bias"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, b["y"][:, None], axis=1))


FLAX_B = {
    "fc1.weight": "fc1/kernel",
    "fc1.bias": "fc1/bias",
    "ln.weight": "ln/scale",
    "ln.bias": "ln/bias",
    "fc2.weight": "fc2/kernel",
    "fc2.bias": "fc2/bias",
    "fc3.weight": "fc3/kernel",
    "fc3.bias": "fc3/bias",
}


def flax_template(ckpt):
    tree = {}
    for n, path in FLAX_B.items():
        mod, leaf = path.split("/")
        shape = ckpt.params[n].shape
        tree.setdefault(mod, {})[leaf] = np.zeros(shape[::-1] if leaf == "kernel" else shape)
    return tree


def as_torch_names(p):
    """A Flax-layout mlp_b tree as the torch-layout dict the loss reads."""
    if "fc1.weight" in p:
        return p
    out = {}
    for n, path in FLAX_B.items():
        mod, leaf = path.split("/")
        out[n] = p[mod][leaf].T if leaf == "kernel" else p[mod][leaf]
    return out


def train_step(model, ckpt, zero, state):
    """The jaxzero step; mlp_b reads its buffer from ``state.model_state`` when it is there."""
    if model == "mlp_a":
        return jz.make_train_step(mlp_a, zero)
    if state.model_state is None:
        scale = jnp.asarray(ckpt.buffers["in_scale"])
        return jz.make_train_step(lambda p, b: mlp_b(as_torch_names(p), b, scale), zero)

    def loss(p, ms, b, rng):
        value = mlp_b(as_torch_names(p), b, ms["in_scale"])
        return value, (ms, {"loss": value})

    return jz.make_train_step(loss, zero, stateful=True)


def torch_model(model, ckpt):
    sys.path.insert(0, os.path.dirname(__file__))
    import ds_worker

    m = ds_worker.MlpA() if model == "mlp_a" else ds_worker.MlpB()
    sd = {n: torch.from_numpy(v.copy()) for n, v in {**ckpt.params, **ckpt.buffers}.items()}
    m.load_state_dict(sd)
    return m


def torch_continue(model, ckpt, batches):
    """torch.optim.AdamW continued from the checkpoint's state on ``batches``."""
    m = torch_model(model, ckpt)
    named = dict(m.named_parameters())
    groups = [
        {
            "params": [named[n] for n in g["names"]],
            "lr": g["lr"],
            "betas": g["betas"],
            "eps": g["eps"],
            "weight_decay": g["weight_decay"],
        }
        for g in ckpt.param_groups
    ]
    opt = torch.optim.AdamW(groups)
    for n, p in named.items():
        opt.state[p] = {
            "step": torch.tensor(float(ckpt.step)),
            "exp_avg": torch.from_numpy(ckpt.exp_avg[n].copy()),
            "exp_avg_sq": torch.from_numpy(ckpt.exp_avg_sq[n].copy()),
        }
    loss_fn = (
        torch.nn.functional.mse_loss if model == "mlp_a" else torch.nn.functional.cross_entropy
    )
    for b in batches:
        opt.zero_grad()
        loss_fn(m(torch.from_numpy(b["x"])), torch.from_numpy(b["y"])).backward()
        opt.step()
    return {
        n: [p.detach().numpy(), opt.state[p]["exp_avg"].numpy(), opt.state[p]["exp_avg_sq"].numpy()]
        for n, p in named.items()
    }


def new_batches(model, count, size, seed):
    rng = np.random.default_rng(seed)
    if model == "mlp_a":
        return [
            {
                "x": rng.normal(size=(size, 17)).astype(np.float32),
                "y": rng.normal(size=(size, 5)).astype(np.float32),
            }
            for _ in range(count)
        ]
    return [
        {
            "x": rng.normal(size=(size, 32)).astype(np.float32),
            "y": rng.integers(0, 10, size=(size,)),
        }
        for _ in range(count)
    ]


def zero_for(ckpt, template, stage, n):
    return jz.ZeRO(adamw(ckpt, template), jz.data_parallel_mesh(n), stage=stage)


def compare(state, zero, ref, tol, what):
    back = from_train_state(state, zero)
    for n, (p, m, v) in ref.items():
        np.testing.assert_allclose(back.params[n], p, rtol=0, atol=tol, err_msg=f"{what} {n}")
        np.testing.assert_allclose(back.exp_avg[n], m, rtol=0, atol=tol, err_msg=f"{what} m {n}")
        np.testing.assert_allclose(back.exp_avg_sq[n], v, rtol=0, atol=tol, err_msg=f"{what} v {n}")


# --------------------------------------------------------------------------- (b) import
_STEPS = {}


@pytest.mark.parametrize("name", FP32)
@pytest.mark.parametrize("stage,n", [(2, 8), (3, 2)])
def test_deepspeed_import_then_continue_matches_torch(fixtures_dir, name, stage, n):
    """jaxzero (stage 2 on 8 devices, stage 3 on 2) continued 2 steps from each fp32 fixture
    == torch.optim.AdamW continued from the same state on the same data (1e-6). mlp_b at
    stage 3 uses a Flax layout (transposed kernels, LayerNorm scale) through the name map."""
    d, hp, _ = fixture(fixtures_dir, name)
    ckpt = read_checkpoint(os.path.join(d, "ckpt"))
    model = hp["model"]
    template = flax_template(ckpt) if (model == "mlp_b" and stage == 3) else None
    key = (model, stage, n)  # the fixtures of one model share groups: reuse the compiled step
    if key not in _STEPS:
        _STEPS[key] = zero_for(ckpt, template, stage, n), None
    zero, step = _STEPS[key]
    state = to_train_state(ckpt, zero, template, rng=jax.random.key(0))
    assert int(state.step) == 3
    if model == "mlp_b" and template is None:
        np.testing.assert_array_equal(state.model_state["in_scale"], ckpt.buffers["in_scale"])
    if step is None:
        step = train_step(model, ckpt, zero, state)
        _STEPS[key] = zero, step
    batches = new_batches(model, 2, 16, seed=stage)
    for b in batches:
        state, _ = step(state, b)
    assert int(state.step) == 5
    compare(state, zero, torch_continue(model, ckpt, batches), 1e-6, name)


def test_deepspeed_groups_with_their_own_lr_and_betas(fixtures_dir):
    """Groups that differ in lr/betas/eps (an optax.multi_transform of per-group AdamW) continue
    like torch.optim.AdamW with those groups (1e-6); a tx built for other groups is refused."""
    import dataclasses

    d, _, _ = fixture(fixtures_dir, "z3_mlp_b_ws2_fp32")
    ckpt = read_checkpoint(os.path.join(d, "ckpt"))
    groups = [dict(ckpt.param_groups[0]), dict(ckpt.param_groups[1], lr=3e-3, betas=(0.8, 0.9))]
    ckpt = dataclasses.replace(ckpt, param_groups=groups)
    zero = zero_for(ckpt, None, 2, 4)
    state = to_train_state(ckpt, zero, rng=jax.random.key(0))
    batches = new_batches("mlp_b", 2, 16, seed=3)
    step = train_step("mlp_b", ckpt, zero, state)
    for b in batches:
        state, _ = step(state, b)
    compare(state, zero, torch_continue("mlp_b", ckpt, batches), 1e-6, "multi_transform")
    other = jz.ZeRO(adamw(groups[:1] + [dict(groups[1], lr=1.0)], None), zero.mesh, stage=2)
    with pytest.raises(ValueError, match="group 1: lr=1.0 vs checkpoint 0.003"):
        to_train_state(ckpt, other)


# --------------------------------------------------------------------------- (c) export
def run_deepspeed(jobs, tmp_path, world=2, timeout=400):
    sys.path.insert(0, os.path.dirname(__file__))
    import ds_worker

    ds_worker.launch(jobs, tmp_path, world=world, timeout=timeout)


def test_deepspeed_export_then_continue_in_deepspeed(fixtures_dir, tmp_path):
    """jaxzero states written for ZeRO 1, 2 and 3 at W=2 load into real DeepSpeed (torch
    AdamW), whose next step == jaxzero's next step on the same data (1e-6); zero_to_fp32 on
    the written checkpoints gives jaxzero's weights bitwise. The bf16 fixture written for
    ZeRO 1, 2, 3 loads into a bf16 DeepSpeed job that saves back the same fp32 master, moments
    and bf16 weights, bitwise."""
    require("deepspeed", "torch")
    d, hp, _ = fixture(fixtures_dir, "z2_mlp_b_ws2_fp32")
    ckpt = read_checkpoint(os.path.join(d, "ckpt"))
    first, second = new_batches("mlp_b", 2, 12, seed=7)
    np.savez(
        tmp_path / "data.npz",
        x=second["x"].reshape(1, 2, 6, 32),
        y=second["y"].reshape(1, 2, 6).astype(np.int64),
    )
    jobs, expected = [], {}
    for stage in (1, 2, 3):
        zero = zero_for(ckpt, None, stage, 2)
        state = to_train_state(ckpt, zero, rng=jax.random.key(0))
        step = train_step("mlp_b", ckpt, zero, state)
        state, _ = step(state, first)  # a jaxzero step of its own
        save = str(tmp_path / f"z{stage}")
        cfg = {**hp["ds_config"], "zero_optimization": {"stage": stage}}
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {**cfg["optimizer"]["params"], "torch_adam": True},
        }
        write_checkpoint(save, state, stage=stage, world_size=2, zero=zero, ds_config=cfg)
        expected[stage] = (from_train_state(state, zero), step(state, second)[0], zero)
        jobs.append(
            {
                "model": "mlp_b",
                "config": cfg,
                "load": save,
                "data": str(tmp_path / "data.npz"),
                "steps": 1,
                "out": str(tmp_path / f"after{stage}"),
                "tag": "after",
            }
        )
    bf16 = read_checkpoint(os.path.join(fixture(fixtures_dir, "z2_mlp_a_ws2_bf16")[0], "ckpt"))
    np.savez(tmp_path / "none.npz", x=np.zeros((1, 2, 4, 17), np.float32))
    for stage in (1, 2, 3):
        cfg = {**bf16.ds_config, "zero_optimization": {"stage": stage}}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}}
        write_checkpoint(tmp_path / f"b{stage}", bf16, stage=stage, world_size=2, ds_config=cfg)
        jobs.append(
            {
                "model": "mlp_a",
                "config": cfg,
                "load": str(tmp_path / f"b{stage}"),
                "data": str(tmp_path / "none.npz"),
                "steps": 0,
                "out": str(tmp_path / f"bafter{stage}"),
            }
        )
    jobs.sort(key=lambda j: j["config"]["zero_optimization"]["stage"])
    run_deepspeed(jobs, str(tmp_path))

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for stage in (1, 2, 3):
        back = read_checkpoint(tmp_path / f"bafter{stage}")
        assert (back.step, back.dtype) == (3, "bf16")
        for f in ("params", "exp_avg", "exp_avg_sq", "module"):
            for n, v in getattr(bf16, f).items():
                np.testing.assert_array_equal(getattr(back, f)[n], v, err_msg=f"bf16 {f} {n}")
    for stage, (written, after, zero) in expected.items():
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"z{stage}"))
        for n in written.param_names:
            np.testing.assert_array_equal(fp32[n].detach().numpy(), written.params[n], err_msg=n)
        ds = read_checkpoint(str(tmp_path / f"after{stage}"))
        assert (ds.step, ds.zero_stage, ds.optimizer) == (5, stage, "torch.optim.AdamW")
        ref = {n: [ds.params[n], ds.exp_avg[n], ds.exp_avg_sq[n]] for n in ds.params}
        compare(after, zero, ref, 1e-6, f"stage {stage}")


def test_deepspeed_roundtrip_layouts_without_deepspeed(fixtures_dir, tmp_path):
    """write_checkpoint then read_checkpoint is the identity for every stage at W = 1..5 and
    with round-robin order, parameter alignment and ZeRO-3 sub-groups (bf16 fixture: bf16
    compute weights and the bf16_ file prefix)."""
    for name in ("z2_mlp_b_ws2_fp32", "z2_mlp_a_ws2_bf16"):
        d, _, _ = fixture(fixtures_dir, name)
        ckpt = read_checkpoint(os.path.join(d, "ckpt"))
        for i, (stage, w, zopt) in enumerate(
            [
                (1, 1, {}),
                (2, 3, {"round_robin_gradients": True, "parameter_alignment": True}),
                (1, 5, {}),
                (3, 4, {"sub_group_size": 100}),
                (3, 5, {}),
            ]
        ):
            cfg = {"zero_optimization": {"stage": stage, **zopt}, "gradient_clipping": 0.0}
            save = tmp_path / f"{name}_{i}"
            files = write_checkpoint(save, ckpt, stage=stage, world_size=w, ds_config=cfg)
            optim = [os.path.basename(f) for f in files if f.endswith("optim_states.pt")]
            assert len(optim) == w
            assert all(f.startswith("bf16_") == ("bf16" in name) for f in optim)
            back = read_checkpoint(save)
            assert (back.step, back.zero_stage, back.world_size, back.dtype) == (
                3,
                stage,
                w,
                ckpt.dtype,
            )
            for f in ("params", "exp_avg", "exp_avg_sq", "module", "buffers"):
                for n, v in getattr(ckpt, f).items():
                    np.testing.assert_array_equal(getattr(back, f)[n], v, err_msg=f"{f} {n}")
            assert back.param_groups == [
                {**g, "names": back.param_groups[k]["names"]}
                for k, g in enumerate(ckpt.param_groups)
            ]


# --------------------------------------------------------------------------- (d) bad input
class Marker:
    """Pickles to 'touch this marker file' when unpickled by an unsafe loader."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_deepspeed_refuses_code_in_pickles(fixtures_dir, tmp_path):
    """A file whose pickle would run code (here: create a marker file) is refused with a
    clear error, and the marker is never created, by load_torch_file and read_checkpoint."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"x": Marker(str(marker))}, evil)
    with pytest.raises(UnsafeFileError, match="refused.*allowlist.*nothing from it was executed"):
        load_torch_file(evil)
    d, _, _ = fixture(fixtures_dir, "z2_mlp_a_ws2_fp32")
    save = tmp_path / "ckpt"
    shutil.copytree(os.path.join(d, "ckpt"), save)
    target = save / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copyfile(evil, target)
    with pytest.raises(UnsafeFileError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        read_checkpoint(save)
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the payload is live: an unsafe load runs it
    assert marker.exists()


def damaged(fixtures_dir, tmp_path, name, edit):
    d, _, _ = fixture(fixtures_dir, name)
    save = tmp_path / name
    shutil.copytree(os.path.join(d, "ckpt"), save)
    edit(save / "step3")
    return save


def rewrite(path, change):
    obj = dspickle.load(path, "t")
    change(obj)
    dspickle.save(obj, path)


def set_optimizer(t):
    def change(sd):
        sd["ds_config"]["optimizer"]["type"] = "Lamb"

    rewrite(t / "mp_rank_00_model_states.pt", change)


def sgd_state(t):
    def change(sd):
        st = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        st["momentum_buffer"] = st.pop("exp_avg")

    rewrite(t / "zero_pp_rank_0_mp_rank_00_optim_states.pt", change)


BAD = {
    "rank file missing": (
        "z2_mlp_a_ws2_fp32",
        lambda t: os.remove(t / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        r"zero_pp_rank_1_mp_rank_00_optim_states.pt: no such file.*partial",
    ),
    "truncated file": (
        "z3_mlp_a_ws2_fp32",
        lambda t: open(t / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "r+b").truncate(4000),
        r"zero_pp_rank_0_mp_rank_00_optim_states.pt.*damaged",
    ),
    "model parallel": (
        "z2_mlp_a_ws2_fp32",
        lambda t: rewrite(t / "mp_rank_00_model_states.pt", lambda sd: sd.update(mp_world_size=2)),
        r"mp_rank_00_model_states.pt: model/pipeline parallelism",
    ),
    "pipeline files": (
        "z2_mlp_a_ws2_fp32",
        lambda t: shutil.copyfile(
            t / "mp_rank_00_model_states.pt", t / "layer_01-model_00-model_states.pt"
        ),
        r"pipeline-parallel",
    ),
    "other optimizer": (
        "z2_mlp_a_ws2_fp32",
        set_optimizer,
        r"optim_states.pt: optimizer type 'Lamb' is not supported",
    ),
    "sgd state": (
        "z2_mlp_a_ws2_fp32",
        sgd_state,
        r"zero_pp_rank_0.*expected AdamW's \['exp_avg', 'exp_avg_sq', 'step'\]",
    ),
    "shapes do not match": (
        "z2_mlp_b_ws2_fp32",
        lambda t: rewrite(
            t / "mp_rank_00_model_states.pt", lambda sd: sd["param_shapes"][0].popitem()
        ),
        r"step3/zero_pp_rank_0_mp_rank_00_optim_states.pt: group 0: param_alignment_paddings lists "
        r"3 params but param_shapes has 2",
    ),
    "no latest": (
        "z2_mlp_a_ws2_fp32",
        lambda t: os.remove(t.parent / "latest"),
        r"latest: no such file; pass tag=",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_deepspeed_bad_checkpoint_errors(fixtures_dir, tmp_path, kind):
    """Each damaged / partial / unsupported checkpoint fails naming the file and the fault."""
    name, edit, pattern = BAD[kind]
    save = damaged(fixtures_dir, tmp_path, name, edit)
    with pytest.raises(DeepSpeedCheckpointError, match=pattern):
        read_checkpoint(save)


def test_deepspeed_cli_roundtrip(fixtures_dir, tmp_path, capsys):
    """convert deepspeed2jax then jax2deepspeed through the argparse side gives back the
    DeepSpeed checkpoint's arrays bitwise, for another stage and world size."""
    from jaxzero import cli

    d, _, _ = fixture(fixtures_dir, "z3_mlp_b_ws2_fp32")
    name_map = tmp_path / "map.json"
    name_map.write_text(json.dumps(FLAX_B))
    args = [
        "convert",
        "deepspeed2jax",
        os.path.join(d, "ckpt"),
        "--out",
        str(tmp_path / "orbax"),
        "--stage",
        "1",
        "--devices",
        "4",
        "--name-map",
        str(name_map),
    ]
    assert cli.main(args) == 0
    assert "DeepSpeed ZeRO-3 x2 <-> jaxzero stage 1 on 4 devices; step 3" in capsys.readouterr().out
    args = [
        "convert",
        "jax2deepspeed",
        str(tmp_path / "orbax"),
        "--out",
        str(tmp_path / "ds"),
        "--stage",
        "2",
        "--world-size",
        "3",
    ]
    assert cli.main(args) == 0
    src, back = read_checkpoint(os.path.join(d, "ckpt")), read_checkpoint(tmp_path / "ds")
    assert (back.zero_stage, back.world_size, back.step) == (2, 3, 3)
    for f in ("params", "exp_avg", "exp_avg_sq", "buffers"):
        for n, v in getattr(src, f).items():
            np.testing.assert_array_equal(getattr(back, f)[n], v, err_msg=f"{f} {n}")
    with pytest.raises(SystemExit):
        cli.main(["convert", "deepspeed2jax", str(tmp_path / "nope"), "--dry-run"])
    assert "nope: no such directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- (a') more layouts
TINY = [
    {"names": ["fc1.weight", "fc1.bias", "fc2.weight"], "weight_decay": 0.1},
    {"names": ["fc2.bias"], "weight_decay": 0.0},
]
LAYOUTS = {  # name: (stage, zero_optimization extras, bf16, BF16_Optimizer, groups)
    "rr_align": (
        2,
        {"round_robin_gradients": True, "parameter_alignment": True},
        False,
        False,
        None,
    ),
    "padding_rank_z1": (1, {}, False, False, TINY),
    "padding_rank_rr_align_z2": (
        2,
        {"round_robin_gradients": True, "parameter_alignment": True},
        False,
        False,
        TINY,
    ),
    "z3_sub_groups": (3, {"sub_group_size": 100}, False, False, TINY),
    "bf16_rr_align": (
        2,
        {"round_robin_gradients": True, "parameter_alignment": True},
        True,
        False,
        TINY,
    ),
    "bf16_optimizer": (1, {}, True, True, TINY),
    "client_adamw_z3": (3, {}, False, False, TINY),
}


def torch_reference(groups, data, world):
    """Plain torch.optim.AdamW on the worker's model and data (mean of the ranks' grads)."""
    sys.path.insert(0, os.path.dirname(__file__))
    import ds_worker

    torch.manual_seed(0)
    m = ds_worker.MlpA()
    opt = torch.optim.AdamW(ds_worker.groups(m, "mlp_a", groups), lr=1e-2, betas=(0.9, 0.95))
    for s in range(data["x"].shape[0]):
        opt.zero_grad()
        for r in range(world):
            out = m(torch.from_numpy(data["x"][s, r]))
            (
                torch.nn.functional.mse_loss(out, torch.from_numpy(data["y"][s, r])) / world
            ).backward()
        opt.step()
    return {
        n: [p.detach().numpy(), opt.state[p]["exp_avg"].numpy(), opt.state[p]["exp_avg_sq"].numpy()]
        for n, p in m.named_parameters()
    }


@pytest.mark.slow
def test_deepspeed_reads_more_real_layouts(fixtures_dir, tmp_path):
    """Real DeepSpeed at W=4 (torch AdamW inside ZeRO): round-robin order with parameter
    alignment, ranks that own only padding, ZeRO-3 sub-groups, bf16 and BF16_Optimizer. fp32
    runs (one with a client torch AdamW, no "optimizer" in the config) == torch.optim.AdamW
    (1e-6) and zero_to_fp32 (bitwise); bf16 runs: the bf16 module
    == bf16(master) bitwise, zero_to_fp32 bitwise where it reads them, and within bf16 noise
    of the fp32 reference."""
    require("deepspeed", "torch")
    d, hp, _ = fixture(fixtures_dir, "z2_mlp_a_ws2_fp32")
    world, rng = 4, np.random.default_rng(1)
    data = {
        "x": rng.normal(size=(3, world, 4, 17)).astype(np.float32),
        "y": rng.normal(size=(3, world, 4, 5)).astype(np.float32),
    }
    np.savez(tmp_path / "data.npz", **data)
    jobs = []
    for name, (stage, zopt, bf16, bf16_opt, groups) in LAYOUTS.items():
        cfg = {
            **hp["ds_config"],
            "train_micro_batch_size_per_gpu": 4,
            "train_batch_size": 16,
            "zero_optimization": {"stage": stage, **zopt},
            "bf16": {"enabled": bf16},
        }
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {**cfg["optimizer"]["params"], "torch_adam": True},
        }
        if bf16_opt:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        client = {}
        if name.startswith("client"):
            client = {"client_adamw": {"lr": 1e-2, "betas": [0.9, 0.95]}}
            del cfg["optimizer"]
        jobs.append(
            {
                "model": "mlp_a",
                "config": cfg,
                "data": str(tmp_path / "data.npz"),
                "steps": 3,
                "out": str(tmp_path / name),
                "tag": "t3",
                **({"groups": groups} if groups else {}),
                **client,
            }
        )
    jobs.sort(key=lambda j: j["config"]["zero_optimization"]["stage"])  # ZeRO 3 patches F.linear
    run_deepspeed(jobs, str(tmp_path), world=world)

    import ml_dtypes
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for name, (stage, _, bf16, bf16_opt, groups) in LAYOUTS.items():
        ckpt = read_checkpoint(tmp_path / name)
        assert (ckpt.zero_stage, ckpt.world_size, ckpt.step) == (stage, world, 3), name
        assert ckpt.optimizer == "torch.optim.AdamW" and ckpt.dtype == ("bf16" if bf16 else "fp32")
        ref = torch_reference(groups, data, world)
        if not bf16_opt:
            fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / name))
            for n in ref:
                np.testing.assert_array_equal(
                    ckpt.params[n], fp32[n].detach().numpy(), err_msg=name
                )
        for n, (p, m, v) in ref.items():
            tol = 0.1 * np.abs(p).max() if bf16 else 1e-6
            np.testing.assert_allclose(ckpt.params[n], p, rtol=0, atol=tol, err_msg=f"{name} {n}")
            for got, want in ((ckpt.exp_avg[n], m), (ckpt.exp_avg_sq[n], v)):
                tol = 0.1 * np.abs(want).max() if bf16 else 1e-6
                np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=f"{name} {n}")
            if bf16:
                want = ckpt.params[n].astype(ml_dtypes.bfloat16)
                np.testing.assert_array_equal(ckpt.module[n], want, err_msg=f"{name} module {n}")


def test_deepspeed_bf16_round_trip_through_stage3_without_compute_copy(fixtures_dir):
    """The bf16 fixture imported into stage 3 with ``Precision(compute_copy=False)`` (FSDP's
    layout: ``state.params`` holds the fp32 master, no bf16 copy) and exported back: fp32
    master, moments and the bf16 module weights equal DeepSpeed's own bit for bit (the
    module's dtype comes from the ZeRO's compute dtype, not from ``state.params``)."""
    d, _, _ = fixture(fixtures_dir, "z2_mlp_a_ws2_bf16")
    ckpt = read_checkpoint(os.path.join(d, "ckpt"))
    pol = jz.Precision.create("bf16", compute_copy=False)
    zero = jz.ZeRO(adamw(ckpt, None), jz.data_parallel_mesh(2), stage=3, precision=pol)
    state = to_train_state(ckpt, zero, rng=jax.random.key(0))
    assert state.master is None
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(np.float32)}
    back = from_train_state(state, zero)
    assert back.dtype == "bf16"
    for f in ("params", "exp_avg", "exp_avg_sq", "module"):
        for n, v in getattr(ckpt, f).items():
            np.testing.assert_array_equal(getattr(back, f)[n], v, err_msg=f"{f} {n}")
