"""The sharded model EMA: the averaging rule (:mod:`~jaxzero.ema.ema`), its storage per leaf or
bucketed (:mod:`~jaxzero.ema.storage`), and its placement in the master weights' shards
(:mod:`~jaxzero.ema.placement`).

``from jaxzero.ema import ShardedEMA, EmaState`` keeps working (this was one module before).
"""

from jaxzero.ema.ema import EmaState as EmaState
from jaxzero.ema.ema import ShardedEMA as ShardedEMA

__all__ = ["EmaState", "ShardedEMA"]
