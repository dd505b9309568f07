"""What a jaxzero checkpoint step holds and records: its items (:data:`STATE`,
:data:`METADATA`, :data:`EXTRA`), how its leaves are named, and the JSON metadata that
describes the saved state (:func:`describe`, :func:`leaf_table`).

The reading and writing is :mod:`jaxzero.checkpoint.io`; this module imports nothing from
the checkpoint package, so that :mod:`~jaxzero.checkpoint.guards` and
:mod:`~jaxzero.checkpoint.adopt` (which :mod:`~jaxzero.checkpoint.io` uses) can name the items
and leaves too."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from jaxzero._version import __version__
from jaxzero.evaluation import mesh_of
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.state import TrainState
from jaxzero.trees import node_types, readable_repr

STATE = "state"
METADATA = "metadata"
EXTRA = "extra"
ITEMS = (STATE, METADATA, EXTRA)
FORMAT = "jaxzero.checkpoint/1"


# --------------------------------------------------------------------------------- leaves
def leaf_name(path: tuple[str, ...]) -> str:
    """A leaf's dotted name (``params.dense.kernel``), as the metadata and messages write it."""
    return ".".join(path) or "<root>"


def flat_leaves(tree) -> dict[tuple[str, ...], Any]:
    """Leaves keyed by Orbax's own path tuples (what it stores and matches on)."""
    return ocp.tree.to_flat_dict(tree)


# --------------------------------------------------------------------------------- metadata
def _describe_tx(tx) -> str | None:
    return readable_repr(repr(tx))


def leaf_row(path: tuple[str, ...], shape: tuple[int, ...], dtype) -> dict:
    """A leaf's ``path``, ``shape``, ``dtype`` and ``bytes`` (a :func:`leaf_table` row)."""
    return {
        "path": leaf_name(path),
        "shape": list(shape),
        "dtype": dtype.name,
        "bytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
    }


def leaf_table(tree) -> list[dict]:
    """One dict per array leaf: ``path``, ``shape``, ``dtype``, ``bytes``, ``spec``."""
    rows = []
    for path, x in flat_leaves(tree).items():
        shape = tuple(int(d) for d in np.shape(x))
        dtype = jnp.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        sharding = getattr(x, "sharding", None)
        spec = str(tuple(sharding.spec)) if isinstance(sharding, NamedSharding) else None
        rows.append({**leaf_row(path, shape, dtype), "spec": spec})
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
        # how stage 3 gathers and where the state lives; absent from checkpoints before them
        "layers": None if zero is None else list(zero.layers or ()) or None,
        "units": None if zero is None else list(zero.units or ()) or None,
        "offload": None if zero is None else ",".join(zero.offloaded()) or None,
        "optimizer": optimizer
        if optimizer is not None
        else (None if zero is None else _describe_tx(zero.tx)),
        "opt_state_types": node_types(state.opt_state),
        "has_ema": state.ema is not None,
        "has_master": state.master is not None,
        "leaves": leaves,
        "total_bytes": sum(r["bytes"] for r in leaves),
        "user": _jsonable(metadata) if metadata is not None else None,
    }
