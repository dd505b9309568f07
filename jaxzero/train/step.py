"""``make_train_step``: one jitted, state-donating ZeRO step built from ZeRO's public pieces."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.distributed import global_batch
from jaxzero.ema.ema import ShardedEMA, check_same_structure
from jaxzero.train.state import TrainState
from jaxzero.zero.config import ZeRO, to_varying
from jaxzero.zero.layers import layer_plan
from jaxzero.zero.specs import batch_rows

_NO_LAYER_GATHER = (
    "ZeRO(stage=3, layers={}) hands the loss each layer stack as shards, but the model never "
    "called jaxzero.gather_layer: wrap the scanned block, e.g. nn.remat(nn.map_variables("
    "Block, 'params', trans_in_fn=jaxzero.gather_layer)), or drop layers= to gather the whole "
    "model up front."
)


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


def _call_loss(loss_fn, stateful, params, model_state, batch, rng):
    if stateful:
        out = loss_fn(params, model_state, batch, rng)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple)):
            raise ValueError(
                "a stateful loss_fn(params, model_state, batch, rng) must return "
                "(loss, (new_model_state, aux)); got "
                f"{type(out).__name__}. Return aux=None when there is none."
            )
        loss, (new_state, aux) = out
        check_same_structure(model_state, new_state, "model_state")
        return loss, aux, new_state
    loss, aux = _split_out(loss_fn(params, batch))
    return loss, aux, None


def local_gradients(zero: ZeRO, loss_fn, accum_steps: int, *, stateful: bool = False):
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
    reduce_each = zero.stage >= 2

    def scaled(params, model_state, batch, rng, scale):
        loss, aux, new_state = _call_loss(loss_fn, stateful, params, model_state, batch, rng)
        if jnp.ndim(loss) != 0:
            raise ValueError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}.")
        return loss.astype(jnp.float32) * scale, (loss, aux, new_state)

    grad_fn = jax.value_and_grad(scaled, has_aux=True)

    def micro(params, specs, model_state, batch, rng, scale):
        full = zero.params_for_loss(params, specs)
        with layer_plan(zero.layer_plan(params, specs)) as plan:
            try:
                (_, (loss, aux, new_state)), g = grad_fn(full, model_state, batch, rng, scale)
            except Exception as e:
                if plan is None or plan.calls:
                    raise
                raise ValueError(_NO_LAYER_GATHER.format(zero.layers)) from e
        if plan is not None and not plan.calls:
            raise ValueError(_NO_LAYER_GATHER.format(zero.layers))
        if reduce_each:
            # reduce_gradients casts to reduce_dtype for the collective and to output_dtype
            # after it: no full-size upcast of the local gradient before a 16-bit scatter.
            g = zero.reduce_gradients(g)
        else:
            # stages 0/1 accumulate the local gradient in output_dtype, reduce once at the end
            g = jax.tree.map(lambda x: x.astype(zero.precision.output_dtype), g)
        return loss, aux, g, new_state

    def fold(rng, i):
        return None if rng is None else jax.random.fold_in(rng, i)

    def fn(params, model_state, batch, rng, scale, specs):
        if model_state is not None:
            model_state = jax.tree.map(lambda x: to_varying(x, axes), model_state)
        if accum_steps == 1:
            losses, auxes, g, model_state = micro(params, specs, model_state, batch, rng, scale)
        else:
            mbs = jax.tree.map(
                lambda x: x.reshape((accum_steps, x.shape[0] // accum_steps) + x.shape[1:]), batch
            )
            first = jax.tree.map(lambda x: x[0], mbs)
            rest = jax.tree.map(lambda x: x[1:], mbs)
            loss0, aux0, g, model_state = micro(
                params, specs, model_state, first, fold(rng, 0), scale
            )

            def body(carry, xs):
                acc, ms = carry
                mb, i = xs
                loss, aux, gi, ms = micro(params, specs, ms, mb, fold(rng, i), scale)
                return (jax.tree.map(jnp.add, acc, gi), ms), (loss, aux)

            idx = jnp.arange(1, accum_steps)
            (g, model_state), (losses, auxes) = jax.lax.scan(body, (g, model_state), (rest, idx))
            cat = lambda a, b: jnp.concatenate([a[None], b])
            losses = cat(loss0, losses).mean()
            auxes = jax.tree.map(cat, aux0, auxes)
            auxes = jax.tree.map(
                lambda x: x.mean(0) if jnp.issubdtype(x.dtype, jnp.floating) else x[-1], auxes
            )
            g = jax.tree.map(lambda x: x / accum_steps, g)
        if not reduce_each:
            g = zero.reduce_gradients(g)
        loss = jax.lax.pmean(losses, axes)
        aux = jax.tree.map(lambda x: _mean_over(x, axes), auxes)
        if model_state is not None:
            model_state = jax.tree.map(lambda x: _mean_over(x, axes), model_state)
        return loss, aux, g, model_state

    return fn


def device_key(rng, step, axes):
    """The step's key on this device: ``fold_in(fold_in(rng, step), device index on axes)``."""
    return jax.random.fold_in(jax.random.fold_in(rng, step), jax.lax.axis_index(axes))


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
    stateful: bool = False

    def init(self, params, **kwargs) -> TrainState:
        """``zero.init(params, ema=self.ema, ...)``."""
        return self.zero.init(params, ema=self.ema, **kwargs)

    def check_batch(self, batch) -> None:
        dims = batch_rows(batch)
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
        if self.stateful and state.rng is None:
            raise ValueError(
                "a stateful step needs state.rng; create the state with "
                "step.init(params, model_state=..., rng=jax.random.key(seed))."
            )
        if not self.stateful and state.model_state is not None:
            raise ValueError(
                "state carries a model_state but the step is not stateful; build it with "
                "make_train_step(..., stateful=True) and a loss_fn(params, model_state, batch, rng)."
            )
        if self.ema is None and state.ema is not None:
            raise ValueError(
                "state carries an EMA but the step was built without one; pass the same "
                "ShardedEMA to make_train_step(..., ema=ema)."
            )

    def place_batch(self, batch):
        """The batch as global arrays split over every mesh axis (``zero.batch_spec()``).

        Host (numpy) leaves hold THIS process's rows of the global batch: the whole batch on
        one process; on several processes only the rows of its own devices
        (``jaxzero.distributed.process_batch_slice``), assembled without communication by
        ``jax.make_array_from_process_local_data``. Global ``jax.Array`` leaves that already
        have the batch sharding pass through.
        """
        sharding = NamedSharding(self.zero.mesh, self.zero.batch_spec())
        if jax.process_count() > 1:
            return global_batch(batch, sharding)
        return jax.tree.map(
            lambda x: (
                x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)
            ),
            batch,
        )

    def _checked_and_placed(self, batch):
        # One process: check the global batch, then place it. Several processes: each holds
        # only its rows, so assemble the global arrays first and check those.
        if jax.process_count() > 1:
            batch = self.place_batch(batch)
            self.check_batch(batch)
            return batch
        self.check_batch(batch)
        return self.place_batch(batch)

    def __call__(self, state: TrainState, batch):
        self.check_state(state)
        state, metrics = self.jitted(state, self._checked_and_placed(batch))
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
        return self.jitted.lower(state, self._checked_and_placed(batch))


