"""jaxzero: ZeRO-style sharding of optimizer state, gradients and parameters, and a sharded
model EMA, for JAX + optax.

Public names only; the implementation lives in subpackages (see BUILD_NOTES.md,
"Architecture"): ``zero/`` (the ZeRO config, sharding rule and collectives), ``train/`` (state
and step), ``ema/`` (the sharded EMA), ``checkpoint/``, ``interop/``, ``memory/``,
``distributed/`` and ``cli/``.
"""

# First, before anything below imports jax: a quiet start on a machine without a GPU where
# jax's CUDA plugin is installed (jaxzero/_startup.py says what it prints otherwise).
from jaxzero import _startup  # noqa: F401

# isort: split

from jaxzero import checkpoint as checkpoint
from jaxzero import flax_nnx as flax_nnx
from jaxzero import gpu as gpu
from jaxzero import memory as memory
from jaxzero._version import __version__ as __version__
from jaxzero.ema.ema import BucketedTree as BucketedTree
from jaxzero.ema.ema import EmaState as EmaState
from jaxzero.ema.ema import ShardedEMA as ShardedEMA
from jaxzero.ema.ema import unbucket as unbucket_ema
from jaxzero.evaluation import ema_model_state as ema_model_state
from jaxzero.evaluation import ema_params as ema_params
from jaxzero.evaluation import gather as gather
from jaxzero.interop import deepspeed as deepspeed
from jaxzero.interop.torch.partition import greedy_partition as greedy_partition
from jaxzero.memory import estimate_memory as estimate_memory
from jaxzero.memory import measure as measure
from jaxzero.mesh import data_parallel_mesh as data_parallel_mesh
from jaxzero.precision import DynamicLossScale as DynamicLossScale
from jaxzero.precision import LossScaleState as LossScaleState
from jaxzero.precision import Precision as Precision
from jaxzero.precision import StaticLossScale as StaticLossScale
from jaxzero.precision import with_state_dtype as with_state_dtype
from jaxzero.simulate import simulate_cpu_devices as simulate_cpu_devices
from jaxzero.train.loss import GlobalMean as GlobalMean
from jaxzero.train.optimizer import ZeRO as ZeRO
from jaxzero.train.state import TrainState as TrainState
from jaxzero.train.step import TrainStep as TrainStep
from jaxzero.train.step import make_train_step as make_train_step
from jaxzero.zero.layers import VocabParallelEmbed as VocabParallelEmbed
from jaxzero.zero.layers import gather_layer as gather_layer
from jaxzero.zero.layers import scan_layers as scan_layers
from jaxzero.zero.layers import stacked_init as stacked_init
from jaxzero.zero.layers import stacked_params as stacked_params
from jaxzero.zero.layers import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from jaxzero.zero.layers import vocab_parallel_embed as vocab_parallel_embed
from jaxzero.zero.layers import vocab_table as vocab_table
from jaxzero.zero.offload.nvme_update import NVMe as NVMe
from jaxzero.zero.wire import Wire as Wire

__all__ = [
    "BucketedTree",
    "DynamicLossScale",
    "EmaState",
    "GlobalMean",
    "LossScaleState",
    "NVMe",
    "Precision",
    "ShardedEMA",
    "StaticLossScale",
    "TrainState",
    "TrainStep",
    "Wire",
    "ZeRO",
    "checkpoint",
    "data_parallel_mesh",
    "deepspeed",
    "ema_model_state",
    "ema_params",
    "estimate_memory",
    "flax_nnx",
    "gather",
    "gather_layer",
    "scan_layers",
    "stacked_init",
    "stacked_params",
    "gpu",
    "greedy_partition",
    "make_train_step",
    "measure",
    "memory",
    "simulate_cpu_devices",
    "unbucket_ema",
    "VocabParallelEmbed",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embed",
    "vocab_table",
    "with_state_dtype",
]
