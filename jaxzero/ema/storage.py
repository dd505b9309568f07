"""One flat per-device bucket for the EMA of small float leaves.

On XLA:CPU every leaf's EMA update is its own kernel on every device, at a fixed cost of
about 5 us per device-kernel. A transformer's biases and layer-norm scales (37 of the 54
leaves of ``benchmarks/ema.py``, 45K of its 20M floats) then cost 1.2-1.6 ms of a ~9 ms
sharded update while doing no real work, and packing them into one array *inside* the jitted
update does not help (XLA splits the pack/update/unpack back into per-leaf kernels). Storing
their EMA in one persistent buffer does: ``ShardedEMA(bucket_leaves_up_to=K)`` keeps every
float EMA leaf whose per-device shard has at most ``K`` elements in one ``[N, L]`` array
sharded ``P(axis)`` (by rows). Row ``i`` (device ``i``'s block) is the concatenation, in tree
order, of device ``i``'s local pieces of those leaves: its block of a sharded leaf, a full
copy of a leaf the sharding rule replicates. The per-step update packs the matching master
pieces (one concatenate) and updates the whole row in one elementwise loop.

The bucket holds exactly what the per-leaf leaves it replaces held on each device, so the
bytes per device do not change. Conversions are local ``shard_map`` slices (no
communication): :func:`unbucket` gives back the ordinary per-leaf sharded tree (what
:func:`jaxzero.gather`, checkpoints and the torch interop see), :func:`bucket` goes the other
way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.zero import specs as sh


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where each leaf of a per-leaf EMA tree lives (static, hashable: pytree aux data).

    Attributes:
      mesh, axis: the mesh and the data axis the EMA is sharded over.
      max_elements: the threshold the layout was planned with (per-device elements).
      treedef: the per-leaf tree's structure.
      shapes, dtypes: every leaf's global shape and dtype, in flatten order.
      offsets: every leaf's offset in a bucket row, or None for a leaf kept per-leaf.
      dtype: the bucket's dtype.
      length: ``L``, the elements in one row.
    """

    mesh: Mesh
    axis: str
    max_elements: int
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    offsets: tuple[int | None, ...]
    dtype: Any
    length: int

    @property
    def num_shards(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def bucketed(self) -> tuple[int, ...]:
        """Flatten indices of the leaves in the bucket."""
        return tuple(i for i, o in enumerate(self.offsets) if o is not None)

    def spec(self, i: int) -> P:
        """The per-leaf sharding rule's spec of leaf ``i``."""
        return sh.leaf_spec(self.shapes[i], self.num_shards, self.axis)

    def local_shape(self, i: int) -> tuple[int, ...]:
        """Leaf ``i``'s per-device block shape."""
        shape = list(self.shapes[i])
        d = sh.shard_dim(shape, self.num_shards)
        if d is not None:
            shape[d] //= self.num_shards
        return tuple(shape)

    def abstract(self):
        """The per-leaf tree as ShapeDtypeStructs with their NamedShardings."""
        return self.treedef.unflatten(
            [
                jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(self.mesh, self.spec(i)))
                for i, (s, d) in enumerate(zip(self.shapes, self.dtypes, strict=True))
            ]
        )


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["rest", "bucket"], meta_fields=["layout"]
)
@dataclasses.dataclass(frozen=True, eq=False)
class BucketedTree:
    """A per-leaf EMA tree with its small float leaves moved into one bucket.

    Attributes:
      rest: the per-leaf tree with every bucketed leaf replaced by None.
      bucket: the ``[N, L]`` bucket, sharded by rows (``P(axis)``; ``[1, L]`` inside
        ``shard_map``).
      layout: the static :class:`BucketLayout`.
    """

    rest: Any
    bucket: Any
    layout: BucketLayout


def _local_size(shape, n: int) -> int:
    size = math.prod(shape)
    return size // n if sh.shard_dim(shape, n) is not None else size


