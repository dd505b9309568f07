"""Sharded checkpoints of the ZeRO training state: a thin adapter over Orbax.

Everything is delegated to :class:`orbax.checkpoint.CheckpointManager`; this module only
configures it for jaxzero and adds the jaxzero-specific parts:

* :func:`manager` builds a manager with three items per step: ``"state"`` (the
  :class:`~jaxzero.TrainState`, ``StandardSave``/``StandardRestore``: every process writes
  only its own shards, nothing is gathered), ``"metadata"`` (``JsonSave``: jaxzero version,
  stage, mesh, precision, optimizer, and every leaf's path/shape/dtype/bytes) and the optional
  ``"extra"`` (a small user pytree such as a data-loader position).
* :func:`save` writes one step (asynchronously by default).
* :func:`restore` checks the stored tree against the target (paths, shapes, dtypes) and then
  lets Orbax read every array straight into the target's shardings, so a checkpoint written
  on N devices at one stage restores on any N / stage / mesh (``ZeRO.abstract_state``
  supplies the shardings).
* :func:`export` writes a gathered, unsharded tree (EMA or params) for inference.
* :func:`inspect` renders a checkpoint directory as text (for ``jaxzero inspect``).

A save is atomic: Orbax writes into a temporary directory and renames it when every item is
committed, so a process killed mid-save leaves only a ``<step>.orbax-checkpoint-tmp-*``
directory that :func:`restore` never considers (and that :func:`manager` removes).

Example::

    mngr = jz.checkpoint.manager("/ckpt", max_to_keep=3)
    for i, batch in enumerate(batches, 1):
        state, _ = step(state, batch)
        jz.checkpoint.save(mngr, i, state, zero=zero, extra={"loader": np.int64(i)})
    mngr.wait_until_finished()
    ...
    state = jz.checkpoint.restore("/ckpt", zero, params, ema=ema)   # latest complete step
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding

from jaxzero.ema import storage as eb
from jaxzero.ema.ema import EmaState, ShardedEMA
from jaxzero.evaluation import mesh_of
from jaxzero.train.state import TrainState
from jaxzero.zero.config import ZeRO

STATE = "state"
METADATA = "metadata"
EXTRA = "extra"
ITEMS = (STATE, METADATA, EXTRA)
FORMAT = "jaxzero.checkpoint/1"

__all__ = [
    "check_compatible",
    "describe",
    "export",
    "inspect",
    "latest_step",
    "load_export",
    "load_metadata",
    "manager",
    "restore",
    "save",
]


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
    mngr, owned = _open(manager_or_dir, read_only=True)
    try:
        if not owned:
            _settle(mngr)
        return mngr.latest_step()
    finally:
        if owned:
            mngr.close()


# --------------------------------------------------------------------------------- metadata
def _name(path: tuple[str, ...]) -> str:
    return ".".join(path) or "<root>"


def _flat(tree) -> dict[tuple[str, ...], Any]:
    """Leaves keyed by Orbax's own path tuples (what it stores and matches on)."""
    return ocp.tree.to_flat_dict(tree)


def _node_types(tree) -> list[str]:
    """Names of the NamedTuple / dataclass nodes of an optimizer state, depth first."""
    out = []

    def walk(x):
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            out.append(type(x).__name__)
            for v in x:
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(tree)
    return out


