"""The sharded model EMA: a model EMA that lives in the master weights' shards, stored per
leaf or in a few flat per-device rows, placed and updated on ZeRO's shards.

Each EMA leaf takes the sharding of the fp32 master shard it averages, so

    ema_shard <- d * ema_shard + (1 - d) * master_shard

is purely local: no collective in the compiled step, 1/N of the work per device. The full
EMA is assembled (one all-gather per leaf) only by :func:`jaxzero.gather`, for evaluation or
export.

Storage in rows: a handful of kernels per update for the EMA of float leaves. Stored one array per leaf, the EMA update is one kernel per leaf per device: on a GPU a launch
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
:func:`jaxzero.gather`, checkpoints and the torch interop see), :func:`bucket_tree` goes the
other way.

Placement on ZeRO's shards: the EMA lives in the master weights' shards and is updated there
by a ``shard_map`` in which each device updates only its own piece (no collective). The
functions taking a ``zero`` read the placement from its config
(:class:`~jaxzero.zero.config.ZeROConfig`). Where the tree comes in (:meth:`ShardedEMA.update`,
:func:`update_on_mesh`) it is checked once against the EMA's (:func:`check_same_tree`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.mesh import mesh_platform
from jaxzero.trees import check_same_structure
from jaxzero.zero import specs as sh
from jaxzero.zero.config import ZeROConfig

SCHEDULES = ("constant", "yolov5", "tf")


class EmaState(NamedTuple):
    """EMA state: ``updates`` (int32, EMA updates applied so far) and the averaged tree."""

    updates: jax.Array
    ema: Any

    def gather_view(self):
        """What :func:`jaxzero.gather` of an EMA state gathers: the averaged tree."""
        return self.ema


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _integral(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class ShardedEMA:
    """Exponential moving average of the weights, updated on shards.

    Decay schedules (``n`` = the number of this update, counting it: 1 on the first update):

    * ``"constant"``: ``d = decay``.
    * ``"yolov5"`` (YOLOv5 / ultralytics / distributed ModelEMA): ``d = decay * (1 - exp(-n / tau))``.
    * ``"tf"`` (TF ``ExponentialMovingAverage(num_updates=)`` / praxis):
      ``d = min(decay, (1 + n - 1) / (10 + n - 1))`` i.e. ``min(decay, n / (9 + n))``, with
      ``n - 1`` the number of updates before this one.

    The update is ``ema = d * ema + (1 - d) * x`` for floating leaves; non-float leaves
    (counters, integer buffers) are copied from ``x``. The counter starts at ``updates0``.

    ``every`` and ``start_step`` gate the update on the training step ``t`` (the optimizer step
    count after this update, 1 on the first step): before ``start_step`` the EMA is a copy of
    the weights (and ``updates`` does not advance); from then on it is updated when
    ``(t - start_step) % every == 0``.

    Args:
      decay: the decay in (0, 1).
      tau: warm-up time constant of the ``"yolov5"`` schedule (> 0).
      schedule: one of ``"constant"``, ``"yolov5"``, ``"tf"``; default ``"yolov5"`` when ``tau``
        is given, else ``"constant"``.
      every: update every this many training steps (>= 1).
      start_step: first training step at which averaging starts.
      dtype: dtype of the EMA of floating leaves (float32).
      updates0: initial value of the counter (YOLOv5's ``updates=`` argument).
      torch_compatible: reproduce torch's float32 ``v *= d; v += (1 - d) * m`` bit for bit
        (``d`` and ``1 - d`` computed in float64 on the host and rounded to float32).
      bucket_leaves_up_to: when the EMA is placed by :class:`jaxzero.ZeRO` (``ZeRO.init``,
        ``make_train_step``), store the EMA of every float leaf whose per-device shard has at
        most this many elements in a few flat ``[N, L_g]`` rows sharded ``P(axis)``, each
        updated by one kernel per device (see :func:`bucket_layout`). ``"all"``: every
        float leaf; 0 keeps one array per leaf; None (the default): ``"all"`` on GPU meshes
        at stages 0-2 (a 350-leaf tree: 4 row kernels added to the train step instead of 351,
        the same 12 bytes per element), 0 on GPU meshes at stage 3 (there XLA fuses each
        leaf's EMA update into that leaf's optimizer kernel: no kernel added to the step, 8
        bytes per element) and on CPU meshes. (In a train step the default EMA's counter is
        derived from the step's and shares its kernel.) Same numbers as per-leaf storage (bit
        for bit with ``torch_compatible``; otherwise XLA may contract ``d * e + (1 - d) * x``
        into an FMA in one and not the other: an ulp), same bytes per device, no collective.
        Why: on XLA:CPU every leaf is its own kernel per device (~5 us each); the 37 small leaves
        (biases, norm scales: 45K floats) of ``benchmarks/ema.py``'s 20M-float, 54-leaf tree
        cost 1.2-1.6 ms of a ~9 ms sharded update; 4096 buckets exactly those there.
        :func:`jaxzero.gather`, :func:`jaxzero.ema_params`, checkpoints (per-leaf on disk)
        and the torch interop see the per-leaf tree (:func:`jaxzero.unbucket_ema`);
        ``init``/``update`` on plain trees stay per-leaf.

    Example:
      >>> ema = ShardedEMA(0.9999, tau=2000)
      >>> state = ema.init(params)
      >>> state = ema.update(state, new_params)
    """

    decay: float = 0.9999
    tau: float | None = None
    schedule: str | None = None
    every: int = 1
    start_step: int = 0
    dtype: Any = jnp.float32
    updates0: int = 0
    torch_compatible: bool = False
    bucket_leaves_up_to: int | str | None = None

    def __post_init__(self):
        if not _real(self.decay) or not 0.0 < self.decay < 1.0:
            raise ValueError(
                f"ShardedEMA decay={self.decay!r} must be in the open interval (0, 1)."
            )
        if self.tau is not None and (not _real(self.tau) or not self.tau > 0):
            raise ValueError(f"ShardedEMA tau={self.tau!r} must be > 0 (or None for no warm-up).")
        schedule = self.schedule or ("yolov5" if self.tau is not None else "constant")
        if schedule not in SCHEDULES:
            raise ValueError(f"ShardedEMA schedule={schedule!r} must be one of {SCHEDULES}.")
        if schedule == "yolov5" and self.tau is None:
            raise ValueError("ShardedEMA schedule='yolov5' needs tau > 0, e.g. tau=2000.")
        object.__setattr__(self, "schedule", schedule)
        if not _integral(self.every) or self.every < 1:
            raise ValueError(f"ShardedEMA every={self.every!r} must be an int >= 1.")
        if not _integral(self.start_step) or self.start_step < 0:
            raise ValueError(f"ShardedEMA start_step={self.start_step!r} must be an int >= 0.")
        if not _integral(self.updates0) or self.updates0 < 0:
            raise ValueError(f"ShardedEMA updates0={self.updates0!r} must be an int >= 0.")
        k = self.bucket_leaves_up_to
        if k == "all":
            k = ALL
        elif k is not None and (not _integral(k) or k < 0):
            raise ValueError(
                f"ShardedEMA bucket_leaves_up_to={k!r} must be None (automatic), 'all' or an "
                f"int >= 0 (elements per device; 0 keeps every leaf separate, e.g. 65536)."
            )
        object.__setattr__(self, "bucket_leaves_up_to", None if k is None else int(k))
        if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
            raise ValueError(f"ShardedEMA dtype={self.dtype!r} must be a floating dtype.")

    # -- decay ---------------------------------------------------------------------------
    def decay_at(self, n):
        """The decay used by update number ``n`` (1-based), as float32 (traceable)."""
        n = jnp.asarray(n, jnp.float32)
        if self.schedule == "constant":
            return jnp.full_like(n, self.decay)
        if self.schedule == "yolov5":
            return self.decay * (1.0 - jnp.exp(-n / self.tau))
        return jnp.minimum(self.decay, n / (9.0 + n))

    def decay_at_f64(self, n: int) -> float:
        """The same decay computed in float64 on the host (the torch reference)."""
        if self.schedule == "constant":
            return float(self.decay)
        if self.schedule == "yolov5":
            return self.decay * (1 - math.exp(-n / self.tau))
        return min(self.decay, n / (9.0 + n))

    def _torch_coefficients(self, n):
        def host(n):
            d = self.decay_at_f64(int(n))
            return np.float32(d), np.float32(1.0 - d)

        spec = jax.ShapeDtypeStruct((), jnp.float32)
        return jax.pure_callback(host, (spec, spec), n)

    # -- state ---------------------------------------------------------------------------
    def init(self, params) -> EmaState:
        """Start the EMA as a copy of ``params`` (float leaves cast to ``dtype``).

        The copy keeps each leaf's sharding, so pass the master shards (``ZeRO.init`` does).
        """
        ema = jax.tree.map(
            lambda x: jnp.asarray(x, self.dtype) if _is_float(x) else jnp.array(x), params
        )
        return EmaState(jnp.asarray(self.updates0, jnp.int32), ema)

    def update(self, state: EmaState, params, *, step=None, apply=True) -> EmaState:
        """One EMA update toward ``params`` (pure; traceable).

        Args:
          state: the current :class:`EmaState`.
          params: a tree with the EMA's structure (the new master weights/shards).
          step: the training step after this update (for ``every``/``start_step``); None
            means "always update".
          apply: a boolean (traced or not); when False the state is returned unchanged
            (steps skipped for non-finite gradients).

        Raises:
          ValueError: ``params`` has a different tree structure or leaf shapes than the EMA.
        """
        if is_bucketed(state.ema) and not is_bucketed(params):
            raise ValueError(
                "this EMA state stores small leaves in a bucket (ShardedEMA(bucket_leaves_up_to"
                "=...) placed by ZeRO); update it with zero.update_ema(ema, state, master), or "
                "convert it with jaxzero.unbucket_ema(state) first."
            )
        check_same_tree(state.ema, params)
        return self._update(state, params, step=step, apply=apply)

    def _update(self, state: EmaState, params, *, step, apply) -> EmaState:
        """:meth:`update` without its checks: ``params`` is known to match ``state.ema``
        (:func:`update_on_mesh` checked the global tree before cutting it into pieces)."""
        if step is None:
            averaging, copying = jnp.asarray(True), jnp.asarray(False)
        else:
            # Predicates that are constant for the default gating stay Python constants: on a
            # GPU a traced `step < 0` is a kernel of its own in front of the EMA's kernels.
            step = jnp.asarray(step)
            copying = step < self.start_step if self.start_step > 0 else jnp.asarray(False)
            averaging = ~copying
            if self.every > 1:
                averaging = jnp.logical_and(averaging, (step - self.start_step) % self.every == 0)
        averaging = jnp.logical_and(averaging, apply)
        copying = jnp.logical_and(copying, apply)
        n = state.updates + 1
        if self.torch_compatible:
            d, one_minus_d = self._torch_coefficients(n)
        else:
            d = self.decay_at(n)
            one_minus_d = 1.0 - d

        def leaf(e, x):
            if not _is_float(e):
                return jnp.where(apply, x.astype(e.dtype), e)
            x = x.astype(e.dtype)
            if self.torch_compatible:
                # torch rounds both products to float32 before adding. Under jit, XLA's CPU
                # (LLVM) backend contracts a*b + c into an FMA, even with loop-invariant
                # selects in between (it unswitches them). A per-element select that is the
                # identity for every value (NaN included) keeps the products separately rounded.
                a = e * d.astype(e.dtype)
                b = x * one_minus_d.astype(e.dtype)
                new = jnp.where(e == e, a, e) + jnp.where(x == x, b, x)
            else:
                new = d.astype(e.dtype) * e + one_minus_d.astype(e.dtype) * x
            return jnp.where(averaging, new, jnp.where(copying, x, e))

        ema = jax.tree.map(leaf, state.ema, params)
        return EmaState(jnp.where(averaging, n, state.updates).astype(jnp.int32), ema)


def check_same_tree(reference, other) -> None:
    """Raise ValueError naming the first path where ``other`` differs from the EMA tree."""
    try:
        check_same_structure(reference, other, "the EMA tree")
    except ValueError as e:
        raise ValueError(
            f"{e} The EMA was built for a different params tree; build it from the same params "
            f"(ShardedEMA.init(params) / ZeRO.init(params, ema=...))."
        ) from None


# -- storage: per leaf or in rows ------------------------------------------------------------
# Leaves per row: XLA:GPU fuses at most 96 operands and outputs into one kernel; a row's
# update has its master pieces, the row, its output, the decay, 1 - decay and the gating
# predicates. 88 keeps every row one kernel (checked on the compiled HLO in tests/test_gpu.py).
LEAVES_PER_ROW = 88

# ``bucket_leaves_up_to="all"``: every float leaf goes into the rows.
ALL = 2**62


def resolve(
    max_elements: int | None, platform: str, stage: int | None = None, streamed: bool = False
) -> int:
    """The threshold ``ShardedEMA(bucket_leaves_up_to=...)`` means on a mesh at ZeRO
    ``stage``: None (the default) is per-leaf (0) on CPUs, where benchmarks/ema.py measured
    per-leaf big leaves as fast and every storage is tested; on GPUs every float leaf in rows
    (:data:`ALL`: 4 kernels for 350 leaves instead of one per leaf), except at stage 3, where
    XLA fuses each per-leaf EMA update into the optimizer's kernel for that leaf (the compiled
    step gains no kernel per leaf, and reads each master piece once: tests/test_gpu.py), and
    when the update is ``streamed``.

    Args:
      max_elements: ``bucket_leaves_up_to`` (None: automatic).
      platform: the platform of the mesh the EMA is sharded over
        (:func:`jaxzero.mesh.mesh_platform`: ``"cpu"``, ``"gpu"`` or ``"mixed"``).
      stage: the ZeRO stage (None: no ZeRO).
      streamed: whether the update streams each leaf's EMA beside its master, a chunk at a
        time (offload, decision 32: ``zero.placement.update_is_local``).

    Returns:
      Per-device elements up to which a float leaf goes into the rows (0: per-leaf).
    """
    if max_elements is not None:
        return int(max_elements)
    if platform != "gpu" or stage == 3 or streamed:
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


def bucket_layout(tree, mesh: Mesh, axis: str, max_elements: int, specs) -> BucketLayout | None:
    """The bucket layout of a per-leaf EMA ``tree`` (arrays or ShapeDtypeStructs) whose leaves
    are sharded as ``specs`` says (a tree of PartitionSpecs: a ZeRO's rule, which splits layer
    stacks along a non-layer dimension, or the plain per-leaf rule,
    :func:`jaxzero.zero.specs.leaf_spec`).

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
    dims = tuple(sh.spec_dim(s) for s in treedef.flatten_up_to(specs))
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


