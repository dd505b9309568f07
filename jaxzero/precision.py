"""Precision policy (compute / master / reduce dtypes) and loss scaling."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.extend.core import Literal

_COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_MASTER_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_REDUCE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _canon(value, allowed: dict, name: str):
    try:
        key = jnp.dtype(value).name
    except TypeError as e:
        raise TypeError(f"{name}={value!r} is not a dtype; use one of {sorted(allowed)}.") from e
    if key not in allowed:
        raise ValueError(f"{name}={key} is not supported; use one of {sorted(allowed)}.")
    return jnp.dtype(allowed[key])


@dataclasses.dataclass(frozen=True)
class Precision:
    """Which dtype each copy of the weights and gradients has.

    Attributes:
      param_dtype: dtype of the compute parameters the loss sees (float32, bfloat16,
        float16). They are ``cast(master)`` after every update; for stages 1/2 the cast happens
        on the shard before the all-gather, so the gather moves ``itemsize(param_dtype)`` bytes
        per parameter; at stage 3 the step's gathers cast the master shards themselves.
      master_dtype: dtype of the master weights the optimizer updates (float32). When it
        equals ``param_dtype`` no separate master copy is stored.
      reduce_dtype: dtype the gradients are communicated (all-reduced / reduce-scattered) in.
      output_dtype: dtype the gradients are accumulated and handed to optax in
        (default: ``master_dtype``).
      compute_copy: keep the ``param_dtype`` copy of the weights in ``TrainState.params``
        beside the master (DeepSpeed's layout: 16 Phi/N per device at stage 3 in bf16 with
        Adam, gradients included). ``False``, stage 3 only (FSDP's mixed-precision layout):
        ``params`` holds the ``master_dtype`` shards themselves, ``master`` is None, and the
        step casts each shard to ``param_dtype`` as it gathers it; ``itemsize(param_dtype)``
        Phi/N less per device, the same numbers and the same bytes on the wire. Then
        ``jz.gather(state.params)`` returns ``master_dtype`` weights, as FSDP's full state
        dict does (``jz.ema_params(state, dtype=param_dtype)`` evaluates in ``param_dtype``).
    """

    param_dtype: object = jnp.float32
    master_dtype: object = jnp.float32
    reduce_dtype: object = jnp.float32
    output_dtype: object = None
    compute_copy: bool = True

    def __post_init__(self):
        p = _canon(self.param_dtype, _COMPUTE_DTYPES, "param_dtype")
        m = _canon(self.master_dtype, _MASTER_DTYPES, "master_dtype")
        r = _canon(self.reduce_dtype, _REDUCE_DTYPES, "reduce_dtype")
        o = (
            m
            if self.output_dtype is None
            else _canon(self.output_dtype, _MASTER_DTYPES, "output_dtype")
        )
        if jnp.finfo(m).bits < jnp.finfo(p).bits:
            raise ValueError(
                f"master_dtype={m.name} is narrower than param_dtype={p.name}; "
                f"the master copy must be at least as precise as the compute copy."
            )
        if not isinstance(self.compute_copy, bool):
            raise TypeError(f"compute_copy={self.compute_copy!r} must be True or False.")
        object.__setattr__(self, "param_dtype", p)
        object.__setattr__(self, "master_dtype", m)
        object.__setattr__(self, "reduce_dtype", r)
        object.__setattr__(self, "output_dtype", o)

    @classmethod
    def create(cls, name: str, *, compute_copy: bool = True) -> Precision:
        """``"fp32"``, ``"bf16"`` or ``"fp16"``: 16-bit compute and reduction, fp32 master."""
        table = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
        if name not in table:
            raise ValueError(f"precision={name!r} is not one of {sorted(table)}.")
        return cls(param_dtype=table[name], reduce_dtype=table[name], compute_copy=compute_copy)

    @property
    def separate_master(self) -> bool:
        """Whether the state keeps a master copy apart from ``params``."""
        return self.param_dtype != self.master_dtype and self.compute_copy


_STATE_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def with_state_dtype(tx, dtype) -> optax.GradientTransformationExtraArgs:
    """``tx`` with its float32 state stored in ``dtype`` and its math in float32.

    Megatron's precision-aware optimizer (``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``)
    and torchtitan's bf16 optimizer states: Adam's moments kept in bfloat16 halve the state's
    bytes, on the device or, with ``ZeRO(offload="optimizer")``, in host memory and on the
    PCIe link each step. Each update widens the stored leaves to float32, runs ``tx.update``
    and rounds the new state to ``dtype`` (to nearest even); the updates ``tx`` returns are
    its float32 ones, so only the state is rounded, never the step it takes. Only float32
    arrays are stored narrower: scalars (step counters, injected hyperparameters) and leaves
    ``tx`` already keeps in another dtype are untouched. This is opt-in and not exact: compare a run's loss with
    the float32 state before relying on it (``docs/benchmarks.md`` has one).

    Args:
      tx: an optax ``GradientTransformation``.
      dtype: the storage dtype, ``jnp.bfloat16`` or ``jnp.float16``.

    Returns:
      A ``GradientTransformationExtraArgs`` whose state mirrors ``tx``'s with its float32
      leaves in ``dtype``.
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"with_state_dtype(tx=...) takes an optax GradientTransformation, got "
            f"{type(tx).__name__}."
        )
    store = _canon(dtype, _STATE_DTYPES, "with_state_dtype(dtype)")
    tx = optax.with_extra_args_support(tx)
    # float32 arrays only: a leaf the optimizer keeps narrower (adam's mu_dtype) stays its own,
    # and scalars (injected hyperparameters, a schedule's state) keep their float32 values
    narrow = lambda t: jax.tree.map(
        lambda x: x.astype(store) if x.dtype == jnp.float32 and x.ndim > 0 else x, t
    )

    def init(params):
        return narrow(tx.init(params))

    def update(updates, state, params=None, **extra_args):
        wide = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == store else x, state)
        updates, new = tx.update(updates, wide, params, **extra_args)
        return updates, narrow(new)

    return optax.GradientTransformationExtraArgs(init, update)