def _describe_tx(tx) -> str:
    text = repr(tx)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def leaf_table(tree) -> list[dict]:
    """One dict per array leaf: ``path``, ``shape``, ``dtype``, ``bytes``, ``spec``."""
    rows = []
    for path, x in _flat(tree).items():
        shape = tuple(int(d) for d in np.shape(x))
        dtype = jnp.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        sharding = getattr(x, "sharding", None)
        rows.append(
            {
                "path": _name(path),
                "shape": list(shape),
                "dtype": dtype.name,
                "bytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                "spec": str(tuple(sharding.spec)) if isinstance(sharding, NamedSharding) else None,
            }
        )
    return rows


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.generic, np.ndarray, jax.Array)):
        return np.asarray(x).tolist()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def describe(
    state: TrainState,
    *,
    zero: ZeRO | None = None,
    optimizer: str | None = None,
    metadata: dict | None = None,
) -> dict:
    """The JSON metadata :func:`save` stores next to ``state``."""
    from jaxzero import __version__

    mesh = zero.mesh if zero is not None else mesh_of(state)
    params_dtype = jnp.dtype(jax.tree.leaves(state.params)[0].dtype).name
    if zero is not None:
        pol = zero.precision
        precision = {
            "param_dtype": jnp.dtype(pol.param_dtype).name,
            "master_dtype": jnp.dtype(pol.master_dtype).name,
            "reduce_dtype": jnp.dtype(pol.reduce_dtype).name,
            "output_dtype": jnp.dtype(pol.output_dtype).name,
        }
    else:
        master = state.master if state.master is not None else state.params
        precision = {
            "param_dtype": params_dtype,
            "master_dtype": jnp.dtype(jax.tree.leaves(master)[0].dtype).name,
        }
    leaves = leaf_table(state)
    return {
        "format": FORMAT,
        "jaxzero_version": __version__,
        "step": int(np.asarray(jax.device_get(state.step))) if state.step is not None else None,
        "stage": None if zero is None else zero.stage,
        "axis": None if zero is None else zero.axis,
        "mesh": None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()},
        "num_devices": None if mesh is None else int(mesh.size),
        "process_count": jax.process_count(),
        "precision": precision,
        "loss_scale": None if zero is None or zero.loss_scale is None else repr(zero.loss_scale),
        "optimizer": optimizer
        if optimizer is not None
        else (None if zero is None else _describe_tx(zero.tx)),
        "opt_state_types": _node_types(state.opt_state),
        "has_ema": state.ema is not None,
        "has_master": state.master is not None,
        "leaves": leaves,
        "total_bytes": sum(r["bytes"] for r in leaves),
        "user": _jsonable(metadata) if metadata is not None else None,
    }


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
      metadata: JSON-serialisable user metadata (stored under ``"user"``).
      extra: a small pytree of arrays/numbers saved alongside (e.g. the data-loader
        position); read back with ``restore(..., with_extra=True)``.
      optimizer: a description of the optimizer (default: ``repr(zero.tx)``).
      wait: block until this save is committed.
      force: save even when ``save_interval_steps`` would skip this step.

    Returns:
      Whether a save was started (False when the manager's policy skips ``step`` or
      ``step`` is not newer than the latest saved step).
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a jaxzero.TrainState, got {type(state).__name__}.")
    if zero is not None and not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO or None, got {type(zero).__name__}.")
    step = int(np.asarray(step))
    # A bucketed EMA is stored per leaf (a local slice, no communication): the on-disk format
    # does not depend on ShardedEMA(bucket_leaves_up_to=...), N or the stage.
    state = eb.unbucket(state)
    mngr, owned = _open(manager_or_dir, read_only=False)
    try:
        meta = describe(state, zero=zero, optimizer=optimizer, metadata=metadata)
        meta["checkpoint_step"] = step
        meta["has_extra"] = extra is not None
        items = {STATE: ocp.args.StandardSave(state), METADATA: ocp.args.JsonSave(meta)}
        if extra is not None:
            items[EXTRA] = ocp.args.StandardSave(_host_tree(extra))
        started = mngr.save(step, args=ocp.args.Composite(**items), force=force)
        if wait or owned:
            mngr.wait_until_finished()
        return bool(started)
    finally:
        if owned:
            mngr.close()


# --------------------------------------------------------------------------------- restore
def _stored_tree(mngr: ocp.CheckpointManager, step: int) -> dict:
    md = mngr.item_metadata(step)
    if STATE not in md or md[STATE] is None:
        raise ValueError(
            f"step {step} in {os.fspath(mngr.directory)} has no {STATE!r} item; it was not "
            f"written by jaxzero.checkpoint.save."
        )
    tree = md[STATE]
    return _flat(getattr(tree, "tree", tree))