def bucket_tree(tree, layout: BucketLayout | None):
    """The inverse of :func:`unbucket`: a per-leaf EMA tree (or :class:`~jaxzero.EmaState`)
    with ``layout``'s leaves moved into its bucket (a local concatenate per device, no
    communication; the other leaves are passed on, not copied). ``layout=None`` returns the
    per-leaf form. Use :meth:`jaxzero.ZeRO.bucket_ema` to plan the layout for a ZeRO mesh."""
    if isinstance(tree, EmaState):
        return tree._replace(ema=bucket_tree(tree.ema, layout))
    tree = unbucket(tree)
    if layout is None:
        return tree
    rest, small = split(tree, layout)
    return BucketedTree(rest, _pack(small, layout), layout)


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
    if leaf_specs is None:  # the plain per-leaf rule
        n = mesh.shape[axis]
        specs = jax.tree.map(lambda x: sh.leaf_spec(np.shape(x), n, axis), per_leaf)
    else:
        specs = leaf_specs(per_leaf)
    layout = bucket_layout(
        per_leaf, mesh, axis, resolve(max_elements, mesh_platform(mesh), stage), specs
    )
    if _is_bucketed(current) and current.layout == layout:
        return ema_state
    if layout is None and not _is_bucketed(current):
        return ema_state
    return bucket_tree(ema_state, layout)


