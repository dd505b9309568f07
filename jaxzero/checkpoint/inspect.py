"""A text report of a checkpoint directory (for ``jaxzero inspect``)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from jaxzero import trees
from jaxzero.checkpoint.adopt import describe_plain
from jaxzero.checkpoint.io import (
    _has_item,
    _opened,
    _partial_saves,
    _read_metadata,
    _resolve_step,
)
from jaxzero.checkpoint.structure import EXTRA, _flat, _row, _stored_tree


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
        _row(path, tuple(getattr(m, "shape", ()) or ()), jnp.dtype(getattr(m, "dtype", np.float32)))
        for path, m in flat.items()
    ]


def _metadata_lines(meta: dict) -> list[str]:
    optimizer = trees.readable_repr(meta.get("optimizer"))  # None: optax closures, say nothing
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
    if not _has_item(mngr, step, EXTRA):
        return []
    md = mngr.item_metadata(step)
    extra = md[EXTRA] if EXTRA in md else None
    if extra is None:
        return []
    rows = _rows(_flat(getattr(extra, "tree", extra)))
    return [f"  extra: {len(rows)} leaves"] + ["    " + line for line in _table(rows)]


def inspect(directory, *, step: int | None = None) -> str:
    """A text report of a checkpoint directory.

    Lists the complete steps and any interrupted saves, then for ``step`` (default: the
    newest complete one) the jaxzero metadata (version, stage, mesh, precision, optimizer,
    ``layers=``, ``units=`` and ``offload=`` where saved, user metadata) and every leaf's
    path, shape, dtype, bytes and partition spec. Reads metadata only (no arrays).
    """
    plain = describe_plain(directory)
    if plain:
        raise ValueError(f"not a jaxzero checkpoint:{plain}")
    with _opened(directory) as mngr:
        lines = [f"checkpoint directory: {os.fspath(mngr.directory)}"]
        steps = sorted(mngr.all_steps())
        lines.append(f"complete steps: {', '.join(map(str, steps)) if steps else 'none'}")
        partial = _partial_saves(mngr.directory)
        if partial:
            lines.append(f"incomplete saves (ignored): {', '.join(partial)}")
        step = _resolve_step(mngr, step)
        lines += ["", f"step {step}:"]
        meta = _read_metadata(mngr, step)
        if meta is not None:
            lines += _metadata_lines(meta)
            rows = meta.get("leaves") or []
        else:
            lines.append("  (no jaxzero metadata: leaves from the Orbax tree metadata)")
            rows = _rows(_stored_tree(mngr, step))
        total = sum(r["bytes"] for r in rows)
        size = trees.format_bytes(total, binary=True)
        lines.append(f"  state: {len(rows)} leaves, {total} bytes ({size})")
        lines += ["    " + line for line in _table(rows)]
        lines += _extra_lines(mngr, step)
        return "\n".join(lines)