def check_compatible(stored: dict, target, *, check_dtypes: bool = True, context: str = "") -> None:
    """Raise ValueError naming the first path where ``target`` and the stored tree differ.

    ``stored`` is the flat (path tuple -> ArrayMetadata) dict of the checkpoint; ``target``
    the abstract state. Missing (in target, not stored) paths are reported first in target
    order, then shape / dtype mismatches, then extra (stored, not in target) paths.
    """
    want = _flat(target)
    for path, leaf in want.items():
        if path not in stored:
            raise ValueError(
                f"checkpoint does not match the target state: leaf {_name(path)} "
                f"(shape {tuple(leaf.shape)}) is missing from the checkpoint.{context}"
            )
        got = stored[path]
        got_shape = tuple(getattr(got, "shape", np.shape(got)) or ())
        if tuple(leaf.shape) != got_shape:
            raise ValueError(
                f"checkpoint does not match the target state: leaf {_name(path)} has shape "
                f"{got_shape} in the checkpoint but {tuple(leaf.shape)} in the target "
                f"(a different model?).{context}"
            )
        got_dtype = getattr(got, "dtype", None)
        if check_dtypes and got_dtype is not None and jnp.dtype(got_dtype) != jnp.dtype(leaf.dtype):
            raise ValueError(
                f"checkpoint does not match the target state: leaf {_name(path)} is "
                f"{jnp.dtype(got_dtype).name} in the checkpoint but {jnp.dtype(leaf.dtype).name} "
                f"in the target (a different precision policy?); pass check_dtypes=False to "
                f"cast on restore.{context}"
            )
    for path, got in stored.items():
        if path not in want:
            raise ValueError(
                f"checkpoint does not match the target state: the checkpoint has leaf "
                f"{_name(path)} (shape {tuple(getattr(got, 'shape', ()) or ())}) that the target "
                f"state lacks.{context}"
            )


def _per_leaf_target(target: TrainState) -> tuple[TrainState, eb.BucketLayout | None]:
    """The target with a bucketed EMA replaced by its per-leaf form (what checkpoints hold),
    and the bucket layout to restore into (None: per-leaf)."""
    if target.ema is None or not isinstance(target.ema.ema, eb.BucketedTree):
        return target, None
    layout = target.ema.ema.layout
    return target.replace(ema=EmaState(target.ema.updates, layout.abstract())), layout


def _target(
    zero: ZeRO, params_or_abstract_state, ema, model_state, rng
) -> tuple[TrainState, eb.BucketLayout | None]:
    if isinstance(params_or_abstract_state, TrainState):
        template = params_or_abstract_state
        max_elements = 0
        if template.ema is not None and isinstance(template.ema.ema, eb.BucketedTree):
            # Keep the template's storage, re-planned for zero's mesh.
            max_elements = template.ema.ema.layout.max_elements
            template = template.replace(
                ema=EmaState(template.ema.updates, template.ema.ema.layout.abstract())
            )
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), template)
        shardings = zero.state_shardings(shapes)
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
        )
        layout = None
        if target.ema is not None:
            layout = eb.plan(target.ema.ema, zero.mesh, zero.axis, max_elements)
        return target, layout
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params_or_abstract_state
    )
    target = zero.abstract_state(shapes, ema=ema, model_state=model_state, rng=rng)
    return _per_leaf_target(target)


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
):
    """Restore a :class:`~jaxzero.TrainState` directly into ``zero``'s shardings.

    The target is ``zero.abstract_state(params, ema=ema, model_state=..., rng=...)`` (or the
    given abstract ``TrainState``, re-sharded for ``zero``); Orbax reads each array straight
    into its target sharding, so each device only loads its own shard. A checkpoint written at
    one device count / stage / mesh restores at any other.

    Args:
      manager_or_dir: a manager or a checkpoint directory (opened read-only).
      zero: the ``ZeRO`` to restore for (its mesh and stage decide the shardings).
      params_or_abstract_state: the model params (arrays or ShapeDtypeStructs; only shapes
        and dtypes are used), or an (abstract) ``TrainState``.
      step: the step to restore; None: the newest complete step.
      ema: the ``ShardedEMA`` when the state carries an EMA (must match the checkpoint). Its
        ``bucket_leaves_up_to`` decides the restored EMA's storage (given an abstract
        ``TrainState``, its EMA's storage does); the checkpoint, always per-leaf on disk,
        restores into either.
      model_state, rng: templates of those state fields, when the state has them.
      with_extra: also return the ``extra`` tree saved with the step (None if none was).
      check_dtypes: refuse leaves whose stored dtype differs from the target's.

    Returns:
      The restored ``TrainState``, or ``(state, extra)`` with ``with_extra=True``.

    Raises:
      FileNotFoundError: no such directory, no complete step, or ``step`` not complete.
      ValueError: the stored tree differs from the target (the first missing / mis-shaped /
        extra leaf path is named); nothing is restored.
    """
    if not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO, got {type(zero).__name__}.")
    if ema is not None and not isinstance(ema, ShardedEMA):
        raise TypeError(f"ema={ema!r} must be a jaxzero.ShardedEMA or None.")
    mngr, owned = _open(manager_or_dir, read_only=True)
    try:
        if not owned:
            _settle(mngr)
        step = _resolve_step(mngr, step)
        # Checkpoints hold the per-leaf EMA; a bucketed target is filled after the read.
        target, layout = _target(zero, params_or_abstract_state, ema, model_state, rng)
        stored = _stored_tree(mngr, step)
        context = ""
        try:
            meta = _read_metadata(mngr, step)
        except Exception:  # noqa: BLE001 - metadata is optional for the check
            meta = None
        if meta is not None:
            ckpt_opt = ", ".join(meta.get("opt_state_types") or []) or "none"
            here_opt = ", ".join(_node_types(target.opt_state)) or "none"
            if ckpt_opt != here_opt:
                context += (
                    f" The checkpoint's optimizer state is [{ckpt_opt}], the target's is "
                    f"[{here_opt}]."
                )
            if meta.get("has_ema") and target.ema is None:
                context += " The checkpoint has an EMA: pass ema=ShardedEMA(...)."
            if meta.get("has_master") is not None and meta["has_master"] != (
                target.master is not None
            ):
                context += (
                    f" The checkpoint was written with precision {meta.get('precision')} "
                    f"(separate master: {meta['has_master']})."
                )
        check_compatible(stored, target, check_dtypes=check_dtypes, context=context)
        items = {STATE: ocp.args.StandardRestore(target)}
        has_extra = with_extra and _has_item(mngr, step, EXTRA)
        if has_extra:
            items[EXTRA] = ocp.args.StandardRestore()
        out = mngr.restore(step, args=ocp.args.Composite(**items))
        state = out[STATE]
        if layout is not None:
            state = state.replace(ema=eb.bucket(state.ema, layout))
        if with_extra:
            return state, (out[EXTRA] if has_extra else None)
        return state
    finally:
        if owned:
            mngr.close()


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
    return out[METADATA]


