"""Small helpers shared by every part of jaxzero (the bottom of the import graph): key paths,
tree-structure checks, argument checks and number formatting. Imports nothing from jaxzero."""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

# dtype name -> the short precision name used by Precision.create, the CLI and metadata.
PRECISION_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def key_name(k) -> Any:
    """One key-path entry as its plain key: ``DictKey('w')`` -> ``'w'``, ``SequenceKey(0)`` -> 0."""
    return getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))


def subtree_names(value, error: str) -> tuple[str, ...]:
    """None, a name, or a sequence of names (params subtrees) as a tuple of names; raises
    ``TypeError(error)`` for anything else (an empty name included)."""
    names = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(names, tuple | list) or not all(isinstance(k, str) and k for k in names):
        raise TypeError(error)
    return tuple(names)


def path_keys(path) -> tuple:
    """A key path as plain keys: ``(DictKey('attn'), DictKey('kernel'))`` -> ``('attn', 'kernel')``."""
    return tuple(key_name(k) for k in path)


def path_strs(path) -> tuple[str, ...]:
    """A key path as strings: ``(DictKey('layers'), SequenceKey(0))`` -> ``('layers', '0')``."""
    return tuple(str(key_name(k)) for k in path)


def leaves_by_keystr(tree, *, is_leaf: Callable | None = None) -> list[tuple[str, Any]]:
    """``[(jax.tree_util.keystr(path), leaf), ...]`` in flatten order."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return [(jax.tree_util.keystr(k), v) for k, v in flat]


def check_same_structure(reference, other, what: str) -> None:
    """Raise ValueError naming the first path where ``other``'s tree or leaf shapes differ
    from ``reference``'s; ``what`` names the tree in the message."""
    ref = dict(jax.tree_util.tree_flatten_with_path(reference)[0])
    got = dict(jax.tree_util.tree_flatten_with_path(other)[0])
    if ref.keys() != got.keys():
        missing = [jax.tree_util.keystr(k) for k in ref if k not in got]
        extra = [jax.tree_util.keystr(k) for k in got if k not in ref]
        raise ValueError(
            f"{what} changed structure: missing paths {missing[:5]}, unexpected paths {extra[:5]}."
        )
    for k, r in ref.items():
        g = got[k]
        if tuple(np.shape(r)) != tuple(np.shape(g)):
            raise ValueError(
                f"{what} leaf at {jax.tree_util.keystr(k)} has shape {tuple(np.shape(r))} but "
                f"the new one has shape {tuple(np.shape(g))}."
            )


def batch_rows(batch, *, what: str = "batch", skip: Callable | None = None) -> dict[str, int]:
    """The leading (batch) dimension of every leaf of ``batch``, keyed by path.

    Leaves for which ``skip(leaf)`` is true are left out. Raises ValueError (naming the
    leaves) for an empty tree, a scalar leaf, or leaves that disagree on the leading dim.
    """
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not leaves:
        raise ValueError(f"{what} is an empty tree; pass the batch arrays.")
    rows = {}
    for path, x in leaves:
        if skip is not None and skip(x):
            continue
        if np.ndim(x) == 0:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every batch leaf needs "
                f"a leading batch dimension."
            )
        rows[jax.tree_util.keystr(path)] = np.shape(x)[0]
    if len(set(rows.values())) > 1:
        raise ValueError(
            f"{what} leaves disagree on the leading (batch) dimension: "
            + ", ".join(f"{k}: {v}" for k, v in rows.items())
            + "; every leaf must hold the same number of examples."
        )
    return rows


def check_int(value: Any, what: str, *, minimum: int = 1, whole_floats: bool = False) -> int:
    """``value`` as an int >= ``minimum``, or a TypeError/ValueError naming ``what``.

    ``whole_floats=True`` also accepts integral floats such as ``7.5e9``.
    """
    ok_float = whole_floats and isinstance(value, float)
    if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or ok_float):
        raise TypeError(
            f"{what} must be an integer, got {value!r} ({type(value).__name__}); "
            f"pass e.g. {what}={max(minimum, 8)}"
        )
    if ok_float and not float(value).is_integer():
        raise ValueError(f"{what} must be a whole number, got {value!r}; round it first")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return int(value)


def format_bytes(n: int | float, *, binary: bool = False) -> str:
    """A byte count for people: decimal units by default (``31.41 GB``, GB = 1e9), binary
    units with ``binary=True`` (``1.50 MiB``)."""
    if binary:
        units: Sequence[tuple[str, int]] = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20))
        units = (*units, ("KiB", 2**10))
    else:
        units = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def node_types(tree) -> list[str]:
    """Names of the NamedTuple nodes of a pytree (e.g. an optax state), depth first."""
    out = []

    def walk(x):
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            out.append(type(x).__name__)
            for v in x:
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(tree)
    return out


def leaf_rows_under(rows, field: str) -> list[dict]:
    """The rows of a checkpoint's leaf table (``{"path": "params.fc1.kernel", ...}``) that lie
    under the state field ``field`` (e.g. ``"params"``)."""
    return [r for r in rows if str(r["path"]).split(".", 1)[0] == field]


_OPAQUE = re.compile(r"<function |<[\w.]+ object\b")


def readable_repr(text) -> str | None:
    """A repr ``text`` without memory addresses, or None when it only names functions or
    objects: ``GradientTransformationExtraArgs(init=<function chain.<locals>.init_fn>, ...)``
    says nothing of the optax chain (its state's node types do)."""
    if text is None:
        return None
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(text))
    return None if _OPAQUE.search(text) else text


def check_not_donated(tree, where: str = "a train step") -> None:
    """Raise ValueError when ``tree`` (a state, or any tree of arrays) has deleted buffers:
    it was donated to ``where``, which returned the state to use instead."""
    deleted = [k for k, x in leaves_by_keystr(tree) if isinstance(x, jax.Array) and x.is_deleted()]
    if deleted:
        raise ValueError(
            f"this state was donated to {where} (its buffers, e.g. "
            f"{', '.join(deleted[:3])}, are deleted); use the state the step returned: "
            f"state, metrics = step(state, batch). Build the step with donate=False to keep "
            f"every state alive (at the cost of a second copy in memory)."
        )
