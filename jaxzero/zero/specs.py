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
Where layers are gathered one at a time (per-layer stage 3: ``contiguous=True``) a stack is
split along its *first* divisible non-layer dimension instead: each layer's shard is then a
contiguous block and its all-gather (and its gradient's reduce-scatter) runs along the major
dimension. Split along a minor one, XLA:GPU transposes the whole fp32 master stack to make
the gathered dimension major before the layer loop, a full-size copy held through the step
(29.4 MB of the 8-layer GPT's 778.0 MB per device at N = 8: BUILD_NOTES decision 23).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.trees import path_strs


def shard_dim(shape: Sequence[int], n: int, *, first: bool = False) -> int | None:
    """The dimension of ``shape`` to split ``n`` ways, or None to replicate.

    Returns the largest dimension whose size is a positive multiple of ``n`` (earliest on
    ties; with ``first``, the earliest such dimension); None when ``n == 1`` or no dimension
    qualifies.
    """
    if n <= 1:
        return None
    best = None
    for d, size in enumerate(shape):
        if size > 0 and size % n == 0 and (best is None or size > shape[best]):
            if first:
                return d
            best = d
    return best


def leaf_spec(
    shape: Sequence[int], n: int, axis: str, *, stacked: bool = False, contiguous: bool = False
) -> P:
    """``PartitionSpec`` that shards ``shape`` over ``axis`` per :func:`shard_dim`; a
    ``stacked`` leaf (layer index on axis 0) is split along one of its other dimensions: the
    first divisible one when ``contiguous`` (see the module docstring)."""
    skip = 1 if stacked else 0
    d = shard_dim(tuple(shape)[skip:], n, first=stacked and contiguous)
    return dim_spec(None if d is None else d + skip, axis)


def dim_spec(d: int | None, axis: str) -> P:
    """The ``PartitionSpec`` splitting dimension ``d`` over ``axis`` (``P()`` when None)."""
    return P() if d is None else P(*([None] * d + [axis]))


def subtree_end(path, names: Sequence[str]) -> int | None:
    """Where in a leaf's key path the first of the subtree ``names`` ends (the index of the
    key after it), or None when the path runs through none. A name matches one key
    (``"layers"``) or, written ``"outer/inner"``, consecutive keys."""
    keys = path_strs(path)
    for i in range(len(keys)):
        for name in names:
            parts = tuple(name.split("/"))
            if keys[i : i + len(parts)] == parts:
                return i + len(parts)
    return None


def is_stacked(path, stacked: Sequence[str]) -> bool:
    """Whether a leaf's key path runs through one of the ``stacked`` subtree names."""
    return bool(stacked) and subtree_end(path, stacked) is not None


def subtree_paths(tree) -> list[str]:
    """Every subtree (not leaf) of ``tree`` as an ``"outer/inner"`` path, outermost first:
    the names ``layers=`` and ``vocab_parallel=`` accept."""
    seen: dict[str, int] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = path_strs(path)
        for depth in range(1, len(keys)):
            seen.setdefault("/".join(keys[:depth]), depth)
    return sorted(seen, key=lambda p: seen[p])


def subtree_mask(tree, names: Sequence[str]):
    """True for the leaves of ``tree`` under one of the subtree ``names`` (None when there
    are no names)."""
    if not names:
        return None
    return jax.tree_util.tree_map_with_path(lambda path, _: is_stacked(path, names), tree)


def tree_specs(
    tree,
    n: int,
    axis: str,
    *,
    shard: bool = True,
    stacked: Sequence[str] = (),
    contiguous: bool = False,
):
    """PartitionSpecs for every leaf of ``tree`` (arrays or ShapeDtypeStructs).

    With ``shard=False`` every leaf is replicated (``P()``). Leaves under a ``stacked`` key
    keep axis 0 whole, and with ``contiguous`` are split along their first divisible other
    dimension (see the module docstring).
    """
    if not shard:
        return jax.tree.map(lambda _: P(), tree)

    def spec(path, x):
        return leaf_spec(x.shape, n, axis, stacked=is_stacked(path, stacked), contiguous=contiguous)

    return jax.tree_util.tree_map_with_path(spec, tree)


def named(mesh: Mesh, specs):
    """Map a tree of PartitionSpecs to NamedShardings on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def spec_dim(spec: P) -> int | None:
    """The sharded dimension of a spec built by :func:`leaf_spec` (None if replicated)."""
    for d, entry in enumerate(spec):
        if entry is not None:
            return d
    return None


def shard_bytes(shape: Sequence[int], spec: P, n: int, itemsize: int) -> int:
    """Bytes per device of a leaf of ``shape`` placed as ``spec`` (built by :func:`leaf_spec`)
    over ``n`` devices, ``itemsize`` bytes an element."""
    size = math.prod(shape)
    return (size // n if spec_dim(spec) is not None else size) * itemsize
