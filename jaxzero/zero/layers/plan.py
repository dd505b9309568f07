"""Stage 3, per layer: gather each scanned layer's parameter shards where the layer runs.

With ``ZeRO(..., stage=3, layers=("layers",))`` the train step hands the loss the layer stack
``params["layers"]`` as this device's shards. The model gathers one layer at a time inside its
scanned, rematerialised block::

    block = nn.map_variables(Block, "params", trans_in_fn=jaxzero.gather_layer)
    block = nn.remat(block)
    x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=n_layers)(cfg, name="layers")(x, None)

so at any moment one layer's weights are whole (FSDP's ``reshard_after_forward=True``): the
forward all-gathers layer ``i``, ``nn.remat`` all-gathers it again for the backward, and the
backward of that all-gather reduce-scatters layer ``i``'s gradient as soon as it exists (in
``precision.reduce_dtype``), so no full gradient of the stack is ever held either.

Stage 2 with ``layers=`` uses the same model: the parameters are already whole on every
device, so :func:`gather_layer` passes each layer through unchanged, and its backward
reduce-scatters that layer's gradient inside the backward scan (DeepSpeed's ``overlap_comm``:
the next layer's backward runs while it moves). The reduced tile is returned repeated N times
along its dimension (a broadcast to the full-size gradient), whatever the device, and the step
cuts the front tile out (no further communication): a static place, so that XLA's collective
pipeliner can move the reduce-scatter into the next layer's backward (a device-dependent place,
``axis_index * size``, stops it: measured 0% hidden against 94%). Repeated, not zero-padded:
the pipeliner carried each pad's zero through the loop as a scalar copy per leaf per layer
(8-layer GPT: 958 -> 871 kernels, 1001.9 -> 998.4 MB). It does so at every micro-batch, as the
whole-gradient reduction of stage 2 does.

Stage 1 without micro-batches takes the stage-2 path (``zero.path.for_step(1)``: its ``stage`` is 2).
Stage 0 without micro-batches all-reduces each layer's gradient in the backward the same way:
the stacks enter the loss device-invariant (the other leaves are marked varying, so autodiff
hands back their local gradients), :func:`gather_layer` marks each layer varying where it
runs, and its backward all-reduces that layer's gradient, invariant again, as the step's
replicated gradient must be (jax has no varying -> invariant cast: an all-reduce of a varying
gradient stays typed varying, which blocked this before; BUILD_NOTES decision 21). A stack
leaf the model uses without :func:`gather_layer` is summed by autodiff's own all-reduce where
it is used (the transpose of jax's implicit varying cast); either way every stack gradient
comes back summed, and the step only divides it.
Outside such a step (evaluation on gathered params, ``model.init``, stage 0 or 1 with
micro-batches) :func:`gather_layer` is the identity, so one model definition serves everywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxzero.mesh import to_varying, varying_axes
from jaxzero.trees import path_keys, path_strs
from jaxzero.zero.collectives import Comm, reduce_leaf, scatter_leaf
from jaxzero.zero.hooks import CalledHook, plan_var
from jaxzero.zero.specs import is_stacked, spec_dim, subtree_end, subtree_paths

_PLAN = plan_var("jaxzero_layer_plan")  # the LayerPlan of the step being traced


_NO_LAYER_GATHER = (
    "ZeRO(stage=3, layers={}) hands the loss each layer stack as shards, but the model never "
    "called jaxzero.gather_layer: wrap the scanned block, e.g. nn.remat(nn.map_variables("
    "Block, 'params', trans_in_fn=jaxzero.gather_layer)), or run the stack with "
    "jaxzero.scan_layers (which also prefetches the next layer), or drop layers= to gather the "
    "whole model up front."
)

_NO_LAYER_REDUCE = (
    "ZeRO(layers={}) at stages 1-2 reduces each layer's gradient in the backward only where "
    "the model calls jaxzero.gather_layer or runs the stack with jaxzero.scan_layers; this "
    "model never did, so the whole gradient is reduced after the backward, as without "
    "layers=. Wrap the scanned block, e.g. nn.remat(nn.map_variables(Block, 'params', "
    "trans_in_fn=jaxzero.gather_layer)), or drop layers=."
)
_NO_SCAN_FOR_PARAMS = (
    "ZeRO(offload=('optimizer', 'params'), layers={}) keeps the layer stacks in host memory "
    "and jaxzero.scan_layers fetches them a layer at a time; gather_layer (an nn.scan over "
    "the stack) cannot. Run the stack with jaxzero.scan_layers, or use offload='optimizer'."
)

_NO_SCAN_FOR_HPZ = (
    "ZeRO(hpz_partition_size={}, layers={}) keeps each layer's gathered weights within the "
    "node for the backward's gather in jaxzero.scan_layers' loop, and this model never ran "
    "its stack with jaxzero.scan_layers (an nn.remat of gather_layer gathers again from the "
    "shards). Run the stack with jaxzero.scan_layers, or drop hpz_partition_size."
)


@dataclasses.dataclass
class LayerPlan(CalledHook):
    """Which dimension each layer leaf was sharded on, keyed by its path inside one layer and
    its local (per-layer, per-device) shape; built by :func:`build_plan`. ``gather``: stage 3
    (gather the shards) or stage 2 (whole params; reduce the gradient only). ``invariant``:
    stage 0 (the stacks enter the loss device-invariant; every stack gradient comes back
    summed, see the module docstring). ``seen``: the keys :func:`gather_layer` handled while
    the loss was traced."""

    comm: Comm
    layers: tuple[str, ...]
    dims: dict[tuple, int | None]
    calls: int = 0
    gather: bool = True
    invariant: bool = False
    seen: set = dataclasses.field(default_factory=set)
    scans: int = 0  # jaxzero.scan_layers calls that ran the prefetching loop
    #: where the saved layer inputs live (the config's ``activations``)
    activations: Any = dataclasses.field(kw_only=True)
    #: where the stacks live (the config's ``placement``): device memory, or host memory
    #: (``offload=("optimizer", "params")``: each layer fetched, each layer's gradient written
    #: into its host slot)
    placement: Any = dataclasses.field(kw_only=True)
    #: the stacks' gradient sums over micro-batches: host accumulators with the params
    #: offloaded (:mod:`jaxzero.zero.offload.sums`), else none
    sums: Any = dataclasses.field(kw_only=True)
    #: the update the last step left pending, run inside the forward's layer loop
    #: (:class:`~jaxzero.zero.layers.rows.LayerRows`), or None
    rows: Any = dataclasses.field(default=None, kw_only=True)
    var = _PLAN

    def wrap(self, fn):
        fn = self.sums.wrap(fn)
        return fn if self.rows is None else self.rows.wrap(fn)

    def emitted(self):
        return None if self.rows is None else self.rows.emitted()

    def lookup(self, path, x):
        keys = path_keys(path)
        # nn.map_variables hands over {"params": {...}}: the collection name is dropped.
        for start in range(len(keys)):
            if (keys[start:], tuple(x.shape)) in self.dims:
                self.seen.add((keys[start:], tuple(x.shape)))
                return self.dims[(keys[start:], tuple(x.shape))]
        known = sorted("/".join(map(str, p)) + str(s) for p, s in self.dims)
        raise ValueError(
            f"gather_layer got a leaf at {jax.tree_util.keystr(tuple(path))} with local shape "
            f"{tuple(x.shape)} that is not a layer of the stacks {self.layers}; per layer "
            f"it knows {known[:8]}. Apply gather_layer to one scanned layer's variables "
            f"(nn.map_variables(Block, 'params', trans_in_fn=jaxzero.gather_layer))."
        )

    # -- the CalledHook answers (jaxzero.zero.hooks) ------------------------------------------
    def must_be_called(self):
        return self.gather

    def not_called(self):
        return ValueError(_NO_LAYER_GATHER.format(self.layers))

    def finish(self):
        super().finish()
        if self.gather and self.comm.wire.hpz and not self.scans:
            raise ValueError(_NO_SCAN_FOR_HPZ.format(self.comm.wire.hpz, self.layers))
        self.activations.check_scanned(self.scans, self.layers)
        if not (self.gather or self.invariant or self.calls):
            warnings.warn(_NO_LAYER_REDUCE.format(self.layers), UserWarning, stacklevel=4)


def _layer_key(path, shape, layers):
    return path_keys(path)[subtree_end(path, layers) :], tuple(shape[1:])


def build_plan(
    comm: Comm,
    layers: tuple[str, ...],
    local_params,
    specs,
    *,
    gather=True,
    invariant=False,
    activations,
    placement,
    sums,
    rows=None,
) -> LayerPlan:
    """The :class:`LayerPlan` of a per-layer step: for each leaf of one layer (a leaf of a
    ``layers`` stack without its layer axis), the dimension it is (stage 3: ``specs`` of the
    params) or its gradient is (stage 2, ``gather=False``: ``specs`` of the gradients)
    sharded on. ``activations``, ``placement``: the config's; ``sums``: the stacks' gradient
    sums (:mod:`jaxzero.zero.offload.sums`)."""
    flat_specs = dict(
        jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]
    )
    dims = {}
    for path, x in jax.tree_util.tree_flatten_with_path(local_params)[0]:
        if not is_stacked(path, layers):
            continue
        d = spec_dim(flat_specs[path])
        dims[_layer_key(path, x.shape, layers)] = None if d is None else d - 1
    where = {"activations": activations, "placement": placement, "sums": sums, "rows": rows}
    return LayerPlan(comm, layers, dims, gather=gather, invariant=invariant, **where)


def reduces_exactly(precision) -> bool:
    """Whether a stage-2 :func:`gather_layer` may hand back the reduced gradient in the
    compute dtype without rounding: ``reduce_dtype`` equals ``param_dtype`` or the params are
    fp32. Otherwise stage 2 reduces the whole gradient after the backward, as without
    ``layers=``."""
    return precision.reduce_dtype == precision.param_dtype or precision.param_dtype == jnp.float32


def reduces_in_backward(stage: int, layers, precision, replica_axes=()) -> bool:
    """Whether a step at ``stage`` (0 or 2; stage 1 reduces as 2 without micro-batches) with
    those ``layers`` reduces each layer's gradient inside the backward. Not stage 2 on a mesh
    with replica axes: the reduce-scattered tile is replica-invariant, but the cotangent of a
    loss leaf varying over every batch axis must vary over them too (the step then reduces
    the whole gradient after the backward, as without ``layers=``)."""
    if not (layers and reduces_exactly(precision)):
        return False
    return stage == 0 or (stage == 2 and not replica_axes)


def leaf_columns(zero, paths, accum_steps: int) -> list[dict]:
    """The per-leaf plan's columns ``layers=`` decides (:mod:`jaxzero.zero.plan`), per leaf
    key path: at stage 3 a stack leaf is gathered a layer at a time and its gradient reduced
    in the backward; at stages 0-2 its gradient is reduced in the backward where
    :func:`reduces_in_backward` (stage 1 as stage 2 with one micro-batch; stages 0/1 with
    micro-batches reduce once), stage 0's stacks entering the loss whole and invariant."""
    if not zero.layers:
        return [{} for _ in paths]
    stage, p, replicas = zero.stage, zero.precision, zero.replica_axes
    if stage == 3:
        cols = {"gather": "per_layer", "reduce": "in_backward"}
    elif stage == 0 and accum_steps == 1 and reduces_in_backward(0, zero.layers, p, replicas):
        cols = {"gather": "invariant", "reduce": "in_backward"}
    elif (stage == 2 or (stage == 1 and accum_steps == 1)) and reduces_in_backward(
        2, zero.layers, p, replicas
    ):
        cols = {"reduce": "in_backward"}
    else:
        return [{} for _ in paths]
    return [dict(cols) if is_stacked(k, zero.layers) else {} for k in paths]


