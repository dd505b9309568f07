"""Where the optimizer's state lives: the placement objects the training step asks (device
memory, or pinned host memory for offload), their shardings, and where the update runs
(decisions 32 and 34).

``ZeRO(offload="optimizer")`` keeps the fp32 master (when separate from the compute params),
the optimizer state and the EMA in the host memory of each device (``memory_kind=
"pinned_host"``), in the same shards as without offload. The optax and EMA updates run on the
host (``compute_on("device_host")`` around a ``jax.jit`` of the update), so the device never
holds the state: it sends the reduced gradient shards to the host and gets the new compute
params (``param_dtype``) back.

With ``offload=("optimizer", "remainder")`` the fp32 master is kept on the host as a 16-bit
remainder and a carry bit beside the bf16 compute params (:mod:`.remainder`, decision 47):
2.125 bytes per param instead of 4 on the host and each way over PCIe, bit-identical steps.
The update joins it on the device and splits the new master there (:mod:`.stream`).

Two traps of jax 0.10 are handled here. Compile-only devices (``jaxzero.gpu``) report no
memories, and a ``NamedSharding`` on their concrete mesh silently drops ``memory_kind``: host
shardings for them are built on ``mesh.abstract_mesh`` (lower under ``jax.set_mesh(mesh)``,
as :func:`jaxzero.gpu.compile_report` does), and every host sharding is checked to carry
``"pinned_host"`` before it is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero.zero.offload.parts as stream_parts
import jaxzero.zero.offload.remainder as remainder
import jaxzero.zero.offload.stream as stream
from jaxzero.mesh import in_host_memory
from jaxzero.zero import specs as sh
from jaxzero.zero.offload.fraction import check_fraction, host_leaves
from jaxzero.zero.offload.packed import PackedRows

OPTIMIZER, PARAMS = "optimizer", "params"
#: with ``"optimizer"``: the host keeps the fp32 master as a 16-bit remainder and a carry bit
REMAINDER = "remainder"
#: what ``offload=`` takes for the state, normalised: the optimizer side, or it and the params
#: (either with ``REMAINDER`` last)
OFFLOADS = (OPTIMIZER, (OPTIMIZER, PARAMS))
HOST = "pinned_host"


def check_offload(offload, stage) -> str | tuple[str, str] | None:
    """``offload`` checked against ``stage`` (an int, or the stages a plan or a table covers):
    None, ``"optimizer"`` or ``("optimizer", "params")`` (in either order, or the string
    ``"optimizer,params"``), returned normalised. The one check of the offload choices:
    ``ZeRO``, :func:`jaxzero.estimate_memory`, ``jaxzero.gpu.plan`` and ``jaxzero plan`` call
    it; what parameter offload needs of the rest of the configuration is
    :func:`check_params`'s."""
    if offload is None:
        return None
    if isinstance(offload, str) and "," in offload:
        offload = tuple(x.strip() for x in offload.split(","))
    if isinstance(offload, tuple | list) and REMAINDER in offload:
        rest = tuple(x for x in offload if x != REMAINDER)
        base = check_offload(rest[0] if len(rest) == 1 else rest, stage)
        if base is None or len(rest) + 1 != len(offload):
            raise ValueError(
                f"offload={offload!r}: 'remainder' keeps the offloaded fp32 master as a 16-bit "
                f"remainder, so it goes with 'optimizer' (once), e.g. offload=('optimizer', "
                f"'remainder')."
            )
        if params_offloaded(base):
            raise ValueError(
                f"offload={offload!r}: the remainder master is rebuilt from the bf16 params, "
                "and with the params offloaded the backward writes the stacks' gradients into "
                "their buffers. Use offload=('optimizer', 'remainder') or ('optimizer', "
                "'params')."
            )
        return (OPTIMIZER, REMAINDER)
    if isinstance(offload, tuple | list) and sorted(offload) == [OPTIMIZER, PARAMS]:
        offload = (OPTIMIZER, PARAMS)
    if offload not in OFFLOADS:
        hint = ""
        if offload in (PARAMS, "param", (PARAMS,)):
            hint = (
                " Parameter offload keeps the optimizer side on the host too (it is the larger "
                "part): use offload=('optimizer', 'params')."
            )
        raise ValueError(
            f"offload={offload!r} is not supported; use None (state in device memory), "
            f"'optimizer' (fp32 master, optimizer state and EMA in pinned host memory: "
            f"DeepSpeed's offload_optimizer) or ('optimizer', 'params') (the 16-bit params "
            f"too, fetched a layer at a time: offload_param).{hint}"
        )
    stages = tuple(stage) if isinstance(stage, tuple | list) else (stage,)
    if 0 in stages:
        got = f"stage={stage}" if len(stages) == 1 else f"stages={stages}"
        raise ValueError(
            f"offload={offload!r} needs stage 1, 2 or 3 (got {got}): at stage 0 every device "
            "holds the whole optimizer state and would update all of it on its host. Use "
            "stage=1 (same communication as stage 0, the state sharded 1/N) with offload."
        )
    if params_offloaded(offload) and set(stages) - {3}:
        raise ValueError(
            f"offload={offload!r} needs stage=3 (got stage(s) {stages}): below stage 3 every "
            "device holds whole params for the step. Use stage=3 with layers=."
        )
    return offload


#: ``offload_update=`` values: None (the update after the backward), the staged path of
#: decision 51 (the layer stacks' update applied at the start of the next step), or its
#: delayed variant (ZeRO-Offload's DPU: the next step's gradient taken before that update)
DEFERRED = "deferred"
DELAYED = "delayed"