def like(per_leaf_tree, reference):
    """``per_leaf_tree`` stored the way ``reference`` (an EMA tree or EmaState) is."""
    ref = reference.ema if isinstance(reference, EmaState) else reference
    return bucket_tree(per_leaf_tree, ref.layout) if _is_bucketed(ref) else per_leaf_tree


def stored_specs(tree, per_leaf_specs: Callable, axis: str):
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


def target(master, model_state):
    """What the EMA averages: the master weights, plus the model state when there is one
    (float buffers such as BatchNorm statistics are averaged, integer ones copied)."""
    if model_state is None:
        return master
    return {"params": master, "model_state": model_state}


# -- placement on ZeRO's shards ------------------------------------------------------------
def specs(zero: ZeROConfig, ema_tree):
    """Specs of an EMA tree in its storage (per leaf, or bucketed ``[N, L_g]`` rows)."""
    return stored_specs(ema_tree, zero.ema_leaf_specs, zero.axis)


def leaf_storage(zero: ZeROConfig, ema: ShardedEMA, params) -> list[str]:
    """The per-leaf plan's ``ema`` column (:mod:`jaxzero.zero.plan`): per params leaf, whether
    ``ema`` keeps it in bucketed ``"rows"`` or ``"per_leaf"`` on ``zero``'s mesh and stage."""
    streamed = zero.placement.update_is_local
    limit = resolve(ema.bucket_leaves_up_to, zero.platform, zero.stage, streamed)
    layout = bucket_layout(params, zero.mesh, zero.axis, limit, zero.ema_leaf_specs(params))
    rows = layout.rows if layout is not None else [None] * len(jax.tree.leaves(params))
    return ["per_leaf" if r is None else "rows" for r in rows]


