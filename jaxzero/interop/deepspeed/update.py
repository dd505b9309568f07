"""What a DeepSpeed 0.19.8 ZeRO run does to a gradient before and around AdamW, read from its
``ds_config`` with DeepSpeed's own defaults for absent keys.

:func:`read_settings` turns a config (plus what the optimizer files record) into
:class:`UpdateSettings`: one :class:`Setting` per key that can change the update, each either
reproduced by the optax chain :func:`jaxzero.interop.deepspeed.adamw` builds, shown to have no
effect on it, or refused with :class:`DeepSpeedSettingError` naming the key (unless the caller
lists it in ``allow``).

Where DeepSpeed 0.19.8 applies them (``runtime/zero/stage_1_and_2.py``, ``stage3.py``,
``bf16_optimizer.py``): the gradient is averaged over the ranks (and summed over accumulated
micro-batches of a loss divided by ``gradient_accumulation_steps``), then its fp32 global norm
over every parameter is taken, the gradient is divided by the loss scale and by
``clip = max(1, (norm + 1e-6) / gradient_clipping)``, and the optimizer steps. ZeRO 1/2 (and
``BF16_Optimizer``) save the clipping in their optimizer files (``clip_grad``) and a run
loaded from them uses that value, not its config's.

The chain clips with ``optax.clip_by_global_norm``, whose coefficient ``max_norm / norm`` lacks
DeepSpeed's ``1e-6``: the two scale the gradient differently by a relative ``1e-6 / norm``
(``norm >= max_norm`` whenever either clips), and AdamW, nearly invariant to the gradient's
scale, turns that into parameter differences at float rounding (measured: 1.5e-8 to 3e-8
after 2 steps for max norms 1.0 down to 0.001, gradient norms about 2.4).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping

import optax

__all__ = [
    "DeepSpeedSettingError",
    "Setting",
    "UpdateSettings",
    "update_settings",
    "config_settings",
    "chain_clipping",
    "check_config_clipping",
    "effective_clipping",
    "read_settings",
]

# deepspeed/runtime/constants.py (0.19.8)
GRADIENT_CLIPPING_DEFAULT = 1.0
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = 1.0

REFUSABLE = (
    "fp16",
    "scheduler",
    "lr_scheduler",
    "gradient_allreduce_op",
    "gradient_predivide_factor",
    "zero_optimization.zenflow",
)


class DeepSpeedSettingError(ValueError):
    """A ``ds_config`` setting that changes the update and that jaxzero does not reproduce."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``ds_config`` key: its value, whether it was absent (DeepSpeed's default), and what
    the optax chain does about it."""

    key: str
    value: object
    default: bool
    effect: str

    def line(self) -> str:
        if self.value is None:
            return f"{self.key}: {self.effect}"
        where = "DeepSpeed default, key absent" if self.default else "set"
        return f"{self.key} = {self.value!r} ({where}): {self.effect}"


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """What :func:`read_settings` found. ``gradient_clipping`` is the max global norm the chain
    clips to (0.0: none); ``not_reproduced`` the refused keys the caller allowed."""

    settings: tuple[Setting, ...]
    gradient_clipping: float
    not_reproduced: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        return [s.line() for s in self.settings]

    def text(self) -> str:
        return "\n".join(self.lines())

    def report(self, groups) -> str:
        """The text :func:`jaxzero.interop.deepspeed.adamw` prints: the param groups, then
        one line per setting."""
        lines = [
            f"param group {i}: {len(g['names'])} params, lr={g['lr']}, betas={tuple(g['betas'])}, "
            f"eps={g['eps']}, weight_decay={g['weight_decay']} (AdamW, decoupled decay)"
            for i, g in enumerate(groups)
        ]
        return "\n".join(["DeepSpeed update reproduced by the optax chain:", *lines, *self.lines()])

    def transforms(self) -> list[optax.GradientTransformation]:
        """The transformations that go before AdamW in the chain."""
        clip = self.gradient_clipping
        return [optax.clip_by_global_norm(clip)] if clip else []


def _number(cfg: Mapping, key: str, default: float) -> tuple[float, bool]:
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
    return max(_number(ds_config or {}, "gradient_clipping", GRADIENT_CLIPPING_DEFAULT)[0], 0.0)


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


def chain_clipping(settings: UpdateSettings | None, ds_config: Mapping | None) -> float:
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


class _Reader:
    """Collects the settings of one config; refusals wait for ``allow``."""

    def __init__(self, cfg: Mapping, allow: tuple[str, ...]):
        self.cfg, self.allow = cfg, allow
        self.settings: list[Setting] = []
        self.allowed: list[str] = []
        self.refused: list[str] = []

    def add(self, key, value, default, effect) -> None:
        self.settings.append(Setting(key, value, default, effect))

    def refuse(self, key, value, default, why: str) -> None:
        if key in self.allow:
            self.allowed.append(key)
            self.add(key, value, default, f"NOT reproduced (allowed by the caller): {why}")
        else:
            self.refused.append(f"{key} = {value!r}: {why}")


def _clipping(r: _Reader, clip_grad) -> float:
    value, default = _number(r.cfg, "gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    clip = effective_clipping(r.cfg, clip_grad)
    effect = (
        f"optax.clip_by_global_norm({clip:g}) on the averaged gradient, before AdamW"
        if clip
        else "no clipping"
    )
    if clip_grad is not None and clip != max(value, 0.0):
        effect += (
            f" (the optimizer files' clip_grad = {clip_grad!r}: DeepSpeed restores it from "
            "the files and continues with it, not with the ds_config's value)"
        )
    r.add("gradient_clipping", value, default, effect)
    return clip


def _reduction(r: _Reader, stage, world_size) -> None:
    op = r.cfg.get("gradient_allreduce_op", "mean")
    default = "gradient_allreduce_op" not in r.cfg
    if op == "mean" or stage == 3:
        extra = "" if op == "mean" else " (ZeRO-3 averages whatever this says)"
        r.add("gradient_allreduce_op", op, default, "the gradient is the mean over ranks" + extra)
    else:
        why = "DeepSpeed sums the ranks' gradients instead of averaging them"
        r.refuse("gradient_allreduce_op", op, default, why)
    pre = bool(r.cfg.get("prescale_gradients", False))
    r.add(
        "prescale_gradients",
        pre,
        "prescale_gradients" not in r.cfg,
        "no effect on the update (divides before or after the all-reduce; same mean)",
    )
    f, default = _number(r.cfg, "gradient_predivide_factor", GRADIENT_PREDIVIDE_FACTOR_DEFAULT)
    if stage == 3 and not pre and f != 1.0 and (world_size is None or f == world_size):
        why = (
            "DeepSpeed 0.19.8's ZeRO-3 divides by it and by the world size but multiplies it "
            "back only when it differs from the world size"
            + ("" if world_size else " (the world size is not known here)")
        )
        r.refuse("gradient_predivide_factor", f, default, why)
    else:
        r.add("gradient_predivide_factor", f, default, "no effect on the update (same mean)")


def _batches(r: _Reader) -> None:
    gas = r.cfg.get("gradient_accumulation_steps")
    effect = (
        "the gradient is the mean over every micro-batch of the step: give one jaxzero step "
        "the global batch (train_batch_size examples; accum_steps= splits it)"
    )
    if gas is None:
        effect = "absent, DeepSpeed derives it from the batch sizes; " + effect
    r.add("gradient_accumulation_steps", gas, gas is None, effect)


def _precision(r: _Reader, dtype: str) -> None:
    fp16 = r.cfg.get("fp16") if isinstance(r.cfg.get("fp16"), Mapping) else {}
    if fp16.get("enabled"):
        why = (
            "DeepSpeed's fp16 loss scaling (skipped overflow steps, its loss-scaler state) is not "
            "carried over; continue from a bf16 or fp32 run, or allow it and choose "
            "ZeRO(precision='fp16', loss_scale=...) yourself"
        )
        r.refuse("fp16", dict(fp16), False, why)
    else:
        r.add("fp16.enabled", False, "fp16" not in r.cfg, "no loss scaling")
    effect = (
        "bf16 compute: build the ZeRO with precision='bf16' (same update; 16-bit rounding "
        "is not bit-identical to DeepSpeed's)"
        if dtype == "bf16"
        else "fp32 compute and master weights"
    )
    r.add("bf16.enabled", dtype == "bf16", "bf16" not in r.cfg, effect)


def _schedule(r: _Reader, lr_scheduler) -> None:
    sched = r.cfg.get("scheduler")
    if isinstance(sched, Mapping) and sched.get("type"):
        why = "the lr follows DeepSpeed's schedule; the chain would keep the param groups' saved lr"
        r.refuse("scheduler", sched.get("type"), False, why)
    elif lr_scheduler is not None:
        why = "a client lr scheduler's state is saved; the chain would keep the saved lr"
        r.refuse("lr_scheduler", "client scheduler", False, why)
    else:
        r.add("scheduler", None, True, "constant lr: each param group's saved lr")
    zopt = r.cfg.get("zero_optimization")
    if isinstance(zopt, Mapping) and zopt.get("zenflow"):
        why = "ZenFlow updates only selected gradient columns on some steps"
        r.refuse("zero_optimization.zenflow", "enabled", False, why)


def read_settings(
    ds_config: Mapping | None,
    *,
    clip_grad: float | None = None,
    stage: int | None = None,
    world_size: int | None = None,
    dtype: str = "fp32",
    lr_scheduler=None,
    allow=(),
) -> UpdateSettings:
    """The update settings of ``ds_config`` (DeepSpeed 0.19.8's defaults for absent keys).

    Args:
      ds_config: the run's config (a checkpoint's ``ds_config``).
      clip_grad: the clipping the ZeRO 1/2 optimizer files recorded (it wins over the config).
      stage, world_size: the DeepSpeed ZeRO stage and data-parallel size (None: unknown).
      dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
      lr_scheduler: the saved client scheduler state (model states' ``lr_scheduler``), if any.
      allow: keys of settings that cannot be reproduced to accept anyway (each is reported as
        NOT reproduced); each must be one this config sets: ``"fp16"``, ``"scheduler"``,
        ``"lr_scheduler"``, ``"gradient_allreduce_op"``, ``"gradient_predivide_factor"``,
        ``"zero_optimization.zenflow"``.

    Raises:
      DeepSpeedSettingError: a setting that changes the update is not reproduced (each named);
        an ``allow`` entry that names nothing refused here.
    """
    cfg = dict(ds_config or {})
    allow = (allow,) if isinstance(allow, str) else tuple(allow)
    unknown = [a for a in allow if a not in REFUSABLE]
    if unknown:
        raise ValueError(f"allow={unknown}: only {list(REFUSABLE)} can be allowed")
    if dtype == "fp16" and not isinstance(cfg.get("fp16"), Mapping):
        cfg["fp16"] = {"enabled": True}
    r = _Reader(cfg, allow)
    clip = _clipping(r, clip_grad)
    _reduction(r, stage, world_size)
    _batches(r)
    _precision(r, dtype)
    _schedule(r, lr_scheduler)
    if r.refused:
        raise DeepSpeedSettingError(
            "these DeepSpeed settings change the update and are not reproduced by the optax "
            "chain: " + "; ".join(r.refused) + ". Change them in the DeepSpeed run, or pass "
            f"allow={[s.split(' = ')[0] for s in r.refused]} to continue without them (the run "
            "then drifts from DeepSpeed's)"
        )
    unused = [a for a in allow if a not in r.allowed]
    if unused:
        raise ValueError(f"allow={unused}: the config does not set these, nothing to allow")
    return UpdateSettings(tuple(r.settings), clip, tuple(r.allowed))


def update_settings(ckpt, allow=()) -> UpdateSettings:
    """The update settings of a :class:`DeepSpeedCheckpoint` (see :func:`read_settings`)."""
    return read_settings(
        ckpt.ds_config,
        clip_grad=ckpt.gradient_clipping,
        stage=ckpt.zero_stage,
        world_size=ckpt.world_size,
        dtype=ckpt.dtype,
        lr_scheduler=ckpt.lr_scheduler,
        allow=allow,
    )


def config_settings(ds_config, allow=()) -> UpdateSettings:
    """The update settings of a bare ``ds_config`` (None: a torch AdamW without clipping)."""
    if ds_config is None:
        if allow:
            raise ValueError(f"allow={list(allow)} needs a checkpoint or a ds_config")
        off = Setting("gradient_clipping", None, False, "no clipping (no ds_config given)")
        return UpdateSettings((off,), 0.0)
    if not isinstance(ds_config, Mapping):
        raise TypeError(f"ds_config must be a dict, got {type(ds_config).__name__}")
    zopt = ds_config.get("zero_optimization")
    stage = zopt.get("stage") if isinstance(zopt, Mapping) else None
    dtype = "bf16" if (ds_config.get("bf16") or {}).get("enabled") else "fp32"
    return read_settings(ds_config, stage=stage, dtype=dtype, allow=allow)
