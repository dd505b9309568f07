"""The one HLO reader (jaxzero.memory.hlo_reader) on a small hand-written module: every
expected figure is read off the text below by hand."""

import pytest

from jaxzero import gpu
from jaxzero.memory import collective_ops
from jaxzero.memory.hlo_reader import Instruction, arrays, parse_hlo, split_tuple, type_bytes

# ENTRY runs a counted loop (3 trips) whose body fetches a host buffer (S(5)) with an async
# copy and runs a fusion; after it ENTRY writes a device buffer back with a synchronous copy
# and all-gathers it.
HLO = """HloModule m, is_scheduled=true

%fused (p0: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  ROOT %n = f32[4,8]{1,0} negate(%p0)
}

%cond (c: (s32[], f32[4,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0:S(5)}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %k), direction=LT
}

%body (b: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %b = (s32[], f32[4,8]{1,0:S(5)}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %h = f32[4,8]{1,0:S(5)} get-tuple-element(%b), index=1
  %cs = (f32[4,8]{1,0}, f32[4,8]{1,0:S(5)}, u32[]) copy-start(%h)
  %cd = f32[4,8]{1,0} copy-done(%cs)
  %f = f32[4,8]{1,0} fusion(%cd), kind=kLoop, calls=%fused
  ROOT %t = (s32[], f32[4,8]{1,0:S(5)}) tuple(%i, %h)
}

ENTRY %main (x: f32[4,8]) -> f32[32,8] {
  %x = f32[4,8]{1,0:S(5)} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0:S(5)}) tuple(%zero, %x)
  %w = (s32[], f32[4,8]{1,0:S(5)}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %y = f32[4,8]{1,0:S(5)} get-tuple-element(%w), index=1
  %d = f32[4,8]{1,0} negate(%y)
  %back = f32[4,8]{1,0:S(5)} copy(%d)
  %ags = (f32[4,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%d), replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %agd = f32[32,8]{1,0} all-gather-done(%ags)
}
"""  # noqa: E501


def _by_name():
    return {inst.name: inst for inst in parse_hlo(HLO).instructions}


def test_reader_splits_computations_and_instructions():
    module = parse_hlo(HLO)
    assert module.entry == "main"
    assert list(module.computations) == ["fused", "cond", "body", "main"]
    assert [len(ops) for ops in module.computations.values()] == [2, 4, 7, 9]
    assert len(module.instructions) == 22
    assert [i.opcode for i in module.computation("body")] == [
        "parameter",
        "get-tuple-element",
        "get-tuple-element",
        "copy-start",
        "copy-done",
        "fusion",
        "tuple",
    ]
    assert all(i.computation == "body" for i in module.computation("body"))
    assert parse_hlo(HLO) is module  # parsed once per text


def test_reader_reads_loops_calls_and_async_pairs():
    inst = _by_name()
    w = inst["w"]
    assert w.trip_count == 3 and w.operands == ("init",)
    assert w.called("body") == ["body"] and w.called("condition") == ["cond"]
    assert inst["f"].called("calls") == ["fused"] and inst["f"].called() == ["fused"]
    assert inst["cd"].done_of == "cs" and inst["agd"].done_of == "ags"
    assert inst["ags"].replica_groups == "[1,8]<=[8]" and inst["agd"].replica_groups is None
    assert inst["agd"].shape == "f32[32,8]" and inst["agd"].type == "f32[32,8]{1,0}"
    # an instruction is the tuple (name, opcode, line)
    name, opcode, line = inst["d"]
    assert (name, opcode) == ("d", "negate") and line.strip().startswith("%d = ")
    assert inst["d"] == Instruction("d", "negate", line)


def test_reader_reads_host_memory_and_bytes():
    destination, source, context = split_tuple(_by_name()["cs"].type)
    assert [a.in_host_memory for a in arrays(destination)] == [False]
    assert [a.in_host_memory for a in arrays(source)] == [True]
    assert arrays(context)[0].dtype == "u32" and arrays(context)[0].rank == 0
    assert type_bytes("(f32[4,8]{1,0}, bf16[3]{0}, pred[])") == (
        4 * 32 + 2 * 3 + 1,
        ("f32", "bf16", "pred"),
    )
    (dynamic,) = arrays("f32[<=8,2]{1,0}")
    assert dynamic.numel == 16 and not dynamic.static
    with pytest.raises(ValueError, match="'opaque'"):
        type_bytes("opaque[2]")


def test_readers_built_on_it_count_the_snippet():
    """jaxzero's readers on the snippet: the loop body runs 3 times; it fetches f32[4,8]
    (128 bytes) from the host each time; ENTRY writes 128 bytes back once."""
    mult, known = gpu.computation_multipliers(HLO)
    assert known and mult == {"main": 1, "body": 3}
    # main: negate, copy, all-gather-start; body x3: copy-start, fusion
    assert gpu.kernels_per_step(HLO) == 3 + 3 * 2
    t = gpu.host_transfers_per_step(HLO)
    assert (t.h2d_bytes, t.d2h_bytes, t.hidden_bytes) == (3 * 128, 128, 0)
    assert (t.transfers, t.launches) == (2, 3 + 1)
    (ag,) = collective_ops(HLO)
    assert (ag.kind, ag.name, ag.bytes, ag.is_async) == ("all-gather", "agd", 32 * 8 * 4, True)
    assert (ag.computation, ag.replica_groups) == ("main", "[1,8]<=[8]")
