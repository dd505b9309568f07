"""Writing and reading jaxzero checkpoints (a thin adapter over Orbax's
``CheckpointManager``): :func:`manager`, :func:`save`, :func:`wait`, :func:`latest_step`,
:func:`load_metadata` and :func:`restore` (checked against the target, verified against the
checksums saved with it, optionally falling back to the newest step that verifies).

What a step holds and records is :mod:`jaxzero.checkpoint.structure`; the reports on a
checkpoint directory (``jaxzero inspect``) are :mod:`jaxzero.checkpoint.report`."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

import jaxzero.checkpoint.guards as guards
import jaxzero.checkpoint.integrity as integrity
import jaxzero.checkpoint.quiet as quiet
from jaxzero.checkpoint.adopt import describe_plain
from jaxzero.checkpoint.integrity import CheckpointDamagedError
from jaxzero.checkpoint.structure import EXTRA, METADATA, STATE, describe, flat_leaves, leaf_name
from jaxzero.checkpoint.trust import check_metadata
from jaxzero.ema import ema as sharded_ema
from jaxzero.ema.ema import ShardedEMA
from jaxzero.train.nvme_step import NVMeState
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.state import TrainState, check_not_donated
from jaxzero.trees import node_types
from jaxzero.zero.offload import remainder

# The NVMe tier's checkpoint (:mod:`jaxzero.checkpoint.nvme`) is built on this module: the
# package plugs it in when it loads (:func:`use_disk_tier`), and this module never imports it.
_disk_tier: Any = None


def use_disk_tier(tier) -> None:
    """Plug in the NVMe tier's checkpoint: its item in every manager, and the save, restore
    and read of a step whose optimizer state is on disk (the package calls it once)."""
    global _disk_tier
    _disk_tier = tier


# --------------------------------------------------------------------------------- manager
def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    nvme = _disk_tier

    for item, save_args, restore_args in (
        (STATE, ocp.args.StandardSave, ocp.args.StandardRestore),
        (EXTRA, ocp.args.StandardSave, ocp.args.StandardRestore),
        (METADATA, ocp.args.JsonSave, ocp.args.JsonRestore),
        (nvme.ITEM, nvme.Save, nvme.Restore),
    ):
        reg.add(item, save_args)
        reg.add(item, restore_args)
    return reg


def manager(
    directory,
    *,
    max_to_keep: int | None = None,
    save_interval_steps: int = 1,
    async_save: bool = True,
    read_only: bool = False,
    **options,
) -> ocp.CheckpointManager:
    """An ``orbax.checkpoint.CheckpointManager`` configured for jaxzero checkpoints.

    Args:
      directory: the root directory (created unless ``read_only``); steps are its
        sub-directories ``<step>/{state,metadata,extra}``.
      max_to_keep: keep only the newest this many complete steps (None: keep all).
      save_interval_steps: :func:`save` writes only steps that are multiples of this
        (other calls return False), plus the first save into an empty directory (Orbax's
        ``InitialSavePolicy``).
      async_save: write in a background thread; ``save`` returns once the arrays are copied
        to host memory (the state may then be donated / updated). Call
        ``mngr.wait_until_finished()`` before reading the checkpoint, and ``mngr.close()``
        at the end.
      read_only: open for restoring only: nothing is created, written or deleted.
      **options: any further ``ocp.CheckpointManagerOptions`` field.

    Leftover temporary directories of interrupted saves are removed when a writable manager
    is created (``cleanup_tmp_directories``), so create it from the (single) training job.
    """
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
        raise ValueError(f"max_to_keep={max_to_keep!r} must be a positive int or None (keep all).")
    if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
        raise ValueError(f"save_interval_steps={save_interval_steps!r} must be an int >= 1.")
    opts = dict(
        max_to_keep=max_to_keep,
        save_interval_steps=0 if read_only else save_interval_steps,
        enable_async_checkpointing=async_save,
        create=not read_only,
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
    )
    opts.update(options)
    path = epath.Path(os.fspath(directory)).absolute()
    with quiet.orbax_calls():
        return ocp.CheckpointManager(
            path, options=ocp.CheckpointManagerOptions(**opts), handler_registry=_registry()
        )


def _open(manager_or_dir, *, read_only: bool) -> tuple[ocp.CheckpointManager, bool]:
    """(manager, owned): a directory opens a manager that the caller must close."""
    if isinstance(manager_or_dir, ocp.CheckpointManager):
        return manager_or_dir, False
    if isinstance(manager_or_dir, (str, os.PathLike, epath.Path)):
        path = epath.Path(os.fspath(manager_or_dir))
        if read_only and not path.is_dir():
            raise FileNotFoundError(f"checkpoint directory {os.fspath(path)} does not exist.")
        if read_only:
            # Not orbax's read_only (which logs warnings): no directory creation, no tmp
            # cleanup, and this manager never saves, so nothing is written or deleted.
            return manager(
                path, async_save=False, create=False, cleanup_tmp_directories=False
            ), True
        return manager(path, async_save=False), True
    raise TypeError(
        f"expected a checkpoint directory or an orbax.checkpoint.CheckpointManager (from "
        f"jaxzero.checkpoint.manager), got {type(manager_or_dir).__name__}."
    )


def _settle(mngr: ocp.CheckpointManager) -> None:
    """Let a caller's manager finish its in-flight save, so that every step it lists is
    complete on disk (an unfinished step is never read)."""
    if mngr.is_saving_in_progress():
        mngr.wait_until_finished()


@contextlib.contextmanager
def opened(manager_or_dir, *, read_only: bool = True) -> Iterator[ocp.CheckpointManager]:
    """The manager to use inside a ``with``: a directory opens one that is closed on leaving
    (closing waits for its saves); a caller's manager is used as is and left open, after its
    in-flight save has finished when reading (:func:`_settle`). Orbax's routine warnings are
    dropped inside (:func:`jaxzero.checkpoint.quiet.orbax_calls`)."""
    with quiet.orbax_calls():
        mngr, owned = _open(manager_or_dir, read_only=read_only)
        try:
            if read_only and not owned:
                _settle(mngr)
            yield mngr
        finally:
            if owned:
                mngr.close()


# --------------------------------------------------------------------------------- steps
def partial_saves(directory) -> list[str]:
    """The names of the interrupted or in-progress saves (Orbax's temporary step
    directories) in ``directory``, which no read ever considers."""
    path = epath.Path(os.fspath(directory))
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if ".orbax-checkpoint-tmp" in p.name)


def resolve_step(mngr: ocp.CheckpointManager, step) -> int:
    """``step`` checked to be a complete step of ``mngr`` (None: the newest complete step);
    FileNotFoundError names the complete steps, or what the directory holds instead."""
    steps = sorted(mngr.all_steps())
    if not steps:
        partial = partial_saves(mngr.directory)
        hint = f" (only interrupted/in-progress saves: {', '.join(partial)})" if partial else ""
        raise FileNotFoundError(
            f"no complete checkpoint step in {os.fspath(mngr.directory)}{hint}."
            + (describe_plain(mngr.directory) or guards.step_directory_hint(mngr.directory))
        )
    if step is None:
        return steps[-1]
    step = int(step)
    if step not in steps:
        raise FileNotFoundError(
            f"step {step} is not a complete checkpoint in {os.fspath(mngr.directory)}; "
            f"complete steps: {steps}."
        )
    return step


def latest_step(manager_or_dir) -> int | None:
    """The newest complete step (None when there is none)."""
    with opened(manager_or_dir) as mngr:
        return mngr.latest_step()


# --------------------------------------------------------------------------------- save
def host_tree(tree):
    """``extra`` as host numpy arrays (small; replicated values read on every process)."""

    def leaf(x):
        if isinstance(x, np.ndarray):
            return x
        if isinstance(x, jax.Array):
            return np.asarray(jax.device_get(x))
        if isinstance(x, (bool, int, float, np.generic)):
            return np.asarray(x)
        raise TypeError(
            f"extra leaves must be arrays or numbers, got {type(x).__name__}; put strings and "
            f"other JSON data in metadata= instead."
        )

    return jax.tree.map(leaf, tree)


def save(
    manager_or_dir,
    step,
    state: TrainState,
    *,
    zero: ZeRO | None = None,
    ema: ShardedEMA | None = None,
    metadata: dict | None = None,
    extra=None,
    optimizer: str | None = None,
    wait: bool = False,
    force: bool = False,
) -> bool:
    """Save ``state`` (sharded: each process writes only its own shards) at ``step``.

    Args:
      manager_or_dir: a manager from :func:`manager` (asynchronous saves), or a directory
        (a manager is opened, the save completes and the manager is closed).
      step: the step number (the checkpoint's directory name).
      state: the :class:`~jaxzero.TrainState`, or the NVMe tier's
        :class:`~jaxzero.train.nvme_step.NVMeState` (its disk leaves streamed a group at a
        time: :mod:`jaxzero.checkpoint.nvme`).
      zero: the ``ZeRO`` that built ``state``: records stage, mesh axis, precision policy
        and optimizer in the metadata (optional but recommended).
      ema: the ``ShardedEMA`` the step updates ``state.ema`` with: records its settings
        (decay, schedule, ...), so that a restore with other settings warns.
      metadata: JSON-serialisable user metadata (stored under ``"user"``).
      extra: a small pytree of arrays/numbers saved alongside (e.g. the data-loader
        position); read back with ``restore(..., with_extra=True)``.
      optimizer: a description of the optimizer (default: ``repr(zero.tx)``).
      wait: block until this save is committed.
      force: save even when ``save_interval_steps`` would skip this step.

    Returns:
      Whether a save was started (False when the manager's ``save_interval_steps`` skips
      ``step``).

    Raises:
      ValueError: ``state`` was donated to a train step; the directory holds files that are
        not checkpoint steps; ``step`` exists already or is older than the newest step.
        Nothing is written.
    """
    if isinstance(state, NVMeState):  # the optimizer state on disk: streamed a group at a time
        nvme = _disk_tier
        return nvme.save(
            manager_or_dir,
            step,
            state,
            zero=zero,
            ema=ema,
            metadata=metadata,
            extra=extra,
            optimizer=optimizer,
            wait=wait,
            force=force,
        )
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a jaxzero.TrainState, got {type(state).__name__}.")
    if zero is not None and not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO or None, got {type(zero).__name__}.")
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    check_not_donated(state)
    state.check_flushed("jaxzero.checkpoint.save")
    step = int(np.asarray(step))
    # A bucketed EMA is stored per leaf (a local slice, no communication): the on-disk format
    # does not depend on ShardedEMA(bucket_leaves_up_to=...), N or the stage.
    state = sharded_ema.to_per_leaf(state)
    # The master as fp32 (a remainder master joined with the params): the checkpoint is the
    # same whatever offload keeps, and restores into any setting and device count.
    state = state.replace(master=state.fp32_master())
    with opened(manager_or_dir, read_only=False) as mngr:
        guards.check_only_steps(mngr)
        guards.check_new_step(mngr, step)
        meta = describe(state, zero=zero, optimizer=optimizer, metadata=metadata)
        meta["checkpoint_step"] = step
        meta["ema"] = guards.ema_settings(ema)
        meta["has_extra"] = extra is not None
        extra = None if extra is None else host_tree(extra)
        meta[integrity.KEY] = state_checksums(state, extra)
        items = {STATE: ocp.args.StandardSave(state), METADATA: ocp.args.JsonSave(meta)}
        if extra is not None:
            items[EXTRA] = ocp.args.StandardSave(extra)
        try:
            started = mngr.save(step, args=ocp.args.Composite(**items), force=force)
            if wait:  # an opened directory's manager waits when it is closed
                mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - a write error is re-raised with the step
            if not integrity.is_write_error(e):
                raise
            raise save_failed(mngr, step, e) from e
        return bool(started)


def wait(mngr: ocp.CheckpointManager) -> None:
    """Block until ``mngr``'s asynchronous save is committed. A failed write raises OSError
    naming the step (``mngr.wait_until_finished()`` raises Orbax's own error instead).

    ``mngr`` must be the manager that saves: a directory is refused (TypeError), because a
    manager opened on it anew has no save in flight and would return at once while the
    training loop's manager is still writing."""
    if not isinstance(mngr, ocp.CheckpointManager):
        raise TypeError(
            f"wait needs the CheckpointManager that saves (from jaxzero.checkpoint.manager), "
            f"got {type(mngr).__name__} {mngr!r}; only that manager knows its saves in "
            f"flight: mngr = jaxzero.checkpoint.manager(directory); "
            f"jaxzero.checkpoint.save(mngr, ...); jaxzero.checkpoint.wait(mngr)."
        )
    try:
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - a write error is re-raised with the step
        if not integrity.is_write_error(e):
            raise
        raise save_failed(mngr, None, e) from e


def state_checksums(state: TrainState, extra) -> dict:
    """The metadata's ``checksums`` entry: every leaf's hash (:mod:`integrity`), taken now,
    before an asynchronous save copies the same arrays."""
    leaves = integrity.checksums({leaf_name(k): v for k, v in flat_leaves(state).items()})
    if extra is not None:
        leaves.update(
            integrity.checksums({"extra." + leaf_name(k): v for k, v in flat_leaves(extra).items()})
        )
    return {"algorithm": integrity.ALGORITHM, "leaves": leaves}


def save_failed(mngr: ocp.CheckpointManager, step: int | None, error: Exception) -> OSError:
    """A failed write (disk full, file too large, ...), possibly of an earlier asynchronous
    save: an OSError naming the step that failed and the newest complete step."""
    failed = integrity.failed_step(error)
    if failed is not None:
        which = f"step {failed}"
    else:
        which = "the last asynchronous save" if step is None else f"step {step} (or an earlier one)"
    leaf = integrity.leaf_of(error)
    try:
        latest = mngr.latest_step()
    except Exception:  # noqa: BLE001 - the report must not hide the original error
        latest = None
    return OSError(
        f"saving checkpoint {which} in {os.fspath(mngr.directory)} failed"
        f"{f' writing leaf {leaf}' if leaf else ''}: {integrity.first_line(error)}. The "
        f"incomplete step is never restored; the newest complete step is {latest}. Free "
        f"space (or raise the file-size limit) and save again."
    )


# --------------------------------------------------------------------------------- read
def has_item(mngr: ocp.CheckpointManager, step: int, item: str) -> bool:
    """Whether ``step`` holds ``item`` (:data:`~jaxzero.checkpoint.structure.ITEMS`)."""
    step_dir = epath.Path(os.fspath(mngr.directory)) / str(step)
    if step_dir.is_dir():
        return (step_dir / item).is_dir()
    md = mngr.item_metadata(step)
    return item in md and md[item] is not None


def read_metadata(mngr: ocp.CheckpointManager, step: int) -> dict | None:
    """``step``'s JSON metadata, checked as untrusted input
    (:func:`jaxzero.checkpoint.trust.check_metadata`); None when the step has none."""
    if not has_item(mngr, step, METADATA):
        return None
    out = mngr.restore(step, args=ocp.args.Composite(**{METADATA: ocp.args.JsonRestore()}))
    where = f"step {step} in {os.fspath(mngr.directory)}"
    return check_metadata(out[METADATA], where)


def load_metadata(manager_or_dir, step: int | None = None) -> dict:
    """The JSON metadata saved with ``step`` (default: newest complete step)."""
    with opened(manager_or_dir) as mngr:
        step = resolve_step(mngr, step)
        meta = read_metadata(mngr, step)
        if meta is None:
            raise ValueError(f"step {step} has no {METADATA!r} item (not a jaxzero checkpoint).")
        return meta


def stored_tree(mngr: ocp.CheckpointManager, step: int) -> dict:
    """``step``'s stored state tree as Orbax's flat ``{path tuple: array metadata}`` (no
    array is read); ValueError when the step has no state item (not a jaxzero checkpoint)."""
    md = mngr.item_metadata(step)
    if md is None or STATE not in md or md[STATE] is None:
        raise ValueError(
            f"step {step} in {os.fspath(mngr.directory)} has no {STATE!r} item; it was not "
            f"written by jaxzero.checkpoint.save. A plain orbax checkpoint of a Flax run "
            f"(params, opt_state, step) continues under jaxzero with "
            f"jaxzero.checkpoint.adopt(directory, step)."
        )
    tree = md[STATE]
    return flat_leaves(getattr(tree, "tree", tree))


# --------------------------------------------------------------------------------- restore
class DamagedStepWarning(UserWarning):
    """``restore(..., fallback=True)`` passed over damaged steps (named in the message)."""


def restore(
    manager_or_dir,
    zero: ZeRO,
    params_or_abstract_state,
    *,
    step: int | None = None,
    ema: ShardedEMA | None = None,
    model_state=None,
    rng=None,
    with_extra: bool = False,
    check_dtypes: bool = True,
    fallback: bool = False,
):
    """Restore a :class:`~jaxzero.TrainState` directly into ``zero``'s shardings (with
    ``ZeRO(offload=jz.NVMe(path))``: an ``NVMeState`` with a fresh state file, filled a group
    at a time: :func:`jaxzero.checkpoint.nvme.restore`).

    The target is ``zero.abstract_state(params, ema=ema, model_state=..., rng=...)`` (or the
    given abstract ``TrainState``, re-sharded for ``zero``); Orbax reads each array straight
    into its target sharding, so each device only loads its own shard. A checkpoint written at
    one device count / stage / mesh restores at any other. Every array read is checked against
    the checksum saved with it (steps saved before checksums existed are read unchecked).

    Args:
      manager_or_dir: a manager or a checkpoint directory (opened read-only).
      zero: the ``ZeRO`` to restore for (its mesh and stage decide the shardings).
      params_or_abstract_state: the model params (arrays or ShapeDtypeStructs; only shapes
        and dtypes are used), or an (abstract) ``TrainState``.
      step: the step to restore; None: the newest complete step.
      ema: the ``ShardedEMA`` when the state carries an EMA (must match the checkpoint). Its
        ``bucket_leaves_up_to`` decides the restored EMA's storage (given an abstract
        ``TrainState``, its EMA's storage does); the checkpoint, always per-leaf on disk,
        restores into either. Settings (decay, schedule, ...) other than those
        ``save(..., ema=)`` recorded give a warning naming both.
      model_state, rng: templates of those state fields, when the state has them.
      with_extra: also return the ``extra`` tree saved with the step (None if none was).
      check_dtypes: refuse leaves whose stored dtype differs from the target's; False casts
        them. Across precision policies the master carries the weights (no flag needed): a
        checkpoint without a separate master (fp32) restores into a ``ZeRO`` that keeps one
        (bf16/fp16 params) with its params as the master and their cast as the compute
        params; a checkpoint with a master restores into an fp32 ``ZeRO`` with the master as
        the params.
      fallback: with ``step=None``, a damaged newest step (unreadable, or its numbers differ
        from its checksums) is passed over for the newest step that verifies; a
        :class:`DamagedStepWarning` names the steps passed over and why.

    Returns:
      The restored ``TrainState``, or ``(state, extra)`` with ``with_extra=True``.

    Raises:
      FileNotFoundError: no such directory, no complete step, or ``step`` not complete.
      ValueError: the stored tree differs from the target (the first missing / mis-shaped /
        extra leaf path is named); nothing is restored.
      CheckpointDamagedError: (a ValueError) the step (with ``fallback``: every step) is
        damaged; the step, the damaged file and the leaf are named.
    """
    if not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO, got {type(zero).__name__}.")
    if zero.nvme is not None:  # an NVMeState, its file filled a group at a time
        nvme = _disk_tier
        return nvme.restore(
            manager_or_dir,
            zero,
            params_or_abstract_state,
            step=step,
            ema=ema,
            model_state=model_state,
            rng=rng,
            with_extra=with_extra,
            check_dtypes=check_dtypes,
            fallback=fallback,
        )
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    if fallback and step is not None:
        raise ValueError(
            f"fallback=True picks the newest step that verifies; it cannot be combined with "
            f"step={step!r}. Pass step=None, or fallback=False to restore exactly step {step}."
        )
    with opened(manager_or_dir) as mngr:
        # Checkpoints hold the per-leaf EMA; a bucketed target is filled after the read.
        target, threshold = _target(zero, params_or_abstract_state, ema, model_state, rng)
        read = dict(check_dtypes=check_dtypes, with_extra=with_extra, ema=ema)
        # checkpoints hold the fp32 master: read it, then split the leaves the target keeps
        # as remainders against the restored params
        plain = target.replace(master=_fp32_master_shapes(target.master))
        state, extra = _first_that_verifies(mngr, step, plain, fallback, **read)
        if target.master is not None:
            master = remainder.stored_like(state.master, state.params, target.master)
            state = state.replace(master=master)
        if threshold:
            state = state.replace(
                ema=sharded_ema.store(
                    state.ema, zero.mesh, zero.axis, threshold, leaf_specs=zero.ema_leaf_specs
                )
            )
        return (state, extra) if with_extra else state


def _first_that_verifies(mngr, step, target, fallback: bool, **read):
    """``(state, extra)`` of ``step`` (None: the newest); with ``fallback``, of the newest step
    that verifies, warning about the damaged steps passed over (``read``: _restore_step's)."""
    first = resolve_step(mngr, step)
    if not fallback:
        return _restore_step(mngr, first, target, **read)
    passed: list[CheckpointDamagedError] = []
    for s in sorted((s for s in mngr.all_steps() if s <= first), reverse=True):
        try:
            out = _restore_step(mngr, s, target, **read)
        except CheckpointDamagedError as e:
            passed.append(e)
            continue
        if passed:
            warnings.warn(_passed_over(passed, s), DamagedStepWarning, stacklevel=4)
        return out
    raise CheckpointDamagedError(
        f"no step of {os.fspath(mngr.directory)} verifies: {_passed_over(passed, None)}",
        step=passed[0].step,
        leaf=passed[0].leaf,
        directory=os.fspath(mngr.directory),
        file=passed[0].file,
    )


def _passed_over(passed: list[CheckpointDamagedError], restored: int | None) -> str:
    steps = ", ".join(str(e.step) for e in passed)
    why = " ".join(f"[step {e.step}: {e}]" for e in passed)
    head = f"passed over damaged step(s) {steps}"
    return f"{head}; restored step {restored}. {why}" if restored is not None else f"{head}. {why}"


def _restore_step(
    mngr, step: int, target: TrainState, *, check_dtypes: bool, with_extra: bool, ema=None
):
    """``(state, extra)`` of one step: checked against ``target``, read in the stored dtypes,
    verified against the saved checksums, then cast / given a master as ``target`` needs;
    warns when ``ema``'s settings differ from those saved with the step."""
    nvme = _disk_tier
    if has_item(mngr, step, nvme.ITEM):  # a step of the NVMe tier: its disk leaves beside
        return nvme.read_in_memory(mngr, step, target, with_extra=with_extra)
    directory = os.fspath(mngr.directory)
    meta = _damaged_if_raises(
        lambda: read_metadata(mngr, step), step, directory, "metadata", f"{METADATA}/metadata"
    )
    stored = _damaged_if_raises(
        lambda: stored_tree(mngr, step), step, directory, "state tree", f"{STATE}/_METADATA"
    )
    read_target, finish = _read_plan(stored, target, check_dtypes)
    context = "" if meta is None else _mismatch_hints(meta, target)
    missing_parts(stored, read_target, step=step, directory=directory)
    check_compatible(stored, read_target, check_dtypes=True, context=context)
    items = (STATE, EXTRA) if with_extra else (STATE,)
    files = integrity.step_files(directory, step, items)
    state = extra = None
    if files.damaged:  # a missing or truncated file: found before any array is read
        problem = integrity.files_error(files, step=step, directory=directory)
    else:
        state, extra, problem = _read_state_quietly(mngr, step, read_target, with_extra, files)
    # Every process reads other files: all learn whether any read failed, so that all raise
    # (none waits in the checksum all-gather for one that gave up).
    if integrity.any_process_failed(problem):
        raise problem or integrity.read_error(None, step=step, directory=directory)
    sums = (meta or {}).get(integrity.KEY)
    integrity.check(named_leaves(state), sums, step=step, directory=directory, files=files)
    if extra is not None and sums:
        integrity.check(
            named_leaves(extra, "extra."), sums, step=step, directory=directory, files=files
        )
    guards.warn_ema_changed(meta, ema, step, directory)
    return finish(state), extra


def _damaged_if_raises(fn, step: int, directory: str, what: str, file: str):
    """``fn()``; a failure to read ``what`` (its ``file`` under the step directory) is a
    CheckpointDamagedError naming the file, raised without Orbax's traceback."""
    try:
        return fn()
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointDamagedError) or "has no 'state' item" in str(e):
            raise
        why = integrity.first_line(e)
    raise CheckpointDamagedError(
        f"checkpoint step {step} in {directory} is damaged: its {what} (file {step}/{file}) "
        f"could not be read ({why}).",
        step=step,
        directory=directory,
        file=f"{step}/{file}",
    )


def _read_state_quietly(mngr, step: int, target: TrainState, with_extra: bool, files):
    """``(state, extra, None)``, or ``(None, None, error)`` when the read fails: a
    CheckpointDamagedError naming the file the failed key is in. Orbax's error is not
    chained to it (its traceback is asyncio's and tensorstore's, not the user's), and what
    the failed read left behind is collected at once, unreported (:mod:`.quiet`)."""
    directory = os.fspath(mngr.directory)
    try:
        state, extra = read_state(mngr, step, target, with_extra=with_extra)
        return state, extra, None
    except Exception as e:  # noqa: BLE001 - any read failure of a step that passed the checks
        if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e):
            raise
        problem = integrity.read_error(e, step=step, directory=directory, files=files)
    quiet.collect_leftovers()
    return None, None, problem


