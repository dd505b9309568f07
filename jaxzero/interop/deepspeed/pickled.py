"""Inert stand-ins for the three DeepSpeed classes its checkpoint files pickle.

DeepSpeed 0.19.8 pickles ``LossScaler`` (loss-scale state; ``DynamicLossScaler`` in fp16 runs
with dynamic loss scaling), ``ZeroStageEnum`` (the ZeRO stage) and ``fragment_address`` (a
parameter's ``numel``/``start`` in a partition). The reader maps exactly these names to the
classes below (plain attribute holders, no methods that
run anything); the writer pickles the stand-ins under DeepSpeed's names so that DeepSpeed
loads its own classes. DeepSpeed itself is never imported.
"""

from __future__ import annotations

import enum

from jaxzero.interop.safe_pickle import load_torch_file, save_torch_file


class LossScaler:
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler``: attributes only."""

    def __init__(self, cur_scale: float = 1.0, dynamic: bool = False):
        self.cur_scale = cur_scale
        self.dynamic = dynamic

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise ValueError(f"LossScaler state must be a dict, got {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self):
        return f"LossScaler({self.__dict__})"


class DynamicLossScaler(LossScaler):
    """``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``: attributes only (read so that
    an fp16 checkpoint is refused for what it is, not as an unknown class)."""


class ZeroStageEnum(enum.IntEnum):
    """``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class fragment_address:  # noqa: N801 - DeepSpeed's name
    """``deepspeed.utils.tensor_fragment.fragment_address``: a param's slice of a partition."""

    def __init__(self, numel: int = 0, start: int = 0):
        self.numel = numel
        self.start = start

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise ValueError(f"fragment_address state must be a dict, got {type(state).__name__}")
        self.__dict__.update(state)

    def __repr__(self):
        return f"fragment_address(numel={self.numel}, start={self.start})"


STAND_INS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": fragment_address,
}


_HINT = (
    "DeepSpeed's own checkpoint files need no other class, so this one was written by other "
    "code or altered; if you trust it, load it with DeepSpeed where it was made and save it "
    "again with engine.save_checkpoint"
)


def load(path, what: str):
    """A DeepSpeed ``.pt`` file, safely (see :mod:`jaxzero.interop.safe_pickle`)."""
    return load_torch_file(path, stand_ins=STAND_INS, what=what, hint=_HINT)


def save(obj, path) -> None:
    """``torch.save`` with the stand-ins written under DeepSpeed's class names."""
    save_torch_file(obj, path, stand_ins=STAND_INS)