def check_update(
    update, offload, layers, fraction, nvme, separate_master, stage=3, delay_after=None
) -> str | None:
    """``offload_update`` checked against the checked ``offload``, ``layers``,
    ``offload_fraction``, ``nvme``, whether the precision keeps a separate master, ``stage``
    and ``delay_after``: None, ``"deferred"`` or ``"delayed"``. Both need the whole optimizer
    side in pinned host memory, a separate fp32 master and layer stacks, the only state
    whose update they defer; ``"delayed"`` also needs stage 3, where the forward's layer loop
    runs the rows, and takes ``delay_after``, the exact steps before the delay (an int >= 1:
    the first step has nothing pending to delay, so it is always exact)."""
    if delay_after is not None and update != DELAYED:
        raise ValueError(
            f"delay_after={delay_after!r} counts the exact steps before a delayed update, and "
            f"offload_update={update!r} delays nothing, so it would change nothing. Use "
            f"offload_update='delayed' with it, or drop delay_after."
        )
    if update is None:
        return None
    if update not in (DEFERRED, DELAYED):
        raise ValueError(
            f"offload_update={update!r} is not supported; use None (the update after the "
            f"backward), 'deferred' (the layer stacks' update applied at the start of the "
            f"next step, decision 51) or 'delayed' (that update applied beside the next "
            f"step's forward, whose gradient is taken before it: ZeRO-Offload's DPU)."
        )
    fix = f"or drop offload_update={update!r}."
    if offload != OPTIMIZER or nvme is not None or fraction != 1:
        raise ValueError(
            f"offload_update={update!r} defers the layer stacks' update of the optimizer state "
            f"in pinned host memory; it is built for offload='optimizer' with "
            f"offload_fraction=1 (got offload={offload!r}, offload_fraction={fraction!r}"
            f"{', NVMe' if nvme is not None else ''}). Use offload='optimizer', {fix}"
        )
    if not layers:
        raise ValueError(
            f"offload_update={update!r} defers the update of the layer stacks (layers=), and "
            "this configuration names none, so it would change nothing. Name the stacks with "
            f"layers=, {fix}"
        )
    if not separate_master:
        raise ValueError(
            f"offload_update={update!r} defers the update of the fp32 master kept apart from "
            "the compute params, and this precision keeps none (the params are the master), "
            f"so it would change nothing. Use precision='bf16', {fix}"
        )
    if update == DELAYED:
        if stage != 3:
            raise ValueError(
                f"offload_update='delayed' runs the pending update inside jaxzero.scan_layers' "
                f"forward loop beside compute that does not wait for it, which needs stage 3 "
                f"with layers= (got stage={stage}). Use stage=3, or offload_update='deferred'."
            )
        if isinstance(delay_after, bool) or not isinstance(delay_after, int) or delay_after < 1:
            raise ValueError(
                f"delay_after={delay_after!r} must be an int >= 1: the exact steps before the "
                f"update is delayed, the first counted (it has nothing pending to delay, so "
                f"1, the default, delays from the second step)."
            )
    return update


def params_offloaded(offload) -> bool:
    """Whether a checked ``offload`` keeps the params in host memory."""
    return isinstance(offload, tuple) and PARAMS in offload


def check_params(
    offload, layers, units, exact: bool, compute_copy: bool, defers: bool, prefetch=True
) -> None:
    """Refuse parameter offload where nothing would fetch the params a layer at a time: it
    needs the layer stacks of ``layers=`` run by :func:`jaxzero.scan_layers`, whose backward
    writes each layer's gradient into that layer's own host slot, or ``units=`` with
    ``prefetch`` (the unit chain fetches each unit where it gathers it; decision 42) (``exact``: the stacks'
    gradients are exact in ``param_dtype``; ``compute_copy``: the params are a 16-bit copy
    apart from the master, which the update does not read; ``defers``: the wire reduces a
    layer's gradient an iteration later)."""
    if not params_offloaded(offload):
        return
    fix = "or offload='optimizer' (the params stay on the device)."
    if units and not prefetch:
        raise ValueError(
            f"offload={offload!r} with units= fetches each unit's params from host memory in "
            f"the prefetching chain of units (prefetch=True, the default); prefetch=False runs "
            f"each unit as its own checkpointed segment, which is not built for it. Drop "
            f"prefetch=False, {fix}"
        )
    if not (layers or units):
        raise ValueError(
            f"offload={offload!r} fetches each layer's params from host memory where stage 3 "
            f"gathers it, a layer (layers=) or a unit (units=) at a time; this configuration "
            f"has no layers= and no units=. Use stage=3 with layers= and jaxzero.scan_layers "
            f"in the model, or units= naming its blocks, {fix}"
        )
    if not (exact and compute_copy):
        raise ValueError(
            f"offload={offload!r} writes each layer's gradient into its 16-bit params' host "
            "buffer, so it needs a 16-bit compute copy apart from the fp32 master (the "
            "update reads the master, not the params; Precision(compute_copy=True)) and a "
            "gradient exact in param_dtype: reduce_dtype equal to param_dtype and a "
            f"power-of-two number of devices. Use precision='bf16' on 2^k devices, {fix}"
        )
    if defers:
        raise ValueError(
            f"offload={offload!r} is not built with quantized gradients (quantize='grads' or "
            f"'both'), whose reduction is deferred a layer. Use quantize='weights' or None, {fix}"
        )