def named_leaves(tree, prefix: str = "") -> dict[str, Any]:
    return {prefix + leaf_name(k): v for k, v in flat_leaves(tree).items()}


def _read_plan(stored: dict, target: TrainState, check_dtypes: bool):
    """``(read_target, finish)``: the tree to read (the stored dtypes, so that the checksums
    compare what was saved) and the function that turns it into ``target``.

    Across precision policies the master carries the weights: an fp32 checkpoint (no separate
    master) restored into a ZeRO that keeps one (bf16/fp16 params) reads its params as the
    master, and the compute params are their cast; a checkpoint with a master restored into
    a ZeRO without one (fp32) takes its master as the params."""
    stored_master = any(k[0] == "master" for k in stored)
    master_from_params = target.master is not None and not stored_master
    params_from_master = target.master is None and stored_master
    read = target
    if master_from_params:
        read = target.replace(params=target.master, master=None)
    elif params_from_master:
        # Read the stored 16-bit params as they are (they are dropped) and the master into
        # the params' shardings.
        read = target.replace(params=_with_stored_dtypes(target, stored).params)
        read = read.replace(master=target.params)
    if not check_dtypes:
        read = _with_stored_dtypes(read, stored)

    def finish(state: TrainState) -> TrainState:
        if master_from_params:
            state = state.replace(master=state.params)
        elif params_from_master:
            state = state.replace(params=state.master, master=None)
        return jax.tree.map(_cast_to, state, target)

    return read, finish


