"""Checkpoints of a state whose optimizer side is on disk (``ZeRO(offload=jz.NVMe(path))``,
decision 50), written and read a group of leaves at a time, so that the optimizer state is never
in host memory whole.

A step of such a checkpoint holds the items every jaxzero step holds, and one more:

- ``state``: the :class:`~jaxzero.TrainState` of the run, as the host offload's checkpoint
  holds it (the same leaves, paths, shapes, dtypes and checksums in ``metadata``), except the
  leaves kept on disk, which are absent (empty nodes); an EMA kept on disk is there too, as
  ``ema`` (its large leaves on disk like the master's);
- ``nvme`` (:data:`ITEM`): the leaves kept on disk, one Orbax PyTree checkpoint per group of
  the state file (``group_<g>``, the leaves keyed by their dotted ``state`` names), and
  ``leaves.json``: each group's leaves and each leaf's checksum (``metadata``'s hash), taken
  while the group passes. The item's handler reads each group through the swapper's window,
  writes it and waits for the write before it reads the next, inside Orbax's save of the step:
  the step's directory is renamed into place only when every item is written (a process
  killed in the middle leaves a temporary directory that no restore reads), and ``save``
  returns only when the disk leaves are written (the next step updates the file in place).

:func:`restore` makes a fresh state file under the ZeRO's NVMe directory (any device count:
each leaf is read straight into the new sharding) and fills it a group at a time, reading only
that group's leaves of the checkpoint (the others are Orbax placeholders), each verified
against its checksum before it is written. A step of a state in memory (the host offload's)
restores the same way, its disk leaves read from its ``state`` item (:class:`StateItem`); a step
of the NVMe tier restores into a state in memory through :func:`read_in_memory`, which
``jaxzero.checkpoint.restore`` calls for any ZeRO without ``nvme``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

import jaxzero.checkpoint.guards as guards
import jaxzero.checkpoint.integrity as integrity
import jaxzero.checkpoint.io as io
from jaxzero.checkpoint.integrity import CheckpointDamagedError
from jaxzero.checkpoint.structure import (
    EXTRA,
    METADATA,
    STATE,
    describe,
    flat_leaves,
    leaf_name,
    leaf_row,
)
from jaxzero.train.nvme_step import NVMeState, open_disk
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.state import TrainState
from jaxzero.zero.offload import parts

ITEM = "nvme"
INDEX = "leaves.json"


# --------------------------------------------------------------------------------- the item
class Handler(ocp.CheckpointHandler):
    """The :data:`ITEM` of a step: the disk leaves, a group at a time (see the module)."""

    def save(self, directory: epath.Path, args: Save) -> None:
        disk, names = args.disk, args.names
        directory = epath.Path(directory)
        groups, sums = [], {}
        writer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        passes = () if disk.swapper is None else disk.swapper.pipelined(write=False)
        try:
            for g, buffer in passes:
                arrays = {names[i]: disk.leaf_array(i, buffer) for i in disk.group_leaves[g]}
                sums.update(integrity.checksums(arrays))
                writer.save(directory / f"group_{g}", args=ocp.args.PyTreeSave(arrays))
                groups.append(sorted(arrays))
                del arrays  # this group's copies go before the next group's arrive
        finally:
            writer.close()
        if jax.process_index() == 0:
            index = {"groups": groups, integrity.KEY: {"algorithm": integrity.ALGORITHM}}
            index[integrity.KEY]["leaves"] = sums
            (directory / INDEX).write_text(json.dumps(index))

    def restore(self, directory: epath.Path, args: Restore | None = None) -> dict:
        """The item's index (``leaves.json``); the leaves are read by :func:`restore`."""
        return json.loads((epath.Path(directory) / INDEX).read_text())

    def metadata(self, directory: epath.Path) -> None:
        return None


@ocp.args.register_with_handler(Handler, for_save=True)
@dataclasses.dataclass
class Save(ocp.args.CheckpointArgs):
    """``disk``: the state's :class:`~jaxzero.zero.offload.nvme_update.DiskUpdate`;
    ``names``: each disk leaf's dotted name by flat index."""

    disk: Any
    names: dict


@ocp.args.register_with_handler(Handler, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.CheckpointArgs):
    """Reads the item's index."""


