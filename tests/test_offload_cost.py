"""What offload moves over PCIe, read from the compiled XLA:GPU HLO (jaxzero.gpu.transfers),
and the step time it predicts (jaxzero.gpu.offload_cost).

The deviceless H100 tests pin the host <-> device bytes of a 4-layer GPT's step at N = 8
against what the offloaded state should move, restated from the leaf shapes and the sharding
rule (a leaf split 8 ways on its largest divisible dimension, a stack's layer axis skipped):

* ``offload="optimizer"`` (bf16 Adam, fp32 master): the update reads the master, mu and nu
  (12 bytes per local element) from the host and writes them back: 12 each way;
* ``("optimizer", "params")`` adds the bf16 params: each layer stack fetched in the forward
  and again in the backward, layer 0 once more (2 x 2 bytes, and 2 / L), the leaves outside the stacks once (2), the
  stacks' gradients written into the params' host bytes (2) and read back twice (the
  prologue's finite check and norm, then the update: 2 x 2), and every new bf16 param
  written (2).

The update's chunk is shrunk (``stream.CHUNK``) so it runs in loops over chunks and the
loops' trip counts are part of what is read.
"""

from __future__ import annotations

import math

import jax
import pytest
from offload_checks import h100_stage3

import jaxzero as jz
from jaxzero import cli, gpu
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape
from jaxzero.gpu.offload_cost import OffloadCost, offload_cost
from jaxzero.gpu.transfers import host_transfers_per_step
from jaxzero.zero.offload import stream

N = 8
SHAPE = model_shape(layers=4, hidden=256, heads=2, vocab=512, seq=16, batch=1)
PARAMS = ("optimizer", "params")


def _local_elements():
    """(all, in the layer stacks) elements per device by the sharding rule."""
    total = stacks = 0
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params(SHAPE))[0]:
        stack = path[0].key == "layers"
        split = any(d % N == 0 for d in x.shape[1 if stack else 0 :])
        n = math.prod(x.shape) // (N if split else 1)
        total += n
        stacks += n if stack else 0
    return total, stacks


def _expected(off):
    """``(host->device, device->host)`` bytes per step (module docstring)."""
    local, stacks = _local_elements()
    h2d = d2h = 12 * local
    if off == PARAMS:
        layers = SHAPE.layers
        h2d += 2 * (local - stacks) + 2 * stacks * (2 * layers + 1) // layers + 2 * 2 * stacks
        d2h += 2 * stacks + 2 * local
    return h2d, d2h


def _report(off, monkeypatch):
    monkeypatch.setattr(stream, "CHUNK", 1 << 14)  # 4 to 6 chunks per stacked leaf
    zero = h100_stage3(N, offload=off)
    step = jz.make_train_step(make_loss(SHAPE), zero)
    return gpu.compile_report(step, abstract_params(SHAPE), batch_shapes(SHAPE, N))


@pytest.mark.parametrize("off", ["optimizer", PARAMS], ids=["optimizer", "optimizer_params"])
def test_gpu_host_transfers_match_what_the_offloaded_state_moves(off, monkeypatch):
    """Deviceless H100, 4 scanned layers x 256 at N = 8: the compiled step's host->device and
    device->host bytes (loop trip counts applied) are each within 2% of the bytes restated
    from the leaf shapes, the update runs in loops (launches > transfer instructions), and
    the report's text and the time at a link's rate follow from the bytes."""
    report = _report(off, monkeypatch)
    t = report.host_transfers
    h2d, d2h = _expected(off)
    assert abs(t.h2d_bytes - h2d) <= 0.02 * h2d, (t.h2d_bytes, h2d)
    assert abs(t.d2h_bytes - d2h) <= 0.02 * d2h, (t.d2h_bytes, d2h)
    assert t.launches > t.transfers  # chunk loops: their trip counts were applied
    assert 0 <= t.hidden_bytes <= t.bytes
    assert report.transfer_summary().startswith(
        f"host->device {jz.memory.format_bytes(t.h2d_bytes)}, device->host "
    )
    total, exposed = report.transfer_seconds(10.0)
    assert total == pytest.approx((t.h2d_bytes + t.d2h_bytes) / 10e9)
    assert exposed == pytest.approx(t.exposed_bytes / 10e9)


