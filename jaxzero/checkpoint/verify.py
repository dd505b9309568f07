"""Read every array of a checkpoint directory and report the damaged steps (for ``jaxzero
inspect --verify``)."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero.checkpoint.integrity as integrity
import jaxzero.checkpoint.quiet as quiet
from jaxzero.checkpoint.integrity import CheckpointDamagedError
from jaxzero.checkpoint.io import _has_item, _opened, _partial_saves, _read_metadata, _resolve_step
from jaxzero.checkpoint.structure import EXTRA, STATE, _flat, _name, _stored_tree


@dataclasses.dataclass(frozen=True)
class StepReport:
    """One step's verification.

    Attributes:
      step: the step.
      ok: every array was read and matched its checksum (or, without checksums, was read).
      checked: leaves compared with a saved checksum (0: the step has none).
      leaves: array leaves read.
      problem: why the step is damaged (None when ok).
      leaf: the damaged leaf, when known.
      file: the damaged file (relative to the checkpoint directory), when known.
    """

    step: int
    ok: bool
    checked: int
    leaves: int
    problem: str | None = None
    leaf: str | None = None
    file: str | None = None


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """:func:`verify`'s result: ``steps`` (newest first), the incomplete saves (ignored by
    restore) and ``ok`` (no damaged step)."""

    directory: str
    steps: tuple[StepReport, ...]
    incomplete: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    @property
    def damaged(self) -> tuple[int, ...]:
        return tuple(s.step for s in self.steps if not s.ok)

    def __str__(self) -> str:
        lines = [f"checkpoint directory: {self.directory}"]
        for s in self.steps:
            if s.ok:
                how = f"{s.checked}/{s.leaves} checksums match" if s.checked else "read"
                note = "" if s.checked else " (saved without checksums: read, not compared)"
                lines.append(f"  step {s.step}: ok ({how}){note}")
            else:
                lines.append(f"  step {s.step}: DAMAGED: {s.problem}")
        if self.incomplete:
            lines.append(f"  incomplete saves (ignored): {', '.join(self.incomplete)}")
        lines.append("all steps verify" if self.ok else f"damaged steps: {list(self.damaged)}")
        return "\n".join(lines)


def _spread(shape, mesh: Mesh) -> NamedSharding:
    """Split the first dimension divisible by the device count (else replicate): every
    device reads a part, no device holds a whole large leaf."""
    n = mesh.size
    for d, size in enumerate(shape):
        if size % n == 0 and size >= n:
            return NamedSharding(mesh, P(*([None] * d), "all"))
    return NamedSharding(mesh, P())


def _is_array_meta(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _target_from(mngr, step: int, mesh: Mesh):
    """The stored tree (Orbax's metadata: its own nesting) as ShapeDtypeStructs spread over
    ``mesh``."""
    md = mngr.item_metadata(step)[STATE]

    def leaf(m):
        shape = tuple(getattr(m, "shape", ()) or ())
        return jax.ShapeDtypeStruct(shape, m.dtype, sharding=_spread(shape, mesh))

    return jax.tree.map(leaf, getattr(md, "tree", md), is_leaf=_is_array_meta)


def _verify_step(mngr, step: int, mesh: Mesh) -> StepReport:
    directory = os.fspath(mngr.directory)
    leaves = 0
    try:
        meta = _read_metadata(mngr, step) or {}
        stored = _stored_tree(mngr, step)
        leaves = len(stored)
        files = integrity.step_files(directory, step, (STATE, EXTRA))
        problem = out = None
        if files.damaged:  # a missing or truncated file: found before any array is read
            problem = integrity.files_error(files, step=step, directory=directory)
        else:
            out, problem = _read_quietly(mngr, step, mesh, files)
        if integrity.any_process_failed(problem):
            raise problem or integrity.read_error(None, step=step, directory=directory)
        sums = meta.get(integrity.KEY)
        named = {_name(k): v for k, v in _flat(out[STATE]).items()}
        if out.get(EXTRA) is not None:
            named.update({"extra." + _name(k): v for k, v in _flat(out[EXTRA]).items()})
        checked = integrity.check(named, sums, step=step, directory=directory, files=files)
    except CheckpointDamagedError as e:
        return StepReport(step, False, 0, leaves, str(e), e.leaf, e.file)
    except (ValueError, TypeError, OSError) as e:
        return StepReport(step, False, 0, leaves, integrity.first_line(e))
    return StepReport(step, True, checked, leaves)


def _read_quietly(mngr, step: int, mesh: Mesh, files):
    """``(every item read, None)`` or ``(None, the read's CheckpointDamagedError)``, with what
    a failed read leaves behind collected at once, unreported (:mod:`.quiet`)."""
    items = {STATE: ocp.args.StandardRestore(_target_from(mngr, step, mesh))}
    if _has_item(mngr, step, EXTRA):
        items[EXTRA] = ocp.args.StandardRestore()
    directory = os.fspath(mngr.directory)
    try:
        return mngr.restore(step, args=ocp.args.Composite(**items)), None
    except Exception as e:  # noqa: BLE001 - reported
        problem = integrity.read_error(e, step=step, directory=directory, files=files)
    quiet.collect_leftovers()
    return None, problem


def verify(directory, step: int | None = None) -> VerifyReport:
    """Read every array of every complete step (or only ``step``) and compare it with the
    checksum saved with it.

    The arrays are read spread over all devices (no device holds a whole large leaf); with
    several processes every process must call it (each reads and hashes its part). Steps
    saved before checksums existed are read (a missing or truncated file is still found) but
    not compared. Nothing is written.

    Returns:
      A :class:`VerifyReport` (``str()`` renders it; ``.ok``, ``.damaged``).

    Raises:
      FileNotFoundError: no such directory, no complete step, or ``step`` not complete.
    """
    with _opened(directory) as mngr:
        first = _resolve_step(mngr, step)
        steps = [first] if step is not None else sorted(mngr.all_steps(), reverse=True)
        mesh = Mesh(np.asarray(jax.devices()), ("all",))
        reports = tuple(_verify_step(mngr, s, mesh) for s in steps)
        return VerifyReport(
            os.fspath(mngr.directory), reports, tuple(_partial_saves(mngr.directory))
        )
