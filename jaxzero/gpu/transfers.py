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

from jaxzero.gpu.hlo import computation_multipliers, dtype_bytes
from jaxzero.gpu.overlap import hidden_pairs
from jaxzero.memory.hlo import COLLECTIVE_KINDS
from jaxzero.memory.hlo_reader import (
    HOST_MEMORY,
    Array,
    Instruction,
    arrays,
    parse_hlo,
    split_tuple,
)

__all__ = ["HostTransfers", "host_transfers_per_step"]

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


def _static(text: str) -> list[Array]:
    return [a for a in arrays(text) if a.static]


def _nbytes(found: list[Array]) -> int:
    return sum(sum(dtype_bytes(a.text).values()) for a in found)


def _sources_and_result(inst: Instruction, types: dict[str, str]):
    """``(operand arrays, result arrays)`` of one instruction; for an async start the
    operands and result its tuple type names."""
    if inst.opcode == "copy-start":
        parts = split_tuple(inst.type)  # (destination, source, context)
        return _static(parts[1]), _static(parts[0])
    if inst.opcode.endswith("-start"):
        parts = split_tuple(inst.type)  # ((operands...), result, context...)
        return _static(parts[0]), _static(parts[1])
    operands = [types[o] for o in inst.operands if o in types]
    return [a for t in operands for a in _static(t)], _static(inst.type)


def _direction(opcode: str, sources: list[Array], result: list[Array]) -> tuple[str, int] | None:
    """``("h2d" | "d2h", bytes)`` of an instruction between the memories, else None."""
    if any(a.in_host_memory for a in result):
        # a copy moves its operand, a scalar too; elsewhere a scalar operand is an index
        copy = opcode in ("copy", "copy-start")
        moved = [a for a in sources if not a.in_host_memory and (a.rank or copy)]
        return ("d2h", _nbytes(moved)) if moved else None
    if any(a.in_host_memory for a in sources):
        return "h2d", _nbytes(result)
    return None


def host_transfers_per_step(hlo: str) -> HostTransfers:
    """Host <-> device bytes per device per step of ``compiled.as_text()`` (module docstring),
    and the share of them the schedule hides behind compute."""
    if HOST_MEMORY not in hlo:
        return HostTransfers()
    module = parse_hlo(hlo)
    mult, _ = computation_multipliers(hlo)
    hidden = hidden_pairs(module.computations)
    acc = dict.fromkeys(("h2d", "d2h", "hidden_h2d", "hidden_d2h", "transfers", "launches"), 0)
    for name, k in mult.items():
        if name in module.async_wrapped:  # a wrapped computation: read at its async-start
            continue
        ops = module.computation(name)
        types = {inst.name: inst.type for inst in ops}
        starts = {inst.name: inst for inst in ops if inst.opcode.endswith("-start")}
        for inst in ops:
            opcode = inst.opcode
            if opcode in _STRUCTURAL or opcode.endswith("-start"):
                continue
            if opcode.endswith("-done"):
                start = starts.get(inst.done_of)
                if start is None:
                    continue
                if (
                    not start.touches_host
                    or start.opcode.removesuffix("-start") in COLLECTIVE_KINDS
                ):
                    continue
                found = _direction(start.opcode, *_sources_and_result(start, types))
                is_hidden = inst.name in hidden
            elif inst.touches_host:
                found = _direction(opcode, *_sources_and_result(inst, types))
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
