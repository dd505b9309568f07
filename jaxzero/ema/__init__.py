"""The sharded model EMA (:mod:`~jaxzero.ema.ema`): the averaging rule, its storage per leaf
or in rows, and its placement and update in the master weights' shards.

``from jaxzero.ema import ShardedEMA, EmaState`` is the short path to the two public classes.
"""

from jaxzero.ema.ema import EmaState as EmaState
from jaxzero.ema.ema import ShardedEMA as ShardedEMA

__all__ = ["EmaState", "ShardedEMA"]
