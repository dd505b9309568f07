"""Gathered, unsharded exports of a trained tree (EMA, params or master) for inference."""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import serialization

from jaxzero.distributed.host import replicated
from jaxzero.ema import storage
from jaxzero.train.state import TrainState


# --------------------------------------------------------------------------------- export
def _export_tree(state_or_tree, which: str):
    if isinstance(state_or_tree, TrainState):
        if which == "ema":
            if state_or_tree.ema is None:
                raise ValueError(
                    "export(which='ema') needs a state with an EMA; use which='params' or "
                    "create the state with an EMA (zero.init(params, ema=ShardedEMA(...)))."
                )
            tree = storage.to_per_leaf(state_or_tree.ema.ema)
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
    # replicated on its mesh, every process holding the full tree; host leaves stay there
    tree = replicated(tree, to_device=False)
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
        with open(path, "rb") as f:
            return serialization.msgpack_restore(f.read())
    with ocp.PyTreeCheckpointer() as ckptr:
        # Saved from numpy arrays without shardings: restored as numpy, no mesh needed.
        return jax.tree.map(np.asarray, ckptr.restore(path))
