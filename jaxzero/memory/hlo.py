"""Reading compiled HLO text: the collectives XLA emitted and their per-device bytes."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from jaxzero.memory.hlo_reader import parse_hlo, type_bytes

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_IOTA_RE = re.compile(r"\[([0-9,]*)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?")
_MESH_RE = re.compile(r"mesh\[([^\]]*)\]\s*(.*?)\s*\{([^}]*)\}")
_MESH_AXIS_RE = re.compile(r"'([^']+)'(?:=|:\(\d+\))(\d+)")


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
    replica_groups: str | None  # as printed; read it with replica_groups() / replica_group_size()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def replica_groups(text: str | None) -> tuple[tuple[int, ...], ...] | None:
    """The device ids of each replica group, from a collective's ``replica_groups=`` text
    (:attr:`CollectiveOp.replica_groups`) in any of XLA's three syntaxes:

    - explicit ``{{0,1},{2,3}}``;
    - iota ``[G,S]<=[d0,d1,...]`` with an optional transpose ``T(p0,p1,...)``: the ids
      ``0..n-1`` laid out as ``[d0,d1,...]``, transposed, read as G groups of S;
    - mesh axes ``mesh['r'=2,'d'=4] {'d'}`` (jax >= 0.12): the ids laid out on the mesh in
      order; a group is the devices that differ only along the listed axes.

    ``None`` when ``text`` is None or its device order is not the plain one (a mesh form with
    more than axes and sizes); :func:`replica_group_size` still reads those.

    Examples: ``replica_groups("[2,4]<=[4,2]T(1,0)") == ((0, 2, 4, 6), (1, 3, 5, 7))``;
    ``replica_groups("mesh['r'=2,'d'=4] {'r'}") == ((0, 4), (1, 5), (2, 6), (3, 7))``.
    """
    if text is None:
        return None
    if text.startswith("{"):
        return tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9, ]*)\}", text[1:-1]))
    iota = _IOTA_RE.fullmatch(text)
    if iota:
        shape, dims = _ints(iota.group(1)), _ints(iota.group(2))
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose(_ints(iota.group(3)))
        return tuple(tuple(int(i) for i in g) for g in ids.reshape(shape[0], -1))
    mesh = _MESH_RE.fullmatch(text)
    if mesh is None or mesh.group(2):
        return None
    axes = _MESH_AXIS_RE.findall(mesh.group(1))
    names = [a for a, _ in axes]
    chosen = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(3))]
    ids = np.arange(math.prod(int(n) for _, n in axes)).reshape([int(n) for _, n in axes])
    kept = [i for i in range(len(axes)) if i not in chosen]
    size = math.prod(ids.shape[i] for i in chosen)
    return tuple(tuple(int(i) for i in g) for g in ids.transpose(kept + chosen).reshape(-1, size))


def replica_group_size(text: str | None) -> int | None:
    """Devices per replica group of a ``replica_groups=`` text (any syntax, see
    :func:`replica_groups`), or None when ``text`` is None or unreadable."""
    groups = replica_groups(text)
    if groups:
        return len(groups[0])
    mesh = _MESH_RE.fullmatch(text or "")
    if mesh is None:
        return None
    sizes = dict(_MESH_AXIS_RE.findall(mesh.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(3)))


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
    ops, starts = [], {}
    for inst in parse_hlo(hlo_text).instructions:
        opcode = inst.opcode
        if not opcode:
            continue
        if opcode.endswith("-start"):  # counted at its "-done"; keep its replica groups
            starts[inst.name] = inst.replica_groups
            continue
        is_async = opcode.endswith("-done")
        kind = opcode.removesuffix("-done")
        if kind not in COLLECTIVE_KINDS:
            continue
        groups = starts.get(inst.done_of) if is_async else inst.replica_groups
        nbytes, dtypes = type_bytes(inst.shape)
        ops.append(
            CollectiveOp(
                kind, inst.name, inst.shape, nbytes, dtypes, is_async, inst.computation, groups
            )
        )
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
