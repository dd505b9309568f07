"""DeepSpeed 0.19.8's gradient clipping: the max norm a run clips to, and checks that a
DeepSpeed config and a jaxzero chain clip alike (see :mod:`jaxzero.interop.deepspeed.update`)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping

from jaxzero.interop.deepspeed.errors import DeepSpeedSettingError

__all__ = [
    "chain_clipping",
    "check_config_clipping",
    "config_number",
    "effective_clipping",
]

# deepspeed/runtime/constants.py (0.19.8)
GRADIENT_CLIPPING_DEFAULT = 1.0


def config_number(cfg: Mapping, key: str, default: float) -> tuple[float, bool]:
    """``(cfg[key] as a float, False)``, or ``(default, True)`` when ``cfg`` has no ``key``; a
    :class:`DeepSpeedSettingError` when the value is not a number."""
    if key not in cfg:
        return float(default), True
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise DeepSpeedSettingError(f"ds_config[{key!r}] = {v!r} is not a number")
    return float(v), False


def effective_clipping(ds_config: Mapping | None, clip_grad: float | None = None) -> float:
    """The max norm DeepSpeed clips to: ``clip_grad`` (from ZeRO 1/2 optimizer files) when
    given, else ``ds_config["gradient_clipping"]``, else DeepSpeed's default 1.0; 0.0 for
    none (DeepSpeed clips only when the value is > 0)."""
    if clip_grad is not None:
        return max(float(clip_grad), 0.0)
    return max(
        config_number(ds_config or {}, "gradient_clipping", GRADIENT_CLIPPING_DEFAULT)[0], 0.0
    )


def _clip_words(clip: float) -> str:
    return f"global norm {clip:g}" if clip else "no norm (no clipping)"


def check_config_clipping(ds_config: Mapping, clip: float, what: str) -> None:
    """Raise :class:`DeepSpeedSettingError` unless a DeepSpeed job with ``ds_config`` clips
    at ``clip`` (0.0: none) as ``what`` does."""
    theirs = effective_clipping(ds_config)
    if theirs != clip:
        said = (
            f"sets gradient_clipping = {ds_config['gradient_clipping']!r}"
            if "gradient_clipping" in ds_config
            else "leaves gradient_clipping out, so DeepSpeed clips at its default 1.0"
        )
        raise DeepSpeedSettingError(
            f"the ds_config {said}, but {what} clips at {_clip_words(clip)}; set "
            f"ds_config['gradient_clipping'] = {clip} (0.0: none) so that DeepSpeed continues "
            "with the same update"
        )


def chain_clipping(settings, ds_config: Mapping | None) -> float:
    """The clipping of a jaxzero chain: from :func:`adamw`'s settings when it built the chain
    (checked against ``ds_config`` when given), else ``ds_config["gradient_clipping"]``,
    which must then be given."""
    if settings is not None:
        if ds_config is not None:
            check_config_clipping(ds_config, settings.gradient_clipping, "zero.tx")
        return settings.gradient_clipping
    if ds_config is None or "gradient_clipping" not in ds_config:
        raise DeepSpeedSettingError(
            "cannot tell whether the optimizer clips gradients (zero.tx was not built by "
            "jaxzero.interop.deepspeed.adamw): pass ds_config={'gradient_clipping': <max norm, "
            "0.0 for none>, ...}, the config the DeepSpeed job will use"
        )
    return effective_clipping(ds_config)
