"""benchmarks/offload_overlap.py: optimizer offload's update run inside the next step's
forward, compiled for 8 H100s without a GPU (the tiny probe: 4 layers x 256).

The bytes each variant moves are restated from the decoder's widths (``ModelShape``'s
parameter count, not the probe's leaf list): master, mu and nu, 12 bytes per local element,
each way. The schedule readings pinned are the probe's findings that hold under jax 0.10
and 0.12: fetching layer i+2 from the stack that layer i+1 is written into makes XLA copy
the whole host stack (host to host), and the even/odd stacks with a barrier between the two
layers of an iteration copy nothing and hide part of the fetches and write-backs.
"""

from __future__ import annotations

import pytest
from conftest import repo_module

from jaxzero import gpu

probe = repo_module("offload_overlap", "benchmarks", "offload_overlap.py")

VARIANTS = ("pipelined", "pipelined_packed_split_barrier")


@pytest.fixture(scope="module")
def rows():
    """Each variant's figures, the tiny probe compiled once per variant."""
    mesh = gpu.compile_only_mesh("h100", probe.N)
    shape = probe.tiny()
    return {v: probe.figures(probe.compile_probe(v, shape, mesh), shape) for v in VARIANTS}


def test_probe_moves_master_mu_nu_each_way(rows):
    """4 layers of LLaMA's widths at 256 (ffn 768): 4h^2 + 3h*ffn + 2h parameters a layer, 8
    shards; each variant fetches and writes back 12 bytes per local element, within 2%."""
    h, ffn, layers, n = 256, 768, 4, 8
    expected = 12 * layers * (4 * h * h + 3 * h * ffn + 2 * h) // n
    for v, r in rows.items():
        assert abs(r["h2d"] - expected) <= 0.02 * expected, (v, r["h2d"], expected)
        assert abs(r["d2h"] - expected) <= 0.02 * expected, (v, r["d2h"], expected)


def test_split_stacks_copy_nothing_and_hide_transfers(rows):
    """The issue's loop (fetch i+2, write i+1 into the same stacks) makes XLA copy host
    stacks host to host; the same loop fetching from the even layers' stack while writing
    the odd layers' (and the reverse) copies none, and the schedule hides part of both
    directions behind the forward's gemms."""
    assert rows["pipelined"]["host_copies"] > 0
    split = rows["pipelined_packed_split_barrier"]
    assert split["host_copies"] == 0
    assert split["hidden_h2d"] > 0 and split["hidden_d2h"] > 0
    assert 1.0 < split["ratio"] < rows["pipelined"]["ratio"]


# Scheduled HLO by hand: a loop of 3 iterations copying a host buffer f32[3,256] (3 KiB) to a
# host buffer, and one device-to-host copy in ENTRY (a transfer, not a host copy).
_HLO = """\
HloModule m, is_scheduled=true

%body (t: (s32[], f32[3,256])) -> (s32[], f32[3,256]) {
  %t = (s32[], f32[3,256]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %h = f32[3,256]{1,0:S(5)} get-tuple-element(%t), index=1
  %hc = f32[3,256]{1,0:S(5)} copy(%h)
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[3,256]{1,0:S(5)}) tuple(%n, %hc)
}

%cond (t: (s32[], f32[3,256])) -> pred[] {
  %t = (s32[], f32[3,256]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

ENTRY %main (h: f32[3,256], d: f32[2,8]) -> ((s32[], f32[3,256]), f32[2,8]) {
  %h = f32[3,256]{1,0:S(5)} parameter(0)
  %d = f32[2,8]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[3,256]{1,0:S(5)}) tuple(%zero, %h)
  %loop = (s32[], f32[3,256]{1,0:S(5)}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %dc = f32[2,8]{1,0:S(5)} copy(%d)
  ROOT %out = ((s32[], f32[3,256]{1,0:S(5)}), f32[2,8]{1,0:S(5)}) tuple(%loop, %dc)
}
"""


def test_host_copy_bytes_counts_host_to_host_copies_per_step():
    """3 iterations x 3072 B; the device-to-host copy is not a host copy."""
    assert probe.host_copy_bytes(_HLO) == 3 * 3 * 256 * 4
    assert probe.host_copy_bytes(_HLO.replace(":S(5)", "")) == 0
