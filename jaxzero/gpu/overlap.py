"""Which collectives the GPU schedule hides behind compute, read from scheduled HLO.

XLA:GPU runs a collective as an async pair: ``*-start`` launches it on a communication stream,
``*-done`` waits for it. Whatever the schedule places between the two runs while the bytes
move. This module counts a collective as **hidden** when at least one *compute kernel* is
scheduled strictly between its ``*-start`` and its ``*-done`` in the same computation, where a
compute kernel is:

* a ``custom-call`` to a library matmul, convolution or fused attention (target starting with
  ``__cublas`` or ``__cudnn``: ``__cublas$gemm``, ``__cublas$lt$matmul``,
  ``__cudnn$convForward``, ``__cudnn$fmhaSoftmax``, ...);
* a ``fusion`` whose fused computation (or one it calls) holds a ``dot`` or ``convolution``
  (XLA's Triton/cuBLAS gemm fusions such as ``gemm_fusion_dot.3``, cuDNN fusions);
* a ``while``, ``call`` or ``conditional`` whose executed computations launch one of the above
  (a collective in flight across a whole loop is hidden by the loop's gemms).

Element-wise fusions, copies and other collectives between the pair do not hide it: they are
memory-bound and short next to the transfer. Synchronous collectives (no ``*-start``) are
exposed. The share is byte-weighted: each collective's payload bytes (as
:func:`jaxzero.gpu.hlo.collectives_per_step` counts them) times how often its computation runs
per step (loop trip counts), hidden bytes over all bytes, per collective kind.

This is a reading of the schedule, not a timing: a 10 GB gather "hidden" by one small gemm is
still mostly exposed on hardware. It measures what the scheduler arranged, which is what the
XLA flags and jaxzero's per-layer collectives change.

**Hideable** bytes bound what any schedule of the same program could hide. A collective of the
ENTRY computation is hideable when some compute kernel of ENTRY depends neither on it nor it on
that kernel (the kernel is neither an ancestor of its ``*-start`` nor a descendant of its
``*-done`` in the data flow; control edges, which are the schedule's choices, are ignored).
A gather whose result every gemm of the step needs (the first layer's, a tied embedding's) or a
reduce-scatter of a gradient that the last gemm produces has none, so no scheduler, flag or
pipeliner can put compute under it within the step. Collectives in loop bodies and other
called computations are counted hideable (a pipeliner can move them across iterations), so
the figure is an upper bound: ``hidden_bytes <= hideable_bytes <= bytes``.
"""

from __future__ import annotations

import dataclasses

from jaxzero.gpu.hlo import collective_payloads, computation_multipliers
from jaxzero.memory.hlo import COLLECTIVE_KINDS
from jaxzero.memory.hlo_reader import Instruction, parse_hlo

__all__ = ["OverlapTotal", "compute_computations", "hidden_pairs", "overlap_per_step"]

_LIBRARIES = ("__cublas", "__cudnn")
_CONTROL = ("while", "call", "conditional")
# the attributes naming computations an instruction runs
_CALLED = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "branch_computations",
    "true_computation",
    "false_computation",
)


@dataclasses.dataclass(frozen=True)
class OverlapTotal:
    """One collective kind per step: payload ``bytes``, the ``hidden_bytes`` among them, and
    the ``hideable_bytes`` any schedule of the same data flow could hide (module docstring)."""

    kind: str
    bytes: int
    hidden_bytes: int
    hideable_bytes: int

    @property
    def share(self) -> float:
        """``hidden_bytes / bytes`` (1.0 when nothing moves)."""
        return self.hidden_bytes / self.bytes if self.bytes else 1.0

    @property
    def bound(self) -> float:
        """``hideable_bytes / bytes`` (1.0 when nothing moves)."""
        return self.hideable_bytes / self.bytes if self.bytes else 1.0


def _instructions(comps) -> dict[str, list[Instruction]]:
    """``comps`` (of :func:`~jaxzero.gpu.hlo.parse_computations`) as instructions; plain
    ``(name, opcode, line)`` tuples are read as instruction lines."""
    return {
        name: [
            op if isinstance(op, Instruction) else Instruction(*op, computation=name) for op in ops
        ]
        for name, ops in comps.items()
    }


def _library(inst: Instruction) -> bool:
    target = inst.custom_call_target
    return target is not None and target.startswith(_LIBRARIES)


