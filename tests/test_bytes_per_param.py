"""Bytes per parameter of an offload setting: ``MemoryEstimate.host_per_param`` and the PCIe
bytes per parameter each way per step (``h2d_per_param``, ``d2h_per_param``), against the
bytes of the state restated here (fp32 master 4, Adam's two moments 4 each, the remainder
master's 16-bit low half and carry bit, 2-byte moments), then against the deviceless
XLA:GPU compile of a 2-layer decoder on 8 H100s (stage 3 per layer), and ``jaxzero plan``'s
host cell.

The compiled step moves the estimate's bytes per parameter within a named remainder: every
leaf of the test model splits 8 ways (no padding, no replicated leaf), so the device holds
exactly ``num_params / 8`` parameters' state; the rest is Adam's int32 step count and a few
scalars (at most :data:`SCALARS` bytes each way), with the remainder master the small leaves
(4096 elements or fewer: the norms) that ZeRO keeps in fp32, and with a fraction of the state
offloaded the granularity of whole leaves (the host takes at least the fraction, by less
than one leaf more).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from compile_memo import H100, reuse_gpu_compiles

import jaxzero as jz
from jaxzero import cli, gpu
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape
from jaxzero.gpu.offload_fraction import fraction_estimate
from jaxzero.memory import parse_bytes

N = 8
MASTER = 4  # the fp32 master copy
ADAM = 2 * 4  # Adam's first and second moments in fp32
ADAM_BF16 = 2 * 2  # the moments stored in 2 bytes each (jz.with_state_dtype)
EMA = 4  # the fp32 EMA
LO, CARRY = 2, 1 / 8  # the remainder master: a 16-bit low half and one carry bit
PARAM = 2  # a bf16 param
# Φ divisible by 8 x N: every shard whole, its carry bits whole bytes
PHI = 6_400_000_000
REMAINDER = ("optimizer", "remainder")
SHAPE = model_shape(layers=2, hidden=256, heads=2, vocab=512, seq=16, batch=1)
SCALARS = 64  # Adam's int32 count and the step's other scalars in host memory, each way


def _est(offload, **kw):
    return jz.estimate_memory(PHI, N, stage=3, offload=offload, **kw)


@pytest.mark.parametrize(
    "offload,kw,host",
    [
        ("optimizer", {}, MASTER + ADAM),
        ("optimizer", {"ema": True}, MASTER + ADAM + EMA),
        ("optimizer", {"state_dtype": "bf16"}, MASTER + ADAM_BF16),
        (REMAINDER, {}, LO + CARRY + ADAM),
        (REMAINDER, {"state_dtype": "bf16"}, LO + CARRY + ADAM_BF16),
        ("optimizer", {"accum_steps": 8}, MASTER + ADAM),  # the update runs once per step
    ],
    ids=["adam", "adam_ema", "bf16_state", "remainder", "remainder_bf16_state", "accum"],
)
def test_optimizer_offload_moves_its_host_state_once_each_way(offload, kw, host):
    """With the optimizer side offloaded the host holds ``host`` bytes per parameter of the
    shard, and the streamed update fetches them and writes them back once per step."""
    e = _est(offload, **kw)
    assert e.params_held == PHI // N
    assert e.host_per_param == host
    assert e.h2d_per_param == e.d2h_per_param == host


def test_a_fraction_of_the_state_offloaded_moves_that_fraction():
    """``offload_fraction=0.5`` (as ``jaxzero plan`` applies it to the estimate): half of the
    12 bytes per parameter on the host, and half of them over PCIe each way."""
    e = fraction_estimate(_est("optimizer"), 0.5)
    assert e.host_per_param == e.h2d_per_param == e.d2h_per_param == 0.5 * (MASTER + ADAM)


def test_without_offload_nothing_and_with_the_params_the_host_but_no_pcie_figure():
    """No offload: nothing on the host, nothing over PCIe. The params offloaded too: 14 bytes
    per parameter on the host (bf16 params, their gradient in the same bytes), and no PCIe
    figure, which depends on the layer stacks (the class docstring)."""
    none = jz.estimate_memory(PHI, N, stage=3)
    assert (none.host_per_param, none.h2d_per_param, none.d2h_per_param) == (0, 0, 0)
    both = _est(("optimizer", "params"))
    assert both.host_per_param == PARAM + MASTER + ADAM
    assert both.h2d_per_param is None and both.d2h_per_param is None


def test_the_parameters_held_are_the_padded_shard_or_all_of_them_at_stage_0():
    """An indivisible Φ: the state is counted in ceil(Φ/N) elements per device, so the host
    holds 12 bytes per parameter of that shard exactly; at stage 0 a device holds every
    parameter's state (and nothing on the host: offload needs stage 1-3)."""
    phi = 1_000_003
    e = jz.estimate_memory(phi, N, stage=1, offload="optimizer")
    assert e.params_held == math.ceil(phi / N)
    assert e.host_per_param == MASTER + ADAM
    zero = jz.estimate_memory(phi, N, stage=0)
    assert zero.params_held == phi and zero.host_per_param == 0


