"""``make_train_step``: one jitted, state-donating ZeRO step built from ZeRO's public pieces."""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.distributed.runtime import global_batch
from jaxzero.ema.ema import ShardedEMA
from jaxzero.simulate import persistent_cache_dir
from jaxzero.train import loss as user_loss
from jaxzero.train import pmap_leftovers
from jaxzero.train.grads import local_gradients
from jaxzero.train.nvme_step import make_nvme_train_step
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.state import (
    TrainState,
    check_not_donated,
    check_same_mesh,
    drop_stale,
    split_pending,
    state_layout,
    with_pending,
)
from jaxzero.train.update import (
    apply_gradients,
    apply_pending,
    pending_rows,
    rows_in_forward,
)
from jaxzero.trees import batch_rows
from jaxzero.zero.config import ZeROConfig
from jaxzero.zero.layers.rows import LayerRows, RowsNotRun, with_stacks
from jaxzero.zero.path import GradientPath


def device_key(rng, step, axes):
    """The step's key on this device: ``fold_in(fold_in(rng, step), device index on axes)``."""
    return jax.random.fold_in(jax.random.fold_in(rng, step), jax.lax.axis_index(axes))


def check_no_torch(batch) -> None:
    """Raise TypeError naming the batch leaves that are torch tensors (told by the type's
    module: torch is never imported here), which jax cannot read."""
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    tensors = [
        jax.tree_util.keystr(k) or "(the batch itself)"
        for k, x in flat
        if type(x).__module__.split(".")[0] == "torch"
    ]
    if tensors:
        raise TypeError(
            f"batch leaves {', '.join(tensors[:5])} are torch tensors, which jax cannot read; "
            f"convert them with .numpy() (.cpu().numpy() for a tensor on a GPU), e.g. "
            f"batch = jax.tree.map(lambda t: t.numpy(), batch)."
        )


_NO_MODEL_STATE = (
    "this step is stateful (make_train_step(..., stateful=True)): it hands "
    "loss_fn(params, model_state, batch, rng) the model's non-trainable state, but init was "
    "not given one; pass it: step.init(params, model_state={k: v for k, v in "
    "variables.items() if k != 'params'} (e.g. {'batch_stats': ...}), rng=...), or "
    "model_state=None where the model has none (what jz.flax_nnx.split returns for a module "
    "without state). A model without state that only needs a key: make_train_step(..., "
    "rng=True) with loss_fn(params, batch, rng)."
)


# XLA:CPU (simulated devices) admits at most 32 programs in flight per device and launches each
# device's share of a program from a shared thread pool, in no guaranteed order. A host loop
# that dispatches more than 32 multi-device steps ahead can therefore fill one device's slots
# with later steps that wait for an earlier step, whose launch on that device waits for a slot,
# while the other devices wait for it in a collective: a deadlock (seen under load).
# On CPU meshes the step keeps at most this many calls in flight; GPUs launch in stream order.
CPU_MAX_IN_FLIGHT = 4

