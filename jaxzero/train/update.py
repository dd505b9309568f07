"""The optax update on shards: unscale, global finite check, optax, EMA, new compute params.

Runs under ``jax.jit`` (GSPMD), outside ``shard_map``, so transforms with global reductions
(``clip_by_global_norm``, LAMB) see the global values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxzero.ema import ema as sharded_ema
from jaxzero.ema.ema import ShardedEMA
from jaxzero.train.state import Pending, TrainState, cast, with_pending
from jaxzero.zero import collectives
from jaxzero.zero import plan as leaf_plan
from jaxzero.zero import specs as sh
from jaxzero.zero.config import ZeROConfig
from jaxzero.zero.layers.rows import with_stacks


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


def _optax_update(zero: ZeROConfig, state: TrainState, master, grads, pins):
    """``(new_master, new_opt_state)``, each pinned where ``zero.placement`` says to its
    NamedShardings in ``pins`` (``(the master's, the optimizer state's)``)."""
    updates, opt_state = zero.tx.update(grads, state.opt_state, master)
    new_master = optax.apply_updates(master, updates)
    return zero.placement.pin(new_master, pins[0]), zero.placement.pin(opt_state, pins[1])


def _shard_update(
    zero: ZeROConfig,
    ema,
    state: TrainState,
    master,
    grads,
    model_state,
    grad_scale=None,
    *,
    pins,
    plan,
    ema_on=None,
):
    """``(new_master, opt_state, ema, compute shards, finite, grad_norm)``: the optax and EMA
    updates on the shards (each leaf unchanged where the step is skipped) and
    ``cast(new_master)`` to ``param_dtype`` (the master itself without a compute copy), then
    the global finite check and norm of the unscaled ``grads``. It runs where
    ``zero.placement`` keeps the state (streamed through the device with offload: decision
    32), so the reductions over the gradients run there too. ``plan``: the step's per-leaf
    plan: a gradient leaf it marks as a host sum over its micro-batches (a host accumulator:
    decision 42) is divided here, where the update streams it; the others are means. ``grad_scale``: a scalar
    the gradients are multiplied by (None: 1). ``pins``: the NamedShardings of the new master
    and optimizer state (the master's shards and the state layout's). ``ema_on``: the
    :class:`~jaxzero.ema.ema.Shards` the EMA is updated on (the state layout's; None: leaf by
    leaf, streamed: :func:`~jaxzero.ema.ema.in_step`)."""
    sums_of = plan.mask(grads, lambda r: plan.accum_steps if leaf_plan.host_sum(r) else 1)
    grads = jax.tree.map(lambda g, k: g if k == 1 else g / k, grads, sums_of)
    grads = _unscaled(zero, state, grads, grad_scale)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    apply = finite if zero.skip_nonfinite else jnp.asarray(True)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
    with jax.named_scope("optimizer_update"):
        new_master, opt_state = _optax_update(zero, state, master, grads, pins)
    new_master = keep(new_master, master)
    step = jnp.where(apply, state.step + 1, state.step)
    new_ema = None
    if state.ema is not None:
        kept = None if state.model_state is None else keep(model_state, state.model_state)
        new_ema = sharded_ema.in_step(
            ema,
            state.ema,
            new_master,
            kept,
            on_shards=ema_on,
            step=step,
            old_step=state.step,
            apply=apply,
        )
    compute = new_master
    if zero.precision.compute_copy:
        compute = cast(new_master, zero.precision.param_dtype)
    norm = optax.tree.norm(grads)
    return new_master, keep(opt_state, state.opt_state), new_ema, compute, finite, norm


def _streamed(zero: ZeROConfig, state: TrainState, layout, plan, ema, model_state, grad_scale):
    """What :func:`apply_gradients` and :func:`apply_pending` hand the placement's update:
    ``(update, master, specs, sums)``, the update function of ``(state, master, grads,
    model_state, grad_scale)``, the master it reads, those arguments' PartitionSpecs and
    whether the host gradients are sums over micro-batches apart from the params (decision
    42). ``layout``: the state's :class:`~jaxzero.train.state.StateLayout`."""
    # the master's shards, per params leaf: the master's, the gradients' and the EMA's target's
    shard_specs = zero.shard_specs(state.params)
    shards = sh.named(zero.mesh, shard_specs)
    master = _master(state, shards)
    pins = (shards, sh.named(zero.mesh, layout.specs.opt_state))
    # an EMA beside an update on the device: updated on the master's shards (a shard_map)
    ema_on = None if zero.placement.update_is_local else layout.ema_shards
    # unscales where the state lives
    update = lambda *a: _shard_update(zero, ema, *a, pins=pins, plan=plan, ema_on=ema_on)
    sums = zero.path.accumulates_on_host(plan.accum_steps)
    # a stored master's leaf (a remainder) is streamed in its lo's shards, the params leaf's
    specs = (
        layout.specs.replace(params=None, master=None),
        shard_specs,
        shard_specs,
        jax.tree.map(lambda _: P(), model_state),
        None if grad_scale is None else P(),
    )
    return update, master, specs, sums


