"""``make_train_step``: one jitted, state-donating ZeRO step built from ZeRO's public pieces."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.ema import ShardedEMA
from jaxzero.optimizer import ZeRO
from jaxzero.state import TrainState


def _split_out(out):
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


def local_gradients(zero: ZeRO, loss_fn, accum_steps: int):
    """The per-device gradient computation, to run inside ``jax.shard_map``.

    Returns ``fn(params_local, batch_local, scale, specs) -> (loss, aux, grads)`` where
    ``grads`` are already reduced by :meth:`ZeRO.reduce_gradients` (all-reduced for stages
    0/1, reduce-scattered for stages 2/3). With ``accum_steps > 1`` the local batch is split
    into micro-batches scanned with ``lax.scan``: stages 0/1 accumulate the full local gradient
    and all-reduce once; stages 2/3 reduce-scatter every micro-batch into a sharded
    accumulator, so no full gradient buffer outlives a micro-batch.
    """
    axes = zero.batch_axes
    reduce_each = zero.stage >= 2

    def scaled(params, batch, scale):
        loss, aux = _split_out(loss_fn(params, batch))
        if jnp.ndim(loss) != 0:
            raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}.")
        return loss.astype(jnp.float32) * scale, (loss, aux)

    grad_fn = jax.value_and_grad(scaled, has_aux=True)

    def micro(params, specs, batch, scale):
        full = zero.gather_params(params, specs)
        # Mark params as device-varying so autodiff returns the local, unreduced gradient;
        # the reduction is then ours (reduce_gradients), not an implicit psum.
        full = jax.tree.map(lambda x: to_varying(x, axes), full)
        (_, (loss, aux)), g = grad_fn(full, batch, scale)
        g = jax.tree.map(lambda x: x.astype(zero.precision.output_dtype), g)
        if reduce_each:
            g = zero.reduce_gradients(g)
        return loss, aux, g

    def fn(params, batch, scale, specs):
        if accum_steps == 1:
            loss, aux, g = micro(params, specs, batch, scale)
            losses, auxes = loss, aux
        else:
            mbs = jax.tree.map(
                lambda x: x.reshape((accum_steps, x.shape[0] // accum_steps) + x.shape[1:]), batch
            )
            first = jax.tree.map(lambda x: x[0], mbs)
            rest = jax.tree.map(lambda x: x[1:], mbs)
            loss0, aux0, g = micro(params, specs, first, scale)

            def body(acc, mb):
                loss, aux, gi = micro(params, specs, mb, scale)
                return jax.tree.map(jnp.add, acc, gi), (loss, aux)

            g, (losses, auxes) = jax.lax.scan(body, g, rest)
            cat = lambda a, b: jnp.concatenate([a[None], b])
            losses = cat(loss0, losses)
            auxes = jax.tree.map(cat, aux0, auxes)
            losses = losses.mean()
            auxes = jax.tree.map(
                lambda x: x.mean(0) if jnp.issubdtype(x.dtype, jnp.floating) else x[-1], auxes
            )
            g = jax.tree.map(lambda x: x / accum_steps, g)
        if not reduce_each:
            g = zero.reduce_gradients(g)
        loss = jax.lax.pmean(losses, axes)
        aux = jax.tree.map(lambda x: _mean_over(x, axes), auxes)
        return loss, aux, g

    return fn


def to_varying(x, axes):
    """``pcast`` ``x`` to device-varying over those of ``axes`` it is not yet varying over."""
    varying = jax.typeof(x).manual_axis_type.varying
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A compiled-once ZeRO train step: ``state, metrics = step(state, batch)``.

    Validates the batch (leading dims agree and divide by ``devices × accum_steps``) before
    anything runs, places it on the mesh split over every mesh axis, and calls a ``jax.jit``
    function that donates ``state``.
    """

    loss_fn: Callable
    zero: ZeRO
    ema: ShardedEMA | None
    accum_steps: int
    jitted: Any

    def init(self, params, **kwargs) -> TrainState:
        """``zero.init(params, ema=self.ema, ...)``."""
        return self.zero.init(params, ema=self.ema, **kwargs)

    def check_batch(self, batch) -> None:
        leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
        if not leaves:
            raise ValueError("batch is an empty tree; pass the global batch arrays.")
        dims = {}
        for path, x in leaves:
            if np.ndim(x) == 0:
                raise ValueError(
                    f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every batch leaf needs "
                    f"a leading batch dimension."
                )
            dims[jax.tree_util.keystr(path)] = np.shape(x)[0]
        if len(set(dims.values())) > 1:
            raise ValueError(
                "batch leaves disagree on the leading (batch) dimension: "
                + ", ".join(f"{k}: {v}" for k, v in dims.items())
                + "; every leaf "
                "must hold the same number of examples."
            )
        b = next(iter(dims.values()))
        need = self.zero.num_batch_shards * self.accum_steps
        if b % need:
            raise ValueError(
                f"global batch size {b} is not divisible by devices ({self.zero.num_batch_shards})"
                f" x accum_steps ({self.accum_steps}) = {need}; use a batch size that is a "
                f"multiple of {need}."
            )

    def check_state(self, state) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"state must be a jaxzero.TrainState (from zero.init / step.init), got "
                f"{type(state).__name__}."
            )
        if self.ema is not None and state.ema is None:
            raise ValueError(
                "this step updates an EMA but state has none; create the state with "
                "step.init(params) or zero.init(params, ema=ema)."
            )
        if self.ema is None and state.ema is not None:
            raise ValueError(
                "state carries an EMA but the step was built without one; pass the same "
                "ShardedEMA to make_train_step(..., ema=ema)."
            )

    def place_batch(self, batch):
        sharding = NamedSharding(self.zero.mesh, self.zero.batch_spec())
        return jax.tree.map(
            lambda x: (
                x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)
            ),
            batch,
        )

    def __call__(self, state: TrainState, batch):
        self.check_state(state)
        self.check_batch(batch)
        state, metrics = self.jitted(state, self.place_batch(batch))
        if "loss_scale_at_min" in metrics and self.zero.loss_scale.on_min != "ignore":
            self._check_min_scale(state, metrics)
        return state, metrics

    def _check_min_scale(self, state, metrics):
        # One scalar device-to-host read per step, only under a dynamic loss scale.
        if not bool(metrics["loss_scale_at_min"]):
            return
        msg = (
            f"the loss scale is stuck at its minimum {self.zero.loss_scale.min_scale} and the "
            f"gradients still overflow (step {int(state.step)}, {int(state.skipped)} steps "
            f"skipped): the model diverged or fp16 cannot represent it. Lower the learning "
            f"rate, use bf16, or set DynamicLossScale(on_min='warn')."
        )
        if self.zero.loss_scale.on_min == "warn":
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            return
        err = FloatingPointError(msg)
        err.state = state  # the (skipped-step) state, so the caller can still checkpoint it
        raise err

    def lower(self, state: TrainState, batch):
        """``jax.jit(...).lower`` of the step (for HLO and memory inspection)."""
        self.check_batch(batch)
        return self.jitted.lower(state, self.place_batch(batch))