def compute_computations(comps) -> set[str]:
    """Names of the computations (of :func:`~jaxzero.gpu.hlo.parse_computations`) that hold,
    directly or through those they call, a ``dot``, a ``convolution`` or a library
    ``custom-call`` (see the module docstring)."""
    comps = _instructions(comps)
    direct = {
        name
        for name, ops in comps.items()
        if any(
            inst.opcode in ("dot", "convolution")
            or (inst.opcode == "custom-call" and _library(inst))
            for inst in ops
        )
    }
    edges = {
        name: {c for inst in ops for c in inst.called(*_CALLED)} for name, ops in comps.items()
    }
    found, changed = set(direct), True
    while changed:
        changed = False
        for name, called in edges.items():
            if name not in found and called & found:
                found.add(name)
                changed = True
    return found


def _is_compute(opcode: str, line: str, computing: set[str]) -> bool:
    """Whether the instruction ``(opcode, line)`` is a compute kernel (module docstring)."""
    return _computes(Instruction("", opcode, line), computing)


def _computes(inst: Instruction, computing: set[str]) -> bool:
    if inst.opcode == "custom-call":
        return _library(inst)
    if inst.opcode == "fusion" or inst.opcode in _CONTROL:
        return any(c in computing for c in inst.called(*_CALLED))
    return False


def hidden_pairs(comps) -> set[str]:
    """Names of the ``*-done`` instructions of ``comps`` (of
    :func:`~jaxzero.gpu.hlo.parse_computations`) whose async pair has a compute kernel
    scheduled in between (the module docstring's reading; any async pair: collectives, host
    copies, async fusions), and of the computations wrapped by such an ``async-start``."""
    comps = _instructions(comps)
    computing = compute_computations(comps)
    hidden = set()
    for ops in comps.values():
        started: dict[str, bool] = {}  # open *-start -> a compute kernel seen since
        wrapped = {}
        for inst in ops:
            if inst.opcode.endswith("-start"):
                started[inst.name] = False
                wrapped[inst.name] = inst.called(*_CALLED) if inst.opcode == "async-start" else []
            elif inst.opcode.endswith("-done"):
                start = inst.done_of
                if start is not None and started.pop(start, False):
                    hidden.update([inst.name, *wrapped.get(start, [])])
            elif started and _computes(inst, computing):
                started = dict.fromkeys(started, True)
    return hidden


def _closure(start: str, edges: dict[str, set[str]]) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in edges.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _unhideable(ops: list[Instruction], computing: set[str]) -> set[str]:
    """Names (as :func:`hidden_pairs` gives them) of the collectives in ``ops`` (one
    computation) that no compute kernel of that computation is independent of (module
    docstring)."""
    by_name = {inst.name: inst for inst in ops}
    operands = {
        inst.name: {o for o in inst.refs if o in by_name and o != inst.name} for inst in ops
    }
    users: dict[str, set[str]] = {}
    for name, deps in operands.items():
        for d in deps:
            users.setdefault(d, set()).add(name)
    kernels = {inst.name for inst in ops if _computes(inst, computing)}
    out = set()
    for inst in ops:
        name, opcode = inst.name, inst.opcode
        if opcode.endswith("-done"):
            start = next(iter(operands[name]), name)
        elif opcode in COLLECTIVE_KINDS:
            start = name
        else:
            continue
        related = _closure(start, operands) | _closure(name, users) | {start, name}
        if not kernels - related:
            out.update([name, *by_name[start].called(*_CALLED)])
    return out


def overlap_per_step(hlo: str, group_size: int) -> tuple[OverlapTotal, ...]:
    """Per collective kind: payload bytes per step and the bytes hidden behind compute (see
    the module docstring), loop trip counts applied. ``group_size`` as in
    :func:`~jaxzero.gpu.hlo.collectives_per_step`."""
    module = parse_hlo(hlo)
    entry_name = module.entry
    hidden = hidden_pairs(module.computations)
    computing = compute_computations(module.computations)
    unhideable = _unhideable(module.computation(entry_name), computing)
    mult, _ = computation_multipliers(hlo)
    acc: dict[str, list[int]] = {}
    for op, per_dtype in collective_payloads(hlo, group_size, mult):
        total = sum(per_dtype.values())
        entry = acc.setdefault(op.kind, [0, 0, 0])
        entry[0] += total
        key = op.name if op.is_async else op.computation
        entry[1] += total if key in hidden else 0
        if op.computation == entry_name and not op.is_async:
            key = op.name  # a synchronous collective of ENTRY itself
        entry[2] += 0 if key in unhideable else total
    return tuple(OverlapTotal(kind, *v) for kind, v in sorted(acc.items()))