@functools.cache
def _moved(offload, state_dtype=None, fraction=1.0):
    """The compiled step's (h2d, d2h, host argument) bytes per device."""
    tx = optax.adam(1e-3)
    if state_dtype:
        tx = jz.with_state_dtype(tx, jnp.bfloat16)
    zero = jz.ZeRO(
        tx,
        gpu.compile_only_mesh("h100", N),
        stage=3,
        precision="bf16",
        layers="layers",
        offload=offload,
        offload_fraction=fraction,
    )
    step = jz.make_train_step(make_loss(SHAPE), zero)
    report = gpu.compile_report(step, abstract_params(SHAPE), batch_shapes(SHAPE, N))
    t = report.host_transfers
    return t.h2d_bytes, t.d2h_bytes, report.host_argument_bytes


def _local_elements(small=False):
    """Elements per device of the test model's leaves (each split 8 ways: asserted), only
    those of 4096 elements or fewer with ``small``."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params(SHAPE))[0]
    total = 0
    for path, x in leaves:
        skip = 1 if path[0].key == "layers" else 0  # a stack splits below its layer axis
        assert any(d % N == 0 for d in x.shape[skip:]), (path, x.shape)
        total += x.size // N if not small or x.size <= 4096 else 0
    return total


@pytest.mark.parametrize(
    "offload,state_dtype,kept_fp32",
    [
        ("optimizer", None, 0),
        # slow: the bf16 state's and the remainder's compiles (the Adam compile stays, and
        # test_optimizer_offload_moves_its_host_state_once_each_way checks their formulas)
        pytest.param("optimizer", "bf16", 0, marks=pytest.mark.slow),
        pytest.param(REMAINDER, None, MASTER - LO - CARRY, marks=pytest.mark.slow),
    ],
    ids=["adam", "bf16_state", "remainder"],
)
def test_gpu_compiled_pcie_bytes_per_param_equal_the_estimates(offload, state_dtype, kept_fp32):
    """Deviceless H100s: the compiled step's bytes each way per parameter of the shard equal
    the estimate's, plus, with the remainder master, 1.875 bytes per element of the small
    leaves kept in fp32, plus at most :data:`SCALARS` bytes; and what moves each way is the
    host state the step holds."""
    held = -(-SHAPE.num_params // N)
    assert held == _local_elements() == SHAPE.num_params / N  # no padding
    e = jz.estimate_memory(SHAPE.num_params, N, stage=3, offload=offload, state_dtype=state_dtype)
    h2d, d2h, host = _moved(offload, state_dtype)
    kept = kept_fp32 * _local_elements(small=True)
    for way, got in (("h2d", h2d), ("d2h", d2h)):
        want = getattr(e, f"{way}_per_param") * held + kept
        assert 0 <= got - want <= SCALARS, (way, got, want)
    assert 0 <= h2d - host <= SCALARS and d2h == host


def test_gpu_compiled_half_the_state_offloaded_moves_half_of_it_within_one_leaf():
    """``offload_fraction=0.5``: the compile keeps whole leaves on the host, at least half of
    the state's bytes and less than one leaf more (the largest: a stack's fp32 master, mu or
    nu shard), and moves them once each way; the estimate says half."""
    e = fraction_estimate(
        jz.estimate_memory(SHAPE.num_params, N, stage=3, offload="optimizer"), 0.5
    )
    held = -(-SHAPE.num_params // N)
    largest = 4 * max(x.size for x in jax.tree.leaves(abstract_params(SHAPE))) // N
    h2d, d2h, host = _moved("optimizer", fraction=0.5)
    for got in (h2d, d2h):
        assert e.h2d_per_param * held <= got <= e.h2d_per_param * held + largest + SCALARS
    assert d2h == host


def test_plan_prints_the_host_bytes_per_param(capsys, monkeypatch):
    """``jaxzero plan --offload optimizer`` on a tiny shape (4 x 256 tokens per device, so the
    compact table keeps every column with the bytes per parameter): the host cell is the
    compiled host bytes with their bytes per parameter, 12.0 (fp32 master and Adam) over
    the model's parameters per GPU, and the legend says what B/param is. The compile is
    tests/test_cli_nvme.py's plan too: one process compiles it once."""
    reuse_gpu_compiles(monkeypatch, H100)
    argv = ["plan", "--devices", str(N), "--layers", "2", "--hidden", "256", "--heads", "2"]
    argv += ["--vocab", "512", "--seq", "256", "--batch", "4", "--stage", "3"]
    assert cli.main([*argv, "--stage3", "per-layer", "--offload", "optimizer"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = re.split(r"\s{2,}", next(x for x in lines if x.startswith("stage")))
    row = re.split(r"\s{2,}", next(x for x in lines if x.startswith("3 per layer")))
    assert header[-2:] == ["host", "hidden AG+RS"]
    cell = dict(zip(header, row, strict=True))["host"]
    m = re.fullmatch(r"([\d.]+ [KMG]?B) \(([\d.]+) B/param\)", cell)
    assert m, cell
    params = int(re.search(r"-> ([\d,]+) params", out)[1].replace(",", ""))
    assert float(m[2]) == MASTER + ADAM
    assert parse_bytes(m[1].replace(" ", "")) / (params / N) == pytest.approx(12, abs=0.05)
    assert "B/param: those bytes over the model's parameters per GPU" in " ".join(lines)