def make_train_step(
    loss_fn: Callable,
    zero: ZeRO,
    *,
    ema: ShardedEMA | None = None,
    accum_steps: int = 1,
    donate: bool = True,
) -> TrainStep:
    """Build the jitted ZeRO train step.

    ``loss_fn(params, batch) -> loss | (loss, aux)`` sees the full compute params and the
    device's slice of the batch (a micro-batch when ``accum_steps > 1``) and returns the mean
    loss over it; the step's gradient is the gradient of the global mean loss. ``aux`` float
    leaves are averaged over micro-batches and devices (others: last micro-batch, max over
    devices).

    Per step: gradients inside ``jax.shard_map`` (stage 3 all-gathers parameters there;
    stages 0/1 all-reduce, 2/3 reduce-scatter), then :meth:`ZeRO.apply_gradients` under jit:
    unscale, global finite check, optax update on the shards, EMA on the same shards,
    ``cast(master)`` all-gathered to the compute params.

    Returns:
      A :class:`TrainStep`; ``state, metrics = step(state, batch)`` with metrics ``loss``,
      ``aux`` (when given), ``grad_norm``, ``step``, ``skipped``, ``finite``.

    Raises:
      ValueError: ``accum_steps < 1``.
    """
    if not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO, got {type(zero).__name__}.")
    if not isinstance(accum_steps, int) or isinstance(accum_steps, bool) or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r} must be an int >= 1 (1: no accumulation).")
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    grads_fn = local_gradients(zero, loss_fn, accum_steps)

    def step_fn(state: TrainState, batch):
        specs = zero.param_specs(state.params)
        grad_specs = zero._specs(state.params, zero.stage >= 2)
        scale = jnp.ones((), jnp.float32) if state.loss_scale is None else state.loss_scale.scale
        batch_spec = zero.batch_spec()
        sm = jax.shard_map(
            lambda p, b, s: grads_fn(p, b, s, specs),
            mesh=zero.mesh,
            in_specs=(specs, jax.tree.map(lambda _: batch_spec, batch), P()),
            out_specs=(P(), P(), grad_specs),
        )
        loss, aux, grads = sm(state.params, batch, scale)
        new_state, metrics = zero.apply_gradients(state, grads, ema=ema)
        metrics = {"loss": loss, **metrics}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics

    jitted = jax.jit(step_fn, donate_argnums=(0,) if donate else ())
    return TrainStep(loss_fn=loss_fn, zero=zero, ema=ema, accum_steps=accum_steps, jitted=jitted)
