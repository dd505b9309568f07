"""The optax update on shards: unscale, global finite check, optax, EMA, new compute params.

Runs under ``jax.jit`` (GSPMD), outside ``shard_map``, so transforms with global reductions
(``clip_by_global_norm``, LAMB) see the global values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxzero.ema import ema as sharded_ema
from jaxzero.ema.ema import ShardedEMA
from jaxzero.train.state import Pending, TrainState, cast, state_layout, with_pending
from jaxzero.trees import check_same_structure
from jaxzero.zero import collectives
from jaxzero.zero import plan as leaf_plan
from jaxzero.zero import specs as sh
from jaxzero.zero.config import ZeROConfig
from jaxzero.zero.offload.placement import host_sharding


def master_view(zero: ZeROConfig, state: TrainState):
    """The master weights in their shards (a local slice of ``params`` when no separate
    master copy is kept)."""
    return _master(state, sh.named(zero.mesh, zero.shard_specs(state.params)))


def _master(state: TrainState, shards):
    """``state``'s master: its own, or ``params`` constrained to ``shards`` (NamedShardings
    of the master's shards, per params leaf)."""
    if state.master is not None:
        return state.master
    return jax.lax.with_sharding_constraint(state.params, shards)


def _pinned(grads, shards, host):
    """The gradients in the master's ``shards``. Leaves in host memory (``host``, the plan's
    ``grads_memory``; parameter offload: the stacks' gradients, written into their params'
    host buffers) are left where they are: they already have the master's shards, and a
    constraint would fetch them."""
    pin = lambda g, s, h: g if h else jax.lax.with_sharding_constraint(g, s)
    return jax.tree.map(pin, grads, shards, host)


def _unscaled(zero: ZeROConfig, state: TrainState, grads, grad_scale=None):
    """The gradients in ``output_dtype``, divided by the loss scale and multiplied by
    ``grad_scale`` (a :class:`~jaxzero.train.loss.GlobalMean` loss's factor; None: 1)."""
    grads = cast(grads, zero.precision.output_dtype)
    factor = None if state.loss_scale is None else 1.0 / state.loss_scale.scale
    if grad_scale is not None:
        factor = grad_scale if factor is None else factor * grad_scale
    if factor is not None:
        grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
    return grads


def _optax_update(zero: ZeROConfig, state: TrainState, master, grads):
    """``(new_master, new_opt_state)``, each pinned where ``zero.placement`` says."""

    def optax_step(grads, opt_state, master):
        updates, opt_state = zero.tx.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state

    new_master, opt_state = optax_step(grads, state.opt_state, master)
    pin = lambda t: zero.placement.pin(t, sh.named(zero.mesh, zero.shard_specs(t)))
    return pin(new_master), pin(opt_state)


def _metrics(zero: ZeROConfig, state: TrainState, new_state: TrainState, norm, finite):
    metrics = {
        "grad_norm": norm,
        "finite": finite,
        "skipped": new_state.skipped,
        "step": new_state.step,
    }
    if new_state.loss_scale is not None:
        metrics["loss_scale"] = new_state.loss_scale.scale
        metrics["loss_scale_at_min"] = jnp.logical_and(
            ~finite, zero.loss_scale.at_minimum(state.loss_scale)
        )
    return metrics


def _new_ema(
    zero: ZeROConfig, state: TrainState, ema, specs, new_master, model_state, step, apply, keep
):
    """The new EMA state. ``specs``: ``(the master's shards, the per-leaf rule's specs of the
    EMA's target, the EMA state's specs)`` where the EMA is updated on the master's shards (a
    ``shard_map``: decision 8); None: leaf by leaf beside the streamed master (offload)."""
    if state.ema is None:
        return None
    if ema is None:
        raise ValueError(
            "state has an EMA but no ShardedEMA was given to apply it; pass ema= to "
            "make_train_step / apply_gradients."
        )
    target = new_master
    if state.model_state is not None:
        target = sharded_ema.target(new_master, keep(model_state, state.model_state))
    if specs is None:
        # per leaf (decision 32): the streamed update reads each EMA leaf beside its master,
        # in the same shards, so the plain update under jit is local and needs no shard_map
        new = ema.update(state.ema, target, step=step, apply=apply)
    else:
        master_specs, leaf_specs, ema_specs = specs
        replicated = jax.tree.map(lambda _: P(), state.model_state)
        placed = sharded_ema.target(master_specs, replicated)  # the target as it is placed
        where = sharded_ema.Shards(zero.mesh, zero.axis, placed, leaf_specs, ema_specs)
        new = sharded_ema.update_on_mesh(ema, state.ema, target, where, step=step, apply=apply)
    if ema.every == 1 and ema.start_step == 0:
        # The EMA then counts exactly the applied steps: deriving its counter from the step's
        # lets XLA compute both in one scalar kernel (on a GPU the EMA's own select was a
        # kernel of its own: 5 -> 4 added by the default EMA at stages 1/2, 1 -> 0 at 3).
        new = new._replace(updates=state.ema.updates + (step - state.step))
    return new


