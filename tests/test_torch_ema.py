"""ShardedEMA against the real-PyTorch EMA fixtures, and EMA checkpoint interop.

* C_dist_modelema (thb1314/distributed_modelema, both bucket modes): the decay sequence, the
  EMA after 1, 5 and 20 updates, and ``ema.state_dict()`` files imported into an EmaState and
  exported back.
* D_ultralytics_ema (ultralytics 8.4.190 / YOLOv5): the decay sequence and the EMA after
  every one of 30 updates; ultralytics-style ``{"ema": module, "updates": n}`` checkpoints,
  with BatchNorm ``num_batches_tracked`` left out of the average and frozen on export.

``ShardedEMA(torch_compatible=True)`` must be bit-exact against torch's float32
``v *= d; v += (1 - d) * m``; every other path within 5e-7 of a float64 EMA. Expected numbers
come from the fixtures (or from numpy using the fixtures' float64 decays), never from jaxzero.
"""

import collections
import copy
import glob
import json
import os

import jax
import numpy as np
import optax
import pytest
from conftest import FIXTURES, fixture_case, missing, require

import jaxzero as jz
from jaxzero.interop import torch as ti

pytestmark = pytest.mark.interop  # torch and DeepSpeed (tests/conftest.py)
torch = require("torch", "torch")

ROOT = FIXTURES
# The cases shipped in tests/fixtures, named here so that a missing one fails its test.
C_CASES = ["mlp_ws2_bucket0", "mlp_ws2_bucket1"]
D_CASES = ["mlp_d0.9999_tau2000", "mlp_d0.9_tau1"]
D_MANIFEST = os.path.join(ROOT, "D_ultralytics_ema", "manifest.json")


def _json(path):
    if not os.path.isfile(path):
        missing("fixture file", path)
    with open(path) as f:
        return json.load(f)


def test_every_shipped_ema_case_is_tested():
    c = glob.glob(os.path.join(ROOT, "C_dist_modelema", "*", "manifest.json"))
    assert sorted(os.path.basename(os.path.dirname(p)) for p in c) == C_CASES
    assert sorted(_json(D_MANIFEST)["cases"]) == D_CASES


F64_ATOL = 5e-7


def c_case(case):
    d, man = fixture_case(ROOT, "C_dist_modelema", case)
    traj = np.load(os.path.join(ROOT, "C_dist_modelema", f"{man['model']}_trajectory.npz"))
    return d, man, traj


def states(traj, keys, steps):
    return [{k: traj[f"step{t}/{k}"] for k in keys} for t in steps]


def float64_ema(trajectory, decays):
    """numpy float64 EMA: ema = d * ema + (1 - d) * x, one entry per update."""
    ema = {k: v.astype(np.float64) for k, v in trajectory[0].items()}
    out = []
    for x, d in zip(trajectory[1:], decays, strict=True):
        ema = {k: d * ema[k] + (1.0 - d) * x[k].astype(np.float64) for k in ema}
        out.append(ema)
    return out


def fma_contracted(e, x, d):
    """What an FMA-contracting compiler makes of float32 ``e*d + x*(1-d)``:
    round(e*f32(d) + round(x*f32(1-d))) with one rounding for the fused part."""
    b = x * np.float32(1.0 - d)
    return (e.astype(np.float64) * np.float64(np.float32(d)) + b.astype(np.float64)).astype(
        np.float32
    )


def run(ema, trajectory, *, jit):
    """ShardedEMA from trajectory[0] updated toward each later state; returns every EmaState."""
    update = jax.jit(ema.update) if jit else ema.update
    state, out = ema.init(trajectory[0]), []
    for x in trajectory[1:]:
        state = update(state, x)
        out.append(state)
    return out


def assert_bit_equal(got, want, what):
    bad = {k: int(np.sum(np.asarray(got[k]) != want[k])) for k in want}
    assert not any(bad.values()), f"{what}: elements differing per key {bad}"


