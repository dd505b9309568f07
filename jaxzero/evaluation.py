"""The EMA as the model's weights, for evaluation and export; ``gather`` and
``gather_to_host`` (:mod:`jaxzero.distributed.host`) assemble any tree."""

from __future__ import annotations

import jax

from jaxzero.distributed.host import gather as gather
from jaxzero.distributed.host import gather_to_host as gather_to_host
from jaxzero.distributed.host import mesh_of as mesh_of
from jaxzero.distributed.host import replicator
from jaxzero.train.nvme_step import NVMeState
from jaxzero.train.state import TrainState
from jaxzero.trees import check_not_donated


def ema_params(state: TrainState, dtype=None):
    """The EMA weights as a replicated params tree (cast to the compute dtype), ready to be
    passed to the model in place of ``state.params``; one extra full copy, nothing more.
    An NVMe tier's state (:class:`~jaxzero.train.nvme_step.NVMeState`) reads its EMA from its
    file a group at a time."""
    if isinstance(state, NVMeState):
        return state.ema_params(dtype)
    if not isinstance(state, TrainState) or state.ema is None:
        raise ValueError(
            "ema_params needs a TrainState with an EMA; build the step with "
            "make_train_step(..., ema=jaxzero.ShardedEMA(decay)) and its state with "
            "step.init(params)."
        )
    check_not_donated(state)
    state.check_flushed("jaxzero.ema_params")
    dtype = jax.numpy.dtype(dtype or jax.tree.leaves(state.params)[0].dtype)
    tree = state.ema.ema
    # With a model state the EMA averages {"params", "model_state"}: keep "params".
    key = None if state.model_state is None else "params"
    return replicator(mesh_of(tree), dtype, key)(tree)


def ema_model_state(state: TrainState):
    """The EMA of the model state (e.g. BatchNorm statistics), replicated; the model's own
    state when the EMA does not cover one."""
    check_not_donated(state)
    state.check_flushed("jaxzero.ema_model_state")
    if state.ema is None or state.model_state is None:
        return state.model_state
    tree = state.ema.ema
    return replicator(mesh_of(tree), None, "model_state")(tree)