def leaf_columns(zero, rows, owners, sizes, accum_steps: int) -> tuple[list[dict], list[str]]:
    """The per-leaf plan's columns ``offload=`` decides (:mod:`jaxzero.zero.plan`):
    ``memory`` of each params row (its master, optimizer-state and EMA leaves: ``owners``,
    the row of each such leaf in :meth:`HostMemory.state_shardings`' order, None for a leaf that
    mirrors no parameter; ``sizes``: their bytes per device), ``params_memory``, and
    ``grads_memory`` and ``accumulate`` (a stack's or unit's gradient lands in host memory,
    summed into a host accumulator over micro-batches), with ``host_state_bytes`` (the row's
    optimizer-side bytes on the host), and ``layout``: ``"packed_rows"`` where the next
    forward runs a pending update (``offload_update="deferred"``, stage 3 per layer; with
    micro-batches, the first one's forward) from the stack's state packed one row per layer (a stacked leaf the update
    streams in rows: more than ``parts.SMALL`` elements); and where each leaf owned by no row
    lives."""
    where = zero.placement
    if not zero.offload:
        return [{} for _ in rows], ["device"] * sum(o is None for o in owners)
    flags = host_leaves(sizes, where.fraction)
    per_row: list[set] = [set() for _ in rows]
    on_host = [0] * len(rows)
    other = []
    for owner, on, size in zip(owners, flags, sizes, strict=True):
        if owner is None:
            other.append(HOST if on else "device")
        else:
            per_row[owner].add(on)
            on_host[owner] += size if on else 0
    kind = lambda s: HOST if s == {True} else "device" if s <= {False} else "split"
    packs = where.defers and zero.per_layer
    columns = []
    for row, s, host in zip(rows, per_row, on_host, strict=True):
        cols = {"memory": kind(s), "host_state_bytes": host}
        if packs and row["layer_axis"] and stream_parts.large(row["shape"]):
            cols["layout"] = "packed_rows"
        if where.params_on_host:
            cols["params_memory"] = HOST
            fetched = row["gather"] == "per_layer" or row["gather"].startswith("unit:")
            if fetched:  # its gradient goes back into host memory where it was fetched
                cols["grads_memory"] = HOST
            if accum_steps > 1 and fetched:
                cols["accumulate"] = "host_sum"
        columns.append(cols)
    return columns, other


def remainder_master(offload) -> bool:
    """Whether a checked ``offload`` keeps the host's fp32 master as a remainder."""
    return isinstance(offload, tuple) and REMAINDER in offload


def placement(
    offload, stage: int, mesh: Mesh, fraction=1.0, update=None, delay_after=None
) -> DeviceMemory | HostMemory:
    """The placement of ``ZeRO(offload=offload, offload_fraction=fraction,
    offload_update=update)`` (``update`` already checked by :func:`check_update`):
    :func:`check_offload` and :func:`~jaxzero.zero.offload.fraction.check_fraction`, then
    :func:`check_platform` when offloading."""
    offload = check_offload(offload, stage)
    fraction = check_fraction(fraction, offload, params_offloaded(offload))
    kept = remainder_master(offload)
    if kept and fraction < 1:
        raise ValueError(
            f"offload={offload!r} with offload_fraction={fraction:g}: the remainder master is "
            "built for the whole optimizer side on the host. Use offload_fraction=1, or drop "
            "'remainder'."
        )
    if offload:
        check_platform(mesh)
        return HostMemory(
            params=params_offloaded(offload),
            fraction=fraction,
            remainder=kept,
            defers=update is not None,
            delay_after=delay_after if update == DELAYED else None,
        )
    return DeviceMemory()


