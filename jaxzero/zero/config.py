"""``ZeROConfig``: the ZeRO settings, checked, with the facts of their mesh.

The config is the low layer of :class:`jaxzero.ZeRO`: its fields and their validation, the
mesh facts and :class:`~jaxzero.zero.collectives.Comm`, the sharding rule's specs
(:mod:`jaxzero.zero.specs`), the placement of the state (:mod:`jaxzero.zero.offload`), the
features that hook into the loss (:mod:`jaxzero.zero.layers`, :mod:`jaxzero.zero.layers.vocab`,
:mod:`jaxzero.zero.units`) and what runs inside ``shard_map``
(:mod:`jaxzero.zero.collectives`). It imports nothing above ``zero/``: creating and updating
the training state is :class:`jaxzero.ZeRO`'s, in :mod:`jaxzero.train.optimizer`
(decision 34).

A config is the user's input, checked and in one spelling, and never rewritten: every
construction (``ZeRO(...)``, ``dataclasses.replace``) passes the arguments through
:func:`canonical` before the frozen dataclass stores them, ``__post_init__`` checks how they
combine, and the objects derived from them (:attr:`~ZeROConfig.placement`,
:attr:`~ZeROConfig.activations`, :attr:`~ZeROConfig.comm`, :attr:`~ZeROConfig.path`) are
built once, on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxzero.mesh import check_mesh, mesh_platform, warn_unnamed_replica_axes
from jaxzero.precision import DynamicLossScale, Precision, StaticLossScale, check_loss_scale
from jaxzero.trees import subtree_names
from jaxzero.zero import collectives
from jaxzero.zero import specs as sh
from jaxzero.zero.hooks import LossHook
from jaxzero.zero.layers import plan as layers
from jaxzero.zero.layers import vocab
from jaxzero.zero.offload import activations
from jaxzero.zero.offload import placement as offload
from jaxzero.zero.offload.fraction import check_fraction
from jaxzero.zero.offload.nvme_update import NVMe
from jaxzero.zero.path import GradientPath
from jaxzero.zero.units import patterns as units
from jaxzero.zero.wire import encodings as wire

STAGES = (0, 1, 2, 3)


def _stage(stage) -> int:
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(
            f"stage={stage!r} is not a ZeRO stage; use 0 (plain data parallel), "
            f"1 (shard optimizer state), 2 (+ shard gradients) or 3 (+ shard parameters)."
        )
    return stage


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


def canonical(given: dict[str, Any]) -> dict[str, Any]:
    """``ZeRO``'s arguments as the user spelled them, each checked, in the one form the
    config stores: ``layers``, ``vocab_parallel`` and ``units`` as tuples of names or
    patterns, ``precision`` a :class:`~jaxzero.precision.Precision`, ``prefetch`` a bool with
    ``units=`` (None without), ``quantize`` a :class:`~jaxzero.zero.wire.Wire` carrying
    ``hpz_partition_size``, ``offload`` None, ``"optimizer"`` or ``("optimizer", "params")``
    with ``"activations"`` moved to ``offload_activations`` and a :class:`NVMe` to ``nvme``,
    ``offload_fraction`` a float.
    Canonical input comes back unchanged, so ``dataclasses.replace`` round-trips.

    Args:
      given: every field of :class:`ZeROConfig`, by name.

    Returns:
      The fields to store, by name.
    """
    out = dict(given)
    stage = _stage(given["stage"])  # the other spellings are checked against it
    if not (hasattr(given["tx"], "init") and hasattr(given["tx"], "update")):
        raise TypeError(
            f"tx={given['tx']!r} is not an optax.GradientTransformation (needs init and update)."
        )
    check_mesh(given["mesh"], given["axis"])
    warn_unnamed_replica_axes(given["mesh"], given["axis"])
    out["layers"] = _layer_names(given["layers"])
    out["vocab_parallel"] = vocab.names(given["vocab_parallel"], stage)
    out["precision"] = _precision(given["precision"], stage)
    out["units"] = units.patterns(given["units"], stage, out["layers"])
    out["prefetch"] = units.prefetch_option(given["prefetch"], out["units"])
    out["quantize"] = wire.wire(given["quantize"], given["hpz_partition_size"])
    out["hpz_partition_size"] = out["quantize"].hpz
    spelled, out["nvme"] = _nvme(given["offload"], given["nvme"])
    state, acts = activations.split(spelled)
    out["offload"] = state = offload.check_offload(state, stage)
    out["offload_activations"] = acts or given["offload_activations"]
    fraction = given["offload_fraction"]
    out["offload_fraction"] = check_fraction(fraction, state, offload.params_offloaded(state))
    if out["nvme"] is not None and (state != offload.OPTIMIZER or out["offload_fraction"] != 1):
        raise ValueError(
            f"offload={given['offload']!r} with offload_fraction={fraction!r}: the NVMe tier "
            f"keeps the whole optimizer side (the fp32 master and the optax state) in its file "
            f"and the params on the device, so it takes offload=jz.NVMe(path) alone (no "
            f"'params', no 'remainder', offload_fraction 1)."
        )
    if given["offload_update"] == offload.DELAYED and given["delay_after"] is None:
        out["delay_after"] = 1  # the first step (nothing to delay), then delayed
    return out


def _nvme(spelled, nvme):
    """``(the offload spelling without the disk, the NVMe settings or None)``:
    ``offload=jz.NVMe(path)`` is stored as ``offload="optimizer"`` and ``nvme=NVMe(path)``."""
    if isinstance(spelled, NVMe):
        if nvme is not None and nvme != spelled:
            raise ValueError(
                f"offload={spelled!r} and nvme={nvme!r} name two NVMe settings; pass one, as "
                f"offload=jz.NVMe(path, ...)."
            )
        return offload.OPTIMIZER, spelled
    if nvme is not None and not isinstance(nvme, NVMe):
        raise TypeError(f"nvme={nvme!r} must be a jaxzero.NVMe(path, ...) or None.")
    if nvme is not None and spelled != offload.OPTIMIZER:
        raise ValueError(
            f"nvme={nvme!r} keeps the optimizer state on disk, and offload={spelled!r} does "
            f"not offload it; spell it offload=jz.NVMe(path, ...)."
        )
    return spelled, nvme


class _Canonical(type):
    """The metaclass of :class:`ZeROConfig`: every construction of one (``ZeRO(...)``,
    ``dataclasses.replace``, a subclass's) stores what :func:`canonical` makes of the
    arguments, so no field is rewritten after it is set."""

    def __call__(cls, *args, **kwargs):
        given = cls.__signature__.bind(*args, **kwargs)
        given.apply_defaults()
        return super().__call__(**canonical(given.arguments))

    @property
    def __signature__(cls) -> inspect.Signature:
        """The dataclass's parameters (what ``inspect.signature(ZeRO)`` shows), not those of
        :meth:`__call__`."""
        init = inspect.signature(cls.__init__)
        params = list(init.parameters.values())[1:]
        return init.replace(parameters=params, return_annotation=inspect.Signature.empty)


@dataclasses.dataclass(frozen=True)
class ZeROConfig(metaclass=_Canonical):
    """The settings of :class:`jaxzero.ZeRO` (its arguments are documented there), stored in
    their canonical form (:func:`canonical`), checked on construction, with their mesh facts
    and the sharding rule's specs."""

    tx: optax.GradientTransformation
    mesh: Mesh
    stage: int = 2
    axis: str = "data"
    precision: Any = None
    loss_scale: DynamicLossScale | StaticLossScale | None = None
    skip_nonfinite: bool = True
    layers: tuple[str, ...] | str | None = None
    vocab_parallel: tuple[str, ...] | str | None = None
    offload: str | tuple[str, ...] | None = None
    units: tuple[str, ...] | str | None = None
    prefetch: bool | None = None
    quantize: Any = None
    hpz_partition_size: int | None = None
    offload_fraction: float = 1.0
    offload_activations: bool = False  # set from offload=("activations", ...)
    nvme: NVMe | None = None  # set from offload=jz.NVMe(...): the optimizer state on disk
    #: None, or "deferred": with offload="optimizer" and layers=, the layer stacks' update is
    #: applied at the start of the next step (decision 51's staged path)
    offload_update: str | None = None
    #: with offload_update="delayed": the exact (deferred) steps before the delay, the first
    #: (which has nothing to delay) counted, so >= 1; None else
    delay_after: int | None = None

    def __post_init__(self):
        """How the canonical fields combine (each field alone was checked by :func:`canonical`)."""
        wire.check(self.quantize, self.stage)
        wire.check_hpz(self.quantize, self.stage, self.num_shards, self.layers, self.units)
        check_loss_scale(self.loss_scale, self.precision)
        self.placement  # noqa: B018 (checked here: host memory on this platform)
        exact = collectives.param_dtype_gradient_exact(self.comm)
        copy, defers = self.precision.separate_master, self.quantize.defers_reduce
        offload.check_params(
            self.offload, self.layers, self.units, exact, copy, defers, self.prefetch
        )
        self.activations  # noqa: B018 (checked here, before any state exists)
        offload.check_update(
            self.offload_update,
            self.offload,
            self.layers,
            self.offload_fraction,
            self.nvme,
            self.precision.separate_master,
            self.stage,
            self.delay_after,
        )
        if self.offload_activations:
            offload.check_platform(self.mesh)

    def __getstate__(self) -> dict[str, Any]:
        """The fields only: a copy builds its own derived objects (its :attr:`path` is its own)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @functools.cached_property
    def platform(self) -> str:
        """``"cpu"``, ``"gpu"`` or ``"mixed"``: the mesh's devices
        (:func:`jaxzero.mesh.mesh_platform`), which the EMA's default storage and the train
        step's pacing of simulated devices depend on."""
        return mesh_platform(self.mesh)

    @functools.cached_property
    def activations(self) -> activations.DeviceActivations:
        """Where per-layer stage 3 keeps the layer inputs saved for the backward: device
        memory, or pinned host memory with ``offload=("activations", ...)``
        (:mod:`jaxzero.zero.offload.activations`)."""
        return activations.check(self.offload_activations, self.stage, self.layers, self.units)

    @functools.cached_property
    def placement(self) -> offload.DeviceMemory:
        """Where the master, the optimizer state and the EMA live and are updated: device
        memory, or pinned host memory with ``offload`` (:mod:`jaxzero.zero.offload`)."""
        return offload.placement(
            self.offload,
            self.stage,
            self.mesh,
            self.offload_fraction,
            self.offload_update,
            self.delay_after,
        )

    def offloaded(self) -> tuple[str, ...]:
        """What the state's ``offload`` moves to pinned host memory, as names (``()``,
        ``("optimizer",)``, ``("optimizer", "params")``): the checkpoint metadata's record.

        Returns:
          The names, without ``"activations"`` (:attr:`offload_activations`).
        """
        state = self.offload
        return () if not state else (state,) if isinstance(state, str) else tuple(state)

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

    @functools.cached_property
    def comm(self) -> collectives.Comm:
        """What the collectives inside ``shard_map`` need to know (axes, sizes, dtypes)."""
        return collectives.Comm.create(
            self.axis,
            self.batch_axes,
            self.replica_axes,
            self.num_batch_shards,
            self.precision,
            self.quantize,
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

    def grad_specs(self, params, stage: int | None = None):
        """Specs of the reduced gradients: sharded for stages 2/3, replicated for 0/1.
        ``stage``: the stage whose reduction runs (a training step's
        :attr:`GradientPath.stage <jaxzero.zero.path.GradientPath.stage>`); the config's by
        default."""
        return self._specs(params, (self.stage if stage is None else stage) >= 2)

    def ema_leaf_specs(self, tree):
        """Specs of a per-leaf EMA tree (always sharded, at every stage)."""
        return self._specs(tree, True)

    def check_layers(self, params) -> None:
        """``layers`` name params subtrees of arrays with a layer axis; ``units`` match paths."""
        layers.check_layers(params, self.layers, self.stage)
        units.check(params, self.units)

    def quantized_leaves(self, params) -> wire.WireReport:
        """Which leaves the ``quantize=`` wire encodes, which stay exact (``fell_back``),
        and the bytes of one gather and one reduction of every leaf, quantized and exact."""
        item = lambda dtype: np.dtype(dtype).itemsize
        p = self.precision
        sizes = (self.num_shards, item(p.param_dtype), item(p.reduce_dtype))
        return wire.report(self.quantize, params, self.grad_specs(params), *sizes)

    # -- inside shard_map (jaxzero.zero.path) ---------------------------------------------------
    @functools.cached_property
    def path(self) -> GradientPath:
        """The gathers, loss hooks and gradient reductions of a step (:mod:`jaxzero.zero.path`):
        what the training step asks inside its ``shard_map``."""
        return GradientPath(self)

    def gather_params(self, local_params, specs):
        """All-gather stage-3 parameter shards (``specs``: ``param_specs(params)``)."""
        return self.path.gather_params(local_params, specs)

    def params_for_loss(self, local_params, specs):
        """The full compute params, marked device-varying, ready to differentiate
        (:meth:`GradientPath.params_for_loss <jaxzero.zero.path.GradientPath.params_for_loss>`)."""
        return self.path.params_for_loss(local_params, specs)

    def loss_hooks(self, local_params, specs) -> list[LossHook]:
        """The features that hook into this step's loss: ``vocab_parallel=``, ``layers=`` and
        ``units=``, each where it acts (:mod:`jaxzero.zero.hooks`)."""
        return self.path.loss_hooks(local_params, specs)

    def reduce_gradients(self, grads, hooks=()):
        """Average local gradients over every batch axis (all-reduce or reduce-scatter);
        ``hooks``: the step's :meth:`loss_hooks`."""
        return self.path.reduce_gradients(grads, hooks)

    # -- under jit ------------------------------------------------------------------------------
    def all_gather(self, tree):
        """Replicate a tree of shards with one explicit ``all_gather`` per sharded leaf."""
        return collectives.all_gather(self.mesh, self.axis, tree, self.shard_specs(tree))