def _with_stored_dtypes(target, stored: dict):
    flat = flat_leaves(target)
    out = {}
    for path, leaf in flat.items():
        dtype = getattr(stored.get(path), "dtype", None) or leaf.dtype
        out[path] = jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
    return jax.tree.unflatten(jax.tree.structure(target), [out[p] for p in flat])


def _cast_to(x, want):
    """``x`` in ``want``'s dtype and sharding (a no-op when both already match)."""
    if x.dtype != want.dtype:
        x = x.astype(want.dtype)
    sharding = getattr(want, "sharding", None)
    if sharding is not None and x.sharding != sharding:
        x = jax.device_put(x, sharding)
    return x


def read_state(
    mngr: ocp.CheckpointManager, step: int, target: TrainState, *, with_extra: bool
) -> tuple[TrainState, Any]:
    """``(state, extra)``: ``step``'s state read straight into ``target``'s shardings, and its
    ``extra`` tree (None unless asked for and saved)."""
    items = {STATE: ocp.args.StandardRestore(target)}
    has_extra = with_extra and has_item(mngr, step, EXTRA)
    if has_extra:
        items[EXTRA] = ocp.args.StandardRestore()
    out = mngr.restore(step, args=ocp.args.Composite(**items))
    return out[STATE], (out[EXTRA] if has_extra else None)