class DeviceMemory:
    """The master, the optimizer state and the EMA in device memory, updated there (no
    offload). Each method is the device side of a question the training step asks its
    placement; :class:`HostMemory` answers the same questions for offload."""

    #: whether the step builds the loss's params from the master (stage 3 with a separate
    #: master: decision 22) where it can; the host's master is out of the device's reach
    master_on_device = True
    #: whether the compute params live in host memory (``offload=("optimizer", "params")``)
    params_on_host = False
    #: whether the update runs leaf by leaf on each device's shards (streamed: decision 32), so
    #: the EMA's update is local too and needs no ``shard_map`` of its own
    update_is_local = False
    #: whether the host keeps the fp32 master as a remainder beside the bf16 params
    remainder = False
    #: whether the layer stacks' update is left pending for the next step
    #: (``offload_update="deferred"``, decision 51)
    defers = False
    #: the exact steps before the pending update is delayed (``offload_update="delayed"``),
    #: else None
    delay_after = None

    @property
    def delays(self) -> bool:
        """Whether the pending update is delayed once ``delay_after`` exact steps are taken
        (``offload_update="delayed"``): the next step's gradient is taken before it."""
        return self.delay_after is not None

    @property
    def optimizer_side_whole(self) -> bool:
        """Whether the whole optimizer side (the fp32 master as it is, the optimizer state,
        the EMA) and nothing else lives in host memory: ``offload="optimizer"`` at fraction 1,
        what the NVMe tier pages to disk instead."""
        return False

    def stored_master(self, zero, master, params):
        """The state's ``master`` as the placement keeps it: the fp32 tree itself, or (with
        :attr:`remainder`) each leaf that :func:`~.remainder.storable` admits and that the
        streamed update runs in chunks (more than :data:`~.parts.SMALL` elements) as a
        :class:`~.remainder.Remainder` packed row by row beside its bf16 compute copy
        (``params``' leaf in the master's shards, which must be ``master``'s cast).

        Args:
          zero: the step's ZeRO config.
          master: the fp32 master tree, in its shards.
          params: the compute params (unused without :attr:`remainder`).

        Returns:
          The master tree as the state holds it.
        """
        return master

    def state_shardings(self, mesh: Mesh, state, specs):
        """Where this placement keeps ``state`` (a TrainState of arrays, tracers or
        ShapeDtypeStructs; ``specs``: its PartitionSpecs): ``(host, shardings)``, ``host`` the
        ``(master, opt_state, ema)`` trees of bools, True where the leaf lives in host memory,
        and ``shardings`` the NamedShardings of ``params``, ``master``, ``opt_state`` and
        ``ema`` (by name; a component that is None stays None)."""
        flag = lambda t: None if t is None else jax.tree.map(lambda _: False, t)
        host = flag(state.master), flag(state.opt_state), flag(state.ema)
        named = lambda t: None if t is None else sh.named(mesh, t)
        parts = ("params", "master", "opt_state", "ema")
        return host, {k: named(getattr(specs, k)) for k in parts}

    def fetch(self, x):
        """``x`` (a param shard, or one layer's slice of a stack, inside ``shard_map``) in
        device memory, where the loss computes with it."""
        return x

    def constrain(self, tree, shardings):
        """``tree`` (inside jit) in ``shardings``."""
        return jax.lax.with_sharding_constraint(tree, shardings)

    # The optax update's outputs pinned to their shardings: otherwise GSPMD may propagate the
    # EMA's (sharded) layout backward into a stage-0 update and all-gather it.
    pin = constrain

    def run_update(
        self,
        zero,
        update,
        state,
        master,
        grads,
        *rest,
        specs,
        host,
        grads_in_params=True,
        defer=False,
    ):
        """``update(state, master, grads, *rest)`` where the state lives: here (``zero``: the
        step's ZeRO config; ``specs``: the arguments' PartitionSpecs, ``host``: the state's
        :meth:`state_shardings`' flags, ``grads_in_params``: whether the host gradients sit in the
        params' buffers, and ``defer``: whether the layer stacks' update is left for later,
        which only the host placement reads or does)."""
        if defer:
            raise ValueError(
                "the deferred update (offload_update='deferred') leaves the layer stacks' "
                "update in host memory, and this state is in device memory: use "
                "offload='optimizer'."
            )
        return update(state, master, grads, *rest)

    def new_params(self, compute, params, keep):
        """The new compute params: ``compute`` where the step applied, ``params`` where not."""
        return keep(compute, params)