def _shard_update(
    zero: ZeROConfig,
    ema,
    state: TrainState,
    master,
    grads,
    model_state,
    grad_scale=None,
    *,
    sums_of=None,
    ema_specs=None,
):
    """``(new_master, opt_state, ema, compute shards, finite, grad_norm)``: the optax and EMA
    updates on the shards (each leaf unchanged where the step is skipped) and
    ``cast(new_master)`` to ``param_dtype`` (the master itself without a compute copy), then
    the global finite check and norm of the unscaled ``grads``. It runs where
    ``zero.placement`` keeps the state (streamed through the device with offload: decision
    32), so the reductions over the gradients run there too. ``sums_of``: per gradient leaf,
    the number of micro-batches it is the sum of (a host accumulator: decision 42), divided
    here, where the update streams it; None: every leaf is a mean. ``grad_scale``: a scalar
    the gradients are multiplied by (None: 1). ``ema_specs``: the specs of an EMA updated on the
    master's shards (:func:`_new_ema`; None: leaf by leaf, streamed)."""
    if sums_of is not None:
        grads = jax.tree.map(lambda g, k: g if k == 1 else g / k, grads, sums_of)
    grads = _unscaled(zero, state, grads, grad_scale)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    apply = finite if zero.skip_nonfinite else jnp.asarray(True)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
    with jax.named_scope("optimizer_update"):
        new_master, opt_state = _optax_update(zero, state, master, grads)
    new_master = keep(new_master, master)
    step = jnp.where(apply, state.step + 1, state.step)
    new_ema = _new_ema(zero, state, ema, ema_specs, new_master, model_state, step, apply, keep)
    compute = new_master
    if zero.precision.compute_copy:
        compute = cast(new_master, zero.precision.param_dtype)
    norm = optax.tree.norm(grads)
    return new_master, keep(opt_state, state.opt_state), new_ema, compute, finite, norm


def _streamed(zero: ZeROConfig, state: TrainState, plan, ema, model_state, grad_scale):
    """What :func:`apply_gradients` and :func:`apply_pending` hand the placement's update:
    ``(update, master, specs, layout, sums)``, the update function of ``(state, master, grads,
    model_state, grad_scale)``, the master it reads, those arguments' PartitionSpecs, the
    state's :class:`~jaxzero.train.state.StateLayout` and whether the host gradients are
    sums over micro-batches apart from the params (decision 42)."""
    # per gradient leaf, from the plan: the micro-batches it sums
    accum_steps = plan.accum_steps
    sums_of = plan.mask(state.params, lambda r: accum_steps if leaf_plan.host_sum(r) else 1)
    layout = state_layout(zero, state)
    # the master's shards, per params leaf: the master's, the gradients' and the EMA's target's
    shard_specs = zero.shard_specs(state.params)
    shards = sh.named(zero.mesh, shard_specs)
    ema_specs = None
    if state.ema is not None and not zero.placement.update_is_local:
        # updated on the master's shards: where each EMA leaf of the target is split
        target = sharded_ema.target(state.params, state.model_state)
        ema_specs = (shard_specs, zero.ema_leaf_specs(target), layout.specs.ema)
    master = _master(state, shards)
    # unscales where the state lives
    update = lambda *a: _shard_update(zero, ema, *a, sums_of=sums_of, ema_specs=ema_specs)
    sums = zero.path.accumulates_on_host(accum_steps)
    # a stored master's leaf (a remainder) is streamed in its lo's shards, the params leaf's
    specs = (
        layout.specs.replace(params=None, master=None),
        shard_specs,
        shard_specs,
        jax.tree.map(lambda _: P(), model_state),
        None if grad_scale is None else P(),
    )
    return update, master, specs, layout, sums


