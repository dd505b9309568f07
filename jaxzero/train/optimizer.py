"""``ZeRO``: any optax transformation, with its state sharded over the data axis.

:class:`ZeRO` is its config (:class:`~jaxzero.zero.config.ZeROConfig`: fields, validation,
mesh facts, the sharding rule) plus the training side, which lives here, above ``zero/`` and
beside the step: creating the state (:mod:`jaxzero.train.state`), the optax update
(:mod:`jaxzero.train.update`) and the EMA (:mod:`jaxzero.ema.ema`). Each method is a
call into those modules, which take the config; nothing below ``train/`` calls back up
(decision 34).
"""

from __future__ import annotations

import dataclasses

from jaxzero.ema import ema as sharded_ema
from jaxzero.ema.ema import EmaState, ShardedEMA
from jaxzero.train import state as train_state
from jaxzero.train import update as train_update
from jaxzero.train.state import TrainState
from jaxzero.trees import check_same_structure
from jaxzero.zero import plan as leaf_plan
from jaxzero.zero.config import ZeROConfig
from jaxzero.zero.plan import Plan


@dataclasses.dataclass(frozen=True)
class ZeRO(ZeROConfig):
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
        :class:`jaxzero.VocabParallelEmbed` (:mod:`jaxzero.zero.layers.vocab`: pays at small N).
      units: stage 3: regular expressions over params paths (``r"block_\\d+"``), each match
        gathered where it runs and for its backward (``fully_shard``: :mod:`jaxzero.zero.units`).
      prefetch: with ``units=`` only (default True): the units run as one chain that gathers
        unit ``k + 1`` under unit ``k``'s forward and unit ``k - 1`` under unit ``k``'s
        backward, reduce-scatters each unit's gradient under the next unit's backward, gathers
        the leaves outside the units where they are read, and recomputes each unit from its
        input for its backward (:mod:`jaxzero.zero.units.chain`; MaxText's
        ``prefetch_fsdp_weights``). False: each unit is a ``jax.checkpoint`` that keeps the
        model's own remat policy, with the backward's collectives exposed (decision 33).
      offload: None, or ``"optimizer"`` (stages 1-3, DeepSpeed's ``offload_optimizer``): the
        master, optimizer state, EMA in host memory, streamed through the device by the
        update (the config's ``placement``, :class:`~jaxzero.zero.config.ZeROConfig`);
        ``("optimizer", "params")`` (stage 3 with ``layers=`` run by
        :func:`jaxzero.scan_layers`; DeepSpeed's ``offload_param``): the 16-bit params too,
        each layer fetched one ahead, its gradient written into its params' host bytes
        (decision 37); ``"activations"``, alone or
        as ``("optimizer", "activations")``: stage 3 with ``layers=`` keeps the layer inputs
        :func:`jaxzero.scan_layers` saves for the backward in host memory, fetched back one
        layer ahead (decision 36); or :class:`jaxzero.NVMe` ``(path, ...)`` (ZeRO-Infinity's
        NVMe tier, DeepSpeed's ``offload_optimizer: {device: nvme}``): the fp32 master and the
        optimizer state in a file under ``path``, paged through a window of host buffers by
        the update, the params on the device (decision 50); the step and its state come from
        :func:`jaxzero.make_train_step` (stored as ``offload="optimizer"`` and ``nvme``).
      offload_fraction: with ``offload="optimizer"``, the share in (0, 1] of the master,
        optimizer state and EMA bytes per device kept in pinned host memory (DeepSpeed's
        ``offload_optimizer.ratio``, Megatron's ``--optimizer-offload-fraction``): the largest
        leaves first until at least that share is reached; the rest stays in device memory,
        updated there in the same step (decision 43). Default 1: all of it.
      offload_update: None (the update after the backward), or ``"deferred"``: with
        ``offload="optimizer"`` over all the state, ``layers=`` and an fp32 master, the layer
        stacks' streamed update is left pending in the returned
        :class:`~jaxzero.train.state.PendingState` and applied by the next step: at stage 3
        inside its forward (with micro-batches, the first one's), a layer's rows just before
        that layer's gather in :func:`jaxzero.scan_layers`' loop (the stack must run through
        exactly one ``scan_layers`` call), otherwise before its forward. ``step.flush(state)``
        applies what is pending before a checkpoint, a gather or an export (which refuse a
        pending state). The same numbers, with the update's copies beside the forward's
        compute (decision 51: on a deviceless H100 compile of a 24-layer decoder, 90% of its
        PCIe bytes hidden; layers 0-1 stay exposed).
        Or ``"delayed"`` (ZeRO-Offload's delayed parameter update, DPU; stage 3 with the
        stacks run by :func:`jaxzero.scan_layers`): after ``delay_after`` exact steps as
        ``"deferred"``, each step takes its gradient at the params before the update the
        step before left pending (every leaf a step behind), and applies that update
        inside its first micro-batch's forward, where no gather waits for it. Not exact:
        the gradient is a step stale (decision 51 states its cost on a 2,000-step run).
      delay_after: with ``offload_update="delayed"``, the exact steps before the delay
        (an int >= 1, the first step counted: it has nothing pending to delay; default 1:
        from the second step). Refused with any other
        ``offload_update``.
      quantize: None (exact collectives), or ZeRO++'s quantized collectives
        (:mod:`jaxzero.zero.wire`): ``"weights"`` (qwZ, stage 3: each shard all-gathered as
        int8 blocks of <= 4096 values with a float32 scale each, dequantized to the compute
        dtype; the master stays exact), ``"grads"`` (qgZ, stages 2-3: each gradient
        reduce-scatter an ``all_to_all`` of int8 tiles summed in float32), ``"both"``, or a
        :class:`jaxzero.Wire` (``Wire.create(weights=8, grads=4)``: int4 gradients).
        :meth:`quantized_leaves` lists the leaves that stay exact.
      hpz_partition_size: None or 1 (off), or G, the devices per node (DeepSpeed ZeRO++'s
        hpZ, ``zero_hpz_partition_size``): stage 3 with ``layers=`` and
        :func:`jaxzero.scan_layers` only. Each layer's forward keeps its 1/G slice of the
        gathered compute weights and the backward gathers the layer within the node of G
        consecutive data-axis devices (``Wire(hpz=G)``, :mod:`jaxzero.zero.wire`).

    Example:
      >>> zero = ZeRO(optax.adamw(3e-4), data_parallel_mesh(), stage=2)
      >>> state = zero.init(params)
    """

    # -- state (jaxzero.train.state) ---------------------------------------------------------
    def init(
        self,
        params,
        *,
        ema: ShardedEMA | None = None,
        model_state=None,
        rng=None,
        opt_state=None,
        step=None,
    ):
        """Place the training state on the mesh (works under ``jax.eval_shape``).

        ``ema`` adds an :class:`EmaState` in the master's shards; ``model_state``
        (non-trainable collections) and ``rng`` (a PRNG key) are stored replicated.

        To continue a plain optax run (adopt it), pass its optimizer state as ``opt_state``
        (the state of the same ``tx``, e.g. ``flax_state.opt_state``; placed into its shards)
        and the steps it has taken as ``step`` (the step counter goes on from there, and with
        it the dropout keys and the EMA's ``start_step``); :func:`jaxzero.checkpoint.adopt`
        reads both from a plain orbax checkpoint or a Flax ``TrainState``. An EMA starts at
        ``params``.

        Raises:
          TypeError: a params leaf is not a floating array (every offending path is listed).
          ValueError: ``opt_state`` does not match ``tx.init(params)`` (the paths are named),
            or ``step`` is not an int >= 0; the optimizer state is on disk
            (``offload=jz.NVMe(...)``: the step's ``init`` writes it there).
        """
        if self.nvme is not None:
            raise ValueError(
                f"ZeRO(offload=NVMe({str(self.nvme.path)!r}, ...)) keeps the optimizer state in "
                f"a file, which zero.init would hold in memory whole. Make the state with "
                f"jz.make_train_step(loss_fn, zero).init(params): it writes the file a group of "
                f"leaves at a time."
            )
        return train_state.init(
            self, params, ema=ema, model_state=model_state, rng=rng, opt_state=opt_state, step=step
        )

    def plan(self, params, *, accum_steps: int = 1, ema: ShardedEMA | None = None) -> Plan:
        """The per-leaf plan (:mod:`jaxzero.zero.plan`): for every params leaf, its shardings,
        how the loss gets it and its gradient leaves the backward, how micro-batches
        accumulate it, where its state and params live, its wire encoding, its EMA storage
        and its bytes per device. ``params``: arrays or ``jax.ShapeDtypeStruct``s (nothing
        is allocated); ``accum_steps``: the step's micro-batches; ``ema``: the step's
        ``ShardedEMA``. ``print(zero.plan(params))`` shows the table."""
        self.check_layers(params)  # the tree the config names, before anything reads it
        storage = None if ema is None else sharded_ema.leaf_storage(self, ema, params)
        return leaf_plan.build(self, params, accum_steps=accum_steps, ema_storage=storage)

    def abstract_state(self, params, *, ema=None, model_state=None, rng=None) -> TrainState:
        """The state's ShapeDtypeStructs, with shardings, without allocating anything."""
        return train_state.abstract_state(self, params, ema=ema, model_state=model_state, rng=rng)

    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs for every leaf of ``state`` (concrete or abstract)."""
        return train_state.state_specs(self, state)

    def state_shardings(self, state: TrainState) -> TrainState:
        """NamedShardings for ``state`` (for ``jax.jit(in_shardings=, out_shardings=)``)."""
        return train_state.state_shardings(self, state)

    def constrain(self, state: TrainState) -> TrainState:
        """Every leaf to its ZeRO sharding and memory kind (inside jit)."""
        return train_state.constrain(self, state)

    _ema_target = staticmethod(sharded_ema.target)  # what the EMA averages

    # -- the EMA (jaxzero.ema.ema) --------------------------------------------------------------
    def ema_specs(self, ema_tree):
        """Specs of an EMA tree in its storage (per leaf, or bucketed ``[N, L_g]`` rows)."""
        return sharded_ema.specs(self, ema_tree)

    def bucket_ema(self, ema: ShardedEMA, ema_state: EmaState) -> EmaState:
        """``ema_state`` in ``ema``'s storage for this mesh and stage (local, no communication);
        the inverse is :func:`jaxzero.unbucket_ema`."""
        return sharded_ema.bucket(self, ema, ema_state)

    def update_ema(self, ema: ShardedEMA, ema_state: EmaState, master, *, step, apply):
        """The EMA update as a ``shard_map`` over the EMA's shards: provably local."""
        return sharded_ema.update_on_shards(self, ema, ema_state, master, step=step, apply=apply)

    # -- the update, under jit (jaxzero.train.update) -----------------------------------------
    def master_view(self, state: TrainState):
        """The master weights in their shards."""
        return train_update.master_view(self, state)

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
        if state.model_state is not None and model_state is not None:
            # the new model state, checked before the update (and its EMA) keeps it (a step's
            # loss checks its own: jaxzero.train.loss)
            check_same_structure(state.model_state, model_state, "model_state")
        plan, layout = self.plan(state.params), train_state.state_layout(self, state)
        return train_update.apply_gradients(
            self, state, grads, plan=plan, layout=layout, ema=ema, model_state=model_state
        )
