"""DeepSpeed 0.19.8's flat partition layouts, as pure numpy functions.

**ZeRO 1/2** (and ``BF16_Optimizer``), per param group:

1. the group's params back to back in ``param_shapes`` order, each followed by its alignment
   padding (``param_alignment_paddings``; all 0 unless ``parameter_alignment``);
2. the total padded with zeros up to a multiple of ``2 * W`` (``nccl_start_alignment_factor``);
3. rank r owns ``[r * P, (r + 1) * P)``, ``P = total / W``. A parameter may span ranks, and a
   rank may own only padding.

**ZeRO 3**, per sub-group: each parameter is split on its own into W chunks of
``ceil(numel / W)`` (the last ones padded); rank r's flat group is its chunk of every
parameter, back to back in ``param_shapes`` order.
"""

from __future__ import annotations

import math

import numpy as np

ALIGN = 2  # DeepSpeed's nccl_start_alignment_factor


def param_alignment(element_size: int) -> int:
    """Elements per alignment unit with ``parameter_alignment`` on (16 bytes)."""
    return 16 // math.gcd(16, element_size)


def alignment_paddings(numels: list[int], alignment: int) -> list[int]:
    """The padding after each param (none after the last) for a per-param ``alignment``."""
    out, offset = [], 0
    for i, n in enumerate(numels):
        offset += n
        pad = 0 if i == len(numels) - 1 else (-offset) % alignment
        out.append(pad)
        offset += pad
    return out


def round_robin_order(names: list[str], world_size: int) -> list[str]:
    """``round_robin_gradients`` order: params i, i+W, i+2W, ... for i = 0..W-1."""
    return [n for j in range(world_size) for n in names[j::world_size]]


def zero12_offsets(numels: list[int], paddings: list[int]) -> tuple[list[int], int]:
    """Each param's start in the flat group, and the group's length before DP padding."""
    offsets, pos = [], 0
    for n, pad in zip(numels, paddings, strict=True):
        offsets.append(pos)
        pos += n + pad
    return offsets, pos


def zero12_partition_size(used: int, world_size: int) -> int:
    """P: the per-rank partition length of a group whose params (with padding) fill ``used``."""
    unit = ALIGN * world_size
    return math.ceil(used / unit) * unit // world_size


def zero12_real_length(used: int, size: int, rank: int) -> int:
    """How many of rank ``rank``'s ``size`` elements are not DP padding."""
    return min(size, max(0, used - rank * size))


def zero12_join(parts: list[np.ndarray], size: int) -> np.ndarray:
    """The flat group (length ``W * size``) from per-rank partitions, each padded to ``size``."""
    flat = np.zeros(size * len(parts), np.float32)
    for r, part in enumerate(parts):
        flat[r * size : r * size + part.size] = part
    return flat


def zero12_split(flat: np.ndarray, size: int, world_size: int) -> list[np.ndarray]:
    """The inverse of :func:`zero12_join` (each rank's full partition, padding included)."""
    full = np.zeros(size * world_size, np.float32)
    full[: flat.size] = flat
    return [full[r * size : (r + 1) * size].copy() for r in range(world_size)]


def zero12_flatten(arrays: list[np.ndarray], paddings: list[int]) -> np.ndarray:
    """The params back to back with their alignment padding (zeros)."""
    pieces = []
    for a, pad in zip(arrays, paddings, strict=True):
        pieces.append(np.asarray(a, np.float32).reshape(-1))
        pieces.append(np.zeros(pad, np.float32))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def zero3_chunk(numel: int, world_size: int) -> int:
    """The per-rank chunk of a ZeRO-3 parameter."""
    return math.ceil(numel / world_size)


def zero3_join(rank_flats: list[np.ndarray], numels: list[int]) -> list[np.ndarray]:
    """Each parameter (flat, unpadded) of a sub-group from the W ranks' flat groups."""
    w = len(rank_flats)
    out, pos = [], 0
    for n in numels:
        c = zero3_chunk(n, w)
        out.append(np.concatenate([f[pos : pos + c] for f in rank_flats])[:n])
        pos += c
    return out


def zero3_split(arrays: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Each rank's flat group of a sub-group (padding as zeros)."""
    ranks = [[] for _ in range(world_size)]
    for a in arrays:
        flat = np.asarray(a, np.float32).reshape(-1)
        c = zero3_chunk(flat.size, world_size)
        padded = np.zeros(c * world_size, np.float32)
        padded[: flat.size] = flat
        for r in range(world_size):
            ranks[r].append(padded[r * c : (r + 1) * c])
    return [np.concatenate(p) if p else np.zeros(0, np.float32) for p in ranks]