def apply_gradients(
    zero: ZeROConfig,
    state: TrainState,
    grads,
    *,
    plan,
    ema: ShardedEMA | None = None,
    model_state=None,
    grad_scale=None,
    packed=None,
    placeholders: bool = False,
):
    """:meth:`jaxzero.ZeRO.apply_gradients` (see there). ``plan``: the step's per-leaf plan
    (:mod:`jaxzero.zero.plan`), which says which gradients sit in host memory and which are
    host sums over its micro-batches (the params offloaded: in accumulators apart from the
    params, decision 42), divided by the update. ``grad_scale``: a scalar the gradients are
    multiplied by before the update (a :class:`~jaxzero.train.loss.GlobalMean` loss's
    devices x micro-batches / global count). The state's layout (its specs, host leaves and
    shardings) is decided once here: the new state has the old one's structure. With
    ``offload_update="deferred"`` the new state is a
    :class:`~jaxzero.train.state.PendingState`: the layer stacks' update is left in its
    ``pending`` (:func:`apply_pending` applies it), and their params are the old ones.
    ``packed``: the host state leaves of those stacks as packed rows, which the forward's
    layer loop wrote (:func:`with_rows`); where the next forward runs the rows and none are
    given, the leaves are packed here. The state leaves the packed rows hold are then
    recorded in the pending update's ``stale``, and with ``placeholders`` (a step whose state
    came in with placeholders: its update was pending) replaced by placeholders; a step
    that came in with the real leaves returns them, and :func:`drop_stale` swaps them
    outside jit (donated leaves in host memory would otherwise be reused for device outputs
    of their shape, as jax matches donations without memory kinds)."""
    state.check_flushed("the update (apply_gradients)")
    host = plan.mask(grads, leaf_plan.grads_on_host)
    update, master, specs, layout, sums = _streamed(zero, state, plan, ema, model_state, grad_scale)
    shard_specs = specs[1]
    shards = sh.named(zero.mesh, shard_specs)
    with jax.named_scope("optimizer_update"):
        pinned = _pinned(grads, shards, host)
    if state.model_state is not None and model_state is not None:
        # the loss's new model state, checked before the update (and its EMA) keeps it
        check_same_structure(state.model_state, model_state, "model_state")
    deferred = zero.placement.defers
    outs = zero.placement.run_update(
        zero,
        update,
        state,
        master,
        pinned,
        model_state,
        grad_scale,
        specs=specs,
        host=layout.host,
        grads_in_params=not sums,
        # the plan's layout says whether the next forward runs the rows from packed rows
        **(
            dict(defer=True, packed=packed, pack=any(map(leaf_plan.packed_rows, plan.rows)))
            if deferred
            else {}
        ),
    )
    pending = None
    if deferred:
        outs, values, rows, (packed, packing, stale) = outs
        # the arguments the rows trace the update with again: only their shapes are read
        leaves, tree = jax.tree.flatten((pinned, model_state, grad_scale))
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
        pending = Pending(values, (tree, shapes), rows, packed, packing)
    new_master, opt_state, new_ema, compute, finite, norm = outs
    if deferred:  # the stacks' compute params: the old ones until the rows run
        compute = _with_rows(compute, state.params, rows)
    apply = finite if zero.skip_nonfinite else jnp.asarray(True)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
    step = jnp.where(apply, state.step + 1, state.step)
    if zero.stage in (1, 2):
        with jax.named_scope("gather_updated_params"):
            compute = collectives.all_gather(zero.mesh, zero.axis, compute, shard_specs)
        if deferred:  # the old replicated params: no gather of the stale shards
            compute = _with_rows(compute, state.params, rows)
    loss_scale = state.loss_scale
    if loss_scale is not None:
        loss_scale = zero.loss_scale.update(loss_scale, finite)
    new_state = state.replace(
        step=step,
        params=zero.placement.new_params(compute, state.params, keep),
        master=new_master if state.master is not None else None,
        opt_state=opt_state,
        skipped=state.skipped + jnp.where(apply, 0, 1).astype(jnp.int32),
        ema=new_ema,
        loss_scale=loss_scale,
    )
    if state.model_state is not None and model_state is not None:
        new_state = new_state.replace(model_state=keep(model_state, state.model_state))
    metrics = _metrics(zero, state, new_state, norm, finite)
    # the state leaves packed rows now hold, passed through the update unchanged (by identity)
    ids = {id(x) for x in stale} if deferred else set()
    stale = [i for i, x in enumerate(jax.tree.leaves(new_state)) if id(x) in ids]
    new_state = zero.placement.constrain(new_state, layout.shardings)
    if pending is None:
        return new_state, metrics
    if stale:  # the rows are in the packed buffers: the tree's leaves are stale
        flat, where = jax.tree.leaves(new_state), jax.tree.leaves(layout.shardings)
        record = tuple(
            (i, tuple(flat[i].shape), jnp.dtype(flat[i].dtype).name, where[i].spec) for i in stale
        )
        pending = pending.replace(stale=record)
        if placeholders:
            new_state = _placeholders(new_state, record, layout.shardings)
    return with_pending(new_state, pending), metrics


