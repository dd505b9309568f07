"""The argument checks of :func:`jaxzero.gpu.plan.plan` (and ``jaxzero plan``): each refuses
a combination that would not compile or would change nothing, naming the fix."""

from __future__ import annotations

from jaxzero.gpu.models import PYTHON_LOOPS, ModelShape
from jaxzero.zero.offload import check_offload, params_offloaded
from jaxzero.zero.offload.fraction import check_fraction
from jaxzero.zero.wire import Wire

PRECISIONS = ("bf16", "fp16", "fp32")


def check_loop(shape: ModelShape, stage2: str, stage1: str) -> None:
    """An unscanned model has no stack for stages 1-2 to reduce layer by layer."""
    if shape.loop not in PYTHON_LOOPS:
        return
    for name, v in (("stage2", stage2), ("stage1", stage1)):
        if v != "whole":
            raise ValueError(
                f"{name}={v!r} needs a scanned layer stack (ZeRO(layers=...)); the shape's "
                f"loop={shape.loop!r} is a Python loop of blocks, which stage 3 alone runs unit "
                f"by unit (ZeRO(units=...)). Pass {name}='whole', or a scanned loop."
            )


def check_hpz(hpz, shape: ModelShape, stages, stage3: str, devices: int, replicas: int) -> None:
    """``hpz`` acts on the per-layer stage-3 row of a scanned stack only; G must split the data
    axis into nodes (divide it, and be smaller)."""
    if hpz is None:
        return
    n = devices // replicas
    why = None
    if stages is not None and 3 not in stages:
        why = "it acts on stage 3 per layer only (the backward's gathers): include stage 3"
    elif stage3 == "whole":
        why = (
            "it acts on stage 3 per layer only: pass stage3='per-layer' or 'both' "
            "(jaxzero plan --stage3 per-layer)"
        )
    elif shape.loop in PYTHON_LOOPS:
        why = "it needs a scanned stack (jaxzero.scan_layers), not a Python loop of blocks"
    elif isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 2 or n % hpz or hpz >= n:
        why = f"G must be >= 2, divide the data axis of {n} devices and be smaller"
    if why:
        raise ValueError(f"hpz={hpz!r}: {why}.")


def check_plan_offload(offload, fraction) -> tuple[bool, str | None, float]:
    """``(auto, offload, fraction)``: ``offload="auto"`` is ``"optimizer"`` at a fraction
    each case picks; ``fraction`` checked against ``offload`` (it needs ``"optimizer"``)."""
    auto = offload == "auto"
    offload = "optimizer" if auto else offload
    on_host = params_offloaded(check_offload(offload, 3))
    return auto, offload, check_fraction(fraction, offload, on_host)


def _check_plan_args(precision, accum, devices, replicas, quantize=None, pcie_gbps=None):
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {', '.join(PRECISIONS)}.")
    for name, v in (("accum", accum), ("devices", devices), ("replicas", replicas)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int.")
    if devices % replicas:
        raise ValueError(f"replicas={replicas} must divide devices={devices}.")
    if pcie_gbps is not None and (
        isinstance(pcie_gbps, bool) or not isinstance(pcie_gbps, int | float) or pcie_gbps <= 0
    ):
        raise ValueError(f"pcie_gbps={pcie_gbps!r} must be a positive number of GB/s.")
    if not isinstance(quantize, Wire) and quantize not in (None, "weights", "grads", "both"):
        raise ValueError(
            f"quantize={quantize!r} must be None, 'weights', 'grads', 'both' or a "
            f"jaxzero.Wire (e.g. Wire.create(weights=8, grads=4): DeepSpeed's ZeRO++ widths)."
        )
