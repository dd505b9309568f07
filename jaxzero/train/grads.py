"""The per-device gradient of one step, run inside ``jax.shard_map``: parameters gathered
for the loss, ``value_and_grad`` over each micro-batch, gradients reduced (all-reduce for
stages 0/1, reduce-scatter for 2/3), model state threaded through the micro-batches."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxzero._tree import check_same_structure
from jaxzero.precision import warn_wide_compute
from jaxzero.zero import hooks as loss_hooks
from jaxzero.zero.collectives import to_varying
from jaxzero.zero.config import ZeROConfig
from jaxzero.zero.offload import on_host


def _bad_axis_name(e: Exception) -> bool:
    """A bare AssertionError, or an unbound-axis NameError: what jax.lax collectives (and
    Flax's BatchNorm through them) raise for an axis name that is not a mesh axis."""
    return (isinstance(e, AssertionError) and not str(e)) or "axis name" in str(e)


def _axis_hint(zero, e: Exception) -> str:
    detail = f": {e}" if str(e) else ""
    return (
        f"the loss failed inside jaxzero's shard_map, whose mesh axes are "
        f"{tuple(zero.mesh.axis_names)}, with {type(e).__name__}{detail}. That is what a "
        f"collective over an axis name the mesh does not have raises, e.g. "
        f"BatchNorm(axis_name='batch') (Flax's ResNet) on the default 'data' axis. Name the "
        f"mesh axis as the model does: jz.data_parallel_mesh(axis='batch') with "
        f"jz.ZeRO(..., axis='batch'); or build the model with axis_name=zero.batch_axes."
    )


def split_out(out):
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError(
                f"loss_fn returned a tuple of {len(out)} items; return a scalar loss or "
                f"(loss, aux)."
            )
        return out[0], out[1]
    return out, None


def _mean_over(x, axes):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.pmean(x, axes)
    return jax.lax.pmax(x, axes)


def _structure(out, depth: int = 0) -> str:
    """What a loss returned, by structure, never a tracer's class: ``"an array of shape ()"``,
    ``"(array (), dict)"``."""
    if isinstance(out, tuple | list) and depth < 2:
        inner = ", ".join(_structure(x, depth + 1) for x in out)
        return f"({inner},)" if len(out) == 1 else f"({inner})"
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return (
            f"an array of shape {tuple(out.shape)}" if depth == 0 else f"array {tuple(out.shape)}"
        )
    return type(out).__name__


def _call_loss(loss_fn, stateful, params, model_state, batch, rng):
    if stateful:
        out = loss_fn(params, model_state, batch, rng)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple)):
            raise ValueError(
                "a stateful loss_fn(params, model_state, batch, rng) must return "
                f"(loss, (new_model_state, aux)); it returned {_structure(out)}. Return "
                f"(loss, (model_state, None)) for a model with no state to update and no aux."
            )
        loss, (new_state, aux) = out
        check_same_structure(model_state, new_state, "model_state")
        return loss, aux, new_state
    loss, aux = split_out(loss_fn(params, batch))
    return loss, aux, None


def _scaled_loss(loss_fn, stateful: bool):
    """``(params, model_state, batch, rng, scale) -> (scale * loss, (loss, aux, state))``."""

    def scaled(params, model_state, batch, rng, scale):
        loss, aux, new_state = _call_loss(loss_fn, stateful, params, model_state, batch, rng)
        if jnp.ndim(loss) != 0:
            raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}.")
        return loss.astype(jnp.float32) * scale, (loss, aux, new_state)

    return scaled


def gradient_zero(zero: ZeROConfig, accum_steps: int) -> ZeROConfig:
    """The ZeRO whose gradient path a step runs. Stage 1 with ``layers=`` and nothing to
    accumulate reduces like stage 2: each layer's gradient is reduce-scattered inside the
    backward, under the next layer's backward, instead of one all-reduce of the whole gradient
    after it (the same sums, half an all-reduce's traffic, and no full reduced gradient: the
    optimizer only reads its shard). Stage 0 with ``layers=`` all-reduces each layer's
    gradient inside the backward (:mod:`jaxzero.zero.layers.plan`). With micro-batches stages 0/1
    keep their full local accumulator and reduce once (a reduce per micro-batch would add
    traffic)."""
    if zero.stage == 1 and accum_steps == 1 and zero.path.reduces_in_backward(stage=2):
        return dataclasses.replace(zero, stage=2)
    if zero.stage == 0 and accum_steps > 1 and zero.layers:
        return dataclasses.replace(zero, layers=None)  # one all-reduce after the micro-batches
    return zero


