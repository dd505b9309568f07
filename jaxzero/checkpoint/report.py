"""Reports on a checkpoint directory (for ``jaxzero inspect``): :func:`inspect` renders its
steps, metadata and leaves as text (metadata only, no array read), :func:`verify` reads every
array and reports the damaged steps (``jaxzero inspect --verify``)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero.checkpoint.integrity as integrity
import jaxzero.checkpoint.nvme as nvme
import jaxzero.checkpoint.quiet as quiet
from jaxzero.checkpoint.adopt import describe_plain
from jaxzero.checkpoint.integrity import CheckpointDamagedError
from jaxzero.checkpoint.io import (
    has_item,
    opened,
    partial_saves,
    read_metadata,
    resolve_step,
    stored_tree,
)
from jaxzero.checkpoint.structure import EXTRA, STATE, flat_leaves, leaf_name, leaf_row
from jaxzero.trees import format_bytes, readable_repr


# --------------------------------------------------------------------------------- inspect
def _table(rows: list[dict]) -> list[str]:
    head = ("path", "shape", "dtype", "bytes", "spec")
    cells = [
        (r["path"], str(tuple(r["shape"])), r["dtype"], str(r["bytes"]), r.get("spec") or "")
        for r in rows
    ]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)
    ]
    fmt = lambda c: "  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip()
    return [fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(c) for c in cells]


def _rows(flat: dict) -> list[dict]:
    """:func:`~jaxzero.checkpoint.leaf_table` rows (without specs) from Orbax's flat array
    metadata."""
    return [
        leaf_row(
            path, tuple(getattr(m, "shape", ()) or ()), jnp.dtype(getattr(m, "dtype", np.float32))
        )
        for path, m in flat.items()
    ]


def _metadata_lines(meta: dict) -> list[str]:
    optimizer = readable_repr(meta.get("optimizer"))  # None: optax closures, say nothing
    lines = [
        f"  jaxzero version: {meta.get('jaxzero_version')}",
        f"  ZeRO stage: {meta.get('stage')}",
        f"  mesh: {meta.get('mesh')} ({meta.get('num_devices')} devices, sharded over "
        f"{meta.get('axis')!r})",
        f"  precision: {meta.get('precision')}",
        *([f"  optimizer: {optimizer}"] if optimizer else []),
        f"  optimizer state: {', '.join(meta.get('opt_state_types') or []) or 'none'}",
        f"  ema: {meta.get('has_ema')}",
        f"  train step: {meta.get('step')}",
    ]
    if meta.get("loss_scale"):
        lines.append(f"  loss scale: {meta['loss_scale']}")
    for key in ("layers", "units", "offload"):
        if meta.get(key):  # absent in checkpoints written before these were saved
            lines.append(f"  {key}: {meta[key]}")
    if meta.get("user") is not None:
        lines += _outline("user metadata", meta["user"], "  ")
    return lines


WIDTH = 100  # a value whose repr fits in a line this wide stays on its key's line
LIST_HEAD = 4  # a long list shows its first items, then how many more


def _outline(key: str, value, indent: str) -> list[str]:
    """``key: value`` as indented lines: a value that fits in :data:`WIDTH` on one line,
    else a dict key by key and a list item by item (``- ...``, its first :data:`LIST_HEAD`
    items and a count of the rest)."""
    text = value if isinstance(value, str) else repr(value)
    if len(f"{indent}{key}: {text}") <= WIDTH or not isinstance(value, dict | list | tuple):
        return [f"{indent}{key}: {text}"]
    if isinstance(value, dict):
        return [f"{indent}{key}:", *_entries(value, indent + "  ")]
    return [f"{indent}{key}: ({len(value)} items)", *_items(value, indent + "  ")]


def _entries(value: dict, indent: str) -> list[str]:
    return [line for k, v in value.items() for line in _outline(str(k), v, indent)]


def _items(value, indent: str) -> list[str]:
    lines = []
    for item in value[:LIST_HEAD]:
        text = f"{indent}- {item!r}"
        if len(text) <= WIDTH or not isinstance(item, dict) or not item:
            lines.append(text)
        else:  # a long dict item, YAML style: "- key: ..." then its other keys beneath
            sub = _entries(item, indent + "  ")
            lines += [f"{indent}- {sub[0][len(indent) + 2 :]}", *sub[1:]]
    if len(value) > LIST_HEAD:
        lines.append(f"{indent}- ... ({len(value) - LIST_HEAD} more)")
    return lines


def _extra_lines(mngr, step: int) -> list[str]:
    if not has_item(mngr, step, EXTRA):
        return []
    md = mngr.item_metadata(step)
    extra = md[EXTRA] if EXTRA in md else None
    if extra is None:
        return []
    rows = _rows(flat_leaves(getattr(extra, "tree", extra)))
    return [f"  extra: {len(rows)} leaves"] + ["    " + line for line in _table(rows)]


def inspect(directory, *, step: int | None = None) -> str:
    """A text report of a checkpoint directory.

    Lists the complete steps and any interrupted saves, then for ``step`` (default: the
    newest complete one) the jaxzero metadata (version, stage, mesh, precision, optimizer,
    ``layers=``, ``units=`` and ``offload=`` where saved, user metadata) and every leaf's
    path, shape, dtype, bytes and partition spec (the NVMe tier's disk leaves in a table of
    their own). Reads metadata only (no arrays).
    """
    plain = describe_plain(directory)
    if plain:
        raise ValueError(f"not a jaxzero checkpoint:{plain}")
    with opened(directory) as mngr:
        lines = [f"checkpoint directory: {os.fspath(mngr.directory)}"]
        steps = sorted(mngr.all_steps())
        lines.append(f"complete steps: {', '.join(map(str, steps)) if steps else 'none'}")
        partial = partial_saves(mngr.directory)
        if partial:
            lines.append(f"incomplete saves (ignored): {', '.join(partial)}")
        step = resolve_step(mngr, step)
        lines += ["", f"step {step}:"]
        meta = read_metadata(mngr, step)
        if meta is not None:
            lines += _metadata_lines(meta)
            rows = meta.get("leaves") or []
        else:
            lines.append("  (no jaxzero metadata: leaves from the Orbax tree metadata)")
            rows = _rows(stored_tree(mngr, step))
        total = sum(r["bytes"] for r in rows)
        size = format_bytes(total, binary=True)
        lines.append(f"  state: {len(rows)} leaves, {total} bytes ({size})")
        lines += ["    " + line for line in _table(rows)]
        disk = ((meta or {}).get(nvme.ITEM) or {}).get("leaves")
        if disk:  # the NVMe tier's leaves, in the step's nvme item
            total = sum(r["bytes"] for r in disk)
            size = format_bytes(total, binary=True)
            lines.append(
                f"  on disk (the NVMe tier's {nvme.ITEM} item): {len(disk)} leaves, {total} bytes ({size})"
            )
            lines += ["    " + line for line in _table(disk)]
        lines += _extra_lines(mngr, step)
        return "\n".join(lines)


# --------------------------------------------------------------------------------- verify
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
        meta = read_metadata(mngr, step) or {}
        stored = stored_tree(mngr, step)
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
        named = {leaf_name(k): v for k, v in flat_leaves(out[STATE]).items()}
        if out.get(EXTRA) is not None:
            named.update({"extra." + leaf_name(k): v for k, v in flat_leaves(out[EXTRA]).items()})
        checked = integrity.check(named, sums, step=step, directory=directory, files=files)
        if has_item(mngr, step, nvme.ITEM):  # the NVMe tier's disk leaves, a group at a time
            more, read = nvme.verify_groups(mngr, step, lambda shape: _spread(shape, mesh))
            checked, leaves = checked + more, leaves + read
    except CheckpointDamagedError as e:
        return StepReport(step, False, 0, leaves, str(e), e.leaf, e.file)
    except (ValueError, TypeError, OSError) as e:
        return StepReport(step, False, 0, leaves, integrity.first_line(e))
    return StepReport(step, True, checked, leaves)


def _read_quietly(mngr, step: int, mesh: Mesh, files):
    """``(every item read, None)`` or ``(None, the read's CheckpointDamagedError)``, with what
    a failed read leaves behind collected at once, unreported (:mod:`.quiet`)."""
    items = {STATE: ocp.args.StandardRestore(_target_from(mngr, step, mesh))}
    if has_item(mngr, step, EXTRA):
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
    with opened(directory) as mngr:
        first = resolve_step(mngr, step)
        steps = [first] if step is not None else sorted(mngr.all_steps(), reverse=True)
        mesh = Mesh(np.asarray(jax.devices()), ("all",))
        reports = tuple(_verify_step(mngr, s, mesh) for s in steps)
        return VerifyReport(
            os.fspath(mngr.directory), reports, tuple(partial_saves(mngr.directory))
        )
