"""Assembling full (replicated) trees from shards: for evaluation and export only."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.ema.ema import EmaState
from jaxzero.ema.storage import to_per_leaf
from jaxzero.train.state import TrainState, check_not_donated


def mesh_of(tree):
    """The mesh of the first leaf placed with a NamedSharding (None if there is none)."""
    for x in jax.tree.leaves(tree):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding):
            return s.mesh
    return None


@functools.cache
def _replicator(mesh, dtype=None, key=None):
    """One jitted "replicate (and cast) every leaf" per mesh; jit caches per tree structure.

    A bucketed EMA is first sliced back into its per-leaf form on each device (no
    communication); ``key`` then picks one entry of the resulting dict ("params")."""
    replicated = NamedSharding(mesh, P())

    def fn(tree):
        tree = to_per_leaf(tree)
        if key is not None:
            tree = tree[key]
        if dtype is not None:
            tree = jax.tree.map(lambda x: x.astype(dtype), tree)
        return jax.lax.with_sharding_constraint(tree, replicated)

    return jax.jit(fn)


def gather(tree):
    """Return ``tree`` fully replicated on its mesh: one all-gather per sharded leaf.

    Accepts an :class:`EmaState` (returns the gathered EMA tree, per leaf also when its small
    leaves are stored in a bucket), a :class:`TrainState` (returns its gathered compute
    params) or any pytree of arrays on a mesh. Compiled once per tree structure and mesh.
    """
    check_not_donated(tree)
    if isinstance(tree, EmaState):
        tree = tree.ema
    elif isinstance(tree, TrainState):
        tree = tree.params
    mesh = mesh_of(tree)
    if mesh is None:
        return tree
    return _replicator(mesh)(tree)


def ema_params(state: TrainState, dtype=None):
    """The EMA weights as a replicated params tree (cast to the compute dtype), ready to be
    passed to the model in place of ``state.params``; one extra full copy, nothing more."""
    if not isinstance(state, TrainState) or state.ema is None:
        raise ValueError(
            "ema_params needs a TrainState with an EMA; build the step with "
            "make_train_step(..., ema=jaxzero.ShardedEMA(decay)) and its state with "
            "step.init(params)."
        )
    check_not_donated(state)
    dtype = jax.numpy.dtype(dtype or jax.tree.leaves(state.params)[0].dtype)
    tree = state.ema.ema
    # With a model state the EMA averages {"params", "model_state"}: keep "params".
    key = None if state.model_state is None else "params"
    return _replicator(mesh_of(tree), dtype, key)(tree)


def ema_model_state(state: TrainState):
    """The EMA of the model state (e.g. BatchNorm statistics), replicated; the model's own
    state when the EMA does not cover one."""
    check_not_donated(state)
    if state.ema is None or state.model_state is None:
        return state.model_state
    tree = state.ema.ema
    return _replicator(mesh_of(tree), None, "model_state")(tree)


def gather_to_host(tree):
    """Full numpy copies of every leaf of ``tree``, on every process.

    Sharded leaves are replicated first (:func:`jaxzero.gather`: one all-gather per sharded
    leaf, so every process must call this together), then each process reads its local copy.
    Accepts an :class:`~jaxzero.EmaState` (its per-leaf EMA tree, also when small leaves are
    bucketed), a :class:`~jaxzero.TrainState`
    (its params) or any pytree; non-jax leaves are returned as numpy arrays.
    """
    tree = gather(tree)

    def leaf(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.array(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(leaf, tree)
