"""The training state pytree, its shardings, and its creation on the mesh."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from jaxzero.ema import ema as sharded_ema
from jaxzero.ema.ema import EmaState, ShardedEMA
from jaxzero.precision import LossScaleState
from jaxzero.train import pmap_leftovers
from jaxzero.trees import check_not_donated as check_not_donated
from jaxzero.trees import leaves_by_keystr
from jaxzero.zero import specs as sh
from jaxzero.zero.config import ZeROConfig
from jaxzero.zero.offload import remainder
from jaxzero.zero.offload.remainder import stored_specs


class Pending(struct.PyTreeNode):
    """The layer stacks' update that a step with ``ZeRO(offload_update="deferred")`` left in
    host memory undone (decision 51), applied at the start of the next step or by
    :meth:`jaxzero.TrainStep.flush`.

    Attributes:
      values: what the streamed update's deferred rows read besides their state (the
        prologue's values, the gradients' stacks): ``stream.run(..., defer=)``'s second value.
      avals: ``(tree, ShapeDtypeStructs)`` of the update's ``(grads, model_state,
        grad_scale)`` arguments, which the rows trace it with again.
      rows: the flat params leaves whose new compute params the rows give.
      packed: the host state leaves the rows rewrite, packed one row per layer
        (:class:`~jaxzero.zero.offload.packed.PackedRows`, at stage 3 per layer with one
        micro-batch, where the next forward runs the rows): the truth while the update is
        pending, and the tree's leaves are stale. None: the tree's leaves.
      packing: how ``packed`` holds them (a
        :class:`~jaxzero.zero.offload.packed.PackedRows`), or None.
      stale: ``(flat index, shape, dtype name, NamedSharding)`` of each state leaf whose
        rows ``packed`` holds: the state keeps a placeholder there (one element per device,
        :func:`placeholder_shape`) until the rows are unpacked.
      delayed: whether the step that applies it runs delayed (``offload_update="delayed"``
        past its ``delay_after`` exact steps): its micro-batches compute on the params
        before this update, which its forwards apply beside their compute.
      before: with ``offload_update="delayed"``, the compute params leaves that the step
        which left this update updated at once (those not in :attr:`rows`: the leaves
        outside the stacks), as they were before it, ``{flat params index: leaf}``: a
        delayed step's forward reads them, so every leaf is a step behind. None otherwise.
    """

    values: tuple
    avals: tuple = struct.field(pytree_node=False)
    rows: tuple = struct.field(pytree_node=False)
    packed: tuple | None = None
    packing: Any = struct.field(pytree_node=False, default=None)
    stale: tuple = struct.field(pytree_node=False, default=())
    delayed: bool = struct.field(pytree_node=False, default=False)
    before: dict | None = None

    def placeholders(self, state: TrainState) -> TrainState:
        """``state`` (under jit) with a placeholder at each :attr:`stale` leaf, in its
        sharding."""
        # a value of the step: a constant output is jax's own, in the memory it picks
        zero = lambda dtype: (0 * state.step).astype(dtype)
        return self._with_stale(
            state,
            lambda shape, dtype, where: jax.device_put(
                jnp.broadcast_to(zero(dtype), placeholder_shape(shape, where)), where
            ),
        )

    def restored(self, state: TrainState) -> TrainState:
        """``state`` (under jit) with each placeholder of :attr:`stale` a leaf of its shape
        again, zeros in its sharding (pinned host memory): the update is traced on the real
        shapes, and nothing reads them but an unpacking, which writes every row first (a step
        whose forward runs the rows never reads them: XLA removes them)."""
        zeros = lambda shape, dtype, where: jax.device_put(jnp.zeros(shape, dtype), where)
        return self._with_stale(state, zeros)

    def restored_shapes(self, state: TrainState) -> TrainState:
        """``state`` with each placeholder of :attr:`stale` a ShapeDtypeStruct of the leaf it
        stands for (the shapes the rows unpack into)."""
        return self._with_stale(state, lambda shape, dtype, _: jax.ShapeDtypeStruct(shape, dtype))

    def _with_stale(self, state: TrainState, leaf) -> TrainState:
        """``state`` with ``leaf(shape, dtype, sharding)`` at each flat leaf index of
        :attr:`stale`."""
        flat, tree = jax.tree.flatten(state)
        for i, shape, dtype, where in self.stale:
            flat[i] = leaf(shape, jnp.dtype(dtype), where)
        return jax.tree.unflatten(tree, flat)


def placeholder_shape(shape, sharding) -> tuple[int, ...]:
    """The shape of a stale leaf's placeholder: one element per device, each dimension the
    number of devices ``sharding``'s spec splits it over (1 where it is not split)."""
    spec = sharding.spec
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    axes = lambda e: (e,) if isinstance(e, str) else (e or ())
    return tuple(math.prod(sharding.mesh.shape[a] for a in axes(e)) for e in entries)


