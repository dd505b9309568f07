"""``jaxzero.layouts``: torch's parameter-to-rank partitions, re-exported from
:mod:`jaxzero.interop.torch.partition` (where the code and its documentation live)."""

from jaxzero.interop.torch import partition as _partition
from jaxzero.interop.torch.partition import ContiguousPlan as ContiguousPlan
from jaxzero.interop.torch.partition import GreedyPlan as GreedyPlan
from jaxzero.interop.torch.partition import contiguous_partition as contiguous_partition
from jaxzero.interop.torch.partition import greedy_partition as greedy_partition
from jaxzero.interop.torch.partition import pack as pack
from jaxzero.interop.torch.partition import stacked_sharding as stacked_sharding
from jaxzero.interop.torch.partition import unpack as unpack

__all__ = list(_partition.__all__)