def unused_reason(zero, accum_steps: int) -> str | None:
    """Why ``zero.layers`` reduces no layer's gradient inside the backward of a step with
    ``accum_steps`` micro-batches at stages 0-2 (see :func:`reduces_in_backward`), as the sentence
    a warning gives; None where it does (or at stage 3, or without ``layers=``)."""
    if zero.stage == 3 or not zero.layers:
        return None
    p = zero.precision
    if not reduces_exactly(p):
        return (
            f"the precision policy reduces in {p.reduce_dtype.name} but computes in "
            f"{p.param_dtype.name}, so a layer's reduced gradient could not be handed back "
            f"unrounded; use reduce_dtype == param_dtype, or fp32 params"
        )
    if zero.stage < 2 and accum_steps > 1:
        return (
            f"with micro-batches (accum_steps={accum_steps}) stage {zero.stage} sums the local "
            f"gradient over them and reduces it once; use accum_steps=1 or stage 2"
        )
    if zero.stage > 0 and zero.replica_axes:
        return (
            f"on a mesh with replica axes {zero.replica_axes} stage {zero.stage} reduces the "
            f"whole gradient after the backward; use a 1-D mesh or stage 0 or 3"
        )
    return None


def scattered_mask(plan: LayerPlan | None, grads):
    """True for the layer-stack leaves of ``grads`` already reduced layer by layer: those a
    stage-2 :func:`gather_layer` reduced (see :func:`_pass_leaf`), every stack leaf at stage 0
    (see the module docstring); None when there are none (no plan, a stage-3 plan, or a
    stage-2 model that never called it)."""
    if plan is None or plan.gather or not (plan.calls or plan.invariant):
        return None

    def reduced(path, x):
        if not is_stacked(path, plan.layers):
            return False
        return plan.invariant or _layer_key(path, x.shape, plan.layers) in plan.seen

    return jax.tree_util.tree_map_with_path(reduced, grads)