# Two steps' programs in flight at once deadlock too. XLA:CPU runs every simulated device's
# collectives on one pool of as many threads as devices, and a thread waiting in a collective
# holds its thread: with two independent programs in flight (two trainings, or a comparison,
# in one process), threads can fill with one program's all-gather on some devices and the
# other's reduce-scatter on the rest, and neither completes (seen in gdb: six threads in one
# all-gather, two in a reduce-scatter). Successive calls of one step are safe, each reading
# the state the one before wrote. So a step's call on a CPU mesh first waits for the calls
# another step still has in flight: the step that ran last on simulated devices is this.
_LAST_ON_CPU: list = [None]  # a weakref to that TrainStep, or None


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
    rng: bool = False
    #: the jitted :func:`~jaxzero.train.update.apply_pending` of :meth:`flush`
    #: (``ZeRO(offload_update="deferred")``), else None
    flushing: Any = None
    _in_flight: collections.deque = dataclasses.field(
        default_factory=collections.deque, repr=False, compare=False
    )

    def init(self, params, **kwargs) -> TrainState:
        """``zero.init(params, ema=self.ema, ...)``: ``rng=`` for a step that hands the loss
        a key, ``model_state=`` for a stateful step (required there), ``opt_state=`` and
        ``step=`` to continue a plain optax run (adopt it)."""
        if self.stateful and "model_state" not in kwargs:
            raise ValueError(_NO_MODEL_STATE)
        self._wait_for_other_steps()
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
        check_not_donated(state, "the previous step call")
        check_same_mesh(state, self.zero.mesh)
        if self.ema is not None and state.ema is None:
            raise ValueError(
                "this step updates an EMA but state has none; create the state with "
                "step.init(params) or zero.init(params, ema=ema)."
            )
        if not self.stateful and state.model_state is not None:
            raise ValueError(
                "state carries a model_state but the step is not stateful; build it with "
                "make_train_step(..., stateful=True) and a loss_fn(params, model_state, batch, rng)."
            )
        if self.rng and state.rng is None:
            raise ValueError(
                "this step hands loss_fn(params, batch, rng) a key (make_train_step(..., "
                "rng=True)) but the state has no rng; create it with "
                "step.init(params, rng=jax.random.key(seed))."
            )
        if self.ema is None and state.ema is not None:
            raise ValueError(
                "state carries an EMA but the step was built without one; pass the same "
                "ShardedEMA to make_train_step(..., ema=ema)."
            )
        if state.pending is not None and self.flushing is None:
            raise ValueError(
                "state carries the layer stacks' update left pending by a step of "
                "ZeRO(offload_update='deferred'), and this step's ZeRO does not defer it; "
                "apply it with that step first: state = step.flush(state)."
            )

    def flush(self, state: TrainState) -> TrainState:
        """``state`` with the layer stacks' update that the last step left pending applied
        (``ZeRO(offload_update="deferred")``, decision 51): their master, optimizer state and
        EMA in host memory and their compute params as a step without deferral leaves them.
        Call it before reading the state (checkpoints, :func:`jaxzero.gather`,
        :func:`jaxzero.ema_params`, exports refuse a state with an update pending). The
        state is donated, as to the step; a state with nothing pending comes back as it is.

        Args:
          state: a :class:`TrainState` this step made (a
            :class:`~jaxzero.train.state.PendingState` after a step that deferred).

        Returns:
          A plain :class:`TrainState` (nothing pending).
        """
        self.check_state(state)
        if state.pending is None:
            return state
        self._wait_for_other_steps()
        return self.flushing(state)

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
        check_no_torch(batch)
        if jax.process_count() > 1:
            batch = self.place_batch(batch)
            self.check_batch(batch)
            return batch
        self.check_batch(batch)
        return self.place_batch(batch)

    def __call__(self, state: TrainState, batch):
        self.check_state(state)
        placed = self._checked_and_placed(batch)
        self._wait_for_other_steps()
        state = self._delayed(state)
        try:
            state, metrics = self.jitted(state, placed)
        except Exception as e:
            # A failure while tracing, on shapes a pmap program leaves: say so (the cause is
            # chained). Errors of the running program, jaxzero's own (they name their fix) and
            # other shapes pass unchanged.
            if isinstance(e, jax.errors.JaxRuntimeError) or pmap_leftovers.raised_by_jaxzero(e):
                raise
            why = pmap_leftovers.explain(state.params, placed, jax.local_device_count())
            if why is None:
                raise
            raise ValueError(why) from e
        # the first step that packs the stacks' rows returns their tree leaves whole
        state = drop_stale(state)
        self._pace(metrics)
        if "loss_scale_at_min" in metrics and self.zero.loss_scale.on_min != "ignore":
            self._check_min_scale(state, metrics)
        return state, metrics

    def _delayed(self, state: TrainState) -> TrainState:
        """``state`` with its pending update marked delayed (:attr:`Pending.delayed
        <jaxzero.train.state.Pending.delayed>`) once ``ZeRO(offload_update="delayed")``'s
        ``delay_after`` exact steps are taken. Until then each step reads the step count
        (a wait for the step before); a delayed step's pending update stays delayed."""
        placement, pending = self.zero.placement, state.pending
        if not placement.delays or pending is None or pending.delayed:
            return state
        if int(state.step) < placement.delay_after:
            return state
        return with_pending(state, pending.replace(delayed=True))

    @functools.cached_property
    def _paces(self) -> bool:
        """Whether calls are paced: a mesh of several CPU devices (decided once)."""
        return self.zero.mesh.size > 1 and self.zero.platform == "cpu"

    def _wait_for_other_steps(self):
        # On simulated CPU devices, no two steps' programs in flight together (_LAST_ON_CPU).
        if not self._paces:
            return
        last = _LAST_ON_CPU[0] and _LAST_ON_CPU[0]()
        if last is not None and last is not self:
            while last._in_flight:
                last._in_flight.popleft().block_until_ready()
        _LAST_ON_CPU[0] = weakref.ref(self)

    def _pace(self, metrics):
        # Bound the calls in flight on simulated CPU devices (see CPU_MAX_IN_FLIGHT).
        if not self._paces:
            return
        self._in_flight.append(metrics["grad_norm"])  # never aliases the state
        while len(self._in_flight) > CPU_MAX_IN_FLIGHT:
            self._in_flight.popleft().block_until_ready()

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
    rng: bool = False,
    donate: bool = True,
    allow_loss_collectives: bool = False,
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
    ``fold_in(fold_in(state.rng, step), device index)`` (None when the state was made without
    ``rng=``: a model without dropout needs none) (and the micro-batch index when
    accumulating), so every device draws different masks and a run is reproducible for a fixed
    seed and N. For BatchNorm over the GLOBAL batch (SyncBatchNorm), build the model's
    ``BatchNorm(axis_name=zero.batch_axes)``: the loss runs inside ``shard_map`` over those axes.

    A loss normalised by a count over the whole global batch (tokens with a mask) returns
    :class:`jaxzero.GlobalMean` ``(total, count)`` of its rows: the step's gradient is then
    exactly that of ``sum(total) / sum(count)`` over every device and micro-batch. A loss that
    itself reduces over the data axes (``jax.lax.pmean(loss, "data")``, a ``psum`` of a
    count: a ``pmap`` leftover) is refused before the first step, since under the step's mean
    it would train at 1/N of the gradient; ``allow_loss_collectives=True`` keeps a collective
    the loss uses on purpose, whose result each device applies to its own rows (a
    hand-written synchronised BatchNorm). Flax's normalization layers with ``axis_name=``
    and jaxzero's own hooks need no flag.

    Per step: gradients inside ``jax.shard_map`` (stage 3 all-gathers parameters there;
    stages 0/1 all-reduce, 2/3 reduce-scatter), then :meth:`ZeRO.apply_gradients` under jit:
    unscale, global finite check, optax update on the shards, EMA on the same shards,
    ``cast(master)`` all-gathered to the compute params.

    With ``ZeRO(offload=jz.NVMe(path, ...))`` the step is the NVMe tier's
    (:class:`jaxzero.train.nvme_step.NVMeTrainStep`, decision 50): its ``init`` writes the
    fp32 master and the optimizer state into a file under ``path`` a group of leaves at a
    time, each step pages them through the window of host buffers, and
    ``state.optimizer_state()`` reads them back; an ``ema`` is kept in the file beside each
    leaf's master; it takes no ``stateful``, ``rng``, ``donate=False`` or
    ``allow_loss_collectives`` yet.

    Returns:
      A :class:`TrainStep`; ``state, metrics = step(state, batch)`` with metrics ``loss``,
      ``aux`` (when given), ``grad_norm``, ``step``, ``skipped``, ``finite``.

    Raises:
      ValueError: ``accum_steps < 1``; at the first call, a loss that reduces over the data
        axes (see above).
      TypeError: ``loss_fn`` cannot take the arguments the step hands it.
    """
    if not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO, got {type(zero).__name__}.")
    if zero.nvme is not None:
        given = dict(
            stateful=stateful,
            rng=rng,
            donate=donate,
            allow_loss_collectives=allow_loss_collectives,
        )
        return _on_disk(loss_fn, zero, accum_steps, given, ema)
    if not isinstance(accum_steps, int) or isinstance(accum_steps, bool) or accum_steps < 1:
        raise ValueError(f"accum_steps={accum_steps!r} must be an int >= 1 (1: no accumulation).")
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    if rng and stateful:
        raise ValueError(
            "rng=True is for a loss without model state, loss_fn(params, batch, rng); a "
            "stateful loss_fn(params, model_state, batch, rng) already gets the key. Drop "
            "rng=True."
        )
    user_loss.check_signature(loss_fn, rng=bool(rng), stateful=stateful)
    # the reduction this step runs: stage 1 with layers= and one micro-batch reduces as stage 2
    reducing = zero.path.for_step(accum_steps)
    inner = _keyed_loss(loss_fn) if rng else loss_fn
    grads_fn = local_gradients(
        reducing,
        inner,
        accum_steps,
        stateful=stateful or bool(rng),
        allow_loss_collectives=allow_loss_collectives,
    )
    step_fn, flush = _step_fn(zero, reducing, grads_fn, ema, accum_steps)
    donated = (0,) if donate else ()
    jitted = jax.jit(step_fn, donate_argnums=donated)
    flushing = _Flushing(zero, flush, donated) if zero.placement.defers else None
    where = persistent_cache_dir(jax)
    if where and zero.mesh.size > 1 and zero.platform == "cpu":
        warnings.warn(
            f"jax's persistent compilation cache is on ({where}) for a step on "
            f"{zero.mesh.size} CPU devices: an XLA:CPU program loaded from it loses the order "
            f"of its collectives against its loops, and the step can then abort or hang on "
            f"its first launch. Turn it off for CPU meshes "
            f"(jax.config.update('jax_enable_compilation_cache', False)), or set the devices "
            f"up with jaxzero.simulate_cpu_devices, which does.",
            UserWarning,
            stacklevel=2,
        )
    # what the step built will not do (nothing is traced yet)
    unused = zero.path.unused_layers(accum_steps)
    if unused:
        warnings.warn(
            f"ZeRO(stage={zero.stage}, layers={zero.layers!r}) reduces no layer's gradient in "
            f"the backward in this step: {unused}. layers= then only keeps the stacks' layer "
            f"axis unsplit, as stage 3 needs; drop it if per-layer reduction was the point.",
            UserWarning,
            stacklevel=2,
        )
    return TrainStep(loss_fn, zero, ema, accum_steps, jitted, stateful, bool(rng), flushing)


_NOT_DELAYED = (
    "ZeRO(offload_update='delayed') applies the pending update inside jaxzero.scan_layers' "
    "forward loop beside compute on the stacks before it, and this model does not run the "
    "stacks layers={} through exactly one jaxzero.scan_layers call (a jz.gather_layer loop "
    "runs the update before the forward: no delay, nothing hidden). Run the stack with "
    "jaxzero.scan_layers, or use offload_update='deferred'."
)

#: make_train_step's options and their defaults, which the NVMe tier's step does not take yet
_NOT_ON_DISK = {
    "stateful": False,
    "rng": False,
    "donate": True,
    "allow_loss_collectives": False,
}


def _on_disk(loss_fn, zero: ZeRO, accum_steps: int, options: dict, ema):
    """The NVMe tier's step (``ZeRO(offload=jz.NVMe(...))``, decision 50), after refusing
    the options it does not take yet (``options``: make_train_step's, by name); ``ema``: the
    step's EMA, kept on disk."""
    given = [k for k, v in options.items() if v != _NOT_ON_DISK[k]]
    if given:
        raise ValueError(
            f"ZeRO(offload=NVMe(...)) trains with the optimizer state on disk, and that step "
            f"does not take {', '.join(f'{k}=' for k in given)} yet; drop it, or use "
            f"offload='optimizer' (the state in pinned host memory)."
        )
    return make_nvme_train_step(
        loss_fn, dataclasses.replace(zero, nvme=None), zero.nvme, accum_steps=accum_steps, ema=ema
    )


@dataclasses.dataclass
class _Flushing:
    """:func:`~jaxzero.train.update.apply_pending` jitted with the shardings of the plain
    state it returns, one compile per state structure: jax pairs a donated input with an
    output of its shape and dtype, and only looks at memory kinds when the outputs' are
    given, so the pending gradients (on the device) would otherwise be reused for the
    master the rows unpack (in host memory)."""

    zero: ZeRO
    fn: Callable
    donated: tuple
    _jitted: dict = dataclasses.field(default_factory=dict)

    def __call__(self, state):
        key = jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))
        if key not in self._jitted:
            plain = state.pending.restored_shapes(with_pending(state, None))
            out = self.zero.state_shardings(plain)
            self._jitted[key] = jax.jit(self.fn, donate_argnums=self.donated, out_shardings=out)
        with warnings.catch_warnings():
            # what the flush consumes (the packed rows, the pending gradients) has no output
            # of its shape to be reused for: jax says so once per compile
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return self._jitted[key](state)


