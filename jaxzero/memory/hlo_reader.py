"""The one reader of compiled HLO text: a module parsed once into its computations and their
instructions, which every HLO question in jaxzero (:mod:`jaxzero.memory.hlo`'s collectives,
:mod:`jaxzero.gpu.hlo`'s per-step counts, :mod:`jaxzero.gpu.transfers`,
:mod:`jaxzero.gpu.overlap`) is answered from.

A computation starts at a header line in column 0 (``[ENTRY] %name (params) -> type {``); an
instruction is a line ``[ROOT] %name = <type> <opcode>(<operands>), <attributes>``. An
:class:`Instruction` is the tuple ``(name, opcode, line)`` with the rest read from the line on
demand: the result type and its arrays (element type, dimensions, layout, memory space ``S(5)``
for pinned host memory), operands, called computations (``calls=``, ``to_apply=``, ``body=``,
``condition=``, branch lists), a ``while``'s ``known_trip_count``, ``replica_groups=``, and the
``*-start`` an async ``*-done`` waits for.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

__all__ = [
    "HOST_MEMORY",
    "Array",
    "HloModule",
    "Instruction",
    "arrays",
    "element_bits",
    "parse_hlo",
    "split_tuple",
    "strip_layouts",
    "type_bytes",
]

INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
# a computation header in column 0: [ENTRY] %name [(params) -> type] {
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)(?:\s.*|\s*\(.*\)\s*->.*)?\{\s*$")
_LAYOUT_RE = re.compile(r"\{[^{}]*\}|/\*.*?\*/")
# an array type: element type, dimensions (static, or bounded dynamic "<=8"), optional layout
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_STATIC_DIMS = re.compile(r"[0-9,]*")
# replica_groups= in the three syntaxes XLA prints: explicit {{0,1},{2,3}} (jax 0.10 on CPU);
# iota [2,4]<=[8] / [2,4]<=[4,2]T(1,0) (XLA:GPU); mesh axes mesh['r'=2,'d'=4] {'d'} (jax 0.12).
_GROUPS_RE = re.compile(
    r"replica_groups=(\{[{}0-9, ]*\}"
    r"|\[[0-9,]*\]<=\[[0-9,]*\](?:T\([0-9,]*\))?"
    r"|mesh\[[^\]]*\][^{,]*\{[^}]*\})"
)
_CALLED_RE = re.compile(
    r"\b(body|condition|to_apply|calls|branch_computations|called_computations"
    r"|true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_DONE_OF_RE = re.compile(r"-done\(\s*%?([\w.\-]+)")
_REF_RE = re.compile(r"%([\w.\-]+)")
_CONTROL_EDGES_RE = re.compile(r"control-predecessors=\{[^}]*\}")
HOST_MEMORY = "S(5)"  # the memory space of pinned host memory in a layout


def element_bits(dtype: str) -> int | None:
    """Bits per element of an HLO primitive type (pred 8, token 0, s4 4, bf16 16, f8e4m3fn 8,
    ...; sub-byte types are packed), None for a type this reader does not know."""
    if dtype in ("pred", "token"):
        return 8 if dtype == "pred" else 0
    m = re.fullmatch(r"(?:s|u|f|bf|c)(\d+)|f(\d)e\d+m\d+[a-z0-9]*", dtype)
    return int(m.group(1) or m.group(2)) if m else None


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a type text: ``f32[2,96,256]{2,1,0:S(5)}``."""

    text: str  # as printed, layout included
    dtype: str
    dims: str  # the text between the brackets: "2,96,256", "<=8", ""
    layout: str  # "{2,1,0:S(5)}", or "" when none is printed

    @property
    def static(self) -> bool:
        """Every dimension a plain integer (no bounded dynamic ``<=`` dimension)."""
        return _STATIC_DIMS.fullmatch(self.dims) is not None

    @property
    def rank(self) -> int:
        return len([d for d in self.dims.split(",") if d.strip()])

    @property
    def numel(self) -> int:
        """Elements (a bounded dynamic dimension ``<=n`` counts ``n``)."""
        return math.prod(int(d.replace("<=", "")) for d in self.dims.split(",") if d.strip())

    @property
    def in_host_memory(self) -> bool:
        """In pinned host memory (memory space 5 in the layout)."""
        return HOST_MEMORY in self.layout


def arrays(type_text: str) -> list[Array]:
    """The arrays of a type text (one, or a tuple's, nested tuples flattened), in order."""
    return [
        Array(m.group(0), m.group(1), m.group(2), m.group(3) or "")
        for m in _ARRAY_RE.finditer(type_text)
    ]