def placeholder_shape(shape, spec, mesh) -> tuple[int, ...]:
    """The shape of a stale leaf's placeholder: one element per device, each dimension the
    number of devices ``spec`` splits it over (1 where it is not split)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    axes = lambda e: (e,) if isinstance(e, str) else (e or ())
    return tuple(math.prod(mesh.shape[a] for a in axes(e)) for e in entries)


def _placeholders(state: TrainState, stale, shardings) -> TrainState:
    """``state`` (under jit) with a placeholder (:func:`placeholder_shape`) at each stale
    leaf of ``stale`` (:attr:`~jaxzero.train.state.Pending.stale`), in its sharding of
    ``shardings``."""
    flat, tree = jax.tree.flatten(state)
    where = jax.tree.leaves(shardings)
    for i, shape, dtype, spec in stale:
        # a value of the step: a constant output is jax's own, in the memory it picks
        zero = (0 * state.step).astype(dtype)
        target = placeholder_shape(shape, spec, where[i].mesh)
        flat[i] = jax.device_put(jnp.broadcast_to(zero, target), where[i])
    return jax.tree.unflatten(tree, flat)


def restored_shapes(state: TrainState, stale) -> TrainState:
    """``state`` with each placeholder of ``stale`` a ShapeDtypeStruct of the leaf it stands
    for (the shapes the rows unpack into)."""
    return _with_stale(state, stale, lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype))


def _with_stale(state: TrainState, stale, leaf) -> TrainState:
    """``state`` with ``leaf(shape, dtype, spec)`` at each flat leaf index of ``stale``."""
    flat, tree = jax.tree.flatten(state)
    for i, shape, dtype, spec in stale:
        flat[i] = leaf(shape, jnp.dtype(dtype), spec)
    return jax.tree.unflatten(tree, flat)


def drop_stale(state: TrainState) -> TrainState:
    """``state`` (outside jit) with each stale leaf its pending update records
    (:attr:`~jaxzero.train.state.Pending.stale`) that is still whole replaced by a
    placeholder, in its sharding: the first step that packs the rows returns them whole.
    A state without stale leaves comes back as it is."""
    pending = getattr(state, "pending", None)
    if pending is None or not pending.stale:
        return state
    flat, tree = jax.tree.flatten(state)
    changed = False
    for i, shape, dtype, spec in pending.stale:
        x = flat[i]
        target = placeholder_shape(shape, spec, x.sharding.mesh)
        if tuple(x.shape) == target:
            continue
        zeros = np.zeros(target, dtype)
        flat[i] = jax.make_array_from_callback(target, x.sharding, lambda idx, z=zeros: z[idx])
        changed = True
    return jax.tree.unflatten(tree, flat) if changed else state


def _restored(zero: ZeROConfig, state: TrainState, stale) -> TrainState:
    """``state`` with each placeholder of ``stale`` (:func:`_placeholders`) a leaf of its
    shape again, zeros in pinned host memory: the update is traced on the real shapes, and
    nothing reads them but an unpacking, which writes every row first (a step whose forward
    runs the rows never reads them: XLA removes them)."""
    zeros = lambda shape, dtype, spec: jax.device_put(
        jnp.zeros(shape, dtype), host_sharding(zero.mesh, spec)
    )
    return _with_stale(state, stale, zeros)


def _with_rows(compute, params, rows):
    """``compute`` (a params tree, None at a deferred leaf) with ``params``' leaf at each flat
    leaf index of ``rows``."""
    flat, tree = jax.tree.flatten(compute, is_leaf=lambda x: x is None)
    old = jax.tree.leaves(params)
    return jax.tree.unflatten(tree, [old[i] if i in rows else x for i, x in enumerate(flat)])


def apply_pending(zero: ZeROConfig, state: TrainState, *, plan, ema: ShardedEMA | None = None):
    """``state`` with its :class:`~jaxzero.train.state.Pending` update applied (under jit): the
    layer stacks' rows that the last step's update left undone, a layer at a time
    (``stream.run_rows``), written into the master, the optimizer state and the EMA in host
    memory, and their new compute params into ``params``: a plain
    :class:`~jaxzero.train.state.TrainState`. A state with nothing pending comes back as it
    is. ``plan`` and ``ema``: the step's, as the update that left the rows was given them."""
    if state.pending is None:
        return state
    pending = state.pending
    state, call, kw, specs, layout = _pending_call(zero, state, plan, ema)
    args, new_master, stacks = zero.placement.run_pending(*call, **kw)
    flat, params_tree = jax.tree.flatten(state.params)
    new = [stacks.get(i) for i in range(len(flat))]
    if zero.stage in (1, 2):
        specs_flat = jax.tree.leaves(specs[1], is_leaf=lambda s: isinstance(s, P))
        gathered = collectives.all_gather(
            zero.mesh,
            zero.axis,
            [new[i] for i in pending.rows],
            [specs_flat[i] for i in pending.rows],
        )
        for i, x in zip(pending.rows, gathered, strict=True):
            new[i] = x
    new = {i: x for i, x in enumerate(new) if x is not None}
    return _written(zero, state, args, new_master, new, layout.shardings)