def drop_stale(state: TrainState) -> TrainState:
    """``state`` (outside jit) with each stale leaf its pending update records
    (:attr:`Pending.stale`) that is still whole replaced by a placeholder, in its sharding:
    the first step that packs the rows returns them whole. A state without stale leaves
    comes back as it is."""
    pending = state.pending
    if pending is None or not pending.stale:
        return state
    flat, tree = jax.tree.flatten(state)
    changed = False
    for i, shape, dtype, where in pending.stale:
        target = placeholder_shape(shape, where)
        if tuple(flat[i].shape) == target:
            continue
        zeros = np.zeros(target, dtype)
        flat[i] = jax.make_array_from_callback(
            target, flat[i].sharding, lambda idx, z=zeros: z[idx]
        )
        changed = True
    return jax.tree.unflatten(tree, flat) if changed else state


class TrainState(struct.PyTreeNode):
    """Everything that persists between steps, each leaf placed on the mesh.

    Attributes:
      step: int32 optimizer steps taken (skipped steps do not count).
      params: compute parameters (``param_dtype``): replicated for stages 0-2, sharded 1/N for
        stage 3. With ``Precision(compute_copy=False)`` (stage 3) the master shards themselves
        (``master_dtype``), and ``master`` is None.
      master: fp32 master weights when ``param_dtype`` differs from ``master_dtype`` (sharded
        1/N for stages 1-3, replicated for stage 0); None otherwise, in which case the master
        is ``params`` itself (or its local slice). With ``offload=("optimizer", "remainder")``
        some leaves are kept as a
        :class:`~jaxzero.zero.offload.remainder.Remainder` beside ``params``: read the fp32
        master with :meth:`fp32_master`. The master is the truth: ``params`` is its
        cast, and a stage-3 step builds the loss's params from the master shards (so edit
        both, or re-create the state with ``zero.init``, to change the weights).
      opt_state: the wrapped optax transformation's state, sharded 1/N for stages 1-3.
      skipped: int32 count of steps skipped for non-finite gradients.
      ema: :class:`EmaState` in the master's shards, or None.
      loss_scale: :class:`LossScaleState`, or None.
      model_state: non-trainable collections (e.g. Flax ``batch_stats``), replicated.
      rng: a PRNG key for dropout etc., replicated, or None.
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any
    skipped: jax.Array
    ema: EmaState | None = None
    loss_scale: LossScaleState | None = None
    model_state: Any = None
    rng: Any = None

    @property
    def pending(self) -> Pending | None:
        """The layer stacks' update the last step left undone. None here; a
        :class:`PendingState` (``ZeRO(offload_update="deferred")``) carries one."""
        return None

    def check_flushed(self, reader: str) -> None:
        """Raise ValueError when the state carries a :class:`Pending` update: ``reader`` (what
        reads the state, named in the message) would see the layer stacks a step behind."""
        if self.pending is not None:
            raise ValueError(
                f"{reader} reads this state, which carries the layer stacks' update left "
                f"pending by ZeRO(offload_update='deferred'): their master, optimizer state, "
                f"EMA and params are a step behind. Apply it first: state = step.flush(state) "
                f"(the TrainStep that made the state)."
            )

    def gather_view(self):
        """What :func:`jaxzero.gather` of a state gathers: its compute params."""
        self.check_flushed("jaxzero.gather")
        return self.params

    def fp32_master(self):
        """The fp32 master, bit for bit, whatever the placement keeps: ``master`` with each
        :class:`~jaxzero.zero.offload.remainder.Remainder` leaf joined with its bf16
        ``params`` leaf (in the master's shards and memory kind). What checkpoints save and
        exports write; ``jaxzero.gather(state.fp32_master())`` gathers it.

        Returns:
          The master tree of fp32 arrays, or None when the state has no separate master (the
          master is ``params``).

        Raises:
          ValueError: the state carries a pending update (:meth:`check_flushed`).
        """
        self.check_flushed("TrainState.fp32_master")
        return None if self.master is None else remainder.fp32(self.master, self.params)


class PendingState(TrainState):
    """A :class:`TrainState` whose layer stacks' update the last step of
    ``ZeRO(offload_update="deferred")`` left undone (decision 51): their master, optimizer
    state, EMA and compute params are those of the step before, and ``pending`` holds what
    applying it reads. The next step applies it before its forward;
    :meth:`jaxzero.TrainStep.flush` applies it and returns a plain :class:`TrainState`.
    A subclass rather than a field, so that a state without deferral keeps its tree (and its
    checkpoints their layout).

    Attributes:
      pending: the :class:`Pending` update.
    """

    pending: Pending | None = None


def with_pending(state: TrainState, pending: Pending | None) -> TrainState:
    """``state``'s fields as a :class:`PendingState` carrying ``pending``, or as a plain
    :class:`TrainState` when ``pending`` is None."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(TrainState)}
    return TrainState(**fields) if pending is None else PendingState(**fields, pending=pending)


def split_pending(state: TrainState) -> tuple[TrainState, Pending | None]:
    """``(plain state, pending)`` (under jit): ``state`` as a plain :class:`TrainState`, each
    placeholder of its pending update's stale leaves a leaf of its shape again
    (:meth:`Pending.restored`), and the :class:`Pending` update it carries (None: nothing
    pending, and ``state`` comes back as it is)."""
    pending = state.pending
    if pending is None:
        return state, None
    return pending.restored(with_pending(state, None)), pending


def _placement(devices, shape=None) -> str:
    ids = sorted(d.id for d in devices)
    shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
    where = f"{len(ids)} device{'s' if len(ids) != 1 else ''} [{shown}]"
    return where if shape is None else f"mesh {dict(shape)} ({where})"


def check_same_mesh(state, mesh) -> None:
    """Raise ValueError when ``state`` (its first placed leaf) lives on other devices than
    ``mesh``'s: a state built for another mesh, e.g. on 8 devices fed to a 4-device step."""
    for x in jax.tree.leaves(state):
        sharding = getattr(x, "sharding", None)
        if sharding is None or isinstance(x, jax.core.Tracer):
            continue
        if sharding.device_set == set(mesh.devices.flat):
            return
        have = _placement(
            sharding.device_set, getattr(getattr(sharding, "mesh", None), "shape", None)
        )
        raise ValueError(
            f"this state is placed on {have} but the step's ZeRO runs on "
            f"{_placement(mesh.devices.flat, mesh.shape)}: it was built for another mesh. Move "
            f"it through a checkpoint: jaxzero.checkpoint.save it, then "
            f"jaxzero.checkpoint.restore(directory, zero, params) with this step's zero (a "
            f"checkpoint restores onto any mesh and stage); or start afresh with "
            f"zero.init(params) / step.init(params)."
        )


def check_params(params) -> None:
    """Every trainable leaf must be a floating array; list every offender otherwise."""
    bad = []
    for path, leaf in leaves_by_keystr(params):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            bad.append(
                f"{path or '<root>'} ({dtype if dtype is not None else type(leaf).__name__})"
            )
    if bad:
        raise TypeError(
            f"params must hold only floating-point arrays (they are all trained), but these "
            f"leaves are not: {', '.join(bad)}. Move counters and integer buffers out of the "
            f"trainable tree (e.g. into model_state) or cast them to float."
        )
    if not leaves_by_keystr(params):
        raise ValueError("params is an empty tree: there is nothing to train.")


def check_model_state(params, model_state) -> None:
    """The model state must not hold what the optimizer trains (e.g. a "params" collection)."""
    if model_state is None:
        return
    if isinstance(model_state, dict) and "params" in model_state:
        raise ValueError(
            "model_state has a 'params' collection: trainable arrays belong in params, and "
            "model_state holds only non-trainable collections (e.g. {'batch_stats': ...}). "
            "Split the variables: params = variables.pop('params')."
        )
    param_paths = {k for k, _ in leaves_by_keystr(params)}
    shared = [k for k, _ in leaves_by_keystr(model_state) if k in param_paths]
    if shared:
        raise ValueError(
            f"model_state leaves {shared[:5]} have the same paths as trainable params; the "
            f"optimizer would see them twice. Keep non-trainable state out of params."
        )


def raw_key(rng):
    """Typed PRNG keys are stored as their raw uint32 data (checkpointable everywhere);
    ``jax.random.fold_in`` and friends accept both."""
    if rng is None:
        return None
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if isinstance(rng, jax.ShapeDtypeStruct):
            return jax.eval_shape(jax.random.key_data, rng)
        return jax.random.key_data(rng)
    return rng


def cast(tree, dtype):
    """Every leaf of ``tree`` cast to ``dtype``."""
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def state_specs(zero: ZeROConfig, state: TrainState) -> TrainState:
    """PartitionSpecs for every leaf of ``state`` (concrete or abstract) under ``zero``."""
    return _specs(zero, state)[0]


def _specs(zero: ZeROConfig, state: TrainState):
    """``(specs, ema_shards)``: :func:`state_specs`, and the
    :class:`~jaxzero.ema.ema.Shards` the EMA's update reads and writes on ``zero``'s shards
    (its target's specs and its storage's; None without an EMA)."""
    ema = None
    if state.ema is not None:
        averaged = sharded_ema.target(state.params, state.model_state)
        ema = sharded_ema.shards(zero, state.ema, averaged)
    replicated = lambda t: jax.tree.map(lambda _: P(), t)
    specs = TrainState(
        step=P(),
        params=zero.param_specs(state.params),
        master=None if state.master is None else stored_specs(zero.shard_specs(state.master)),
        opt_state=zero.shard_specs(state.opt_state),
        skipped=P(),
        ema=None if ema is None else ema.state_specs,
        loss_scale=None if state.loss_scale is None else replicated(state.loss_scale),
        model_state=None if state.model_state is None else replicated(state.model_state),
        rng=None if state.rng is None else P(),
    )
    return specs, ema


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Where every leaf of one state's structure lives, decided once: its PartitionSpecs,
    which leaves of the optimizer side are in host memory, and their NamedShardings. The
    update reads all three from one layout (its in-specs, the streamed update's host
    leaves and the new state's constraint), since its output has its input's structure.

    Attributes:
      specs: a :class:`TrainState` of PartitionSpecs (:func:`state_specs`).
      host: ``(master, opt_state, ema)`` as trees of bools, True where the leaf lives in
        host memory (the placement's ``state_shardings``: offload, ``offload_fraction``).
      shardings: a :class:`TrainState` of NamedShardings, memory kinds included.
      ema_shards: where the EMA's update on the shards reads and writes
        (:class:`~jaxzero.ema.ema.Shards`: its target's specs and its storage's); None
        without an EMA.
    """

    specs: TrainState
    host: tuple
    shardings: TrainState
    ema_shards: Any = None


def state_layout(zero: ZeROConfig, state: TrainState) -> StateLayout:
    """The :class:`StateLayout` of ``state`` (concrete or abstract) under ``zero``: the
    params, the master, the optimizer state and the EMA where ``zero.placement`` keeps them
    (pinned host memory with offload, the leaves of its ``state_shardings`` with
    ``offload_fraction``)."""
    specs, ema = _specs(zero, state)
    # per leaf (offload_fraction: decision 43)
    host, placed = zero.placement.state_shardings(zero.mesh, state, specs)
    return StateLayout(specs, host, sh.named(zero.mesh, specs).replace(**placed), ema)


def state_shardings(zero: ZeROConfig, state: TrainState) -> TrainState:
    """NamedShardings for every leaf of ``state`` (its :func:`state_layout`'s)."""
    return state_layout(zero, state).shardings


def constrain(zero: ZeROConfig, state: TrainState) -> TrainState:
    """:meth:`jaxzero.ZeRO.constrain`: every leaf to its ZeRO sharding and memory kind."""
    return zero.placement.constrain(state, state_shardings(zero, state))


def _init_raw(zero: ZeROConfig, params, ema: ShardedEMA | None, model_state, rng) -> TrainState:
    pol = zero.precision
    master_full = cast(params, pol.master_dtype)
    master_view = jax.lax.with_sharding_constraint(
        master_full, sh.named(zero.mesh, zero.shard_specs(master_full))
    )
    ema_state = None
    if ema is not None:
        ema_state = ema.init(sharded_ema.target(master_view, model_state))
        ema_state = sharded_ema.bucket(zero, ema, ema_state)
    compute = cast(params, pol.param_dtype) if pol.compute_copy else master_view
    # the master as the placement keeps it (a remainder beside the compute params: decision 47)
    master = None
    if pol.separate_master:
        master = zero.placement.stored_master(zero, master_view, compute)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=compute,
        master=master,
        opt_state=zero.tx.init(master_view),
        skipped=jnp.zeros((), jnp.int32),
        ema=ema_state,
        loss_scale=None if zero.loss_scale is None else zero.loss_scale.init(),
        model_state=model_state,
        rng=rng,
    )


def abstract_state(zero: ZeROConfig, params, *, ema=None, model_state=None, rng=None) -> TrainState:
    """The state's ShapeDtypeStructs, with shardings, without allocating anything."""
    zero.check_layers(params)
    rng = raw_key(rng)
    shapes = jax.eval_shape(lambda p, m, r: _init_raw(zero, p, ema, m, r), params, model_state, rng)
    shardings = state_shardings(zero, shapes)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def tree_mismatch(want: dict, have: dict, prefix: str = "") -> list[str]:
    """What differs between two ``{path: shape}`` maps: the paths missing from ``have``, those
    it adds, and those shaped otherwise (at most four of each, with a count of the rest)."""

    def some(what: str, items: list[str]) -> list[str]:
        more = f" and {len(items) - 4} more" if len(items) > 4 else ""
        return [f"{what} {', '.join(prefix + k for k in items[:4])}{more}"] if items else []

    shaped = [
        f"{k} {have[k]} (expected {want[k]})" for k in want if k in have and have[k] != want[k]
    ]
    return (
        some("missing", [k for k in want if k not in have])
        + some("unexpected", [k for k in have if k not in want])
        + some("shaped otherwise:", shaped)
    )


def check_opt_state(expected, given) -> None:
    """Raise ValueError naming the paths where ``given`` (an optax state to adopt) differs
    from ``expected`` (``zero.tx.init(params)``'s shapes): missing, unexpected, mis-shaped."""
    shapes = lambda t: {k: tuple(int(d) for d in jnp.shape(x)) for k, x in leaves_by_keystr(t)}
    bad = tree_mismatch(shapes(expected), shapes(given))
    if not bad and jax.tree.structure(expected) != jax.tree.structure(given):
        bad.append(
            f"the same leaves in other containers: {jax.tree.structure(given)} against "
            f"{jax.tree.structure(expected)}"
        )
    if bad:
        raise ValueError(
            f"opt_state does not match the ZeRO's optimizer state for these params "
            f"(zero.tx.init(params)): {'; '.join(bad)}. Pass the state of the same optax "
            f"transformation, built for the same params, as the one given to "
            f"jz.ZeRO(tx, ...); nothing was placed."
        )


def step_count(step) -> int:
    """A step counter to adopt (an int, or a 0-d integer array) as a Python int >= 0."""
    value = getattr(step, "dtype", None)
    integral = isinstance(step, int) and not isinstance(step, bool)
    if value is not None and jnp.ndim(step) == 0 and jnp.issubdtype(value, jnp.integer):
        integral, step = True, int(step)
    if not integral or step < 0:
        raise ValueError(
            f"step={step!r} must be the optimizer steps already taken: an int >= 0 (e.g. "
            f"int(flax_state.step)), so the step counter, the schedule, the EMA and the "
            f"dropout keys go on from there."
        )
    return step


def init(
    zero: ZeROConfig, params, *, ema=None, model_state=None, rng=None, opt_state=None, step=None
) -> TrainState:
    """:meth:`jaxzero.ZeRO.init`: check the inputs, then place the state on the mesh; an
    adopted ``opt_state`` and ``step`` replace the fresh ones."""
    check_params(params)
    pmap_leftovers.check_not_replicated(params, jax.local_device_count())
    check_model_state(params, model_state)
    zero.check_layers(params)
    rng = raw_key(rng)
    if jax.process_count() > 1:
        from jaxzero.distributed.runtime import check_same_on_all_processes

        check_same_on_all_processes(params, "params")
        check_same_on_all_processes(model_state, "model_state")
        check_same_on_all_processes(rng, "rng")
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    abstract = abstract_state(zero, params, ema=ema, model_state=model_state, rng=rng)
    if opt_state is not None:
        check_opt_state(abstract.opt_state, opt_state)
    if step is not None:
        step = jnp.asarray(step_count(step), jnp.int32)
    out = jax.tree.map(lambda x: x.sharding, abstract)

    def build(p, m, r, o, s):
        state = _init_raw(zero, p, ema, m, r)
        if o is not None:  # adopted: placed by out_shardings, never by state.replace
            o = jax.tree.map(lambda x, a: x.astype(a.dtype), o, state.opt_state)
            state = state.replace(opt_state=o)
        return state if s is None else state.replace(step=s)

    fn = jax.jit(build, out_shardings=out)
    # Inputs may live anywhere (numpy, one device, another mesh): move what is committed
    # elsewhere onto this mesh, in the placement the state will have.
    params = _onto(params, out.params)
    model_state = _onto(model_state, out.model_state)
    rng = _onto(rng, out.rng)
    opt_state = _onto(opt_state, out.opt_state)
    return fn(params, model_state, rng, opt_state, step)


def _onto(tree, shardings):
    """Leaves of ``tree`` that are jax Arrays on devices other than their target sharding's,
    ``device_put`` there (host and already-placed leaves pass through)."""
    if tree is None:
        return None

    def one(x, s):
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
            return x  # traced (init under eval_shape / jit) or on the host: jit places it
        if x.sharding.device_set != s.device_set:
            return jax.device_put(x, s)
        return x

    return jax.tree.map(one, tree, shardings)
