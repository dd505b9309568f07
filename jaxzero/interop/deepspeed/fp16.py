"""DeepSpeed 0.19.8's fp16 loss scaling as jaxzero's loss scales.

An fp16 run with ``loss_scale: 0`` (DeepSpeed's default) scales dynamically with DeepSpeed's
``DynamicLossScaler``: an overflow skips the step (the optimizer, its step count and the lr
scheduler stay put) and spends one unit of hysteresis, or halves the scale once the
hysteresis is down to 1 (never below ``min_loss_scale``); a clean step doubles the scale when
the clean steps since the last overflow before it are a positive multiple of
``loss_scale_window`` (refilling the hysteresis), and with ``consecutive_hysteresis`` every
clean step refills it. :func:`loss_scale` gives the :class:`jaxzero.DynamicLossScale` that
does the same (``growth="since_overflow"``), with the scaler's own settings from the
optimizer files when a checkpoint is given (a DeepSpeed run loaded from them continues with
those, not with its config's), and :func:`loss_scale_state` the scaler's state at the
checkpoint. A static ``loss_scale`` is :class:`jaxzero.StaticLossScale`.

One difference remains, on an error path: at ``min_loss_scale`` DeepSpeed raises when an
overflow would lower the scale further, jaxzero's ``on_min="raise"`` at the first overflow
there.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import jax.numpy as jnp

from jaxzero.interop.deepspeed.errors import DeepSpeedSettingError
from jaxzero.precision import DynamicLossScale, LossScaleState, StaticLossScale

__all__ = ["fp16_block", "loss_scale", "loss_scale_state", "scale_from_config"]

# deepspeed/runtime/precision_config.py (0.19.8): DeepSpeedFP16Config's defaults
FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}


def fp16_block(ds_config: Mapping | None) -> dict | None:
    """The ``fp16`` block with DeepSpeed's defaults when it is enabled, else None."""
    fp16 = (ds_config or {}).get("fp16")
    if not isinstance(fp16, Mapping) or not fp16.get("enabled"):
        return None
    block = {**FP16_DEFAULTS, **fp16}
    for key in FP16_DEFAULTS:
        v = block[key]
        if not isinstance(v, numbers.Real) or (
            isinstance(v, bool) and key != "consecutive_hysteresis"
        ):
            raise DeepSpeedSettingError(f"ds_config['fp16'][{key!r}] = {v!r} is not a number")
    return block


def scale_from_config(block: Mapping, scaler: Mapping | None = None):
    """The jaxzero loss scale of an enabled ``fp16`` block (see :func:`fp16_block`), with the
    dynamic scaler's own settings (``scaler``, a checkpoint's) winning over the block's."""
    if float(block["loss_scale"]) > 0:
        return StaticLossScale(float(block["loss_scale"]))
    s = scaler or {}
    min_scale = float(s.get("min_scale", block["min_loss_scale"]))
    return DynamicLossScale(
        init_scale=max(float(2 ** block["initial_scale_power"]), min_scale),
        window=int(s.get("scale_window", block["loss_scale_window"])),
        factor=float(s.get("scale_factor", 2.0)),
        hysteresis=int(s.get("delayed_shift", block["hysteresis"])),
        min_scale=min_scale,
        on_min="raise" if s.get("raise_error_at_min_scale", True) else "ignore",
        growth="since_overflow",
        consecutive_hysteresis=bool(
            s.get("consecutive_hysteresis", block["consecutive_hysteresis"])
        ),
    )


def loss_scale(ckpt_or_config):
    """The jaxzero loss scale reproducing a DeepSpeed fp16 run's: a
    :class:`jaxzero.DynamicLossScale` (dynamic scaling), a :class:`jaxzero.StaticLossScale`
    (``fp16.loss_scale`` > 0), or None (no fp16). Build the ZeRO with it and
    ``precision="fp16"``; :func:`jaxzero.interop.deepspeed.to_train_state` then starts from
    the checkpoint's scaler state.

    Args:
      ckpt_or_config: a :class:`DeepSpeedCheckpoint` (its scaler's settings from the
        optimizer files win over its ``ds_config``) or a ``ds_config`` dict.
    """
    if isinstance(ckpt_or_config, Mapping):
        block = fp16_block(ckpt_or_config)
        return None if block is None else scale_from_config(block)
    block = fp16_block(ckpt_or_config.ds_config)
    if block is None and ckpt_or_config.dtype == "fp16":
        block = dict(FP16_DEFAULTS)
    return None if block is None else scale_from_config(block, ckpt_or_config.loss_scaler)


def loss_scale_state(scaler: Mapping) -> LossScaleState:
    """jaxzero's state of a DeepSpeed ``DynamicLossScaler`` (a checkpoint's ``loss_scaler``):
    the scale, the clean steps since the last overflow (``cur_iter - last_overflow_iter - 1``)
    and the hysteresis left."""
    good = int(scaler["cur_iter"]) - int(scaler["last_overflow_iter"]) - 1
    if good < 0:
        raise DeepSpeedSettingError(
            f"the loss scaler's cur_iter {scaler['cur_iter']} is before its last_overflow_iter "
            f"{scaler['last_overflow_iter']}: the checkpoint is damaged"
        )
    return LossScaleState(
        jnp.asarray(float(scaler["cur_scale"]), jnp.float32),
        jnp.asarray(good, jnp.int32),
        jnp.asarray(int(scaler["cur_hysteresis"]), jnp.int32),
    )


def effect(ls) -> str:
    """What the update does about the loss scale ``ls`` (one line of the report)."""
    if isinstance(ls, StaticLossScale):
        return (
            f"static loss scale {ls.scale:g}: ZeRO(precision='fp16', loss_scale=jz.StaticLossScale)"
        )
    return (
        f"dynamic loss scaling (window {ls.window}, hysteresis {ls.hysteresis}, min scale "
        f"{ls.min_scale:g}, consecutive_hysteresis {ls.consecutive_hysteresis}): build the ZeRO "
        "with precision='fp16', loss_scale=jaxzero.interop.deepspeed.loss_scale(ckpt); "
        "to_train_state carries the scaler's state and the skipped steps"
    )
