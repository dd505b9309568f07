"""Host <-> device transfers per step, read from compiled (scheduled) XLA:GPU HLO.

With ``ZeRO(offload=...)`` the state lives in pinned host memory, which XLA writes as memory
space 5 in a layout (``f32[2,96,256]{2,1,0:S(5)}``). The compiled GPU step moves bytes across
PCIe with async pairs, as it runs collectives:

* ``copy-start``/``copy-done``: a whole array copied; ``copy-start``'s tuple is
  ``(destination, source, context)``, the ``copy-done``'s result the destination;
* ``fusion-start``/``fusion-done`` of a wrapped ``dynamic-slice`` (a slice of a host buffer
  fetched: a chunk of the streamed update, one layer of an offloaded stack) or
  ``dynamic-update-slice`` (a device slice written into a host buffer); the start's tuple is
  ``((operands...), result, context)``.

A synchronous instruction between the memories (a scalar ``copy`` to ``S(5)``) counts too,
as exposed. An instruction moves bytes **host to device** when its result is in device memory
and an operand in host memory (the result's bytes: the slice fetched), and **device to host**
when its result is in host memory and an operand on the device (those operands' bytes, index
scalars left out: the slice written). Each is multiplied by how often its computation runs
per step (:func:`jaxzero.gpu.hlo.computation_multipliers`: the streamed update's chunk loops,
the layer loops). A transfer is **hidden** when the schedule places a compute kernel between
its start and its done, the reading :mod:`jaxzero.gpu.overlap` makes for collectives
(:func:`jaxzero.gpu.overlap.hidden_pairs`).
"""

from __future__ import annotations

import dataclasses
import re

from jaxzero.gpu.hlo import (
    _CALLS,
    _dtype_bytes,
    _result_type,
    computation_multipliers,
    parse_computations,
)
from jaxzero.gpu.overlap import hidden_pairs
from jaxzero.memory.hlo import COLLECTIVE_KINDS

__all__ = ["HostTransfers", "host_transfers_per_step"]

# an array type with its layout: element type, dimensions, the layout braces
_TYPED = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HOST = "S(5)"
# instructions that move no bytes of their own between the memories
_STRUCTURAL = frozenset(
    {
        "parameter",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "call",
        "conditional",
        "opt-barrier",
        "constant",
        "after-all",
        "add-dependency",
    }
)


@dataclasses.dataclass(frozen=True)
class HostTransfers:
    """Bytes per device per step between pinned host memory and the GPU, loop trip counts
    applied: ``h2d_bytes`` fetched, ``d2h_bytes`` written back, and the ``hidden_*`` among
    them (a compute kernel between the transfer's start and done). ``transfers``: transfer
    instructions in the HLO; ``launches``: those times their computations' run counts."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    hidden_h2d_bytes: int = 0
    hidden_d2h_bytes: int = 0
    transfers: int = 0
    launches: int = 0

    @property
    def bytes(self) -> int:
        """Both directions."""
        return self.h2d_bytes + self.d2h_bytes

    @property
    def hidden_bytes(self) -> int:
        return self.hidden_h2d_bytes + self.hidden_d2h_bytes

    @property
    def exposed_bytes(self) -> int:
        return self.bytes - self.hidden_bytes

    @property
    def share(self) -> float:
        """``hidden_bytes / bytes`` (1.0 when nothing moves)."""
        return self.hidden_bytes / self.bytes if self.bytes else 1.0


def _split_tuple(text: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, (b, c), d)``."""
    inner = text.strip()
    if not inner.startswith("("):
        return [inner]
    inner = inner[1 : inner.rindex(")")]
    out, depth, cur = [], 0, []
    for ch in inner:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur).strip())
    return out


def _arrays(text: str) -> list[tuple[str, bool, int]]:
    """``[(type text, in host memory, rank), ...]`` of every array type in ``text``."""
    out = []
    for m in _TYPED.finditer(text):
        rank = len([d for d in m.group(2).split(",") if d.strip()])
        out.append((m.group(0), _HOST in (m.group(3) or ""), rank))
    return out


def _nbytes(types) -> int:
    return sum(sum(_dtype_bytes(t).values()) for t in types)


def _sources_and_result(opcode: str, line: str, types: dict[str, str]):
    """``(operand arrays, result arrays)`` of one instruction, each ``(type, host, rank)``;
    for an async start the operands and result its tuple type names."""
    result = _result_type(line)
    if opcode == "copy-start":
        parts = _split_tuple(result)  # (destination, source, context)
        return _arrays(parts[1]), _arrays(parts[0])
    if opcode.endswith("-start"):
        parts = _split_tuple(result)  # ((operands...), result, context...)
        return _arrays(parts[0]), _arrays(parts[1])
    args = line.partition(f" {opcode}(")[2].split("), ")[0]
    operands = [types[o] for o in re.findall(r"%([\w.\-]+)", args) if o in types]
    return [a for t in operands for a in _arrays(t)], _arrays(result)


def _direction(opcode: str, sources, result) -> tuple[str, int] | None:
    """``("h2d" | "d2h", bytes)`` of an instruction between the memories, else None."""
    if any(host for _, host, _ in result):
        # a copy moves its operand, a scalar too; elsewhere a scalar operand is an index
        copy = opcode in ("copy", "copy-start")
        moved = [t for t, host, rank in sources if not host and (rank or copy)]
        return ("d2h", _nbytes(moved)) if moved else None
    if any(host for _, host, _ in sources):
        return "h2d", _nbytes(t for t, _, _ in result)
    return None


def host_transfers_per_step(hlo: str) -> HostTransfers:
    """Host <-> device bytes per device per step of ``compiled.as_text()`` (module docstring),
    and the share of them the schedule hides behind compute."""
    if _HOST not in hlo:
        return HostTransfers()
    comps, _ = parse_computations(hlo)
    mult, _ = computation_multipliers(hlo)
    hidden = hidden_pairs(comps)
    wrapped = {
        m.group(1)
        for ops in comps.values()
        for _, op, line in ops
        if op == "async-start" and (m := _CALLS.search(line))
    }
    acc = dict.fromkeys(("h2d", "d2h", "hidden_h2d", "hidden_d2h", "transfers", "launches"), 0)
    for name, k in mult.items():
        if name in wrapped:  # a wrapped computation: read at its async-start
            continue
        ops = comps.get(name, [])
        types = {n: _result_type(line) for n, _, line in ops}
        starts = {n: (op, line) for n, op, line in ops if op.endswith("-start")}
        for inst, opcode, line in ops:
            if opcode in _STRUCTURAL or opcode.endswith("-start"):
                continue
            if opcode.endswith("-done"):
                start = re.search(r"-done\(\s*%?([\w.\-]+)", line)
                if start is None or start.group(1) not in starts:
                    continue
                s_op, s_line = starts[start.group(1)]
                if _HOST not in s_line or s_op.removesuffix("-start") in COLLECTIVE_KINDS:
                    continue
                found = _direction(s_op, *_sources_and_result(s_op, s_line, types))
                is_hidden = inst in hidden
            elif _HOST in line:
                found = _direction(opcode, *_sources_and_result(opcode, line, types))
                is_hidden = False
            else:
                continue
            if found is None:
                continue
            way, nbytes = found
            acc[way] += k * nbytes
            acc[f"hidden_{way}"] += k * nbytes if is_hidden else 0
            acc["transfers"] += 1
            acc["launches"] += k
    return HostTransfers(
        acc["h2d"],
        acc["d2h"],
        acc["hidden_h2d"],
        acc["hidden_d2h"],
        acc["transfers"],
        acc["launches"],
    )