# --------------------------------------------------------------------------------- restore checks
def check_compatible(stored: dict, target, *, check_dtypes: bool = True, context: str = "") -> None:
    """Raise ValueError naming the first path where ``target`` and the stored tree differ.

    ``stored`` is the flat (path tuple -> ArrayMetadata) dict of the checkpoint; ``target``
    the abstract state. Missing (in target, not stored) paths are reported first in target
    order, then shape / dtype mismatches, then extra (stored, not in target) paths.
    """
    want = flat_leaves(target)
    for path, leaf in want.items():
        if path not in stored:
            raise ValueError(
                f"checkpoint does not match the target state: leaf {leaf_name(path)} "
                f"(shape {tuple(leaf.shape)}) is missing from the checkpoint.{context}"
            )
        got = stored[path]
        got_shape = tuple(getattr(got, "shape", np.shape(got)) or ())
        if tuple(leaf.shape) != got_shape:
            raise ValueError(
                f"checkpoint does not match the target state: leaf {leaf_name(path)} has shape "
                f"{got_shape} in the checkpoint but {tuple(leaf.shape)} in the target "
                f"(a different model?).{context}"
            )
        got_dtype = getattr(got, "dtype", None)
        if check_dtypes and got_dtype is not None and jnp.dtype(got_dtype) != jnp.dtype(leaf.dtype):
            raise ValueError(
                f"checkpoint does not match the target state: leaf {leaf_name(path)} is "
                f"{jnp.dtype(got_dtype).name} in the checkpoint but {jnp.dtype(leaf.dtype).name} "
                f"in the target (a different precision policy?); pass check_dtypes=False to "
                f"cast on restore.{context}"
            )
    for path, got in stored.items():
        if path not in want:
            raise ValueError(
                f"checkpoint does not match the target state: the checkpoint has leaf "
                f"{leaf_name(path)} (shape {tuple(getattr(got, 'shape', ()) or ())}) that the target "
                f"state lacks.{context}"
            )


