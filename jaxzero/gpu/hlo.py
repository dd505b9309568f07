"""Reading compiled (scheduled) XLA HLO per executed step: loop trip counts, collectives by
kind and dtype, and kernels launched.

Works on any backend's ``compiled.as_text()``; written for XLA:GPU's, where collectives are
async ``*-start``/``*-done`` pairs (each counted once, by :func:`jaxzero.memory.collective_ops`),
several gradients share one combined reduce-scatter, and scanned layers are ``while`` loops
annotated ``backend_config={"known_trip_count":{"n":"K"}, ...}``.
"""

from __future__ import annotations

import dataclasses
import re

from jaxzero.memory import collective_ops
from jaxzero.memory.hlo import INSTR_RE, OPCODE_RE, replica_group_size, replica_groups

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_REF = r"%?([\w.\-]+)"
_BODY = re.compile(r"\bbody=" + _REF)
_COND = re.compile(r"\bcondition=" + _REF)
_BRANCHES = re.compile(
    r"\b(?:branch_computations|true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TO_APPLY = re.compile(r"\bto_apply=" + _REF)
_CALLS = re.compile(r"\bcalls=" + _REF)
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")

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


def _opcode(rest: str) -> str | None:
    """The opcode of an instruction's right-hand side ``<type> <opcode>(...)``."""
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth, end = 0, len(rest)
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                end = i
                break
        rest = rest[end + 1 :]
    else:
        rest = rest.partition(" ")[2]
    m = OPCODE_RE.match(rest.strip())
    return m.group(1) if m else None


def parse_computations(hlo: str) -> tuple[dict[str, list[tuple[str, str, str]]], str | None]:
    """``({computation: [(instruction, opcode, line), ...]}, entry name)`` of HLO text."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    cur, entry = None, None
    for line in hlo.splitlines():
        if line[:1] not in (" ", "\t", ""):
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                cur = m.group(2)
                comps[cur] = []
                entry = cur if m.group(1) else entry
            continue
        m = INSTR_RE.match(line)
        if m and cur is not None:
            comps[cur].append((m.group(1), _opcode(m.group(2).strip()) or "", line))
    return comps, entry


def _callees(opcode: str, line: str, trip_known: bool) -> list[tuple[str, int | None]]:
    """Computations an instruction runs, with their repeat count (None: the loop's trip
    count). Fusion bodies, reducers and comparators are not executed computations."""
    if opcode == "while":
        out = [(_BODY.search(line).group(1), None)]
        if not trip_known:  # a counted loop needs no condition kernel per iteration
            out.append((_COND.search(line).group(1), None))
        return out
    if opcode == "conditional":
        m = _BRANCHES.findall(line)
        return [(name, 1) for ref in m for name in re.findall(r"[\w.\-]+", ref)]
    if opcode == "call":
        m = _TO_APPLY.search(line)
        return [(m.group(1), 1)] if m else []
    if opcode == "async-start":  # a wrapped collective (counted by collective_ops inside)
        m = _CALLS.search(line)
        return [(m.group(1), 1)] if m else []
    return []


def computation_multipliers(hlo: str) -> tuple[dict[str, int], bool]:
    """How often each executed computation runs per step: ENTRY once, a while body its
    ``known_trip_count`` times its caller's count (nested loops multiply), conditional branches
    and called computations as often as their caller (an upper bound for branches).

    Returns ``(multipliers, all_trips_known)``; a loop without a known trip count is counted
    once per entry into it and makes the flag False.
    """
    comps, entry = parse_computations(hlo)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text().")
    mult, known, stack = {entry: 1}, True, [entry]
    while stack:
        name = stack.pop()
        for _, opcode, line in comps.get(name, []):
            trip = _TRIP.search(line) if opcode == "while" else None
            if opcode == "while" and trip is None:
                known = False
            for callee, times in _callees(opcode, line, trip is not None):
                times = times if times is not None else (int(trip.group(1)) if trip else 1)
                k = mult[name] * times
                if callee in comps and k > mult.get(callee, 0):
                    mult[callee] = k
                    stack.append(callee)
    return mult, known


def kernels_per_step(hlo: str) -> int:
    """Device operations launched per step: every instruction of every executed computation
    (ENTRY, while bodies x trip count, conditional branches, called computations) except
    bookkeeping and control flow (parameters, constants, tuples, bitcasts, ``while`` itself,
    ...) and the ``*-done`` halves of async pairs. A fusion is one kernel, a library call
    (``custom-call``: cuBLAS/cuDNN) one, a collective one (at its ``*-start``), a ``copy`` one.
    Computations inside fusions, reducers and comparators are not counted; neither is a
    counted loop's condition (XLA:GPU runs known-trip-count loops without it).
    """
    comps, _ = parse_computations(hlo)
    mult, _ = computation_multipliers(hlo)
    wrapped = {
        m.group(1)
        for ops in comps.values()
        for _, op, line in ops
        if op == "async-start" and (m := _CALLS.search(line))
    }
    total = 0
    for name, k in mult.items():
        if name in wrapped:  # launched by its async-start, counted there
            continue
        ops = comps.get(name, [])
        total += k * sum(
            1 for _, op, _ in ops if op and op not in _FREE and not op.endswith("-done")
        )
    return total


def _result_type(line: str) -> str:
    """The result type text of an instruction line (``%x = <type> opcode(...)``)."""
    rest = INSTR_RE.match(line).group(2).strip()
    if not rest.startswith("("):
        return rest.partition(" ")[0]
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return rest[: i + 1]
    return rest


def kernel_bytes_per_step(hlo: str, computation: str | None = None) -> int:
    """Bytes the kernels of the ENTRY computation (or ``computation``) read and write: for
    every counted instruction (as :func:`kernels_per_step` counts them) its result plus each
    operand's result, once per operand. An upper bound for a kernel that updates a buffer in
    place or reads only a slice of an operand; exact for element-wise kernels."""
    comps, entry = parse_computations(hlo)
    ops = comps.get(computation or entry, [])
    size = {name: sum(_dtype_bytes(_result_type(line)).values()) for name, _, line in ops}
    total = 0
    for name, op, line in ops:
        if not op or op in _FREE or op.endswith("-done"):
            continue
        args = line.partition(f" {op}(")[2]
        operands = re.findall(r"%([\w.\-]+)", args.split("), ")[0])
        total += size[name] + sum(size.get(o, 0) for o in operands)
    return total


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


_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16}


def _dtype_bytes(shape: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype)
        if bits is None:
            m = re.search(r"(\d+)", dtype)
            bits = int(m.group(1)) if dtype[0] in "fsuc" and m and not dtype.startswith("f8") else 8
        numel = 1
        for d in dims.split(","):
            numel *= int(d) if d.strip() else 1
        out[dtype] = out.get(dtype, 0) + -(-numel * bits // 8)
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
        out.append((op, {dt: b * scale * k for dt, b in _dtype_bytes(op.shape).items()}))
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