def assert_close(got, want, atol, what):
    err = max(float(np.max(np.abs(np.asarray(got[k], np.float64) - want[k]))) for k in want)
    assert err <= atol, f"{what}: max abs diff {err:.3g} > {atol}"


def check_jitted_bit_exact(got_per_update, trajectory, decays, expected, what):
    """Bit-exact; on failure, show whether the jitted result is exactly the FMA-contracted
    float32 formula (XLA's CPU backend fuses the multiply-add; see jaxzero/ema.py)."""
    mismatch = [
        i
        for i, want in expected.items()
        if any(np.any(np.asarray(got_per_update[i - 1].ema[k]) != want[k]) for k in want)
    ]
    if not mismatch:
        return
    e = dict(trajectory[0])
    for i, (x, d) in enumerate(zip(trajectory[1:], decays, strict=True), start=1):
        e = {k: fma_contracted(e[k], x[k], d) for k in e}
        assert_bit_equal(got_per_update[i - 1].ema, e, f"{what}: FMA emulation, update {i}")
    raise AssertionError(
        f"{what}: jitted torch_compatible update is not bit-exact at updates {mismatch}: XLA "
        "contracted e*d + x*(1-d) into fma(e, d, x*(1-d)) (reproduced exactly in numpy); "
        "the per-element selects in ShardedEMA.update must keep the products rounded"
    )


# --------------------------------------------------------------------------- C: ModelEMA
@pytest.mark.parametrize("cfg", ["default", "warm"])
@pytest.mark.parametrize("case", C_CASES)
def test_dist_modelema_decays_and_values(case, cfg):
    d, man, traj = c_case(case)
    c = man["configs"][cfg]
    keys = c["ema_keys_order"]
    assert not set(c["no_need_ema_keys"]) & set(keys)  # num_batches_tracked never averaged
    ema = jz.ShardedEMA(
        c["decay"], tau=c["tau"], updates0=c["initial_updates"], torch_compatible=True
    )
    n0 = c["initial_updates"]
    decays = c["decay_used_per_update"]
    assert [ema.decay_at_f64(n0 + i) for i in range(1, len(decays) + 1)] == decays

    snaps = np.load(os.path.join(d, f"ema_{cfg}.npz"))
    trajectory = states(traj, keys, range(len(decays) + 1))
    expected = {i: {k: snaps[f"update{i}/{k}"] for k in keys} for i in man["snapshots"]}
    eager = run(ema, trajectory, jit=False)
    f64 = float64_ema(trajectory, decays)
    for i, want in expected.items():
        assert int(eager[i - 1].updates) == n0 + i
        assert_bit_equal(eager[i - 1].ema, want, f"{case}/{cfg} update {i}")
        assert_close(want, f64[i - 1], 3.3e-7, "fixture vs float64")
        assert_close(eager[i - 1].ema, f64[i - 1], F64_ATOL, "eager vs float64")
    plain = run(jz.ShardedEMA(c["decay"], tau=c["tau"], updates0=n0), trajectory, jit=True)
    for i in expected:
        assert_close(plain[i - 1].ema, f64[i - 1], F64_ATOL, f"torch_compatible=False update {i}")
    jitted = run(ema, trajectory, jit=True)
    for i in expected:
        assert_close(jitted[i - 1].ema, f64[i - 1], F64_ATOL, f"jitted update {i}")
    check_jitted_bit_exact(jitted, trajectory, decays, expected, f"{case}/{cfg}")


