"""``jaxzero plan``'s flags for where the state lives and what offload costs: ``--offload``
(with ``auto``), ``--offload-fraction``, ``--gpu-memory``, ``--pcie-gbps``, their checks and
the words the plan's first line says them in."""

from __future__ import annotations

import argparse
import sys

from jaxzero.cli.command import memory_size


def add_state_layout(group) -> None:
    """``--no-compute-copy`` and ``--offload``: where the state lives."""
    group.add_argument(
        "--no-compute-copy",
        dest="compute_copy",
        action="store_false",
        help="stage 3 in FSDP's layout: no 16-bit params copy beside the fp32 master "
        "(jaxzero.Precision(compute_copy=False))",
    )
    group.add_argument(
        "--offload",
        choices=["optimizer", "optimizer,params", "auto"],
        help="keep the fp32 master, Adam's state and the EMA in pinned host memory, streamed "
        "through the GPU by the update (jaxzero.ZeRO(offload='optimizer'); stages 1-3, the "
        "default then); optimizer,params: the bf16 params too, fetched a layer at a time, "
        "and their gradients (offload=('optimizer', 'params'); stage 3 per layer); auto: "
        "'optimizer' at the smallest --offload-fraction whose compile fits the GPU "
        "(--gpu-memory), none if the step fits without",
    )
    group.add_argument(
        "--offload-fraction",
        type=float,
        default=1.0,
        metavar="F",
        help="with --offload optimizer, the share in (0, 1] of the master, Adam and EMA bytes "
        "per GPU kept in host memory, largest leaves first (ZeRO(offload_fraction=F); "
        "DeepSpeed's offload_optimizer.ratio) (default: 1)",
    )
    group.add_argument(
        "--gpu-memory",
        type=memory_size,
        metavar="SIZE",
        help="per-GPU memory the verdicts (and --offload auto) judge by, e.g. 16GB, 79.6GiB "
        "(default: the --gpu kind's)",
    )


def add_pcie(group) -> None:
    """``--pcie-gbps``: the host <-> device rate the offload columns assume."""
    group.add_argument(
        "--pcie-gbps",
        type=float,
        metavar="GB/S",
        help="with --offload, the pinned host <-> device copy rate per GPU in GB/s (1e9 "
        "bytes/s, not Gbit/s) for the predicted step time (default per --gpu: h100 and h200 "
        "55, measured on an H100 PCIe Gen5 host; a100 25, PCIe Gen4; sources in "
        "jaxzero.gpu.targets.PCIE_SOURCES)",
    )


def offload_words(args) -> str:
    """``--offload``'s choice as the description line says it."""
    if args.offload == "auto":
        return "the smallest fraction of the optimizer that fits"
    share = f" ({args.offload_fraction:g} of it)" if args.offload_fraction != 1 else ""
    return " and ".join(args.offload.split(",")) + share


def check_offload_args(args: argparse.Namespace, parser):
    """The stages to plan (``jaxzero.gpu.plan.plan_stages``), after refusing offload flags that
    would not act or do not parse, each naming the fix."""
    from jaxzero.gpu.plan import plan_stages
    from jaxzero.zero.offload.fraction import check_fraction

    if args.pcie_gbps is not None and (args.pcie_gbps <= 0 or not args.offload):
        why = "must be a positive GB/s figure" if args.pcie_gbps <= 0 else "needs --offload"
        parser.error(f"--pcie-gbps {args.pcie_gbps:g} {why}")
    if args.offload_fraction != 1 and args.offload != "optimizer":
        parser.error(
            f"--offload-fraction {args.offload_fraction:g} needs --offload optimizer (auto picks "
            "its own fraction; optimizer,params keeps the whole state on the host)"
        )
    if args.offload == "auto" and args.gpu_memory is None:
        print(
            f"note: --offload auto fits the {args.gpu.upper()}'s own memory; pass --gpu-memory "
            "to fit a smaller budget",
            file=sys.stderr,
        )
    try:
        check_fraction(args.offload_fraction, "optimizer", False)
        return plan_stages(args.stage, "optimizer" if args.offload == "auto" else args.offload)
    except ValueError as e:
        parser.error(f"--offload: {e}")
