"""The per-leaf sharding rule: which dimension of each leaf is split over the data axis.

One rule serves every stage and every state component: a leaf of shape ``s`` is sharded on
its largest dimension divisible by ``N`` (the size of the data axis; ties go to the earliest
dimension). Because the rule depends on the shape alone, optimizer-state leaves that mirror a
parameter (Adam's ``mu``/``nu``, MultiSteps' accumulators, the EMA) land in exactly the
parameter's shards, and leaves of other shapes (Adafactor's factored rows/columns, scalar
counters) get a consistent placement of their own without jaxzero knowing the optimizer.

A leaf with no dimension divisible by ``N`` (a bias of 31 elements on 8 devices, a scalar) is
replicated. See BUILD_NOTES.md for why we replicate rather than pad, and the measured cost.

Stacked layers (``nn.scan``: every leaf of a layer stack carries the layer index on axis 0) are
named by the key of their subtree (``stacked=("layers",)``): any leaf whose path holds that key
(the params, and the optimizer-state and EMA leaves that mirror them) is never split along
axis 0, so each scanned layer is a slice of whole shards and can be gathered on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def shard_dim(shape: Sequence[int], n: int) -> int | None:
    """The dimension of ``shape`` to split ``n`` ways, or None to replicate.

    Returns the largest dimension whose size is a positive multiple of ``n`` (earliest on
    ties); None when ``n == 1`` or no dimension qualifies.
    """
    if n <= 1:
        return None
    best = None
    for d, size in enumerate(shape):
        if size > 0 and size % n == 0 and (best is None or size > shape[best]):
            best = d
    return best


def leaf_spec(shape: Sequence[int], n: int, axis: str, *, stacked: bool = False) -> P:
    """``PartitionSpec`` that shards ``shape`` over ``axis`` per :func:`shard_dim`; a
    ``stacked`` leaf (layer index on axis 0) is split along one of its other dimensions."""
    skip = 1 if stacked else 0
    d = shard_dim(tuple(shape)[skip:], n)
    if d is None:
        return P()
    return P(*([None] * (d + skip) + [axis]))


def path_keys(path) -> tuple:
    """A key path as plain keys: ``(DictKey('attn'), DictKey('kernel'))`` -> ``('attn', 'kernel')``."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def is_stacked(path, stacked: Sequence[str]) -> bool:
    """Whether a leaf's key path runs through one of the ``stacked`` subtree names."""
    return bool(stacked) and any(k in stacked for k in path_keys(path))


def tree_specs(tree, n: int, axis: str, *, shard: bool = True, stacked: Sequence[str] = ()):
    """PartitionSpecs for every leaf of ``tree`` (arrays or ShapeDtypeStructs).

    With ``shard=False`` every leaf is replicated (``P()``). Leaves under a ``stacked`` key
    keep axis 0 whole (see the module docstring).
    """
    if not shard:
        return jax.tree.map(lambda _: P(), tree)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: leaf_spec(x.shape, n, axis, stacked=is_stacked(path, stacked)), tree
    )


def named(mesh: Mesh, specs):
    """Map a tree of PartitionSpecs to NamedShardings on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def spec_dim(spec: P) -> int | None:
    """The sharded dimension of a spec built by :func:`leaf_spec` (None if replicated)."""
    for d, entry in enumerate(spec):
        if entry is not None:
            return d
    return None


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
