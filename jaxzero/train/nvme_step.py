"""``make_nvme_train_step``: a ZeRO train step whose optimizer state (the fp32 master and the
optax state) lives in a file on disk, paged through a bounded window of host buffers by the
update (the NVMe tier, decision 50; DeepSpeed's ``offload_optimizer: {device: nvme}``).

The step is the host offload's (``ZeRO(offload="optimizer")``, decision 32) with the state in
the swapper's file instead of pinned host memory: the same gradients (one jitted ``shard_map``
of the host offload's gradient path), then :class:`~jaxzero.zero.offload.nvme_update.DiskUpdate`'s
update, a group of leaves at a time, which gives the host offload's numbers (bit for bit
with XLA:CPU's LLVM passes off, to the last bits with them on: see there).
The compute params live on the device (replicated at stages 1 and 2, sharded at stage 3),
as with the host offload; host memory holds the swapper's window::

    zero = jz.ZeRO(tx, mesh, stage=2, offload="optimizer")
    step = make_nvme_train_step(loss_fn, zero, NVMe("/nvme/run", buffer_count=4, buffer_mb=64))
    state = step.init(params)
    state, metrics = step(state, batch)
    opt_state, master = state.optimizer_state()  # read back from the file

With ``ema=jz.ShardedEMA(decay)`` the EMA of the master is in the file too, each leaf in its
master leaf's group, updated as the host offload updates it; ``jz.ema_params(state)`` reads it
back a group at a time.

A step updates the file in place. An error in the middle of a step's update (a failed write)
leaves the file part updated: the step raises it, and the state refuses later steps and reads
with a message naming it (restore from a checkpoint). A process killed in the middle of an
update leaves the file marked (``optimizer_state.swp.updating``): the next state opened on it
(``init``, or ``jaxzero.checkpoint.restore``) warns and rebuilds it. The file is locked while
its state is open: a second run in the same directory is refused, naming the first one's
process; :meth:`NVMeState.close` releases it (and the kernel, when the process dies).
``jaxzero.checkpoint.save`` and ``restore`` stream the state a group at a time
(:mod:`jaxzero.checkpoint.nvme`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.ema.ema import EmaState, ShardedEMA
from jaxzero.train import loss as user_loss
from jaxzero.train.grads import local_gradients
from jaxzero.train.optimizer import ZeRO
from jaxzero.trees import batch_rows
from jaxzero.zero import specs as sh
from jaxzero.zero.offload.nvme import check_directory
from jaxzero.zero.offload.nvme_update import DiskUpdate, NVMe, finite_and_norm

__all__ = ["NVMe", "NVMeState", "NVMeTrainStep", "make_nvme_train_step", "open_disk"]


@dataclasses.dataclass
class NVMeState:
    """A training state whose optimizer side is on disk.

    ``params`` (the compute params, on the device), ``resident`` (the small state leaves, on
    the device: ``{flat index: array}``), ``step``, ``skipped`` and ``loss_scale`` are values;
    ``disk`` is the file, which each step updates in place: an older ``NVMeState`` reads the
    latest state from it, not its own.
    """

    params: Any
    resident: dict
    step: jax.Array
    skipped: jax.Array
    loss_scale: Any
    disk: DiskUpdate

    def gather_view(self):
        """What :func:`jaxzero.gather` of the state gathers: its compute params (on the
        device; the optimizer side is read with :meth:`optimizer_state`)."""
        return self.params

    def optimizer_state(self):
        """``(opt_state, master)`` as trees of global numpy arrays, read from the file a group
        at a time (``master`` None when the params are the master)."""
        return self.disk.read(self.resident)

    def ema_state(self):
        """The EMA state (an :class:`~jaxzero.EmaState` of global numpy arrays), read from the
        file a group at a time; None when the step keeps no EMA."""
        return self.disk.read_ema(self.resident)

    def ema_params(self, dtype=None):
        """What :func:`jaxzero.ema_params` gives for this state: the EMA weights as a params
        tree replicated on the mesh, cast to ``dtype`` (by default the compute params'),
        read from the file a group at a time.

        Raises:
          ValueError: the step keeps no EMA.
        """
        ema = self.ema_state()
        if ema is None:
            raise ValueError(
                "ema_params needs a state with an EMA; build the step with "
                "make_train_step(..., ema=jaxzero.ShardedEMA(decay)) and its state with "
                "step.init(params)."
            )
        dtype = jnp.dtype(dtype or jax.tree.leaves(self.params)[0].dtype)
        mesh = jax.tree.leaves(self.params)[0].sharding.mesh
        replicated = NamedSharding(mesh, P())
        return jax.tree.map(lambda x: jax.device_put(x.astype(dtype), replicated), ema.ema)

    def close(self) -> None:
        """Close the state's file (it stays on disk) and release its lock."""
        self.disk.close()


def open_disk(zero: ZeRO, nvme: NVMe, params, ema: ShardedEMA | None = None) -> DiskUpdate:
    """The :class:`DiskUpdate` of ``zero``'s state of ``params`` (arrays or shapes) with its
    file under ``nvme.path``: made (every check of the swapper, the lock, the preallocation)
    before any state exists, to be filled with ``DiskUpdate.fill``.

    Args:
      zero: the host offload's ZeRO (``offload="optimizer"``, no ``nvme``).
      nvme: where and how the state is paged.
      params: the model params, or their ShapeDtypeStructs.
      ema: the step's EMA (its leaves on disk beside their masters), or None.
    """
    abstract = zero.abstract_state(params, ema=ema)
    on_device = abstract.master is None
    master = abstract.params if on_device else abstract.master
    aval = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    named = lambda t: sh.named(zero.mesh, zero.shard_specs(t))
    return DiskUpdate(
        zero.tx,
        zero.precision,
        zero.skip_nonfinite,
        opt_state=aval(abstract.opt_state),
        master=aval(master),
        opt_shardings=named(abstract.opt_state),
        master_shardings=named(master),
        master_on_device=on_device,
        scaled=abstract.loss_scale is not None,
        nvme=nvme,
        ema=ema,
        ema_state=None if ema is None else aval(abstract.ema),
        ema_shardings=None if ema is None else ema_shardings(zero, abstract.ema),
    )


def ema_shardings(zero: ZeRO, ema_state: EmaState) -> EmaState:
    """The NamedShardings of a per-leaf EMA state on ``zero``'s mesh: each leaf in its
    master leaf's shards (where the host offload's streamed update reads it), the counter
    replicated."""
    tree = sh.named(zero.mesh, zero.ema_specs(ema_state.ema))
    return EmaState(NamedSharding(zero.mesh, P()), tree)


@dataclasses.dataclass
class NVMeTrainStep:
    """``state, metrics = step(state, batch)``; :meth:`init` makes the state and its file."""

    loss_fn: Any
    zero: ZeRO
    nvme: NVMe
    accum_steps: int
    ema: ShardedEMA | None
    _grads: Any
    _check: Any
    _finish: Any
    _gather: Any

    def init(self, params) -> NVMeState:
        """The state of ``params``, its optimizer side written to the file a group of leaves
        at a time: the file is made (and the directory checked) before any state exists,
        and each group's first values (``zero.init``'s, computed for those leaves alone) are
        on the host only while they are copied into the window, so the state never sits in
        memory whole.

        Returns:
          The :class:`NVMeState`; the file is ``nvme.path/optimizer_state.swp``.
        """
        zero = self.zero
        disk = open_disk(zero, self.nvme, params, self.ema)
        on_device = disk.master_on_device
        if disk.found_torn:
            warnings.warn(f"{disk.found_torn} first values (init)", stacklevel=2)

        def leaves(indices):
            # zero.init under jit, its other outputs unused: XLA computes only these leaves
            def pick(p):
                state = zero.init(p, ema=self.ema)
                flat = jax.tree.leaves(state.opt_state)
                flat += [None] * disk.n_m if on_device else jax.tree.leaves(state.master)
                flat += jax.tree.leaves(state.ema)
                return [flat[i] for i in indices]

            out = [disk.shardings[i] for i in indices]
            return jax.jit(pick, out_shardings=out)(params)

        def rest(p):  # the compute params and the counters, the optimizer side unused
            state = zero.init(p)
            return state.params, state.step, state.skipped, state.loss_scale

        try:
            resident = disk.fill(leaves)
            compute, step, skipped, loss_scale = jax.jit(rest)(params)
        except BaseException:
            disk.close()  # the file stays; its lock is released
            raise
        return NVMeState(compute, resident, step, skipped, loss_scale, disk)

    def __call__(self, state: NVMeState, batch):
        zero = self.zero
        rows = next(iter(batch_rows(batch).values()))
        need = zero.num_batch_shards * self.accum_steps
        if rows % need:
            raise ValueError(
                f"global batch size {rows} is not divisible by devices "
                f"({zero.num_batch_shards}) x accum_steps ({self.accum_steps}) = {need}"
            )
        if state.disk.ema != self.ema:
            raise ValueError(
                f"this state's file keeps the EMA of {state.disk.ema!r} and the step updates "
                f"{self.ema!r}: make the step with the ema= the state was made (or restored) with"
            )
        sharding = NamedSharding(zero.mesh, zero.batch_spec())
        batch = jax.tree.map(lambda x: jax.device_put(x, sharding), batch)
        scale = None if state.loss_scale is None else state.loss_scale.scale
        loss, aux, grads, master = self._grads(state.params, batch, scale)
        finite, norm = self._check(grads, scale)
        apply = bool(finite) or not zero.skip_nonfinite
        params, resident = state.params, state.resident
        if apply:
            resident, compute = state.disk.run(
                state.resident,
                grads,
                master if state.disk.master_on_device else None,
                scale,
                None if self.ema is None else state.step,
            )
            params = self._gather(jax.tree.unflatten(jax.tree.structure(state.params), compute))
        del grads, master
        step, skipped, loss_scale = self._finish(
            state.step, state.skipped, state.loss_scale, finite
        )
        new = NVMeState(params, resident, step, skipped, loss_scale, state.disk)
        metrics = {"loss": loss, "grad_norm": norm, "finite": finite, "skipped": skipped}
        metrics["step"] = step
        if loss_scale is not None:
            metrics["loss_scale"] = loss_scale.scale
        if aux is not None:
            metrics["aux"] = aux
        return new, metrics


def make_nvme_train_step(
    loss_fn, zero: ZeRO, nvme: NVMe, *, accum_steps: int = 1, ema: ShardedEMA | None = None
):
    """A train step of ``zero`` (built with ``offload="optimizer"``: the gradient path of the
    host offload) whose optimizer state lives on disk under ``nvme.path``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss | (loss, aux)``, as :func:`make_train_step`'s.
      zero: ``jz.ZeRO(tx, mesh, stage=1|2|3, offload="optimizer", ...)``.
      nvme: where and how the state is paged.
      accum_steps: micro-batches per step.
      ema: a :class:`~jaxzero.ShardedEMA` of the master, kept in the file beside each
        leaf's master and optax state (in the same group) and updated from the new master
        of that group, as the host offload's streamed update computes it (``ema_params``
        reads it back); None: no EMA.

    Returns:
      An :class:`NVMeTrainStep`.

    Raises:
      ValueError: ``zero`` does not offload the optimizer alone (parameter offload, an
        ``offload_fraction`` below 1 and the remainder master are not supported on disk).
      FileNotFoundError, NotADirectoryError, PermissionError: ``nvme.path`` is missing, a
        file or not writable (:func:`~jaxzero.zero.offload.nvme.check_directory`; a
        directory on tmpfs warns); the free space and the lock are checked by ``init``,
        before the state is built.
      NotImplementedError: (at the first call) a loss returning a ``GlobalMean``.
    """
    if not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO, got {type(zero).__name__}.")
    place = zero.placement
    if not isinstance(nvme, NVMe):
        raise TypeError(f"nvme must be a jaxzero NVMe(path, ...), got {type(nvme).__name__}.")
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    if not place.optimizer_side_whole:
        raise ValueError(
            f"the NVMe step takes ZeRO(offload='optimizer') (got offload={zero.offload!r}, "
            f"offload_fraction={zero.offload_fraction}): the state on disk replaces the "
            "optimizer side in pinned host memory"
        )
    user_loss.check_signature(loss_fn, rng=False, stateful=False)
    check_directory(nvme.path)  # a bad directory fails here, before any state is built
    reducing = zero.path.for_step(accum_steps)
    grads_fn = local_gradients(reducing, loss_fn, accum_steps)
    axes_spec = zero.batch_spec()

    def grads(params, batch, scale):
        specs = zero.param_specs(params)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        plan = zero.plan(shapes, accum_steps=accum_steps)
        s = jnp.ones((), jnp.float32) if scale is None else scale
        sm = jax.shard_map(
            lambda p, b, t: grads_fn(p, None, b, None, t, specs, plan),
            mesh=zero.mesh,
            in_specs=(specs, jax.tree.map(lambda _: axes_spec, batch), P()),
            out_specs=(P(), P(), reducing.grad_specs(params), None),
        )
        loss, aux, g, _ = sm(params, batch, s)
        if isinstance(loss, tuple):
            raise NotImplementedError("a GlobalMean loss is not supported by the NVMe step yet")
        shards = sh.named(zero.mesh, zero.shard_specs(g))
        g = jax.lax.with_sharding_constraint(g, shards)
        # the master when the params are it: their shards, as the host offload reads them
        # (a separate master is on disk: no copy of the params is made for it)
        master = None
        if not zero.precision.separate_master:
            master = jax.lax.with_sharding_constraint(
                params, sh.named(zero.mesh, zero.shard_specs(params))
            )
        return loss, aux, g, master

    def finish(step, skipped, loss_scale, finite):
        apply = finite if zero.skip_nonfinite else jnp.asarray(True)
        step = jnp.where(apply, step + 1, step)
        skipped = skipped + jnp.where(apply, 0, 1).astype(jnp.int32)
        if loss_scale is not None:
            loss_scale = zero.loss_scale.update(loss_scale, finite)
        return step, skipped, loss_scale

    def gather(compute):
        return zero.all_gather(compute) if zero.stage in (1, 2) else compute

    check = lambda g, s: finite_and_norm(zero.precision, g, s)
    return NVMeTrainStep(
        loss_fn,
        zero,
        nvme,
        accum_steps,
        ema,
        jax.jit(grads),
        jax.jit(check),
        jax.jit(finish),
        jax.jit(gather),
    )
