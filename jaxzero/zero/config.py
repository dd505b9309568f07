"""``ZeRO``: any optax transformation, with its state sharded over the data axis.

The class is a frozen, self-validating config plus the facts of its mesh; every method
delegates to the module that does the work: :mod:`jaxzero.zero.specs` (the sharding rule),
:mod:`jaxzero.zero.collectives` (what runs inside ``shard_map``), :mod:`jaxzero.zero.layers`
(stage 3 per layer), :mod:`jaxzero.train.state` (creating the state),
:mod:`jaxzero.train.update` (the optax update) and :mod:`jaxzero.ema.placement` (the EMA).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxzero._tree import subtree_names
from jaxzero.ema import placement
from jaxzero.ema import storage as ema_storage
from jaxzero.ema.ema import EmaState, ShardedEMA
from jaxzero.mesh import check_mesh, warn_unnamed_replica_axes
from jaxzero.precision import DynamicLossScale, Precision, StaticLossScale, check_loss_scale
from jaxzero.train import state as train_state
from jaxzero.train import update as train_update
from jaxzero.train.state import TrainState
from jaxzero.zero import collectives, layers, units, vocab
from jaxzero.zero import offload as host_memory
from jaxzero.zero import specs as sh

STAGES = (0, 1, 2, 3)


def _layer_names(layers) -> tuple[str, ...]:
    return subtree_names(
        layers,
        f"layers={layers!r} must name the params subtrees holding scanned layer stacks, e.g. "
        f"layers='layers' or layers=('encoder', 'decoder').",
    )


def _precision(precision, stage) -> Precision:
    if precision is None:
        return Precision()
    if isinstance(precision, str):
        return Precision.create(precision)
    if not isinstance(precision, Precision):
        raise TypeError(
            f"precision={precision!r} must be a jaxzero.Precision or 'fp32'/'bf16'/'fp16'."
        )
    if not precision.compute_copy and stage != 3:
        raise ValueError(
            f"Precision(compute_copy=False) needs stage=3 (got stage={stage}): below stage 3 "
            f"the step computes with the replicated params copy; keep compute_copy=True."
        )
    return precision


@dataclasses.dataclass(frozen=True)
class ZeRO:
    """ZeRO stage 0-3 sharding around any ``optax.GradientTransformation``.

    =====  ==============================  ========================  ==============  =======
    stage  compute params                  reduced gradients         master + opt.   EMA
    =====  ==============================  ========================  ==============  =======
    0      replicated                      all-reduced, replicated   replicated      sharded
    1      replicated                      all-reduced, sliced       sharded 1/N     sharded
    2      replicated                      reduce-scattered, 1/N     sharded 1/N     sharded
    3      sharded 1/N, gathered for use   reduce-scattered          sharded 1/N     sharded
    =====  ==============================  ========================  ==============  =======

    Args:
      tx: the optax transformation (any chain: masks, clipping, schedules, MultiSteps...).
        Its update runs under ``jax.jit`` on the sharded arrays, so transforms with global
        reductions (``clip_by_global_norm``, LAMB) give the unsharded result.
      mesh: a mesh with an axis named ``axis``; every other mesh axis is a replica axis
        (hybrid sharding: state replicated over it, batch and gradient mean over all axes).
      stage: 0, 1, 2 or 3.
      axis: the mesh axis state is sharded over.
      precision: a :class:`Precision` policy, or "fp32"/"bf16"/"fp16".
      loss_scale: :class:`DynamicLossScale`, :class:`StaticLossScale` or None.
      skip_nonfinite: skip the whole update (params, master, optimizer state, EMA and step
        unchanged) when any gradient on any device is non-finite.
      layers: params subtrees holding scanned layer stacks (the layer index on axis 0 of every
        leaf), e.g. ``"layers"`` or ``"outer/inner"``; ``init`` refuses other subtrees. They
        (and their optimizer state and EMA) are never split along axis 0. Stage 3 gathers them
        a layer at a time (:func:`jaxzero.gather_layer` or :func:`jaxzero.scan_layers` in the
        model); stages 2 and 1 (no micro-batches) reduce-scatter each layer in the backward.
      vocab_parallel: stage 3 only: names of params subtrees holding ``[vocab, width]``
        embedding tables (e.g. ``"embed"``) that the loss gets as this device's rows, never
        gathered; the model looks them up and computes its tied head's cross-entropy with
        :class:`jaxzero.VocabParallelEmbed` (:mod:`jaxzero.zero.vocab`: pays at small N).
      units: stage 3: regular expressions over params paths (``r"block_\\d+"``), each match
        gathered where it runs and for its backward (``fully_shard``: :mod:`jaxzero.zero.units`).
      offload: None, or ``"optimizer"`` (stages 1-3, DeepSpeed's ``offload_optimizer``): the
        master, optimizer state, EMA in host memory, updated there (:mod:`jaxzero.zero.offload`).

    Example:
      >>> zero = ZeRO(optax.adamw(3e-4), data_parallel_mesh(), stage=2)
      >>> state = zero.init(params)
    """

    tx: optax.GradientTransformation
    mesh: Mesh
    stage: int = 2
    axis: str = "data"
    precision: Any = None
    loss_scale: DynamicLossScale | StaticLossScale | None = None
    skip_nonfinite: bool = True
    layers: tuple[str, ...] | str | None = None
    vocab_parallel: tuple[str, ...] | str | None = None
    offload: str | None = None
    units: tuple[str, ...] | str | None = None

    def __post_init__(self):
        if self.stage not in STAGES or isinstance(self.stage, bool):
            raise ValueError(
                f"stage={self.stage!r} is not a ZeRO stage; use 0 (plain data parallel), "
                f"1 (shard optimizer state), 2 (+ shard gradients) or 3 (+ shard parameters)."
            )
        if not (hasattr(self.tx, "init") and hasattr(self.tx, "update")):
            raise TypeError(
                f"tx={self.tx!r} is not an optax.GradientTransformation (needs init and update)."
            )
        check_mesh(self.mesh, self.axis)
        warn_unnamed_replica_axes(self.mesh, self.axis)
        object.__setattr__(self, "layers", _layer_names(self.layers))
        object.__setattr__(self, "vocab_parallel", vocab.names(self.vocab_parallel, self.stage))
        object.__setattr__(self, "precision", _precision(self.precision, self.stage))
        object.__setattr__(self, "units", units.patterns(self.units, self.stage, self.layers))
        check_loss_scale(self.loss_scale, self.precision)
        host_memory.check(self.offload, self.stage, self.mesh)

    @property
    def num_shards(self) -> int:
        """N, the size of the data axis the state is split over."""
        return self.mesh.shape[self.axis]

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes other than ``axis`` (state replicated over them)."""
        return tuple(a for a in self.mesh.axis_names if a != self.axis)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over (all of them; the data axis last)."""
        return self.replica_axes + (self.axis,)

    @property
    def num_batch_shards(self) -> int:
        """How many pieces the global batch is split into (the mesh size)."""
        return int(self.mesh.size)

    def batch_spec(self) -> P:
        """The batch's PartitionSpec: leading dimension split over every mesh axis."""
        axes = self.batch_axes
        return P(axes if len(axes) > 1 else axes[0])

    @property
    def per_layer(self) -> bool:
        """True at stage 3 with named layer stacks (parameters gathered one layer at a time)."""
        return self.stage == 3 and bool(self.layers)

    @property
    def comm(self) -> collectives.Comm:
        """What the collectives inside ``shard_map`` need to know (axes, sizes, dtypes)."""
        return collectives.Comm.create(
            self.axis, self.batch_axes, self.replica_axes, self.num_batch_shards, self.precision
        )

    # -- the sharding rule (jaxzero.zero.specs) ----------------------------------------------
    def _specs(self, tree, shard: bool):
        rule = {"stacked": self.layers, "contiguous": self.per_layer}
        return sh.tree_specs(tree, self.num_shards, self.axis, shard=shard, **rule)

    def param_specs(self, params):
        """Specs of the compute params: sharded for stage 3, replicated otherwise."""
        return self._specs(params, self.stage == 3)

    def shard_specs(self, tree):
        """Specs of the master/optimizer-state shards (sharded for stages 1-3)."""
        return self._specs(tree, self.stage >= 1)

    def grad_specs(self, params):
        """Specs of the reduced gradients: sharded for stages 2/3, replicated for 0/1."""
        return self._specs(params, self.stage >= 2)

    def ema_leaf_specs(self, tree):
        """Specs of a per-leaf EMA tree (always sharded, at every stage)."""
        return self._specs(tree, True)

    def ema_specs(self, ema_tree):
        """Specs of an EMA tree in its storage (per leaf, or bucketed ``[N, L_g]`` rows)."""
        return ema_storage.specs(ema_tree, self.ema_leaf_specs, self.axis)

    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs for every leaf of ``state`` (concrete or abstract)."""
        return train_state.state_specs(self, state)

    def state_shardings(self, state: TrainState) -> TrainState:
        """NamedShardings for ``state`` (for ``jax.jit(in_shardings=, out_shardings=)``)."""
        return train_state.state_shardings(self, state)

    def constrain(self, state: TrainState) -> TrainState:
        """Every leaf to its ZeRO sharding and memory kind (inside jit)."""
        return train_state.constrain(self, state)

    def _stacked_mask(self, tree, on: bool | None = None):  # the loss gets them as shards
        if not (self.per_layer or self.units if on is None else on):
            return None
        return units.mask(tree, self.units) if self.units else sh.subtree_mask(tree, self.layers)

    def _whole_mask(self, tree):  # stage 0 per layer: the stacks stay device-invariant
        on = self.stage == 0 and layers.reduces_in_backward(0, self.layers, self.precision)
        return self._stacked_mask(tree, on)

    # -- state ----------------------------------------------------------------------------------
    def init(self, params, *, ema: ShardedEMA | None = None, model_state=None, rng=None):
        """Place the training state on the mesh (works under ``jax.eval_shape``).

        ``ema`` adds an :class:`EmaState` in the master's shards; ``model_state``
        (non-trainable collections) and ``rng`` (a PRNG key) are stored replicated.

        Raises:
          TypeError: a params leaf is not a floating array (every offending path is listed).
        """
        return train_state.init(self, params, ema=ema, model_state=model_state, rng=rng)

    def abstract_state(self, params, *, ema=None, model_state=None, rng=None) -> TrainState:
        """The state's ShapeDtypeStructs, with shardings, without allocating anything."""
        return train_state.abstract_state(self, params, ema=ema, model_state=model_state, rng=rng)

    _ema_target = staticmethod(train_state.ema_target)  # what the EMA averages

    def check_layers(self, params) -> None:
        """``layers`` name params subtrees of arrays with a layer axis; ``units`` match paths."""
        layers.check_layers(params, self.layers, self.stage)
        units.check(params, self.units)

    def bucket_ema(self, ema: ShardedEMA, ema_state: EmaState) -> EmaState:
        """``ema_state`` in ``ema``'s storage for this mesh and stage (local, no communication);
        the inverse is :func:`jaxzero.unbucket_ema`."""
        where = (self.mesh, self.axis, ema.bucket_leaves_up_to, self.stage, self.ema_leaf_specs)
        return ema_storage.store(ema_state, *where)

    # -- inside shard_map (jaxzero.zero.collectives, jaxzero.zero.layers) ---------------------
    def gather_params(self, local_params, specs):
        """All-gather stage-3 parameter shards (``specs``: ``param_specs(params)``)."""
        return collectives.gather_params(
            self.comm, local_params, specs, self._stacked_mask(local_params)
        )

    def params_for_loss(self, local_params, specs):
        """The full compute params, marked device-varying, ready to differentiate."""
        tables = vocab.mask(self.vocab_parallel, local_params)  # stay rows, like the stacks
        args = (vocab.either(self._stacked_mask(local_params), tables),)
        args += (self._whole_mask(local_params), bool(self.offload))  # keep_dtype: decision 32
        full = collectives.params_for_loss(self.comm, local_params, specs, *args)
        return vocab.varying(self.comm, tables, full)

    def layer_plan(self, local_params, specs):
        """The plan of a per-layer stage-3 step (gather), or of a stage 2/0 step that reduces in
        the backward (:func:`jaxzero.zero.layers.reduces_in_backward`); None otherwise."""
        gather, rule = self.per_layer, (self.stage, self.layers, self.precision, self.replica_axes)
        if not (gather or layers.reduces_in_backward(*rule)):
            return None
        specs = specs if gather else self.grad_specs(local_params)
        return layers.build_plan(
            self.comm, self.layers, local_params, specs, gather=gather, invariant=self.stage == 0
        )

    def reduce_gradients(self, grads, plan=None):
        """Average local gradients over every batch axis (all-reduce or reduce-scatter);
        ``plan``: the step's :meth:`layer_plan` (stage 2: the leaves it reduced per layer)."""
        masks = (self._stacked_mask(grads), layers.scattered_mask(plan, grads))
        masks += (vocab.mask(self.vocab_parallel, grads),)  # complete on every device
        return collectives.reduce_gradients(self.comm, grads, self.grad_specs(grads), *masks)

    # -- under jit (jaxzero.train.update, jaxzero.ema.placement) ------------------------------
    def all_gather(self, tree):
        """Replicate a tree of shards with one explicit ``all_gather`` per sharded leaf."""
        return collectives.all_gather(self.mesh, self.axis, tree, self.shard_specs(tree))

    def master_view(self, state: TrainState):
        """The master weights in their shards."""
        return train_update.master_view(self, state)

    def update_ema(self, ema: ShardedEMA, ema_state: EmaState, master, *, step, apply):
        """The EMA update as a ``shard_map`` over the EMA's shards: provably local."""
        return _update_ema(self, ema, ema_state, master, step=step, apply=apply)

    def apply_gradients(
        self, state: TrainState, grads, *, ema: ShardedEMA | None = None, model_state=None
    ):
        """The optax update on shards (call under ``jax.jit``, outside ``shard_map``).

        ``grads`` are the reduced gradients of the (scaled) loss, in any sharding; they are
        constrained to the master's shards, unscaled, checked for non-finite values
        (globally), and handed to the optax chain with the master shards. Then
        ``master += updates``, the EMA is updated on the same shards, and the compute params
        are ``cast(master)`` all-gathered (stages 1/2) or left as they are placed (stages 0/3).
        With ``skip_nonfinite`` a non-finite step leaves every leaf unchanged.

        Returns:
          ``(new_state, metrics)`` with metrics ``grad_norm``, ``finite``, ``skipped``,
          ``step`` (and ``loss_scale`` with a loss scale).
        """
        return train_update.apply_gradients(self, state, grads, ema=ema, model_state=model_state)


def _update_ema(zero: ZeRO, ema: ShardedEMA, ema_state: EmaState, master, *, step, apply):
    return placement.update(
        ema,
        ema_state,
        master,
        mesh=zero.mesh,
        axis=zero.axis,
        master_specs=_master_specs(zero, master),
        leaf_specs=zero.ema_leaf_specs(master),
        per_leaf_specs=zero.ema_leaf_specs,
        step=step,
        apply=apply,
    )


def _master_specs(zero: ZeRO, master):
    """The specs of what the EMA averages as it is placed: the master's shards, and the
    replicated model state when the EMA also averages it."""
    if isinstance(master, dict) and set(master) == {"params", "model_state"}:
        return {
            "params": zero.shard_specs(master["params"]),
            "model_state": jax.tree.map(lambda _: P(), master["model_state"]),
        }
    return zero.shard_specs(master)
