"""A text report of a checkpoint directory (for ``jaxzero inspect``)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from jaxzero.checkpoint.io import (
    _has_item,
    _opened,
    _partial_saves,
    _read_metadata,
    _resolve_step,
)
from jaxzero.checkpoint.structure import EXTRA, _flat, _name, _stored_tree


# --------------------------------------------------------------------------------- inspect
def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


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


def inspect(directory, *, step: int | None = None) -> str:
    """A text report of a checkpoint directory.

    Lists the complete steps and any interrupted saves, then for ``step`` (default: the
    newest complete one) the jaxzero metadata (version, stage, mesh, precision, optimizer,
    user metadata) and every leaf's path, shape, dtype, bytes and partition spec. Reads
    metadata only (no arrays).
    """
    with _opened(directory) as mngr:
        lines = [f"checkpoint directory: {os.fspath(mngr.directory)}"]
        steps = sorted(mngr.all_steps())
        lines.append(f"complete steps: {', '.join(map(str, steps)) if steps else 'none'}")
        partial = _partial_saves(mngr.directory)
        if partial:
            lines.append(f"incomplete saves (ignored): {', '.join(partial)}")
        step = _resolve_step(mngr, step)
        lines.append("")
        lines.append(f"step {step}:")
        meta = _read_metadata(mngr, step)
        if meta is not None:
            mesh = meta.get("mesh")
            lines += [
                f"  jaxzero version: {meta.get('jaxzero_version')}",
                f"  ZeRO stage: {meta.get('stage')}",
                f"  mesh: {mesh} ({meta.get('num_devices')} devices, sharded over "
                f"{meta.get('axis')!r})",
                f"  precision: {meta.get('precision')}",
                f"  optimizer: {meta.get('optimizer')}",
                f"  optimizer state: {', '.join(meta.get('opt_state_types') or []) or 'none'}",
                f"  ema: {meta.get('has_ema')}",
                f"  train step: {meta.get('step')}",
            ]
            if meta.get("loss_scale"):
                lines.append(f"  loss scale: {meta['loss_scale']}")
            if meta.get("user") is not None:
                lines.append(f"  user metadata: {meta['user']}")
            rows = meta.get("leaves") or []
        else:
            lines.append("  (no jaxzero metadata: leaves from the Orbax tree metadata)")
            rows = []
            for path, m in _stored_tree(mngr, step).items():
                shape = tuple(getattr(m, "shape", ()) or ())
                dtype = jnp.dtype(getattr(m, "dtype", np.float32))
                rows.append(
                    {
                        "path": _name(path),
                        "shape": list(shape),
                        "dtype": dtype.name,
                        "bytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                    }
                )
        total = sum(r["bytes"] for r in rows)
        lines.append(f"  state: {len(rows)} leaves, {total} bytes ({_fmt_bytes(total)})")
        lines += ["    " + line for line in _table(rows)]
        if _has_item(mngr, step, EXTRA):
            md = mngr.item_metadata(step)
            extra = md[EXTRA] if EXTRA in md else None
            if extra is not None:
                erows = []
                for path, m in _flat(getattr(extra, "tree", extra)).items():
                    shape = tuple(getattr(m, "shape", ()) or ())
                    dtype = jnp.dtype(getattr(m, "dtype", np.float32))
                    erows.append(
                        {
                            "path": _name(path),
                            "shape": list(shape),
                            "dtype": dtype.name,
                            "bytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                        }
                    )
                lines.append(f"  extra: {len(erows)} leaves")
                lines += ["    " + line for line in _table(erows)]
        return "\n".join(lines)