def _mismatch_hints(meta: dict, target: TrainState) -> str:
    """Sentences for a :func:`check_compatible` error: where the checkpoint's metadata shows
    that ``target`` was built differently (optimizer, EMA, precision)."""
    hints = ""
    ckpt_opt = ", ".join(meta.get("opt_state_types") or []) or "none"
    here_opt = ", ".join(node_types(target.opt_state)) or "none"
    if ckpt_opt != here_opt:
        hints += f" The checkpoint's optimizer state is [{ckpt_opt}], the target's is [{here_opt}]."
    if meta.get("has_ema") and target.ema is None:
        hints += " The checkpoint has an EMA: pass ema=ShardedEMA(...)."
    if meta.get("has_master") is not None and meta["has_master"] != (target.master is not None):
        hints += (
            f" The checkpoint was written with precision {meta.get('precision')} "
            f"(separate master: {meta['has_master']})."
        )
    return hints


_PARTS = {
    "model_state": (
        "model state",
        "model_state=<the model's non-trainable collections, e.g. variables['batch_stats']> "
        "(a template: only shapes and dtypes are used; the saved values are restored)",
    ),
    "rng": (
        "an rng key",
        "rng=jax.random.key(0) (a template: any key; the saved key is restored)",
    ),
}

FRESH_EMA = (
    "restore without ema=, then start the EMA from the restored weights: "
    "`state = state.replace(ema=zero.init(jz.gather(state.fp32_master() if state.master is "
    "not None else state.params), ema=jz.ShardedEMA(...), model_state=state.model_state).ema)`"
)