class LossScaleState(NamedTuple):
    """Dynamic loss-scale state: current scale, clean steps since the last change (since the
    last overflow with ``DynamicLossScale(growth="since_overflow")``), and the overflows still
    tolerated before the scale backs off (hysteresis)."""

    scale: jax.Array
    good_steps: jax.Array
    hysteresis_left: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """DeepSpeed-style dynamic loss scaling.

    The loss is multiplied by ``scale`` before differentiation and the gradients divided by it
    after reduction. Per step:

    * overflow (any non-finite gradient on any device): the update is skipped; if
      ``hysteresis_left <= 1`` then ``scale = max(scale / factor, min_scale)`` else
      ``hysteresis_left -= 1``; ``good_steps = 0``.
    * clean step: ``good_steps += 1``; when ``good_steps == window``:
      ``scale *= factor``, ``good_steps = 0``, ``hysteresis_left = hysteresis``.

    Defaults are DeepSpeed's (initial 2**16, window 1000, factor 2, hysteresis 2, min 1).
    ``on_min`` says what the step does when an overflow happens at ``min_scale``: "raise"
    (DeepSpeed's behaviour), "warn" or "ignore".

    DeepSpeed's ``DynamicLossScaler`` counts otherwise; two options reproduce it exactly:

    * ``growth="since_overflow"``: ``good_steps`` counts the clean steps since the last
      overflow (DeepSpeed's ``cur_iter - last_overflow_iter - 1``) and is not reset by a
      growth; a clean step grows the scale when the clean steps before it are a positive
      multiple of ``window`` (the first growth after an overflow comes on the
      ``window + 1``-th clean step, later ones every ``window``). The default ``"reset"``
      grows on the ``window``-th clean step and restarts the count.
    * ``consecutive_hysteresis=True`` (DeepSpeed's ``consecutive_hysteresis``): every clean
      step refills ``hysteresis_left``, not only a growth.
    """

    init_scale: float = 2.0**16
    window: int = 1000
    factor: float = 2.0
    hysteresis: int = 2
    min_scale: float = 1.0
    on_min: str = "raise"
    growth: str = "reset"
    consecutive_hysteresis: bool = False

    def __post_init__(self):
        for name in ("init_scale", "factor", "min_scale"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"DynamicLossScale.{name}={v!r} must be a positive number.")
        if self.factor <= 1:
            raise ValueError(f"DynamicLossScale.factor={self.factor!r} must be > 1.")
        for name in ("window", "hysteresis"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DynamicLossScale.{name}={v!r} must be an int >= 1.")
        if self.min_scale > self.init_scale:
            raise ValueError(
                f"DynamicLossScale.min_scale={self.min_scale} exceeds init_scale={self.init_scale}."
            )
        if self.on_min not in ("raise", "warn", "ignore"):
            raise ValueError(f"on_min={self.on_min!r} must be 'raise', 'warn' or 'ignore'.")
        if self.growth not in ("reset", "since_overflow"):
            raise ValueError(
                f"DynamicLossScale.growth={self.growth!r} must be 'reset' or 'since_overflow'."
            )
        if not isinstance(self.consecutive_hysteresis, bool):
            raise TypeError(
                f"DynamicLossScale.consecutive_hysteresis={self.consecutive_hysteresis!r} must "
                "be True or False."
            )

    def init(self) -> LossScaleState:
        return LossScaleState(
            jnp.asarray(self.init_scale, jnp.float32),
            jnp.asarray(0, jnp.int32),
            jnp.asarray(self.hysteresis, jnp.int32),
        )

    def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        good = state.good_steps + 1
        if self.growth == "reset":
            grow = good >= self.window
            counted = jnp.where(grow, 0, good)
        else:  # DeepSpeed's: the clean steps before this one, a positive multiple of window
            grow = (state.good_steps > 0) & (state.good_steps % self.window == 0)
            counted = good
        refill = jnp.asarray(True) if self.consecutive_hysteresis else grow
        clean = LossScaleState(
            jnp.where(grow, state.scale * self.factor, state.scale),
            counted,
            jnp.where(refill, self.hysteresis, state.hysteresis_left),
        )
        back_off = state.hysteresis_left <= 1
        overflow = LossScaleState(
            jnp.where(
                back_off, jnp.maximum(state.scale / self.factor, self.min_scale), state.scale
            ),
            jnp.zeros_like(state.good_steps),
            jnp.where(back_off, state.hysteresis_left, state.hysteresis_left - 1),
        )
        return jax.tree.map(lambda c, o: jnp.where(finite, c, o), clean, overflow)

    def at_minimum(self, state: LossScaleState) -> jax.Array:
        return state.scale <= self.min_scale


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale (multiplied into the loss, divided out of the gradients)."""

    scale: float

    def __post_init__(self):
        if not isinstance(self.scale, (int, float)) or not self.scale > 0:
            raise ValueError(f"StaticLossScale.scale={self.scale!r} must be a positive number.")

    def init(self) -> LossScaleState:
        return LossScaleState(
            jnp.asarray(self.scale, jnp.float32),
            jnp.asarray(0, jnp.int32),
            jnp.asarray(0, jnp.int32),
        )

    def update(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        del finite
        return state

    def at_minimum(self, state: LossScaleState) -> jax.Array:
        return jnp.asarray(False)

    on_min = "ignore"


def check_loss_scale(loss_scale, precision: Precision) -> None:
    """Validate a loss-scale choice against the precision policy."""
    if loss_scale is None:
        return
    if not isinstance(loss_scale, (DynamicLossScale, StaticLossScale)):
        raise TypeError(
            f"loss_scale={loss_scale!r} must be jaxzero.DynamicLossScale(), "
            f"jaxzero.StaticLossScale(scale) or None."
        )
    if precision.param_dtype != jnp.float16:
        warnings.warn(
            f"a loss scale with param_dtype={precision.param_dtype.name} is unnecessary: "
            f"bfloat16/float32 have float32's exponent range. Pass loss_scale=None.",
            UserWarning,
            stacklevel=3,
        )


def _sub_jaxprs(params):
    for p in params.values():
        for q in p if isinstance(p, tuple | list) else (p,):
            if hasattr(q, "eqns"):
                yield q
            elif hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
                yield q.jaxpr


class WideMatmul(NamedTuple):
    """A matmul of the loss with a float32 operand: where it is (the module path from the
    equation's name stack, the user source line) and whether that operand is computed from
    the weights alone (an upcast weight: the module's own dtype) or from activations."""

    module: str
    source: str
    from_weights: bool


def _where(eqn) -> tuple[str, str]:
    """(module path, source line) of ``eqn``: its name stack without a trailing einsum's
    subscripts, and jax's summary of the user frame with the installation prefix dropped."""
    parts = str(eqn.source_info.name_stack).split("/")
    if parts and "->" in parts[-1]:
        parts = parts[:-1]
    try:
        from jax.extend.source_info_util import summarize

        source = re.sub(r"^.*(site|dist)-packages/", "", summarize(eqn.source_info))
    except Exception:  # noqa: BLE001 - the location is advice; a jax without it gives none
        source = "?"
    return "/".join(parts) or "(top level)", source


def wide_matmuls(jaxpr, weights=(), dtype=jnp.float32) -> list[WideMatmul]:
    """Every ``dot_general``/convolution in ``jaxpr`` (sub-jaxprs included) that takes an
    operand of ``dtype``; ``weights``: the variables holding the params (see
    :func:`_weight_flow`)."""
    return _weight_flow(jaxpr, weights, dtype)[0]


def _weight_flow(jaxpr, weights, dtype) -> tuple[list[WideMatmul], set]:
    """:func:`wide_matmuls`, and the variables computed from ``weights`` alone: an equation's
    outputs when its inputs are such variables, constants or scalars (at least one of them a
    weight),
    or, for an equation holding a sub-jaxpr (its inputs aligned with the equation's last
    inputs), the outputs the sub-jaxpr computes from them (a ``jax.checkpoint`` that also
    reads activations can return a weight-only value)."""
    derived, consts, out = set(weights), set(), []
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, Literal)]
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            wide = [v for v in ins if getattr(v.aval, "dtype", None) == dtype]
            if wide:
                out.append(WideMatmul(*_where(eqn), any(v in derived for v in wide)))
        for sub in _sub_jaxprs(eqn.params):
            k = min(len(sub.invars), len(eqn.invars))
            pairs = zip(eqn.invars[-k:] if k else [], sub.invars[-k:] if k else [], strict=True)
            given = [s for v, s in pairs if not isinstance(v, Literal) and v in derived]
            found, inner = _weight_flow(sub, given, dtype)
            out += found
            if len(sub.outvars) == len(eqn.outvars):
                derived.update(
                    o
                    for o, s in zip(eqn.outvars, sub.outvars, strict=True)
                    if not isinstance(s, Literal) and s in inner
                )
        if all(v in consts for v in ins):  # computed from literals alone
            consts.update(eqn.outvars)
        elif all(v in derived or v in consts or _scalar(v) for v in ins) and any(
            v in derived for v in ins
        ):  # a weight shifted or scaled by a scalar (units='s ordering tokens) stays one
            derived.update(eqn.outvars)
    return out, derived


def _scalar(v) -> bool:
    return getattr(getattr(v, "aval", None), "size", 2) <= 1


def _places(found: list[WideMatmul], most: int = 3) -> str:
    """Where ``found`` are, grouped by source line: "2 at file.py:12 (fn) in Model/a, ..."."""
    groups: dict[str, list[str]] = {}
    for m in found:
        groups.setdefault(m.source, [])
        if m.module not in groups[m.source]:
            groups[m.source].append(m.module)
    text = []
    for source, modules in list(groups.items())[:most]:
        n = sum(m.source == source for m in found)
        text.append(f"{n} at {source} in {', '.join(modules[:most])}")
        text[-1] += f" and {len(modules) - most} more" if len(modules) > most else ""
    more = len(groups) - most
    return "; ".join(text) + (f"; and {more} more places" if more > 0 else "")


def wide_compute_advice(found: list[WideMatmul], name: str) -> str:
    """The warning for the float32 matmuls ``found`` under a ``name`` (16-bit) policy."""
    upcast = [m for m in found if m.from_weights]
    head = f"the precision policy computes in {name}, but {len(found)} matmul(s) of the loss "
    if upcast:
        return (
            f"{head}run in float32, {len(upcast)} of them on {name} weights upcast to float32 "
            f"({_places(upcast)}): a Flax module computes in its own dtype (float32 by "
            f"default) and upcasts the {name} weights. Build those modules with "
            f"dtype=jnp.{name} (e.g. nn.Dense(features, dtype=jnp.{name}), or the module's "
            f"dtype= field) to compute in {name}; keep param_dtype as it is."
        )
    return (
        f"{head}run in float32 ({_places(found)}), none of them on upcast weights: the model "
        f"computes these activations in float32 itself, which may be deliberate (e.g. an "
        f"attention softmax kept in float32 for accuracy, as Hugging Face's Llama does). "
        f"Neither the precision policy nor a module's dtype= is the cause; change that code "
        f"only if float32 there is not intended."
    )


def warn_wide_compute(jaxpr, weights: int, policy: Precision) -> None:
    """Under a 16-bit policy, warn when the loss still runs matmuls in float32.

    ``precision="bf16"`` stores and communicates bf16 weights, but a Flax module computes in
    its own ``dtype`` (float32 by default): the weights are upcast again and the matmuls run
    in float32, costing the speed the policy was chosen for. ``jaxpr`` is the loss's (traced
    once by the step, at trace time, not per step; None when it did not trace) and its first
    ``weights`` inputs are the params: a matmul whose float32 operand is computed from them
    alone takes an upcast weight (the warning advises the module's ``dtype=``); one on float32
    activations only is the model's own choice (the warning says where, and that it may be
    deliberate). Does nothing for a float32 policy.
    """
    if jaxpr is None or jnp.finfo(policy.param_dtype).bits >= 32:
        return
    found = wide_matmuls(jaxpr, jaxpr.invars[:weights])
    if found:
        name = jnp.dtype(policy.param_dtype).name
        warnings.warn(wide_compute_advice(found, name), UserWarning, stacklevel=2)
