"""Full (replicated) trees from shards, and their numpy copies on every process: what
evaluation, export and a multi-process script read (:mod:`jaxzero.evaluation` builds on it).

A state object says what gathering it means through a ``gather_view()`` method
(:class:`~jaxzero.TrainState`: its compute params; :class:`~jaxzero.EmaState`: the averaged
tree), so this module knows no training type.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.ema.ema import to_per_leaf
from jaxzero.mesh import in_host_memory
from jaxzero.trees import check_not_donated
from jaxzero.zero.offload.remainder import is_stored


def mesh_of(tree):
    """The mesh of the first leaf placed with a NamedSharding (None if there is none)."""
    for x in jax.tree.leaves(tree):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding):
            return s.mesh
    return None


@functools.cache
def replicator(mesh, dtype=None, key=None, to_device: bool = True):
    """One jitted "replicate (and cast) every leaf" per mesh; jit caches per tree structure.

    A bucketed EMA is first sliced back into its per-leaf form on each device (no
    communication); ``key`` then picks one entry of the resulting dict ("params"). With
    ``to_device`` a leaf in host memory (offload: the EMA, the master, the params) comes back
    in device memory, where the model that reads it computes (jax refuses a host operand
    beside a device one); without, it stays in host memory (a copy bound for numpy, which a
    model offloaded for its size would not fit on the device)."""
    replicated = NamedSharding(mesh, P())
    fetch = lambda x: jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x

    def fn(tree):
        tree = to_per_leaf(tree)
        if to_device:
            tree = jax.tree.map(fetch, tree)
        if key is not None:
            tree = tree[key]
        if dtype is not None:
            tree = jax.tree.map(lambda x: x.astype(dtype), tree)
        return jax.lax.with_sharding_constraint(tree, replicated)

    return jax.jit(fn)


def gather(tree):
    """Return ``tree`` fully replicated on its mesh: one all-gather per sharded leaf, every
    leaf in device memory (also one offloaded to host memory), ready for the model.

    Accepts an :class:`EmaState` (returns the gathered EMA tree, per leaf also when its small
    leaves are stored in a bucket), a :class:`TrainState` (returns its gathered compute
    params) or any pytree of arrays on a mesh. Compiled once per tree structure and mesh.
    The fp32 master is ``gather(state.fp32_master())``: a master kept as a remainder
    (``offload=("optimizer", "remainder")``) is refused, since it is not the master without
    the params.
    """
    return replicated(tree, to_device=True)


def replicated(tree, *, to_device: bool):
    """:func:`gather`; with ``to_device=False`` a leaf in host memory stays there (what
    :func:`gather_to_host` and the exports copy to numpy)."""
    check_not_donated(tree)
    view = getattr(tree, "gather_view", None)
    if callable(view):
        tree = view()
    if any(is_stored(x) for x in jax.tree.leaves(tree, is_leaf=is_stored)):
        # a remainder master is half a master: its fp32 values need the params beside it
        raise ValueError(
            "this tree holds a master kept as a 16-bit remainder beside the bf16 params "
            "(offload=('optimizer', 'remainder')), which is not the fp32 master on its own: "
            "gather state.fp32_master() instead of state.master"
        )
    mesh = mesh_of(tree)
    if mesh is None:
        return tree
    return replicator(mesh, to_device=to_device)(tree)


def gather_to_host(tree):
    """Full numpy copies of every leaf of ``tree``, on every process.

    Sharded leaves are replicated first (:func:`jaxzero.gather`: one all-gather per sharded
    leaf, so every process must call this together; a leaf in host memory is replicated
    there), then each process reads its local copy.
    Accepts an :class:`~jaxzero.EmaState` (its per-leaf EMA tree, also when small leaves are
    bucketed), a :class:`~jaxzero.TrainState`
    (its params) or any pytree; non-jax leaves are returned as numpy arrays.
    """
    tree = replicated(tree, to_device=False)

    def leaf(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.array(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(leaf, tree)