def plan(tree, mesh: Mesh, axis: str, max_elements: int) -> BucketLayout | None:
    """The bucket layout of a per-leaf EMA ``tree`` (arrays or ShapeDtypeStructs).

    Float leaves whose per-device block (per :func:`jaxzero.zero.specs.shard_dim`) has at most
    ``max_elements`` elements go into the bucket, in flatten order, if they share the first
    such leaf's dtype (the EMA casts every float leaf to ``ShardedEMA.dtype``). Returns None
    when ``max_elements`` is 0 or no leaf qualifies (the tree then stays per-leaf).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if max_elements <= 0:
        return None
    n = mesh.shape[axis]
    dtype, offsets, length = None, [], 0
    for x in leaves:
        shape = tuple(int(d) for d in np.shape(x))
        small = (
            jnp.issubdtype(x.dtype, jnp.floating)
            and _local_size(shape, n) <= max_elements
            and (dtype is None or jnp.dtype(x.dtype) == dtype)
        )
        if small:
            dtype = jnp.dtype(x.dtype)
            offsets.append(length)
            length += _local_size(shape, n)
        else:
            offsets.append(None)
    if dtype is None:
        return None
    return BucketLayout(
        mesh=mesh,
        axis=axis,
        max_elements=int(max_elements),
        treedef=treedef,
        shapes=tuple(tuple(int(d) for d in np.shape(x)) for x in leaves),
        dtypes=tuple(jnp.dtype(x.dtype) for x in leaves),
        offsets=tuple(offsets),
        dtype=dtype,
        length=length,
    )


def split(tree, layout: BucketLayout):
    """``(rest, small)``: the tree with bucketed leaves replaced by None, and those leaves."""
    leaves = layout.treedef.flatten_up_to(tree)
    rest = layout.treedef.unflatten(
        [None if o is not None else x for x, o in zip(leaves, layout.offsets, strict=True)]
    )
    return rest, [leaves[i] for i in layout.bucketed]


def pack_local(pieces, layout: BucketLayout):
    """Inside ``shard_map``: this device's ``[1, L]`` row from its local pieces (one concat)."""
    row = jnp.concatenate([p.astype(layout.dtype).reshape(-1) for p in pieces])
    missing = tuple(a for a in (layout.axis,) if a not in jax.typeof(row).manual_axis_type.varying)
    if missing:  # every bucketed leaf is replicated: the row is still per-device data
        row = jax.lax.pcast(row, missing, to="varying")
    return row[None]


@functools.partial(jax.jit, static_argnums=1)
def _pack(small, layout: BucketLayout):
    """The ``[N, L]`` bucket from the bucketed leaves (each device packs its own pieces)."""
    return jax.shard_map(
        lambda *pieces: pack_local(pieces, layout),
        mesh=layout.mesh,
        in_specs=tuple(layout.spec(i) for i in layout.bucketed),
        out_specs=P(layout.axis),
    )(*small)


@functools.partial(jax.jit, static_argnums=1)
def _slice(bucket_array, layout: BucketLayout):
    """The bucketed leaves, in their per-leaf shardings, from the ``[N, L]`` bucket."""
    idx = layout.bucketed

    def local(row):
        row = row[0]
        return tuple(
            row[layout.offsets[i] : layout.offsets[i] + math.prod(layout.local_shape(i))]
            .reshape(layout.local_shape(i))
            .astype(layout.dtypes[i])
            for i in idx
        )

    # A replicated leaf's copies are identical on every device (same inputs, same program),
    # but the row is typed device-varying: skip the replication check for the P() outputs.
    return jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=P(layout.axis),
        out_specs=tuple(layout.spec(i) for i in idx),
        check_vma=False,
    )(bucket_array)


def _unbucket_tree(tree: BucketedTree):
    layout = tree.layout
    leaves = layout.treedef.flatten_up_to(tree.rest)  # None at the bucketed positions
    for i, x in zip(layout.bucketed, _slice(tree.bucket, layout), strict=True):
        leaves[i] = x
    return layout.treedef.unflatten(leaves)


def _is_bucketed(x) -> bool:
    return isinstance(x, BucketedTree)


def is_bucketed(tree) -> bool:
    """Whether ``tree`` (an EmaState, TrainState or any pytree) holds a bucketed EMA."""
    return any(_is_bucketed(x) for x in jax.tree.leaves(tree, is_leaf=_is_bucketed))


def unbucket(tree):
    """Every :class:`BucketedTree` in ``tree`` back to the ordinary per-leaf sharded tree.

    Accepts a :class:`BucketedTree`, an :class:`~jaxzero.EmaState`, a
    :class:`~jaxzero.TrainState` or any pytree holding them; anything without a bucket is
    returned as is. Only the bucket goes through a (cached, per-layout) jitted ``shard_map``
    in which each device slices its own row, with no communication; every other leaf is
    passed on as the same array, not copied. Works eagerly and inside ``jax.jit``.
    """
    return jax.tree.map(
        lambda x: _unbucket_tree(x) if _is_bucketed(x) else x, tree, is_leaf=_is_bucketed
    )