def _keyed_loss(loss_fn):
    """``loss_fn(params, batch, rng)`` as a stateful loss (``make_train_step(..., rng=True)``):
    the same per-device key, no model state (None in, None out)."""

    def stateful(params, model_state, batch, rng):
        loss, aux = user_loss.split_out(loss_fn(params, batch, rng))
        return loss, (model_state, aux)

    return stateful


def _step_fn(
    zero: ZeROConfig, reducing: GradientPath, grads_fn, ema: ShardedEMA | None, accum_steps: int
):
    """``(step, flush)``, unjitted. The step: the per-device gradients in a ``shard_map`` over
    the mesh (reduced as ``reducing``, the step's :class:`~jaxzero.zero.path.GradientPath`,
    says), then :meth:`ZeRO.apply_gradients` under jit. The flush: the update a state has
    pending applied (:func:`~jaxzero.train.update.apply_pending`)."""
    axes, batch_spec = zero.batch_axes, zero.batch_spec()

    def unpacked(state: TrainState):
        # what a step (or a flush) reads of the state, decided once per trace: the per-leaf
        # plan (from the params' shapes), the plain state with the update it has pending
        # apart (None: nothing pending) and the plain state's layout
        plan = zero.plan(state.params, accum_steps=accum_steps)
        state, pending = split_pending(state)
        return plan, state, pending, state_layout(zero, state)

    def applied(plan, state, pending, layout):
        # the state with the update it has pending applied (a step's before its forward, and
        # the flush)
        return apply_pending(zero, state, pending, plan=plan, layout=layout, ema=ema)

    def step_fn(state: TrainState, batch):
        plan, state, pending, layout = unpacked(state)
        # the layer stacks' update the last step left (offload_update="deferred"): inside the
        # (first micro-batch's) forward's layer loop at stage 3 per layer, else before the
        # forward; every micro-batch reads the updated params
        began = pending is not None  # its stale leaves (if any) came in as placeholders
        # offload_update="delayed" past its exact steps: every micro-batch computes on the
        # params before the pending update (TrainStep.__call__ decides it, Pending.delayed)
        delayed = began and pending.delayed
        if began and rows_in_forward(zero):
            forward = pending_rows(zero, state, pending, plan=plan, layout=layout, ema=ema)
            before = pending.before if delayed else None
            try:
                return step_with(state, batch, plan, layout, began, forward, before)
            except RowsNotRun as e:  # the stack never ran through one scan_layers call
                if zero.placement.delays:
                    raise ValueError(_NOT_DELAYED.format(zero.layers)) from e
        return step_with(applied(plan, state, pending, layout), batch, plan, layout, began)

    def step_with(state, batch, plan, layout, began_pending, forward=None, before=None):
        # before: a delayed step's params leaves outside the stacks, as the step before
        # found them (Pending.before); None: not delayed
        delayed = before is not None
        # what the loss builds its params from: at stage 3 with a separate master, the fp32
        # master shards (the gathers cast them to param_dtype first, so the wire stays 16-bit,
        # and the per-layer stack's gradient comes back in fp32 with no fp32 copy of the stack
        # made); otherwise the params, which are cast(master) after every update. A master in
        # host memory (offload) is not read there: that would fetch it all (decision 32).
        master = zero.stage == 3 and state.master is not None and zero.placement.master_on_device
        shards = state.master if master else state.params
        if delayed:  # every leaf a step behind: the stacks' update is still pending
            shards = with_stacks(shards, before)
        specs = layout.specs.params
        scale = jnp.ones((), jnp.float32) if state.loss_scale is None else state.loss_scale.scale
        replicated = lambda t: jax.tree.map(lambda _: P(), t)
        in_specs = (
            specs,
            replicated(state.model_state),
            jax.tree.map(lambda _: batch_spec, batch),
            replicated(state.rng),
            P(),
            P(),
        )
        out_specs = (P(), P(), reducing.grad_specs(state.params), replicated(state.model_state))
        args = (shards, state.model_state, batch, state.rng, state.step, scale)
        written = None  # what the forward's layer loop wrote of the pending update (or None)
        if forward is None:
            sm = jax.shard_map(
                lambda p, m, b, r, t, s: sharded(p, m, b, r, t, s, specs, plan),
                mesh=zero.mesh,
                in_specs=in_specs,
                out_specs=out_specs,
            )
            loss, aux, grads, model_state = sm(*args)
        else:
            flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
            stack_specs = [flat_specs[j] for j in forward.rows]
            held_specs = forward.held_specs()
            sm = jax.shard_map(
                lambda p, m, b, r, t, s, h, q: sharded(
                    p, m, b, r, t, s, specs, plan, (forward, h, q, delayed)
                ),
                mesh=zero.mesh,
                in_specs=(*in_specs, held_specs, forward.pending_specs),
                out_specs=(*out_specs, (held_specs, stack_specs)),
            )
            loss, aux, grads, model_state, (held, stacks) = sm(
                *args, forward.held_values(), forward.pending
            )
            written = (forward, held, stacks)
        grad_scale = None
        if isinstance(loss, tuple):  # a GlobalMean: (its value, the gradient's factor)
            loss, grad_scale = loss
        new_state, metrics = apply_gradients(
            zero,
            state,
            grads,
            ema=ema,
            model_state=model_state,
            grad_scale=grad_scale,
            plan=plan,
            layout=layout,
            forward=written,
            placeholders=began_pending,
            # once delayed, the steps after it are too (past delay_after: the step only grows)
            delayed=delayed,
        )
        metrics = {"loss": loss, **metrics}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics

    def flush(state: TrainState):
        return applied(*unpacked(state))

    def sharded(params, model_state, batch, rng, step, scale, specs, plan, rows=None):
        key = None if rng is None else device_key(rng, step, axes)
        if rows is None:
            return grads_fn(params, model_state, batch, key, scale, specs, plan)
        forward, held, pending, delayed = rows
        rows = LayerRows(forward, held, pending, zero.layers, delayed)
        return grads_fn(params, model_state, batch, key, scale, specs, plan, rows)

    return step_fn, flush