def bucket(zero: ZeROConfig, ema: ShardedEMA, ema_state: EmaState) -> EmaState:
    """``ema_state`` in ``ema``'s storage for ``zero``'s mesh and stage (local, no
    communication); the inverse is :func:`jaxzero.unbucket_ema`."""
    streamed = zero.placement.update_is_local
    if streamed and ema.bucket_leaves_up_to not in (None, 0):
        raise ValueError(
            f"ShardedEMA(bucket_leaves_up_to={ema.bucket_leaves_up_to!r}) with "
            f"ZeRO(offload={zero.offload!r}): the offloaded update streams each leaf's EMA "
            f"beside its master a chunk at a time, and rows would join every leaf they hold "
            f"into one fetch. Leave bucket_leaves_up_to=None (per leaf with offload)."
        )
    limit = resolve(ema.bucket_leaves_up_to, zero.platform, zero.stage, streamed)
    where = (zero.mesh, zero.axis, limit, zero.stage, zero.ema_leaf_specs)
    return store(ema_state, *where)


class Shards(NamedTuple):
    """Where an EMA update on ZeRO's shards reads and writes (:func:`shards`): the mesh and its
    data axis, the specs of the master as it is placed (replicated leaves at stage 0, the
    replicated model state beside the params when the EMA also averages it), the per-leaf
    rule's specs of the master (where each EMA leaf is sharded), and the specs of the
    :class:`EmaState` in its storage (:func:`state_specs`)."""

    mesh: Mesh
    axis: str
    master_specs: Any
    leaf_specs: Any
    state_specs: EmaState