# A scheduled-HLO excerpt in XLA:GPU's form: a loop of 3 iterations fetching a 1x256 f32
# slice of a host buffer with a gemm fusion between start and done (hidden), writing a
# 1x256 bf16 slice back into a host stack (no compute between: exposed; its s32 indices
# are not payload), and a synchronous scalar copy to the host after it.
_HLO = """\
HloModule m, is_scheduled=true

%fused_dot (p0: bf16[16,16], p1: bf16[16,16]) -> bf16[16,16] {
  %p0 = bf16[16,16]{1,0} parameter(0)
  %p1 = bf16[16,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[16,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%wrapped_ds (a: f32[3,256], i: s32[]) -> f32[1,256] {
  %a = f32[3,256]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,256]{1,0} dynamic-slice(%a, %i, %z), dynamic_slice_sizes={1,256}
}

%wrapped_dus (b: bf16[3,256], u: bf16[1,256], i: s32[]) -> bf16[3,256] {
  %b = bf16[3,256]{1,0} parameter(0)
  %u = bf16[1,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[3,256]{1,0} dynamic-update-slice(%b, %u, %i, %z)
}

%body (t: (s32[], f32[3,256], bf16[3,256], bf16[16,16])) -> (s32[], f32[3,256], bf16[3,256], bf16[16,16]) {
  %t = (s32[], f32[3,256]{1,0:S(5)}, bf16[3,256]{1,0:S(5)}, bf16[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %h = f32[3,256]{1,0:S(5)} get-tuple-element(%t), index=1
  %g = bf16[3,256]{1,0:S(5)} get-tuple-element(%t), index=2
  %w = bf16[16,16]{1,0} get-tuple-element(%t), index=3
  %ds-start = ((f32[3,256]{1,0:S(5)}, s32[]), f32[1,256]{1,0}, u32[]) fusion-start(%h, %i), kind=kLoop, calls=%wrapped_ds
  %gemm = bf16[16,16]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot
  %ds-done = f32[1,256]{1,0} fusion-done(%ds-start)
  %u = bf16[1,256]{1,0} convert(%ds-done)
  %dus-start = ((bf16[3,256]{1,0:S(5)}, bf16[1,256]{1,0}, s32[]), bf16[3,256]{1,0:S(5)}, u32[]) fusion-start(%g, %u, %i), kind=kLoop, calls=%wrapped_dus
  %dus-done = bf16[3,256]{1,0:S(5)} fusion-done(%dus-start)
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[3,256]{1,0:S(5)}, bf16[3,256]{1,0:S(5)}, bf16[16,16]{1,0}) tuple(%n, %h, %dus-done, %gemm)
}

%cond (t: (s32[], f32[3,256], bf16[3,256], bf16[16,16])) -> pred[] {
  %t = (s32[], f32[3,256]{1,0:S(5)}, bf16[3,256]{1,0:S(5)}, bf16[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

ENTRY %main (h: f32[3,256], g: bf16[3,256], w: bf16[16,16], c: s32[]) -> (s32[], f32[3,256], bf16[3,256], bf16[16,16], s32[]) {
  %h = f32[3,256]{1,0:S(5)} parameter(0)
  %g = bf16[3,256]{1,0:S(5)} parameter(1)
  %w = bf16[16,16]{1,0} parameter(2)
  %c = s32[] parameter(3)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[3,256]{1,0:S(5)}, bf16[3,256]{1,0:S(5)}, bf16[16,16]{1,0}) tuple(%zero, %h, %g, %w)
  %loop = (s32[], f32[3,256]{1,0:S(5)}, bf16[3,256]{1,0:S(5)}, bf16[16,16]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %c2 = s32[]{:S(5)} copy(%c)
  ROOT %out = (s32[], f32[3,256]{1,0:S(5)}, bf16[3,256]{1,0:S(5)}, bf16[16,16]{1,0}, s32[]{:S(5)}) tuple(%zero, %h, %g, %w, %c2)
}
"""


def test_host_transfers_read_async_slices_loops_and_overlap():
    """By hand: 3 fetches of 1 KiB (f32[1,256]), each with a gemm between start and done;
    3 writes of 512 B (bf16[1,256]) with none; one 4-byte synchronous copy to the host."""
    t = host_transfers_per_step(_HLO)
    assert (t.h2d_bytes, t.hidden_h2d_bytes) == (3 * 1024, 3 * 1024)
    assert (t.d2h_bytes, t.hidden_d2h_bytes) == (3 * 512 + 4, 0)
    assert (t.transfers, t.launches) == (3, 7)
    assert t.share == pytest.approx(3072 / (3072 + 1540))
    assert host_transfers_per_step(_HLO.replace(":S(5)", "")).bytes == 0


