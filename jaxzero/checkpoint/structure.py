"""What a jaxzero checkpoint holds: its items, the JSON metadata (:func:`describe`), the
stored tree and its checks against a restore target (:func:`check_compatible`)."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from jaxzero._version import __version__
from jaxzero.ema import storage
from jaxzero.evaluation import mesh_of
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.state import TrainState
from jaxzero.trees import node_types, readable_repr

STATE = "state"
METADATA = "metadata"
EXTRA = "extra"
ITEMS = (STATE, METADATA, EXTRA)
FORMAT = "jaxzero.checkpoint/1"


# --------------------------------------------------------------------------------- metadata
def _name(path: tuple[str, ...]) -> str:
    return ".".join(path) or "<root>"


def _flat(tree) -> dict[tuple[str, ...], Any]:
    """Leaves keyed by Orbax's own path tuples (what it stores and matches on)."""
    return ocp.tree.to_flat_dict(tree)


def _describe_tx(tx) -> str | None:
    return readable_repr(repr(tx))


def _row(path: tuple[str, ...], shape: tuple[int, ...], dtype) -> dict:
    """A leaf's ``path``, ``shape``, ``dtype`` and ``bytes`` (a :func:`leaf_table` row)."""
    return {
        "path": _name(path),
        "shape": list(shape),
        "dtype": dtype.name,
        "bytes": int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,
    }


def leaf_table(tree) -> list[dict]:
    """One dict per array leaf: ``path``, ``shape``, ``dtype``, ``bytes``, ``spec``."""
    rows = []
    for path, x in _flat(tree).items():
        shape = tuple(int(d) for d in np.shape(x))
        dtype = jnp.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        sharding = getattr(x, "sharding", None)
        spec = str(tuple(sharding.spec)) if isinstance(sharding, NamedSharding) else None
        rows.append({**_row(path, shape, dtype), "spec": spec})
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
        "offload": None if zero is None or not zero.offload else ",".join(_as_tuple(zero.offload)),
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


# --------------------------------------------------------------------------------- restore
def _stored_tree(mngr: ocp.CheckpointManager, step: int) -> dict:
    md = mngr.item_metadata(step)
    if md is None or STATE not in md or md[STATE] is None:
        raise ValueError(
            f"step {step} in {os.fspath(mngr.directory)} has no {STATE!r} item; it was not "
            f"written by jaxzero.checkpoint.save. A plain orbax checkpoint of a Flax run "
            f"(params, opt_state, step) continues under jaxzero with "
            f"jaxzero.checkpoint.adopt(directory, step)."
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
    "`state = state.replace(ema=zero.init(jz.gather(state.master if state.master is not None "
    "else state.params), ema=jz.ShardedEMA(...), model_state=state.model_state).ema)`"
)


def _missing_parts(stored: dict, target: TrainState, *, step: int, directory) -> None:
    """Raise ValueError when the checkpoint has a part of the state (model state, rng, EMA)
    that the restore call did not ask for, or lacks one it asked for: naming the part and
    the argument to pass or drop (instead of the first differing leaf)."""
    tops = {path[0] for path in stored if path}
    where = f"checkpoint step {step} in {directory}"
    for field, (what, how) in _PARTS.items():
        has, wants = field in tops, bool(jax.tree.leaves(getattr(target, field)))
        if has and not wants:
            leaves = [_name(p) for p in stored if p and p[0] == field]
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
        leaves = sorted((_name(p) for p in stored if p[0] == "ema"), key=len, reverse=True)
        raise ValueError(
            f"{where} has an EMA ({len(leaves)} leaves, e.g. {leaves[0]}) and this restore "
            f"call passed no ema=: pass "
            f"ema=jz.ShardedEMA(<the decay it was trained with>) to restore it."
        )


def _shape_dtype(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _target(zero: ZeRO, params_or_abstract_state, ema, model_state, rng) -> tuple[TrainState, int]:
    """``(target, threshold)``: the abstract state to restore into, with the EMA per-leaf (what
    checkpoints hold), and the ``bucket_leaves_up_to`` to store the restored EMA with (0:
    per-leaf; see :func:`jaxzero.ema.storage.store`)."""
    if isinstance(params_or_abstract_state, TrainState):
        template = jax.tree.map(_shape_dtype, params_or_abstract_state)
        # Keep the template's storage, re-planned for zero's mesh.
        threshold = storage.threshold(template)
        shapes = jax.tree.map(_shape_dtype, storage.to_per_leaf(template))
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
        else storage.resolve(ema.bucket_leaves_up_to, zero.mesh, zero.stage, zero.offload)
    )
    return storage.to_per_leaf(target), threshold


def _as_tuple(offload) -> tuple[str, ...]:
    """``ZeRO.offload`` (a name or a tuple of names) as a tuple, for the metadata's one
    string (``"optimizer"``, ``"optimizer,params"``)."""
    return (offload,) if isinstance(offload, str) else tuple(offload)
