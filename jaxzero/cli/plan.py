"""``jaxzero plan``: compile the real jaxzero step for a GPU cluster, without a GPU.

Registered as ``COMMAND`` in :mod:`jaxzero.cli`; the library side is :mod:`jaxzero.gpu`. The
command whole: its arguments and their checks, the run, what it prints around the compiled
figures (the table, compact or every column with ``--wide``, the network lines and the notes),
the row it picks with the ``jaxzero.ZeRO(...)`` line that builds it, and what it does with
XLA's log lines and its progress while it compiles.

XLA and absl write their C++ log lines (``W1128 17:04:28.424257 4041
hlo_rematerialization.cc:3231] Can't reduce memory use below ...``) straight to file
descriptor 2, below Python's ``sys.stderr``. Left there, they land in the middle of the table
and break the progress bar, and read as failures. :func:`xla_logs_captured` points descriptor
2 at a temporary file for the compiles and hands back the lines; :func:`log_summary` sums
them up in a few lines (``--verbose`` prints them as they were). The progress goes to the
terminal the command started with: a tqdm bar when both stdout and that stream are
terminals, else one plain line per compile (no carriage returns in a log file).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import textwrap
from collections import Counter

from jaxzero.cli.command import Command, memory_size, param_count, pick, positive_int

DESCRIPTION = """\
Compile jaxzero's Adam train step of a GPT/LLaMA-shaped model for a GPU cluster with XLA's GPU
compiler, on a machine without GPUs (needs jax's CUDA plugin: pip install "jax[cuda12]==0.10.2"),
and print per stage the compiled peak per device, whether it fits in the GPU's memory and the
share of the collectives hidden (--wide: next to jaxzero.estimate_memory's formula, with the
collectives per step), then the row to use as a jaxzero.ZeRO(...) line. Nothing is allocated
or run.

The model: rematerialised decoder layers (LLaMA: RMSNorm, SwiGLU MLP, untied head; GPT:
LayerNorm, GELU MLP, tied head), --batch sequences of --seq tokens per device and micro-batch,
the layers nn.scan'd, or with --loop python a Python loop of blocks (block_0, block_1, ...) as
most Flax code is written, whose stage 3 per layer is ZeRO(units=r"block_\\d+"): one block
gathered at a time ("3 per unit"). GB = 1e9 bytes.

examples:
  jaxzero plan --params 6.7e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 2048 \\
      --batch 1 --gpu h100 --devices 64
  jaxzero plan --params 1.3B --gpu a100 --devices 16 --stage 3 --stage3 per-layer --ema
  jaxzero plan --params 1.3B --devices 8 --stage 2 --stage2 both --xla-flags
  jaxzero plan --model gpt --layers 16 --hidden 2048 --vocab 15872 --seq 512 --devices 8 \\
      --stage 3 --loop python --no-compute-copy
  jaxzero plan --params 6.7e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 2048 \\
      --batch 1 --gpu h100 --devices 8 --stage 3 --stage3 per-layer --offload optimizer
  jaxzero plan --params 6.7e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 2048 \\
      --batch 8 --devices 8 --stage 3 --stage3 per-layer --offload auto --gpu-memory 16GB
  jaxzero plan --params 6.7e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 2048 \\
      --devices 64 --stage 3 --stage3 per-layer --quantize both --grad-bits 4 --hpz 8 \\
      --network-gbps 900 400
"""


def configure(p: argparse.ArgumentParser) -> None:
    """Add ``jaxzero plan``'s arguments to ``p``."""
    size = p.add_argument_group("model shape (give --params, or --layers and --hidden)")
    size.add_argument("--params", type=param_count, metavar="N", help="parameter count, e.g. 6.7e9")
    size.add_argument(
        "--model", choices=["llama", "gpt"], default="llama", help="(default: %(default)s)"
    )
    size.add_argument("--layers", type=positive_int, metavar="L")
    size.add_argument("--hidden", type=positive_int, metavar="H")
    size.add_argument("--heads", type=positive_int, help="attention heads (default: hidden / 128)")
    size.add_argument(
        "--ffn", type=positive_int, help="MLP width (default: LLaMA 8h/3 rounded up to 256, GPT 4h)"
    )
    size.add_argument("--vocab", type=positive_int, default=32000, help="(default: %(default)s)")
    size.add_argument(
        "--seq", type=positive_int, default=2048, help="tokens per sequence (default: %(default)s)"
    )
    size.add_argument(
        "--batch",
        type=positive_int,
        default=1,
        help="sequences per device and micro-batch (default: %(default)s)",
    )
    add_loop(size)
    size.add_argument(
        "--attention",
        choices=["auto", "xla"],
        default="auto",
        help="auto: cuDNN flash attention for bf16/fp16, XLA's for fp32; xla: XLA's reference "
        "attention, which holds the seq x seq scores (default: %(default)s)",
    )
    train = p.add_argument_group("training and cluster")
    train.add_argument(
        "--stage",
        type=int,
        choices=[0, 1, 2, 3],
        action="append",
        help="ZeRO stage (repeatable; default: all four)",
    )
    add_per_layer_choices(train)
    train.add_argument(
        "--precision",
        choices=["bf16", "fp16", "fp32"],
        default="bf16",
        help="(default: %(default)s)",
    )
    train.add_argument(
        "--accum",
        type=positive_int,
        default=1,
        help="gradient accumulation micro-batches (default: 1)",
    )
    train.add_argument("--ema", action="store_true", help="add a sharded fp32 parameter EMA")
    train.add_argument(
        "--state-dtype",
        choices=["bf16", "fp16"],
        help="store Adam's moments in 2 bytes each, the math in fp32 (jaxzero.with_state_dtype; "
        "opt-in, not exact): 4 bytes per parameter less on the device, or in host memory and "
        "each way over PCIe with --offload (default: fp32)",
    )
    add_state_layout(train)
    add_pcie(train)
    train.add_argument(
        "--vocab-parallel",
        action="store_true",
        help="gpt: stage 3 keeps the tied embedding as each device's vocabulary rows "
        "(jaxzero.ZeRO(vocab_parallel=...), jaxzero.VocabParallelEmbed)",
    )
    train.add_argument(
        "--gpu", choices=["h100", "a100", "h200"], default="h100", help="(default: %(default)s)"
    )
    train.add_argument(
        "--devices", type=positive_int, required=True, metavar="N", help="GPUs in the cluster"
    )
    train.add_argument(
        "--replicas", type=positive_int, default=1, help="HSDP replica groups (default: 1)"
    )
    add_wire(train)
    train.add_argument(
        "--xla-flags",
        action="store_true",
        help="compile with jaxzero's recommended XLA GPU flags (jaxzero.gpu.recommended_xla_flags; "
        "what jaxzero.distributed.initialize applies on GPUs) instead of XLA's defaults",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--wide",
        action="store_true",
        help="every column (the formula estimate, state, host estimate, kernels, PCIe bytes, "
        "collectives) and the long notes, instead of the table that fits 100 columns",
    )
    out.add_argument(
        "--leaves",
        action="store_true",
        help="after the table, the picked configuration's per-leaf plan (ZeRO.plan): every "
        "params leaf's gather, reduction, accumulation, memory, wire, EMA storage and bytes "
        "per device (every row's plan when none fits)",
    )
    out.add_argument(
        "--verbose",
        action="store_true",
        help="print the log lines XLA wrote during the compiles (by default captured and "
        "summed up in a few lines after the table; all of them when a compile fails; a process "
        "XLA aborts leaves them in $TMPDIR/jaxzero-plan-xla-*.log)",
    )


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
        choices=["optimizer", "optimizer,remainder", "optimizer,params", "auto"],
        help="keep the fp32 master, Adam's state and the EMA in pinned host memory, streamed "
        "through the GPU by the update (jaxzero.ZeRO(offload='optimizer'); stages 1-3, the "
        "default then); optimizer,remainder: that with the fp32 master kept as a 16-bit "
        "remainder and a carry bit beside the bf16 params, 2.125 bytes per param instead of 4 "
        "in host memory and each way over PCIe (offload=('optimizer', 'remainder'); --precision "
        "bf16); optimizer,params: the bf16 params too, fetched a layer at a time, "
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
        "--offload-update",
        choices=["exact", "deferred", "delayed"],
        default="exact",
        help="with --offload optimizer at --stage3 per-layer: deferred runs each layer's "
        "update inside the next step's forward, beside the layer before's compute, from the "
        "state packed one row per layer (jaxzero.ZeRO(offload_update='deferred'), the same "
        "numbers); delayed also takes that step's gradient before the update, so no gather "
        "waits for it (ZeRO-Offload's delayed parameter update, "
        "jaxzero.ZeRO(offload_update='delayed'), not exact); the row is compiled as a step "
        "with an update pending (default: exact, the update after the backward)",
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
    group.add_argument(
        "--nvme-gbps",
        type=float,
        nargs=2,
        metavar=("READ", "WRITE"),
        help="with --offload optimizer, the state on an NVMe disk per node read and written at "
        "these GB/s (jaxzero.ZeRO(offload=jaxzero.NVMe(path)); benchmarks/nvme.py measures "
        "them): prints each row's disk bytes per node per step (every GPU's offloaded state "
        "on the node, --gpus-per-node, read once and written once), the disk time (read time + "
        "write time: one disk serves both), the step (compute + the slower of the disk and the "
        "exposed PCIe copies) and ZeRO-Infinity's efficiency with the disk's rate",
    )


def _shape(args, parser):
    from jaxzero.gpu.models import model_shape
    from jaxzero.gpu.plan import UNITS, check_hpz, check_loop
    from jaxzero.zero.offload.placement import check_offload, check_params, params_offloaded

    if args.params is None and (args.layers is None or args.hidden is None):
        parser.error("give --params, or --layers and --hidden (and optionally --heads)")
    try:
        dims = pick(args, "params", "layers", "hidden", "heads", "vocab", "seq", "batch")
        shape = model_shape(
            **dims,
            arch=args.model,
            ffn=args.ffn or 0,
            attention=args.attention,
            vocab_parallel=args.vocab_parallel,
            loop="python" if args.loop == "python" else "prefetch",
        )
        check_loop(shape, args.stage2, args.stage1)
        chosen = "optimizer" if args.offload == "auto" else args.offload  # auto: a fraction of it
        offload = check_offload(chosen, 3) if args.offload else None
        if args.loop == "python" and args.prefetch in ("off", "both"):  # units=, prefetch=False
            check_params(offload, None, UNITS, True, True, False, prefetch=False)
    except ValueError as e:
        parser.error(str(e))
    try:
        check_hpz(args.hpz, shape, args.stage, args.stage3, args.devices, args.replicas)
    except ValueError as e:
        parser.error(f"--{e}")
    if args.grad_bits is not None and args.quantize not in ("grads", "both"):
        parser.error(
            f"--grad-bits {args.grad_bits} sets the width of quantized gradients; add "
            f"--quantize both (int8 weights, DeepSpeed's ZeRO++) or --quantize grads"
        )
    per_unit = args.loop == "python" and args.stage3 != "whole" and 3 in (args.stage or [3])
    if args.prefetch not in (None, "on") and not per_unit:
        parser.error(
            f"--prefetch {args.prefetch} needs a per-unit stage 3 row: --loop python with "
            "--stage3 per-layer or both (a scanned stack always prefetches the next layer)"
        )
    both = per_unit and not params_offloaded(offload)  # the params offload needs prefetch
    args.prefetch = args.prefetch or ("both" if both else "on")
    if args.devices % args.replicas:
        parser.error(f"--replicas {args.replicas} must divide --devices {args.devices}")
    return shape


def check_offload_args(args: argparse.Namespace, parser):
    """The stages to plan (``jaxzero.gpu.plan.plan_stages``), after refusing offload flags that
    would not act or do not parse, each naming the fix."""
    from jaxzero.gpu.plan import plan_stages
    from jaxzero.zero.offload.fraction import check_fraction

    if args.pcie_gbps is not None and (args.pcie_gbps <= 0 or not args.offload):
        why = "must be a positive GB/s figure" if args.pcie_gbps <= 0 else "needs --offload"
        parser.error(f"--pcie-gbps {args.pcie_gbps:g} {why}")
    if args.nvme_gbps is not None and args.offload != "optimizer":
        parser.error(
            f"--nvme-gbps pages the optimizer state to disk: add --offload optimizer "
            f"(got --offload {args.offload or 'none'})"
        )
    if args.nvme_gbps is not None and min(args.nvme_gbps) <= 0:
        rates = " ".join(f"{x:g}" for x in args.nvme_gbps)
        parser.error(f"--nvme-gbps {rates}: the read and write rates must be positive GB/s")
    if args.offload_fraction != 1 and args.offload != "optimizer":
        parser.error(
            f"--offload-fraction {args.offload_fraction:g} needs --offload optimizer (auto picks "
            "its own fraction; optimizer,params and optimizer,remainder keep the whole state "
            "on the host)"
        )
    if args.offload == "optimizer,remainder" and (
        args.precision != "bf16" or not args.compute_copy
    ):
        why = f"--precision {args.precision}" if args.precision != "bf16" else "--no-compute-copy"
        parser.error(
            f"--offload optimizer,remainder with {why}: the remainder is the fp32 master's low "
            "half beside its bf16 params; use --precision bf16 without --no-compute-copy, or "
            "--offload optimizer"
        )
    if args.offload == "optimizer,params" and args.stage3 != "per-layer":
        parser.error(
            f"--offload optimizer,params with --stage3 {args.stage3}: the params stay in host "
            "memory only where stage 3 fetches them a layer (or unit) at a time; the whole "
            "stage-3 row gathers every param at once. Add --stage3 per-layer"
        )
    if args.offload_update != "exact" and (
        args.offload != "optimizer"
        or args.offload_fraction != 1
        or args.stage3 == "whole"
        or args.loop != "scan"
        or args.precision == "fp32"
        or not args.compute_copy
    ):
        parser.error(
            f"--offload-update {args.offload_update} runs the update of the fp32 master inside "
            "the forward's layer loop: it needs --offload optimizer (the whole state, no "
            "--offload-fraction), a scanned stack (--loop scan), its per-layer stage-3 row "
            "(--stage3 per-layer or both) and a master apart from the params (--precision bf16 "
            "or fp16, without --no-compute-copy)"
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


def _describe(args, shape, recommended_xla_flags) -> str:
    """The plan's first line: the model, the cluster and the options."""
    from jaxzero.memory import format_bytes

    return (
        f"{args.model}: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, ffn "
        f"{shape.ffn}, vocab {shape.vocab}, {shape.batch} x {shape.seq} tokens per device -> "
        f"{shape.num_params:,} params"
        + (", a Python loop of blocks" if args.loop == "python" else "")
        + f"; {args.devices} x {args.gpu.upper()}"
        + (f" ({args.replicas} replicas)" if args.replicas > 1 else "")
        + f", {args.precision}, Adam"
        + (f" with {args.state_dtype} moments" if args.state_dtype else "")
        + f", accum {args.accum}"
        + (", EMA" if args.ema else "")
        + ("" if args.compute_copy else ", stage 3 without a compute copy")
        + (", stage 3 vocabulary-parallel embedding" if args.vocab_parallel else "")
        + (f", offload {offload_words(args)} to {_offload_target(args)}" if args.offload else "")
        + (f", {format_bytes(args.gpu_memory)} per GPU" if args.gpu_memory else "")
        + (f", {_wire_words(args)} on the wire" if args.quantize else "")
        + (f", hpZ in groups of {args.hpz}" if args.hpz else "")
        + (
            f"; XLA flags {' '.join(recommended_xla_flags(quantized_grads=_qgz(args)))}"
            if args.xla_flags
            else ""
        )
    )


def _wire_words(args) -> str:
    """``--quantize`` (and ``--grad-bits``) as the description line says it."""
    if args.grad_bits != 4:
        return f"int8 {args.quantize}"
    return "int8 weights and int4 grads" if args.quantize == "both" else "int4 grads"


def offload_words(args) -> str:
    """``--offload``'s choice as the description line says it."""
    if args.offload == "auto":
        return "the smallest fraction of the optimizer that fits"
    if args.offload == "optimizer,remainder":
        return "the optimizer (the fp32 master as a 16-bit remainder and a carry bit)"
    share = f" ({args.offload_fraction:g} of it)" if args.offload_fraction != 1 else ""
    return " and ".join(args.offload.split(",")) + share


def _quantize(args):
    """What the plan's ``ZeRO(quantize=)`` gets (:func:`plan_zero`): ``--quantize``'s name, or
    with ``--grad-bits 4`` the :class:`~jaxzero.Wire` of those widths."""
    if args.grad_bits != 4:
        return args.quantize
    from jaxzero.zero.wire import Wire

    return Wire.create(weights=8 if args.quantize == "both" else None, grads=4)


def _qgz(args) -> bool:
    """Whether the plan's wire defers the gradient reduction (quantized gradients: the
    recommended flags then add one)."""
    from jaxzero.zero.wire import wire

    return wire(_quantize(args)).defers_reduce


def plan_zero(args: argparse.Namespace):
    """The ``ZeRO`` the flags describe, for :func:`jaxzero.gpu.plan`: Adam (its state in
    ``--state-dtype``) on a compile-only mesh of ``--devices`` GPUs of ``--gpu`` (``--replicas``,
    ``--gpu-memory``), at stage 3 with the model's layer stack (``--loop python``: its blocks,
    ``--prefetch``) and every option, each of which the plan applies where it acts."""
    from jaxzero.gpu.plan import UNITS, plan_tx
    from jaxzero.gpu.topology import compile_only_mesh
    from jaxzero.precision import Precision
    from jaxzero.train.optimizer import ZeRO

    mesh = compile_only_mesh(
        args.gpu, args.devices, replicas=args.replicas, memory_bytes=args.gpu_memory
    )
    units = args.loop == "python"
    offload = "optimizer" if args.offload == "auto" else args.offload
    return ZeRO(
        plan_tx(args.state_dtype),
        mesh,
        stage=3,
        precision=Precision.create(args.precision, compute_copy=args.compute_copy),
        layers=None if units else "layers",
        units=UNITS if units else None,
        prefetch=args.prefetch != "off" if units else None,
        vocab_parallel="embed" if args.vocab_parallel else None,
        offload=offload,
        offload_fraction=args.offload_fraction,
        quantize=_quantize(args),
        hpz_partition_size=args.hpz,
        offload_update=None if args.offload_update == "exact" else args.offload_update,
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Compile every requested stage and print the table; returns the exit code."""
    shape = _shape(args, parser)
    from jaxzero.gpu import PluginMissingError, plan, plan_cases, recommended_xla_flags, xla_options

    if args.params is not None and abs(shape.num_params - args.params) > 0.1 * args.params:
        print(
            f"note: the {args.model} shape has {shape.num_params:,} parameters, not "
            f"{args.params:,}; planning the shape",
            file=sys.stderr,
        )
    print(_describe(args, shape, recommended_xla_flags), flush=True)
    stages = check_offload_args(args, parser)
    if args.network_gbps and min(args.network_gbps) <= 0:
        parser.error(f"--network-gbps: {args.network_gbps} must be two positive Gbit/s figures")
    cases = plan_cases(stages, args.stage3, args.stage2, args.stage1)
    both = args.prefetch == "both" and (3, True) in cases  # the per-unit row twice
    flags = xla_options(quantized_grads=_qgz(args)) if args.xla_flags else None
    logs = None
    try:
        with xla_logs_captured() as logs:  # XLA's C++ log lines: summed up after the table
            on_case, close = progress(len(cases) + both, logs.stream)
            try:
                zero = plan_zero(args)
                rows = plan(
                    zero,
                    shape,
                    cases=cases,
                    both_prefetch=args.prefetch == "both",
                    fit_offload=args.offload == "auto",
                    on_case=on_case,
                    compiler_options=flags,
                    **pick(args, "accum", "ema", "gpu_memory", "pcie_gbps"),
                )
            finally:
                close()
    except PluginMissingError as e:
        _print_logs(logs.lines, args.verbose)
        print(f"jaxzero plan: error: {e}", file=sys.stderr)
        return 1
    except BaseException:  # a failed compile: XLA's lines as written, they may say why
        if logs is not None:
            _print_logs(logs.lines, True)
        raise
    _print_tables(rows, args)
    if args.leaves:
        _print_leaves(rows, zero, shape, args)
    _print_logs(logs.lines, args.verbose)
    return 0


def _print_leaves(rows, zero, shape, args) -> None:
    """The per-leaf plan (:meth:`jaxzero.ZeRO.plan`) of the picked row, or of every row when
    none fits: the same ``ZeRO`` options the row was compiled with, on the model's abstract
    params (nothing allocated)."""
    from jaxzero.ema import ShardedEMA
    from jaxzero.gpu.models import abstract_params
    from jaxzero.train.optimizer import ZeRO

    pick = chosen(rows)
    params = abstract_params(shape)
    ema = ShardedEMA(0.999) if args.ema else None
    for row in [pick] if pick is not None else rows:
        leaves = ZeRO(zero.tx, zero.mesh, **row.zero_options)
        print(f"\nper-leaf plan of {row.label} (ZeRO.plan):")
        print(leaves.plan(params, accum_steps=args.accum, ema=ema), flush=True)


def _print_tables(rows, args) -> None:
    """The table (compact, or every column with ``--wide``), the network lines and the notes,
    then the pick and its ``ZeRO(...)`` line."""
    from jaxzero.gpu.plan import prefetch_advice

    fractions = args.offload == "auto" or args.offload_fraction != 1
    shards = args.devices // args.replicas  # the devices each row's state is sharded over
    if args.wide:
        text = table(rows, fractions, shards=shards)
    else:
        text = compact_table(rows, fractions, shards=shards)
    print(text)
    if args.network_gbps or args.hpz:
        print(network(rows, args))
    if args.nvme_gbps:
        print(nvme(rows, args))
    notes = [fallback_note(rows), prefetch_advice(rows)]
    if args.wide:
        notes += [offload_note(rows), fraction_note(rows), formula_note(rows), WIDE_LEGEND]
    else:
        notes += [tries_note(rows), legend(rows, shards=shards, in_cells="B/param" in text)]
    for note in notes:
        if note:
            print(note)
    print(pick_note(rows, args), flush=True)


def _print_logs(lines, verbose: bool) -> None:
    """XLA's captured log lines: all of them with ``--verbose``, else their summary."""
    if not lines:
        return
    if verbose:
        print("XLA's log lines during the compiles:", file=sys.stderr)
        print("\n".join(lines), file=sys.stderr, flush=True)
    else:
        print("\n".join(log_summary(lines)), file=sys.stderr, flush=True)


WIDE_LEGEND = (
    "GPU-compiled: the compiled step's peak per device, arguments + outputs - donated aliases + "
    "temporaries (XLA:GPU memory_analysis), which the verdict judges; formula est.: "
    "jaxzero.estimate_memory with activations (ckpt_every=1) and f32 logits (stage 3: the whole "
    "model gathered; per layer: one layer with its gradient; per unit: that, the next unit's "
    "weights and, with prefetch, the last unit's, jaxzero.gpu.plan.unit_bound), every buffer "
    "counted as live at once: a bound to check the compile against, not the verdict's; state: "
    "persistent arguments less the batch; host (with --offload): the same sum in pinned host "
    "memory, next to the formula's (host est.); hidden: the share of collective bytes per step "
    "whose start and done the GPU schedule separates by a gemm/conv/attention kernel "
    "(jaxzero.gpu.overlap), of max the share any schedule of the step's data flow could hide; "
    "kernels: device launches per step."
)


WIDTH = 100  # the compact table and its notes fit a terminal this wide


def hidden(report) -> str:
    """The hidden share of all-gather + reduce-scatter bytes and its ceiling (what any schedule
    of the step's data flow could hide), or "-" when neither moves any (stage 0 only
    all-reduces)."""
    if not report.payload("all-gather") + report.payload("reduce-scatter"):
        return "-"
    kinds = ("all-gather", "reduce-scatter", "all-to-all")  # all-to-all: quantized gradients
    return f"{report.hidden_share(*kinds):.0%} of max {report.hideable_share(*kinds):.0%}"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _time(seconds: float) -> str:
    """Seconds from one up (``24.26 s``), milliseconds below (:func:`_ms`)."""
    return f"{seconds:.2f} s" if seconds >= 1 else _ms(seconds)


def per_param(nbytes: int, params: float) -> str:
    """``nbytes`` per GPU and the same over ``params``, the model's parameters per GPU:
    ``"10.11 GB (12.0 B/param)"``; just the bytes where there are none."""
    from jaxzero.memory import format_bytes

    if not nbytes:
        return format_bytes(nbytes)
    return f"{format_bytes(nbytes)} ({nbytes / params:.1f} B/param)"


def _cost_cells(cost, params: float) -> list[str]:
    """The offload columns of one row: host->device and device->host bytes per step (each
    with its bytes per parameter, over the model's ``params`` per GPU), their hidden share,
    the predicted step (compute + exposed transfer), its ratio to the compute alone, and
    ZeRO-Infinity's efficiency (:mod:`jaxzero.gpu.offload_cost`)."""
    if cost is None:
        return ["-"] * 6
    return [
        per_param(cost.h2d_bytes, params),
        per_param(cost.d2h_bytes, params),
        f"{cost.hidden_share:.0%}",
        _ms(cost.step_seconds),
        f"{cost.slowdown:.2f}x",
        f"{cost.formula_efficiency:.0%}",
    ]


def offload_note(rows) -> str | None:
    """What the offload columns assume, or None without them."""
    from jaxzero.gpu.offload_cost import MFU

    cost = next((r.cost for r in rows if r.cost is not None), None)
    if cost is None:
        return None
    return (
        f"PCIe: host->device (h2d) and device->host (d2h) bytes per GPU per step read from "
        f"the compiled HLO (copy-start/done and async slices to or from host memory, loop trip "
        f"counts applied; jaxzero.gpu.transfers), and B/param: those bytes over the model's "
        f"parameters per GPU (params / the devices the state is sharded over; 12 for the fp32 "
        f"master and Adam's two moments, each way); hidden: the share a compute kernel overlaps "
        f"in the schedule; step: compute ({cost.flops:.3g} FLOP = 8 x params x tokens per GPU "
        f"at {MFU:.0%} of the bf16 peak: {_ms(cost.compute_seconds)}) + the exposed "
        f"bytes at {cost.gbps:g} GB/s (--pcie-gbps); x compute: step over the compute alone, "
        f"the step without offload in this model; ZI eff.: ZeRO-Infinity's "
        f"ait*bw/(ait*bw+peak), ait = FLOP per byte of the offloaded state moved twice "
        f"({cost.ait:.0f} FLOP/B), nothing overlapped."
    )


def _fraction(f) -> str:
    return "none" if f is None else f if isinstance(f, str) else f"{f:g}"


def _format(header: list[str], body: list[list[str]], last_free: bool) -> str:
    """Columns two spaces apart, a rule under the header; ``last_free``: the last column is
    not padded (the wide table's collectives)."""
    n = len(header) - last_free
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(n)]
    rule = ["-" * w for w in widths] + (["-" * 20] if last_free else [])
    fmt = lambda cells: "  ".join(
        [c.ljust(w) for c, w in zip(cells[:n], widths, strict=True)] + cells[n:]
    ).rstrip()
    return "\n".join([fmt(header), fmt(rule)] + [fmt(b) for b in body])


def short_verdict(report) -> str:
    """The compact table's verdict: ``"fits, 2.35 GB spare"``, ``"short by 17.79 MB"`` (the
    memory it is judged against is said once, in the legend)."""
    from jaxzero.memory import format_bytes

    if report.fits is None:
        return f"needs {format_bytes(report.peak_bytes)}"
    if report.fits:
        return f"fits, {format_bytes(report.headroom_bytes)} spare"
    return f"short by {format_bytes(-report.headroom_bytes)}"


def _step(cost) -> str:
    return "-" if cost is None else f"{_ms(cost.step_seconds)}, {cost.slowdown:.2f}x"


def _columns(rows, fractions: bool, shards: int | None) -> list[tuple[str, list[str]]]:
    """The compact table's columns, ``(header, cells)``, most important first; ``shards``:
    the devices each row's state is sharded over, for the host cell's bytes per parameter
    (None: the bytes alone)."""
    from jaxzero.memory import format_bytes

    cols = [("stage", [r.label for r in rows])]
    if fractions:
        cells = [_fraction(r.fraction) + (" + params" * r.params_offloaded) for r in rows]
        cols.append(("offloaded", cells))
    cols.append(("GPU peak", [format_bytes(r.gpu_bytes) for r in rows]))
    cols.append(("verdict", [short_verdict(r.report) for r in rows]))
    cost = [r.cost for r in rows if r.cost is not None]
    if cost:
        cols.append((f"step @{cost[0].gbps:g} GB/s", [_step(r.cost) for r in rows]))
    if any(r.report.host_bytes for r in rows):
        if shards is None:
            host = [format_bytes(r.report.host_bytes) for r in rows]
        else:
            host = [per_param(r.report.host_bytes, r.num_params / shards) for r in rows]
        cols.append(("host", host))
    cols.append(("hidden AG+RS", [hidden(r.report) for r in rows]))
    return cols


def compact_table(rows, fractions: bool = False, width: int = WIDTH, *, shards: int) -> str:
    """The default table: stage, offloaded share (``fractions``), the compiled peak, the
    verdict, with offload the predicted step and the host bytes (with their bytes per
    parameter, over the model's parameters per each of the ``shards`` devices the state is
    sharded over), and the hidden AG+RS share. Where a line would be wider than ``width``
    the host cell gives up its bytes per parameter (:func:`legend` says them then), and
    then the last columns are dropped while it still is."""
    for per in (shards, None):
        cols = _columns(rows, fractions, per)
        count = len(cols)
        while True:
            body = [[cells[i] for _, cells in cols] for i in range(len(rows))]
            text = _format([h for h, _ in cols], body, False)
            if len(cols) <= 3 or max(map(len, text.splitlines())) <= width:
                break
            cols.pop()
        if len(cols) == count:
            return text
    return text


def legend(rows, wrap: int = WIDTH, *, shards: int, in_cells: bool = True) -> str:
    """What the compact table's columns are, wrapped to ``wrap`` columns; ``shards``: the
    devices each row's state is sharded over; ``in_cells``: the host cells carry their bytes
    per parameter (else the legend says them, row by row)."""
    from jaxzero.memory import format_bytes

    memory = rows[0].report.hbm_bytes
    judged = f"against {format_bytes(memory)} per GPU" if memory else "(no GPU memory given)"
    text = (
        f"GPU peak: the compiled step's peak bytes per GPU (XLA:GPU), which the verdict judges "
        f"{judged}."
    )
    cost = next((r.cost for r in rows if r.cost is not None), None)
    if cost is not None:
        text += (
            f" step: the compute plus the PCIe transfers left exposed at {cost.gbps:g} GB/s, and "
            "its ratio to the compute alone. host: pinned host bytes per GPU"
        )
        per_gpu = "the model's parameters per GPU (params / the devices the state is sharded "
        per_gpu += "over; 12 for the fp32 master and Adam's two moments)"
        if in_cells:
            text += f", and B/param: those bytes over {per_gpu}."
        else:
            said = [
                f"{r.label} {r.report.host_bytes / (r.num_params / shards):.1f} B/param"
                for r in rows
                if r.report.host_bytes
            ]
            text += f"; over {per_gpu}: {', '.join(said)}."
    text += (
        " hidden AG+RS: the share of all-gather + reduce-scatter bytes the schedule hides "
        "behind compute, of the most any schedule could. --wide: every column (the formula "
        "estimate, state, kernels, PCIe bytes, collectives) and its notes."
    )
    return textwrap.fill(text, wrap, break_on_hyphens=False)


def table(rows, fractions: bool = False, *, shards: int) -> str:
    """The ``--wide`` table, every column; ``fractions``: a column of each row's offload
    fraction (``--offload auto`` or ``--offload-fraction``); ``shards``: the devices each
    row's state is sharded over (the PCIe cells' bytes per parameter)."""
    from jaxzero.memory import format_bytes

    header = ["stage", "GPU-compiled", "formula est.", "state", "verdict", "hidden AG+RS"]
    header.append("kernels")
    host = any(r.report.host_bytes or r.estimate.host for r in rows)
    header[4:4] = ["host", "host est."] if host else []
    header[1:1] = ["offloaded"] if fractions else []
    cost = [r.cost for r in rows if r.cost is not None]
    if cost:
        header += [
            "PCIe h2d",
            "PCIe d2h",
            "PCIe hidden",
            f"step @{cost[0].gbps:g} GB/s",
            "x compute",
            "ZI eff.",
        ]
    header.append("collectives per step (hidden share)")
    body = [
        [
            r.label,
            *([_fraction(r.fraction) + (" + params" * r.params_offloaded)] if fractions else []),
            format_bytes(r.gpu_bytes),
            format_bytes(r.estimate.total),
            format_bytes(r.state_bytes),
            *([format_bytes(r.report.host_bytes), format_bytes(r.estimate.host)] if host else []),
            r.verdict,
            hidden(r.report),
            str(r.report.kernels_per_step),
            *(_cost_cells(r.cost, r.num_params / shards) if cost else []),
            f"{r.report.collective_summary()} ({r.report.overlap_summary()})",
        ]
        for r in rows
    ]
    return _format(header, body, True)


def formula_note(rows) -> str | None:
    """Where the formula estimate and the verdict disagree (the formula over the GPU's memory
    on a row that fits, or under it on a row that does not), why; None where they agree."""
    from jaxzero.memory import format_bytes

    odd = [
        r
        for r in rows
        if r.report.fits is not None and (r.estimate.total <= r.report.hbm_bytes) != r.report.fits
    ]
    if not odd:
        return None
    said = "; ".join(
        f"{r.label} {'fits' if r.report.fits else 'is short'} at a compiled peak of "
        f"{format_bytes(r.gpu_bytes)} where the formula says {format_bytes(r.estimate.total)}"
        for r in odd
    )
    return (
        f"formula est. against the verdict: {said}. The verdict judges the compiled peak, never "
        "the formula: the formula adds every buffer the step holds as if all were live at once "
        "(all activations, the f32 logits, the gathered weights), where XLA frees and reuses "
        "them, and it leaves out XLA's own temporaries."
    )


def network(rows, args) -> str:
    """Each row's collective bytes per device per step and the share of them that crosses
    nodes (:func:`jaxzero.gpu.hlo.cross_node_bytes`), with ``--network-gbps`` the time each
    takes (``wire_time``, ``cross_node_time``)."""
    from jaxzero.gpu.hlo import cross_node_bytes
    from jaxzero.gpu.network import COLLECTIVES, cross_node_time, wire_time
    from jaxzero.memory import format_bytes

    node, n, gbps = args.gpus_per_node, args.devices // args.replicas, args.network_gbps
    speeds = f", {gbps[0]:g} Gbit/s intra-node, {gbps[1]:g} Gbit/s inter-node" if gbps else ""
    lines = [
        f"network ({node} GPUs per node{speeds}): collective bytes per device per step, and "
        "the bytes of the collectives whose groups span nodes (cross-node)"
        + (
            ", each with the time it takes on the ring's slowest link, overlap not counted"
            if gbps
            else ""
        )
    ]
    width = max(len(r.label) for r in rows)
    for r in rows:
        if gbps:
            t = wire_time(r.report, args.devices, *gbps, node)
            c = cross_node_time(r.report, n, gbps[1], node)
            row = f"{format_bytes(t.bytes):>10}  {t.seconds * 1e3:9.1f} ms ({t.link})"
            row += f"  cross-node {format_bytes(c.bytes):>10}  {c.seconds * 1e3:9.1f} ms"
        else:
            total = sum(r.report.payload(kind) for kind in COLLECTIVES)
            cross = cross_node_bytes(r.report.hlo_text, node, n)
            row = f"{format_bytes(total):>10}  cross-node {format_bytes(cross):>10}"
        lines.append(f"  {r.label:<{width}} {row}")
    return "\n".join(lines)


def _offload_target(args) -> str:
    """Where the header says the offloaded state lives: pinned host memory, or with
    ``--nvme-gbps`` the optimizer state in a file on NVMe, paged through host buffers."""
    if getattr(args, "nvme_gbps", None):
        read, write = args.nvme_gbps
        return f"NVMe ({read:g} GB/s read, {write:g} GB/s write), paged through pinned host memory"
    return "pinned host memory"


def nvme(rows, args, wrap: int = WIDTH) -> str:
    """Each row's NVMe tier (``--nvme-gbps``): the bytes the node's disk reads and writes per
    step, its read and write time, the step with the disk in it, the step's ratio to the
    compute alone and ZeRO-Infinity's efficiency (:class:`jaxzero.gpu.offload_cost.DiskCost`),
    under a note of the model wrapped to ``wrap`` columns."""
    from jaxzero.gpu.offload_cost import disk_cost
    from jaxzero.memory import format_bytes

    read, write = args.nvme_gbps
    gpus = min(args.gpus_per_node, args.devices)
    note = (
        f"NVMe, {read:g} GB/s read and {write:g} GB/s write per node, one disk shared by "
        f"{gpus} GPUs (--gpus-per-node): the disk reads and writes every GPU's offloaded state "
        "once per step (disk/node: bytes each way); disk: read + write, as one disk serves "
        "both (the swapper's pass overlaps them with the update, not with each other); step: "
        "compute + the slower of the disk and the exposed PCIe copies; ZI eff.: "
        "ZeRO-Infinity's ait*bw/(ait*bw+peak), bw the disk's rate per GPU, = compute / "
        "(compute + disk)."
    )
    header = ["stage", "disk/node", "read", "write", "disk", "compute", "step", "x compute"]
    header.append("ZI eff.")
    body = []
    for r in rows:
        if r.cost is None:
            body.append([r.label] + ["-"] * (len(header) - 1))
            continue
        d = disk_cost(r.cost, read, write, gpus)
        body.append(
            [
                r.label,
                format_bytes(d.bytes),
                _time(d.read_seconds),
                _time(d.write_seconds),
                _time(d.seconds),
                _time(r.cost.compute_seconds),
                _time(d.step_seconds),
                f"{d.slowdown:.2f}x",
                f"{d.efficiency:.1%}",
            ]
        )
    return textwrap.fill(note, wrap, break_on_hyphens=False) + "\n" + _format(header, body, False)


def fallback_note(rows) -> str | None:
    """A line naming the stages compiled without Triton gemms (``CompileReport
    .triton_gemm_fallback``) and why, or None when every stage compiled as asked."""
    hit = [r for r in rows if r.report.triton_gemm_fallback]
    if not hit:
        return None
    return (
        f"without Triton gemms (stage {', '.join(r.label for r in hit)}): XLA:GPU's Triton gemm "
        f"emitter failed ({hit[0].report.triton_gemm_fallback}), so the step was compiled "
        "again with xla_gpu_enable_triton_gemm=False (gemms by cuBLAS); the figures are that "
        "compile's."
    )


def fraction_note(rows) -> str | None:
    """``--offload auto``'s compiles, each fraction tried with its peak, or None."""
    from jaxzero.memory import format_bytes

    tried = [(r.label, r.tries) for r in rows if r.tries]
    if not tried:
        return None
    one = lambda t: "; ".join(f"{_fraction(f)}: {format_bytes(p)}, {h:.0%}" for f, p, h in t)
    lines = [f"{label}: {one(t)}" for label, t in tried]
    return (
        "offloaded: the share of the master, Adam and EMA bytes per GPU in host memory "
        "(ZeRO(offload_fraction=...)), largest leaves first; auto compiled everything offloaded, "
        "then the fraction where the device takes the rest byte for byte, rounded up to 0.01, "
        "bisected towards 1 where it hides less of the AG+RS bytes, and where all of it does not "
        "fit, the params too (1 + params: ZeRO(offload=('optimizer', 'params')); "
        "jaxzero.gpu.offload_fraction; "
        "per fraction tried: compiled peak, hidden AG+RS: " + " | ".join(lines) + ")."
    )


def tries_note(rows, wrap: int = WIDTH) -> str | None:
    """``--offload auto``'s compiles in short, each fraction tried with its peak and hidden
    share, wrapped to ``wrap`` columns (``--wide``: :func:`fraction_note`); None without."""
    from jaxzero.memory import format_bytes

    tried = [(r.label, r.tries) for r in rows if r.tries]
    if not tried:
        return None
    one = lambda t: "; ".join(f"{_fraction(f)} -> {format_bytes(p)} ({h:.0%})" for f, p, h in t)
    width = max(len(label) for label, _ in tried)
    lines = ["auto's compiles per stage: offloaded share -> GPU peak (hidden AG+RS)"]
    for label, t in tried:
        lines += textwrap.wrap(
            f"{label + ':':<{width + 1}}  {one(t)}",
            wrap,
            initial_indent="  ",
            subsequent_indent=" " * (width + 5),
        )
    return "\n".join(lines)


_DEFAULTS = {
    "layers": None,
    "units": None,
    "vocab_parallel": None,
    "offload": None,
    "offload_fraction": 1.0,
    "prefetch": None,
    "quantize": None,
    "hpz_partition_size": None,
    "offload_update": None,
}
_KINDS = ("all-gather", "reduce-scatter", "all-to-all")


def chosen(rows):
    """The row to use, or None when none fits: the row that fits with the shortest predicted
    step (offload's exposed PCIe time; a row without offload has none), then the lowest stage
    (the least sharding that fits), then the most all-gather + reduce-scatter bytes hidden."""
    fit = [r for r in rows if r.report.fits is not False]
    if not fit:
        return None
    step = lambda r: 0.0 if r.cost is None else r.cost.step_seconds
    return min(fit, key=lambda r: (step(r), r.stage, -r.report.hidden_share(*_KINDS)))


def _source(value) -> str:
    """``value`` as Python source, with ``jz.`` for jaxzero's own types."""
    from jaxzero.precision import Precision
    from jaxzero.zero.wire import Blockwise, Wire

    if isinstance(value, Precision):
        import jax.numpy as jnp

        names = {jnp.dtype(jnp.float32): "fp32", jnp.dtype(jnp.bfloat16): "bf16"}
        name = names.get(jnp.dtype(value.param_dtype), "fp16")
        if value == Precision.create(name):
            return f'"{name}"'
        return f'jz.Precision.create("{name}", compute_copy={value.compute_copy})'
    if isinstance(value, Wire):
        bits = lambda c: c.bits if isinstance(c, Blockwise) else None
        hpz = f", hpz={value.hpz}" if value.hpz else ""
        return f"jz.Wire.create(weights={bits(value.weights)}, grads={bits(value.grads)}{hpz})"
    if isinstance(value, str):
        return f'r"{value}"' if "\\" in value and '"' not in value else f'"{value}"'
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_source, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


#: the directory the paste names for the NVMe tier's file (``--nvme-gbps``)
NVME_DIR = "/nvme/run"


def paste(row, width: int = 100, indent: str = "  ", nvme: bool = False) -> str:
    """``zero = jz.ZeRO(tx, mesh, stage=..., ...)`` for ``row``: its ``zero_options`` (the
    keyword arguments its step was compiled with, :func:`jaxzero.gpu.plan.zero_options`) less
    ZeRO's defaults, as Python, on one line when it fits ``width``, else wrapped inside the
    call; with ``nvme`` (``--nvme-gbps``) the optimizer offload is the NVMe tier's,
    ``offload=jz.NVMe(NVME_DIR)``."""
    source = lambda k, v: f'jz.NVMe("{NVME_DIR}")' if nvme and k == "offload" else _source(v)
    args = ["tx", "mesh"] + [
        f"{k}={source(k, v)}"
        for k, v in row.zero_options.items()
        if k not in _DEFAULTS or v != _DEFAULTS[k]
    ]
    line = f"{indent}zero = jz.ZeRO({', '.join(args)})"
    if len(line) <= width:
        return line
    body = textwrap.fill(
        ", ".join(args),
        width,
        initial_indent=indent + "    ",
        subsequent_indent=indent + "    ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return f"{indent}zero = jz.ZeRO(\n{body}\n{indent})"


def _step_line(args, indent: str) -> str | None:
    """``step = jz.make_train_step(...)`` where the plan's step needs more than its defaults
    (``--accum``, ``--ema``: ShardedEMA(0.999), as the plan compiled)."""
    extra = [f"accum_steps={args.accum}"] * (args.accum > 1)
    extra += ["ema=jz.ShardedEMA(0.999)"] * bool(args.ema)
    if not extra:
        return None
    return f"{indent}step = jz.make_train_step(loss_fn, zero, {', '.join(extra)})"


def pick_note(rows, args, width: int = 100) -> str:
    """The pick and its lines to paste (``import jaxzero as jz``; ``tx`` your optax
    optimizer, ``mesh`` your mesh), or why there is none."""
    from jaxzero.memory import format_bytes

    row = chosen(rows)
    if row is None:
        memory = format_bytes(rows[0].report.hbm_bytes)
        return textwrap.fill(
            f"pick: none; no row fits in {memory} per GPU: add devices, offload (--offload "
            "auto, --offload optimizer,params), or shorten --batch / --seq.",
            width,
            break_on_hyphens=False,
        )
    why = "of the rows that fit, the shortest predicted step, then the lowest stage"
    if len(rows) == 1:
        why = "the one row, and it fits"
    lines = textwrap.wrap(
        f"pick: {row.label} ({why}). To build it (import jaxzero as jz; tx: your optax "
        "optimizer; mesh: your mesh, e.g. jz.data_parallel_mesh()):",
        width,
        break_on_hyphens=False,
    )
    if args.state_dtype:
        from jaxzero.gpu.plan import STATE_DTYPES  # the dtype plan_tx compiled with

        dtype = STATE_DTYPES[args.state_dtype]
        lines.append(f"  tx = jz.with_state_dtype(tx, jnp.{dtype})  # import jax.numpy as jnp")
    lines.append(paste(row, width, nvme=bool(getattr(args, "nvme_gbps", None))))
    if getattr(args, "nvme_gbps", None):
        lines.append(f"  # {NVME_DIR}: a directory on the node's NVMe drives")
    step = _step_line(args, "  ")
    if step:
        lines.append(step)
    opts = row.zero_options
    names = {
        "layers": "the params subtree of your scanned layer stack",
        "units": "your model's blocks",
        "vocab_parallel": "your tied embedding",
    }
    said = [f"{k}={_source(opts[k])}: {what}" for k, what in names.items() if opts.get(k)]
    if said:
        comment = "; ".join(said) + ", as the plan's model names them"
        lines += textwrap.wrap(
            comment, width, initial_indent="  # ", subsequent_indent="  # ", break_on_hyphens=False
        )
    return "\n".join(lines)


# absl's prefix: severity, MMDD hh:mm:ss.micros, thread id, file:line]
_ABSL = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\s\]]+:\d+)\] ?(.*)$")
_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to"
_SEVERITY = {"I": "info", "W": "warning", "E": "error", "F": "fatal"}
# what a kind means for the plan, where it is known
_MEANING = {
    "hlo_rematerialization": "(XLA's rematerialisation missed a memory target of its own: not "
    "an error; the verdict judges the compiled peak)",
    "cudart_stub": "(no CUDA driver on this machine: expected, the compiles are deviceless)",
}


