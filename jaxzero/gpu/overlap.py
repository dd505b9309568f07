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
"""

from __future__ import annotations

import dataclasses
import re

from jaxzero.gpu.hlo import collective_payloads, computation_multipliers, parse_computations

__all__ = ["OverlapTotal", "compute_computations", "overlap_per_step"]

_LIBRARY = re.compile(r'custom_call_target="__(?:cublas|cudnn)')
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCH_LIST = re.compile(r"\b(?:branch_computations|true_computation|false_computation)=([^,]*)")
_OPERAND = re.compile(r"-done\(\s*%?([\w.\-]+)")
_CONTROL = ("while", "call", "conditional")


@dataclasses.dataclass(frozen=True)
class OverlapTotal:
    """One collective kind per step: payload ``bytes`` and the ``hidden_bytes`` among them."""

    kind: str
    bytes: int
    hidden_bytes: int

    @property
    def share(self) -> float:
        """``hidden_bytes / bytes`` (1.0 when nothing moves)."""
        return self.hidden_bytes / self.bytes if self.bytes else 1.0


def _callees(line: str) -> list[str]:
    names = _CALLED.findall(line)
    for ref in _BRANCH_LIST.findall(line):
        names += re.findall(r"[\w.\-]+", ref.replace("%", ""))
    return names


def compute_computations(comps) -> set[str]:
    """Names of the computations (of :func:`~jaxzero.gpu.hlo.parse_computations`) that hold,
    directly or through those they call, a ``dot``, a ``convolution`` or a library
    ``custom-call`` (see the module docstring)."""
    direct = {
        name
        for name, ops in comps.items()
        if any(
            op in ("dot", "convolution") or (op == "custom-call" and _LIBRARY.search(line))
            for _, op, line in ops
        )
    }
    edges = {name: {c for _, _, line in ops for c in _callees(line)} for name, ops in comps.items()}
    found, changed = set(direct), True
    while changed:
        changed = False
        for name, called in edges.items():
            if name not in found and called & found:
                found.add(name)
                changed = True
    return found


def _is_compute(opcode: str, line: str, computing: set[str]) -> bool:
    if opcode == "custom-call":
        return bool(_LIBRARY.search(line))
    if opcode == "fusion" or opcode in _CONTROL:
        return any(c in computing for c in _callees(line))
    return False


def _hidden(comps) -> set[str]:
    """Names of the ``*-done`` instructions whose pair has a compute kernel in between, and of
    the computations wrapped by such an ``async-start`` (the collective inside is hidden)."""
    computing = compute_computations(comps)
    hidden = set()
    for ops in comps.values():
        started: dict[str, bool] = {}  # open *-start -> a compute kernel seen since
        wrapped = {}
        for name, opcode, line in ops:
            if opcode.endswith("-start"):
                started[name] = False
                wrapped[name] = _callees(line) if opcode == "async-start" else []
            elif opcode.endswith("-done"):
                m = _OPERAND.search(line)
                if m and started.pop(m.group(1), False):
                    hidden.update([name, *wrapped.get(m.group(1), [])])
            elif started and _is_compute(opcode, line, computing):
                started = dict.fromkeys(started, True)
    return hidden


def overlap_per_step(hlo: str, group_size: int) -> tuple[OverlapTotal, ...]:
    """Per collective kind: payload bytes per step and the bytes hidden behind compute (see
    the module docstring), loop trip counts applied. ``group_size`` as in
    :func:`~jaxzero.gpu.hlo.collectives_per_step`."""
    comps, _ = parse_computations(hlo)
    hidden = _hidden(comps)
    mult, _ = computation_multipliers(hlo)
    acc: dict[str, list[int]] = {}
    for op, per_dtype in collective_payloads(hlo, group_size, mult):
        total = sum(per_dtype.values())
        entry = acc.setdefault(op.kind, [0, 0])
        entry[0] += total
        covered = op.name in hidden if op.is_async else op.computation in hidden
        entry[1] += total if covered else 0
    return tuple(OverlapTotal(kind, b, h) for kind, (b, h) in sorted(acc.items()))
