"""DeepSpeed 0.19.8's own lr schedulers (``ds_config["scheduler"]``) as optax schedules.

DeepSpeed builds the scheduler with ``last_batch_iteration = -1``, which sets each param
group's lr (OneCycle: also its betas) for the first step, and steps it after every applied
optimizer step (not after fp16 overflow steps), so optimizer step ``t`` (1-based) runs with
the scheduler at ``last_batch_iteration = t - 2``. Each function here is of
``u = last_batch_iteration + 1``; :func:`read` shifts it onto the optax step count ``c`` (the
applied steps so far) with the checkpoint's ``last_batch_iteration``: ``u = c + (L + 1 - S)``
for a checkpoint at optimizer step ``S`` (``L = S - 1`` in an uninterrupted run).

* ``WarmupLR``, ``WarmupDecayLR``: from ``warmup_min_lr`` up to ``warmup_max_lr`` over
  ``warmup_num_steps`` (at least 2) in ``log`` (``log(u) / log(W)``: lr ``warmup_min_lr`` on
  the first two steps) or ``linear`` (``optax.linear_schedule``) steps; WarmupDecayLR then
  decays linearly to ``warmup_min_lr`` at ``total_num_steps``. WarmupLR's ``warmup_max_lr``
  defaults to the optimizer's lr, WarmupDecayLR's to 0.001 (DeepSpeed's defaults).
* ``WarmupCosineLR``: the optimizer's lr times a ratio: 0 on the first step, then from
  ``warmup_min_ratio`` to 1 as above, then ``optax.cosine_decay_schedule`` down to
  ``cos_min_ratio``.
* ``OneCycle``: a triangle from ``cycle_min_lr`` to ``cycle_max_lr`` and back over
  ``cycle_first_step_size + cycle_second_step_size`` steps (stairs when the stair counts are
  set), then ``cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)``; with
  ``cycle_momentum`` (default) Adam's beta1 runs the inverse triangle between
  ``cycle_min_mom`` and ``cycle_max_mom`` (``optax.inject_hyperparams``) and beta2 is 0.99.
* ``LRRangeTest``: ``lr_range_test_min_lr * (1 + step_rate * u / step_size)`` (floored with
  ``lr_range_test_staircase``).

Other scheduler names (torch's ``torch.optim.lr_scheduler`` classes, which DeepSpeed also
accepts) are refused by :mod:`jaxzero.interop.deepspeed.update`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import optax

from jaxzero.interop.deepspeed.errors import DeepSpeedSettingError

__all__ = ["SCHEDULERS", "GroupSchedule", "Schedule", "read"]

_PARAMS = {
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupDecayLR": {
        "total_num_steps": None,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.001,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    },
    "OneCycle": {
        "cycle_min_lr": None,
        "cycle_max_lr": None,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 1e-3,
        "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False,
    },
}
SCHEDULERS = tuple(_PARAMS)
_REQUIRED = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",)}
_REQUIRED["OneCycle"] = ("cycle_min_lr", "cycle_max_lr")
_PER_GROUP = {"warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr"}
_PER_GROUP |= {"cycle_min_mom", "cycle_max_mom", "lr_range_test_min_lr"}


@dataclasses.dataclass(frozen=True)
class GroupSchedule:
    """One param group's schedules of the optax step count: ``lr``, and OneCycle's cycled
    ``b1`` with its fixed ``b2`` (None: the group's own betas). Groups with equal ``key``
    have equal schedules."""

    lr: Callable
    b1: Callable | None = None
    b2: float | None = None
    key: tuple = ()


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What :func:`read` found: the scheduler's name, its parameters (DeepSpeed's defaults
    filled in), one :class:`GroupSchedule` per param group, the shift ``u = count + offset``
    and the checkpoint's ``last_batch_iteration`` (-1: the run's start)."""

    name: str
    params: dict
    groups: tuple[GroupSchedule, ...]
    offset: int
    last_batch_iteration: int = -1

    def effect(self) -> str:
        beta = (
            "; Adam's beta1 cycles inversely (optax.inject_hyperparams), beta2 0.99"
            if self.groups[0].b1 is not None
            else ""
        )
        return (
            f"the lr of every param group follows DeepSpeed's {self.name} ({self.params}) as "
            f"an optax schedule of the step count, continuing from scheduler iteration "
            f"{self.last_batch_iteration}{beta}"
        )


def _bad(name: str, msg: str) -> DeepSpeedSettingError:
    return DeepSpeedSettingError(f"scheduler {name}: {msg}")


def _params(name: str, given: Mapping, n: int, base_lrs: list) -> dict:
    """The scheduler's parameters with DeepSpeed's defaults, per-group values as lists."""
    table = _PARAMS[name]
    unknown = sorted(set(given) - set(table))
    if unknown:
        raise _bad(name, f"DeepSpeed's {name} takes no {unknown} (it takes {sorted(table)})")
    p = {**table, **given}
    missing = [k for k in _REQUIRED.get(name, ()) if p[k] is None]
    if missing:
        raise _bad(name, f"{missing} must be set (DeepSpeed's {name} requires them)")
    if name == "WarmupLR" and p["warmup_max_lr"] is None:
        if None in base_lrs:
            raise _bad(name, "warmup_max_lr is absent and the optimizer block sets no lr; set it")
        p["warmup_max_lr"] = list(base_lrs)
    for k in _PER_GROUP & set(p):
        v = p[k]
        vs = list(v) if isinstance(v, list | tuple) else [v] * n
        if len(vs) != n or not all(_real(x) for x in vs):
            raise _bad(name, f"{k} = {v!r} must be a number or one per param group ({n})")
        p[k] = [float(x) for x in vs]
    for k, v in p.items():
        if k not in _PER_GROUP and k != "warmup_type" and v is not None and not _real(v):
            raise _bad(name, f"{k} = {v!r} is not a number")
    for k in ("warmup_num_steps", "lr_range_test_step_size"):
        if k in p and not (isinstance(p[k], int) and not isinstance(p[k], bool) and p[k] > 0):
            raise _bad(name, f"{k} = {p[k]!r} must be a positive int (DeepSpeed refuses it too)")
    return p


def _real(v) -> bool:
    return isinstance(v, numbers.Real)


def _warmup(lo: float, hi: float, steps: int, kind: str) -> Callable:
    """lo -> hi over ``steps`` iterations ``L`` (``u - 1``), then hi."""
    if kind == "linear":
        return optax.linear_schedule(lo, hi, steps)
    # DeepSpeed's log warm-up (its fallback for an unknown warmup_type too): optax has none
    inv = 1.0 / math.log(steps)
    return lambda n: jnp.where(n < steps, lo + (hi - lo) * inv * jnp.log(n + 1.0), hi)


def _warmup_lr(name: str, p: dict, i: int, base_lrs: list) -> Callable:
    lo, hi = p["warmup_min_lr"][i], p["warmup_max_lr"][i]
    w = max(2, p["warmup_num_steps"])
    warm = _warmup(lo, hi, w, p["warmup_type"])
    if name == "WarmupLR":
        return optax.join_schedules([optax.constant_schedule(lo), warm], [1])
    total = p["total_num_steps"]
    decay = optax.linear_schedule(hi, lo, total - w) if total > w else optax.constant_schedule(lo)
    return optax.join_schedules([optax.constant_schedule(lo), warm, decay], [1, w + 1])


def _warmup_cosine(name: str, p: dict, i: int, base_lrs: list) -> Callable:
    base_lr = base_lrs[i]
    if base_lr is None:
        raise _bad(name, "it scales the optimizer's lr, which the optimizer block does not set")
    w = max(2, p["warmup_num_steps"])
    warm = _warmup(base_lr * p["warmup_min_ratio"], base_lr, w, p["warmup_type"])
    total, floor = p["total_num_steps"], p["cos_min_ratio"]
    cosine = optax.cosine_decay_schedule(base_lr, max(1, total - w), alpha=floor)
    after = lambda n: jnp.maximum(0.0, cosine(n + 1))
    return optax.join_schedules([optax.constant_schedule(0.0), warm, after], [1, w + 1])


def _range_test(name: str, p: dict, i: int, base_lrs: list) -> Callable:
    lo, size = p["lr_range_test_min_lr"][i], p["lr_range_test_step_size"]
    rate = float(p["lr_range_test_step_rate"])
    if p["lr_range_test_staircase"]:
        return lambda u: lo * (1.0 + rate * jnp.floor_divide(u, size))
    return lambda u: lo * (1.0 + rate * (u / size))


def _one_cycle_scale(p: dict) -> tuple[Callable, float]:
    """DeepSpeed's ``OneCycle._get_scale_factor`` as a function of ``u``."""
    first = float(p["cycle_first_step_size"])
    second = first if p["cycle_second_step_size"] is None else float(p["cycle_second_step_size"])
    if first <= 0 or second < 0:
        raise _bad("OneCycle", "cycle_first_step_size must be > 0, cycle_second_step_size >= 0")
    total, ratio = first + second, first / (first + second)
    stairs1 = int(p["cycle_first_stair_count"])
    stairs2 = (
        stairs1 if p["cycle_second_stair_count"] is None else int(p["cycle_second_stair_count"])
    )

    def scale(u):
        u = jnp.asarray(u, jnp.float32)
        x = 1.0 + u / total - jnp.floor(1.0 + u / total)
        up = x <= ratio
        s = jnp.where(up, x / ratio, (x - 1.0) / (ratio - 1.0) if ratio != 1 else 0.0)
        count = jnp.where(up, stairs1, stairs2)
        at = jnp.mod(u, total)
        pos = jnp.where(at <= first, at * count / first, (total - at) * count / (second or 1.0))
        stepped = jnp.floor(pos) / jnp.maximum(count, 1)
        return jnp.where(count > 0, stepped, s)

    return scale, total


def _one_cycle(p: dict, i: int) -> tuple[Callable, Callable | None]:
    scale, total = _one_cycle_scale(p)
    lo, hi = p["cycle_min_lr"][i], p["cycle_max_lr"][i]
    size = float(p["decay_step_size"])
    lr_decay = not (math.isclose(size, 0) or math.isclose(p["decay_lr_rate"], 0))
    mom_decay = not (math.isclose(size, 0) or math.isclose(p["decay_mom_rate"], 0))
    after = lambda u: u - total  # DeepSpeed's decay_batch_iteration (cycle done: u > total)

    def lr(u):
        decayed = lo / (1.0 + p["decay_lr_rate"] * after(u) / size) if lr_decay else lo
        return jnp.where(u - 1 < total, lo + (hi - lo) * scale(u), decayed)

    if not p["cycle_momentum"]:
        return lr, None
    m_lo, m_hi = p["cycle_min_mom"][i], p["cycle_max_mom"][i]

    def b1(u):
        decayed = m_hi * (1.0 + p["decay_mom_rate"] * after(u) / size) if mom_decay else m_hi
        cycled = jnp.where(u == 0, m_lo, m_hi - (m_hi - m_lo) * scale(u))
        return jnp.where(u - 1 < total, cycled, decayed)

    return lr, b1


_BUILD = {
    "WarmupLR": _warmup_lr,
    "WarmupDecayLR": _warmup_lr,
    "WarmupCosineLR": _warmup_cosine,
    "LRRangeTest": _range_test,
}


def _shifted(fn: Callable, offset: int) -> Callable:
    return lambda count: fn(jnp.asarray(count) + offset)


def read(
    sched: Mapping, groups: list[dict], base_lrs: list, last_batch_iteration, step: int, saved: bool
) -> Schedule:
    """The :class:`Schedule` of a ``ds_config["scheduler"]`` block (its ``type`` one of
    :data:`SCHEDULERS`) for torch-style ``groups``, each group's lr before any scheduler
    (``base_lrs``, None where unknown), and the checkpoint's scheduler
    ``last_batch_iteration`` (None: ``step - 1``) at optimizer ``step``. With ``saved``, the
    groups hold a checkpoint's lr and betas, which must be the schedule's at its iteration.

    Raises:
      DeepSpeedSettingError: parameters DeepSpeed would not take, or saved values the
        schedule does not give (naming the group).
    """
    name = sched["type"]
    p = _params(name, dict(sched.get("params") or {}), len(groups), base_lrs)
    last = step - 1 if last_batch_iteration is None else int(last_batch_iteration)
    offset = last + 1 - step
    out = []
    for i in range(len(groups)):
        if name == "OneCycle":
            lr, b1 = _one_cycle(p, i)
        else:
            lr, b1 = _BUILD[name](name, p, i, base_lrs), None
        key = (name, tuple((k, v[i] if k in _PER_GROUP else v) for k, v in sorted(p.items())))
        out.append(
            GroupSchedule(
                lr=_shifted(lr, offset),
                b1=None if b1 is None else _shifted(b1, offset),
                b2=None if b1 is None else 0.99,
                key=key,
            )
        )
    schedule = Schedule(name, dict(p), tuple(out), offset, last)
    if saved:
        _check_saved(schedule, groups, step, last)
    return schedule


def _check_saved(schedule: Schedule, groups: list[dict], step: int, last: int) -> None:
    """The groups' saved lr and betas against the schedule at the next step."""
    for i, (g, s) in enumerate(zip(groups, schedule.groups, strict=True)):
        want = [("lr", g["lr"], float(s.lr(step)))]
        if s.b1 is not None:
            want += [("beta1", g["betas"][0], float(s.b1(step))), ("beta2", g["betas"][1], s.b2)]
        for what, saved, ours in want:
            if not math.isclose(saved, ours, rel_tol=1e-5, abs_tol=1e-12):
                raise _bad(
                    schedule.name,
                    f"param group {i} saved {what} = {saved!r}, but DeepSpeed's "
                    f"{schedule.name} with the ds_config's parameters gives {ours!r} at "
                    f"iteration {last}: the run's scheduler or param groups differ from its "
                    "ds_config (a per-group lr, a scheduler changed by hand?); continue it "
                    "with the ds_config it ran with",
                )
