"""Writing and reading jaxzero checkpoints: :func:`manager`, :func:`save`, :func:`restore`,
:func:`latest_step` and :func:`load_metadata` (a thin adapter over Orbax's
``CheckpointManager``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

import jaxzero.checkpoint.guards as guards
import jaxzero.checkpoint.integrity as integrity
import jaxzero.checkpoint.quiet as quiet
from jaxzero.checkpoint.adopt import describe_plain
from jaxzero.checkpoint.structure import EXTRA, METADATA, STATE, _flat, _name, describe
from jaxzero.checkpoint.trust import check_metadata
from jaxzero.ema import storage
from jaxzero.ema.ema import ShardedEMA
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.state import TrainState, check_not_donated


# --------------------------------------------------------------------------------- manager
def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item, save_args, restore_args in (
        (STATE, ocp.args.StandardSave, ocp.args.StandardRestore),
        (EXTRA, ocp.args.StandardSave, ocp.args.StandardRestore),
        (METADATA, ocp.args.JsonSave, ocp.args.JsonRestore),
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
def _opened(manager_or_dir, *, read_only: bool = True) -> Iterator[ocp.CheckpointManager]:
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


def _partial_saves(directory) -> list[str]:
    path = epath.Path(os.fspath(directory))
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if ".orbax-checkpoint-tmp" in p.name)


def _resolve_step(mngr: ocp.CheckpointManager, step) -> int:
    steps = sorted(mngr.all_steps())
    if not steps:
        partial = _partial_saves(mngr.directory)
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
    with _opened(manager_or_dir) as mngr:
        return mngr.latest_step()


# --------------------------------------------------------------------------------- save
def _host_tree(tree):
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
      state: the :class:`~jaxzero.TrainState`.
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
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a jaxzero.TrainState, got {type(state).__name__}.")
    if zero is not None and not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO or None, got {type(zero).__name__}.")
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    check_not_donated(state)
    step = int(np.asarray(step))
    # A bucketed EMA is stored per leaf (a local slice, no communication): the on-disk format
    # does not depend on ShardedEMA(bucket_leaves_up_to=...), N or the stage.
    state = storage.to_per_leaf(state)
    with _opened(manager_or_dir, read_only=False) as mngr:
        guards.check_only_steps(mngr)
        guards.check_new_step(mngr, step)
        meta = describe(state, zero=zero, optimizer=optimizer, metadata=metadata)
        meta["checkpoint_step"] = step
        meta["ema"] = guards.ema_settings(ema)
        meta["has_extra"] = extra is not None
        extra = None if extra is None else _host_tree(extra)
        meta[integrity.KEY] = _checksums(state, extra)
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
            raise _save_failed(mngr, step, e) from e
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
        raise _save_failed(mngr, None, e) from e


def _checksums(state: TrainState, extra) -> dict:
    """The metadata's ``checksums`` entry: every leaf's hash (:mod:`integrity`), taken now,
    before an asynchronous save copies the same arrays."""
    leaves = integrity.checksums({_name(k): v for k, v in _flat(state).items()})
    if extra is not None:
        leaves.update(
            integrity.checksums({"extra." + _name(k): v for k, v in _flat(extra).items()})
        )
    return {"algorithm": integrity.ALGORITHM, "leaves": leaves}


def _save_failed(mngr: ocp.CheckpointManager, step: int | None, error: Exception) -> OSError:
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
def _has_item(mngr: ocp.CheckpointManager, step: int, item: str) -> bool:
    step_dir = epath.Path(os.fspath(mngr.directory)) / str(step)
    if step_dir.is_dir():
        return (step_dir / item).is_dir()
    md = mngr.item_metadata(step)
    return item in md and md[item] is not None


def _read_metadata(mngr: ocp.CheckpointManager, step: int) -> dict | None:
    if not _has_item(mngr, step, METADATA):
        return None
    out = mngr.restore(step, args=ocp.args.Composite(**{METADATA: ocp.args.JsonRestore()}))
    where = f"step {step} in {os.fspath(mngr.directory)}"
    return check_metadata(out[METADATA], where)


def load_metadata(manager_or_dir, step: int | None = None) -> dict:
    """The JSON metadata saved with ``step`` (default: newest complete step)."""
    with _opened(manager_or_dir) as mngr:
        step = _resolve_step(mngr, step)
        meta = _read_metadata(mngr, step)
        if meta is None:
            raise ValueError(f"step {step} has no {METADATA!r} item (not a jaxzero checkpoint).")
        return meta
