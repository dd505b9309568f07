"""The per-device gradient of one step, run inside ``jax.shard_map``: parameters gathered
for the loss, ``value_and_grad`` over each micro-batch, gradients reduced (all-reduce for
stages 0/1, reduce-scatter for 2/3), model state threaded through the micro-batches."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxzero.mesh import to_varying
from jaxzero.precision import warn_wide_compute
from jaxzero.train import loss as user_loss
from jaxzero.zero import hooks as loss_hooks
from jaxzero.zero import plan as leaf_plan
from jaxzero.zero.layers.rows import with_stacks
from jaxzero.zero.path import GradientPath


def _mean_over(x, axes):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.pmean(x, axes)
    return jax.lax.pmax(x, axes)


def local_gradients(
    reducing: GradientPath,
    loss_fn,
    accum_steps: int,
    *,
    stateful: bool = False,
    allow_loss_collectives: bool = False,
):
    """The per-device gradient computation, to run inside ``jax.shard_map``, for the step
    whose gradient path is ``reducing`` (``zero.path.for_step(accum_steps)``:
    :meth:`GradientPath.for_step <jaxzero.zero.path.GradientPath.for_step>`, whose stage the
    micro-batches decide).

    Returns ``fn(params_local, model_state, batch_local, rng, scale, specs, plan)`` ->
    ``(loss, aux, grads, new_model_state)`` (``plan``: the step's per-leaf plan,
    :meth:`jaxzero.ZeRO.plan`, which the gathers and reductions read) where ``grads`` are already reduced by
    :meth:`ZeRO.reduce_gradients` (all-reduced for stages 0/1, reduce-scattered for stages
    2/3). With ``accum_steps > 1`` the local batch is split into micro-batches scanned with
    ``lax.scan``: stages 0/1 accumulate the full local gradient and all-reduce once; stages 2/3
    reduce-scatter every micro-batch into a sharded accumulator, so no full gradient buffer
    outlives a micro-batch. The model state is threaded through the micro-batches and averaged
    over devices at the end (identical on every device when BatchNorm is synchronised).
    ``rng`` is this device's key (already folded with the step and the device index); each
    micro-batch folds in its index.

    For a :class:`~jaxzero.train.loss.GlobalMean` loss, ``loss`` is ``(global mean, factor)``:
    the gradients are then the mean over devices and micro-batches of each one's gradient of
    its ``total``, and ``factor`` (devices x micro-batches / the global count) turns them into
    the gradient of the global mean (the update multiplies it in where it unscales).

    Before the first step the loss's jaxpr is read once (:func:`jaxzero.train.loss.check`): a
    reduction over the data axes in the user's loss is refused unless
    ``allow_loss_collectives``.
    """
    zero = reducing.zero
    axes = zero.batch_axes
    # stages 2/3, and stage 0 when it all-reduces each layer in the backward (one micro-batch)
    reduce_each = reducing.reduces_each_micro_batch()
    # the params in host memory: the stacks' gradients summed into host accumulators
    on_host_sums = reducing.accumulates_on_host(accum_steps)

    checked = []

    def micro(path, params, specs, model_state, batch, rng, scale, sums=None, rows=None):
        full = path.params_for_loss(params, specs)
        # layers=, vocab_parallel=, units=
        hooks = path.loss_hooks(params, specs, sums, accumulate=on_host_sums, rows=rows)
        scaled = loss_hooks.wrap(hooks, user_loss.scaled_loss(loss_fn, stateful))
        if not checked:  # once per trace: what the loss's jaxpr says
            checked.append(True)
            with loss_hooks.scope(hooks):
                traced = user_loss.trace(scaled, (full, model_state, batch, rng, scale))
            user_loss.check(
                traced,
                axes,
                allow=allow_loss_collectives,
                stateful_devices=zero.num_batch_shards if model_state is not None else 1,
            )
            weights = len(jax.tree.leaves(full))
            warn_wide_compute(traced and traced.jaxpr, weights, zero.precision)
        grad_fn = jax.value_and_grad(loss_hooks.emitting(hooks, scaled), has_aux=True)
        with loss_hooks.scope(hooks), jax.named_scope("forward_backward"):
            try:
                (_, ((loss, count, aux, new_state), emitted)), g = grad_fn(
                    full, model_state, batch, rng, scale
                )
            except (AssertionError, NameError) as e:
                if not user_loss.bad_axis_name(e):
                    raise
                hint = user_loss.axis_hint(zero.mesh.axis_names, axes, e)
                raise ValueError(hint) from e
            except Exception as e:
                better = loss_hooks.explain(hooks, e)
                if better is None:
                    raise
                raise better from e
        loss_hooks.finish(hooks)
        if reduce_each:
            # reduce_gradients casts to reduce_dtype for the collective and to output_dtype
            # after it: no full-size upcast of the local gradient before a 16-bit scatter.
            g = path.reduce_gradients(g, hooks)
        else:
            # stages 0/1 accumulate the local gradient in output_dtype, reduce once at the end
            g = jax.tree.map(lambda x: x.astype(zero.precision.output_dtype), g)
        if rows is not None:  # the new stacks and host state the forward's rows wrote
            out_rows.append(next(e for e in emitted if e is not None))
        return (loss, count), aux, g, new_state

    out_rows = []

    def fn(params, model_state, batch, rng, scale, specs, plan, rows=None):
        """The step's gradients; ``rows``: the update the last step left pending, run inside
        the first micro-batch's forward (:class:`~jaxzero.zero.layers.rows.LayerRows`; the
        micro-batches after it read the stacks it wrote, or, delayed, the stacks as they came
        in), which adds a fifth value: the new host state leaves and stacks it wrote."""
        path = dataclasses.replace(reducing, plan=plan)  # each leaf's fate: the plan's rows
        if model_state is not None:
            model_state = jax.tree.map(lambda x: to_varying(x, axes), model_state)
        run = lambda p, ms, b, key, sums=None, rows=None: micro(
            path, p, specs, ms, b, key, scale, sums, rows
        )
        out_rows.clear()
        if accum_steps == 1:
            (losses, counts), auxes, g, model_state = run(
                params, model_state, batch, rng, None, rows
            )
        else:
            # the sums in output_dtype (an offloaded step's stacks come in param_dtype); the
            # leaves the plan sums into host accumulators are those sums already
            host = plan.mask(params, leaf_plan.host_sum)
            out = zero.precision.output_dtype
            first = lambda ms, b, key, sums: _with_grads_in(
                out, run(params, ms, b, key, sums, rows), host
            )
            # after a first micro-batch that ran the rows: the stacks it wrote (traced first)
            rest = lambda ms, b, key, sums: _with_grads_in(
                out, run(_after_rows(params, rows, out_rows), ms, b, key, sums), host
            )
            (losses, counts), auxes, g, model_state = _accumulate(
                first, rest, accum_steps, model_state, batch, rng, host
            )
        if not reduce_each:
            g = path.reduce_gradients(g)
        loss = jax.lax.pmean(losses, axes)
        if counts is not None:  # a GlobalMean: sum(total) / sum(count) over everything
            total = jax.lax.psum(counts, axes)
            factor = jnp.where(total > 0, zero.num_batch_shards * accum_steps / total, 0.0)
            loss = (loss * factor, factor)
        aux = jax.tree.map(lambda x: _mean_over(x, axes), auxes)
        if model_state is not None:
            model_state = jax.tree.map(lambda x: _mean_over(x, axes), model_state)
        if rows is not None:
            return loss, aux, g, model_state, out_rows[-1]
        return loss, aux, g, model_state

    return fn


def _with_grads_in(dtype, out, host):
    """``(loss, aux, grads, model_state)`` with the grads cast to ``dtype`` (micro-batch sums
    accumulate in it; a host accumulator, where ``host`` is True, already holds it)."""
    loss, aux, g, model_state = out
    cast = lambda x, h: x if h else x.astype(dtype)
    return loss, aux, jax.tree.map(cast, g, host), model_state


def _after_rows(params, rows, out_rows):
    """``params`` (this device's, as the loss is handed them) with the stacks the first
    micro-batch's forward wrote (``out_rows``: its ``(held, stacks)``, the stacks in the order
    of ``rows.forward.rows``) where ``rows`` ran; ``params`` as they are without rows or
    when they run delayed (every micro-batch computes on the params before the update)."""
    if rows is None or rows.delayed:
        return params
    return with_stacks(params, dict(zip(rows.forward.rows, out_rows[-1][1], strict=True)))


def _fold(rng, i):
    return None if rng is None else jax.random.fold_in(rng, i)


def _accumulate(first, run, accum_steps: int, model_state, batch, rng, host):
    """Scan ``run(model_state, micro_batch, key, sums) -> (loss, aux, grads, model_state)``
    over ``accum_steps`` micro-batches of the local batch, summing gradients.

    The first micro-batch runs outside the scan (``first``, the same signature: it may run
    a pending update's rows, whose stacks ``run`` then reads) and its gradient becomes the
    carry, so the
    carry has the right device-varying type (and, at stages 2/3, the sharded shape) without
    zeros. A gradient leaf where ``host`` is True (the plan's host sums: parameter offload,
    decision 42) is the sum so far already: ``run`` gets the carry (``sums``; None at the first micro-batch) and adds into
    its host leaves, and the step's update divides them. Returns ``(mean loss, summed count)``
    (the count None but for a :class:`~jaxzero.train.loss.GlobalMean`), the aux (float
    leaves averaged, others from the last micro-batch), the mean gradient (host leaves: the
    sum) and the final model state.
    """
    mbs = jax.tree.map(
        lambda x: x.reshape((accum_steps, x.shape[0] // accum_steps) + x.shape[1:]), batch
    )
    head = jax.tree.map(lambda x: x[0], mbs)
    rest = jax.tree.map(lambda x: x[1:], mbs)
    loss0, aux0, g, model_state = first(model_state, head, _fold(rng, 0), None)
    add = lambda acc, gi, h: gi if h else acc + gi

    def body(carry, xs):
        acc, ms = carry
        mb, i = xs
        loss, aux, gi, ms = run(ms, mb, _fold(rng, i), acc)
        return (jax.tree.map(add, acc, gi, host), ms), (loss, aux)

    idx = jnp.arange(1, accum_steps)
    (g, model_state), (losses, auxes) = jax.lax.scan(body, (g, model_state), (rest, idx))
    cat = lambda a, b: jnp.concatenate([a[None], b])
    (value0, count0), (values, counts) = loss0, losses
    counts = None if count0 is None else cat(count0, counts).sum()
    losses = (cat(value0, values).mean(), counts)
    auxes = jax.tree.map(cat, aux0, auxes)
    auxes = jax.tree.map(
        lambda x: x.mean(0) if jnp.issubdtype(x.dtype, jnp.floating) else x[-1], auxes
    )
    g = jax.tree.map(lambda x, h: x if h else x / accum_steps, g, host)
    return losses, auxes, g, model_state
