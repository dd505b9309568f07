"""Reading compiled HLO text: the collectives XLA emitted and their per-device bytes."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_COMP_RE = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_LAYOUT_RE = re.compile(r"\{[^{}]*\}|/\*.*?\*/")
_GROUPS_RE = re.compile(  # explicit {{0,1},{2,3}} or iota [2,4]<=[8] / [2,4]<=[4,2]T(1,0)
    r"replica_groups=(\{[{}0-9, ]*\}|\[[0-9,]*\]<=\[[0-9,]*\](?:T\([0-9,]*\))?)"
)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective in compiled HLO; ``bytes`` is its per-device output size."""

    kind: str  # one of COLLECTIVE_KINDS
    name: str  # HLO instruction name (of the -done op for async pairs)
    shape: str  # HLO result type, e.g. "f32[8,32]" or "(f32[8], bf16[4])"
    bytes: int
    dtypes: tuple[str, ...]
    is_async: bool
    computation: str | None
    replica_groups: str | None


def _element_bits(dtype: str) -> int | None:
    """Bits per element of an HLO primitive type: pred 8, s4 4, bf16 16, f8e4m3fn 8, ..."""
    if dtype in ("pred", "token"):
        return 8 if dtype == "pred" else 0
    m = re.fullmatch(r"(?:s|u|f|bf|c)(\d+)|f(\d)e\d+m\d+[a-z0-9]*", dtype)
    return int(m.group(1) or m.group(2)) if m else None  # sub-byte types are packed


def _type_bytes(type_text: str) -> tuple[int, tuple[str, ...]]:
    total, dtypes = 0, []
    for dtype, dims in _ARRAY_RE.findall(type_text):
        bits = _element_bits(dtype)
        if bits is None:
            raise ValueError(
                f"unknown HLO element type {dtype!r} in {type_text!r}; "
                "add its bit width to jaxzero.memory.hlo._element_bits"
            )
        numel = math.prod(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())
        total += -(-numel * bits // 8)
        dtypes.append(dtype)
    return total, tuple(dtypes)


def _split_type(rest: str) -> tuple[str, str]:
    """Split ``"<type> <opcode>(..."`` into the type text and the remainder."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    return rest, ""


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
    """List the collectives in HLO text (``jax.jit(f).lower(...).compile().as_text()``).

    Async pairs (``all-reduce-start``/``-done`` etc.) are counted once, at the
    ``-done`` op, whose result is the real output (a ``-start`` result is a tuple
    that also holds the operand). Collectives wrapped in ``async-start`` are
    found inside their wrapped computation. Counts are static: a collective in a
    while-loop body appears once however many iterations run.

    Args:
        hlo_text: the HLO module as text.

    Returns:
        One :class:`CollectiveOp` per collective, in text order.
    """
    if not isinstance(hlo_text, str):
        raise TypeError(
            f"collective_ops needs HLO text (str), got {type(hlo_text).__name__}; "
            "pass jax.jit(f).lower(*args).compile().as_text()"
        )
    ops, computation, starts = [], None, {}
    for line in hlo_text.splitlines():
        instr = INSTR_RE.match(line)
        if not instr:
            comp = _COMP_RE.match(line)
            computation = comp.group(1) if comp else computation
            continue
        type_text, tail = _split_type(instr.group(2).strip())
        opm = OPCODE_RE.match(tail)
        if not opm:
            continue
        opcode, name = opm.group(1), instr.group(1)
        groups = _GROUPS_RE.search(tail)
        groups = groups.group(1) if groups else None
        if opcode.endswith("-start"):  # counted at its "-done"; keep its replica groups
            starts[name] = groups
            continue
        is_async = opcode.endswith("-done")
        kind = opcode[: -len("-done")] if is_async else opcode
        if kind not in COLLECTIVE_KINDS:
            continue
        if is_async:
            operand = re.search(r"%?([\w.\-]+)\)", tail[opm.end() - 1 :])
            groups = starts.get(operand.group(1)) if operand else None
        shape = _LAYOUT_RE.sub("", type_text).strip()  # drop {1,0} layouts, /*index*/ notes
        nbytes, dtypes = _type_bytes(shape)
        ops.append(CollectiveOp(kind, name, shape, nbytes, dtypes, is_async, computation, groups))
    return ops


def collective_bytes(hlo_text: str) -> dict[str, dict[str, Any]]:
    """Count collectives in compiled HLO text and sum their per-device output bytes.

    Bytes come from each op's HLO result type: elements x element size (f32=4,
    bf16=f16=2, s32=4, pred=1, ...), summed over tuple results.

    Args:
        hlo_text: ``jax.jit(f).lower(*args).compile().as_text()``.

    Returns:
        ``{kind: {"count": int, "bytes": int, "ops": [CollectiveOp, ...]}}`` for every
        kind in :data:`COLLECTIVE_KINDS` (zeros when absent). E.g. the largest
        all-reduce is ``max(d["all-reduce"]["ops"], key=lambda o: o.bytes)``.
    """
    out = {k: {"count": 0, "bytes": 0, "ops": []} for k in COLLECTIVE_KINDS}
    for op in collective_ops(hlo_text):
        entry = out[op.kind]
        entry["count"] += 1
        entry["bytes"] += op.bytes
        entry["ops"].append(op)
    return out