def _written(zero: ZeROConfig, state: TrainState, args, master, new, shardings) -> TrainState:
    """``state`` with the pending rows written: ``args`` (the streamed update's first
    argument: its optimizer state and EMA) and ``master`` as the rows left them, and the new
    compute params ``new`` (``{flat params index: leaf}``), placed by ``shardings``."""
    flat, params_tree = jax.tree.flatten(state.params)
    for i, x in new.items():
        flat[i] = x.astype(flat[i].dtype)  # a forward loop's stack may be the loss's wider copy
    state = state.replace(
        params=jax.tree.unflatten(params_tree, flat),
        master=master if state.master is not None else None,
        opt_state=args.opt_state,
        ema=args.ema,
    )
    return zero.placement.constrain(state, shardings)


def rows_in_forward(zero: ZeROConfig, state: TrainState, accum_steps: int) -> bool:
    """Whether the step runs the update its state has pending inside the forward's layer loop
    (decision 51's third stage): stage 3 per layer, one micro-batch. Otherwise
    :func:`apply_pending` runs it before the forward."""
    return state.pending is not None and zero.per_layer and accum_steps == 1


def pending_rows(zero: ZeROConfig, state: TrainState, *, plan, ema: ShardedEMA | None = None):
    """``(rows, state)``: the placement's
    :class:`~jaxzero.zero.offload.placement.DeferredRows` of the update ``state`` has pending
    (for the forward's layer loop to run, :mod:`jaxzero.zero.layers.rows`), and ``state``
    with nothing pending. ``plan`` and ``ema``: the step's."""
    state, call, kw, _, _ = _pending_call(zero, state, plan, ema)
    return zero.placement.forward_rows(*call, **kw), state


def _pending_call(zero: ZeROConfig, state: TrainState, plan, ema):
    """What the placement's pending rows are called with, for the update ``state`` has
    pending: ``(state with nothing pending, positional arguments, keywords, the update's
    specs, the state's layout)``."""
    pending = state.pending
    state = _restored(zero, with_pending(state, None), pending.stale)
    tree, shapes = pending.avals
    grads, model_state, grad_scale = jax.tree.unflatten(tree, shapes)
    update, master, specs, layout, sums = _streamed(zero, state, plan, ema, model_state, grad_scale)
    call = (zero, update, state, master, grads, model_state, grad_scale)
    kw = dict(
        pending=pending.values,
        rows=pending.rows,
        packed=pending.packed,
        specs=specs,
        host=layout.host,
        grads_in_params=not sums,
    )
    return state, call, kw, specs, layout


def with_rows(zero: ZeROConfig, state: TrainState, rows, held, stacks):
    """``state`` with what the forward's layer loop wrote (:func:`pending_rows`): the host
    state leaves ``held`` in the master, optimizer state and EMA, and the new compute
    ``stacks`` (in the order of ``rows.rows``) in the params: a step without deferral's state
    after the last update."""
    args, master = rows.finish(held)
    new = dict(zip(rows.rows, stacks, strict=True))
    return _written(zero, state, args, master, new, state_layout(zero, state).shardings)
