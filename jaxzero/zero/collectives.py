"""The collectives ZeRO places itself, inside ``jax.shard_map``: gather parameter shards for
the loss, reduce local gradients (all-reduce or reduce-scatter), replicate updated shards.

Each function takes a :class:`Comm`: the few facts a collective needs (axes, sizes, dtypes),
not the whole :class:`~jaxzero.ZeRO`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxzero.mesh import to_varying
from jaxzero.zero.specs import spec_dim
from jaxzero.zero.wire.encodings import Wire


@dataclasses.dataclass(frozen=True)
class Comm:
    """What the collectives of one ZeRO configuration need to know.

    Attributes:
      axis: the mesh axis state is sharded over (reduce-scatter / all-gather axis).
      batch_axes: every mesh axis the batch is split over (the data axis last).
      replica_axes: the batch axes other than ``axis`` (state replicated over them).
      num_batch_shards: the number of batch shards the gradient is averaged over.
      precision: the :class:`~jaxzero.Precision` policy: its dtypes are the ones gathered in
        (``param_dtype``), reduced in (``reduce_dtype``) and handed to the optimizer in
        (``output_dtype``).
      wire: how the weight gathers and gradient reduce-scatters encode what they move
        (:class:`~jaxzero.zero.wire.Wire`: exact, or ZeRO++'s blockwise int8/int4).
    """

    axis: str
    batch_axes: tuple[str, ...]
    replica_axes: tuple[str, ...]
    num_batch_shards: int
    precision: Any
    wire: Wire = Wire()

    @classmethod
    def create(cls, axis, batch_axes, replica_axes, num_batch_shards, precision, wire=None) -> Comm:
        """The Comm of those axes, a :class:`~jaxzero.Precision` policy and a
        :class:`~jaxzero.zero.wire.Wire`."""
        axes = (axis, tuple(batch_axes), tuple(replica_axes), num_batch_shards)
        return cls(*axes, precision, Wire() if wire is None else wire)

    @property
    def param_dtype(self):
        return self.precision.param_dtype

    @property
    def reduce_dtype(self):
        return self.precision.reduce_dtype

    @property
    def output_dtype(self):
        return self.precision.output_dtype


#: From this many devices on the gather's axis, the backward loops' next all-gather (per layer
#: and per unit) waits for this layer's (unit's) recompute (decision 49). XLA:GPU keeps one
#: collective in flight, and there its latency estimate of the gather covers the whole layer:
#: unordered, the gather took every gemm and left the reduce-scatter bare (LLaMA-7B, the
#: recommended flags, jax 0.12: 63% of AG+RS hidden at N = 16, 32 and 64, 94% with the wait).
#: At N = 8 the wait gains nothing (94% either way with the recommended flags) and costs the
#: gather the recompute's window on XLA's defaults (86% -> 76% on jax 0.10, 83% on jax 0.12).
GATHER_AFTER_RECOMPUTE_FROM = 16


def gather_after_recompute(comm: Comm) -> bool:
    """Whether the backward loops' next gather waits for the recompute (inside ``shard_map``:
    :data:`GATHER_AFTER_RECOMPUTE_FROM` devices or more on ``comm.axis``)."""
    return jax.lax.axis_size(comm.axis) >= GATHER_AFTER_RECOMPUTE_FROM


def scatter_leaf(comm: Comm, g, d: int | None):
    """The communicating half of :func:`reduce_leaf`: ``g`` in ``reduce_dtype``,
    reduce-scattered along ``d`` over the data axis (then summed over replica axes), both on
    ``comm.wire`` (exact, or quantized: :mod:`jaxzero.zero.wire`), or all-reduced exactly over
    every batch axis when ``d`` is None. Returns the sum, in ``reduce_dtype``."""
    return scatter_leaves(comm, [g], [d])[0]


def scatter_leaves(comm: Comm, gs: list, dims: list) -> list:
    """:func:`scatter_leaf` of each of ``gs`` (one layer's or unit's gradients), their
    reduce-scatters asked of the wire together
    (:meth:`~jaxzero.zero.wire.Wire.reduce_scatter_many`: one all-to-all when quantized)."""
    gs = [g.astype(comm.reduce_dtype) for g in gs]
    split = [k for k, d in enumerate(dims) if d is not None]
    out = [
        jax.lax.psum(g, comm.batch_axes) if d is None else None
        for g, d in zip(gs, dims, strict=True)
    ]
    if split:
        scattered = comm.wire.reduce_scatter_many(
            [gs[k] for k in split], comm.axis, [dims[k] for k in split]
        )
        for k, g in zip(split, scattered, strict=True):
            out[k] = comm.wire.all_reduce(g, comm.replica_axes) if comm.replica_axes else g
    return out


def reduce_leaves(comm: Comm, gs: list, dims: list) -> list:
    """:func:`reduce_leaf` of each of ``gs``, their reduce-scatters together
    (:func:`scatter_leaves`)."""
    return [finish_leaf(comm, g) for g in scatter_leaves(comm, gs, dims)]


def finish_leaf(comm: Comm, g):
    """The local half of :func:`reduce_leaf`: the summed gradient in ``output_dtype``, divided
    by the number of batch shards."""
    return g.astype(comm.output_dtype) / comm.num_batch_shards


def reduce_leaf(comm: Comm, g, d: int | None):
    """Average one local gradient leaf over every batch axis.

    Reduce-scatter along dimension ``d`` over the data axis (then ``psum`` over replica axes),
    or all-reduce when ``d`` is None; communicated in ``reduce_dtype``, returned in
    ``output_dtype`` and divided by the number of batch shards.
    """
    return reduce_leaves(comm, [g], [d])[0]


def front_tile(comm: Comm, g, d: int | None):
    """The first of ``g``'s N tiles along ``d`` (N: the data axis size; ``g`` when None):
    where a stage-2 :func:`jaxzero.gather_layer` put this device's reduced tile."""
    if d is None:
        return g
    return jax.lax.slice_in_dim(g, 0, g.shape[d] // jax.lax.axis_size(comm.axis), axis=d)


def _keep(stacked_mask, tree):
    """``stacked_mask`` or an all-False mask of ``tree``'s structure."""
    return jax.tree.map(lambda _: False, tree) if stacked_mask is None else stacked_mask


def gather_params(comm: Comm, local_params, specs, stacked_mask=None):
    """All-gather stage-3 parameter shards into full tensors in ``param_dtype`` (cast before
    the gather: the fp32 master shards move as 16-bit compute params); leaves where
    ``stacked_mask`` is True (per-layer stage 3) stay shards, uncast. ``specs`` are the global
    params' specs."""

    def gather(stacked, p_local, spec):
        if stacked:
            return p_local
        p_local = p_local.astype(comm.param_dtype)
        d = spec_dim(spec)
        if d is None:
            return p_local
        return comm.wire.gather(p_local, comm.axis, d)

    return jax.tree.map(gather, _keep(stacked_mask, local_params), local_params, specs)


def params_for_loss(
    comm: Comm, local_params, specs, stacked_mask=None, whole_mask=None, keep_dtype=False
):
    """The full compute params, ready to differentiate, from ``local_params``: the compute
    params, or (stage 3 with a separate master) the master shards themselves.

    Sharded leaves are all-gathered in ``param_dtype`` (:func:`gather_params`); then every
    leaf is marked device-varying over the batch axes (``jax.lax.pcast``), so autodiff returns
    each device's local, unreduced gradient and the reduction is :func:`reduce_gradients`'s,
    not an implicit ``psum``. Leaves where ``stacked_mask`` is True (layer stacks of a
    per-layer stage 3) stay shards, in ``output_dtype`` (the dtype their gradients come back
    in; the fp32 master shards already are): :func:`jaxzero.gather_layer` gathers them per
    layer, cast to ``param_dtype``, and its backward reduces their gradients. Leaves where
    ``whole_mask`` is True (layer stacks of a per-layer stage 0) stay as they are,
    device-invariant: :func:`jaxzero.gather_layer` marks each layer varying where it is used,
    and its backward all-reduces that layer's gradient, which comes back invariant. With
    ``keep_dtype`` (offload: the stacks are the ``param_dtype`` params, the master being in
    host memory) the stacks keep their dtype where their gradient is exact in it
    (:func:`param_dtype_gradient_exact`), and so do their gradients: no ``output_dtype`` copy
    of a stack is made on the device.
    """
    keep_dtype = keep_dtype and param_dtype_gradient_exact(comm)
    with jax.named_scope("gather_params"):
        full = gather_params(comm, local_params, specs, stacked_mask)

    def prepare(stacked, whole, x):
        if whole:
            return x
        if stacked:
            return x if keep_dtype else x.astype(comm.output_dtype)
        return to_varying(x, comm.batch_axes)

    return jax.tree.map(prepare, _keep(stacked_mask, full), _keep(whole_mask, full), full)


def param_dtype_gradient_exact(comm: Comm) -> bool:
    """Whether a gradient reduced in ``reduce_dtype`` and divided by the number of batch
    shards is exact in ``param_dtype``: the same dtype, and a power-of-two divisor (exact
    unless the values reach the subnormal range)."""
    n = comm.num_batch_shards
    return comm.reduce_dtype == comm.param_dtype and n & (n - 1) == 0


def reduce_gradients(
    comm: Comm, grads, grad_specs, stacked_mask=None, scattered_mask=None, complete_mask=None
):
    """Average local gradients over every batch axis, one :func:`reduce_leaf` per leaf along
    its ``grad_specs`` dimension. Leaves where ``stacked_mask`` is True were already reduced
    layer by layer (by :func:`jaxzero.gather_layer`'s backward, stage 3) and pass through;
    leaves where ``scattered_mask`` is True were reduce-scattered layer by layer into the front
    tile of a full-size gradient (stage 2): that tile is cut out and finished. Leaves where
    ``complete_mask`` is True are already this device's shard summed over the data axis (a
    vocabulary-parallel table, :mod:`jaxzero.zero.layers.vocab`): summed over the replica axes and
    finished."""

    def one(stacked, scattered, complete, g, spec):
        if stacked:
            return g
        if scattered:
            return finish_leaf(comm, front_tile(comm, g, spec_dim(spec)))
        if complete:
            g = g.astype(comm.reduce_dtype)
            return finish_leaf(comm, jax.lax.psum(g, comm.replica_axes) if comm.replica_axes else g)
        return reduce_leaf(comm, g, spec_dim(spec))

    masks = (_keep(stacked_mask, grads), _keep(scattered_mask, grads))
    masks += (_keep(complete_mask, grads),)
    with jax.named_scope("reduce_gradients"):
        return jax.tree.map(one, *masks, grads, grad_specs)


def all_gather(mesh: Mesh, axis: str, tree, specs):
    """Replicate a tree of shards with one explicit ``all_gather`` per sharded leaf (outside
    ``shard_map``; it builds its own), so the collective moves exactly the bytes of the
    dtype the shards already have. A None leaf of ``tree`` (one that ``specs`` has a spec
    for) stays None."""

    def gather(x, spec):
        d = spec_dim(spec)
        if x is None or d is None:
            return x
        return jax.lax.all_gather(x, axis, axis=d, tiled=True, to="invarying")

    return jax.shard_map(
        lambda t: jax.tree.map(gather, t, specs, is_leaf=lambda x: x is None),
        mesh=mesh,
        in_specs=(specs,),
        out_specs=jax.tree.map(lambda _: P(), specs),
    )(tree)
