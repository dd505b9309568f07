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
from collections.abc import Mapping

import optax

import jaxzero.interop.deepspeed.fp16 as LS
import jaxzero.interop.deepspeed.schedules as S
from jaxzero.interop.deepspeed.clipping import (
    GRADIENT_CLIPPING_DEFAULT,
    chain_clipping,
    check_config_clipping,
    config_number,
    effective_clipping,
)
from jaxzero.interop.deepspeed.errors import DeepSpeedSettingError
from jaxzero.precision import DynamicLossScale

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
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = 1.0

REFUSABLE = (
    "fp16",
    "scheduler",
    "lr_scheduler",
    "gradient_allreduce_op",
    "gradient_predivide_factor",
    "zero_optimization.zenflow",
)


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
    clips to (0.0: none); ``not_reproduced`` the refused keys the caller allowed;
    ``schedule`` the lr scheduler (:class:`schedules.Schedule`, None: constant lr);
    ``l2_weight_decay`` whether the weight decay is added to the gradient (Adam with
    ``adam_w_mode: false``); ``loss_scale`` the fp16 run's jaxzero loss scale (None: none)."""

    settings: tuple[Setting, ...]
    gradient_clipping: float
    not_reproduced: tuple[str, ...] = ()
    schedule: S.Schedule | None = None
    l2_weight_decay: bool = False
    loss_scale: object = None

    def not_written(self) -> list[str]:
        """The settings a DeepSpeed checkpoint written from the chain's state would lose (the
        writer writes neither a scheduler's state nor a loss scaler, and only AdamW)."""
        return [
            key
            for key, on in (
                ("scheduler", self.schedule is not None),
                ("optimizer.params.adam_w_mode", self.l2_weight_decay),
                ("fp16", isinstance(self.loss_scale, DynamicLossScale)),
            )
            if on
        ]

    def lines(self) -> list[str]:
        return [s.line() for s in self.settings]

    def text(self) -> str:
        return "\n".join(self.lines())

    def report(self, groups) -> str:
        """The text :func:`jaxzero.interop.deepspeed.adamw` prints: the param groups, then
        one line per setting."""
        kind = "Adam, L2: decay added to the gradient" if self.l2_weight_decay else "AdamW"
        lines = [
            f"param group {i}: {len(g['names'])} params, lr={g['lr']}, betas={tuple(g['betas'])}, "
            f"eps={g['eps']}, weight_decay={g['weight_decay']} ({kind})"
            for i, g in enumerate(groups)
        ]
        return "\n".join(["DeepSpeed update reproduced by the optax chain:", *lines, *self.lines()])

    def transforms(self) -> list[optax.GradientTransformation]:
        """The transformations that go before AdamW in the chain."""
        clip = self.gradient_clipping
        return [optax.clip_by_global_norm(clip)] if clip else []


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
    value, default = config_number(r.cfg, "gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
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
    f, default = config_number(
        r.cfg, "gradient_predivide_factor", GRADIENT_PREDIVIDE_FACTOR_DEFAULT
    )
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


def _precision(r: _Reader, dtype: str, loss_scaler) -> object:
    """The fp16 loss scale (None without fp16)."""
    block = LS.fp16_block(r.cfg)
    ls = None
    if block is not None and block.get("fp16_master_weights_and_grads"):
        why = (
            "the master weights and gradients are fp16 (DeepSpeedCPUAdam only); jaxzero's are fp32"
        )
        r.refuse("fp16", "fp16_master_weights_and_grads", False, why)
    elif block is not None:
        ls = LS.scale_from_config(block, loss_scaler)
        r.add("fp16", dict(r.cfg["fp16"]), False, LS.effect(ls))
    else:
        r.add("fp16.enabled", False, "fp16" not in r.cfg, "no loss scaling")
    effect = (
        "bf16 compute: build the ZeRO with precision='bf16' (same update; 16-bit rounding "
        "is not bit-identical to DeepSpeed's)"
        if dtype == "bf16"
        else "fp16 compute: build the ZeRO with precision='fp16' (16-bit rounding is not "
        "bit-identical to DeepSpeed's)"
        if dtype == "fp16"
        else "fp32 compute and master weights"
    )
    r.add("bf16.enabled", dtype == "bf16", "bf16" not in r.cfg, effect)
    return ls


def _base_lrs(cfg: Mapping, groups, saved: bool) -> list:
    """Each group's lr before any scheduler: the optimizer block's lr, else (no checkpoint)
    the group's own; None where unknown."""
    opt = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), Mapping) else {}
    lr = (opt.get("params") or {}).get("lr")
    if lr is not None:
        return [float(lr)] * len(groups)
    return [None if saved else float(g["lr"]) for g in groups]