# --------------------------------------------------------------------------------- layout
def _names(opt_tree, master_tree, master_on_device: bool, ema_tree=None) -> dict[int, str]:
    """Each optimizer-state input's dotted ``state`` name by the update's flat index (the
    optax state's leaves, then the separate master's, then the EMA state's: ``ema_tree``,
    None without an EMA)."""
    n_o, n_m = opt_tree.num_leaves, master_tree.num_leaves
    opt = jax.tree.unflatten(opt_tree, list(range(n_o)))
    master = None
    if not master_on_device:
        master = jax.tree.unflatten(master_tree, list(range(n_o, n_o + n_m)))
    ema = None
    if ema_tree is not None:
        ema = jax.tree.unflatten(ema_tree, list(range(n_o + n_m, n_o + n_m + ema_tree.num_leaves)))
    skeleton = TrainState(
        step=None, params=None, master=master, opt_state=opt, skipped=None, ema=ema
    )
    return {i: leaf_name(path) for path, i in flat_leaves(skeleton).items()}


def _ema_tree(disk):
    """The EMA state's tree structure of ``disk`` (a DiskUpdate), None without an EMA."""
    return None if disk.ema is None else disk.ema_tree


def _on_disk(x) -> bool:
    """Whether the NVMe tier keeps a state leaf of this shape on disk (the update's rule)."""
    return int(np.prod(x.shape, dtype=np.int64)) > parts.SMALL


def _state_tree(state: NVMeState) -> TrainState:
    """The ``state`` item of ``state``: the host offload's TrainState without its disk leaves."""
    disk = state.disk
    n_o, n_m = disk.n_o, disk.n_m
    flat: list = [None] * disk.n_state
    for i, x in state.resident.items():
        flat[i] = x
    opt = jax.tree.unflatten(disk.opt_tree, flat[:n_o])
    master = (
        None
        if disk.master_on_device
        else jax.tree.unflatten(disk.master_tree, flat[n_o : n_o + n_m])
    )
    ema = None if disk.ema is None else jax.tree.unflatten(disk.ema_tree, flat[n_o + n_m :])
    return TrainState(
        ema=ema,
        step=state.step,
        params=state.params,
        master=master,
        opt_state=opt,
        skipped=state.skipped,
        loss_scale=state.loss_scale,
    )


# --------------------------------------------------------------------------------- save
def save(
    manager_or_dir,
    step,
    state: NVMeState,
    *,
    zero: ZeRO | None = None,
    ema=None,
    metadata: dict | None = None,
    extra=None,
    optimizer: str | None = None,
    wait: bool = False,
    force: bool = False,
) -> bool:
    """:func:`jaxzero.checkpoint.save` of an :class:`NVMeState` (see the module): the leaves on
    disk stream into the step a group at a time, and are written when this returns, also with
    an asynchronous manager (the next step updates the file in place).

    Raises:
      ValueError: ``ema`` is given for a state without an EMA; ``zero`` is not the ZeRO the
        state was trained with (another optimizer or precision); the step exists already.
      RuntimeError: the state's file was left part updated by a failed step, or is closed.
      Nothing is written.
    """
    if ema is not None and state.disk.ema is None:
        raise ValueError(
            f"ema={ema!r}: this NVMe state keeps no EMA (its step was made without ema=); "
            "save it without ema="
        )
    if zero is not None and not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO or None, got {type(zero).__name__}.")
    disk = state.disk
    disk.check_whole()
    if disk.swapper is not None and disk.swapper.closed:
        raise RuntimeError(
            f"the state's file {disk.swapper.path} is closed (NVMeState.close): nothing to save"
        )
    tree = _state_tree(state)
    if zero is not None:
        want = jax.tree.structure(zero.abstract_state(jax.tree.map(_aval, state.params)).opt_state)
        if want != disk.opt_tree:
            raise ValueError(
                "zero= is not the ZeRO this NVMe state was trained with: its optimizer state's "
                f"tree is {want}, the state's is {disk.opt_tree}"
            )
    names = _names(disk.opt_tree, disk.master_tree, disk.master_on_device, _ema_tree(disk))
    rows = [
        leaf_row(tuple(names[i].split(".")), leaf.shape, leaf.dtype)
        for i, leaf in sorted(disk.leaves.items())
    ]
    step = int(np.asarray(step))
    with io.opened(manager_or_dir, read_only=False) as mngr:
        guards.check_only_steps(mngr)
        guards.check_new_step(mngr, step)
        meta = describe(tree, zero=zero, optimizer=optimizer, metadata=metadata)
        meta["checkpoint_step"] = step
        meta["ema"] = guards.ema_settings(disk.ema)  # the EMA the state's step updates
        meta["has_extra"] = extra is not None
        meta[ITEM] = {"leaves": rows, "total_bytes": sum(r["bytes"] for r in rows)}
        extra = None if extra is None else io.host_tree(extra)
        meta[integrity.KEY] = io.state_checksums(tree, extra)
        items = {
            STATE: ocp.args.StandardSave(tree),
            METADATA: ocp.args.JsonSave(meta),
            ITEM: Save(disk, {i: names[i] for i in disk.leaves}),
        }
        if extra is not None:
            items[EXTRA] = ocp.args.StandardSave(extra)
        try:
            started = mngr.save(step, args=ocp.args.Composite(**items), force=force)
            if wait:
                mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - a write error is re-raised with the step
            if not integrity.is_write_error(e):
                raise
            raise io.save_failed(mngr, step, e) from e
        return bool(started)


