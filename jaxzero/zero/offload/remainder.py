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
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

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


def split(master: jax.Array, compute: jax.Array) -> Remainder:
    """The remainder of an fp32 master beside its bf16 compute copy.

    Args:
      master: the fp32 master, any shape (a scalar, a local shard inside ``shard_map``).
      compute: its bf16 compute copy, of the same shape: ``master.astype(jnp.bfloat16)``
        (taken as an argument because the device already holds it). Any rounding that gives
        the truncated high half or one above it will do.

    Returns:
      A :class:`Remainder`: ``lo`` of the master's shape, ``carry`` of
      ``carry_bytes(master.size)`` bytes.

    Raises:
      ValueError: ``master`` is not float32, ``compute`` not bfloat16, or their shapes differ.
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
    bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
    high = (bits >> 16).astype(jnp.uint16)
    h = jax.lax.bitcast_convert_type(compute, jnp.uint16)
    carry = (h != high).astype(jnp.uint8)
    # packed along the flattened array: a static shape for any leaf shape or local shard
    packed = jnp.packbits(carry.reshape(-1), bitorder="little")
    return Remainder(lo=bits.astype(jnp.uint16), carry=packed)


def join(compute: jax.Array, rem: Remainder) -> jax.Array:
    """The fp32 master, bit for bit, from its bf16 compute copy and its remainder.

    Args:
      compute: the bf16 compute copy :func:`split` was given.
      rem: the :class:`Remainder` :func:`split` returned.

    Returns:
      The fp32 master, of ``compute``'s shape.

    Raises:
      ValueError: ``compute`` is not bfloat16, or ``rem`` is not the remainder of an array of
        its shape.
    """
    _check_compute(compute)
    want = (compute.shape, (carry_bytes(compute.size),))
    if (rem.lo.shape, rem.carry.shape) != want or rem.lo.dtype != jnp.uint16:
        raise ValueError(
            f"a compute copy of shape {compute.shape} needs a remainder with lo uint16 "
            f"{want[0]} and carry {want[1]}, and got lo {rem.lo.dtype} {rem.lo.shape} and "
            f"carry {rem.carry.shape}: pass the remainder split() returned for this master"
        )
    h = jax.lax.bitcast_convert_type(compute, jnp.uint16).astype(jnp.uint32)
    bits = jnp.unpackbits(rem.carry, count=compute.size, bitorder="little")
    carry = bits.reshape(compute.shape).astype(jnp.uint32)
    # h is the truncated high half, or one above it where the cast rounded up
    master = ((h - carry) << 16) | rem.lo.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(master, jnp.float32)