def _fake_report(state_bytes, h2d, d2h, hidden=0):
    t = gpu.HostTransfers(h2d, d2h, hidden, 0, 1, 1)
    return gpu.CompileReport(
        kind="h100",
        devices=8,
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=0,
        hbm_bytes=None,
        collectives=(),
        kernels_per_step=0,
        trip_counts_known=True,
        compile_seconds=0.0,
        hlo_text="",
        host_argument_bytes=state_bytes,
        host_transfers=t,
    )


def test_offload_cost_restates_zero_infinity_and_adds_the_exposed_transfer():
    """LLaMA-7B's 6.74e9 parameters at N = 8, one 2048-token sequence per GPU, 16 bytes of
    state per parameter streamed both ways: ZeRO-Infinity's ait is seq x bsz x N / 4 = 4096
    FLOP/B, and at 55 GB/s and half the H100's 989.4 TFLOPS its efficiency is
    4096 * 55e9 / (4096 * 55e9 + 494.7e12) = 0.3129. The step adds only the exposed bytes,
    and a hidden transfer longer than the compute it overlaps sets the step's length."""
    params, seq, n = 6_738_415_616, 2048, 8
    state = 16 * params // n
    cost = offload_cost(_fake_report(state, state, state), params, seq)
    assert isinstance(cost, OffloadCost) and cost.gbps == 55.0
    assert cost.ait == pytest.approx(seq * 1 * n / 4, rel=1e-6)
    assert cost.formula_efficiency == pytest.approx(0.31290, abs=1e-4)
    compute = 8 * params * seq / (0.5 * 989.4e12)
    assert cost.compute_seconds == pytest.approx(compute)
    assert cost.step_seconds == pytest.approx(compute + 2 * state / 55e9)
    # nothing overlapped: the step's efficiency is the formula's
    assert 1 / cost.slowdown == pytest.approx(cost.formula_efficiency)
    half = offload_cost(_fake_report(state, state, state, hidden=state), params, seq, gbps=25)
    assert state / 25e9 > compute  # the hidden half takes longer than the compute it is under
    assert half.step_seconds == pytest.approx(state / 25e9 + state / 25e9)
    # eight times the tokens: the compute covers the hidden half, and the exposed one adds
    longer = offload_cost(_fake_report(state, state, state, hidden=state), params, 8 * seq)
    assert 8 * compute > state / 55e9
    assert longer.step_seconds == pytest.approx(8 * compute + state / 55e9)
    # a deferred update's rows overlap the first micro-batch's forward alone (2 of its 8 x
    # params x tokens FLOP): with 8 micro-batches a window of 1 / 32 of the compute, shorter
    # than the hidden half, which then adds what it lasts beyond it
    rows = offload_cost(
        _fake_report(state, state, state, hidden=state), params, 8 * seq, window=1 / 32
    )
    assert state / 55e9 > 8 * compute / 32
    beyond = state / 55e9 - 8 * compute / 32
    assert rows.step_seconds == pytest.approx(8 * compute + beyond + state / 55e9)
    with pytest.raises(ValueError, match=r"window=0 must be in \(0, 1\]"):
        offload_cost(_fake_report(state, state, state), params, seq, window=0)
    with pytest.raises(ValueError, match=r"gbps=0 must be a positive number of GB/s"):
        offload_cost(_fake_report(state, state, state), params, seq, gbps=0)


def test_gpu_plan_cli_prints_the_pcie_columns(capsys, monkeypatch):
    argv = ["plan", "--devices", "8", "--layers", str(SHAPE.layers), "--hidden", "256"]
    argv += ["--heads", "2"]
    argv += ["--vocab", "512", "--seq", "16", "--stage", "3", "--stage3", "per-layer"]
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--pcie-gbps", "20"])
    assert e.value.code == 2
    assert "--pcie-gbps 20 needs --offload" in capsys.readouterr().err
    assert cli.main([*argv, "--offload", "optimizer", "--pcie-gbps", "20", "--wide"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("stage"))
    for col in ("PCIe h2d", "PCIe d2h", "PCIe hidden", "step @20 GB/s", "x compute", "ZI eff."):
        assert col in header
    row = next(line for line in out.splitlines() if line.startswith("3 per layer"))
    h2d, d2h = _expected("optimizer")  # each way (CHUNK as shipped)
    assert row.count(jz.memory.format_bytes(h2d)) >= 1
    assert "ZeRO-Infinity" in out
