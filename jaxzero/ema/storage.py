"""Flat per-device rows for the EMA of float leaves: a handful of kernels per update.

Stored one array per leaf, the EMA update is one kernel per leaf per device: on a GPU a launch
each (a 350-leaf detector: 351 kernels, where the bytes alone take microseconds), on XLA:CPU
about 5 us each. ``ShardedEMA(bucket_leaves_up_to=K)`` stores the EMA of every float leaf
whose per-device shard has at most ``K`` elements in a few flat ``[N, L_g]`` rows, sharded
``P(axis)`` (row ``i`` of each is device ``i``'s block): the concatenation, smallest leaf first, of
device ``i``'s local pieces of up to :data:`LEAVES_PER_ROW` leaves (its block of a sharded
leaf, a full copy of a leaf the sharding rule replicates).

The per-step update concatenates the matching master pieces and updates the row in one
elementwise expression; XLA fuses the concatenate into it, so each row is ONE kernel that
reads every master piece and the row and writes the row in place: 12 bytes per float32
element, as per-leaf storage, and no intermediate. The row size is what XLA:GPU agrees to
fuse: at most 96 operands and outputs per kernel; a row's update takes its master pieces, the
row, the decay and the gating predicates. (One concatenate of more pieces is split into
several fusions whose outputs are written and read again: 20 bytes per element.)

The rows hold exactly what the per-leaf leaves they replace held on each device, so the
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

from jaxzero.mesh import mesh_platform
from jaxzero.zero import specs as sh

# Leaves per row: XLA:GPU fuses at most 96 operands and outputs into one kernel; a row's
# update has its master pieces, the row, its output, the decay, 1 - decay and the gating
# predicates. 88 keeps every row one kernel (checked on the compiled HLO in tests/test_gpu.py).
LEAVES_PER_ROW = 88

# ``bucket_leaves_up_to="all"``: every float leaf goes into the rows.
ALL = 2**62


def resolve(max_elements: int | None, mesh: Mesh, stage: int | None = None, offload=None) -> int:
    """The threshold ``ShardedEMA(bucket_leaves_up_to=...)`` means on ``mesh`` at ZeRO
    ``stage``: None (the default) is per-leaf (0) on CPUs, where benchmarks/ema.py measured
    per-leaf big leaves as fast and every storage is tested; on GPUs every float leaf in rows
    (:data:`ALL`: 4 kernels for 350 leaves instead of one per leaf), except at stage 3, where
    XLA fuses each per-leaf EMA update into the optimizer's kernel for that leaf (the compiled
    step gains no kernel per leaf, and reads each master piece once: tests/test_gpu.py), and
    with ``offload``, whose streamed update reads each leaf's EMA beside its master, a chunk
    at a time (decision 32)."""
    if max_elements is not None:
        return int(max_elements)
    if mesh_platform(mesh) != "gpu" or stage == 3 or offload:
        return 0
    return ALL


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where each leaf of a per-leaf EMA tree lives (static, hashable: pytree aux data).

    Attributes:
      mesh, axis: the mesh and the data axis the EMA is sharded over.
      max_elements: the threshold the layout was planned with (per-device elements).
      treedef: the per-leaf tree's structure.
      shapes, dtypes: every leaf's global shape and dtype, in flatten order.
      dims: every leaf's sharded dimension (None: replicated), as the master it averages is
        sharded (the ZeRO's rule, which treats layer stacks apart): the rows hold exactly the
        master's local pieces, so packing and unpacking must cut them the same way.
      offsets: every leaf's offset in its row, or None for a leaf kept per-leaf.
      rows: every leaf's row index, or None for a leaf kept per-leaf.
      dtype: the rows' dtype.
      lengths: ``L_g``, the elements in one device's block of each row.
    """

    mesh: Mesh
    axis: str
    max_elements: int
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    dims: tuple[int | None, ...]
    offsets: tuple[int | None, ...]
    rows: tuple[int | None, ...]
    dtype: Any
    lengths: tuple[int, ...]

    @property
    def length(self) -> int:
        """Elements of all rows on one device."""
        return sum(self.lengths)

    def in_row(self, g: int) -> tuple[int, ...]:
        """Flatten indices of the leaves in row ``g``, in row order (by offset)."""
        return tuple(
            sorted((i for i, r in enumerate(self.rows) if r == g), key=self.offsets.__getitem__)
        )

    @property
    def num_shards(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def bucketed(self) -> tuple[int, ...]:
        """Flatten indices of the leaves in the bucket."""
        return tuple(i for i, o in enumerate(self.offsets) if o is not None)

    def spec(self, i: int) -> P:
        """Leaf ``i``'s spec (sharded along ``dims[i]``)."""
        return sh.dim_spec(self.dims[i], self.axis)

    def local_shape(self, i: int) -> tuple[int, ...]:
        """Leaf ``i``'s per-device block shape."""
        return _local_shape(self.shapes[i], self.dims[i], self.num_shards)

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
    """A per-leaf EMA tree with its small float leaves moved into flat rows.

    Attributes:
      rest: the per-leaf tree with every bucketed leaf replaced by None.
      bucket: a tuple of ``[N, L_g]`` rows, each sharded ``P(axis)`` (``[1, L_g]`` inside
        ``shard_map``).
      layout: the static :class:`BucketLayout`.
    """

    rest: Any
    bucket: Any
    layout: BucketLayout


def _local_shape(shape, d: int | None, n: int) -> tuple[int, ...]:
    return tuple(s // n if i == d else s for i, s in enumerate(shape))


def plan(tree, mesh: Mesh, axis: str, max_elements: int, specs=None) -> BucketLayout | None:
    """The bucket layout of a per-leaf EMA ``tree`` (arrays or ShapeDtypeStructs) whose leaves
    are sharded as ``specs`` says (a tree of PartitionSpecs; None: the plain per-leaf rule,
    :func:`jaxzero.zero.specs.leaf_spec`; a ZeRO passes its own, which splits layer stacks
    along a non-layer dimension).

    Float leaves whose per-device block has at most
    ``max_elements`` elements go into rows, smallest first (ties in flatten order), at most
    :data:`LEAVES_PER_ROW` per row, if they share the first such leaf's dtype (the EMA casts
    every float leaf to ``ShardedEMA.dtype``). Returns None
    when ``max_elements`` is 0 or no leaf qualifies (the tree then stays per-leaf).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if max_elements <= 0:
        return None
    n = mesh.shape[axis]
    shapes = [tuple(int(d) for d in np.shape(x)) for x in leaves]
    if specs is None:
        specs = [sh.leaf_spec(s, n, axis) for s in shapes]
    else:
        specs = treedef.flatten_up_to(specs)
    dims = tuple(sh.spec_dim(s) for s in specs)
    dtype, small = None, []
    for i, x in enumerate(leaves):
        size = math.prod(_local_shape(shapes[i], dims[i], n))
        if (
            jnp.issubdtype(x.dtype, jnp.floating)
            and size <= max_elements
            and (dtype is None or jnp.dtype(x.dtype) == dtype)
        ):
            dtype = jnp.dtype(x.dtype)
            small.append((size, i))
    # Rows of leaves of like size: XLA:GPU runs a row's concatenate with a thread per element
    # of its largest piece, each visiting every piece, so a row mixing a 2M-element kernel with
    # 32-element biases does 88x the work (measured on an H100: benchmarks/gpu_real.py).
    offsets, rows, lengths = [None] * len(leaves), [None] * len(leaves), []
    for k, (size, i) in enumerate(sorted(small)):
        if k % LEAVES_PER_ROW == 0:
            lengths.append(0)
        offsets[i], rows[i] = lengths[-1], len(lengths) - 1
        lengths[-1] += size
    if dtype is None:
        return None
    return BucketLayout(
        mesh=mesh,
        axis=axis,
        max_elements=int(max_elements),
        treedef=treedef,
        shapes=tuple(shapes),
        dtypes=tuple(jnp.dtype(x.dtype) for x in leaves),
        dims=dims,
        offsets=tuple(offsets),
        rows=tuple(rows),
        dtype=dtype,
        lengths=tuple(lengths),
    )


def split(tree, layout: BucketLayout):
    """``(rest, small)``: the tree with bucketed leaves replaced by None, and those leaves."""
    leaves = layout.treedef.flatten_up_to(tree)
    rest = layout.treedef.unflatten(
        [None if o is not None else x for x, o in zip(leaves, layout.offsets, strict=True)]
    )
    return rest, [leaves[i] for i in layout.bucketed]


def pack_local(pieces, layout: BucketLayout):
    """Inside ``shard_map``: this device's ``[1, L_g]`` rows from its local pieces of the
    bucketed leaves (in flatten order; one concatenate per row)."""
    by_index = dict(zip(layout.bucketed, pieces, strict=True))

    def row(g):
        r = jnp.concatenate(
            [by_index[i].astype(layout.dtype).reshape(-1) for i in layout.in_row(g)]
        )
        missing = tuple(
            a for a in (layout.axis,) if a not in jax.typeof(r).manual_axis_type.varying
        )
        if missing:  # every leaf of the row is replicated: the row is still per-device data
            r = jax.lax.pcast(r, missing, to="varying")
        return r[None]

    return tuple(row(g) for g in range(len(layout.lengths)))


@functools.partial(jax.jit, static_argnums=1)
def _pack(small, layout: BucketLayout):
    """The ``[N, L_g]`` rows from the bucketed leaves (each device packs its own pieces)."""
    return jax.shard_map(
        lambda *pieces: pack_local(pieces, layout),
        mesh=layout.mesh,
        in_specs=tuple(layout.spec(i) for i in layout.bucketed),
        out_specs=tuple(P(layout.axis) for _ in layout.lengths),
    )(*small)


@functools.partial(jax.jit, static_argnums=1)
def _slice(rows, layout: BucketLayout):
    """The bucketed leaves, in their per-leaf shardings, from the ``[N, L_g]`` rows."""
    idx = layout.bucketed

    def local(rows):
        return tuple(
            rows[layout.rows[i]][
                0, layout.offsets[i] : layout.offsets[i] + math.prod(layout.local_shape(i))
            ]
            .reshape(layout.local_shape(i))
            .astype(layout.dtypes[i])
            for i in idx
        )

    # A replicated leaf's copies are identical on every device (same inputs, same program),
    # but the row is typed device-varying: skip the replication check for the P() outputs.
    return jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(tuple(P(layout.axis) for _ in layout.lengths),),
        out_specs=tuple(layout.spec(i) for i in idx),
        check_vma=False,
    )(tuple(rows))


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
        if abstract or any(isinstance(r, jax.ShapeDtypeStruct) for r in x.bucket):
            return x.layout.abstract()
        return _unbucket_tree(x)

    return jax.tree.map(one, tree, is_leaf=_is_bucketed)


def threshold(tree) -> int:
    """The ``bucket_leaves_up_to`` the bucketed EMA in ``tree`` was planned with (0: per-leaf)."""
    for x in jax.tree.leaves(tree, is_leaf=_is_bucketed):
        if _is_bucketed(x):
            return x.layout.max_elements
    return 0


def store(ema_state, mesh: Mesh, axis: str, max_elements, stage=None, leaf_specs=None):
    """``ema_state`` (an EmaState in either storage) in the storage planned for ``mesh`` with
    ``bucket_leaves_up_to=max_elements`` (None: :func:`resolve` at ZeRO ``stage``): small float leaves in rows
    when > 0, per-leaf otherwise; ``leaf_specs(tree)``: the per-leaf specs (the ZeRO's rule; None: the plain
    rule). A local slice/concatenate per device, no communication; returned as is when it is already stored
    that way."""
    current = ema_state.ema
    per_leaf = current.layout.abstract() if _is_bucketed(current) else current
    specs = None if leaf_specs is None else leaf_specs(per_leaf)
    layout = plan(per_leaf, mesh, axis, resolve(max_elements, mesh, stage), specs)
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
    per-leaf tree; for a bucketed one the per-leaf rule for the rest and ``P(axis)`` for each
    ``[N, L_g]`` row."""
    if _is_bucketed(tree):
        rows = tuple(P(axis) for _ in tree.layout.lengths)
        return BucketedTree(per_leaf_specs(tree.rest), rows, tree.layout)
    return per_leaf_specs(tree)


def pack_like(pieces, local_ema):
    """Inside ``shard_map``: this device's per-leaf master ``pieces`` in the storage of its
    ``local_ema`` tree (the small pieces packed into one bucket row when it is bucketed)."""
    if not _is_bucketed(local_ema):
        return pieces
    layout = local_ema.layout
    rest, small = split(pieces, layout)
    return BucketedTree(rest, pack_local(small, layout), layout)