def load_metadata(manager_or_dir, step: int | None = None) -> dict:
    """The JSON metadata saved with ``step`` (default: newest complete step)."""
    mngr, owned = _open(manager_or_dir, read_only=True)
    try:
        if not owned:
            _settle(mngr)
        step = _resolve_step(mngr, step)
        meta = _read_metadata(mngr, step)
        if meta is None:
            raise ValueError(f"step {step} has no {METADATA!r} item (not a jaxzero checkpoint).")
        return meta
    finally:
        if owned:
            mngr.close()


# --------------------------------------------------------------------------------- export
def _export_tree(state_or_tree, which: str):
    from jaxzero.evaluation import gather

    if isinstance(state_or_tree, TrainState):
        if which == "ema":
            if state_or_tree.ema is None:
                raise ValueError(
                    "export(which='ema') needs a state with an EMA; use which='params' or "
                    "create the state with an EMA (zero.init(params, ema=ShardedEMA(...)))."
                )
            tree = eb.unbucket(state_or_tree.ema.ema)
        elif which == "params":
            tree = state_or_tree.params
        elif which == "master":
            tree = (
                state_or_tree.master if state_or_tree.master is not None else state_or_tree.params
            )
        else:
            raise ValueError(f"which={which!r} must be 'ema', 'params' or 'master'.")
    else:
        tree = state_or_tree
    tree = gather(tree)  # replicated on its mesh: every process holds the full tree
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def export(state_or_tree, path, *, which: str = "ema", overwrite: bool = False) -> str:
    """Write a gathered, unsharded tree for inference; returns the path written.

    Args:
      state_or_tree: a ``TrainState`` (pick the tree with ``which``) or any pytree of
        (possibly sharded) arrays.
      path: a directory (an Orbax PyTree checkpoint of plain numpy arrays, loadable without
        jaxzero and without a mesh) or a file ending in ``.msgpack`` (``flax.serialization``).
      which: ``"ema"`` (default), ``"params"`` (compute dtype) or ``"master"`` (fp32 master).
      overwrite: replace an existing export.
    """
    tree = _export_tree(state_or_tree, which)
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it.")
    if path.endswith(".msgpack"):
        from flax import serialization

        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(serialization.msgpack_serialize(serialization.to_state_dict(tree)))
            os.replace(tmp, path)
        return path
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(path, ocp.args.PyTreeSave(tree), force=overwrite)
    return path