def _schedule(r: _Reader, lr_scheduler, groups, step: int, saved: bool):
    """The lr scheduler (None: constant lr)."""
    sched = r.cfg.get("scheduler")
    found = None
    if isinstance(sched, Mapping) and sched.get("type"):
        name = sched["type"]
        if name not in S.SCHEDULERS:
            why = (
                f"not one of DeepSpeed's own schedulers {list(S.SCHEDULERS)} (a "
                "torch.optim.lr_scheduler class?); build its optax schedule yourself"
            )
            r.refuse("scheduler", name, False, why)
        elif groups is None:
            why = "the schedule needs the param groups: pass them (or a checkpoint) to adamw"
            r.refuse("scheduler", name, False, why)
        else:
            last = (
                lr_scheduler.get("last_batch_iteration")
                if isinstance(lr_scheduler, Mapping)
                else None
            )
            found = S.read(sched, groups, _base_lrs(r.cfg, groups, saved), last, step, saved)
            r.add("scheduler", name, False, found.effect())
    elif lr_scheduler is not None:
        why = "a client lr scheduler's state is saved; the chain would keep the saved lr"
        r.refuse("lr_scheduler", "client scheduler", False, why)
    else:
        r.add("scheduler", None, True, "constant lr: each param group's saved lr")
    zopt = r.cfg.get("zero_optimization")
    if isinstance(zopt, Mapping) and zopt.get("zenflow"):
        why = "ZenFlow updates only selected gradient columns on some steps"
        r.refuse("zero_optimization.zenflow", "enabled", False, why)
    return found


def _optimizer(r: _Reader, l2: bool | None) -> bool:
    """Whether the weight decay is L2 (added to the gradient before the moments)."""
    opt = r.cfg.get("optimizer") if isinstance(r.cfg.get("optimizer"), Mapping) else {}
    mode = (opt.get("params") or {}).get("adam_w_mode")
    if l2 is None:
        l2 = str(opt.get("type", "")).lower() == "adam" and mode is False
    effect = (
        "L2: optax.add_decayed_weights before optax.scale_by_adam (torch Adam / FusedAdam "
        "with adam_w_mode false)"
        if l2
        else "decoupled weight decay (AdamW): optax.add_decayed_weights after scale_by_adam"
    )
    r.add("optimizer.params.adam_w_mode", mode, mode is None, effect)
    return l2


def read_settings(
    ds_config: Mapping | None,
    *,
    clip_grad: float | None = None,
    stage: int | None = None,
    world_size: int | None = None,
    dtype: str = "fp32",
    lr_scheduler=None,
    param_groups=None,
    step: int = 0,
    saved: bool = False,
    l2_weight_decay: bool | None = None,
    loss_scaler=None,
    allow=(),
) -> UpdateSettings:
    """The update settings of ``ds_config`` (DeepSpeed 0.19.8's defaults for absent keys).

    Args:
      ds_config: the run's config (a checkpoint's ``ds_config``).
      clip_grad: the clipping the ZeRO 1/2 optimizer files recorded (it wins over the config).
      stage, world_size: the DeepSpeed ZeRO stage and data-parallel size (None: unknown).
      dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
      lr_scheduler: the saved scheduler state (model states' ``lr_scheduler``), if any.
      param_groups: torch-style groups (``names``, ``lr``, ``betas``, ...), which a
        ``scheduler`` needs; ``saved``: they hold a checkpoint's (scheduled) lr and betas,
        checked against the schedule; ``step``: the checkpoint's optimizer step.
      l2_weight_decay: whether the optimizer's decay is L2 (None: as ``ds_config`` says).
      loss_scaler: a checkpoint's dynamic loss scaler state (its settings win).
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
    ls = _precision(r, dtype, loss_scaler)
    l2 = _optimizer(r, l2_weight_decay)
    schedule = _schedule(r, lr_scheduler, param_groups, step, saved)
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
    return UpdateSettings(tuple(r.settings), clip, tuple(r.allowed), schedule, l2, ls)


def update_settings(ckpt, allow=()) -> UpdateSettings:
    """The update settings of a :class:`DeepSpeedCheckpoint` (see :func:`read_settings`)."""
    return read_settings(
        ckpt.ds_config,
        clip_grad=ckpt.gradient_clipping,
        stage=ckpt.zero_stage,
        world_size=ckpt.world_size,
        dtype=ckpt.dtype,
        lr_scheduler=ckpt.lr_scheduler,
        param_groups=ckpt.param_groups,
        step=ckpt.step,
        saved=True,
        l2_weight_decay=ckpt.l2_weight_decay,
        loss_scaler=ckpt.loss_scaler,
        allow=allow,
    )


def config_settings(ds_config, allow=(), param_groups=None) -> UpdateSettings:
    """The update settings of a bare ``ds_config`` (None: a torch AdamW without clipping),
    for a run that starts from its first step with ``param_groups``."""
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
    dtype = "fp16" if (ds_config.get("fp16") or {}).get("enabled") else dtype
    return read_settings(
        ds_config, stage=stage, dtype=dtype, param_groups=param_groups, allow=allow
    )
