"""The training state pytree."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from jaxzero.ema.ema import EmaState
from jaxzero.precision import LossScaleState


class TrainState(struct.PyTreeNode):
    """Everything that persists between steps, each leaf placed on the mesh.

    Attributes:
      step: int32 optimizer steps taken (skipped steps do not count).
      params: compute parameters (``param_dtype``): replicated for stages 0-2, sharded 1/N for
        stage 3.
      master: fp32 master weights when ``param_dtype`` differs from ``master_dtype`` (sharded
        1/N for stages 1-3, replicated for stage 0); None otherwise, in which case the master
        is ``params`` itself (or its local slice).
      opt_state: the wrapped optax transformation's state, sharded 1/N for stages 1-3.
      skipped: int32 count of steps skipped for non-finite gradients.
      ema: :class:`EmaState` in the master's shards, or None.
      loss_scale: :class:`LossScaleState`, or None.
      model_state: non-trainable collections (e.g. Flax ``batch_stats``), replicated.
      rng: a PRNG key for dropout etc., replicated, or None.
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any
    skipped: jax.Array
    ema: EmaState | None = None
    loss_scale: LossScaleState | None = None
    model_state: Any = None
    rng: Any = None
