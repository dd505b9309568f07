"""``ZeRO``: any optax transformation, with its state sharded over the data axis."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxzero.ema import storage as eb
from jaxzero.ema.ema import EmaState, ShardedEMA, check_same_structure, check_same_tree
from jaxzero.mesh import check_mesh
from jaxzero.precision import (
    DynamicLossScale,
    Precision,
    StaticLossScale,
    check_loss_scale,
)
from jaxzero.train.state import TrainState
from jaxzero.zero import specs as sh

STAGES = (0, 1, 2, 3)


def _paths(tree):
    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_params(params) -> None:
    """Every trainable leaf must be a floating array; list every offender otherwise."""
    bad = []
    for path, leaf in _paths(params):
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
    if not _paths(params):
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
    param_paths = {
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    shared = [
        jax.tree_util.keystr(k)
        for k, _ in jax.tree_util.tree_flatten_with_path(model_state)[0]
        if jax.tree_util.keystr(k) in param_paths
    ]
    if shared:
        raise ValueError(
            f"model_state leaves {shared[:5]} have the same paths as trainable params; the "
            f"optimizer would see them twice. Keep non-trainable state out of params."
        )


def to_varying(x, axes):
    """``pcast`` ``x`` to device-varying over those of ``axes`` it is not yet varying over."""
    varying = jax.typeof(x).manual_axis_type.varying
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


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


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


@dataclasses.dataclass(frozen=True)
class ZeRO:
    """ZeRO stage 0-3 sharding around any ``optax.GradientTransformation``.

    | stage | compute params | reduced gradients | master + optimizer state | EMA |
    |---|---|---|---|---|
    | 0 | replicated | all-reduced, replicated | replicated | sharded |
    | 1 | replicated | all-reduced, sliced | sharded 1/N | sharded |
    | 2 | replicated | reduce-scattered, 1/N | sharded 1/N | sharded |
    | 3 | sharded 1/N, gathered for use | reduce-scattered | sharded 1/N | sharded |

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
      layers: names of the params subtrees that hold scanned layer stacks (``nn.scan`` puts
        the layer index on axis 0 of every leaf), e.g. ``"layers"``. Those leaves, and the
        optimizer-state and EMA leaves that mirror them, are never split along axis 0. With
        stage 3 the step then gathers the stacks one layer at a time: the loss sees them as
        shards and the model gathers each layer with :func:`jaxzero.gather_layer` inside its
        scanned, rematerialised block (peak memory: one layer's weights, not the model's).

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
        layers = self.layers
        if layers is None:
            layers = ()
        elif isinstance(layers, str):
            layers = (layers,)
        if not isinstance(layers, tuple | list) or not all(
            isinstance(k, str) and k for k in layers
        ):
            raise TypeError(
                f"layers={self.layers!r} must name the params subtrees holding scanned layer "
                f"stacks, e.g. layers='layers' or layers=('encoder', 'decoder')."
            )
        object.__setattr__(self, "layers", tuple(layers))
        precision = self.precision
        if precision is None:
            precision = Precision()
        elif isinstance(precision, str):
            precision = Precision.create(precision)
        elif not isinstance(precision, Precision):
            raise TypeError(
                f"precision={precision!r} must be a jaxzero.Precision or 'fp32'/'bf16'/'fp16'."
            )
        object.__setattr__(self, "precision", precision)
        check_loss_scale(self.loss_scale, precision)

    # -- mesh facts -------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """N, the size of the data axis the state is split over."""
        return self.mesh.shape[self.axis]

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes the batch is split over (all of them; the data axis last)."""
        return tuple(a for a in self.mesh.axis_names if a != self.axis) + (self.axis,)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.mesh.axis_names if a != self.axis)

    @property
    def num_batch_shards(self) -> int:
        return int(self.mesh.size)

    def batch_spec(self) -> P:
        axes = self.batch_axes
        return P(axes if len(axes) > 1 else axes[0])

    # -- the sharding rule ------------------------------------------------------------------
    def _specs(self, tree, shard: bool):
        return sh.tree_specs(tree, self.num_shards, self.axis, shard=shard, stacked=self.layers)

    @property
    def per_layer(self) -> bool:
        """Stage 3 with named layer stacks: parameters are gathered one layer at a time."""
        return self.stage == 3 and bool(self.layers)

    def _stacked_mask(self, tree):
        """True for the leaves of ``tree`` that belong to a named layer stack."""
        return jax.tree_util.tree_map_with_path(
            lambda path, _: sh.is_stacked(path, self.layers), tree
        )

    def check_layers(self, params) -> None:
        """Every name in ``layers`` must be a params subtree of arrays with a layer axis."""
        if not self.layers:
            return
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        for name in self.layers:
            leaves = [(p, x) for p, x in flat if sh.is_stacked(p, (name,))]
            if not leaves:
                top = list(params) if isinstance(params, dict) else type(params).__name__
                raise ValueError(
                    f"ZeRO(layers={self.layers!r}): params has no subtree named {name!r} "
                    f"(top-level keys: {top}); name the nn.scan'd module's params key."
                )
            scalars = [jax.tree_util.keystr(p) for p, x in leaves if not jnp.ndim(x)]
            if scalars:
                raise ValueError(
                    f"ZeRO(layers=...): {scalars[:5]} under {name!r} are scalars, not stacked "
                    f"per layer; a layer stack's leaves carry the layer index on axis 0."
                )

    def param_specs(self, params):
        """Specs of the compute params: sharded for stage 3, replicated otherwise."""
        return self._specs(params, self.stage == 3)

    def shard_specs(self, params):
        """Specs of the master/optimizer/gradient shards (sharded for stages 1-3)."""
        return self._specs(params, self.stage >= 1)

    def ema_specs(self, ema_tree):
        """Specs of an EMA tree: the per-leaf rule (always sharded), and ``P(axis)`` (rows) for
        the ``[N, L]`` bucket of a :class:`~jaxzero.ema.storage.BucketedTree`."""
        if isinstance(ema_tree, eb.BucketedTree):
            return eb.BucketedTree(self._specs(ema_tree.rest, True), P(self.axis), ema_tree.layout)
        return self._specs(ema_tree, True)

    def state_specs(self, state: TrainState) -> TrainState:
        """PartitionSpecs for every leaf of ``state`` (concrete or abstract)."""
        replicated = lambda t: jax.tree.map(lambda _: P(), t)
        return TrainState(
            step=P(),
            params=self.param_specs(state.params),
            master=None if state.master is None else self.shard_specs(state.master),
            opt_state=self._specs(state.opt_state, self.stage >= 1),
            skipped=P(),
            ema=None if state.ema is None else EmaState(P(), self.ema_specs(state.ema.ema)),
            loss_scale=None if state.loss_scale is None else replicated(state.loss_scale),
            model_state=None if state.model_state is None else replicated(state.model_state),
            rng=None if state.rng is None else P(),
        )

    def state_shardings(self, state: TrainState) -> TrainState:
        """NamedShardings for ``state`` (for ``jax.jit(in_shardings=, out_shardings=)``)."""
        return sh.named(self.mesh, self.state_specs(state))

    def constrain(self, state: TrainState) -> TrainState:
        """``with_sharding_constraint`` every leaf to its ZeRO sharding (inside jit)."""
        return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

    # -- init ---------------------------------------------------------------------------------
    def _init_raw(self, params, ema: ShardedEMA | None, model_state, rng) -> TrainState:
        pol = self.precision
        master_full = _cast(params, pol.master_dtype)
        master_view = jax.lax.with_sharding_constraint(
            master_full, sh.named(self.mesh, self.shard_specs(master_full))
        )
        master = master_view if pol.separate_master else None
        compute = _cast(params, pol.param_dtype)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=compute,
            master=master,
            opt_state=self.tx.init(master_view),
            skipped=jnp.zeros((), jnp.int32),
            ema=None
            if ema is None
            else self.bucket_ema(ema, ema.init(self._ema_target(master_view, model_state))),
            loss_scale=None if self.loss_scale is None else self.loss_scale.init(),
            model_state=model_state,
            rng=rng,
        )

    def bucket_ema(self, ema: ShardedEMA, ema_state: EmaState) -> EmaState:
        """``ema_state`` in ``ema``'s storage for this mesh: small float leaves in one
        ``[N, L]`` bucket when ``ema.bucket_leaves_up_to > 0``, per-leaf otherwise.

        Accepts either form (e.g. a per-leaf state from ``torch_interop.import_ema``, or a
        bucketed one with another threshold); the conversion is a local slice/concatenate
        per device, with no communication. The inverse is :func:`jaxzero.unbucket_ema`.
        """
        tree = ema_state.ema
        if isinstance(tree, eb.BucketedTree):
            tree = tree.layout.abstract()
        layout = eb.plan(tree, self.mesh, self.axis, ema.bucket_leaves_up_to)
        if isinstance(ema_state.ema, eb.BucketedTree) and ema_state.ema.layout == layout:
            return ema_state
        if layout is None and not eb.is_bucketed(ema_state):
            return ema_state
        return eb.bucket(ema_state, layout)

    @staticmethod
    def _ema_target(master, model_state):
        """What the EMA averages: the master weights, plus the model state when there is one
        (float buffers such as BatchNorm statistics are averaged, integer ones copied)."""
        if model_state is None:
            return master
        return {"params": master, "model_state": model_state}

    def abstract_state(self, params, *, ema=None, model_state=None, rng=None) -> TrainState:
        """The state's ShapeDtypeStructs, with shardings, without allocating anything."""
        rng = raw_key(rng)
        shapes = jax.eval_shape(
            lambda p, m, r: self._init_raw(p, ema, m, r), params, model_state, rng
        )
        shardings = self.state_shardings(shapes)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
        )

    def init(
        self, params, *, ema: ShardedEMA | None = None, model_state=None, rng=None
    ) -> TrainState:
        """Place the training state on the mesh.

        Works under ``jax.eval_shape`` (returns the abstract state). ``ema`` adds an
        :class:`EmaState` in the master's shards; ``model_state`` (non-trainable collections)
        and ``rng`` (a PRNG key) are stored replicated.

        Raises:
          TypeError: a params leaf is not a floating array (every offending path is listed).
        """
        check_params(params)
        check_model_state(params, model_state)
        self.check_layers(params)
        rng = raw_key(rng)
        if jax.process_count() > 1:
            from jaxzero.distributed import check_same_on_all_processes

            check_same_on_all_processes(params, "params")
            check_same_on_all_processes(model_state, "model_state")
            check_same_on_all_processes(rng, "rng")
        if ema is not None and not isinstance(ema, ShardedEMA):
            raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
        abstract = self.abstract_state(params, ema=ema, model_state=model_state, rng=rng)
        out = jax.tree.map(lambda x: x.sharding, abstract)
        fn = jax.jit(lambda p, m, r: self._init_raw(p, ema, m, r), out_shardings=out)
        return fn(params, model_state, rng)

    # -- pieces of a step ---------------------------------------------------------------------
    def master_view(self, state: TrainState):
        """The master weights in their shards (a local slice of ``params`` when no separate
        master copy is kept)."""
        if state.master is not None:
            return state.master
        specs = self.shard_specs(state.params)
        return jax.lax.with_sharding_constraint(state.params, sh.named(self.mesh, specs))

    def gather_params(self, local_params, specs):
        """Inside ``shard_map``: all-gather stage-3 parameter shards into full tensors.

        ``specs`` are the global params' specs (``param_specs(params)``, computed outside).
        """

        def gather(stacked, p_local, spec):
            d = sh.spec_dim(spec)
            if d is None or (stacked and self.per_layer):
                return p_local
            return jax.lax.all_gather(p_local, self.axis, axis=d, tiled=True)

        return jax.tree.map(gather, self._stacked_mask(local_params), local_params, specs)

    def all_gather(self, tree):
        """Replicate a tree of shards with one explicit ``all_gather`` per sharded leaf.

        Used for the stage-1/2 parameter gather after the update, so the collective moves
        exactly the compute dtype's bytes (the cast happens on the shard, before the gather).
        """
        specs = self.shard_specs(tree)

        def gather(x, spec):
            d = sh.spec_dim(spec)
            if d is None:
                return x
            return jax.lax.all_gather(x, self.axis, axis=d, tiled=True, to="invarying")

        return jax.shard_map(
            lambda t: jax.tree.map(gather, t, specs),
            mesh=self.mesh,
            in_specs=(specs,),
            out_specs=jax.tree.map(lambda _: P(), specs),
        )(tree)

    def grad_specs(self, params):
        """Specs of the reduced gradients: sharded for stages 2/3, replicated for 0/1."""
        return self._specs(params, self.stage >= 2)

    def params_for_loss(self, local_params, specs):
        """Inside ``shard_map``: the full compute params, ready to differentiate.

        Stage 3 shards are all-gathered; then every leaf is marked device-varying over the
        batch axes (``jax.lax.pcast``), so autodiff returns each device's local, unreduced
        gradient and the reduction is :meth:`reduce_gradients`'s, not an implicit ``psum``.
        With :attr:`per_layer`, the layer stacks stay shards (in ``output_dtype``, the dtype
        their gradients come back in): :func:`jaxzero.gather_layer` gathers them per layer
        and its backward reduces their gradients.
        """
        full = self.gather_params(local_params, specs)
        if not self.per_layer:
            return jax.tree.map(lambda x: to_varying(x, self.batch_axes), full)
        out_dtype = self.precision.output_dtype
        return jax.tree.map(
            lambda stacked, x: x.astype(out_dtype) if stacked else to_varying(x, self.batch_axes),
            self._stacked_mask(full),
            full,
        )

    def layer_plan(self, local_params, specs):
        """The :class:`~jaxzero.zero.layers.LayerPlan` of a per-layer stage-3 step (None
        otherwise): for each leaf of one layer, the dimension it is sharded on."""
        if not self.per_layer:
            return None
        from jaxzero.zero.layers import LayerPlan

        flat_specs = dict(
            jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]
        )
        dims = {}
        for path, x in jax.tree_util.tree_flatten_with_path(local_params)[0]:
            if not sh.is_stacked(path, self.layers):
                continue
            keys = sh.path_keys(path)
            start = next(i for i, k in enumerate(keys) if k in self.layers) + 1
            d = sh.spec_dim(flat_specs[path])
            dims[(keys[start:], tuple(x.shape[1:]))] = None if d is None else d - 1
        return LayerPlan(self, dims)

    def reduce_gradients(self, grads):
        """Inside ``shard_map``: average local gradients over every batch axis.

        Stages 0/1 all-reduce (``psum``) each leaf; stages 2/3 reduce-scatter
        (``psum_scatter(..., tiled=True)``) each shardable leaf along its shard dimension over
        the data axis (then ``psum`` over replica axes). Leaves are communicated in
        ``precision.reduce_dtype`` and returned in ``precision.output_dtype``, divided by the
        number of batch shards. With :attr:`per_layer` the layer stacks' gradients were
        already reduced layer by layer (by :func:`jaxzero.gather_layer`'s backward) and pass
        through.
        """
        specs = self.grad_specs(grads)

        def one(stacked, g, spec):
            if stacked and self.per_layer:
                return g
            return self.reduce_leaf(g, sh.spec_dim(spec))

        return jax.tree.map(one, self._stacked_mask(grads), grads, specs)

    def reduce_leaf(self, g, d):
        """Inside ``shard_map``, one leaf of :meth:`reduce_gradients`: reduce-scatter along
        dimension ``d`` over the data axis (then ``psum`` over replica axes), or all-reduce when
        ``d`` is None; communicated in ``reduce_dtype``, returned in ``output_dtype`` and
        divided by the number of batch shards."""
        pol = self.precision
        g = g.astype(pol.reduce_dtype)
        if d is None:
            g = jax.lax.psum(g, self.batch_axes)
        else:
            g = jax.lax.psum_scatter(g, self.axis, scatter_dimension=d, tiled=True)
            if self.replica_axes:
                g = jax.lax.psum(g, self.replica_axes)
        return g.astype(pol.output_dtype) / self.num_batch_shards

    def update_ema(self, ema: ShardedEMA, ema_state: EmaState, master, *, step, apply):
        """The EMA update as a ``shard_map`` over the EMA's shards: provably local.

        Each device updates only its own EMA shard from its own master shard; for stage 0
        (replicated master) it slices its part out of the local replica. No collective. A
        bucketed EMA (``ShardedEMA(bucket_leaves_up_to=...)``) concatenates the device's
        pieces of the small master leaves into one row and updates its bucket row in one
        elementwise loop; the big leaves are updated per leaf as usual.
        """
        layout = None
        if isinstance(ema_state.ema, eb.BucketedTree):
            layout = ema_state.ema.layout
            check_same_tree(layout.abstract(), master)
        else:
            check_same_tree(ema_state.ema, master)
        state_specs = EmaState(P(), self.ema_specs(ema_state.ema))
        # The per-leaf EMA specs: what each device's piece of the master must match.
        ema_specs = self._specs(master, True)
        if isinstance(master, dict) and set(master) == {"params", "model_state"}:
            master_specs = {
                "params": self.shard_specs(master["params"]),
                "model_state": jax.tree.map(lambda _: P(), master["model_state"]),
            }
        else:
            master_specs = self.shard_specs(master)
        n, axis = self.num_shards, self.axis

        def local(e_state, m_local, step, apply):
            def take(x, m_spec, e_spec):
                d = sh.spec_dim(e_spec)
                if d is None or sh.spec_dim(m_spec) is not None:
                    return x
                size = x.shape[d] // n
                return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * size, size, d)

            mine = jax.tree.map(take, m_local, master_specs, ema_specs)
            if layout is not None:  # the bucket's pieces, packed like the bucket row
                rest, small = eb.split(mine, layout)
                mine = eb.BucketedTree(rest, eb.pack_local(small, layout), layout)
            return ema.update(e_state, mine, step=step, apply=apply)

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(state_specs, master_specs, P(), P()),
            out_specs=state_specs,
        )(ema_state, master, step, apply)

    def apply_gradients(
        self, state: TrainState, grads, *, ema: ShardedEMA | None = None, model_state=None
    ):
        """The optax update on shards (call under ``jax.jit``, outside ``shard_map``).

        ``grads`` are the reduced gradients of the (scaled) loss, in any sharding; they are
        constrained to the master's shards, unscaled, checked for non-finite values (globally),
        and handed to the optax chain together with the master shards. Then
        ``master += updates``, the EMA is updated on the same shards, and the compute params are
        ``cast(master)`` all-gathered (stages 0-2) or left sharded (stage 3). With
        ``skip_nonfinite`` a non-finite step leaves every leaf unchanged.

        Returns:
          ``(new_state, metrics)`` with metrics ``grad_norm``, ``finite``, ``skipped``,
          ``loss_scale``.
        """
        mesh, pol = self.mesh, self.precision
        master = self.master_view(state)
        grads = jax.lax.with_sharding_constraint(
            _cast(grads, pol.output_dtype), sh.named(mesh, self.shard_specs(grads))
        )
        if state.loss_scale is not None:
            inv = 1.0 / state.loss_scale.scale
            grads = jax.tree.map(lambda g: g * inv.astype(g.dtype), grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, master)
        new_master = optax.apply_updates(master, updates)
        # Pin the update's outputs to their own shardings: otherwise GSPMD may propagate the
        # EMA's (sharded) layout backward into a stage-0 update and all-gather it afterwards.
        new_master = jax.lax.with_sharding_constraint(
            new_master, sh.named(mesh, self.shard_specs(new_master))
        )
        opt_state = jax.lax.with_sharding_constraint(
            opt_state, sh.named(mesh, self._specs(opt_state, self.stage >= 1))
        )
        apply = finite if self.skip_nonfinite else jnp.asarray(True)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
        new_master = keep(new_master, master)
        opt_state = keep(opt_state, state.opt_state)
        step = jnp.where(apply, state.step + 1, state.step)
        compute = _cast(new_master, pol.param_dtype)
        if self.stage in (1, 2):
            compute = self.all_gather(compute)
        new_params = keep(compute, state.params)
        new_ema = state.ema
        if state.ema is not None:
            if ema is None:
                raise ValueError(
                    "state has an EMA but no ShardedEMA was given to apply it; pass ema= to "
                    "make_train_step / apply_gradients."
                )
            target = new_master
            if state.model_state is not None:
                target = self._ema_target(new_master, keep(model_state, state.model_state))
            new_ema = self.update_ema(ema, state.ema, target, step=step, apply=apply)
        loss_scale = state.loss_scale
        if loss_scale is not None:
            loss_scale = self.loss_scale.update(loss_scale, finite)
        new_state = state.replace(
            step=step,
            params=new_params,
            master=new_master if state.master is not None else None,
            opt_state=opt_state,
            skipped=state.skipped + jnp.where(apply, 0, 1).astype(jnp.int32),
            ema=new_ema,
            loss_scale=loss_scale,
        )
        if state.model_state is not None and model_state is not None:
            check_same_structure(state.model_state, model_state, "model_state")
            new_state = new_state.replace(model_state=keep(model_state, state.model_state))
        metrics = {
            "grad_norm": grad_norm,
            "finite": finite,
            "skipped": new_state.skipped,
            "step": new_state.step,
        }
        if loss_scale is not None:
            metrics["loss_scale"] = loss_scale.scale
            metrics["loss_scale_at_min"] = jnp.logical_and(
                ~finite, self.loss_scale.at_minimum(state.loss_scale)
            )
        return self.constrain(new_state), metrics