class HostMemory(DeviceMemory):
    """``offload="optimizer"`` (DeepSpeed's ``offload_optimizer``): the master (when separate
    from the compute params), the optimizer state and the EMA in pinned host memory, streamed
    through the device by the update (decision 32). With ``params=True``
    (``offload=("optimizer", "params")``, DeepSpeed's ``offload_param``) the 16-bit compute
    params too: the loss fetches each leaf, and each layer of a stack one layer ahead, and the
    stacks' gradients are written into their params' host buffers (decision 37)."""

    master_on_device = False
    update_is_local = True

    def __init__(
        self,
        params: bool = False,
        fraction: float = 1.0,
        remainder: bool = False,
        defers: bool = False,
        delay_after: int | None = None,
    ):
        self.params_on_host = params
        #: the share of the master, optimizer state and EMA bytes kept on the host (decision 43)
        self.fraction = fraction
        self.remainder = remainder
        self.defers = defers
        #: with ``offload_update="delayed"``: the exact steps before the delay (else None)
        self.delay_after = delay_after

    @property
    def optimizer_side_whole(self) -> bool:
        return not self.params_on_host and self.fraction == 1 and not self.remainder

    def stored_master(self, zero, master, params):
        if not self.remainder or master is None:
            return master
        pol = zero.precision
        if (pol.param_dtype, pol.master_dtype) != (jnp.bfloat16, jnp.float32):
            raise ValueError(
                f"offload={zero.offload!r} keeps the fp32 master as a 16-bit remainder beside "
                f"bf16 compute params, and the precision has param_dtype "
                f"{jnp.dtype(pol.param_dtype).name} and master_dtype "
                f"{jnp.dtype(pol.master_dtype).name}. Use precision='bf16' (or a Precision "
                f"with bfloat16 params and a float32 master), or drop 'remainder'."
            )
        specs = zero.shard_specs(master)
        named = sh.named(zero.mesh, specs)
        shards = jax.lax.with_sharding_constraint(params, named)

        def copy(m, c, s):
            # a small leaf (a bias, a norm's scale) is updated whole in the streamed update's
            # prologue, beside every other small leaf: it stays fp32 (a few bytes), and the
            # prologue's fusions, whose FMA contractions the EMA's rounding follows, stay as
            # they are
            big = math.prod(m.shape) > stream_parts.SMALL
            return c if big and remainder.storable(m.shape, s.shard_shape(m.shape)) else None

        return remainder.store(master, jax.tree.map(copy, master, shards, named))

    def state_shardings(self, mesh: Mesh, state, specs):
        """The master, optimizer state and EMA in pinned host memory: every leaf at
        ``fraction=1``, else the largest leaves (bytes per device) holding at least
        ``fraction`` of the three components' bytes
        (:func:`~jaxzero.zero.offload.fraction.host_leaves`); the params too with
        ``("optimizer", "params")``."""
        # where a leaf goes once its flag is known: the host's sharding, or the device's
        one = lambda s, h: host_sharding(mesh, s) if h else NamedSharding(mesh, s)
        where = lambda t, h: None if t is None else jax.tree.map(one, t, h, is_leaf=_is_spec)
        params = host_shardings if self.params_on_host else sh.named
        parts = (state.master, state.opt_state, state.ema)
        trees = (specs.master, specs.opt_state, specs.ema)
        leaves, treedef = jax.tree.flatten(parts)
        flat_specs = jax.tree.leaves(trees, is_leaf=_is_spec)
        sizes = [
            math.prod(NamedSharding(mesh, s).shard_shape(x.shape)) * x.dtype.itemsize
            for x, s in zip(leaves, flat_specs, strict=True)
        ]
        host = tuple(jax.tree.unflatten(treedef, host_leaves(sizes, self.fraction)))
        names = ("master", "opt_state", "ema")
        shardings = {
            "params": params(mesh, specs.params),
            **{k: where(t, h) for k, t, h in zip(names, trees, host, strict=True)},
        }
        return host, shardings

    def fetch(self, x):
        return jax.device_put(x, jax.memory.Space.Device) if self.params_on_host else x

    def constrain(self, tree, shardings):
        # device_put also moves a leaf to its memory kind (a constraint keeps the kind it has)
        return jax.device_put(tree, shardings)

    def pin(self, tree, shardings):
        return tree  # the streamed update placed each output where it belongs

    def run_update(
        self,
        zero,
        update,
        state,
        master,
        grads,
        *rest,
        specs,
        host,
        grads_in_params=True,
        defer=False,
        packed=None,
        pack=False,
    ):
        """``update`` streamed through the device (:mod:`jaxzero.zero.offload.stream`): the state is
        fetched from host memory a chunk at a time and each chunk's result written back into
        the state's own buffers. The finite flag and the norm (``update``'s last outputs)
        stay on the device, and so do the new compute shards before them, unless the params
        are on the host: then each is written into the buffer its old one leaves (a stack's
        into its gradient's, which the backward wrote into the stack's: decision 37).
        ``specs``: the PartitionSpecs of ``(state, master, grads, *rest)``, the state without
        its params and master (the update reads ``master``), the master's per params leaf (a
        stored master's leaf is streamed in its lo's shards, its params leaf's); ``host``: the
        state's :meth:`state_shardings` flags (a stored master's flagged as its lo).
        ``grads_in_params=False``: the host gradients are accumulators apart from the params
        (micro-batches: decision 42), and the new params go back into the params' own
        buffers. ``defer=True`` (``ZeRO(offload_update="deferred")``, decision 51): the
        parts of the layer stacks' state are left undone (``stream.run(..., defer=)``), and
        the call returns ``(outputs, pending, rows, packed)``: the outputs with those state
        leaves unchanged and their compute leaves None, what :meth:`run_pending` reads, the
        flat params leaves whose compute rows it gives, and ``(buffers, layout, leaves)``:
        the :class:`~jaxzero.zero.offload.packed.PackedRows` buffers and layout of the state
        leaves the rows rewrite and those leaves (as the outputs pass them through, stale),
        the buffers ``packed`` when given (the forward's loop wrote the rows there), else
        packed from the leaves with ``pack=True`` (``(None, None, ())`` without, or when
        they cannot be packed)."""
        fn, args, kw = self._streamed(
            zero,
            update,
            state,
            master,
            grads,
            *rest,
            specs=specs,
            host=host,
            grads_in_params=grads_in_params,
        )
        if not defer:
            return stream.run(fn, args, **kw)
        defer = _stacked(zero, args, kw["host"])
        outs, pending = stream.run(fn, args, defer=defer, **kw)
        compute = jax.tree.leaves(outs[3], is_leaf=lambda x: x is None)
        rows = tuple(j for j, x in enumerate(compute) if x is None)
        if packed is None and not pack:
            return outs, pending, rows, (None, None, ())
        flat = jax.tree.leaves(args, is_leaf=remainder.is_stored)
        packs = _packs(flat, defer)
        held, specs = [flat[i] for i in packs], [kw["specs"][i] for i in packs]
        layout = PackedRows.of(zero.mesh, held, specs)
        if layout is None:
            return outs, pending, rows, (None, None, ())
        # in pinned host memory, as the next step reads them (whatever a shard_map's output
        # reports as its memory kind)
        where = host_sharding(zero.mesh, layout.spec)
        if packed is None:
            packed = layout.packed(held, specs)
        packed = tuple(jax.device_put(x, where) for x in packed)
        return outs, pending, rows, (packed, layout, tuple(held))

    def run_pending(self, zero, update, state, *args, **kw):
        """The layer stacks' rows that :meth:`run_update` with ``defer=True`` left undone,
        applied a layer at a time (``stream.run_rows`` in a loop over the layers): the same
        arguments as that call (``master``, ``grads`` and the rest positional, ``specs``,
        ``host`` and ``grads_in_params`` by keyword; ``grads`` and the rest may be
        ShapeDtypeStructs: what ``pending`` carries is read instead), with ``state`` and
        ``master`` as they are now, and the keywords ``pending`` (what that call left) and
        ``rows`` (the flat params leaves whose compute rows it gives).

        Returns:
          ``(state, master, compute)``: ``state`` (the update's first argument) and
          ``master`` with the rows written into their host leaves, and the new compute
          params of the flat params leaves ``rows``, each a stack in the master's shards.
        """
        r = self._rows(zero, update, state, *args, **kw)
        if r.layout is not None:  # the rows in optax's tree first, then as unpacked
            flat, packs, leaves, specs = list(r.flat), r.packs, r.leaves(), r.leaf_specs()
            for k, x in zip(packs, r.layout.unpacked(r.packed, leaves, specs), strict=True):
                flat[k] = x
            r = dataclasses.replace(r, flat=flat, layout=None, packed=None)
        pending, rows = r.pending, r.rows
        params = jax.tree.leaves(state.params)
        shards = jax.tree.leaves(sh.named(zero.mesh, zero.shard_specs(state.params)))

        def body(i, carry):
            vals, stacks = carry
            vals, new, _ = r.run(i, vals, pending, local=False)
            put = lambda s, j: jax.lax.dynamic_update_slice_in_dim(s, new[j], i, 0)
            return vals, [put(s, j) for s, j in zip(stacks, rows, strict=True)]

        stacks = [
            jax.lax.with_sharding_constraint(jnp.zeros_like(params[j]), shards[j]) for j in rows
        ]
        vals = r.held_values()
        if vals:
            (count,) = {x.shape[0] for x in vals}
            vals, stacks = jax.lax.fori_loop(0, count, body, (vals, stacks))
        done = r.finish(vals)
        return done[0], done[1], dict(zip(rows, stacks, strict=True))

    def forward_rows(self, zero, update, state, master, grads, *rest, **kw) -> DeferredRows:
        """The layer stacks' rows that :meth:`run_update` with ``defer=True`` left undone, to
        run a layer at a time inside the next forward's layer loop (``jaxzero.scan_layers``
        in the step's ``shard_map``, decision 51's third stage) instead of :meth:`run_pending`'s
        loop before it: the rows with their ``shard_map`` specs and the update traced outside
        it. The arguments are :meth:`run_pending`'s."""
        r = self._rows(zero, update, state, master, grads, *rest, **kw)
        args = jax.tree.unflatten(r.tree, r.flat)
        return dataclasses.replace(
            r,
            pending_specs=stream.pending_specs(r.fn, args, defer=r.defer, **r.kw),
            traced=stream.trace_rows(r.fn, args, **r.kw),
        )

    def _rows(self, zero, update, state, *args, pending, rows, packed=None, **kw) -> DeferredRows:
        """The :class:`DeferredRows` of :meth:`run_pending`'s arguments: those of
        :meth:`run_update` (``specs``, ``host`` and ``grads_in_params`` among ``kw``) with
        what ``pending`` carries, the params leaves ``rows`` it gives and, where the state
        leaves the rows rewrite are ``packed`` (:meth:`run_update`'s last value), those
        buffers."""
        fn, args, kw = self._streamed(zero, update, state, *args, **kw)
        flat, tree = jax.tree.flatten(args, is_leaf=remainder.is_stored)
        # the flat output of the first compute leaf: after the master, optimizer state and EMA
        first = len(jax.tree.leaves(state.params))
        first += len(jax.tree.leaves((state.opt_state, state.ema)))
        r = DeferredRows(
            fn=fn,
            tree=tree,
            flat=flat,
            defer=_stacked(zero, args, kw["host"]),
            kw=kw,
            pending=tuple(pending),
            rows=tuple(rows),
            first=first,
        )
        if packed is None:
            return r
        layout = PackedRows.of(zero.mesh, r.leaves(), r.leaf_specs())
        return dataclasses.replace(r, layout=layout, packed=tuple(packed))

    def _streamed(
        self, zero, update, state, master, grads, *rest, specs, host, grads_in_params=True
    ):
        """``(fn, args, keywords)`` of the ``stream.run`` call :meth:`run_update` makes."""
        leaf = remainder.is_stored
        args = (state.replace(params=None, master=None), master, grads, *rest)
        mark = lambda t, on: jax.tree.map(lambda _: on, t, is_leaf=leaf)
        separate = state.master is not None
        host_master, host_opt, host_ema = host
        one = lambda t: jax.tree.map(lambda x: x.lo if leaf(x) else x, t, is_leaf=leaf)
        host_master = one(host_master)
        in_host = mark(args[0], False).replace(opt_state=host_opt, ema=host_ema)
        grads_host = jax.tree.map(in_host_memory, grads)
        master_host = host_master if separate else mark(master, False)
        flags = (in_host, master_host, grads_host, mark(rest, False))
        # each new state leaf replaces its own (donated) input leaf
        flat = lambda t: jax.tree.leaves(t, is_leaf=leaf)
        index = jax.tree.unflatten(jax.tree.structure(args, is_leaf=leaf), range(len(flat(args))))
        olds = jax.tree.leaves((index[0].opt_state, index[0].ema))
        m = len(flat(master))
        if state.master is not None:  # the update reads the master as its own argument
            olds = jax.tree.leaves(index[1]) + olds
        first = 0 if state.master is not None else m  # the new master replaces the old one
        alias = {first + o: i for o, i in enumerate(olds)}
        # each output where its state leaf lives; the compute shards on the device unless the
        # params are offloaded; the finite flag and the norm on the device
        stays = lambda t: [not h for h in flat(t)]
        device_outputs = (
            (stays(host_master) if separate else [False] * m)
            + stays((host_opt, host_ema))
            + [not self.params_on_host] * m
            + [True, True]
        )
        stored = [leaf(x) for x in flat(master)]
        if zero.stage == 3 and state.master is not None:
            # the new 16-bit shards are written into the old ones (no longer read: the loss
            # has run), so no second copy of the params is held; a stack whose gradient the
            # backward wrote into its params' host buffer gets them back in that buffer
            args = (*args, state.params)
            start = len(flat(args)) - m
            tail = len(olds) + first  # the compute outputs follow the state's
            into = [
                g if on and grads_in_params else start + o
                for o, (g, on) in enumerate(
                    zip(jax.tree.leaves(index[2]), jax.tree.leaves(grads_host), strict=True)
                )
            ]
            alias.update({tail + o: i for o, i in enumerate(into)})
            fn = lambda *a: update(*a[:-1])
            specs = (specs, zero.param_specs(state.params))
            flags = (*flags, mark(state.params, self.params_on_host))
        elif any(stored):  # the params, which the stored master is joined with, ride along
            args = (*args, state.params)
            fn = lambda *a: update(*a[:-1])
            specs = (specs, zero.param_specs(state.params))
            flags = (*flags, mark(state.params, False))
        else:
            fn = update
        # each stored master leaf's compute copy: the params' leaf, the last arguments
        n = len(flat(args))
        first_master = len(flat(args[0]))
        pairs = {first_master + i: n - m + i for i, s in enumerate(stored) if s}
        kw = dict(
            mesh=zero.mesh,
            specs=jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)),
            host=jax.tree.leaves(flags),
            alias=alias,
            device_outputs=device_outputs,
            stored=pairs,
        )
        return fn, args, kw

    def new_params(self, compute, params, keep):
        return compute  # already the kept master's cast: the device params are not read