@dataclasses.dataclass
class Captured:
    """The lines descriptor 2 received during :func:`xla_logs_captured` (filled in when it
    exits) and the stream progress should write to meanwhile."""

    stream: object
    lines: list[str] = dataclasses.field(default_factory=list)


def _writes_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def xla_logs_captured():
    """Point file descriptor 2 at a temporary file; yield a :class:`Captured` whose ``stream``
    still reaches the original stderr (``sys.stderr`` itself where it does not write to
    descriptor 2, e.g. under pytest's capsys). Descriptor 2 is restored on the way out,
    exceptions included, and ``lines`` holds what it received. The lines go to
    ``$TMPDIR/jaxzero-plan-xla-*.log``, removed then; a process XLA aborts leaves it behind."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    stream = os.fdopen(os.dup(saved), "w", buffering=1) if _writes_fd2(sys.stderr) else sys.stderr
    captured = Captured(stream)
    # a named file, removed on the way out: if XLA aborts the process, its lines stay there
    fd, path = tempfile.mkstemp(prefix="jaxzero-plan-xla-", suffix=".log")
    os.dup2(fd, 2)
    try:
        yield captured
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if stream is not sys.stderr:
            stream.close()
        with os.fdopen(fd, "rb") as f:
            f.seek(0)
            text = f.read().decode("utf-8", errors="replace")
        os.unlink(path)
        captured.lines = [line for line in text.splitlines() if line.strip()]


def _kind(line: str) -> tuple[str, str, str]:
    """``(severity, source, message)`` of one captured line: absl's ``file.cc:123`` source, or
    ``"absl"`` for its "before InitializeLog" preamble, or ``"other"``."""
    m = _ABSL.match(line)
    if m:
        return _SEVERITY[m[1]], m[2], m[3]
    if line.startswith(_PREAMBLE):
        return "info", "absl", line
    return "-", "other", line


def log_summary(lines: list[str], width: int = 100) -> list[str]:
    """A few lines saying what XLA printed during the compiles: the count, then per kind
    (source file and line) its count, severity and first message, cut to ``width``, and
    what it means for the plan where that is known; ``[]`` when nothing was printed."""
    if not lines:
        return []
    kinds = Counter()
    first = {}
    for line in lines:
        severity, source, message = _kind(line)
        kinds[(severity, source)] += 1
        first.setdefault((severity, source), message)
    out = [
        f"XLA printed {len(lines)} log line{'s' * (len(lines) > 1)} during the compiles "
        f"({len(kinds)} kind{'s' * (len(kinds) > 1)}; --verbose prints them):"
    ]
    for (severity, source), count in kinds.most_common():
        line = f"  {count} x {severity} {source}: {first[(severity, source)]}"
        out.append(line if len(line) <= width else line[: width - 3] + "...")
        meaning = _MEANING.get(source.split(":")[0].removesuffix(".cc"))
        if meaning:
            out += textwrap.wrap(meaning, width, initial_indent="    ", subsequent_indent="    ")
    return out


def progress(total_hint: int, stream=None):
    """``(on_case, close)``: a tqdm bar on ``stream`` (default ``sys.stderr``) when it and
    stdout are terminals, else one plain line per compile."""
    stream = sys.stderr if stream is None else stream
    tty = all(getattr(s, "isatty", lambda: False)() for s in (stream, sys.stdout))
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not tty:

        def on_case(label, i, total):
            print(f"[{i + 1}/{total}] compiling stage {label} ...", file=stream, flush=True)

        return on_case, lambda: None
    bar = tqdm(total=total_hint, desc="compiling", unit="stage", file=stream, leave=False)

    def on_case(label, i, total):
        bar.n = i
        bar.set_postfix_str(f"stage {label}")  # refreshes the bar

    def close():
        bar.n = bar.total
        bar.close()

    return on_case, close


COMMAND = Command(
    "plan",
    "Compile the step for a GPU cluster (no GPU needed) and show memory per stage.",
    configure,
    run,
    DESCRIPTION,
)
