"""``jaxzero plan --offload auto``: the smallest share of the optimizer side to offload for the
step to fit the GPU (``ZeRO(offload="optimizer", offload_fraction=f)``, decision 43).

The device side of the state grows byte for byte with what the fraction keeps there: a leaf
kept on the device is an argument of the step in device memory instead of host memory, and
the streamed update's working set does not depend on it. So one compile with everything
offloaded gives the linear model: with ``S`` its host bytes and ``spare`` the memory it
leaves free, the device takes ``(1 - f) x S`` more at fraction ``f``, and the smallest
fraction that fits is ``1 - spare / S``. The fraction is rounded up to a hundredth and
checked by compiling it; a check that does not fit moves the fraction up by its shortfall
over ``S`` (at most :data:`CHECKS` times).

Fitting is not enough: XLA:GPU's latency-hiding scheduler keeps the step under the device's
memory, and a step that fills it leaves no room to run a collective beside compute (the 70B
plan at N = 8 H100s fits at 0.55 with 2.95 GB to spare and hides 31% of its all-gather and
reduce-scatter bytes, against 96% with all of it offloaded and 96% at 0.55 on an H200). So
the fraction that fits must also hide those bytes as the all-offloaded step does
(:func:`keeps_overlap`); where it does not, the fraction is bisected between it and 1
(:data:`BISECTIONS` compiles).

Where everything offloaded still does not fit, the params go to the host too
(:func:`or_params`): offload only what does not fit, the optimizer side first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jaxzero.gpu.report import CompileReport
from jaxzero.memory import MemoryEstimate

__all__ = [
    "BISECTIONS",
    "CHECKS",
    "WITH_PARAMS",
    "fraction_estimate",
    "keeps_overlap",
    "limited",
    "or_params",
    "smallest_fraction",
]

#: compiles after the first that check (and correct) the linear model's fraction
CHECKS = 3
#: compiles that bisect towards 1 where the fraction that fits loses the collectives' overlap
BISECTIONS = 3
#: how much of the all-offloaded step's hidden share of all-gather + reduce-scatter bytes a
#: fraction may lose
OVERLAP_SLACK = 0.02
_KINDS = ("all-gather", "reduce-scatter")
#: auto's last try where all of the optimizer side offloaded does not fit: the params too
WITH_PARAMS = "1 + params"


def keeps_overlap(report: CompileReport, full: CompileReport) -> bool:
    """Whether ``report`` hides the all-gather and reduce-scatter bytes as ``full`` (the step
    with everything offloaded) does, within :data:`OVERLAP_SLACK`."""
    return report.hidden_share(*_KINDS) >= full.hidden_share(*_KINDS) - OVERLAP_SLACK


def limited(report: CompileReport, gpu_memory: int | None) -> CompileReport:
    """``report`` judged against ``gpu_memory`` bytes per device (``--gpu-memory``) instead of
    the GPU kind's memory; unchanged when None."""
    return report if gpu_memory is None else dataclasses.replace(report, hbm_bytes=gpu_memory)


def fraction_estimate(est: MemoryEstimate, fraction: float | None) -> MemoryEstimate:
    """``est`` (with ``offload="optimizer"``) with ``fraction`` of its host bytes on the host
    and the rest back in the device's optimizer column (linear: the leaves' granularity is
    the compiled row's); unchanged at ``fraction`` None or 1."""
    if fraction is None or fraction >= 1:
        return est
    kept = math.ceil(fraction * est.host)
    return dataclasses.replace(est, optimizer=est.optimizer + est.host - kept, host=kept)


def _tried(f, report: CompileReport) -> tuple[float | None, int, float]:
    """``(fraction, peak bytes, hidden share of all-gather + reduce-scatter)`` of a compile."""
    return f, report.peak_bytes, report.hidden_share(*_KINDS)


def _up(f: float) -> float:
    """``f`` rounded up to a hundredth, in [0.01, 1]."""
    return min(1.0, max(0.01, math.ceil(round(f * 100, 6)) / 100))


def smallest_fraction(
    compile_at: Callable[[float | None], CompileReport],
    keeps: Callable[[CompileReport, CompileReport], bool] = keeps_overlap,
) -> tuple[float | None, CompileReport, list[tuple[float | None, int, float]]]:
    """The smallest offload fraction whose compile fits and ``keeps(report, full)`` (the
    overlap of the all-offloaded compile ``full``), by the module's linear model and, where
    the overlap is lost, a bisection towards 1.

    ``compile_at(f)`` compiles the step with ``offload_fraction=f`` (None: without offload)
    and returns its report, judged against the device's memory (:func:`limited`).

    Returns:
      ``(fraction, report, tried)``: the fraction picked (None: the step fits without
      offload; 1.0 also when nothing fits, the report then short), its compile's report,
      and every ``(fraction, peak bytes, hidden share)`` compiled, in order.
    """
    full = compile_at(1.0)
    tried = [_tried(1.0, full)]
    host = full.host_argument_bytes
    if not full.fits or host <= 0:
        return 1.0, full, tried
    f = 1.0 - full.headroom_bytes / host
    if f <= 0:  # all of it fits on the device: check the step without offload
        none = compile_at(None)
        tried.append(_tried(None, none))
        if none.fits and keeps(none, full):
            return None, none, tried
        f = 0.01
    f = _up(f)
    for _ in range(CHECKS):
        if f >= 1.0:
            break
        report = compile_at(f)
        tried.append(_tried(f, report))
        if report.fits:
            return (
                (f, report, tried)
                if keeps(report, full)
                else _bisect(f, full, compile_at, keeps, tried)
            )
        f = _up(f + (report.peak_bytes - report.hbm_bytes) / host + 0.01)
    return 1.0, full, tried


def or_params(picked, compile_params: Callable[[], CompileReport | None] | None):
    """``(fraction, report, tried, params)``: :func:`smallest_fraction`'s ``picked`` with
    ``params`` False; or, where even all of the optimizer side offloaded does not fit, the
    step with the params offloaded too (``ZeRO(offload=("optimizer", "params"))``), compiled
    by ``compile_params``, with ``params`` True. ``compile_params`` is None, or returns None,
    where ZeRO does not build the params offload for the case (it needs stage 3 a layer or a
    unit at a time, bf16 on 2^k devices); ``picked`` then stands."""
    f, report, tried = picked
    more = None
    if f == 1.0 and not report.fits and compile_params is not None:
        more = compile_params()
    if more is None:
        return f, report, tried, False
    return 1.0, more, [*tried, _tried(WITH_PARAMS, more)], True


def _bisect(low, full, compile_at, keeps, tried):
    """Between ``low`` (fits, loses the overlap) and 1 (``full``), the smallest hundredth found
    by :data:`BISECTIONS` halvings that fits and keeps it."""
    high, best = 1.0, (1.0, full)
    for _ in range(BISECTIONS):
        mid = _up((low + high) / 2)
        if mid >= high:
            break
        report = compile_at(mid)
        tried.append(_tried(mid, report))
        if report.fits and keeps(report, full):
            high, best = mid, (mid, report)
        else:
            low = mid
    return (*best, tried)
