"""What the command line reports.

Expected numbers are written from the formulas (ZeRO accounting, torch layouts), not read back
from jaxzero: ``estimate``'s stage-3 row holds the whole model gathered in the compute dtype
(unless one layer at a time), ``--from-checkpoint`` counts the checkpoint's EMA, ``inspect``
never prints optax's closures, and ``convert jax2torch`` prints torch shapes for torch names.
"""

import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxzero as jz
from jaxzero import cli, trees

GB = 10**9
LEGACY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "legacy_ckpt")


def _table(out: str) -> dict[int, dict[str, str]]:
    """{stage: {column: "value unit"}} from ``jaxzero estimate``'s table."""
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:1] == ["stage"])
    cols = lines[head].split()
    rows = {}
    for ln in lines[head + 2 :]:
        f = ln.split()
        if not f or not f[0].isdigit():
            break
        cells, k = {"stage": f[0]}, 1
        for c in cols[1:]:
            if c == "fits":
                cells[c] = f[k]
                k += 1
            else:
                cells[c] = f"{f[k]} {f[k + 1]}"
                k += 2
        rows[int(f[0])] = cells
    return rows


def _estimate(capsys, *argv) -> dict[int, dict[str, str]]:
    assert cli.main(["estimate", *argv]) == 0
    return _table(capsys.readouterr().out)


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB"


def test_estimate_stage3_holds_the_gathered_model(capsys):
    """7B on 8 devices, bf16 Adam: the persistent stage-3 state is (2+2+12)Φ/8 = 14 GB, but
    the default stage 3 gathers the model for the micro-batch: + 2Φ = 14 GB more, so a 24 GB
    device does not fit it (it said "yes" before)."""
    phi, n = 7 * 10**9, 8
    row = _estimate(capsys, "--params", "7B", "--devices", "8", "--gpu-memory", "24GB")[3]
    assert row["params"] == row["grads"] == _gb(2 * phi / n)
    assert row["optimizer"] == _gb(12 * phi / n)
    assert row["gathered"] == _gb(2 * phi)
    assert row["total"] == _gb(16 * phi / n + 2 * phi) == "28.00 GB"
    assert row["fits"] == "NO"
    # fp32: the model is gathered in float32, 4 bytes per parameter
    row = _estimate(capsys, "--params", "7B", "--devices", "8", "--precision", "fp32")[3]
    assert row["gathered"] == _gb(4 * phi)
    assert row["total"] == _gb((4 + 4 + 8) * phi / n + 4 * phi)


def test_estimate_stage3_per_layer_counts_the_layer_not_the_model(capsys):
    """--layer-params: one layer gathered with its gradient, (2+2)·200M, plus the gradients
    outside the stack, 2·(7e9 - 32·200M); no whole-model term."""
    argv = ["--params", "7B", "--devices", "8", "--stage", "3", "--layers", "32"]
    row = _estimate(capsys, *argv, "--layer-params", "200M")[3]
    assert row["gathered"] == _gb(4 * 200e6 + 2 * (7e9 - 32 * 200e6)) == "2.00 GB"
    assert row["total"] == _gb(16 * 7e9 / 8 + 2e9)


def test_estimate_memory_whole_model_option():
    e = jz.estimate_memory(1000, 4, stage=3, gather_model=True)
    assert e.gathered == 2 * 1000 and e.total == 16 * 250 + 2000
    assert jz.estimate_memory(1000, 4, stage=2, gather_model=True).gathered == 0
    assert jz.estimate_memory(1000, 4, stage=3).gathered == 0  # the paper's accounting
    with pytest.raises(ValueError, match="exclude each other"):
        jz.estimate_memory(1000, 4, stage=3, gather_model=True, layers=2, layer_params=10)
    with pytest.raises(TypeError, match="gather_model"):
        jz.estimate_memory(1000, 4, gather_model="yes")