def check_layers(params, layers: tuple[str, ...], stage: int = 3) -> None:
    """Every name in ``layers`` must name params subtrees (``"outer/inner"`` for a nested
    one) that are layer stacks: arrays that share a leading (layer) dimension. Raises
    ValueError saying what was found and what to do otherwise."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for name in layers:
        if not all(name.split("/")):
            raise ValueError(
                f"ZeRO(layers={layers!r}): {name!r} has an empty part; name a nested subtree "
                f"as 'outer/inner'."
            )
        stacks: dict[tuple, list] = {}  # each subtree the name matches -> its leaves
        for p, x in flat:
            end = subtree_end(p, (name,))
            if end is not None:
                stacks.setdefault(path_strs(p)[:end], []).append((p, tuple(np.shape(x))))
        if not stacks:
            raise ValueError(_no_subtree(params, layers, name))
        for where, leaves in stacks.items():
            _check_stack(layers, "/".join(where), leaves, stage)


def _no_subtree(params, layers, name: str) -> str:
    paths = subtree_paths(params)
    near = difflib.get_close_matches(name, paths, n=8, cutoff=0.5)
    tail = name.split("/")[-1]
    near += [p for p in paths if p not in near and tail in p.split("/")[-1]]
    near += [p for p in paths if p not in near and p.count("/") < 2]
    more = f" ({len(paths)} subtrees in all)" if len(paths) > 12 else ""
    return (
        f"ZeRO(layers={layers!r}): params has no subtree named {name!r}; subtrees near it: "
        f"{near[:12]}{more}. Name the nn.scan'd module's params key, nested as 'outer/inner' "
        f"where needed."
    )


def _check_stack(layers, where: str, leaves, stage: int) -> None:
    scalars = [jax.tree_util.keystr(p) for p, shape in leaves if not shape]
    if scalars:
        raise ValueError(
            f"ZeRO(layers=...): {scalars[:5]} under {where!r} are scalars, not stacked "
            f"per layer; a layer stack's leaves carry the layer index on axis 0."
        )
    first: dict[int, str] = {}  # leading size -> the first leaf that has it
    for p, shape in leaves:
        first.setdefault(shape[0], "/".join(path_strs(p)))
    if len(first) == 1:
        return
    found = ", ".join(f"{path}: {size}" for size, path in list(first.items())[:4])
    children = {path_strs(p)[where.count("/") + 1] for p, _ in leaves}
    numbered = ""
    if all(c.isdigit() for c in children):
        numbered = f"; its children {sorted(children, key=int)[:6]} look like a list of layers"
    unit = f"{where}/\\d+" if numbered else "block_\\d+"
    loop = (
        f"ZeRO(stage=3, units=r'{unit}') in place of layers= (each layer gathered where it "
        f"runs, jaxzero.zero.units)"
        if stage == 3
        else f"stage {stage} without layers="
    )
    raise ValueError(
        f"ZeRO(layers={layers!r}): {where!r} is not a layer stack: a stack (nn.scan, "
        f"jaxzero.stacked_params) carries the layer index on axis 0 of every leaf, but the "
        f"leading sizes of its leaves differ ({found}){numbered}. Stack the layers with "
        f"nn.scan or jaxzero.stacked_params + jaxzero.scan_layers; for a model built as a "
        f"Python loop or list of layers (e.g. an nnx.List), use {loop}."
    )


def current_plan() -> LayerPlan | None:
    """The plan of the per-layer step being traced (None outside one)."""
    return _PLAN.get()


def _with_backward(forward, backward, x):
    """``forward(x)``, differentiated by ``backward(cotangent) -> gradient of x``."""
    fn = jax.custom_vjp(forward)
    fn.defvjp(lambda x: (forward(x), None), lambda _, ct: (backward(ct),))
    return fn(x)


def gather_shard(comm: Comm, x, d, kept: bool = False):
    """One layer leaf's shard ``x`` all-gathered along ``d`` (unless None) in the compute
    dtype, device-varying over the batch axes; with ``kept``, ``x`` is the slice a forward
    kept for the backward (hpZ), gathered within the node
    (:meth:`~jaxzero.zero.wire.Wire.regather`)."""
    y = x.astype(comm.param_dtype)
    if d is not None:
        y = comm.wire.regather(y, comm.axis, d, kept)
    return to_varying(y, comm.batch_axes)


def gather_leaf(comm: Comm, x, d):
    """:func:`gather_shard`, whose backward reduces the gradient with
    :func:`~jaxzero.zero.collectives.reduce_leaf` (reduce-scatter over the data axis, or
    all-reduce when the leaf is replicated) and returns it in ``x``'s dtype."""
    forward = lambda x: gather_shard(comm, x, d)
    return _with_backward(forward, lambda ct: reduce_leaf(comm, ct, d).astype(x.dtype), x)


