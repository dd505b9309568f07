"""What a plan's collectives cost on the network: the bytes per step, the cross-node share of
them, and the time each takes at a link's bandwidth (``jaxzero plan --network-gbps``)."""

from __future__ import annotations

import dataclasses

from jaxzero.gpu.hlo import cross_node_bytes
from jaxzero.gpu.report import CompileReport
from jaxzero.zero.wire import Exact, Wire

__all__ = ["COLLECTIVES", "WireTime", "cross_node_time", "stage_quantize", "wire_time"]

COLLECTIVES = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")


@dataclasses.dataclass(frozen=True)
class WireTime:
    """What a step's collectives cost on the network: ``bytes`` (payload per device per step,
    every collective kind, loop trip counts applied), ``seconds`` those bytes take on
    ``link`` (``"intra-node"`` or ``"inter-node"``) at ``gbps``."""

    bytes: int
    seconds: float
    link: str
    gbps: float


def wire_time(
    report: CompileReport, devices: int, intra_gbps: float, inter_gbps: float, per_node: int = 8
) -> WireTime:
    """The cost model of :class:`WireTime`: a ring collective over ``devices`` sends
    ``(devices - 1) / devices`` of its payload through each device's link, and a ring that
    spans nodes (``devices > per_node``) runs at the inter-node bandwidth. Compute overlap is
    not counted: it is the time the bytes take, hidden or not."""
    for name, v in (("intra_gbps", intra_gbps), ("inter_gbps", inter_gbps)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ValueError(f"{name}={v!r} must be a positive number of Gbit/s.")
    nbytes = sum(report.payload(kind) for kind in COLLECTIVES)
    link, gbps = ("inter-node", inter_gbps) if devices > per_node else ("intra-node", intra_gbps)
    seconds = nbytes * (devices - 1) / devices / (gbps * 1e9 / 8)
    return WireTime(nbytes, seconds, link, float(gbps))


def stage_quantize(quantize, stage: int):
    """The part of ``quantize`` (``"weights"``, ``"grads"``, ``"both"``, or a
    :class:`~jaxzero.Wire` such as ``Wire.create(weights=8, grads=4)``) that acts at
    ``stage``: weights at stage 3, gradients at stages 2-3 (``ZeRO`` refuses the rest)."""
    if isinstance(quantize, Wire):
        weights = quantize.weights if stage == 3 else Exact()
        grads = quantize.grads if stage >= 2 else Exact()
        if isinstance(weights, Exact) and isinstance(grads, Exact):
            return None
        return Wire(weights, grads, quantize.hpz)
    weights = quantize in ("weights", "both") and stage == 3
    grads = quantize in ("grads", "both") and stage >= 2
    return {(True, True): "both", (True, False): "weights", (False, True): "grads"}.get(
        (weights, grads)
    )


def cross_node_time(
    report: CompileReport, group_size: int, inter_gbps: float, per_node: int = 8
) -> WireTime:
    """The bytes per device per step of the collectives that cross nodes (nodes of
    ``per_node`` consecutive devices, :func:`jaxzero.gpu.hlo.cross_node_bytes` on the
    compiled HLO; ``group_size``: the data axis size), and the time they take at
    ``inter_gbps`` in :func:`wire_time`'s ring model: ``(group_size - 1) / group_size`` of
    them through each device's inter-node link, overlap not counted."""
    if isinstance(inter_gbps, bool) or not isinstance(inter_gbps, int | float) or inter_gbps <= 0:
        raise ValueError(f"inter_gbps={inter_gbps!r} must be a positive number of Gbit/s.")
    nbytes = cross_node_bytes(report.hlo_text, per_node, group_size)
    seconds = nbytes * (group_size - 1) / group_size / (inter_gbps * 1e9 / 8)
    return WireTime(nbytes, seconds, "inter-node", float(inter_gbps))
