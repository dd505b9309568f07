"""Gathered, unsharded exports of a trained tree (EMA, params or master) for inference, and,
on request, with the optimizer state and step counter: the tree a Flax ``TrainState`` holds,
for continuing the run without jaxzero."""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization

from jaxzero.distributed.host import replicated
from jaxzero.ema.ema import to_per_leaf
from jaxzero.train.state import TrainState

# The keys of an export with the optimizer state: a Flax TrainState's fields (and what
# jaxzero.checkpoint.adopt reads), the model state's collections beside them.
PARAMS, OPT_STATE, STEP = "params", "opt_state", "step"


# --------------------------------------------------------------------------------- export
def _weights(state: TrainState, which: str):
    if which == "ema":
        if state.ema is None:
            raise ValueError(
                "export(which='ema') needs a state with an EMA; use which='params' or "
                "create the state with an EMA (zero.init(params, ema=ShardedEMA(...)))."
            )
        return to_per_leaf(state.ema.ema)
    if which == "params":
        return state.params
    if which == "master":
        return state.fp32_master() if state.master is not None else state.params
    raise ValueError(f"which={which!r} must be 'ema', 'params' or 'master'.")


def _with_opt_state(state: TrainState, which: str) -> dict:
    """``{"params", "opt_state", "step", *model_state}``: a Flax ``TrainState``'s tree."""
    if which == "ema":
        raise ValueError(
            "export(opt_state=True, which='ema'): the optimizer state continues the master "
            "weights, not their EMA. Pass which='master' (the default with opt_state=True), "
            "and export the EMA on its own for inference."
        )
    tree = {PARAMS: _weights(state, which), OPT_STATE: state.opt_state, STEP: state.step}
    model_state = state.model_state or {}
    clash = sorted(set(model_state) & set(tree)) if isinstance(model_state, dict) else []
    if clash or not isinstance(model_state, dict):
        raise ValueError(
            f"the state's model_state ({type(model_state).__name__} with keys "
            f"{sorted(model_state) if isinstance(model_state, dict) else '-'}) cannot stand "
            f"beside params, opt_state and step in an export: it must be a dict of "
            f"collections (e.g. {{'batch_stats': ...}}) with other names."
        )
    return {**tree, **model_state}


def _export_tree(state_or_tree, which: str | None, opt_state: bool):
    if isinstance(state_or_tree, TrainState):
        if opt_state:
            tree = _with_opt_state(state_or_tree, "master" if which is None else which)
        else:
            tree = _weights(state_or_tree, "ema" if which is None else which)
    else:
        if opt_state or which is not None:
            raise ValueError(
                f"export({'opt_state=True' if opt_state else f'which={which!r}'}) picks from a "
                f"jaxzero TrainState, but a {type(state_or_tree).__name__} was given (written "
                f"as it is): pass the state, or drop the argument."
            )
        tree = state_or_tree
    # replicated on its mesh, every process holding the full tree; host leaves stay there
    tree = replicated(tree, to_device=False)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def export(
    state_or_tree,
    path,
    *,
    which: str | None = None,
    opt_state: bool = False,
    overwrite: bool = False,
) -> str:
    """Write a gathered, unsharded tree for inference (or, with ``opt_state=True``, for
    continuing the run elsewhere); returns the path written.

    Args:
      state_or_tree: a ``TrainState`` (pick the tree with ``which``) or any pytree of
        (possibly sharded) arrays.
      path: a directory (an Orbax PyTree checkpoint of plain numpy arrays, loadable without
        jaxzero and without a mesh) or a file ending in ``.msgpack`` (``flax.serialization``).
      which: ``"ema"`` (the default), ``"params"`` (compute dtype) or ``"master"`` (the fp32
        master; the params when there is no separate one). With ``opt_state=True``:
        ``"master"`` (the default) or ``"params"``.
      opt_state: write ``{"params": <which>, "opt_state": ..., "step": ...}`` (and the model
        state's collections, e.g. ``"batch_stats"``, beside them): the tree a Flax
        ``TrainState`` holds, the optax state keyed by its fields' names. Read it back into
        your own ``TrainState`` with :func:`load_export` ``(path, target=ts)`` (or orbax
        alone), or continue under jaxzero with :func:`jaxzero.checkpoint.adopt`.
      overwrite: replace an existing export.
    """
    tree = _export_tree(state_or_tree, which, opt_state)
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it.")
    if path.endswith(".msgpack"):
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


def _dtype(x):
    """A target leaf's dtype (None for a Python number such as a fresh ``TrainState``'s
    ``step=0``: the export's own dtype is kept)."""
    return getattr(x, "dtype", None)


def _numpy_args(target):
    """Orbax restore arguments: every leaf of ``target`` read as a numpy array (no mesh, no
    device), of the target's dtype."""
    return jax.tree.map(lambda x: ocp.RestoreArgs(restore_type=np.ndarray, dtype=_dtype(x)), target)


def load_export(path, *, target=None):
    """Read an :func:`export` back as a tree of numpy arrays.

    Args:
      path: what :func:`export` wrote.
      target: None (default): plain nested dicts (an optax state's named tuples come back as
        dicts keyed by field name, its tuples as lists). Or a tree to read into, matched by
        key path, never by leaf order: e.g. your Flax ``TrainState`` (``TrainState.create(
        apply_fn, params, tx)``, its optax state from your own ``tx.init``) for an export
        written with ``opt_state=True``, or your params for an EMA export. Its leaves give
        the dtypes (an export's values are cast to them); the values are the export's. A
        directory export may hold entries the target lacks (they are not read).
    """
    path = os.path.abspath(os.fspath(path))
    if path.endswith(".msgpack"):
        with open(path, "rb") as f:
            tree = serialization.msgpack_restore(f.read())
        if target is None:
            return tree
        restored = serialization.from_state_dict(target, tree)
        return jax.tree.map(lambda t, x: np.asarray(x, dtype=_dtype(t)), target, restored)
    with ocp.PyTreeCheckpointer() as ckptr:
        if target is None:
            # Saved from numpy arrays without shardings: restored as numpy, no mesh needed.
            return jax.tree.map(np.asarray, ckptr.restore(path))
        return ckptr.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=_numpy_args(target), partial_restore=True
            ),
        )