def _aval(x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


# --------------------------------------------------------------------------------- restore


def _metadata_of_policy(mngr, step: int, has_master: bool, where: str) -> dict:
    """The step's metadata, once its precision policy is checked to keep a separate master
    exactly when the target does (``has_master``): the NVMe tier restores only into the
    policy it was saved with."""
    meta = io.read_metadata(mngr, step) or {}
    if bool(meta.get("has_master")) != has_master:
        raise ValueError(
            f"{where} was written with precision {meta.get('precision')} (separate master: "
            f"{meta.get('has_master')}), and the target's policy "
            f"{'keeps' if has_master else 'has no'} separate master: the NVMe tier restores "
            "only into the precision policy it was saved with"
        )
    return meta


def restore(
    manager_or_dir,
    zero: ZeRO,
    params,
    *,
    step: int | None = None,
    ema=None,
    model_state=None,
    rng=None,
    with_extra: bool = False,
    check_dtypes: bool = True,
    fallback: bool = False,
):
    """:func:`jaxzero.checkpoint.restore` into ``ZeRO(offload=jz.NVMe(path))``: an
    :class:`NVMeState` whose state file (a fresh one under ``path``, at ``zero``'s device
    count) is filled from the checkpoint a group at a time.

    A file a killed process left part updated in the directory is replaced (a warning names
    the process that left it); a file another live state holds is refused (its lock).

    Raises:
      ValueError: an option the NVMe tier does not take (``model_state=``, ``rng=``,
        ``fallback=True``, ``check_dtypes=False``), ``ema=`` for a step saved without an EMA
        or none for one with, a step saved from a state in
        memory, or from another precision policy or model; nothing is written.
      CheckpointDamagedError: a leaf read back differs from its checksum (the new file is
        closed; the run restores from another step).
    """
    for name, given in (("model_state", model_state), ("rng", rng)):
        if given is not None:
            raise ValueError(
                f"{name}= is not supported by the NVMe tier's restore (its state has no "
                f"{name}); restore without it"
            )
    if fallback or not check_dtypes:
        raise ValueError(
            "fallback=True and check_dtypes=False are not supported by the NVMe tier's "
            "restore yet: restore a given step with the dtypes it was saved with"
        )
    if isinstance(params, TrainState):
        raise ValueError(
            "the NVMe tier's restore takes the model params (arrays or ShapeDtypeStructs), not "
            "an abstract TrainState: the state's layout on disk follows from the params"
        )
    plain = dataclasses.replace(zero, nvme=None)
    shapes = jax.tree.map(_aval, params)
    abstract = plain.abstract_state(shapes, ema=ema)
    with io.opened(manager_or_dir) as mngr:
        step = io.resolve_step(mngr, step)
        directory = os.fspath(mngr.directory)
        where = f"checkpoint step {step} in {directory}"
        meta = _metadata_of_policy(mngr, step, abstract.master is not None, where)
        if bool(meta.get("has_ema")) != (ema is not None):
            raise ValueError(
                f"{where} was saved {'with' if meta.get('has_ema') else 'without'} an EMA, and "
                f"this restore {'passes' if ema is not None else 'passes no'} ema=: "
                + (
                    "pass ema=jz.ShardedEMA(<the decay it was trained with>) to restore it"
                    if meta.get("has_ema")
                    else "restore without ema="
                )
            )
        # the state item's target: the host offload's abstract state without the disk leaves
        master_on_device = abstract.master is None
        opt_tree = jax.tree.structure(abstract.opt_state)
        master_tree = jax.tree.structure(abstract.params if master_on_device else abstract.master)
        ema_tree = None if ema is None else jax.tree.structure(abstract.ema)
        n_o, n_m = opt_tree.num_leaves, master_tree.num_leaves
        flat = jax.tree.leaves(abstract.opt_state)
        if not master_on_device:
            flat += jax.tree.leaves(abstract.master)
        else:
            flat += [None] * n_m  # the params: not an optimizer-state input
        if ema is not None:
            flat += jax.tree.leaves(abstract.ema)
        names = _names(opt_tree, master_tree, master_on_device, ema_tree)
        on_disk = {i for i, x in enumerate(flat) if x is not None and _on_disk(x)}
        kept = [None if i in on_disk else x for i, x in enumerate(flat)]
        target = abstract.replace(
            opt_state=jax.tree.unflatten(opt_tree, kept[:n_o]),
            master=None
            if master_on_device
            else jax.tree.unflatten(master_tree, kept[n_o : n_o + n_m]),
            ema=None if ema is None else jax.tree.unflatten(ema_tree, kept[n_o + n_m :]),
        )
        stored = io.stored_tree(mngr, step)
        step_dir = epath.Path(directory) / str(step)
        sums = meta.get(integrity.KEY) or {}
        if io.has_item(mngr, step, ITEM):
            io.check_compatible(stored, target)
            saved = {r["path"]: r for r in (meta.get(ITEM) or {}).get("leaves", [])}
            for i in sorted(on_disk):
                row, x = saved.get(names[i]), flat[i]
                if (
                    row is None
                    or tuple(row["shape"]) != tuple(x.shape)
                    or row["dtype"] != x.dtype.name
                ):
                    raise ValueError(
                        f"{where} does not match the target state: its disk leaf {names[i]} "
                        f"is {row and (row['shape'], row['dtype'])}, the target's "
                        f"{(list(x.shape), x.dtype.name)}"
                    )
            index = mngr.restore(step, args=ocp.args.Composite(**{ITEM: Restore()}))[ITEM]
            source = Groups(step_dir / ITEM, index, step, directory)
            tree, extra = io.read_state(mngr, step, target, with_extra=with_extra)
        else:  # a step of a state in memory: its disk leaves are read from its state item
            io.missing_parts(stored, abstract, step=step, directory=directory)
            io.check_compatible(stored, abstract)
            source = StateItem(step_dir / STATE, abstract, sums, step, directory)
            tree = source.read_tree(target)
            extra = None
            if with_extra and io.has_item(mngr, step, EXTRA):
                args = ocp.args.Composite(**{EXTRA: ocp.args.StandardRestore()})
                extra = mngr.restore(step, args=args)[EXTRA]
        integrity.check(io.named_leaves(tree), sums, step=step, directory=directory)
        if extra is not None and sums:
            integrity.check(io.named_leaves(extra, "extra."), sums, step=step, directory=directory)
        guards.warn_ema_changed(meta, ema, step, directory)
        state = _fill(plain, zero, shapes, tree, names, source, step, directory, on_disk, ema)
        return (state, extra) if with_extra else state


def read_in_memory(mngr, step: int, target: TrainState, *, with_extra: bool):
    """``(state, extra)``: a step of the NVMe tier read into a state in memory (the host
    offload's, or any ZeRO's), ``target`` its abstract ``TrainState`` (the fp32 master's
    shapes). The ``state`` item is read as any step's, and each disk leaf from its group
    straight into ``target``'s sharding (a group at a time, verified against its checksum):
    the state is then in memory, where ``target``'s ZeRO keeps it.

    Raises:
      ValueError: ``target`` has another precision policy (a separate master or not), an
        EMA, model state or an rng key, or other leaves; nothing is read.
    """
    directory = os.fspath(mngr.directory)
    where = f"checkpoint step {step} in {directory}"
    meta = _metadata_of_policy(mngr, step, target.master is not None, where)
    rows = {r["path"]: r for r in (meta.get(ITEM) or {}).get("leaves", [])}
    flat = flat_leaves(target)
    on_disk = {p: x for p, x in flat.items() if leaf_name(p) in rows}
    stored = io.stored_tree(mngr, step)
    kept = jax.tree.unflatten(
        jax.tree.structure(target), [None if p in on_disk else x for p, x in flat.items()]
    )
    io.missing_parts(stored, kept, step=step, directory=directory)
    io.check_compatible(stored, kept)
    for p, x in on_disk.items():
        row = rows[leaf_name(p)]
        if tuple(row["shape"]) != tuple(x.shape) or row["dtype"] != jax.numpy.dtype(x.dtype).name:
            raise ValueError(
                f"{where} does not match the target state: its disk leaf {leaf_name(p)} is "
                f"{(row['shape'], row['dtype'])}, the target's {(list(x.shape), x.dtype)}"
            )
    if len(on_disk) != len(rows):
        missing = sorted(set(rows) - {leaf_name(p) for p in on_disk})
        raise ValueError(f"{where} has disk leaves the target state lacks: {missing}")
    index = mngr.restore(step, args=ocp.args.Composite(**{ITEM: Restore()}))[ITEM]
    state, extra = io.read_state(mngr, step, kept, with_extra=with_extra)
    sums = meta.get(integrity.KEY)
    integrity.check(io.named_leaves(state), sums, step=step, directory=directory)
    if extra is not None and sums:
        integrity.check(io.named_leaves(extra, "extra."), sums, step=step, directory=directory)
    groups = Groups(epath.Path(directory) / str(step) / ITEM, index, step, directory)
    read = groups.read({leaf_name(p): x for p, x in on_disk.items()})
    got = flat_leaves(state)
    leaves = [read[leaf_name(p)] if p in on_disk else got[p] for p in flat]
    return jax.tree.unflatten(jax.tree.structure(target), leaves), extra


def verify_groups(mngr, step: int, sharding_of) -> tuple[int, int]:
    """``(leaves compared with a checksum, leaves read)`` of a step's :data:`ITEM`, each
    group read whole in the shardings ``sharding_of(shape)`` gives and checked against
    ``leaves.json`` (:func:`jaxzero.checkpoint.verify`'s share of an NVMe step).

    Raises:
      CheckpointDamagedError: a leaf read back other numbers than were saved.
    """
    directory = os.fspath(mngr.directory)
    meta = io.read_metadata(mngr, step) or {}
    rows = {r["path"]: r for r in (meta.get(ITEM) or {}).get("leaves", [])}
    index = mngr.restore(step, args=ocp.args.Composite(**{ITEM: Restore()}))[ITEM]
    groups = Groups(epath.Path(directory) / str(step) / ITEM, index, step, directory)
    read = 0
    for names in index["groups"]:
        wanted = {}
        for n in names:
            shape = tuple(rows[n]["shape"])
            dtype = jax.numpy.dtype(rows[n]["dtype"])
            wanted[n] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_of(shape))
        got = groups.read(wanted)
        read += len(got)
        del got
    return sum(1 for group in index["groups"] for n in group if n in groups.sums), read