@pytest.mark.parametrize("case", C_CASES)
def test_dist_modelema_state_dict_import_export_roundtrip(case, tmp_path):
    """Every rank's ``ema.state_dict()`` file imports into an EmaState (values bit-equal to
    the snapshot after 20 updates, ``updates`` restored) and exports back to a file that
    torch.load reads as the same ``{"param": OrderedDict, "updates": n}``."""
    d, man, traj = c_case(case)
    for cfg, c in man["configs"].items():
        keys = c["ema_keys_order"]
        snaps = np.load(os.path.join(d, f"ema_{cfg}.npz"))
        target = jz.ShardedEMA(c["decay"], tau=c["tau"]).init(states(traj, keys, [0])[0])
        for r in range(man["world_size"]):
            path = os.path.join(d, f"ema_state_dict_{cfg}_rank{r}.pt")
            original = torch.load(path, weights_only=True)
            state = ti.import_ema(target, path)
            assert int(state.updates) == c["updates_after"] == original["updates"]
            assert_bit_equal(state.ema, {k: snaps[f"update20/{k}"] for k in keys}, path)
            out = ti.export_ema(state, name_map=original["param"])
            torch.save(out, tmp_path / "ema.pt")
            back = torch.load(tmp_path / "ema.pt", weights_only=True)
            assert type(back) is dict and list(back) == ["param", "updates"]
            assert isinstance(back["param"], collections.OrderedDict)
            assert list(back["param"]) == list(original["param"]) == keys
            assert back["updates"] == original["updates"]
            for k, v in original["param"].items():
                assert back["param"][k].dtype == v.dtype and torch.equal(back["param"][k], v), k


@pytest.mark.parametrize("case", C_CASES[:1])
def test_imported_modelema_continues_like_torch(case):
    """A ModelEMA checkpoint taken after 5 updates, imported (counter and values) and
    continued by ShardedEMA, reaches the torch EMA after 20 updates bit for bit; on a ZeRO
    mesh the imported leaves keep the EMA's shardings."""
    d, man, traj = c_case(case)
    for cfg, c in man["configs"].items():
        keys = c["ema_keys_order"]
        snaps = np.load(os.path.join(d, f"ema_{cfg}.npz"))
        ckpt = {
            "param": collections.OrderedDict(
                (k, torch.from_numpy(snaps[f"update5/{k}"])) for k in keys
            ),
            "updates": c["initial_updates"] + 5,
        }
        ema = jz.ShardedEMA(c["decay"], tau=c["tau"], torch_compatible=True)
        state = ti.import_ema(ema.init(states(traj, keys, [0])[0]), ckpt)
        for x in states(traj, keys, range(6, 21)):
            state = ema.update(state, x)
        assert int(state.updates) == c["updates_after"]
        assert_bit_equal(state.ema, {k: snaps[f"update20/{k}"] for k in keys}, cfg)

    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(2), stage=2)
    params = states(traj, keys, [0])[0]
    sharded = zero.init(params, ema=jz.ShardedEMA(0.999, tau=2000)).ema
    path = os.path.join(d, "ema_state_dict_default_rank0.pt")
    state = ti.import_ema(sharded, path)
    for got, old in zip(jax.tree.leaves(state), jax.tree.leaves(sharded), strict=True):
        assert got.sharding == old.sharding and got.dtype == old.dtype
    original = torch.load(path, weights_only=True)
    for k in keys:
        np.testing.assert_array_equal(np.asarray(state.ema[k]), original["param"][k].numpy())