def make_train_step(
    loss_fn: Callable,
    zero: ZeRO,
    *,
    ema: ShardedEMA | None = None,
    accum_steps: int = 1,
    stateful: bool = False,
    donate: bool = True,
) -> TrainStep:
    """Build the jitted ZeRO train step.

    ``loss_fn(params, batch) -> loss | (loss, aux)`` sees the full compute params and the
    device's slice of the batch (a micro-batch when ``accum_steps > 1``) and returns the mean
    loss over it; the step's gradient is the gradient of the global mean loss. ``aux`` float
    leaves are averaged over micro-batches and devices (others: last micro-batch, max over
    devices).

    With ``stateful=True`` the loss takes and returns the non-trainable model state and gets
    a PRNG key: ``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, aux))``
    (e.g. Flax ``apply(..., mutable=["batch_stats"], rngs={"dropout": rng})``). The model state
    lives replicated in ``state.model_state``; ``rng`` is
    ``fold_in(fold_in(state.rng, step), device index)`` (and the micro-batch index when
    accumulating), so every device draws different masks and a run is reproducible for a fixed
    seed and N. For BatchNorm over the GLOBAL batch (SyncBatchNorm), build the model's
    ``BatchNorm(axis_name=zero.batch_axes)``: the loss runs inside ``shard_map`` over those axes.

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
    grads_fn = local_gradients(zero, loss_fn, accum_steps, stateful=stateful)
    axes = zero.batch_axes

    def sharded(params, model_state, batch, rng, step, scale, specs):
        key = None if rng is None else device_key(rng, step, axes)
        return grads_fn(params, model_state, batch, key, scale, specs)

    def step_fn(state: TrainState, batch):
        specs = zero.param_specs(state.params)
        grad_specs = zero.grad_specs(state.params)
        scale = jnp.ones((), jnp.float32) if state.loss_scale is None else state.loss_scale.scale
        batch_spec = zero.batch_spec()
        replicated = lambda t: jax.tree.map(lambda _: P(), t)
        sm = jax.shard_map(
            lambda p, m, b, r, t, s: sharded(p, m, b, r, t, s, specs),
            mesh=zero.mesh,
            in_specs=(
                specs,
                replicated(state.model_state),
                jax.tree.map(lambda _: batch_spec, batch),
                replicated(state.rng),
                P(),
                P(),
            ),
            out_specs=(P(), P(), grad_specs, replicated(state.model_state)),
        )
        loss, aux, grads, model_state = sm(
            state.params, state.model_state, batch, state.rng, state.step, scale
        )
        new_state, metrics = zero.apply_gradients(state, grads, ema=ema, model_state=model_state)
        metrics = {"loss": loss, **metrics}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics

    jitted = jax.jit(step_fn, donate_argnums=(0,) if donate else ())
    return TrainStep(
        loss_fn=loss_fn,
        zero=zero,
        ema=ema,
        accum_steps=accum_steps,
        jitted=jitted,
        stateful=stateful,
    )