def bucket(tree, layout: BucketLayout | None):
    """The inverse of :func:`unbucket`: a per-leaf EMA tree (or :class:`~jaxzero.EmaState`)
    with ``layout``'s leaves moved into its bucket (a local concatenate per device, no
    communication; the other leaves are passed on, not copied). ``layout=None`` returns the
    per-leaf form. Use :meth:`jaxzero.ZeRO.bucket_ema` to plan the layout for a ZeRO mesh."""
    if _is_ema_state(tree):
        return tree._replace(ema=bucket(tree.ema, layout))
    tree = unbucket(tree)
    if layout is None:
        return tree
    rest, small = split(tree, layout)
    return BucketedTree(rest, _pack(small, layout), layout)


def _is_ema_state(x) -> bool:
    # EmaState is a NamedTuple (updates, ema); tested by shape so this module stays below ema.
    return isinstance(x, tuple) and getattr(x, "_fields", None) == ("updates", "ema")


# -- the storage interface: nothing outside jaxzero.ema looks at BucketedTree -----------------
def to_per_leaf(tree, *, abstract: bool = False):
    """``tree`` (an EMA tree, EmaState, TrainState or any pytree) with every bucketed EMA in
    its per-leaf form: concrete arrays are sliced locally (:func:`unbucket`); an abstract
    bucket (or any bucket, with ``abstract=True``: nothing is computed) becomes the per-leaf
    ShapeDtypeStructs with their shardings."""

    def one(x):
        if not _is_bucketed(x):
            return x
        if abstract or isinstance(x.bucket, jax.ShapeDtypeStruct):
            return x.layout.abstract()
        return _unbucket_tree(x)

    return jax.tree.map(one, tree, is_leaf=_is_bucketed)


def threshold(tree) -> int:
    """The ``bucket_leaves_up_to`` the bucketed EMA in ``tree`` was planned with (0: per-leaf)."""
    for x in jax.tree.leaves(tree, is_leaf=_is_bucketed):
        if _is_bucketed(x):
            return x.layout.max_elements
    return 0


def store(ema_state, mesh: Mesh, axis: str, max_elements: int):
    """``ema_state`` (an EmaState in either storage) in the storage planned for ``mesh`` with
    ``bucket_leaves_up_to=max_elements``: small float leaves bucketed when > 0, per-leaf
    otherwise. A local slice/concatenate per device, no communication; returned as is when
    it is already stored that way."""
    current = ema_state.ema
    per_leaf = current.layout.abstract() if _is_bucketed(current) else current
    layout = plan(per_leaf, mesh, axis, max_elements)
    if _is_bucketed(current) and current.layout == layout:
        return ema_state
    if layout is None and not _is_bucketed(current):
        return ema_state
    return bucket(ema_state, layout)


def like(per_leaf_tree, reference):
    """``per_leaf_tree`` stored the way ``reference`` (an EMA tree or EmaState) is."""
    ref = reference.ema if _is_ema_state(reference) else reference
    return bucket(per_leaf_tree, ref.layout) if _is_bucketed(ref) else per_leaf_tree


def specs(tree, per_leaf_specs: Callable, axis: str):
    """The PartitionSpecs of an EMA tree in its storage: ``per_leaf_specs(tree)`` for a
    per-leaf tree; for a bucketed one the per-leaf rule for the rest and ``P(axis)`` (rows)
    for the ``[N, L]`` bucket."""
    if _is_bucketed(tree):
        return BucketedTree(per_leaf_specs(tree.rest), P(axis), tree.layout)
    return per_leaf_specs(tree)


def pack_like(pieces, local_ema):
    """Inside ``shard_map``: this device's per-leaf master ``pieces`` in the storage of its
    ``local_ema`` tree (the small pieces packed into one bucket row when it is bucketed)."""
    if not _is_bucketed(local_ema):
        return pieces
    layout = local_ema.layout
    rest, small = split(pieces, layout)
    return BucketedTree(rest, pack_local(small, layout), layout)