def shards(zero: ZeROConfig, ema_state: EmaState, master) -> Shards:
    """The :class:`Shards` of ``ema_state`` (in its storage), an EMA of ``master`` (arrays or
    shape structs: what :func:`target` makes), on ``zero``'s shards."""
    ema_specs = state_specs(ema_state, zero.ema_leaf_specs, zero.axis)
    master_specs = zero.shard_specs(master)
    if isinstance(master, dict) and set(master) == {"params", "model_state"}:
        master_specs = {
            "params": zero.shard_specs(master["params"]),
            "model_state": jax.tree.map(lambda _: P(), master["model_state"]),
        }
    return Shards(zero.mesh, zero.axis, master_specs, zero.ema_leaf_specs(master), ema_specs)


def update_on_shards(
    zero: ZeROConfig, ema: ShardedEMA, ema_state: EmaState, master, *, step, apply
):
    """:func:`update_on_mesh` on ``zero``'s shards: the master's (``master`` as it is placed, with
    the replicated model state when the EMA also averages it)."""
    where = shards(zero, ema_state, master)
    return update_on_mesh(ema, ema_state, master, where, step=step, apply=apply)


def state_specs(ema_state: EmaState, per_leaf_specs, axis: str) -> EmaState:
    """The specs of an :class:`EmaState` in its storage (``per_leaf_specs(tree)`` gives the
    per-leaf rule's specs of a tree)."""
    return EmaState(P(), stored_specs(ema_state.ema, per_leaf_specs, axis))