def missing_parts(stored: dict, target: TrainState, *, step: int, directory) -> None:
    """Raise ValueError when the checkpoint has a part of the state (model state, rng, EMA)
    that the restore call did not ask for, or lacks one it asked for: naming the part and
    the argument to pass or drop (instead of the first differing leaf)."""
    tops = {path[0] for path in stored if path}
    where = f"checkpoint step {step} in {directory}"
    for field, (what, how) in _PARTS.items():
        has, wants = field in tops, bool(jax.tree.leaves(getattr(target, field)))
        if has and not wants:
            leaves = [leaf_name(p) for p in stored if p and p[0] == field]
            raise ValueError(
                f"{where} has {what} ({len(leaves)} leaves, e.g. {leaves[0]}) and this restore "
                f"call gave none: pass {how}."
            )
        if wants and not has:
            raise ValueError(
                f"{where} has no {what}, but this restore call passed {field}=: drop it (the "
                f"checkpoint was saved from a state without {what})."
            )
    if target.ema is not None and "ema" not in tops:
        raise ValueError(
            f"{where} has no EMA (it was saved from a state without ShardedEMA), but this "
            f"restore call passed ema=. To start a fresh EMA: {FRESH_EMA}."
        )
    if target.ema is None and "ema" in tops:
        leaves = sorted((leaf_name(p) for p in stored if p[0] == "ema"), key=len, reverse=True)
        raise ValueError(
            f"{where} has an EMA ({len(leaves)} leaves, e.g. {leaves[0]}) and this restore "
            f"call passed no ema=: pass "
            f"ema=jz.ShardedEMA(<the decay it was trained with>) to restore it."
        )


