"""``jaxzero.layouts``: torch's parameter-to-rank partitions, re-exported from
:mod:`jaxzero.interop.torch.partition` (where the code and its documentation live)."""

from jaxzero.interop.torch.partition import (
    ContiguousPlan,
    GreedyPlan,
    contiguous_partition,
    greedy_partition,
    pack,
    stacked_sharding,
    unpack,
)

__all__ = [
    "GreedyPlan",
    "ContiguousPlan",
    "greedy_partition",
    "contiguous_partition",
    "pack",
    "unpack",
    "stacked_sharding",
]