def _adam_checkpoint(path, *, ema: bool, tx=None):
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}  # 2,080 params
    zero = jz.ZeRO(tx or optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(
        lambda p, b: jnp.sum(p["w"]), zero, ema=jz.ShardedEMA(0.99) if ema else None
    )
    jz.checkpoint.save(str(path), 1, step.init(params), zero=zero, wait=True)


def test_estimate_from_checkpoint_counts_its_ema(tmp_path, capsys):
    """A stage-2 fp32 Adam checkpoint with an EMA, Φ = 2,080 on 8 devices: the EMA costs
    4·Φ/8 = 1,040 B, the total 4Φ + (4+8)Φ/8 + 4Φ/8 = 12,480 B per device."""
    _adam_checkpoint(tmp_path / "with", ema=True)
    assert cli.main(["estimate", "--from-checkpoint", str(tmp_path / "with")]) == 0
    out = capsys.readouterr().out
    assert "2,080 params, with an EMA" in out
    row = _table(out)[2]
    assert row["ema"] == "1.04 KB"
    assert row["total"] == "12.48 KB"
    _adam_checkpoint(tmp_path / "without", ema=False)
    assert cli.main(["estimate", "--from-checkpoint", str(tmp_path / "without")]) == 0
    out = capsys.readouterr().out
    assert "with an EMA" not in out and "ema" not in _table(out)[2]
    assert _table(out)[2]["total"] == "11.44 KB"  # 4Φ + 12Φ/8


def test_inspect_names_the_chain_not_its_closures(tmp_path, capsys):
    _adam_checkpoint(tmp_path / "adam", ema=False)
    assert cli.main(["inspect", str(tmp_path / "adam")]) == 0
    out = capsys.readouterr().out
    assert "<function" not in out and "GradientTransformation" not in out, out
    assert "optimizer state: ScaleByAdamState, EmptyState" in out
    meta = jz.checkpoint.load_metadata(str(tmp_path / "adam"))
    assert meta["optimizer"] is None  # nothing useless is recorded either
    # a checkpoint saved before (its metadata holds the closures' repr)
    assert cli.main(["inspect", LEGACY]) == 0
    out = capsys.readouterr().out
    assert "<function" not in out and "optimizer state: ScaleByAdamState" in out, out


@pytest.mark.parametrize(
    "tx, readable",
    [
        (optax.adam(1e-3), False),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), False),
        (optax.MultiSteps(optax.sgd(0.1), 4), False),
        ("optax.adam(1e-2)", True),
        ("GradientTransformationExtraArgs(init=<function chain.<locals>.init_fn>)", False),
    ],
)
def test_readable_repr(tx, readable):
    text = tx if isinstance(tx, str) else repr(tx)
    assert (trees.readable_repr(text) == text) if readable else trees.readable_repr(text) is None


def test_jax2torch_summary_prints_torch_shapes(tmp_path, capsys):
    """Flax Dense kernel (in, out) = (32, 5) is torch Linear.weight (out, in) = (5, 32); Flax
    Conv kernel (kh, kw, in, out) = (3, 3, 2, 4) is torch Conv2d.weight (out, in, kh, kw)."""
    params = {
        "conv": {"kernel": np.zeros((3, 3, 2, 4), np.float32)},
        "head": {"kernel": np.zeros((32, 5), np.float32), "bias": np.zeros(5, np.float32)},
    }
    zero = jz.ZeRO(optax.adamw(1e-3), jz.data_parallel_mesh(2), stage=1)
    ckpt = str(tmp_path / "ckpt")
    jz.checkpoint.save(ckpt, 1, zero.init(params), zero=zero, wait=True)
    argv = ["convert", "jax2torch", "--ckpt", ckpt, "--world-size", "2", "--lr", "1e-3"]
    assert cli.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    shapes = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    assert "(5, 32)" in shapes["head.weight"] and "(32, 5)" not in shapes["head.weight"]
    assert "(4, 2, 3, 3)" in shapes["conv.weight"]
    assert "(5,)" in shapes["head.bias"]
