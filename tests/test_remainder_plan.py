"""The remainder master in the memory estimate and the plan: ``estimate_memory(...,
offload=("optimizer", "remainder"))`` counts 2 + 1/8 bytes per parameter for the offloaded fp32
master where ``offload="optimizer"`` counts 4, and ``jaxzero plan --offload
optimizer,remainder`` compiles ``ZeRO(offload=("optimizer", "remainder"))``: its host bytes
are lower by 1.875 bytes per stored parameter per device (leaves of over 4096 elements, from
the model's own leaf shapes), and its paste line builds it."""

from __future__ import annotations

import re

import jax
import pytest
from compile_memo import H100, reuse_gpu_compiles

from jaxzero import cli, estimate_memory
from jaxzero.gpu.models import abstract_params, model_shape
from jaxzero.memory import parse_bytes

REMAINDER = ("optimizer", "remainder")
PHI, N = 8 * 64_000, 8  # a whole number of carry bytes per device: the formula is exact


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(
    "state_dtype,ema,state",
    [(None, False, 8), ("bf16", False, 4), (None, True, 8 + 4)],  # Adam's moments (+ the EMA)
)
def test_the_estimate_counts_the_master_in_two_and_an_eighth_bytes(stage, state_dtype, ema, state):
    """Host bytes per device: the optimizer state (and the EMA) as before, the fp32 master in
    2.125 bytes per parameter instead of 4; the device's bytes do not change."""
    kw = dict(stage=stage, state_dtype=state_dtype, ema=ema)
    fp32 = estimate_memory(PHI, N, offload="optimizer", **kw)
    kept = estimate_memory(PHI, N, offload=REMAINDER, **kw)
    assert fp32.host == (state + 4) * PHI // N
    assert kept.host == (state + 2.125) * PHI // N
    assert fp32.host - kept.host == 1.875 * PHI / N
    assert kept.total == fp32.total and kept.optimizer == kept.ema == 0


def test_the_estimate_rounds_the_carry_bits_up_to_whole_bytes():
    """A shard of 1001 parameters holds 2 x 1001 bytes of remainder and ceil(1001 / 8) = 126
    bytes of carry bits."""
    n, shard = 4, 1001
    e = estimate_memory(n * shard, n, stage=3, offload=REMAINDER)
    assert e.host == 8 * shard + 2 * shard + 126


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(precision="fp16"), "precision='fp16'.*precision='bf16'"),
        (dict(precision="fp32"), "precision='fp32'.*precision='bf16'"),
        (dict(compute_copy=False), "compute_copy=False.*compute_copy=True"),
    ],
)
def test_the_estimate_refuses_a_remainder_without_an_offloaded_master_beside_bf16(kw, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(PHI, N, stage=3, offload=REMAINDER, **kw)
    with pytest.raises(ValueError, match="'remainder'.*'optimizer', 'remainder'"):
        estimate_memory(PHI, N, stage=3, offload=("optimizer", "params", "remainder"))


DIMS = dict(layers=2, hidden=256, heads=2, vocab=512, seq=16)
ARGV = ["plan", "--devices", str(N), "--stage", "3", "--stage3", "per-layer", "--wide"]
ARGV += [f"--{k}={v}" for k, v in DIMS.items()]


def _row(capsys, offload):
    assert cli.main([*ARGV, "--offload", offload]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("stage"))
    row = next(line for line in lines if line.startswith("3 per layer"))
    names = [h.strip() for h in header.split("  ") if h.strip()]
    cells = [c.strip() for c in row.split("  ") if c.strip()]
    table = dict(zip(names, cells, strict=False))
    keys = ("host", "host est.", "PCIe h2d", "PCIe d2h")
    # a PCIe cell: "2.95 MB (12.0 B/param)", the bytes before the bytes per parameter
    return out, {k: parse_bytes(table[k].split(" (")[0].replace(" ", "")) for k in keys}


def _stored_params() -> int:
    """The parameters ``ZeRO`` keeps as remainders in the plan's model: leaves of more than
    4096 elements (each last axis a multiple of 8 x 8, so per device a multiple of 8 however
    the stage-3 shard splits it)."""
    leaves = jax.tree.leaves(abstract_params(model_shape(**DIMS, batch=1)))
    big = [x for x in leaves if x.size > 4096]
    assert all(x.shape[-1] % (8 * N) == 0 for x in big)
    assert len(big) < len(leaves)  # the norms stay fp32
    return sum(x.size for x in big)


def test_plan_remainder_compiles_lower_host_and_pcie_bytes_and_pastes_the_zero(capsys, monkeypatch):
    """``--offload optimizer,remainder`` against ``--offload optimizer`` (deviceless H100s,
    a 2-layer decoder, stage 3 per layer): host memory and each way over PCIe lower by 1.875
    bytes x the stored parameters per device, within the printed figures' rounding (two
    decimals of MB each); the paste line spells the ZeRO's offload. The ``--offload
    optimizer`` compile is tests/test_gpu_offload.py's, test_state_dtype.py's and
    test_cli_plan_output.py's plan too: one process compiles it once."""
    reuse_gpu_compiles(monkeypatch, H100)
    _, fp32 = _row(capsys, "optimizer")
    out, kept = _row(capsys, "optimizer,remainder")
    saved = 1.875 * _stored_params() / N
    rounding = 2 * 0.005e6
    for key in ("host", "host est.", "PCIe h2d", "PCIe d2h"):
        assert fp32[key] - kept[key] == pytest.approx(saved, abs=rounding), key
    assert 'offload=("optimizer", "remainder")' in out
    assert "the fp32 master as a 16-bit remainder" in out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--offload-fraction", "0.5"], "--offload-fraction 0.5 needs --offload optimizer"),
        (["--precision", "fp16"], "--precision fp16: the remainder.*--precision bf16"),
        (["--no-compute-copy"], "--no-compute-copy: the remainder"),
        (["--nvme-gbps", "3", "3"], "--nvme-gbps .*add --offload optimizer"),
    ],
)
def test_plan_refuses_remainder_flags_that_would_not_act(capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        cli.main([*ARGV, "--offload", "optimizer,remainder", *extra])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_plan_has_no_remainder_with_the_params_offloaded(capsys):
    """The params offload writes gradients into the params' buffers the remainder is rebuilt
    from: ``optimizer,params,remainder`` is not a choice."""
    with pytest.raises(SystemExit) as e:
        cli.main([*ARGV, "--offload", "optimizer,params,remainder"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