def _pass_leaf(comm: Comm, x, d):
    """Stages 2 and 0: ``x`` (whole) in the compute dtype; the backward reduce-scatters the
    gradient along ``d`` (all-reduces it when None: stage 0) and returns it in ``x``'s dtype
    and device-variance, repeated along ``d`` to ``x``'s shape: its front tile is the reduced
    gradient (see the module docstring; ZeRO only builds this plan when ``reduce_dtype``
    converts to ``x``'s dtype exactly)."""

    def backward(ct):
        g = scatter_leaf(comm, ct, d).astype(x.dtype)
        if d is not None:
            n = ct.shape[d] // g.shape[d]
            g = jnp.expand_dims(g, d)
            g = jnp.broadcast_to(g, g.shape[:d] + (n,) + g.shape[d + 1 :]).reshape(ct.shape)
        return to_varying(g, varying_axes(x))

    forward = lambda x: to_varying(x.astype(comm.param_dtype), comm.batch_axes)
    return _with_backward(forward, backward, x)


def gather_layer(variables):
    """Gather one scanned layer's variables (use as ``nn.map_variables(trans_in_fn=...)``).

    Inside a stage-3 train step built with ``ZeRO(layers=...)`` every leaf is all-gathered
    along the dimension ZeRO sharded it on; inside a stage-2 one every leaf passes unchanged
    and its gradient is reduce-scattered in the backward; anywhere else the tree is returned
    unchanged.
    """
    plan = _PLAN.get()
    if plan is None:
        return variables
    plan.calls += 1
    if plan.placement.params_on_host:
        raise ValueError(_NO_SCAN_FOR_PARAMS.format(plan.layers))
    leaf = gather_leaf if plan.gather else _pass_leaf
    return jax.tree_util.tree_map_with_path(
        lambda path, x: leaf(plan.comm, x, plan.lookup(path, x)), variables
    )
