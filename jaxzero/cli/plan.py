"""``jaxzero plan``: compile the real jaxzero step for a GPU cluster, without a GPU.

Registered as ``COMMAND`` in :mod:`jaxzero.cli`; the library side is :mod:`jaxzero.gpu`.
"""

from __future__ import annotations

import argparse
import sys

import jaxzero.cli.plan_flags as plan_flags
from jaxzero.cli.command import Command, param_count, pick, positive_int
from jaxzero.cli.plan_logs import log_summary, progress, xla_logs_captured
from jaxzero.cli.plan_offload import add_pcie, add_state_layout, check_offload_args, offload_words
from jaxzero.cli.plan_output import (
    compact_table,
    fallback_note,
    formula_note,
    fraction_note,
    legend,
    network,
    offload_note,
    table,
    tries_note,
)
from jaxzero.cli.plan_pick import pick_note

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
    plan_flags.add_loop(size)
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
    plan_flags.add_per_layer_choices(train)
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
    plan_flags.add_wire(train)
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
        + f", {args.precision}, Adam, accum {args.accum}"
        + (", EMA" if args.ema else "")
        + ("" if args.compute_copy else ", stage 3 without a compute copy")
        + (", stage 3 vocabulary-parallel embedding" if args.vocab_parallel else "")
        + (f", offload {offload_words(args)} to pinned host memory" if args.offload else "")
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


def _quantize(args):
    """What ``plan(quantize=)`` gets: ``--quantize``'s name, or with ``--grad-bits 4`` the
    :class:`~jaxzero.Wire` of those widths."""
    if args.grad_bits != 4:
        return args.quantize
    from jaxzero.zero.wire import Wire

    return Wire.create(weights=8 if args.quantize == "both" else None, grads=4)


def _qgz(args) -> bool:
    """Whether the plan's wire defers the gradient reduction (quantized gradients: the
    recommended flags then add one)."""
    from jaxzero.zero.wire import wire

    return wire(_quantize(args)).defers_reduce


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
    options = pick(
        args,
        "gpu",
        "devices",
        "replicas",
        "stage3",
        "stage2",
        "stage1",
        "precision",
        "accum",
        "ema",
        "compute_copy",
        "offload",
        "prefetch",
        "hpz",
        "pcie_gbps",
        "offload_fraction",
        "gpu_memory",
    )
    options["quantize"] = _quantize(args)
    flags = xla_options(quantized_grads=_qgz(args)) if args.xla_flags else None
    logs = None
    try:
        with xla_logs_captured() as logs:  # XLA's C++ log lines: summed up after the table
            on_case, close = progress(len(cases) + both, logs.stream)
            try:
                rows = plan(
                    shape, stages=args.stage, on_case=on_case, compiler_options=flags, **options
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
        _print_leaves(rows, shape, args)
    _print_logs(logs.lines, args.verbose)
    return 0


def _print_leaves(rows, shape, args) -> None:
    """The per-leaf plan (:meth:`jaxzero.ZeRO.plan`) of the picked row, or of every row when
    none fits: the same ``ZeRO`` options the row was compiled with, on the model's abstract
    params (nothing allocated)."""
    import optax

    from jaxzero.cli.plan_pick import chosen
    from jaxzero.ema import ShardedEMA
    from jaxzero.gpu.models import abstract_params
    from jaxzero.gpu.topology import compile_only_mesh
    from jaxzero.train.optimizer import ZeRO

    pick = chosen(rows)
    mesh = compile_only_mesh(args.gpu, args.devices, replicas=args.replicas)
    params = abstract_params(shape)
    ema = ShardedEMA(0.999) if args.ema else None
    for row in [pick] if pick is not None else rows:
        zero = ZeRO(optax.adam(1e-4), mesh, **row.zero_options)
        print(f"\nper-leaf plan of {row.label} (ZeRO.plan):")
        print(zero.plan(params, accum_steps=args.accum, ema=ema), flush=True)


def _print_tables(rows, args) -> None:
    """The table (compact, or every column with ``--wide``), the network lines and the notes,
    then the pick and its ``ZeRO(...)`` line."""
    from jaxzero.gpu.plan import prefetch_advice

    fractions = args.offload == "auto" or args.offload_fraction != 1
    print(table(rows, fractions) if args.wide else compact_table(rows, fractions))
    if args.network_gbps or args.hpz:
        print(network(rows, args))
    notes = [fallback_note(rows), prefetch_advice(rows)]
    if args.wide:
        notes += [offload_note(rows), fraction_note(rows), formula_note(rows), WIDE_LEGEND]
    else:
        notes += [tries_note(rows), legend(rows)]
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


COMMAND = Command(
    "plan",
    "Compile the step for a GPU cluster (no GPU needed) and show memory per stage.",
    configure,
    run,
    DESCRIPTION,
)