def _shape_dtype(x) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype; a :class:`~jaxzero.zero.offload.remainder.Remainder` leaf: the
    fp32 master's it stands for."""
    if remainder.is_stored(x):
        return jax.ShapeDtypeStruct(np.shape(x.lo), jnp.float32)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _fp32_master_shapes(master):
    return None if master is None else remainder.fp32_shapes(master)


def _target(zero: ZeRO, params_or_abstract_state, ema, model_state, rng) -> tuple[TrainState, int]:
    """``(target, threshold)``: the abstract state to restore into, with the EMA per-leaf (what
    checkpoints hold) and the master as ``zero``'s placement keeps it (a remainder master
    beside the params, or fp32), and the ``bucket_leaves_up_to`` to store the restored EMA
    with (0: per-leaf; see :func:`jaxzero.ema.ema.store`)."""
    if isinstance(params_or_abstract_state, TrainState):
        template = jax.tree.map(_shape_dtype, params_or_abstract_state, is_leaf=remainder.is_stored)
        if template.master is not None:  # kept as zero keeps it, whatever the template kept
            keep = lambda m, p: zero.placement.stored_master(zero, m, p)
            template = template.replace(
                master=jax.eval_shape(keep, template.master, template.params)
            )
        # Keep the template's storage, re-planned for zero's mesh.
        threshold = sharded_ema.threshold(template)
        shapes = jax.tree.map(_shape_dtype, sharded_ema.to_per_leaf(template))
        shardings = zero.state_shardings(shapes)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
        )
        return target, threshold
    shapes = jax.tree.map(_shape_dtype, params_or_abstract_state)
    target = zero.abstract_state(shapes, ema=ema, model_state=model_state, rng=rng)
    threshold = (
        0
        if ema is None
        else sharded_ema.resolve(
            ema.bucket_leaves_up_to, zero.platform, zero.stage, zero.placement.update_is_local
        )
    )
    return sharded_ema.to_per_leaf(target), threshold
