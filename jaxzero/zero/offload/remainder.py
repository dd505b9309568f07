"""An fp32 master kept as its bf16 compute copy plus a 16-bit remainder and a carry bit, exact
(decision 47).

With the optimizer offloaded and bf16 compute params on the device, the host's fp32 master
repeats the high half of every compute param. :func:`split` keeps only what the compute copy
lacks: the master's low 16 bits (``lo``) and one bit per element saying whether the cast to
bf16 rounded the high half up (``carry``, packed 8 to a byte). :func:`join` rebuilds the master
bit for bit: ``((h - carry) << 16) | lo``, with ``h`` the compute param's bit pattern.

The carry bit is what makes it exact. Round-to-nearest-even sends two masters with the same
low half to one bf16 value at each tie: ``(t, 0x8000)`` with ``t`` even rounds down to ``t``,
and ``(t - 1, 0x8000)`` rounds up to it. Both give the same ``(h, lo)``, so no rule on those
32 bits rebuilds both. The rebuild only needs ``h`` to be the master's truncated high half or
one above it, whatever rounding made it, so it is exact for every finite fp32 (subnormals, ties
and the largest finite value, which rounds to inf in bf16 included) and for +-inf. A NaN master
comes back a NaN, its payload possibly changed; the step skips non-finite updates, so the
master holds none.

The offloaded step keeps the master this way with ``offload=("optimizer", "remainder")``
(:mod:`.placement`): the carry is then packed along each leaf's last axis (``axis=-1``), so a
leaf's rows, its shards and the streamed update's chunks (:mod:`.stream`) each own whole carry
bytes; :func:`storable` says which leaves, :func:`rows` and :func:`put_rows` cut and write a
chunk.

Outside the step every reader sees the fp32 master: :func:`fp32` joins a state's stored master
with its params (what :meth:`jaxzero.TrainState.fp32_master`, checkpoint saves and exports
read), and :func:`stored_like` splits an fp32 master again into the leaves a target state
keeps as remainders (a checkpoint restored into ``offload=("optimizer", "remainder")``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.mesh import in_host_memory

#: host bytes per param of the stored remainder: 2 for ``lo``, 1/8 for the packed carry bit
_LO_BYTES = 2
_CARRY_BYTES = 1 / 8


class Remainder(NamedTuple):
    """What the host keeps of an fp32 master beside its bf16 compute copy.

    Attributes:
      lo: the master's low 16 bits, uint16, of the master's shape.
      carry: 1 where the bf16 compute copy's bit pattern is the master's truncated high half
        plus one, the flattened array's bits packed 8 to a uint8 (little bit order, the last
        byte padded with zeros): ``ceil(size / 8)`` bytes.
    """

    lo: jax.Array
    carry: jax.Array


def host_bytes_per_param() -> float:
    """Host bytes per param of a :class:`Remainder`, in place of 4 for an fp32 master.

    Returns:
      2.125: 2 bytes of ``lo`` and one carry bit.
    """
    return _LO_BYTES + _CARRY_BYTES


def carry_shape(shape, axis: int | None = None) -> tuple[int, ...]:
    """The shape of the packed carry of a master of ``shape``.

    Args:
      shape: the master's shape.
      axis: None (packed along the flattened array) or -1 (along the last axis, row by row).

    Returns:
      ``(ceil(size / 8),)``, or ``shape[:-1] + (ceil(shape[-1] / 8),)``.
    """
    shape = tuple(shape)
    if axis is None:
        return (carry_bytes(math.prod(shape)),)
    return shape[:-1] + (carry_bytes(shape[-1]),)


def carry_bytes(size: int) -> int:
    """Bytes of the packed carry of an array of ``size`` elements.

    Args:
      size: the number of elements of the master (1 for a scalar).

    Returns:
      ``ceil(size / 8)``.
    """
    return math.ceil(size / 8)


def _check_compute(compute) -> None:
    if compute.dtype != jnp.bfloat16:
        raise ValueError(
            f"the compute params must be bfloat16 to rebuild an fp32 master from them and a "
            f"16-bit remainder, and got {compute.dtype}: cast them with "
            f"master.astype(jnp.bfloat16), or keep the fp32 master whole"
        )


def _check_axis(shape, axis) -> None:
    if axis not in (None, -1) or (axis == -1 and not shape):
        raise ValueError(
            f"the carry is packed along the flattened array (axis=None) or along the last "
            f"axis of an array with one (axis=-1), and got axis={axis!r} for shape {shape}"
        )


def split(master: jax.Array, compute: jax.Array, axis: int | None = None) -> Remainder:
    """The remainder of an fp32 master beside its bf16 compute copy.

    Args:
      master: the fp32 master, any shape (a scalar, a local shard inside ``shard_map``).
      compute: its bf16 compute copy, of the same shape: ``master.astype(jnp.bfloat16)``
        (taken as an argument because the device already holds it). Any rounding that gives
        the truncated high half or one above it will do.
      axis: None to pack the carry along the flattened array, -1 to pack it along the last
        axis, each row padded to whole bytes (what the offloaded step stores).

    Returns:
      A :class:`Remainder`: ``lo`` of the master's shape, ``carry`` of
      ``carry_shape(master.shape, axis)``.

    Raises:
      ValueError: ``master`` is not float32, ``compute`` not bfloat16, their shapes differ,
        or ``axis`` is neither None nor -1 (or -1 for a scalar).
    """
    if master.dtype != jnp.float32:
        raise ValueError(
            f"split keeps the low half of an fp32 master, and the master is {master.dtype}: "
            f"pass the float32 master (the remainder of a bf16 master is nothing: keep it whole)"
        )
    _check_compute(compute)
    if master.shape != compute.shape:
        raise ValueError(
            f"the master has shape {master.shape} and its compute copy {compute.shape}: pass "
            f"the compute copy of this master (master.astype(jnp.bfloat16))"
        )
    _check_axis(master.shape, axis)
    bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
    high = (bits >> 16).astype(jnp.uint16)
    h = jax.lax.bitcast_convert_type(compute, jnp.uint16)
    carry = (h != high).astype(jnp.uint8)
    if axis is None:
        # packed along the flattened array: a static shape for any leaf shape or local shard
        packed = jnp.packbits(carry.reshape(-1), bitorder="little")
    else:  # row by row: a row's carry bytes stay with its row in any shard or chunk of rows
        packed = jnp.packbits(carry, axis=-1, bitorder="little")
    return Remainder(lo=bits.astype(jnp.uint16), carry=packed)


def join(compute: jax.Array, rem: Remainder, axis: int | None = None) -> jax.Array:
    """The fp32 master, bit for bit, from its bf16 compute copy and its remainder.

    Args:
      compute: the bf16 compute copy :func:`split` was given.
      rem: the :class:`Remainder` :func:`split` returned.
      axis: the ``axis`` :func:`split` was given.

    Returns:
      The fp32 master, of ``compute``'s shape.

    Raises:
      ValueError: ``compute`` is not bfloat16, or ``rem`` is not the remainder of an array of
        its shape.
    """
    _check_compute(compute)
    _check_axis(compute.shape, axis)
    want = (compute.shape, carry_shape(compute.shape, axis))
    if (rem.lo.shape, rem.carry.shape) != want or rem.lo.dtype != jnp.uint16:
        raise ValueError(
            f"a compute copy of shape {compute.shape} needs a remainder with lo uint16 "
            f"{want[0]} and carry {want[1]}, and got lo {rem.lo.dtype} {rem.lo.shape} and "
            f"carry {rem.carry.shape}: pass the remainder split() returned for this master"
        )
    h = jax.lax.bitcast_convert_type(compute, jnp.uint16).astype(jnp.uint32)
    if axis is None:
        bits = jnp.unpackbits(rem.carry, count=compute.size, bitorder="little")
    else:
        bits = jnp.unpackbits(rem.carry, axis=-1, count=compute.shape[-1], bitorder="little")
    carry = bits.reshape(compute.shape).astype(jnp.uint32)
    # h is the truncated high half, or one above it where the cast rounded up
    master = ((h - carry) << 16) | rem.lo.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(master, jnp.float32)


def is_stored(x) -> bool:
    """Whether ``x`` (a leaf of a state's master) is a :class:`Remainder`."""
    return isinstance(x, Remainder)


def storable(shape, local_shape) -> bool:
    """Whether the offloaded step can keep a master leaf as a :class:`Remainder` packed row by
    row: it has an axis, and its last axis holds a whole number of carry bytes per device,
    so every shard and every chunk of 8 rows of it owns its carry bytes.

    Args:
      shape: the leaf's shape.
      local_shape: its shard's shape on one device.

    Returns:
      True where ``shape`` has an axis and ``local_shape[-1]`` is a positive multiple of 8.
    """
    return len(shape) >= 1 and local_shape[-1] > 0 and local_shape[-1] % 8 == 0


def store(master, compute):
    """The offloaded step's stored master: each leaf of ``master`` where ``compute`` has a
    bf16 leaf its :func:`split` row by row, the others left whole.

    Args:
      master: the fp32 master tree.
      compute: a tree of its shape: per leaf its bf16 compute copy, or None to keep the leaf
        whole.

    Returns:
      ``master`` with :class:`Remainder` leaves where ``compute`` has a copy.
    """
    one = lambda m, c: m if c is None else split(m, c, axis=-1)
    return jax.tree.map(one, master, compute, is_leaf=lambda c: c is None)


def stored_specs(specs):
    """PartitionSpecs of a stored master whose ``specs`` were computed leaf by leaf: a
    :class:`Remainder`'s carry is sharded as its ``lo`` (the carry's own shape may pick
    another axis).

    Args:
      specs: the tree of PartitionSpecs of a stored master's leaves.

    Returns:
      ``specs`` with each :class:`Remainder`'s carry spec set to its ``lo`` spec.
    """
    fix = lambda s: Remainder(s.lo, s.lo) if is_stored(s) else s
    return jax.tree.map(fix, specs, is_leaf=is_stored)


def _carry_range(rem: Remainder, start, size: int, dim: int):
    last = dim == rem.lo.ndim - 1
    return (start // 8, size // 8) if last else (start, size)


def rows(rem: Remainder, start, size: int, dim: int) -> Remainder:
    """``size`` rows of ``rem`` (packed row by row) along ``dim`` from ``start``.

    Args:
      rem: a :class:`Remainder` packed along the last axis.
      start: the first row (a multiple of 8 when ``dim`` is the last axis).
      size: how many (a multiple of 8 when ``dim`` is the last axis).
      dim: the axis to cut.

    Returns:
      The rows' :class:`Remainder`.
    """
    at, n = _carry_range(rem, start, size, dim)
    cut = lambda x, s, k: jax.lax.dynamic_slice_in_dim(x, s, k, dim, allow_negative_indices=False)
    return Remainder(cut(rem.lo, start, size), cut(rem.carry, at, n))


def put_rows(rem: Remainder, piece: Remainder, start, dim: int) -> Remainder:
    """``rem`` with ``piece`` (from :func:`rows`' cut of ``rem``'s shape) written at ``start``
    along ``dim``.

    Args:
      rem: a :class:`Remainder` packed along the last axis.
      piece: the rows to write.
      start: the first row (a multiple of 8 when ``dim`` is the last axis).
      dim: the axis of the cut.

    Returns:
      The updated :class:`Remainder`.
    """
    at, _ = _carry_range(rem, start, piece.lo.shape[dim], dim)
    put = lambda x, y, s: jax.lax.dynamic_update_slice_in_dim(
        x, y, s, dim, allow_negative_indices=False
    )
    return Remainder(put(rem.lo, piece.lo, start), put(rem.carry, piece.carry, at))


# ------------------------------------------------------------------ the boundary to fp32 readers
def _fetch(x):
    """``x`` (traced) in device memory, where it is computed with (jax refuses a host operand
    beside a device one)."""
    return jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x


@functools.cache
def _joiner(sharding):
    fn = lambda c, r: join(_fetch(c), Remainder(_fetch(r.lo), _fetch(r.carry)), axis=-1)
    return jax.jit(fn, out_shardings=sharding)


@functools.cache
def _splitter(out: Remainder, flag):
    def fn(m, c):
        m, c = _fetch(m), _fetch(c)
        high = (jax.lax.bitcast_convert_type(m, jnp.uint32) >> 16).astype(jnp.uint16)
        up = jax.lax.bitcast_convert_type(c, jnp.uint16) - high  # wraps below the high half
        return split(m, c, axis=-1), jnp.all(up <= 1)

    return jax.jit(fn, out_shardings=(out, flag))


def fp32(master, params):
    """The fp32 master of a state's stored ``master``: every :class:`Remainder` leaf joined
    (packed row by row) with its bf16 ``params`` leaf, placed as its ``lo`` is (in the same
    shards and memory kind), the fp32 leaves as they are. Bit for bit the master the
    fp32-master run holds. Each leaf is joined on its own, so the device holds one leaf's
    fp32 copy at a time.

    Args:
      master: a state's ``master`` (arrays), stored or not.
      params: the state's compute params, the same tree.

    Returns:
      The fp32 master tree (``master`` itself when it holds no :class:`Remainder`).
    """
    if not any(is_stored(x) for x in jax.tree.leaves(master, is_leaf=is_stored)):
        return master

    def one(m, c):
        return _joiner(m.lo.sharding)(c, m) if is_stored(m) else m

    return jax.tree.map(one, master, params, is_leaf=is_stored)


def fp32_shapes(master):
    """:func:`fp32` for a tree of ShapeDtypeStructs: each :class:`Remainder` leaf becomes the
    fp32 ShapeDtypeStruct it stands for, with its ``lo``'s sharding.

    Args:
      master: a stored master's ShapeDtypeStructs (an abstract state's ``master``).

    Returns:
      The fp32 master's ShapeDtypeStructs.
    """

    def one(m):
        if not is_stored(m):
            return m
        sharding = getattr(m.lo, "sharding", None)
        return jax.ShapeDtypeStruct(m.lo.shape, jnp.float32, sharding=sharding)

    return jax.tree.map(one, master, is_leaf=is_stored)


def stored_like(master, params, like):
    """The inverse of :func:`fp32`: each leaf of the fp32 ``master`` that ``like`` keeps as a
    :class:`Remainder` split (row by row) against its ``params`` leaf, in ``like``'s
    shardings; the others as they are.

    Args:
      master: the fp32 master tree (arrays).
      params: its bf16 compute params, the same tree: each leaf the master's cast.
      like: the target's stored master (arrays or ShapeDtypeStructs with shardings), whose
        :class:`Remainder` leaves say which leaves to split and where to place them.

    Returns:
      ``master`` with :class:`Remainder` leaves where ``like`` has them.

    Raises:
      ValueError: a params leaf is not its master leaf's bf16 cast (neither the truncated high
        half nor one above it), so no remainder beside it rebuilds the master.
    """

    def one(m, c, want):
        if not is_stored(want):
            return m
        out = Remainder(want.lo.sharding, want.carry.sharding)
        rem, ok = _splitter(out, NamedSharding(want.lo.sharding.mesh, P()))(m, c)
        if not bool(ok):
            raise ValueError(
                f"a master leaf of shape {m.shape} is to be kept as a remainder beside its "
                f"bf16 params, and the params are not its bf16 cast, so the remainder would "
                f"rebuild another master: restore into offload='optimizer' (an fp32 master), "
                f"or set the params to the master's cast first"
            )
        return rem

    return jax.tree.map(one, master, params, like)
