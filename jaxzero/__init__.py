"""jaxzero: ZeRO-style sharding of optimizer state, gradients and parameters, and a sharded
model EMA, for JAX + optax."""

from jaxzero import checkpoint, layouts, memory, nnx, torch_interop
from jaxzero.ema.ema import EmaState, ShardedEMA
from jaxzero.ema.storage import BucketedTree
from jaxzero.ema.storage import unbucket as unbucket_ema
from jaxzero.evaluation import ema_model_state, ema_params, gather
from jaxzero.layouts import greedy_partition
from jaxzero.memory import estimate_memory, measure
from jaxzero.mesh import data_parallel_mesh
from jaxzero.precision import DynamicLossScale, LossScaleState, Precision, StaticLossScale
from jaxzero.train.state import TrainState
from jaxzero.train.step import TrainStep, make_train_step
from jaxzero.zero.config import ZeRO
from jaxzero.zero.layers import gather_layer

__version__ = "0.1.0"

__all__ = [
    "checkpoint",
    "layouts",
    "memory",
    "torch_interop",
    "nnx",
    "ema_model_state",
    "estimate_memory",
    "greedy_partition",
    "measure",
    "BucketedTree",
    "DynamicLossScale",
    "EmaState",
    "LossScaleState",
    "Precision",
    "ShardedEMA",
    "StaticLossScale",
    "TrainState",
    "TrainStep",
    "ZeRO",
    "data_parallel_mesh",
    "ema_params",
    "unbucket_ema",
    "gather",
    "gather_layer",
    "make_train_step",
]
