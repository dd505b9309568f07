"""Parameter-to-rank partitions, compatible with the PyTorch sharders they mimic.

Pure functions on tensor sizes; nothing here touches devices except :func:`stacked_sharding`.

* :func:`greedy_partition` reproduces ``torch.distributed.optim.ZeroRedundancyOptimizer``
  (``sort=True``) and the distributed ``ModelEMA`` of thb1314/distributed_modelema
  (``sort=False, align_bytes=8``): each whole tensor is owned by one rank, plus the per-rank
  "bucket view" (one flat buffer per rank holding its tensors).
* :func:`contiguous_partition` is the DeepSpeed/Megatron partition: all tensors ravelled into one
  padded flat buffer that is cut into ``world_size`` equal shards (tensors may straddle ranks).
* :func:`pack` / :func:`unpack` move a list of arrays to and from the ``[world_size, L]`` stacked
  form of either plan, with numpy or jax arrays; :func:`stacked_sharding` shards that form's first
  axis over a mesh axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.trees import check_int

__all__ = [
    "GreedyPlan",
    "ContiguousPlan",
    "greedy_partition",
    "contiguous_partition",
    "pack",
    "unpack",
    "stacked_sharding",
]


def _check_numels(numels) -> tuple[int, ...]:
    if isinstance(numels, (str, bytes)) or not isinstance(numels, Sequence | np.ndarray):
        raise TypeError(f"numels must be a sequence of ints, got {type(numels).__name__}")
    return tuple(check_int(n, f"numels[{i}]", minimum=0) for i, n in enumerate(numels))


@dataclass(frozen=True)
class GreedyPlan:
    """Whole-tensor ownership plus the per-rank bucket view (see :func:`greedy_partition`).

    ``owner[i]``, ``offsets[i]``, ``slot_ends[i]`` are indexed by tensor (input order);
    ``per_rank[r][g]`` lists rank r's tensors of group g in assignment order; ``rank_numel[r]`` is
    the real element count of rank r and ``bucket_numel[r]`` its bucket length (padding included).
    Rank r's tensor i occupies ``[offsets[i], offsets[i] + numels[i])`` of its bucket and its slot
    (padding included) ends at ``slot_ends[i]``.
    """

    world_size: int
    numels: tuple[int, ...]
    groups: tuple[int, ...]
    owner: tuple[int, ...]
    per_rank: tuple[tuple[tuple[int, ...], ...], ...]
    rank_numel: tuple[int, ...]
    offsets: tuple[int, ...]
    slot_ends: tuple[int, ...]
    bucket_numel: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        return len(self.per_rank[0]) if self.per_rank else 0

    @property
    def max_bucket_numel(self) -> int:
        return max(self.bucket_numel)

    def rank_order(self, rank: int) -> tuple[int, ...]:
        """Tensor indices of ``rank`` in bucket order (group 0's list, then group 1's, ...)."""
        return tuple(i for group in self.per_rank[rank] for i in group)

    def bucket_entries(self, rank: int) -> tuple[tuple[int, int, int, int], ...]:
        """``(index, offset_start, offset_end_padded, real_size)`` for each tensor of ``rank``."""
        return tuple(
            (i, self.offsets[i], self.slot_ends[i], self.numels[i]) for i in self.rank_order(rank)
        )


def greedy_partition(
    numels: Sequence[int],
    world_size: int,
    *,
    groups: Sequence[int] | None = None,
    sort: bool = True,
    itemsize: int = 4,
    align_bytes: int | None = None,
    empty_bucket_numel: int | None = None,
) -> GreedyPlan:
    """Assign each whole tensor to one rank, greedily by running element totals.

    Algorithm (torch 2.13 ``ZeroRedundancyOptimizer._partition_parameters`` and
    distributed_modelema ``ModelEMA.partition_parameters``)::

        sizes = [0] * world_size                      # one total per rank, shared by all groups
        for g in ascending group ids:
            order = tensors of group g in input order
            if sort: order = stable sort of order by numel, descending
            for i in order:
                r = sizes.index(min(sizes))           # smallest total, ties -> lowest rank
                append i to per_rank[r][g]; sizes[r] += numels[i]

    Bucket view: rank r's bucket is its tensors in ``rank_order(r)``, each slot placed right
    after the previous one. Without ``align_bytes`` (torch ZeRO) slots are unpadded, offsets are
    cumulative and an empty rank gets torch's size-1 dummy bucket. With ``align_bytes`` (ModelEMA
    uses 8) each slot is rounded up to a multiple of ``align_bytes // itemsize`` elements and an
    empty rank has no bucket (size 0).

    Args:
        numels: element count of each tensor, in the order given to the optimizer / state dict.
        world_size: number of ranks (>= 1).
        groups: param-group id (int >= 0) of each tensor; default all 0. Group g is the g-th torch
            param group; ids with no tensors are empty groups and still appear in ``per_rank``.
        sort: True for torch ZeRO (size-descending within each group), False for ModelEMA
            (state-dict order).
        itemsize: bytes per element, used only with ``align_bytes`` (4 float32, 2 fp16/bf16,
            8 fp64).
        align_bytes: round each bucket slot up to this many bytes; None for no padding.
        empty_bucket_numel: bucket length of a rank that owns nothing; default 1 without
            ``align_bytes`` (torch ZeRO dummy bucket) and 0 with it (ModelEMA makes no bucket).

    Returns:
        A frozen :class:`GreedyPlan`.
    """
    world_size = check_int(world_size, "world_size", minimum=1)
    numels = _check_numels(numels)
    groups = _check_groups(groups, len(numels))
    grid = _slot_grid(itemsize, align_bytes)
    if empty_bucket_numel is None:
        empty_bucket_numel = 1 if align_bytes is None else 0
    empty_bucket_numel = check_int(empty_bucket_numel, "empty_bucket_numel", minimum=0)

    owner, lists, sizes = _assign(numels, groups, world_size, sort)
    offsets, slot_ends, bucket_numel = _bucket_view(numels, lists, grid, empty_bucket_numel)
    return GreedyPlan(
        world_size=world_size,
        numels=numels,
        groups=groups,
        owner=tuple(owner),
        per_rank=tuple(tuple(tuple(lst) for lst in rank_lists) for rank_lists in lists),
        rank_numel=tuple(sizes),
        offsets=tuple(offsets),
        slot_ends=tuple(slot_ends),
        bucket_numel=tuple(bucket_numel),
    )


def _assign(numels, groups, world_size: int, sort: bool):
    """The greedy assignment: (owner rank per tensor, per-rank per-group index lists, the
    ranks' element totals)."""
    num_groups = max(groups) + 1 if groups else 1
    sizes = [0] * world_size
    owner = [0] * len(numels)
    lists = [[[] for _ in range(num_groups)] for _ in range(world_size)]
    for g in range(num_groups):
        order = [i for i in range(len(numels)) if groups[i] == g]
        if sort:
            order.sort(key=lambda i: numels[i], reverse=True)  # list.sort is stable
        for i in order:
            r = sizes.index(min(sizes))
            owner[i] = r
            lists[r][g].append(i)
            sizes[r] += numels[i]
    return owner, lists, sizes


def _bucket_view(numels, lists, grid: int, empty_bucket_numel: int):
    """(offset and padded slot end per tensor, bucket length per rank) of the assignment."""
    offsets = [0] * len(numels)
    slot_ends = [0] * len(numels)
    bucket_numel = []
    for rank_lists in lists:
        end = 0
        for i in (i for group in rank_lists for i in group):
            offsets[i] = end
            end += -(-numels[i] // grid) * grid
            slot_ends[i] = end
        bucket_numel.append(end if any(rank_lists) else empty_bucket_numel)
    return offsets, slot_ends, bucket_numel


def _check_groups(groups, n: int) -> tuple[int, ...]:
    """One param-group id (int >= 0) per tensor; all 0 when ``groups`` is None."""
    if groups is None:
        return (0,) * n
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence | np.ndarray):
        raise TypeError(f"groups must be a sequence of ints, got {type(groups).__name__}")
    groups = tuple(check_int(g, f"groups[{i}]", minimum=0) for i, g in enumerate(groups))
    if len(groups) != n:
        raise ValueError(
            f"groups has {len(groups)} entries but numels has {n}; give one group id per tensor"
        )
    return groups


def _slot_grid(itemsize, align_bytes) -> int:
    """The element multiple every bucket slot is rounded up to (1 without ``align_bytes``)."""
    itemsize = check_int(itemsize, "itemsize", minimum=1)
    if align_bytes is None:
        return 1
    align_bytes = check_int(align_bytes, "align_bytes", minimum=1)
    if align_bytes % itemsize:
        raise ValueError(
            f"align_bytes={align_bytes} is not a multiple of itemsize={itemsize}; "
            "use an alignment that holds a whole number of elements"
        )
    return align_bytes // itemsize


@dataclass(frozen=True)
class ContiguousPlan:
    """One flat buffer cut into equal shards (see :func:`contiguous_partition`).

    Tensor i occupies ``ranges[i] = (start, end)`` of the flat buffer; rank r owns
    ``[r * shard_size, (r + 1) * shard_size)``. ``total_padded = world_size * shard_size``.
    """

    world_size: int
    align: int
    numels: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    total_numel: int
    total_padded: int
    shard_size: int

    def ranks_of(self, index: int) -> tuple[int, ...]:
        """Ranks whose shard holds at least one element of tensor ``index`` (empty if numel 0)."""
        start, end = self.ranges[index]
        if start == end:
            return ()
        return tuple(range(start // self.shard_size, (end - 1) // self.shard_size + 1))


def contiguous_partition(
    numels: Sequence[int], world_size: int, *, align: int = 1
) -> ContiguousPlan:
    """Ravel all tensors in order into one flat buffer and split it into equal shards.

    Algorithm (DeepSpeed ZeRO / Megatron distributed optimizer): tensor i occupies
    ``[sum(numels[:i]), sum(numels[:i+1]))``; the buffer is zero-padded at the end to
    ``total_padded = ceil(total / (world_size * align)) * world_size * align`` so that every
    shard has ``shard_size = total_padded // world_size`` elements, a multiple of ``align``.

    Args:
        numels: element count of each tensor, in buffer order.
        world_size: number of ranks (>= 1).
        align: each shard size is a multiple of this many elements (>= 1).

    Returns:
        A frozen :class:`ContiguousPlan`.
    """
    world_size = check_int(world_size, "world_size", minimum=1)
    align = check_int(align, "align", minimum=1)
    numels = _check_numels(numels)
    starts = np.concatenate([[0], np.cumsum(numels, dtype=np.int64)]).tolist()
    total = int(starts[-1])
    unit = world_size * align
    total_padded = -(-total // unit) * unit
    return ContiguousPlan(
        world_size=world_size,
        align=align,
        numels=numels,
        ranges=tuple((int(starts[i]), int(starts[i + 1])) for i in range(len(numels))),
        total_numel=total,
        total_padded=total_padded,
        shard_size=total_padded // world_size,
    )


def _namespace(arrays):
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def pack(plan: GreedyPlan | ContiguousPlan, arrays: Sequence) -> np.ndarray | jax.Array:
    """Lay ``arrays`` out as the per-rank flat buffers of ``plan``, stacked over ranks.

    Args:
        plan: a :class:`GreedyPlan` or :class:`ContiguousPlan`.
        arrays: one array per tensor of the plan, in input order, each with the plan's numel.
            Any jax array makes the result a jax array (jit-compatible); otherwise numpy.

    Returns:
        ``[world_size, L]`` with L = ``plan.max_bucket_numel`` (GreedyPlan, row r = rank r's bucket,
        zero in padding and past its end) or ``plan.shard_size`` (ContiguousPlan). The dtype is
        the common result type of ``arrays`` (float32 if there are none).
    """
    if not isinstance(plan, GreedyPlan | ContiguousPlan):
        raise TypeError(f"plan must be a GreedyPlan or ContiguousPlan, got {type(plan).__name__}")
    arrays = list(arrays)
    if len(arrays) != len(plan.numels):
        raise ValueError(f"plan has {len(plan.numels)} tensors but {len(arrays)} arrays were given")
    xp = _namespace(arrays)
    flat = [xp.ravel(xp.asarray(a)) for a in arrays]
    for i, (f, n) in enumerate(zip(flat, plan.numels, strict=True)):
        if f.shape[0] != n:
            raise ValueError(f"arrays[{i}] has {f.shape[0]} elements but the plan expects {n}")
    dtype = xp.result_type(*flat) if flat else np.float32

    def zeros(n):
        return xp.zeros((n,), dtype)

    if isinstance(plan, ContiguousPlan):
        pieces = flat + [zeros(plan.total_padded - plan.total_numel)]
        return xp.concatenate(pieces).astype(dtype).reshape(plan.world_size, plan.shard_size)
    width = plan.max_bucket_numel
    rows = []
    for r in range(plan.world_size):
        pieces, end = [], 0
        for i in plan.rank_order(r):
            pieces += [zeros(plan.offsets[i] - end), flat[i].astype(dtype)]
            end = plan.offsets[i] + plan.numels[i]
        pieces.append(zeros(width - end))
        rows.append(xp.concatenate(pieces))
    return xp.stack(rows)


def unpack(plan: GreedyPlan | ContiguousPlan, stacked, shapes: Sequence[Sequence[int]]) -> list:
    """Inverse of :func:`pack`: cut each tensor back out of the stacked buffers.

    Args:
        plan: the plan used to pack.
        stacked: ``[world_size, L]`` numpy or jax array as returned by :func:`pack`.
        shapes: the shape of each tensor, in input order (product must equal its numel).

    Returns:
        A list of arrays (numpy or jax, like ``stacked``) with the given shapes and
        ``stacked``'s dtype.
    """
    if not isinstance(plan, GreedyPlan | ContiguousPlan):
        raise TypeError(f"plan must be a GreedyPlan or ContiguousPlan, got {type(plan).__name__}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if len(shapes) != len(plan.numels):
        raise ValueError(f"plan has {len(plan.numels)} tensors but {len(shapes)} shapes were given")
    for i, (s, n) in enumerate(zip(shapes, plan.numels, strict=True)):
        if math.prod(s) != n:
            raise ValueError(f"shapes[{i}]={s} has {math.prod(s)} elements; the plan expects {n}")
    width = plan.shard_size if isinstance(plan, ContiguousPlan) else plan.max_bucket_numel
    if tuple(stacked.shape) != (plan.world_size, width):
        raise ValueError(
            f"stacked has shape {tuple(stacked.shape)}, expected {(plan.world_size, width)}; "
            "pass the output of pack(plan, ...)"
        )
    if isinstance(plan, ContiguousPlan):
        flat = stacked.reshape(-1)
        return [flat[a:b].reshape(s) for (a, b), s in zip(plan.ranges, shapes, strict=True)]
    return [
        stacked[plan.owner[i], plan.offsets[i] : plan.offsets[i] + plan.numels[i]].reshape(s)
        for i, s in enumerate(shapes)
    ]


def stacked_sharding(mesh: jax.sharding.Mesh, axis: str = "data") -> NamedSharding:
    """``NamedSharding(mesh, P(axis, None))``: row r of a ``[N, L]`` stacked buffer on rank r.

    Args:
        mesh: the device mesh; ``mesh.shape[axis]`` should equal the plan's world_size.
        axis: mesh axis name that indexes ranks.

    Returns:
        The sharding to pass to ``jax.device_put`` or use as a jit out_sharding.
    """
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not a mesh axis; mesh has axes {mesh.axis_names}")
    return NamedSharding(mesh, P(axis, None))