# --------------------------------------------------------------------------- D: ultralytics
@pytest.mark.parametrize("case", D_CASES)
def test_ultralytics_decays_and_every_update(case):
    man = _json(D_MANIFEST)
    c = man["cases"][case]
    base = os.path.dirname(D_MANIFEST)
    traj = np.load(os.path.join(base, f"{c['model']}_trajectory.npz"))
    ref = np.load(os.path.join(base, f"{case}.npz"))
    keys, steps = c["float_keys"], man["steps"]
    assert not set(c["non_float_keys"]) & set(keys)
    ema = jz.ShardedEMA(c["decay"], tau=c["tau"], torch_compatible=True)
    assert [ema.decay_at_f64(n) for n in range(1, steps + 1)] == c["d_per_update"]

    trajectory = states(traj, keys, range(steps + 1))
    want = {t: {k: ref[f"muladd/step{t}/{k}"] for k in keys} for t in range(1, steps + 1)}
    f64 = {t: {k: ref[f"float64/step{t}/{k}"] for k in keys} for t in range(1, steps + 1)}
    eager = run(ema, trajectory, jit=False)
    jitted = run(ema, trajectory, jit=True)
    plain = run(jz.ShardedEMA(c["decay"], tau=c["tau"]), trajectory, jit=True)
    for t in range(1, steps + 1):
        assert int(eager[t - 1].updates) == t
        assert_bit_equal(eager[t - 1].ema, want[t], f"{case} update {t}")
        ultra = {k: ref[f"ultralytics/step{t}/{k}"] for k in keys}
        assert_close(ultra, f64[t], F64_ATOL, "ultralytics fixture vs float64")
        for name, got in (("eager", eager), ("jitted", jitted), ("plain", plain)):
            assert_close(got[t - 1].ema, f64[t], F64_ATOL, f"{name} update {t}")
    check_jitted_bit_exact(jitted, trajectory, c["d_per_update"], want, case)


def ultralytics_mlp():
    m = torch.nn.Module()
    m.fc1, m.act, m.fc2 = torch.nn.Linear(17, 31), torch.nn.Tanh(), torch.nn.Linear(31, 5)
    return m


