"""Reading a step back: :func:`restore` (checked against the target, verified against the
checksums saved with it, optionally falling back to the newest step that verifies)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

import jaxzero.checkpoint.guards as guards
import jaxzero.checkpoint.integrity as integrity
import jaxzero.checkpoint.quiet as quiet
from jaxzero.checkpoint.integrity import CheckpointDamagedError
from jaxzero.checkpoint.io import _has_item, _opened, _read_metadata, _resolve_step
from jaxzero.checkpoint.structure import (
    EXTRA,
    METADATA,
    STATE,
    _flat,
    _mismatch_hints,
    _missing_parts,
    _name,
    _stored_tree,
    _target,
    check_compatible,
)
from jaxzero.ema import storage
from jaxzero.ema.ema import ShardedEMA
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.state import TrainState


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
    """Restore a :class:`~jaxzero.TrainState` directly into ``zero``'s shardings.

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
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    if fallback and step is not None:
        raise ValueError(
            f"fallback=True picks the newest step that verifies; it cannot be combined with "
            f"step={step!r}. Pass step=None, or fallback=False to restore exactly step {step}."
        )
    with _opened(manager_or_dir) as mngr:
        # Checkpoints hold the per-leaf EMA; a bucketed target is filled after the read.
        target, threshold = _target(zero, params_or_abstract_state, ema, model_state, rng)
        read = dict(check_dtypes=check_dtypes, with_extra=with_extra, ema=ema)
        state, extra = _first_that_verifies(mngr, step, target, fallback, **read)
        if threshold:
            state = state.replace(
                ema=storage.store(
                    state.ema, zero.mesh, zero.axis, threshold, leaf_specs=zero.ema_leaf_specs
                )
            )
        return (state, extra) if with_extra else state


def _first_that_verifies(mngr, step, target, fallback: bool, **read):
    """``(state, extra)`` of ``step`` (None: the newest); with ``fallback``, of the newest step
    that verifies, warning about the damaged steps passed over (``read``: _restore_step's)."""
    first = _resolve_step(mngr, step)
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
    directory = os.fspath(mngr.directory)
    meta = _damaged_if_raises(
        lambda: _read_metadata(mngr, step), step, directory, "metadata", f"{METADATA}/metadata"
    )
    stored = _damaged_if_raises(
        lambda: _stored_tree(mngr, step), step, directory, "state tree", f"{STATE}/_METADATA"
    )
    read_target, finish = _read_plan(stored, target, check_dtypes)
    context = "" if meta is None else _mismatch_hints(meta, target)
    _missing_parts(stored, read_target, step=step, directory=directory)
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
    integrity.check(_named(state), sums, step=step, directory=directory, files=files)
    if extra is not None and sums:
        integrity.check(_named(extra, "extra."), sums, step=step, directory=directory, files=files)
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
        state, extra = _read_state(mngr, step, target, with_extra=with_extra)
        return state, extra, None
    except Exception as e:  # noqa: BLE001 - any read failure of a step that passed the checks
        if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e):
            raise
        problem = integrity.read_error(e, step=step, directory=directory, files=files)
    quiet.collect_leftovers()
    return None, None, problem


def _named(tree, prefix: str = "") -> dict[str, Any]:
    return {prefix + _name(k): v for k, v in _flat(tree).items()}


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
    flat = _flat(target)
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


def _read_state(
    mngr: ocp.CheckpointManager, step: int, target: TrainState, *, with_extra: bool
) -> tuple[TrainState, Any]:
    """``(state, extra)``: ``step``'s state read straight into ``target``'s shardings, and its
    ``extra`` tree (None unless asked for and saved)."""
    items = {STATE: ocp.args.StandardRestore(target)}
    has_extra = with_extra and _has_item(mngr, step, EXTRA)
    if has_extra:
        items[EXTRA] = ocp.args.StandardRestore()
    out = mngr.restore(step, args=ocp.args.Composite(**items))
    return out[STATE], (out[EXTRA] if has_extra else None)