@dataclasses.dataclass
class DeferredRows:
    """The layer rows a deferred update left (decision 51), as
    :meth:`HostMemory.run_pending` runs them: the streamed update's function and flat
    arguments, which of them are the host state leaves the rows rewrite (``defer``, :attr:`held`), what ``pending`` carries, and the flat
    params leaves whose new compute rows they give (``rows``; ``first``: the first compute
    output's flat index). For the forward's loop (:meth:`HostMemory.forward_rows`) also the
    ``shard_map`` specs of ``pending`` and the update traced outside that ``shard_map``."""

    fn: Any
    tree: Any
    flat: list
    defer: list
    kw: dict
    pending: tuple
    rows: tuple
    first: int
    pending_specs: tuple | None = None
    traced: Any = None
    #: the :class:`~jaxzero.zero.offload.packed.PackedRows` of the held leaves and their
    #: buffers, where the rows are read and written packed (else None: the leaves themselves)
    layout: Any = None
    packed: tuple | None = None

    @property
    def held(self) -> list[int]:
        """The flat argument indices of the host state leaves the rows rewrite."""
        return [i for i, d in enumerate(self.defer) if d]

    @property
    def stacks(self) -> int:
        """How many stacks of packed rows (:attr:`PackedRows.stacks`; 1 without a layout):
        the forward's loop runs layers of each parity in turn."""
        return 1 if self.layout is None else self.layout.stacks

    @property
    def packs(self) -> list[int]:
        """Those of :attr:`held` that packed rows hold (:func:`_packs`)."""
        return _packs(self.flat, self.defer)

    def leaves(self) -> list:
        """The host state leaves of :attr:`packs`, as the tree holds them."""
        return [self.flat[i] for i in self.packs]

    def leaf_specs(self) -> list:
        return [self.kw["specs"][i] for i in self.packs]

    def _loose(self) -> list[int]:
        """The held leaves that are not packed (all of them without a layout)."""
        packs = set(self.packs) if self.layout is not None else set()
        return [i for i in self.held if i not in packs]

    def held_values(self) -> list:
        """What the rows read and write: the packed buffers (where there is a layout), then
        the host state leaves not packed."""
        packed = [] if self.layout is None else list(self.packed)
        return packed + [self.flat[i] for i in self._loose()]

    def held_specs(self) -> list:
        """The PartitionSpecs of :meth:`held_values`."""
        packed = [] if self.layout is None else [self.layout.spec] * len(self.packed)
        return packed + [self.kw["specs"][i] for i in self._loose()]

    def _split(self, held):
        """``held`` (:meth:`held_values`' order) as ``(buffers, loose leaves)``."""
        n = 0 if self.layout is None else len(self.packed)
        return list(held[:n]), list(held[n:])

    def buffers(self, held) -> tuple | None:
        """The packed buffers among ``held`` (what the rows wrote), None without a layout."""
        return None if self.layout is None else tuple(self._split(held)[0])

    def with_held(self, held) -> list:
        """The flat arguments with the loose leaves of ``held`` put in."""
        flat = list(self.flat)
        for k, v in zip(self._loose(), self._split(held)[1], strict=True):
            flat[k] = v
        return flat

    def fetch(self, held, i, parity: int = 0):
        """Layer ``i``'s packed rows of :meth:`held_values` ``held``, on the device (one copy
        per buffer), for :meth:`run`'s ``fetched`` (a forward loop fetches a layer ahead)."""
        return self.layout.row(self._split(held)[0], i, parity)

    def run(self, i, held, pending, local: bool = True, parity: int = 0, fetched=None, write=True):
        """Layer ``i``'s rows: ``held`` (:meth:`held_values` as they are now; ``local``: this
        device's shards, inside the step's ``shard_map``) with the row written,
        ``{flat params index: its new compute row}`` and the new packed row (None unpacked).
        ``parity``: ``i % stacks``, known while tracing (which packed buffers hold the row);
        ``fetched``: the row as :meth:`fetch` gave it (None: fetched here). ``write=False``
        (packed rows): the packed row is not written into ``held``, for :meth:`put`."""
        if local:
            mesh, specs = self.kw["mesh"], self.kw["specs"]
            shard = lambda x, s: NamedSharding(mesh, s).shard_shape(x.shape)
            pairs = zip(self.flat, specs, strict=True)
            now = [jax.ShapeDtypeStruct(shard(x, s), x.dtype) for x, s in pairs]
        else:
            now = list(self.flat)
        packed, loose = self._split(held)
        for k, v in zip(self._loose(), loose, strict=True):
            now[k] = v
        given = None
        if self.layout is not None:  # one fetch and one write-back per buffer
            if fetched is None:
                fetched = self.layout.row(packed, i, parity)
            given = dict(zip(self.packs, fetched, strict=True))
        new_args, new, *written = stream.run_rows(
            self.fn,
            jax.tree.unflatten(self.tree, now),
            pending,
            i,
            1,
            defer=self.defer,
            local=local,
            traced=self.traced if local else None,
            given=given,
            **self.kw,
        )
        out = jax.tree.leaves(new_args, is_leaf=remainder.is_stored)
        new_rows = None if given is None else [written[0][k] for k in self.packs]
        if new_rows is not None and write:
            packed = self.layout.put(packed, i, [new_rows], parity)
        rows = {j: new[self.first + j] for j in self.rows}
        return packed + [out[k] for k in self._loose()], rows, new_rows

    def put(self, held, i, new_rows, parity: int = 0) -> list:
        """``held`` with ``new_rows`` (the third values of :meth:`run` with ``write=False``
        for layers ``i``, ``i + stacks``, ...: consecutive rows of their buffers) written,
        one copy per buffer."""
        packed, loose = self._split(held)
        return self.layout.put(packed, i, new_rows, parity) + loose

    def finish(self, held):
        """``(state, master)``: the streamed update's first two arguments with the host state
        leaves ``held`` (what the rows wrote); packed, the leaves as they were (the rows are
        in ``held``'s buffers, which the next update carries)."""
        done = jax.tree.unflatten(self.tree, self.with_held(held))
        return done[0], done[1]