def load_export(path):
    """Read an :func:`export` back as a tree of numpy arrays (plain nested dicts)."""
    path = os.path.abspath(os.fspath(path))
    if path.endswith(".msgpack"):
        from flax import serialization

        with open(path, "rb") as f:
            return serialization.msgpack_restore(f.read())
    with ocp.PyTreeCheckpointer() as ckptr:
        # Saved from numpy arrays without shardings: restored as numpy, no mesh needed.
        return jax.tree.map(np.asarray, ckptr.restore(path))


# --------------------------------------------------------------------------------- inspect
def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def _table(rows: list[dict]) -> list[str]:
    head = ("path", "shape", "dtype", "bytes", "spec")
    cells = [
        (r["path"], str(tuple(r["shape"])), r["dtype"], str(r["bytes"]), r.get("spec") or "")
        for r in rows
    ]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)
    ]
    fmt = lambda c: "  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip()
    return [fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(c) for c in cells]


def inspect(directory, *, step: int | None = None) -> str:
    """A text report of a checkpoint directory.

    Lists the complete steps and any interrupted saves, then for ``step`` (default: the
    newest complete one) the jaxzero metadata (version, stage, mesh, precision, optimizer,
    user metadata) and every leaf's path, shape, dtype, bytes and partition spec. Reads
    metadata only (no arrays).
    """
    mngr, _ = _open(directory, read_only=True)
    try:
        lines = [f"checkpoint directory: {os.fspath(mngr.directory)}"]
        steps = sorted(mngr.all_steps())
        lines.append(f"complete steps: {', '.join(map(str, steps)) if steps else 'none'}")
        partial = _partial_saves(mngr.directory)
        if partial:
            lines.append(f"incomplete saves (ignored): {', '.join(partial)}")
        step = _resolve_step(mngr, step)
        lines.append("")
        lines.append(f"step {step}:")
        meta = _read_metadata(mngr, step)
        if meta is not None:
            mesh = meta.get("mesh")
            lines += [
                f"  jaxzero version: {meta.get('jaxzero_version')}",
                f"  ZeRO stage: {meta.get('stage')}",
                f"  mesh: {mesh} ({meta.get('num_devices')} devices, sharded over "
                f"{meta.get('axis')!r})",
                f"  precision: {meta.get('precision')}",
                f"  optimizer: {meta.get('optimizer')}",
                f"  optimizer state: {', '.join(meta.get('opt_state_types') or []) or 'none'}",
                f"  ema: {meta.get('has_ema')}",
                f"  train step: {meta.get('step')}",
            ]
            if meta.get("loss_scale"):
                lines.append(f"  loss scale: {meta['loss_scale']}")
            if meta.get("user") is not None:
                lines.append(f"  user metadata: {meta['user']}")
            rows = meta.get("leaves") or []
        else:
            lines.append("  (no jaxzero metadata: leaves from the Orbax tree metadata)")
            rows = []
            for path, m in _stored_tree(mngr, step).items():
                shape = tuple(getattr(m, "shape", ()) or ())
                dtype = jnp.dtype(getattr(m, "dtype", np.float32))
                rows.append(
                    {
                        "path": _name(path),
                        "shape": list(shape),
                        "dtype": dtype.name,
                        "bytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                    }
                )
        total = sum(r["bytes"] for r in rows)
        lines.append(f"  state: {len(rows)} leaves, {total} bytes ({_fmt_bytes(total)})")
        lines += ["    " + line for line in _table(rows)]
        if _has_item(mngr, step, EXTRA):
            md = mngr.item_metadata(step)
            extra = md[EXTRA] if EXTRA in md else None
            if extra is not None:
                erows = []
                for path, m in _flat(getattr(extra, "tree", extra)).items():
                    shape = tuple(getattr(m, "shape", ()) or ())
                    dtype = jnp.dtype(getattr(m, "dtype", np.float32))
                    erows.append(
                        {
                            "path": _name(path),
                            "shape": list(shape),
                            "dtype": dtype.name,
                            "bytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
                        }
                    )
                lines.append(f"  extra: {len(erows)} leaves")
                lines += ["    " + line for line in _table(erows)]
        return "\n".join(lines)
    finally:
        mngr.close()