def in_step(
    ema: ShardedEMA | None,
    ema_state: EmaState,
    master,
    model_state,
    *,
    on_shards: Shards | None,
    step,
    old_step,
    apply,
) -> EmaState:
    """The EMA's update inside a train step, after the optax update: ``ema_state`` moved
    towards the new ``master`` (and the step's ``model_state`` when the EMA averages it;
    None otherwise) where ``apply``. ``on_shards``: the :class:`Shards` the EMA is updated on
    (:func:`update_on_mesh`, a ``shard_map``: decision 8), the state layout's; None: leaf by
    leaf beside the streamed master (offload, decision 32), where the plain update is local.
    ``step``/``old_step``: the state's step after and before this one.

    Raises:
      ValueError: the state has an EMA and the step was given no ``ema``.
    """
    if ema is None:
        raise ValueError(
            "state has an EMA but no ShardedEMA was given to apply it; pass ema= to "
            "make_train_step / apply_gradients."
        )
    averaged = target(master, model_state)
    if on_shards is not None:
        new = update_on_mesh(ema, ema_state, averaged, on_shards, step=step, apply=apply)
    else:
        new = ema.update(ema_state, averaged, step=step, apply=apply)
    if ema.every == 1 and ema.start_step == 0:
        # The EMA then counts exactly the applied steps: deriving its counter from the step's
        # lets XLA compute both in one scalar kernel (on a GPU the EMA's own select was a
        # kernel of its own: 5 -> 4 added by the default EMA at stages 1/2, 1 -> 0 at 3).
        new = new._replace(updates=ema_state.updates + (step - old_step))
    return new


def update_on_mesh(ema: ShardedEMA, ema_state: EmaState, master, where: Shards, *, step, apply):
    """The EMA update as a ``shard_map`` over the EMA's shards: provably local.

    Each device updates only its own EMA shard from its own master piece; where the master
    leaf is replicated (stage 0) it slices its part out of the local replica. A bucketed EMA
    concatenates the device's pieces of the small leaves into one row and updates its bucket
    row in one elementwise loop; the big leaves are updated per leaf as usual.

    Args:
      where: the mesh and the specs of ``master`` and of the EMA (:func:`shards`).
    """
    # Checked here, on the global tree (the error names the leaves' shapes), and only here:
    # inside the shard_map the pieces are this tree's blocks.
    check_same_tree(to_per_leaf(ema_state.ema, abstract=True), master)
    mesh, axis, master_specs, leaf_specs, specs = where
    n = mesh.shape[axis]

    def local(e_state, m_local, step, apply):
        def take(x, m_spec, e_spec):
            d = sh.spec_dim(e_spec)
            if d is None or sh.spec_dim(m_spec) is not None:
                return x
            # Index the device's block (no index * size arithmetic, no negative-index select):
            # XLA:GPU then fuses every block into its bucket row's kernel (decision 19).
            blocks = x.reshape(x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1 :])
            i = jax.lax.axis_index(axis)
            return jax.lax.dynamic_index_in_dim(blocks, i, d, False, allow_negative_indices=False)

        mine = jax.tree.map(take, m_local, master_specs, leaf_specs)
        mine = pack_like(mine, e_state.ema)
        return ema._update(e_state, mine, step=step, apply=apply)

    with jax.named_scope("ema_update"):
        return jax.shard_map(
            local, mesh=mesh, in_specs=(specs, master_specs, P(), P()), out_specs=specs
        )(ema_state, master, step, apply)