def _packs(flat, defer) -> list[int]:
    """The indices of the flat arguments ``flat`` that ``defer`` flags and whose rows the
    update streams row by row (large leaves): what packed rows hold. A small one (a stack's
    norm scale) is read and written whole."""
    return [
        i
        for i, (x, d) in enumerate(zip(flat, defer, strict=True))
        if d and stream_parts.large(x.shape)
    ]


def _stacked(zero, args, host) -> list[bool]:
    """Per flat leaf of the streamed update's ``args`` (a stored master one leaf), whether it
    is a host state leaf of the ``layers=`` stacks: what ``stream.run(..., defer=)`` leaves
    for later."""
    paths = jax.tree_util.tree_flatten_with_path(args, is_leaf=remainder.is_stored)[0]
    return [h and sh.is_stacked(p, zero.layers) for (p, _), h in zip(paths, host, strict=True)]


def memory_kinds(mesh: Mesh) -> tuple[str, ...]:
    """The memory kinds the mesh's first device addresses (empty for compile-only devices,
    which report none)."""
    return tuple(m.kind for m in mesh.devices.flat[0].addressable_memories())


def check_platform(mesh: Mesh) -> None:
    """Refuse a mesh whose devices have memories but no pinned host memory."""
    kinds = memory_kinds(mesh)
    if kinds and HOST not in kinds:
        platform = mesh.devices.flat[0].platform
        raise ValueError(
            f"offload='optimizer' needs {HOST!r} memory, and the {platform} devices of this "
            f"mesh address only {', '.join(kinds)}; train without offload (offload=None), "
            f"or on GPUs/CPUs, which have pinned host memory."
        )


