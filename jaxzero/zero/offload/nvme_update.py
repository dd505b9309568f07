"""The optimizer's update with its state on disk (the NVMe tier's second stage, decision 50):
the fp32 master, the optax state and the EMA live in one file of the :class:`~.nvme.Swapper`,
and the update pages them through its bounded window of host buffers a group of leaves at a
time.

The update is the host offload's (decision 32): the same function of ``(opt_state, master,
ema_state, grads, loss scale, step)`` traced once to a flat jaxpr and cut by :mod:`~.parts` into a prologue
(the small values several leaves read: a global norm, a step count, the finite check) and
independent parts, one per group of connected large leaves. Each state leaf then has a home:

- *on disk*, a large leaf (more than :data:`~.parts.SMALL` elements) of the optimizer state,
  of a separate master or of the EMA (which the part of its master updates): its shards, one per distinct shard index among this process's devices
  (a replicated leaf once), in the group of the part that reads and replaces it;
- *resident*, a small leaf (Adam's count, a bias's moments): kept on the device with its
  sharding, read and replaced by the prologue; its bytes are negligible;
- *on the device*, the master when the params are the master (fp32 without a copy).

A step runs the prologue under jit, then iterates the groups with :meth:`Swapper.pipelined`
(group ``g+1`` read and ``g-1`` written while ``g`` updates): each group's shards go from its
buffer into their devices' pinned host memory, where the host offload keeps them, the group's
parts run as the host offload's own streamed update of those parts (:func:`stream.run`, under
jit, with the prologue's values: a loop over chunks fetched to the device, the small values
computed once outside it), and the new state's shards come back into the same buffer, which
is written back. The new compute shards stay on the device. Host memory holds the swapper's
window and a group's copy in pinned memory; the device holds the params, the gradients, a
chunk of a group's state and the new compute shards.

So each part is the host offload's program for it, and the prologue's values cross programs
here as they cross an ``optimization_barrier`` in the host offload's program: with XLA:CPU's
LLVM passes off the state equals the host offload's bit for bit at every step, and follows
:mod:`~.stream` when it changes how it runs a part. With them on it differs from the second
step in the last bits (decision 50): XLA recomputes Adam's new moment inside the parameter's
kernel, and LLVM contracts a different one of its two products into a fused multiply-add there
when the gradients' mean is computed in the same kernel (the host offload's single program)
than when the gradient arrives materialized (here).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import Literal, Var
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxzero.zero.offload.parts as stream_parts
import jaxzero.zero.offload.stream as stream
from jaxzero.zero import jaxpr_eval
from jaxzero.zero.offload.nvme import Swapper

__all__ = ["NVMe", "DiskUpdate", "update_fn"]

#: a shard's bytes start at a multiple of this within its group (whole cache lines)
PIECE_ALIGN = 64

DISK, RESIDENT, DEVICE = "disk", "resident", "device"
HOST = "pinned_host"


@dataclasses.dataclass(frozen=True)
class NVMe:
    """Where and how the optimizer state is paged (DeepSpeed's ``offload_optimizer: {device:
    nvme, nvme_path, buffer_count}``).

    Args:
      path: an existing, writable directory (an NVMe mount); the state's file is made there.
      buffer_count: host buffers of the swapper's window (4: a group updating, one read ahead,
        one or two written behind).
      buffer_mb: MiB of each buffer, the most one group holds; by default the largest leaf's
        state (a leaf's shards are never split between groups).
      block_bytes: bytes of one read or write call (:class:`~.nvme.Swapper`).
      queue_depth: I/O threads.
      direct: ``O_DIRECT``: required (True), never (False), where the filesystem allows
        (None).
    """

    path: str | os.PathLike
    buffer_count: int = 4
    buffer_mb: float | None = None
    block_bytes: int = 4 << 20
    queue_depth: int = 4
    direct: bool | None = None


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def update_fn(tx, precision, skip_nonfinite: bool, ema=None):
    """The update the disk state runs: ``fn(opt_state, master, ema_state, grads, scale, step)
    -> (new_master, new_opt_state, compute, finite, norm, new_ema_state)``, the arithmetic of
    the host offload's update (``jaxzero.train.update``): the gradients in ``output_dtype``
    divided by the loss ``scale`` (None: none), the finite check, optax, each leaf kept where
    a non-finite step is skipped, the new compute shards, the gradients' norm, and with
    ``ema`` (a :class:`~jaxzero.ShardedEMA`) the EMA of the new master, leaf by leaf as the
    host offload's streamed update computes it (``step``: the training step before this one;
    ``ema_state`` and ``step`` None without an EMA)."""

    def fn(opt_state, master, ema_state, grads, scale, step):
        grads = _cast(grads, precision.output_dtype)
        if scale is not None:
            factor = 1.0 / scale
            grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        apply = finite if skip_nonfinite else jnp.asarray(True)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(apply, a, b), new, old)
        updates, new_opt = tx.update(grads, opt_state, master)
        new_master = keep(optax.apply_updates(master, updates), master)
        compute = new_master
        if precision.compute_copy:
            compute = _cast(new_master, precision.param_dtype)
        norm = optax.tree.norm(grads)
        new_ema = None
        if ema_state is not None:
            # the host offload's (train/update.py): per leaf, gated on the new step
            new_step = jnp.where(apply, step + 1, step)
            new_ema = ema.update(ema_state, new_master, step=new_step, apply=apply)
            if ema.every == 1 and ema.start_step == 0:
                new_ema = new_ema._replace(updates=ema_state.updates + (new_step - step))
        return new_master, keep(new_opt, opt_state), compute, finite, norm, new_ema

    return fn


def finite_and_norm(precision, grads, scale):
    """``(finite, norm)`` of the unscaled gradients: what decides, before any state is read,
    whether the step runs (the update computes the same values again, in its prologue)."""
    grads = _cast(grads, precision.output_dtype)
    if scale is not None:
        factor = 1.0 / scale
        grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return finite, optax.tree.norm(grads)


def _key(index) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


@dataclasses.dataclass
class _Leaf:
    """A state leaf on disk: its sharding, its distinct shards (index, devices) among this
    process's devices, and where each shard's bytes sit in its group."""

    input: int  # flat input index of the traced update
    shape: tuple
    dtype: np.dtype
    sharding: NamedSharding
    shards: list  # [(index key, index, [devices])]
    shard_shape: tuple
    group: int = -1
    offsets: list = dataclasses.field(default_factory=list)

    @property
    def shard_bytes(self) -> int:
        return math.prod(self.shard_shape) * self.dtype.itemsize

    def piece_bytes(self) -> int:
        return -(-self.shard_bytes // PIECE_ALIGN) * PIECE_ALIGN

    def nbytes(self) -> int:
        return self.piece_bytes() * len(self.shards)

    def views(self, buffer):
        """Each shard's bytes in ``buffer`` as an array of the shard's shape."""
        return [
            buffer[o : o + self.shard_bytes].view(self.dtype).reshape(self.shard_shape)
            for o in self.offsets
        ]

    def to_host(self, buffer) -> jax.Array:
        """The leaf as a global array in its devices' pinned host memory (where the host
        offload keeps it, and where its streamed update reads it from), from its shards in
        ``buffer``."""
        sharding = self.sharding.with_memory_kind(HOST)
        by_device = {}
        for (_, _, devices), view in zip(self.shards, self.views(buffer), strict=True):
            for d in devices:
                by_device[d] = view
        arrays = [
            jax.device_put(by_device[d], SingleDeviceSharding(d, memory_kind=HOST))
            for d in sharding.addressable_devices_indices_map(self.shape)
        ]
        return jax.make_array_from_single_device_arrays(self.shape, sharding, arrays)

    def from_device(self, x: jax.Array, buffer) -> None:
        """The shards of ``x`` (this leaf's new value, in its sharding) copied into
        ``buffer``."""
        got = {_key(s.index): s.data for s in x.addressable_shards}
        for (key, _, _), view in zip(self.shards, self.views(buffer), strict=True):
            view[...] = np.asarray(got[key])


def _leaf(i, aval, sharding) -> _Leaf:
    shards: dict = {}
    for d, index in sharding.addressable_devices_indices_map(aval.shape).items():
        shards.setdefault(_key(index), (index, []))[1].append(d)
    return _Leaf(
        i,
        tuple(aval.shape),
        np.dtype(aval.dtype),
        sharding,
        [(k, index, devices) for k, (index, devices) in shards.items()],
        tuple(sharding.shard_shape(aval.shape)),
    )


def _evaluator(closed, eqns, ins, outs, shardings):
    """A function of the values of ``ins`` (jaxpr variables) giving those of ``outs``,
    the equations ``eqns`` of the flat jaxpr evaluated one by one (as the host offload's
    stream does); an output with a sharding in ``shardings`` is constrained to it."""
    jaxpr = closed.jaxpr
    consts = dict(zip(jaxpr.constvars, closed.consts, strict=True))

    def fn(*vals):
        env = dict(consts)
        env.update(zip(ins, vals, strict=True))
        for i in eqns:
            jaxpr_eval.bind(jaxpr.eqns[i], env)
        got = []
        for v in outs:
            x = jaxpr_eval.read(env, v)
            if v in shardings:
                x = jax.lax.with_sharding_constraint(x, shardings[v])
            got.append(x)
        return got

    return fn


def _marker(path: str) -> str:
    return path + ".updating"


def _mark_updating(path: str) -> None:
    with open(_marker(path), "w") as f:
        f.write(str(os.getpid()))


def _unmark_updating(path: str) -> None:
    os.unlink(_marker(path))


def _torn(path: str) -> str | None:
    """The message for a state file whose update marker is still there (its process stopped
    in the middle of an update, or of writing the file's first values), else None."""
    try:
        with open(_marker(path)) as f:
            pid = f.read().strip() or "?"
    except FileNotFoundError:
        return None
    return (
        f"the optimizer state file {path} was left part updated by process {pid}, which "
        "stopped in the middle of an update (its groups hold different steps); its contents "
        "are replaced by this state's"
    )


class DiskUpdate:
    """The traced update, its state leaves placed (disk, resident, device) and grouped into
    the swapper's file, and the loop that runs it a group at a time.

    Args:
      tx: the optax transformation.
      precision: the step's :class:`~jaxzero.precision.Precision`.
      skip_nonfinite: whether a step with a non-finite gradient leaves the state unchanged.
      opt_state: the optax state's avals (global shapes).
      master: the master's avals: the separate fp32 master (kept on disk), or the params when
        they are the master (``master_on_device``).
      opt_shardings, master_shardings: their shards' NamedShardings.
      master_on_device: the master is the params, read from the device, never stored.
      scaled: the update divides by a loss scale.
      nvme: where and how the state is paged.
      ema: the :class:`~jaxzero.ShardedEMA` the update applies to the new master, or None.
      ema_state, ema_shardings: the EMA state's avals and NamedShardings (an
        :class:`~jaxzero.EmaState`, per leaf): each large EMA leaf is on disk in its
        master leaf's group, its counter resident.

    Raises:
      NotImplementedError: the prologue reads a large state leaf whole (an update that mixes
        leaves through one: every leaf's state would have to be read before any group).
      ValueError: a leaf's state is larger than ``nvme.buffer_mb``.
    """

    def __init__(
        self,
        tx,
        precision,
        skip_nonfinite: bool,
        *,
        opt_state,
        master,
        opt_shardings,
        master_shardings,
        master_on_device: bool,
        scaled: bool,
        nvme: NVMe,
        ema=None,
        ema_state=None,
        ema_shardings=None,
    ):
        self.precision = precision
        self.ema = ema
        grads = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, precision.output_dtype), master
        )
        scale = jax.ShapeDtypeStruct((), jnp.float32) if scaled else None
        if ema is None:
            ema_state = ema_shardings = None
        step = None if ema is None else jax.ShapeDtypeStruct((), jnp.int32)
        fn = update_fn(tx, precision, skip_nonfinite, ema)
        args = (opt_state, master, ema_state, grads, scale, step)
        self.closed, self.out_tree = stream_parts.flat_jaxpr(fn, args)
        self.plan = stream_parts.plan(self.closed)
        jaxpr = self.closed.jaxpr
        self.opt_tree = jax.tree.structure(opt_state)
        self.master_tree = jax.tree.structure(master)
        self.ema_tree = jax.tree.structure(ema_state)
        n_o, n_m = self.opt_tree.num_leaves, self.master_tree.num_leaves
        n_e = self.ema_tree.num_leaves
        self.n_o, self.n_m, self.n_e = n_o, n_m, n_e
        o_avals, m_avals = jax.tree.leaves(opt_state), jax.tree.leaves(master)
        e_avals = jax.tree.leaves(ema_state)
        o_sh, m_sh = jax.tree.leaves(opt_shardings), jax.tree.leaves(master_shardings)
        e_sh = jax.tree.leaves(ema_shardings)
        self.avals = [*o_avals, *m_avals, *e_avals]
        # of the state inputs: opt_state, then master, then the EMA state
        self.shardings = [*o_sh, *m_sh, *e_sh]
        # each input's spec, as the host offload's stream is given them: the state's, and the
        # master's for the gradients (and for the params as the master)
        in_sh = [*o_sh, *m_sh, *e_sh, *m_sh]
        self.in_specs = {v: s.spec for v, s in zip(jaxpr.invars, in_sh, strict=False)}
        # each flat input's home
        kinds = []
        for i, v in enumerate(jaxpr.invars):
            state = (
                i < n_o or (i < n_o + n_m and not master_on_device) or n_o + n_m <= i < self.n_state
            )
            kinds.append(DEVICE if not state else DISK if stream_parts.big(v) else RESIDENT)
        self.kinds = kinds
        self.master_on_device = master_on_device
        # outputs: new_master (n_m), new_opt_state (n_o), compute (n_m), finite, norm, new EMA
        # state (n_e)
        outs = jaxpr.outvars
        self.state_out = {}  # state input -> the variable (or literal) of its new value
        for j in range(n_m):
            if not master_on_device:
                self.state_out[n_o + j] = outs[j]
        for j in range(n_o):
            self.state_out[j] = outs[n_m + j]
        for j in range(n_e):
            self.state_out[n_o + n_m + j] = outs[2 * n_m + n_o + 2 + j]
        self.compute_out = list(outs[n_m + n_o : n_m + n_o + n_m])
        # the sharding each large output is constrained to: its state leaf's, or the master's
        self.out_sharding = {}
        for i, v in self.state_out.items():
            if isinstance(v, Var):
                self.out_sharding.setdefault(v, self.shardings[i])
        for j, v in enumerate(self.compute_out):
            if isinstance(v, Var) and stream_parts.big(v):
                self.out_sharding.setdefault(v, m_sh[j])
        self._check_prologue()
        self._layout(nvme)
        # new disk leaves no other output is (a compute shard, a resident leaf): dropped from
        # the device once their group is written
        others = {v for v in self.compute_out if isinstance(v, Var)}
        others |= {v for i, v in self.state_out.items() if i not in self.leaves}
        self._dropped = {
            v
            for i, v in self.state_out.items()
            if i in self.leaves and isinstance(v, Var) and v not in others
        }

    @property
    def n_state(self) -> int:
        """Flat state inputs: the optax state's, the master's, the EMA state's."""
        return self.n_o + self.n_m + self.n_e

    # -- building ------------------------------------------------------------------------

    def _check_prologue(self):
        invars = self.closed.jaxpr.invars
        disk = {invars[i] for i, k in enumerate(self.kinds) if k == DISK}
        read = disk.intersection(self.plan.prologue.inputs)
        if read:
            raise NotImplementedError(
                f"the optimizer's update reads {len(read)} large state leaves before any "
                "leaf's own update (a value that mixes leaves, e.g. a flattened state): the "
                "NVMe tier updates the state a group of leaves at a time and supports "
                "updates that are per leaf after small shared values (Adam, clipping, "
                "weight decay, schedules)"
            )
        made = {v for i in self.plan.prologue.eqns for v in self.closed.jaxpr.eqns[i].outvars}
        for i, v in self.state_out.items():
            if self.kinds[i] == DISK and isinstance(v, Var) and v in made:
                raise NotImplementedError(
                    f"state leaf {i} is large but its new value comes from the update's "
                    "prologue; the NVMe tier writes a leaf back from its own group"
                )

    def _layout(self, nvme: NVMe):
        jaxpr = self.closed.jaxpr
        invars = jaxpr.invars
        self.leaves = {
            i: _leaf(i, self.avals[i], self.shardings[i])
            for i, k in enumerate(self.kinds)
            if k == DISK
        }
        var_leaf = {invars[i]: i for i in self.leaves}
        out_leaf = {
            v: i for i, v in self.state_out.items() if i in self.leaves and isinstance(v, Var)
        }
        # each part with the disk leaves it reads or replaces
        units, homeless = [], []
        owner = {}
        for p, part in enumerate(self.plan.parts):
            mine = {var_leaf[v] for v in part.inputs if v in var_leaf}
            mine |= {out_leaf[v] for v in part.outputs if v in out_leaf}
            for i in mine:
                if owner.setdefault(i, p) != p:
                    raise NotImplementedError(f"state leaf {i} is read by two parts")
            (units if mine else homeless).append((p, sorted(mine)))
        # leaves no part reads or replaces: stored, never updated
        still = [i for i in self.leaves if i not in owner]
        unit_bytes = lambda u: sum(self.leaves[i].nbytes() for i in u[1])
        sizes = [unit_bytes(u) for u in units] + [self.leaves[i].nbytes() for i in still]
        if not sizes:
            sizes = [0]
        limit = int(nvme.buffer_mb * (1 << 20)) if nvme.buffer_mb else max(sizes)
        if max(sizes) > limit:
            raise ValueError(
                f"a leaf's optimizer state takes {max(sizes):,} bytes, more than a buffer's "
                f"{limit:,} (buffer_mb={nvme.buffer_mb}): raise buffer_mb; a leaf's shards are "
                "never split between groups"
            )
        self.groups: list[list[int]] = []  # parts of each group that updates
        self.group_leaves: list[list[int]] = []
        group_bytes: list[int] = []
        for (p, mine), size in zip(units, sizes, strict=False):
            if not self.groups or group_bytes[-1] + size > limit or not self.groups[-1]:
                self.groups.append([])
                self.group_leaves.append([])
                group_bytes.append(0)
            self.groups[-1].append(p)
            self.group_leaves[-1].extend(mine)
            group_bytes[-1] += size
        self.updating = len(self.groups)
        for i in still:
            self.groups.append([])
            self.group_leaves.append([i])
            group_bytes.append(self.leaves[i].nbytes())
        self.device_parts = [p for p, _ in homeless]  # parts with no state on disk
        for g, leaves in enumerate(self.group_leaves):
            at = 0
            for i in leaves:
                leaf = self.leaves[i]
                leaf.group = g
                leaf.offsets = [at + k * leaf.piece_bytes() for k in range(len(leaf.shards))]
                at += leaf.nbytes()
        self.swapper = None
        #: why the file no longer holds one step's state (an update failed in the middle)
        self.broken: str | None = None
        #: what the file held when it was opened: a state some process left part updated
        #: (killed in the middle of an update), which ``fill`` replaces; else None
        self.found_torn: str | None = None
        if self.leaves:
            self.swapper = Swapper(
                nvme.path,
                group_bytes,
                buffer_count=nvme.buffer_count,
                buffer_bytes=limit,
                block_bytes=nvme.block_bytes,
                queue_depth=nvme.queue_depth,
                direct=nvme.direct,
            )
            self.found_torn = _torn(self.swapper.path)
        # the jitted pieces
        pro = self.plan.prologue
        self._prologue = jax.jit(_evaluator(self.closed, pro.eqns, pro.inputs, pro.outputs, {}))
        self._programs: dict = {}  # a group's traced update -> its jitted program
        try:
            self._group_fns = [self._group_fn(parts) for parts in self.groups[: self.updating]]
            self._device_fn = None
            if self.device_parts:
                self._device_fn = self._group_fn(self.device_parts, streamed=False)
        except BaseException:
            self.close()  # the file's lock goes with the half-built update
            raise

    def _group_fn(self, parts, streamed: bool = True):
        """``(inputs, outputs, program)`` of the parts ``parts``. With ``streamed``, the
        program is the host offload's streamed update of those parts (:func:`stream.run`):
        their disk leaves read from pinned host memory and their new values written there, a
        loop over chunks for an elementwise part, its small values computed once outside
        it. So a group's arithmetic is the host offload's program for the same parts, which
        XLA compiles and rewrites alike."""
        chosen = [self.plan.parts[p] for p in parts]
        ins = list(dict.fromkeys(v for part in chosen for v in part.inputs))
        outs = list(dict.fromkeys(v for part in chosen for v in part.outputs))
        eqns = sorted({i for part in chosen for i in part.eqns})
        if streamed:  # no constraint on the outputs: the stream places each, as the host's
            fn = self._streamed(_evaluator(self.closed, eqns, ins, outs, {}), ins, outs)
        else:
            fn = _evaluator(self.closed, eqns, ins, outs, self.out_sharding)
        # groups of the same leaves' shapes (a model's layers) share one program: the same
        # equations, told by the traced update's text and the arrays it captures
        var_leaf = {self.closed.jaxpr.invars[i]: leaf for i, leaf in self.leaves.items()}

        def aval(v):  # a disk leaf's in pinned host memory, as the program is given it
            leaf = var_leaf.get(v) if streamed else None
            sharding = None if leaf is None else leaf.sharding.with_memory_kind(HOST)
            return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding)

        traced = jax.make_jaxpr(fn)(*[aval(v) for v in ins])
        key = (str(traced), tuple(id(c) for c in traced.consts))
        return ins, outs, self._programs.setdefault(key, jax.jit(fn))

    def _streamed(self, fn, ins, outs):
        """``fn`` (of the values of ``ins``, giving those of ``outs``) run by
        :func:`stream.run` as the host offload runs its update: a disk leaf's input in pinned
        host memory, its new value written into it (``alias``), every other output on the
        device."""
        invars = self.closed.jaxpr.invars
        disk = {invars[i]: i for i in self.leaves}
        host = [v in disk for v in ins]
        specs = [self.in_specs.get(v, P()) for v in ins]
        alias, stays = {}, []
        for o, v in enumerate(outs):
            replaces = [i for i, w in self.state_out.items() if w is v and i in self.leaves]
            i = replaces[0] if replaces else None
            if i is not None and invars[i] in ins and ins.index(invars[i]) not in alias.values():
                alias[o] = ins.index(invars[i])
                stays.append(False)
            else:
                stays.append(True)
        mesh = self.shardings[0].mesh if self.shardings else None

        def run(*vals):
            return stream.run(
                fn, vals, mesh=mesh, specs=specs, host=host, device_outputs=stays, alias=alias
            )

        return run

    # -- the state -----------------------------------------------------------------------

    @property
    def window_bytes(self) -> int:
        """The host memory the swapper's window holds at most."""
        return 0 if self.swapper is None else self.swapper.buffer_count * self.swapper.buffer_bytes

    @property
    def programs(self) -> int:
        """How many programs the groups' updates compile to (one per distinct group)."""
        return len(self._programs)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the state file."""
        return 0 if self.swapper is None else self.swapper.file_bytes

    def fill(self, make) -> dict:
        """Write the state's first values to disk a group at a time, so that host and device
        memory hold one group's leaves at once, never the whole state.

        Args:
          make: ``make(indices) -> arrays``: the state leaves of those flat input indices
            (the optax state's, then the separate master's, then the EMA state's), computed
            now, in any sharding.

        Returns:
          The resident leaves, ``{flat input index: array}`` in their shardings.
        """
        if self.swapper is not None:
            _mark_updating(self.swapper.path)  # until every group holds the new state
        for g, leaves in enumerate(self.group_leaves):
            buffer = self.swapper.acquire(g)
            for i, x in zip(leaves, make(leaves), strict=True):
                self.leaves[i].from_device(jax.device_put(x, self.leaves[i].sharding), buffer)
                del x
            self.swapper.write_back(g, buffer)
        if self.swapper is not None:
            self.swapper.flush(sync=True)
            _unmark_updating(self.swapper.path)
            self.found_torn = None
        resident = [i for i, k in enumerate(self.kinds) if k == RESIDENT]
        arrays = make(resident) if resident else []
        return {
            i: jax.device_put(x, self.shardings[i]) for i, x in zip(resident, arrays, strict=True)
        }

    def read(self, resident: dict):
        """``(opt_state, master)`` as trees of global numpy arrays: the disk leaves read
        through the window a group at a time, the resident ones from the device (``master``
        None when it is the params).

        Args:
          resident: the resident leaves (:meth:`store`'s, or a step's).
        """
        flat = self._read_flat(resident, range(self.n_o + self.n_m))
        opt = jax.tree.unflatten(self.opt_tree, flat[: self.n_o])
        master = None
        if not self.master_on_device:
            master = jax.tree.unflatten(self.master_tree, flat[self.n_o : self.n_o + self.n_m])
        return opt, master

    def read_ema(self, resident: dict):
        """The EMA state (an :class:`~jaxzero.EmaState` of global numpy arrays, None without
        an EMA): its disk leaves read through the window a group at a time (only groups
        holding an EMA leaf; each leaf copied out of its buffer alone), its counter from the
        device.

        Args:
          resident: the resident leaves (a step's).
        """
        if self.ema is None:
            return None
        start = self.n_o + self.n_m
        flat = self._read_flat(resident, range(start, self.n_state))
        return jax.tree.unflatten(self.ema_tree, flat[start:])

    def _read_flat(self, resident: dict, wanted) -> list:
        """The flat state leaves of the indices ``wanted`` as global numpy arrays (None
        elsewhere): the disk ones read from the groups that hold one."""
        self._check_whole()
        wanted = set(wanted)
        flat: list = [None] * self.n_state
        for i, x in resident.items():
            if i in wanted:
                flat[i] = np.asarray(jax.device_get(x))
        groups = [g for g, leaves in enumerate(self.group_leaves) if wanted.intersection(leaves)]
        if self.swapper is not None and groups:
            for g, buffer in self.swapper.pipelined(groups, write=False):
                for i in self.group_leaves[g]:
                    if i not in wanted:
                        continue
                    leaf = self.leaves[i]
                    out = np.empty(leaf.shape, leaf.dtype)
                    for (_, index, _), view in zip(leaf.shards, leaf.views(buffer), strict=True):
                        out[index] = view
                    flat[i] = out
        return flat

    def leaf_array(self, i: int, buffer) -> jax.Array:
        """Disk leaf ``i`` (a flat input index) as a global array in its sharding on the
        devices, from its shards in its group's ``buffer``."""
        leaf = self.leaves[i]
        return jax.device_put(leaf.to_host(buffer), leaf.sharding)

    def check_whole(self) -> None:
        """Raise the part-updated error when an update failed in the middle of the groups."""
        self._check_whole()

    # -- a step --------------------------------------------------------------------------

    def run(self, resident: dict, grads, master, scale, step=None):
        """One update: the prologue, then every group through the window (its state updated on
        disk in place).

        Args:
          resident: the resident leaves, ``{flat input index: array}``.
          grads: the reduced gradients, in the master's shards (a tree like the master).
          master: the params as the master (``master_on_device``), in the master's shards;
            else None.
          scale: the loss scale (a scalar array) or None.
          step: the training step before this update (an int32 scalar), which gates the EMA;
            None without an EMA.

        Returns:
          ``(resident, compute)``: the new resident leaves and the new compute shards (a list
          in the master's leaf order, in the master's shards).
        """
        self._check_whole()
        jaxpr = self.closed.jaxpr
        invars = jaxpr.invars
        env: dict = {}
        n_o, n_m, n_s = self.n_o, self.n_m, self.n_state
        flat_in = [None] * len(invars)
        for i, x in resident.items():
            flat_in[i] = x
        if self.master_on_device:
            flat_in[n_o : n_o + n_m] = jax.tree.leaves(master)
        flat_in[n_s : n_s + n_m] = jax.tree.leaves(grads)
        if scale is not None:
            flat_in[n_s + n_m] = scale
        if self.ema is not None:
            flat_in[-1] = step
        for v, x in zip(invars, flat_in, strict=True):
            if x is not None:
                env[v] = x
        pro = self.plan.prologue
        env.update(zip(pro.outputs, self._prologue(*[env[v] for v in pro.inputs]), strict=True))
        var_leaf = {invars[i]: i for i in self.leaves}
        if self.swapper is not None:
            # a marker beside the file while its groups hold two steps: a process killed in
            # the middle leaves it, and the next state opened on the file says so
            _mark_updating(self.swapper.path)
            try:
                self._groups(env, var_leaf)
                self.swapper.flush()
                _unmark_updating(self.swapper.path)
            except BaseException as e:
                self.broken = (
                    f"the optimizer state file {self.swapper.path} was left part updated by an "
                    f"error in the middle of an update ({type(e).__name__}: {e}): its groups "
                    "hold different steps. Restore the run from its last checkpoint"
                )
                raise
        if self._device_fn is not None:
            ins, outs, fn = self._device_fn
            env.update(zip(outs, fn(*[env[v] for v in ins]), strict=True))
        value = lambda v: jnp.asarray(v.val) if isinstance(v, Literal) else env[v]
        new_resident = {i: value(self.state_out[i]) for i in resident}
        return new_resident, [value(v) for v in self.compute_out]

    def _groups(self, env, var_leaf) -> None:
        """Every group that updates through the window: its state from the buffer to the
        device, its parts with the prologue's values (``env``, which gains the outputs other
        values read), its new state back into the buffer, written behind."""
        for g, buffer in self.swapper.pipelined(range(self.updating)):
            ins, outs, fn = self._group_fns[g]
            local = {}
            for v in ins:
                i = var_leaf.get(v)
                local[v] = self.leaves[i].to_host(buffer) if i is not None else env[v]
            got = dict(zip(outs, fn(*[local[v] for v in ins]), strict=True))
            for i in self.group_leaves[g]:
                v = self.state_out[i]
                if isinstance(v, Var) and v in got:
                    self.leaves[i].from_device(got[v], buffer)
            # the group's new state is on disk now: only what else reads it stays, and the
            # group's device copies go before the next group's arrive
            env.update((v, x) for v, x in got.items() if v not in self._dropped)
            del local, got

    def _check_whole(self) -> None:
        if self.broken:
            raise RuntimeError(self.broken)

    def close(self) -> None:
        """Close the swapper's file (it stays on disk)."""
        if self.swapper is not None:
            self.swapper.close()
