"""A model EMA that lives in the master weights' shards.

Each EMA leaf takes the sharding of the fp32 master shard it averages, so

    ema_shard <- d * ema_shard + (1 - d) * master_shard

is purely local: no collective in the compiled step, 1/N of the work per device. The full
EMA is assembled (one all-gather per leaf) only by :func:`jaxzero.gather`, for evaluation or
export.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.ema.storage import ALL, is_bucketed
from jaxzero.trees import check_same_structure

SCHEDULES = ("constant", "yolov5", "tf")


class EmaState(NamedTuple):
    """EMA state: ``updates`` (int32, EMA updates applied so far) and the averaged tree."""

    updates: jax.Array
    ema: Any

    def gather_view(self):
        """What :func:`jaxzero.gather` of an EMA state gathers: the averaged tree."""
        return self.ema


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _integral(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


@dataclasses.dataclass(frozen=True)
class ShardedEMA:
    """Exponential moving average of the weights, updated on shards.

    Decay schedules (``n`` = the number of this update, counting it: 1 on the first update):

    * ``"constant"``: ``d = decay``.
    * ``"yolov5"`` (YOLOv5 / ultralytics / distributed ModelEMA): ``d = decay * (1 - exp(-n / tau))``.
    * ``"tf"`` (TF ``ExponentialMovingAverage(num_updates=)`` / praxis):
      ``d = min(decay, (1 + n - 1) / (10 + n - 1))`` i.e. ``min(decay, n / (9 + n))``, with
      ``n - 1`` the number of updates before this one.

    The update is ``ema = d * ema + (1 - d) * x`` for floating leaves; non-float leaves
    (counters, integer buffers) are copied from ``x``. The counter starts at ``updates0``.

    ``every`` and ``start_step`` gate the update on the training step ``t`` (the optimizer step
    count after this update, 1 on the first step): before ``start_step`` the EMA is a copy of
    the weights (and ``updates`` does not advance); from then on it is updated when
    ``(t - start_step) % every == 0``.

    Args:
      decay: the decay in (0, 1).
      tau: warm-up time constant of the ``"yolov5"`` schedule (> 0).
      schedule: one of ``"constant"``, ``"yolov5"``, ``"tf"``; default ``"yolov5"`` when ``tau``
        is given, else ``"constant"``.
      every: update every this many training steps (>= 1).
      start_step: first training step at which averaging starts.
      dtype: dtype of the EMA of floating leaves (float32).
      updates0: initial value of the counter (YOLOv5's ``updates=`` argument).
      torch_compatible: reproduce torch's float32 ``v *= d; v += (1 - d) * m`` bit for bit
        (``d`` and ``1 - d`` computed in float64 on the host and rounded to float32).
      bucket_leaves_up_to: when the EMA is placed by :class:`jaxzero.ZeRO` (``ZeRO.init``,
        ``make_train_step``), store the EMA of every float leaf whose per-device shard has at
        most this many elements in a few flat ``[N, L_g]`` rows sharded ``P(axis)``, each
        updated by one kernel per device (see :mod:`jaxzero.ema.storage`). ``"all"``: every
        float leaf; 0 keeps one array per leaf; None (the default): ``"all"`` on GPU meshes
        at stages 0-2 (a 350-leaf tree: 4 row kernels added to the train step instead of 351,
        the same 12 bytes per element), 0 on GPU meshes at stage 3 (there XLA fuses each
        leaf's EMA update into that leaf's optimizer kernel: no kernel added to the step, 8
        bytes per element) and on CPU meshes. (In a train step the default EMA's counter is
        derived from the step's and shares its kernel.) Same numbers as per-leaf storage (bit
        for bit with ``torch_compatible``; otherwise XLA may contract ``d * e + (1 - d) * x``
        into an FMA in one and not the other: an ulp), same bytes per device, no collective.
        Why: on XLA:CPU every leaf is its own kernel per device (~5 us each); the 37 small leaves
        (biases, norm scales: 45K floats) of ``benchmarks/ema.py``'s 20M-float, 54-leaf tree
        cost 1.2-1.6 ms of a ~9 ms sharded update; 4096 buckets exactly those there.
        :func:`jaxzero.gather`, :func:`jaxzero.ema_params`, checkpoints (per-leaf on disk)
        and the torch interop see the per-leaf tree (:func:`jaxzero.unbucket_ema`);
        ``init``/``update`` on plain trees stay per-leaf.

    Example:
      >>> ema = ShardedEMA(0.9999, tau=2000)
      >>> state = ema.init(params)
      >>> state = ema.update(state, new_params)
    """

    decay: float = 0.9999
    tau: float | None = None
    schedule: str | None = None
    every: int = 1
    start_step: int = 0
    dtype: Any = jnp.float32
    updates0: int = 0
    torch_compatible: bool = False
    bucket_leaves_up_to: int | str | None = None

    def __post_init__(self):
        if not _real(self.decay) or not 0.0 < self.decay < 1.0:
            raise ValueError(
                f"ShardedEMA decay={self.decay!r} must be in the open interval (0, 1)."
            )
        if self.tau is not None and (not _real(self.tau) or not self.tau > 0):
            raise ValueError(f"ShardedEMA tau={self.tau!r} must be > 0 (or None for no warm-up).")
        schedule = self.schedule or ("yolov5" if self.tau is not None else "constant")
        if schedule not in SCHEDULES:
            raise ValueError(f"ShardedEMA schedule={schedule!r} must be one of {SCHEDULES}.")
        if schedule == "yolov5" and self.tau is None:
            raise ValueError("ShardedEMA schedule='yolov5' needs tau > 0, e.g. tau=2000.")
        object.__setattr__(self, "schedule", schedule)
        if not _integral(self.every) or self.every < 1:
            raise ValueError(f"ShardedEMA every={self.every!r} must be an int >= 1.")
        if not _integral(self.start_step) or self.start_step < 0:
            raise ValueError(f"ShardedEMA start_step={self.start_step!r} must be an int >= 0.")
        if not _integral(self.updates0) or self.updates0 < 0:
            raise ValueError(f"ShardedEMA updates0={self.updates0!r} must be an int >= 0.")
        k = self.bucket_leaves_up_to
        if k == "all":
            k = ALL
        elif k is not None and (not _integral(k) or k < 0):
            raise ValueError(
                f"ShardedEMA bucket_leaves_up_to={k!r} must be None (automatic), 'all' or an "
                f"int >= 0 (elements per device; 0 keeps every leaf separate, e.g. 65536)."
            )
        object.__setattr__(self, "bucket_leaves_up_to", None if k is None else int(k))
        if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
            raise ValueError(f"ShardedEMA dtype={self.dtype!r} must be a floating dtype.")

    # -- decay ---------------------------------------------------------------------------
    def decay_at(self, n):
        """The decay used by update number ``n`` (1-based), as float32 (traceable)."""
        n = jnp.asarray(n, jnp.float32)
        if self.schedule == "constant":
            return jnp.full_like(n, self.decay)
        if self.schedule == "yolov5":
            return self.decay * (1.0 - jnp.exp(-n / self.tau))
        return jnp.minimum(self.decay, n / (9.0 + n))

    def decay_at_f64(self, n: int) -> float:
        """The same decay computed in float64 on the host (the torch reference)."""
        if self.schedule == "constant":
            return float(self.decay)
        if self.schedule == "yolov5":
            return self.decay * (1 - math.exp(-n / self.tau))
        return min(self.decay, n / (9.0 + n))

    def _torch_coefficients(self, n):
        def host(n):
            d = self.decay_at_f64(int(n))
            return np.float32(d), np.float32(1.0 - d)

        spec = jax.ShapeDtypeStruct((), jnp.float32)
        return jax.pure_callback(host, (spec, spec), n)

    # -- state ---------------------------------------------------------------------------
    def init(self, params) -> EmaState:
        """Start the EMA as a copy of ``params`` (float leaves cast to ``dtype``).

        The copy keeps each leaf's sharding, so pass the master shards (``ZeRO.init`` does).
        """
        ema = jax.tree.map(
            lambda x: jnp.asarray(x, self.dtype) if _is_float(x) else jnp.array(x), params
        )
        return EmaState(jnp.asarray(self.updates0, jnp.int32), ema)

    def update(self, state: EmaState, params, *, step=None, apply=True) -> EmaState:
        """One EMA update toward ``params`` (pure; traceable).

        Args:
          state: the current :class:`EmaState`.
          params: a tree with the EMA's structure (the new master weights/shards).
          step: the training step after this update (for ``every``/``start_step``); None
            means "always update".
          apply: a boolean (traced or not); when False the state is returned unchanged
            (steps skipped for non-finite gradients).

        Raises:
          ValueError: ``params`` has a different tree structure or leaf shapes than the EMA.
        """
        if is_bucketed(state.ema) and not is_bucketed(params):
            raise ValueError(
                "this EMA state stores small leaves in a bucket (ShardedEMA(bucket_leaves_up_to"
                "=...) placed by ZeRO); update it with zero.update_ema(ema, state, master), or "
                "convert it with jaxzero.unbucket_ema(state) first."
            )
        check_same_tree(state.ema, params)
        if step is None:
            averaging, copying = jnp.asarray(True), jnp.asarray(False)
        else:
            # Predicates that are constant for the default gating stay Python constants: on a
            # GPU a traced `step < 0` is a kernel of its own in front of the EMA's kernels.
            step = jnp.asarray(step)
            copying = step < self.start_step if self.start_step > 0 else jnp.asarray(False)
            averaging = ~copying
            if self.every > 1:
                averaging = jnp.logical_and(averaging, (step - self.start_step) % self.every == 0)
        averaging = jnp.logical_and(averaging, apply)
        copying = jnp.logical_and(copying, apply)
        n = state.updates + 1
        if self.torch_compatible:
            d, one_minus_d = self._torch_coefficients(n)
        else:
            d = self.decay_at(n)
            one_minus_d = 1.0 - d

        def leaf(e, x):
            if not _is_float(e):
                return jnp.where(apply, x.astype(e.dtype), e)
            x = x.astype(e.dtype)
            if self.torch_compatible:
                # torch rounds both products to float32 before adding. Under jit, XLA's CPU
                # (LLVM) backend contracts a*b + c into an FMA, even with loop-invariant
                # selects in between (it unswitches them). A per-element select that is the
                # identity for every value (NaN included) keeps the products separately rounded.
                a = e * d.astype(e.dtype)
                b = x * one_minus_d.astype(e.dtype)
                new = jnp.where(e == e, a, e) + jnp.where(x == x, b, x)
            else:
                new = d.astype(e.dtype) * e + one_minus_d.astype(e.dtype) * x
            return jnp.where(averaging, new, jnp.where(copying, x, e))

        ema = jax.tree.map(leaf, state.ema, params)
        return EmaState(jnp.where(averaging, n, state.updates).astype(jnp.int32), ema)


def check_same_tree(reference, other) -> None:
    """Raise ValueError naming the first path where ``other`` differs from the EMA tree."""
    try:
        check_same_structure(reference, other, "the EMA tree")
    except ValueError as e:
        raise ValueError(
            f"{e} The EMA was built for a different params tree; build it from the same params "
            f"(ShardedEMA.init(params) / ZeRO.init(params, ema=...))."
        ) from None