def type_bytes(type_text: str) -> tuple[int, tuple[str, ...]]:
    """``(bytes, element types)`` of a type text, summed over a tuple's arrays; an element type
    :func:`element_bits` does not know is an error."""
    total, dtypes = 0, []
    for a in arrays(type_text):
        bits = element_bits(a.dtype)
        if bits is None:
            raise ValueError(
                f"unknown HLO element type {a.dtype!r} in {type_text!r}; "
                "add its bit width to jaxzero.memory.hlo_reader.element_bits"
            )
        total += -(-a.numel * bits // 8)
        dtypes.append(a.dtype)
    return total, tuple(dtypes)


def strip_layouts(type_text: str) -> str:
    """A type text without its layouts (``{1,0}``) and ``/*index=N*/`` notes."""
    return _LAYOUT_RE.sub("", type_text).strip()


def split_tuple(type_text: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, (b, c), d)``; a non-tuple type alone."""
    inner = type_text.strip()
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


class Instruction(tuple):
    """One HLO instruction: the tuple ``(name, opcode, line)`` (opcode ``""`` where the line
    names none), its ``computation`` and the rest of the line read on demand."""

    computation: str | None

    def __new__(cls, name: str, opcode: str, line: str, computation: str | None = None):
        self = super().__new__(cls, (name, opcode, line))
        self.computation = computation
        return self

    def __getnewargs__(self):
        return (*self, self.computation)

    @classmethod
    def parse(cls, line: str, computation: str | None = None) -> Instruction | None:
        """The instruction of ``line``, or None when the line is not one."""
        m = INSTR_RE.match(line)
        if m is None:
            return None
        type_text, tail = _split_type(m.group(2).strip())
        opm = OPCODE_RE.match(tail)
        self = cls(m.group(1), opm.group(1) if opm else "", line, computation)
        self.__dict__.update(type=type_text, tail=tail)
        return self

    @property
    def name(self) -> str:
        return self[0]

    @property
    def opcode(self) -> str:
        return self[1]

    @property
    def line(self) -> str:
        return self[2]

    def _split(self) -> None:
        m = INSTR_RE.match(self.line)
        type_text, tail = _split_type(m.group(2).strip()) if m else ("", "")
        self.__dict__.update(type=type_text, tail=tail)

    @functools.cached_property
    def type(self) -> str:
        """The result type as printed, layouts included: ``f32[8,32]{1,0}``, ``(f32[8], s32[])``."""
        self._split()
        return self.__dict__["type"]

    @functools.cached_property
    def tail(self) -> str:
        """The line after the result type: ``opcode(operands), attributes``."""
        self._split()
        return self.__dict__["tail"]

    @functools.cached_property
    def shape(self) -> str:
        """The result type without layouts: ``f32[8,32]``."""
        return strip_layouts(self.type)

    @functools.cached_property
    def operands(self) -> tuple[str, ...]:
        """Names of the instructions in the operand list."""
        args = self.line.partition(f" {self.opcode}(")[2].split("), ")[0]
        return tuple(_REF_RE.findall(args))

    @functools.cached_property
    def refs(self) -> tuple[str, ...]:
        """Every ``%name`` the line mentions outside ``control-predecessors``: operands, called
        computations, its own name."""
        return tuple(_REF_RE.findall(_CONTROL_EDGES_RE.sub("", self.line)))

    @functools.cached_property
    def done_of(self) -> str | None:
        """For an async ``*-done``: the name of the ``*-start`` it waits for."""
        m = _DONE_OF_RE.search(self.line) if self.opcode.endswith("-done") else None
        return m.group(1) if m else None

    @functools.cached_property
    def calls(self) -> tuple[tuple[str, str], ...]:
        """``(attribute, computation)`` of every computation the instruction names, in line
        order: ``body``, ``condition``, ``to_apply``, ``calls``, and each of
        ``branch_computations`` / ``called_computations`` lists, ``true_computation``,
        ``false_computation``."""
        return tuple(
            (key, name)
            for key, ref in _CALLED_RE.findall(self.line)
            for name in re.findall(r"[\w.\-]+", ref)
        )

    def called(self, *keys: str) -> list[str]:
        """The computations named by the attributes ``keys`` (all of them without keys)."""
        return [name for key, name in self.calls if not keys or key in keys]

    @functools.cached_property
    def trip_count(self) -> int | None:
        """A ``while``'s ``known_trip_count`` from its backend config, None when not stated."""
        m = _TRIP_RE.search(self.line)
        return int(m.group(1)) if m else None

    @functools.cached_property
    def replica_groups(self) -> str | None:
        """The ``replica_groups=`` text as printed, None when the line states none."""
        m = _GROUPS_RE.search(self.tail)
        return m.group(1) if m else None

    @functools.cached_property
    def custom_call_target(self) -> str | None:
        m = _TARGET_RE.search(self.line)
        return m.group(1) if m else None

    @property
    def touches_host(self) -> bool:
        """The line names pinned host memory (``S(5)``) anywhere: result or operand types."""
        return HOST_MEMORY in self.line


@dataclasses.dataclass(frozen=True, eq=False)
class HloModule:
    """An HLO module's text, parsed: ``computations`` maps each computation's name to its
    instructions in text (for scheduled HLO: schedule) order; ``entry`` is the ENTRY
    computation's name; ``instructions`` every instruction in text order, those before any
    header included (``computation`` None)."""

    computations: dict[str, list[Instruction]]
    entry: str | None
    instructions: tuple[Instruction, ...]

    def computation(self, name: str | None) -> list[Instruction]:
        """The instructions of computation ``name`` (empty when there is none)."""
        return self.computations.get(name, [])

    @functools.cached_property
    def async_wrapped(self) -> frozenset[str]:
        """Computations an ``async-start`` runs (``calls=``): launched by that start."""
        return frozenset(
            name
            for inst in self.instructions
            if inst.opcode == "async-start"
            for name in inst.called("calls")[:1]
        )


@functools.lru_cache(maxsize=2)
def parse_hlo(hlo_text: str) -> HloModule:
    """Parse HLO text (``compiled.as_text()``) once; the same text gives the same module."""
    comps: dict[str, list[Instruction]] = {}
    instructions: list[Instruction] = []
    cur = entry = None
    for line in hlo_text.splitlines():
        if line[:1] not in (" ", "\t", ""):
            m = _HEADER_RE.match(line)
            if m and not line.startswith("HloModule"):
                cur = m.group(2)
                comps[cur] = []
                entry = cur if m.group(1) else entry
                continue
        inst = Instruction.parse(line, cur)
        if inst is None:
            continue
        instructions.append(inst)
        if cur is not None:
            comps[cur].append(inst)
    return HloModule(comps, entry, tuple(instructions))
