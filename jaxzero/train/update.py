"""The optax update on shards: unscale, global finite check, optax, EMA, new compute params.

Runs under ``jax.jit`` (GSPMD), outside ``shard_map``, so transforms with global reductions
(``clip_by_global_norm``, LAMB) see the global values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxzero.ema.ema import ShardedEMA, update_on_shards
from jaxzero.train.state import TrainState, cast, constrain, ema_target, state_specs
from jaxzero.trees import check_same_structure
from jaxzero.zero import plan as leaf_plan
from jaxzero.zero import specs as sh
from jaxzero.zero.config import ZeROConfig


def master_view(zero: ZeROConfig, state: TrainState):
    """The master weights in their shards (a local slice of ``params`` when no separate
    master copy is kept)."""
    if state.master is not None:
        return state.master
    specs = zero.shard_specs(state.params)
    return jax.lax.with_sharding_constraint(state.params, sh.named(zero.mesh, specs))


def _pinned(zero: ZeROConfig, grads, host):
    """The gradients in the master's shards. Leaves in host memory (``host``, the plan's
    ``grads_memory``; parameter offload: the stacks' gradients, written into their params'
    host buffers) are left where they are: they already have the master's shards, and a
    constraint would fetch them."""
    named = sh.named(zero.mesh, zero.shard_specs(grads))
    pin = lambda g, s, h: g if h else jax.lax.with_sharding_constraint(g, s)
    return jax.tree.map(pin, grads, named, host)


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


def _new_ema(zero: ZeROConfig, state: TrainState, ema, new_master, model_state, step, apply, keep):
    if state.ema is None:
        return None
    if ema is None:
        raise ValueError(
            "state has an EMA but no ShardedEMA was given to apply it; pass ema= to "
            "make_train_step / apply_gradients."
        )
    target = new_master
    if state.model_state is not None:
        target = ema_target(new_master, keep(model_state, state.model_state))
    if zero.placement.update_is_local:
        # per leaf (decision 32): the streamed update reads each EMA leaf beside its master,
        # in the same shards, so the plain update under jit is local and needs no shard_map
        new = ema.update(state.ema, target, step=step, apply=apply)
    else:
        new = update_on_shards(zero, ema, state.ema, target, step=step, apply=apply)
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
):
    """``(new_master, opt_state, ema, compute shards, finite, grad_norm)``: the optax and EMA
    updates on the shards (each leaf unchanged where the step is skipped) and
    ``cast(new_master)`` to ``param_dtype`` (the master itself without a compute copy), then
    the global finite check and norm of the unscaled ``grads``. It runs where
    ``zero.placement`` keeps the state (streamed through the device with offload: decision
    32), so the reductions over the gradients run there too. ``sums_of``: per gradient leaf,
    the number of micro-batches it is the sum of (a host accumulator: decision 42), divided
    here, where the update streams it; None: every leaf is a mean. ``grad_scale``: a scalar
    the gradients are multiplied by (None: 1)."""
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
    new_ema = _new_ema(zero, state, ema, new_master, model_state, step, apply, keep)
    compute = new_master
    if zero.precision.compute_copy:
        compute = cast(new_master, zero.precision.param_dtype)
    norm = optax.tree.norm(grads)
    return new_master, keep(opt_state, state.opt_state), new_ema, compute, finite, norm


def apply_gradients(
    zero: ZeROConfig,
    state: TrainState,
    grads,
    *,
    ema: ShardedEMA | None = None,
    model_state=None,
    accum_steps: int = 1,
    grad_scale=None,
    plan=None,
):
    """:meth:`jaxzero.ZeRO.apply_gradients` (see there). ``accum_steps``: the step's
    micro-batches; with the params offloaded the gradient leaves in host memory are then
    their sums, in accumulators apart from the params (decision 42), divided by the update.
    ``grad_scale``: a scalar the gradients are multiplied by before the update (a
    :class:`~jaxzero.train.loss.GlobalMean` loss's devices x micro-batches / global count).
    ``plan``: the step's per-leaf plan (built here from the params' shapes when None), which
    says which gradients sit in host memory and which are host sums over micro-batches."""
    if plan is None:
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
        plan = leaf_plan.build(zero, shapes, accum_steps=accum_steps)
    master = master_view(zero, state)
    with jax.named_scope("optimizer_update"):
        pinned = _pinned(zero, grads, plan.mask(grads, leaf_plan.grads_on_host))
    sums = zero.path.accumulates_on_host(accum_steps)
    sums_of = plan.mask(pinned, lambda r: accum_steps if leaf_plan.host_sum(r) else 1)
    # unscales where the state lives
    update = lambda *a: _shard_update(zero, ema, *a, sums_of=sums_of)
    specs = (
        state_specs(zero, state).replace(params=None, master=None),
        zero.shard_specs(master),
        zero.shard_specs(pinned),
        jax.tree.map(lambda _: P(), model_state),
        None if grad_scale is None else P(),
    )
    new_master, opt_state, new_ema, compute, finite, norm = zero.placement.run_update(
        zero,
        update,
        state,
        master,
        pinned,
        model_state,
        grad_scale,
        specs=specs,
        grads_in_params=not sums,
    )
    apply = finite if zero.skip_nonfinite else jnp.asarray(True)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
    step = jnp.where(apply, state.step + 1, state.step)
    if zero.stage in (1, 2):
        with jax.named_scope("gather_updated_params"):
            compute = zero.all_gather(compute)
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
        check_same_structure(state.model_state, model_state, "model_state")
        new_state = new_state.replace(model_state=keep(model_state, state.model_state))
    metrics = _metrics(zero, state, new_state, norm, finite)
    return constrain(zero, new_state), metrics