def apply_gradients(
    zero: ZeROConfig,
    state: TrainState,
    grads,
    *,
    plan,
    layout,
    ema: ShardedEMA | None = None,
    model_state=None,
    grad_scale=None,
    forward=None,
    placeholders: bool = False,
    delayed: bool = False,
):
    """:meth:`jaxzero.ZeRO.apply_gradients` (see there). ``plan``: the step's per-leaf plan
    (:mod:`jaxzero.zero.plan`), which says which gradients sit in host memory and which are
    host sums over its micro-batches (the params offloaded: in accumulators apart from the
    params, decision 42), divided by the update. ``layout``: ``state``'s
    :class:`~jaxzero.train.state.StateLayout` (its specs, host leaves and shardings; the new
    state has the old one's structure). ``grad_scale``: a scalar the gradients are
    multiplied by before the update (a :class:`~jaxzero.train.loss.GlobalMean` loss's
    devices x micro-batches / global count). With
    ``offload_update="deferred"`` the new state is a
    :class:`~jaxzero.train.state.PendingState`: the layer stacks' update is left in its
    ``pending`` (:func:`apply_pending` applies it), and their params are the old ones.
    ``forward``: ``(rows, held, stacks)``, what the forward's layer loop wrote when it ran the
    rows of the update ``state`` had pending (:func:`pending_rows`): the host state leaves
    ``held`` (the stacks' state as packed rows), written into the master, optimizer state
    and EMA first, and the new compute ``stacks`` (in the order of ``rows.rows``) into the
    params; where the next forward runs the rows and none are given, the leaves are packed
    here. The state leaves the packed rows hold are then
    recorded in the pending update's ``stale``, and with ``placeholders`` (a step whose state
    came in with placeholders: its update was pending) replaced by placeholders; a step
    that came in with the real leaves returns them, and
    :func:`~jaxzero.train.state.drop_stale` swaps them outside jit (donated leaves in host
    memory would otherwise be reused for device outputs of their shape, as jax matches
    donations without memory kinds). ``delayed``: the pending update it leaves is applied by
    a delayed step (:attr:`~jaxzero.train.state.Pending.delayed`)."""
    state.check_flushed("the update (apply_gradients)")
    packed = None
    if forward is not None:  # the update the state had pending, as the forward's loop left it
        loop, held, stacks = forward
        args, master = loop.finish(held)
        new = dict(zip(loop.rows, stacks, strict=True))
        state = _written(zero, state, args, master, new, layout.shardings)
        packed = loop.buffers(held)
    host = plan.mask(grads, leaf_plan.grads_on_host)
    update, master, specs, sums = _streamed(zero, state, layout, plan, ema, model_state, grad_scale)
    shard_specs = specs[1]
    shards = sh.named(zero.mesh, shard_specs)
    with jax.named_scope("optimizer_update"):
        pinned = _pinned(grads, shards, host)
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
        before = None
        if zero.placement.delays:  # what a delayed step's forward reads
            flat = jax.tree.leaves(state.params)
            before = {i: x for i, x in enumerate(flat) if i not in rows}
        pending = Pending(
            values, (tree, shapes), rows, packed, packing, delayed=delayed, before=before
        )
    new_master, opt_state, new_ema, compute, finite, norm = outs
    apply = finite if zero.skip_nonfinite else jnp.asarray(True)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
    step = jnp.where(apply, state.step + 1, state.step)
    if zero.stage in (1, 2):
        with jax.named_scope("gather_updated_params"):
            compute = collectives.all_gather(zero.mesh, zero.axis, compute, shard_specs)
    if deferred:  # the stacks' compute params (None): the old ones until the rows run
        old_at_none = lambda new, old: old if new is None else new
        compute = jax.tree.map(old_at_none, compute, state.params, is_leaf=lambda x: x is None)
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
    metrics = {"grad_norm": norm, "finite": finite, "skipped": new_state.skipped, "step": step}
    if loss_scale is not None:
        metrics["loss_scale"] = loss_scale.scale
        at_min = zero.loss_scale.at_minimum(state.loss_scale)
        metrics["loss_scale_at_min"] = jnp.logical_and(~finite, at_min)
    # the state leaves packed rows now hold, passed through the update unchanged (by identity)
    ids = {id(x) for x in stale} if deferred else set()
    stale = [i for i, x in enumerate(jax.tree.leaves(new_state)) if id(x) in ids]
    new_state = zero.placement.constrain(new_state, layout.shardings)
    if pending is None:
        return new_state, metrics
    if stale:  # the rows are in the packed buffers: the tree's leaves are stale
        flat, where = jax.tree.leaves(new_state), jax.tree.leaves(layout.shardings)
        record = tuple(
            (i, tuple(flat[i].shape), jnp.dtype(flat[i].dtype).name, where[i]) for i in stale
        )
        pending = pending.replace(stale=record)
        if placeholders:
            new_state = pending.placeholders(new_state)
    return with_pending(new_state, pending), metrics


