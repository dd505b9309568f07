"""Symmetric blockwise integer quantization: the encoding of a quantized collective.

A flat run of ``size`` values is cut into ``groups`` blocks of ``block`` values (the last
padded with zeros), each block ``b`` stored as integers ``q = round(x / s_b)`` clipped to
``[-qmax, qmax]`` with one float32 scale ``s_b = max|x_b| / qmax`` (``qmax = 2**(bits-1) - 1``:
127 for int8, 7 for int4). Dequantizing gives ``q * s_b``, so every value is off by at most
half a step::

    |x - dequantize(quantize(x))| <= s_b / 2 = max|x_b| / (2 * qmax)

Blocks are adaptive as in DeepSpeed's ZeRO++ (``CUDAQuantizer``): the fewest groups that keep a
block at or under ``max_block`` values (4096 by default: DeepSpeed finds ~4k best, under ~8k
good, 16k its hard limit), sizes as even as the count allows. int4 values are packed two to a
byte (the low nibble first), so the payload is ``groups * block * bits / 8`` bytes plus
``4 * groups`` bytes of scales.

A block holding an inf or a NaN has a non-finite scale, and every value of it dequantizes to a
non-finite number (``q * inf`` or ``0 * inf``): a step's finite check still sees it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

BITS = (8, 4)
MAX_BLOCK = 4096


def qmax(bits: int) -> int:
    """The largest integer a ``bits``-bit symmetric code uses: 127 (int8), 7 (int4)."""
    return 2 ** (bits - 1) - 1


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How ``size`` values are cut: ``groups`` blocks of ``block`` values (the padded length
    ``groups * block`` >= ``size``), ``bits`` per value."""

    size: int
    groups: int
    block: int
    bits: int

    @property
    def padded(self) -> int:
        return self.groups * self.block

    @property
    def payload_bytes(self) -> int:
        """Bytes of the integer payload (int4: two values a byte)."""
        return self.padded * self.bits // 8

    @property
    def scale_bytes(self) -> int:
        """Bytes of the float32 scales, one per block."""
        return 4 * self.groups

    @property
    def bytes(self) -> int:
        return self.payload_bytes + self.scale_bytes


def blocks(size: int, bits: int, max_block: int = MAX_BLOCK) -> Blocks:
    """The blocks of ``size`` values: ``ceil(size / max_block)`` groups, each of
    ``ceil(size / groups)`` values (rounded up to even for int4's packing)."""
    if bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported; use one of {BITS}.")
    groups = max(1, math.ceil(size / max_block))
    block = max(1, math.ceil(size / groups))
    block += block % 2 if bits == 4 else 0
    return Blocks(size, groups, block, bits)


def _pack4(q):
    """Two int4 values a byte along the last axis: even positions in the low nibble."""
    pairs = q.reshape(q.shape[:-1] + (q.shape[-1] // 2, 2))
    low = jnp.bitwise_and(pairs[..., 0], jnp.int8(0x0F))
    return jnp.bitwise_or(low, jnp.left_shift(pairs[..., 1], jnp.int8(4)))


def _unpack4(p):
    """The inverse of :func:`_pack4`, sign-extending each nibble."""
    four = jnp.int8(4)
    low = jnp.right_shift(jnp.left_shift(p, four), four)
    high = jnp.right_shift(p, four)
    return jnp.stack([low, high], axis=-1).reshape(p.shape[:-1] + (2 * p.shape[-1],))


def quantize(x, bits: int = 8, max_block: int = MAX_BLOCK):
    """Quantize ``x`` (shape ``[..., size]``) blockwise along its last axis.

    Returns:
      ``(q, scales)``: ``q`` int8 of shape ``[..., padded * bits / 8]`` (int4 packed two a
      byte), ``scales`` float32 of shape ``[..., groups]`` (:func:`blocks`).
    """
    b = blocks(x.shape[-1], bits, max_block)
    x = x.astype(jnp.float32)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, b.padded - b.size)])
    x = x.reshape(x.shape[:-1] + (b.groups, b.block))
    m = qmax(bits)
    # At least the smallest normal float32: an all-zero block divides by it and stays zero.
    scales = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / m, jnp.finfo(jnp.float32).tiny)
    q = jnp.clip(jnp.round(x / scales[..., None]), -m, m).astype(jnp.int8)
    q = q.reshape(q.shape[:-2] + (b.padded,))
    return (_pack4(q) if bits == 4 else q), scales


def dequantize(q, scales, size: int, bits: int = 8, dtype=jnp.float32):
    """The values :func:`quantize` encoded: ``q * scale`` per block, the padding cut off,
    shape ``[..., size]`` in ``dtype``."""
    q = _unpack4(q) if bits == 4 else q
    groups = scales.shape[-1]
    x = q.reshape(q.shape[:-1] + (groups, q.shape[-1] // groups)).astype(jnp.float32)
    x = (x * scales[..., None]).reshape(q.shape)
    return jax.lax.slice_in_dim(x, 0, size, axis=x.ndim - 1).astype(dtype)
