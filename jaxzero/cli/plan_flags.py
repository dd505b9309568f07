"""The argument groups of ``jaxzero plan`` (:mod:`jaxzero.cli.plan`) that choose the step's
layout, loop, wire and offload link."""

from __future__ import annotations

from jaxzero.cli.command import positive_int


def add_per_layer_choices(group) -> None:
    """``--stage3``, ``--stage2`` and ``--stage1``: whole, per-layer or both rows."""
    for stage, what in (
        (3, "gathers the whole model up front, or one layer at a time"),
        (
            2,
            "reduce-scatters the whole gradient after the backward, or each layer's in the "
            "backward loop (hidden behind the next layer's backward)",
        ),
        (
            1,
            "all-reduces the whole gradient after the backward, or (without --accum) "
            "reduce-scatters each layer's in the backward loop as stage 2",
        ),
    ):
        group.add_argument(
            f"--stage{stage}",
            choices=["whole", "per-layer", "both"],
            default="both" if stage == 3 else "whole",
            help=f"stage {stage} {what} (per layer: ZeRO(layers=...) + jaxzero.gather_layer), "
            "or both rows (default: %(default)s)",
        )


def add_loop(group) -> None:
    """``--loop``: the layers scanned, or a Python loop of blocks (stage 3 per unit)."""
    group.add_argument(
        "--loop",
        choices=["scan", "python"],
        default="scan",
        help="scan: the layers stacked (jaxzero.scan_layers; stage 3 per layer is "
        "ZeRO(layers=...)); python: a Python loop of nn.remat blocks, stage 3 per layer is "
        "ZeRO(units=...), stages 1-2 whole only (default: %(default)s)",
    )
    group.add_argument(
        "--prefetch",
        choices=["on", "off", "both"],
        help="with --loop python, stage 3 per unit with ZeRO(prefetch=True), prefetch=False, "
        "or both rows and which to pick (default: both where a per-unit row is compiled)",
    )


def add_wire(group) -> None:
    """``--quantize``, ``--network-gbps`` and ``--gpus-per-node``: the wire and its cost."""
    group.add_argument(
        "--quantize",
        choices=["weights", "grads", "both"],
        help="ZeRO++'s int8 collectives (jaxzero.ZeRO(quantize=...)): weights: stage 3's "
        "all-gathers; grads: the reduce-scatters of stages 2-3; both",
    )
    group.add_argument(
        "--grad-bits",
        type=int,
        choices=[8, 4],
        help="the width of --quantize grads/both's gradients: 4 is DeepSpeed's ZeRO++ default "
        "(qgZ), as jaxzero.Wire.create(weights=8, grads=4) (default: 8)",
    )
    group.add_argument(
        "--network-gbps",
        type=float,
        nargs=2,
        metavar=("INTRA", "INTER"),
        help="intra-node and inter-node bandwidth per GPU in Gbit/s: print each row's "
        "collective bytes per step and the time they take (jaxzero.gpu.plan.wire_time)",
    )
    group.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=8,
        help="GPUs per node, consecutive device ids: where --network-gbps's rings and the "
        "cross-node bytes cross nodes (default: %(default)s)",
    )
    group.add_argument(
        "--hpz",
        type=positive_int,
        metavar="G",
        help="ZeRO++'s hpZ, DeepSpeed's zero_hpz_partition_size (usually --gpus-per-node): "
        "stage 3 per layer with jaxzero.ZeRO(hpz_partition_size=G), the backward gathering "
        "each layer within groups of G; prints each row's cross-node bytes per step",
    )