class Groups:
    """The disk leaves of a step of the NVMe tier: its :data:`ITEM`'s group checkpoints.

    Args:
      item: the step's item directory; index: its ``leaves.json``; step, directory: for
        messages.
    """

    def __init__(self, item, index: dict, step: int, directory):
        self.item, self.index, self.step, self.directory = item, index, step, directory
        self.group_of = {n: g for g, group in enumerate(index["groups"]) for n in group}
        self.sums = (index.get(integrity.KEY) or {}).get("leaves", {})

    def read(self, wanted: dict) -> dict:
        """``{name: array}`` of ``wanted`` (``{name: ShapeDtypeStruct with a sharding}``),
        each saved group read once for its wanted leaves alone, verified against its
        checksums."""
        by_group = collections.defaultdict(list)
        for name in wanted:
            by_group[self.group_of[name]].append(name)
        out = {}
        reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        try:
            for g, mine in by_group.items():
                target = {n: ocp.PLACEHOLDER for n in self.index["groups"][g]}
                target.update((n, wanted[n]) for n in mine)
                got = _read(reader, self.item / f"group_{g}", target)
                read = {n: got[n] for n in mine}
                file = f"{self.step}/{ITEM}/group_{g}"
                _verify(read, self.sums, self.step, self.directory, file)
                out.update(read)
                del got, read
        finally:
            reader.close()
        return out


