"""Small helpers shared by the torch interop modules: host copies, placement, shapes, tree
paths, the transpose kinds between torch and Flax layouts, and message lists.

Imports no torch: tensors are recognised by their type's module.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero import trees

# How a torch tensor maps to its Flax leaf: as is, a Linear weight [out, in] <-> Dense kernel
# [in, out], or a conv weight [out, in, *k] <-> kernel [*k, in, out].
KINDS = ("identity", "linear", "conv")


def is_tensor(x) -> bool:
    """Whether ``x`` is a torch tensor (without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "shape")


def to_host(x) -> np.ndarray:
    """A numpy copy of a torch tensor, jax array (gathered) or array-like."""
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        return np.array(x)
    if type(x).__module__.startswith("torch"):
        t = x.detach().cpu()
        if t.dtype.is_floating_point and t.dtype.itemsize < 4 and str(t.dtype) != "torch.float16":
            t = t.float()  # bfloat16/float8 have no numpy dtype
        return t.numpy().copy()
    return np.array(x)


def is_float(x) -> bool:
    """Whether ``x`` (a torch tensor, array or shape-only entry) holds floats."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return True
    if type(x).__module__.startswith("torch"):
        return bool(dtype.is_floating_point)
    return bool(jnp.issubdtype(dtype, jnp.floating))


def shape_of(x) -> tuple[int, ...]:
    """The shape of an array or tensor, or ``x`` itself when it is a tuple/list of ints."""
    if isinstance(x, tuple | list) and all(isinstance(d, int) for d in x):
        return tuple(x)
    return tuple(int(d) for d in x.shape)


def by_path(tree) -> dict[tuple[str, ...], Any]:
    """``{path (tuple of str): leaf}`` in flatten order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {trees.path_strs(path): leaf for path, leaf in leaves}


def fmt_path(path) -> str:
    """A path tuple as ``"a/b/kernel"``."""
    return "/".join(path)


def to_flax(kind: str, a: np.ndarray) -> np.ndarray:
    """A torch-layout array in the Flax layout of ``kind`` (see :data:`KINDS`)."""
    if kind == "linear":
        return a.T
    if kind == "conv":
        return np.transpose(a, tuple(range(2, a.ndim)) + (1, 0))
    return a


def to_torch(kind: str, a: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_flax`."""
    if kind == "linear":
        return a.T
    if kind == "conv":
        return np.transpose(a, (a.ndim - 1, a.ndim - 2) + tuple(range(a.ndim - 2)))
    return a


def _moved_shape(move, kind: str, shape) -> tuple[int, ...]:
    return tuple(move(kind, np.broadcast_to(np.int8(0), tuple(shape))).shape)  # no allocation


def to_flax_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Flax shape of a torch ``shape`` under ``kind``."""
    return _moved_shape(to_flax, kind, shape)


def to_torch_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape of a Flax ``shape`` under ``kind``."""
    return _moved_shape(to_torch, kind, shape)


def join(items, limit=20) -> str:
    """``items`` comma-separated for a message, at most ``limit`` of them."""
    items = list(items)
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(str(i) for i in items[:limit]) + more


def place(value: np.ndarray, target):
    """``value`` with ``target``'s dtype and sharding."""
    value = np.asarray(value, dtype=target.dtype)
    sharding = getattr(target, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)
