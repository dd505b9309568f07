"""Reading compiled (scheduled) XLA HLO per executed step: loop trip counts, collectives by
kind and dtype, and kernels launched.

Works on any backend's ``compiled.as_text()``; written for XLA:GPU's, where collectives are
async ``*-start``/``*-done`` pairs (each counted once, by :func:`jaxzero.memory.collective_ops`),
several gradients share one combined reduce-scatter, and scanned layers are ``while`` loops
annotated ``backend_config={"known_trip_count":{"n":"K"}, ...}``.
"""

from __future__ import annotations

import dataclasses

from jaxzero.memory import collective_ops
from jaxzero.memory.hlo import replica_group_size, replica_groups
from jaxzero.memory.hlo_reader import Instruction, arrays, element_bits, parse_hlo

# Instructions that launch nothing on the device: bookkeeping, aliasing views, control flow
# (whose bodies are counted instead) and the waiting half of async pairs.
_FREE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "conditional",
        "call",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "partition-id",
        "replica-id",
        "domain",
    }
)


def parse_computations(hlo: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """``({computation: [(instruction, opcode, line), ...]}, entry name)`` of HLO text; each
    entry is a :class:`jaxzero.memory.hlo_reader.Instruction` (that tuple, read further on
    demand)."""
    module = parse_hlo(hlo)
    return {name: list(ops) for name, ops in module.computations.items()}, module.entry


def _callees(inst: Instruction) -> list[tuple[str, int | None]]:
    """Computations an instruction runs, with their repeat count (None: the loop's trip
    count). Fusion bodies, reducers and comparators are not executed computations."""
    opcode = inst.opcode
    if opcode == "while":
        out = [(inst.called("body")[0], None)]
        if inst.trip_count is None:  # a counted loop needs no condition kernel per iteration
            out.append((inst.called("condition")[0], None))
        return out
    if opcode == "conditional":
        keys = ("branch_computations", "true_computation", "false_computation")
        return [(name, 1) for name in inst.called(*keys)]
    if opcode == "call":
        return [(name, 1) for name in inst.called("to_apply")[:1]]
    if opcode == "async-start":  # a wrapped collective (counted by collective_ops inside)
        return [(name, 1) for name in inst.called("calls")[:1]]
    return []


def computation_multipliers(hlo: str) -> tuple[dict[str, int], bool]:
    """How often each executed computation runs per step: ENTRY once, a while body its
    ``known_trip_count`` times its caller's count (nested loops multiply), conditional branches
    and called computations as often as their caller (an upper bound for branches).

    Returns ``(multipliers, all_trips_known)``; a loop without a known trip count is counted
    once per entry into it and makes the flag False.
    """
    module = parse_hlo(hlo)
    comps, entry = module.computations, module.entry
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text().")
    mult, known, stack = {entry: 1}, True, [entry]
    while stack:
        name = stack.pop()
        for inst in comps.get(name, []):
            trip = inst.trip_count if inst.opcode == "while" else None
            if inst.opcode == "while" and trip is None:
                known = False
            for callee, times in _callees(inst):
                times = times if times is not None else (trip if trip is not None else 1)
                k = mult[name] * times
                if callee in comps and k > mult.get(callee, 0):
                    mult[callee] = k
                    stack.append(callee)
    return mult, known


def _launches(inst: Instruction) -> bool:
    """The instruction launches a device operation (see :func:`kernels_per_step`)."""
    op = inst.opcode
    return bool(op) and op not in _FREE and not op.endswith("-done")


def kernels_per_step(hlo: str) -> int:
    """Device operations launched per step: every instruction of every executed computation
    (ENTRY, while bodies x trip count, conditional branches, called computations) except
    bookkeeping and control flow (parameters, constants, tuples, bitcasts, ``while`` itself,
    ...) and the ``*-done`` halves of async pairs. A fusion is one kernel, a library call
    (``custom-call``: cuBLAS/cuDNN) one, a collective one (at its ``*-start``), a ``copy`` one.
    Computations inside fusions, reducers and comparators are not counted; neither is a
    counted loop's condition (XLA:GPU runs known-trip-count loops without it).
    """
    module = parse_hlo(hlo)
    mult, _ = computation_multipliers(hlo)
    total = 0
    for name, k in mult.items():
        if name in module.async_wrapped:  # launched by its async-start, counted there
            continue
        total += k * sum(1 for inst in module.computation(name) if _launches(inst))
    return total


def kernel_bytes_per_step(hlo: str, computation: str | None = None) -> int:
    """Bytes the kernels of the ENTRY computation (or ``computation``) read and write: for
    every counted instruction (as :func:`kernels_per_step` counts them) its result plus each
    operand's result, once per operand. An upper bound for a kernel that updates a buffer in
    place or reads only a slice of an operand; exact for element-wise kernels."""
    module = parse_hlo(hlo)
    ops = module.computation(computation or module.entry)
    size = {inst.name: sum(dtype_bytes(inst.type).values()) for inst in ops}
    return sum(
        size[inst.name] + sum(size.get(o, 0) for o in inst.operands)
        for inst in ops
        if _launches(inst)
    )


@dataclasses.dataclass(frozen=True)
class CollectiveTotal:
    """One (kind, dtype) of collectives per step.

    ``ops``: collective instructions in the HLO (a combined op counts once per dtype it holds);
    ``launches``: those times their loop trip counts; ``bytes``: payload per device per step
    (all-reduce / all-gather / all-to-all / collective-permute: output bytes; reduce-scatter:
    output bytes x group size, i.e. its input).
    """

    kind: str
    dtype: str
    ops: int
    launches: int
    bytes: int


def dtype_bytes(shape: str) -> dict[str, int]:
    """Bytes per element type of a type text's arrays with static dimensions; an element
    type of no known width (``token``, ``opaque``, ...) counts a byte per element.

    Args:
      shape: an HLO type text, e.g. ``"(bf16[8,128]{1,0}, f32[])"``.

    Returns:
      ``{element type: bytes}`` over the arrays in ``shape``.
    """
    out: dict[str, int] = {}
    for a in arrays(shape):
        if not a.static:
            continue
        bits = element_bits(a.dtype)
        bits = 8 if bits is None or a.dtype == "token" else bits
        out[a.dtype] = out.get(a.dtype, 0) + -(-a.numel * bits // 8)
    return out


def collective_payloads(hlo: str, group_size: int, mult: dict[str, int] | None = None):
    """``[(CollectiveOp, {dtype: payload bytes per step}), ...]``: each collective's payload
    (see :class:`CollectiveTotal`) times how often its computation runs (``mult``, default
    :func:`computation_multipliers`)."""
    mult = computation_multipliers(hlo)[0] if mult is None else mult
    out = []
    for op in collective_ops(hlo):
        k = mult.get(op.computation, 1)
        scale = 1
        if op.kind == "reduce-scatter":
            scale = replica_group_size(op.replica_groups) or group_size
        out.append((op, {dt: b * scale * k for dt, b in dtype_bytes(op.shape).items()}))
    return out


def collectives_per_step(hlo: str, group_size: int) -> tuple[CollectiveTotal, ...]:
    """Collectives by (kind, dtype), with payload bytes multiplied by loop trip counts.

    ``group_size`` is used for reduce-scatters whose replica groups the text does not state
    in a form :func:`jaxzero.memory.replica_group_size` reads: the size of the data axis.
    """
    mult, _ = computation_multipliers(hlo)
    acc: dict[tuple[str, str], list[int]] = {}
    for op, payload in collective_payloads(hlo, group_size, mult):
        for dtype, nbytes in payload.items():
            entry = acc.setdefault((op.kind, dtype), [0, 0, 0])
            entry[0] += 1
            entry[1] += mult.get(op.computation, 1)
            entry[2] += nbytes
    return tuple(CollectiveTotal(kd, dt, *v) for (kd, dt), v in sorted(acc.items()))


def cross_node_bytes(hlo: str, node: int, group_size: int) -> int:
    """Payload bytes per device per step (as :func:`collectives_per_step` counts them) of the
    collectives whose replica groups span more than one node, a node being ``node``
    consecutive device ids (DeepSpeed's count: a collective over devices of several nodes
    moves its bytes across them; one within each node moves none). A collective whose
    groups the text does not list (all devices, or an unreadable form) counts as spanning."""
    total = 0
    for op, payload in collective_payloads(hlo, group_size):
        groups = replica_groups(op.replica_groups)
        within = bool(groups) and all(len({i // node for i in g}) == 1 for g in groups)
        total += 0 if within else sum(payload.values())
    return total