def apply_pending(
    zero: ZeROConfig, state: TrainState, pending, *, plan, layout, ema: ShardedEMA | None = None
):
    """``state`` with the :class:`~jaxzero.train.state.Pending` update ``pending`` applied
    (under jit): the layer stacks' rows that the last step's update left undone, a layer at a
    time (``stream.run_rows``), written into the master, the optimizer state and the EMA in
    host memory, and their new compute params into ``params``. ``state``: the plain state
    the update was left on (:func:`~jaxzero.train.state.split_pending`); with ``pending``
    None it comes back as it is. ``plan``, ``layout`` (``state``'s
    :class:`~jaxzero.train.state.StateLayout`) and ``ema``: the step's, as the update that
    left the rows was given them."""
    if pending is None:
        return state
    call, kw, specs = _pending_call(zero, state, pending, plan, ema, layout)
    args, new_master, stacks = zero.placement.run_pending(*call, **kw)
    return _written(zero, state, args, new_master, stacks, layout.shardings, specs[1])


def _written(
    zero: ZeROConfig, state: TrainState, args, master, new, shardings, shard_specs=None
) -> TrainState:
    """``state`` with the pending rows written: ``args`` (the streamed update's first
    argument: its optimizer state and EMA) and ``master`` as the rows left them, and the new
    compute params ``new`` (``{flat params index: leaf}``), placed by ``shardings``. At
    stages 1-2 ``new`` holds the rows' new shards, gathered here (``shard_specs``: the
    params' shard specs)."""
    if zero.stage in (1, 2):  # the new shards of the rows' stacks, replicated
        specs_flat = jax.tree.leaves(shard_specs, is_leaf=lambda s: isinstance(s, P))
        shards = [new.get(i) for i in range(len(specs_flat))]
        gathered = collectives.all_gather(zero.mesh, zero.axis, shards, specs_flat)
        new = {i: x for i, x in enumerate(gathered) if x is not None}
    state = state.replace(
        params=with_stacks(state.params, new),
        master=master if state.master is not None else None,
        opt_state=args.opt_state,
        ema=args.ema,
    )
    return zero.placement.constrain(state, shardings)


def rows_in_forward(zero: ZeROConfig) -> bool:
    """Whether a step runs the update its state has pending inside the forward's layer loop
    (decision 51's third stage; with micro-batches, the first one's): stage 3 per layer.
    Otherwise :func:`apply_pending` runs it before the forward."""
    return zero.per_layer


def pending_rows(
    zero: ZeROConfig, state: TrainState, pending, *, plan, layout, ema: ShardedEMA | None = None
):
    """The placement's :class:`~jaxzero.zero.offload.placement.DeferredRows` of the
    :class:`~jaxzero.train.state.Pending` update ``pending`` left on the plain ``state``, for
    the forward's layer loop to run (:mod:`jaxzero.zero.layers.rows`). ``plan``, ``layout``
    and ``ema``: the step's (see :func:`apply_pending`)."""
    call, kw, _ = _pending_call(zero, state, pending, plan, ema, layout)
    return zero.placement.forward_rows(*call, **kw)


def _pending_call(zero: ZeROConfig, state: TrainState, pending, plan, ema, layout):
    """What the placement's pending rows are called with, for the update ``pending`` left on
    ``state``: ``(positional arguments, keywords, the update's specs)``."""
    tree, shapes = pending.avals
    grads, model_state, grad_scale = jax.tree.unflatten(tree, shapes)
    update, master, specs, sums = _streamed(zero, state, layout, plan, ema, model_state, grad_scale)
    call = (zero, update, state, master, grads, model_state, grad_scale)
    kw = dict(
        pending=pending.values,
        rows=pending.rows,
        packed=pending.packed,
        specs=specs,
        host=layout.host,
        grads_in_params=not sums,
    )
    return call, kw, specs