class StateItem:
    """The disk leaves of a step of a state in memory (the host offload's): its ``state``
    item, read a few leaves at a time (every other leaf an Orbax placeholder).

    Args:
      path: the step's ``state`` directory; abstract: the full target ``TrainState``; sums:
        the metadata's checksums entry; step, directory: for messages.
    """

    def __init__(self, path, abstract: TrainState, sums: dict, step: int, directory):
        self.path, self.abstract, self.step, self.directory = path, abstract, step, directory
        self.sums = sums.get("leaves", {}) if sums.get("algorithm") == integrity.ALGORITHM else {}
        self.paths = {leaf_name(p): p for p in flat_leaves(abstract)}

    def _target(self, wanted: dict):
        flat = flat_leaves(self.abstract)
        for p in flat:
            name = leaf_name(p)
            flat[p] = wanted[name] if name in wanted else ocp.PLACEHOLDER
        return jax.tree.unflatten(jax.tree.structure(self.abstract), list(flat.values()))

    def read_tree(self, target: TrainState) -> TrainState:
        """``target`` (the abstract state with None where a leaf is on disk) read; the
        disk leaves are not."""
        wanted = {leaf_name(p): x for p, x in flat_leaves(target).items()}
        reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        try:
            got = _read(reader, self.path, self._target(wanted))
        finally:
            reader.close()
        return jax.tree.map(lambda x: None if x is ocp.PLACEHOLDER else x, got)

    def read(self, wanted: dict) -> dict:
        """:meth:`Groups.read`'s, from the state item."""
        reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        try:
            got = _read(reader, self.path, self._target(wanted))
        finally:
            reader.close()
        flat = {leaf_name(p): x for p, x in flat_leaves(got).items()}
        read = {n: flat[n] for n in wanted}
        _verify(read, self.sums, self.step, self.directory, f"{self.step}/{STATE}")
        return read


