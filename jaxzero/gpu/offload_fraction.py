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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jaxzero.gpu.report import CompileReport
from jaxzero.memory import MemoryEstimate

__all__ = ["CHECKS", "fraction_estimate", "limited", "smallest_fraction"]

#: compiles after the first that check (and correct) the linear model's fraction
CHECKS = 3


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


def _up(f: float) -> float:
    """``f`` rounded up to a hundredth, in [0.01, 1]."""
    return min(1.0, max(0.01, math.ceil(round(f * 100, 6)) / 100))


def smallest_fraction(
    compile_at: Callable[[float | None], CompileReport],
) -> tuple[float | None, CompileReport, list[tuple[float | None, int]]]:
    """The smallest offload fraction whose compile fits, by the module's linear model.

    ``compile_at(f)`` compiles the step with ``offload_fraction=f`` (None: without offload)
    and returns its report, judged against the device's memory (:func:`limited`).

    Returns:
      ``(fraction, report, tried)``: the fraction picked (None: the step fits without
      offload; 1.0 also when nothing fits, the report then short), its compile's report,
      and every ``(fraction, peak bytes)`` compiled, in order.
    """
    full = compile_at(1.0)
    tried = [(1.0, full.peak_bytes)]
    host = full.host_argument_bytes
    if not full.fits or host <= 0:
        return 1.0, full, tried
    f = 1.0 - full.headroom_bytes / host
    if f <= 0:  # all of it fits on the device: check the step without offload
        none = compile_at(None)
        tried.append((None, none.peak_bytes))
        if none.fits:
            return None, none, tried
        f = 0.01
    f = _up(f)
    for _ in range(CHECKS):
        if f >= 1.0:
            break
        report = compile_at(f)
        tried.append((f, report.peak_bytes))
        if report.fits:
            return f, report, tried
        f = _up(f + (report.peak_bytes - report.hbm_bytes) / host + 0.01)
    return 1.0, full, tried