def local_gradients(zero: ZeROConfig, loss_fn, accum_steps: int, *, stateful: bool = False):
    """The per-device gradient computation, to run inside ``jax.shard_map``.

    Returns ``fn(params_local, model_state, batch_local, rng, scale, specs)`` ->
    ``(loss, aux, grads, new_model_state)`` where ``grads`` are already reduced by
    :meth:`ZeRO.reduce_gradients` (all-reduced for stages 0/1, reduce-scattered for stages
    2/3). With ``accum_steps > 1`` the local batch is split into micro-batches scanned with
    ``lax.scan``: stages 0/1 accumulate the full local gradient and all-reduce once; stages 2/3
    reduce-scatter every micro-batch into a sharded accumulator, so no full gradient buffer
    outlives a micro-batch. The model state is threaded through the micro-batches and averaged
    over devices at the end (identical on every device when BatchNorm is synchronised).
    ``rng`` is this device's key (already folded with the step and the device index); each
    micro-batch folds in its index.
    """
    axes = zero.batch_axes
    # stages 2/3, and stage 0 when it all-reduces each layer in the backward (one micro-batch)
    reduce_each = zero.path.reduces_each_micro_batch()
    # the params in host memory: the stacks' gradients summed into host accumulators
    on_host_sums = zero.path.accumulates_on_host(accum_steps)

    checked = []

    def micro(params, specs, model_state, batch, rng, scale, sums=None):
        full = zero.path.params_for_loss(params, specs)
        # layers=, vocab_parallel=, units=
        hooks = zero.path.loss_hooks(params, specs, sums, accumulate=on_host_sums)
        scaled = loss_hooks.wrap(hooks, _scaled_loss(loss_fn, stateful))
        if not checked:  # once per trace: the loss's matmul dtypes under a 16-bit policy
            checked.append(True)
            with loss_hooks.scope(hooks):
                warn_wide_compute(scaled, (full, model_state, batch, rng, scale), zero.precision)
        grad_fn = jax.value_and_grad(scaled, has_aux=True)
        with loss_hooks.scope(hooks), jax.named_scope("forward_backward"):
            try:
                (_, (loss, aux, new_state)), g = grad_fn(full, model_state, batch, rng, scale)
            except (AssertionError, NameError) as e:
                if not _bad_axis_name(e):
                    raise
                raise ValueError(_axis_hint(zero, e)) from e
            except Exception as e:
                better = loss_hooks.explain(hooks, e)
                if better is None:
                    raise
                raise better from e
        loss_hooks.finish(hooks)
        if reduce_each:
            # reduce_gradients casts to reduce_dtype for the collective and to output_dtype
            # after it: no full-size upcast of the local gradient before a 16-bit scatter.
            g = zero.path.reduce_gradients(g, hooks)
        else:
            # stages 0/1 accumulate the local gradient in output_dtype, reduce once at the end
            g = jax.tree.map(lambda x: x.astype(zero.precision.output_dtype), g)
        return loss, aux, g, new_state

    def fn(params, model_state, batch, rng, scale, specs):
        if model_state is not None:
            model_state = jax.tree.map(lambda x: to_varying(x, axes), model_state)
        run = lambda ms, b, key, sums=None: micro(params, specs, ms, b, key, scale, sums)
        if accum_steps == 1:
            losses, auxes, g, model_state = run(model_state, batch, rng)
        else:
            # the sums in output_dtype (an offloaded step's stacks come in param_dtype)
            out = zero.precision.output_dtype
            run_in = lambda ms, b, key, sums: _with_grads_in(out, run(ms, b, key, sums))
            losses, auxes, g, model_state = _accumulate(
                run_in, accum_steps, model_state, batch, rng
            )
        if not reduce_each:
            g = zero.path.reduce_gradients(g)
        loss = jax.lax.pmean(losses, axes)
        aux = jax.tree.map(lambda x: _mean_over(x, axes), auxes)
        if model_state is not None:
            model_state = jax.tree.map(lambda x: _mean_over(x, axes), model_state)
        return loss, aux, g, model_state

    return fn


def _with_grads_in(dtype, out):
    """``(loss, aux, grads, model_state)`` with the grads cast to ``dtype`` (micro-batch sums
    accumulate in it; a host accumulator already holds it)."""
    loss, aux, g, model_state = out
    return loss, aux, jax.tree.map(lambda x: x if on_host(x) else x.astype(dtype), g), model_state


def _fold(rng, i):
    return None if rng is None else jax.random.fold_in(rng, i)


def _accumulate(run, accum_steps: int, model_state, batch, rng):
    """Scan ``run(model_state, micro_batch, key, sums) -> (loss, aux, grads, model_state)``
    over ``accum_steps`` micro-batches of the local batch, summing gradients.

    The first micro-batch runs outside the scan and its gradient becomes the carry, so the
    carry has the right device-varying type (and, at stages 2/3, the sharded shape) without
    zeros. A gradient leaf in host memory (parameter offload: decision 42) is the sum so far
    already: ``run`` gets the carry (``sums``; None at the first micro-batch) and adds into
    its host leaves, and the step's update divides them. Returns the mean loss, the aux (float
    leaves averaged, others from the last micro-batch), the mean gradient (host leaves: the
    sum) and the final model state.
    """
    mbs = jax.tree.map(
        lambda x: x.reshape((accum_steps, x.shape[0] // accum_steps) + x.shape[1:]), batch
    )
    first = jax.tree.map(lambda x: x[0], mbs)
    rest = jax.tree.map(lambda x: x[1:], mbs)
    loss0, aux0, g, model_state = run(model_state, first, _fold(rng, 0), None)
    add = lambda acc, gi: gi if on_host(gi) else acc + gi

    def body(carry, xs):
        acc, ms = carry
        mb, i = xs
        loss, aux, gi, ms = run(ms, mb, _fold(rng, i), acc)
        return (jax.tree.map(add, acc, gi), ms), (loss, aux)

    idx = jnp.arange(1, accum_steps)
    (g, model_state), (losses, auxes) = jax.lax.scan(body, (g, model_state), (rest, idx))
    cat = lambda a, b: jnp.concatenate([a[None], b])
    losses = cat(loss0, losses).mean()
    auxes = jax.tree.map(cat, aux0, auxes)
    auxes = jax.tree.map(
        lambda x: x.mean(0) if jnp.issubdtype(x.dtype, jnp.floating) else x[-1], auxes
    )
    g = jax.tree.map(lambda x: x if on_host(x) else x / accum_steps, g)
    return losses, auxes, g, model_state