def _read(reader, path, target):
    return reader.restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
        ),
    )


def _fill(plain, zero, shapes, tree, names, source, step, directory, on_disk, ema) -> NVMeState:
    """The restored :class:`NVMeState`: a fresh file filled from ``source``'s disk leaves (a
    :class:`Groups` or a :class:`StateItem`) a group of the new file at a time; ``tree`` is
    the restored ``state`` item without the leaves ``on_disk`` (flat indices); ``ema``: the
    step's ShardedEMA, or None."""
    disk = open_disk(plain, zero.nvme, shapes, ema)
    torn = disk.found_torn
    try:
        if set(disk.leaves) != on_disk:  # the update's placement, against _on_disk's rule
            raise RuntimeError(
                f"the NVMe update keeps leaves {sorted(disk.leaves)} on disk, the checkpoint's "
                f"reader expected {sorted(on_disk)}"
            )
        # the resident leaves by the update's flat index (the optax state's, the master's,
        # the EMA state's)
        values: dict[int, Any] = {}
        kept = [i for i in range(disk.n_o) if i not in disk.leaves]
        got = jax.tree.leaves(tree.opt_state)
        if not disk.master_on_device:
            kept += [i for i in range(disk.n_o, disk.n_o + disk.n_m) if i not in disk.leaves]
            got += jax.tree.leaves(tree.master)
        if disk.ema is not None:
            kept += [i for i in range(disk.n_o + disk.n_m, disk.n_state) if i not in disk.leaves]
            got += jax.tree.leaves(tree.ema)
        values.update(zip(kept, got, strict=True))

        def make(indices):
            wanted = {
                names[i]: jax.ShapeDtypeStruct(
                    disk.leaves[i].shape, disk.leaves[i].dtype, sharding=disk.shardings[i]
                )
                for i in indices
                if i in disk.leaves
            }
            read = source.read(wanted) if wanted else {}
            return [read.pop(names[i]) if i in disk.leaves else values[i] for i in indices]

        resident = disk.fill(make)
    except BaseException:
        disk.close()  # the file stays, marked part written; its lock is released
        raise
    if torn:
        warnings.warn(f"{torn} values from checkpoint step {step} of {directory}", stacklevel=3)
    return NVMeState(tree.params, resident, tree.step, tree.skipped, tree.loss_scale, disk)


def _verify(arrays: dict, want: dict, step: int, directory, file: str) -> None:
    """Each leaf of ``arrays`` against its saved checksum."""
    got = integrity.checksums(arrays)
    for name, value in got.items():
        if name in want and want[name] != value:
            raise CheckpointDamagedError(
                f"checkpoint step {step} in {directory} is damaged: leaf {name} read back "
                f"other numbers than were saved (checksum {value}, saved {want[name]}; file "
                f"{file}).",
                step=step,
                leaf=name,
                directory=os.fspath(directory),
                file=file,
            )