def _is_spec(x) -> bool:
    return isinstance(x, P)


def host_sharding(mesh: Mesh, spec: P) -> NamedSharding:
    """``NamedSharding(mesh, spec, memory_kind="pinned_host")``, on ``mesh.abstract_mesh`` for
    compile-only devices (whose concrete mesh drops the memory kind).

    Raises:
      ValueError: the sharding came back without ``"pinned_host"`` (the platform dropped it).
    """
    s = NamedSharding(mesh, spec, memory_kind=HOST)
    if s.memory_kind != HOST and not memory_kinds(mesh):
        s = NamedSharding(mesh.abstract_mesh, spec, memory_kind=HOST)
    if s.memory_kind != HOST:
        raise ValueError(
            f"asked for memory_kind={HOST!r} on the {mesh.devices.flat[0].platform} mesh and "
            f"got memory_kind={s.memory_kind!r}: this jax/platform silently drops host memory "
            f"kinds, so offloaded state would stay in device memory. Train without offload "
            f"(offload=None), or report the platform and jax version."
        )
    return s


def host_shardings(mesh: Mesh, specs):
    """A tree of PartitionSpecs mapped to checked host shardings (:func:`host_sharding`)."""
    return jax.tree.map(lambda s: host_sharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def offloaded_bytes(state, fraction: float = 1.0) -> int:
    """Bytes per device of what offload keeps in host memory: the master, the optimizer state
    and the EMA of ``state`` (a TrainState of arrays or ShapeDtypeStructs with shardings),
    whatever memory kind they were given (their leaves that ``offload_fraction=fraction``
    picks, :func:`~jaxzero.zero.offload.fraction.host_leaves`), and the params placed in host
    memory (``("optimizer", "params")``)."""
    local = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    sizes = [local(x) for x in jax.tree.leaves((state.master, state.opt_state, state.ema))]
    params = [x for x in jax.tree.leaves(state.params) if x.sharding.memory_kind == HOST]
    kept = sum(s for s, h in zip(sizes, host_leaves(sizes, fraction), strict=True) if h)
    return kept + sum(local(x) for x in params)


def lowering(mesh: Mesh, offload):
    """The context to lower a step in: ``jax.set_mesh(mesh)`` where it offloads and its host
    shardings live on the abstract mesh (compile-only devices), else a no-op."""
    abstract = offload and not memory_kinds(mesh)
    return jax.set_mesh(mesh) if abstract else contextlib.nullcontext()