def test_ultralytics_checkpoint_import_export():
    """``{"ema": deepcopy(model).half(), "updates": n, ...}`` (an ultralytics checkpoint)
    imports into a Flax-layout EmaState (kernels transposed, fp16 cast up) and exports back
    to a module in eval mode with ``requires_grad=False`` holding the EMA."""
    base = os.path.dirname(D_MANIFEST)
    case = D_CASES[0]
    ref = np.load(os.path.join(base, f"{case}.npz"))
    model = ultralytics_mlp()
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(torch.from_numpy(ref[f"ultralytics/step30/{k}"]))
    ckpt = {"epoch": 0, "model": None, "ema": copy.deepcopy(model).half(), "updates": 30}
    flax_tree = {
        "fc1": {"kernel": np.zeros((17, 31), np.float32), "bias": np.zeros(31, np.float32)},
        "fc2": {"kernel": np.zeros((31, 5), np.float32), "bias": np.zeros(5, np.float32)},
    }
    state = ti.import_ema(jz.ShardedEMA(0.9999, tau=2000).init(flax_tree), ckpt)
    assert int(state.updates) == 30 and state.ema["fc1"]["kernel"].dtype == np.float32
    half = ckpt["ema"].state_dict()
    np.testing.assert_array_equal(state.ema["fc1"]["kernel"], half["fc1.weight"].float().numpy().T)
    np.testing.assert_array_equal(state.ema["fc2"]["bias"], half["fc2.bias"].float().numpy())

    full = ti.import_ema(state, {"ema": model.state_dict(), "updates": 30})
    out = ti.export_ema(full, format="ultralytics", model=model)
    assert set(out) == {"ema", "updates"} and out["updates"] == 30
    m = out["ema"]
    assert m is not model and not m.training
    assert all(not p.requires_grad for p in m.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k


def test_ultralytics_batchnorm_counter_excluded_and_frozen():
    """BN running stats are averaged weights (imported), ``num_batches_tracked`` is not: it is
    left out of the EmaState and an export onto the EMA module keeps its frozen value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    ema_module = copy.deepcopy(model).eval()  # num_batches_tracked stays 0 in ultralytics
    model[1].num_batches_tracked.fill_(30)
    tree = {  # flax naming: nn.Sequential's layers_0 / layers_1
        "params": {
            "layers_0": {
                "kernel": np.zeros((3, 3, 3, 4), np.float32),
                "bias": np.zeros(4, np.float32),
            },
            "layers_1": {"scale": np.zeros(4, np.float32), "bias": np.zeros(4, np.float32)},
        },
        "batch_stats": {
            "layers_1": {"mean": np.zeros(4, np.float32), "var": np.zeros(4, np.float32)}
        },
    }
    state = ti.import_ema(jz.ShardedEMA(0.9).init(tree), {"ema": ema_module, "updates": 7})
    sd = ema_module.state_dict()
    assert int(state.updates) == 7
    np.testing.assert_array_equal(
        state.ema["params"]["layers_0"]["kernel"], sd["0.weight"].numpy().transpose(2, 3, 1, 0)
    )
    np.testing.assert_array_equal(
        state.ema["batch_stats"]["layers_1"]["var"], sd["1.running_var"].numpy()
    )
    assert "num_batches_tracked" not in str(jax.tree_util.tree_structure(state.ema))

    out = ti.export_ema(state, format="ultralytics", model=ema_module)["ema"]
    assert list(out.state_dict()) == list(sd)
    for k, v in sd.items():
        assert torch.equal(out.state_dict()[k], v), k
    assert int(out.state_dict()["1.num_batches_tracked"]) == 0
    plain = ti.export_ema(state, format="modelema", name_map=sd)["param"]
    assert list(plain) == [k for k in sd if not k.endswith("num_batches_tracked")]


def test_bad_ema_checkpoints():
    tree = {"fc1.weight": np.zeros((31, 17), np.float32), "fc1.bias": np.zeros(31, np.float32)}
    state = jz.ShardedEMA(0.9).init(tree)
    good = collections.OrderedDict((k, torch.zeros(v.shape)) for k, v in tree.items())
    with pytest.raises(ValueError, match=r"ckpt has keys \['model', 'epoch'\]"):
        ti.import_ema(state, {"model": good, "epoch": 3})
    with pytest.raises(ValueError, match=r"updates'\] must be an int >= 0, got -1"):
        ti.import_ema(state, {"param": good, "updates": -1})
    with pytest.raises(
        ValueError, match=r"no tree leaf: fc2\.bias \(5,\).*no torch entry: fc1\.bias"
    ):
        ti.import_ema(
            state,
            {"param": {"fc1.weight": good["fc1.weight"], "fc2.bias": torch.zeros(5)}, "updates": 1},
        )
    with pytest.raises(
        ValueError, match=r"fc1\.weight \(17, 31\) \(fc1\.weight has shape \(31, 17\)\)"
    ):
        ti.import_ema(state, {"param": {**good, "fc1.weight": torch.zeros(17, 31)}, "updates": 1})
    with pytest.raises(TypeError, match=r"ema_state must be a jaxzero\.EmaState"):
        ti.import_ema(tree, {"param": good, "updates": 1})
    with pytest.raises(ValueError, match=r"format='yolo'"):
        ti.export_ema(state, format="yolo")


def test_bf16_modelema_checkpoint_is_upcast_not_rejected():
    """torch's distributed ModelEMA cannot build bf16 buckets (its 8-byte grid table has no
    entry for itemsize 2 -> KeyError). jaxzero accepts a bf16 EMA state dict and upcasts it
    exactly to the EMA's float32 (every bf16 value is representable in float32), and the
    bucket layout for 2-byte items uses a 4-element grid."""
    from jaxzero import greedy_partition

    w = torch.randn(6, 5).to(torch.bfloat16)
    b = torch.randn(5).to(torch.bfloat16)
    ckpt = {"param": collections.OrderedDict([("w", w), ("b", b)]), "updates": 7}
    target = jz.ShardedEMA(0.9).init(
        {"w": np.zeros((6, 5), np.float32), "b": np.zeros(5, np.float32)}
    )
    state = ti.import_ema(target, ckpt, name_map=ckpt["param"])
    assert int(state.updates) == 7
    assert state.ema["w"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(state.ema["w"]), w.float().numpy())
    np.testing.assert_array_equal(np.asarray(state.ema["b"]), b.float().numpy())
    plan = greedy_partition([30, 5], 2, sort=False, itemsize=2, align_bytes=8)
    assert plan.slot_ends[1] - plan.offsets[1] == 8  # 5 bf16 elements padded to the 4-grid
