"""``jaxzero estimate``: per-device training memory for ZeRO stages 0-3
(:mod:`jaxzero.memory`)."""

from __future__ import annotations

import argparse
import math

from jaxzero import memory, trees
from jaxzero.cli.command import Command, param_count, pick, positive_int


def _memory_size(text: str) -> int:
    try:
        return memory.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --------------------------------------------------------------------------- estimate

ESTIMATE_DESCRIPTION = """\
Estimate per-device training memory for ZeRO stages 0-3 (Rajbhandari et al. 2020).

Under mixed precision with Adam each parameter costs 2 bytes (bf16 params) +
2 (grads) + 12 (fp32 master, m, v); stage 1 shards the 12 over the devices,
stage 2 also the grads, stage 3 also the params. Stage 3 then gathers the whole
model in the compute dtype for each micro-batch (2 bytes/param in bf16: "gathered"
column) unless it runs one layer at a time (--layer-params). GB = 1e9 bytes.

examples:
  jaxzero estimate --params 7.5e9 --devices 64
  jaxzero estimate --model gpt --layers 32 --hidden 4096 --devices 8 --gpu-memory 80GB
  jaxzero estimate --params 7B --devices 8 --stage 3 --ema \\
      --layers 32 --hidden 4096 --heads 32 --batch 4 --seq 2048 --ckpt-every 1
"""


def _configure(p: argparse.ArgumentParser) -> None:
    _add_size(p)
    train = _add_training(p)
    _add_activations(p)
    train.add_argument("--layer-params", type=param_count, metavar="N", help=_LAYER_PARAMS)


_LAYER_PARAMS = (
    "stage 3 one layer at a time (ZeRO(layers=...)): parameters of one layer; adds that layer "
    "gathered with its gradient and the full gradients outside the stack (needs --layers)"
)


def _add_size(p: argparse.ArgumentParser) -> None:
    size = p.add_argument_group("model size (give --params or --model)")
    which = size.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--params", type=param_count, metavar="N", help="total parameter count, e.g. 7e9, 7B, 350M"
    )
    which.add_argument(
        "--from-checkpoint",
        metavar="DIR",
        help="read the parameter count (and, unless given, devices, stage and precision; "
        "the EMA when it has one) from a jaxzero checkpoint's metadata",
    )
    which.add_argument(
        "--model",
        choices=["gpt"],
        help="derive the count from a GPT shape: 12*L*h^2 + (vocab+seq_len)*h "
        "(needs --layers and --hidden)",
    )
    size.add_argument(
        "--layers",
        type=positive_int,
        metavar="L",
        help="transformer layers (for --model gpt and for activations)",
    )
    size.add_argument(
        "--hidden",
        type=positive_int,
        metavar="H",
        help="model width (for --model gpt and for activations)",
    )
    size.add_argument(
        "--vocab",
        type=positive_int,
        default=50257,
        help="vocabulary size for --model gpt (default: %(default)s)",
    )
    size.add_argument(
        "--seq-len",
        type=positive_int,
        default=1024,
        metavar="S",
        help="position embeddings for --model gpt (default: %(default)s)",
    )


def _add_training(p: argparse.ArgumentParser):
    train = p.add_argument_group("training setup")
    train.add_argument(
        "--devices",
        type=positive_int,
        metavar="N",
        help="data-parallel devices the state is sharded over (required unless "
        "--from-checkpoint gives them)",
    )
    train.add_argument(
        "--stage", type=int, choices=[0, 1, 2, 3], help="ZeRO stage to show (default: all four)"
    )
    train.add_argument(
        "--optimizer",
        choices=list(memory.OPTIMIZERS),
        default="adam",
        help="optimizer state: adam 8 B/param, sgd (momentum) 4, adafactor ~0, "
        "each +4 for the fp32 master under bf16/fp16 (default: %(default)s)",
    )
    train.add_argument(
        "--precision",
        choices=list(memory.PRECISIONS),
        default=None,
        help="bf16/fp16: mixed precision with fp32 master; fp32: single copy "
        "(default: bf16, the ZeRO paper's accounting; a checkpoint's own with --from-checkpoint)",
    )
    train.add_argument(
        "--ema",
        action="store_true",
        help="add an fp32 parameter EMA, sharded at every stage (4*params/N)",
    )
    train.add_argument(
        "--gpu-memory",
        type=_memory_size,
        metavar="SIZE",
        help="per-device memory budget, e.g. 80GB, 79.6GiB, 24000MB; marks which stages fit",
    )
    return train


def _add_activations(p: argparse.ArgumentParser) -> None:
    act = p.add_argument_group(
        "activations (optional; need --batch, --seq, --heads, --layers and --hidden)"
    )
    act.add_argument("--batch", type=positive_int, help="per-device micro-batch size")
    act.add_argument("--seq", type=positive_int, help="training sequence length")
    act.add_argument("--heads", type=positive_int, help="attention heads")
    act.add_argument(
        "--ckpt-every",
        type=positive_int,
        metavar="CI",
        help="layers between activation checkpoints (default: 1)",
    )
    act.add_argument(
        "--logits",
        action="store_true",
        help="add the f32 logits over --vocab (logits, softmax, gradient: 12*batch*seq*vocab)",
    )


def _from_checkpoint(args, parser) -> int:
    """Fill the parameter count (and missing devices/stage/precision) from checkpoint metadata."""
    from jaxzero import checkpoint  # imports orbax: only for this option

    try:
        meta = checkpoint.load_metadata(args.from_checkpoint)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    rows = trees.leaf_rows_under(meta.get("leaves", []), "params")
    if not rows:
        parser.error(f"{args.from_checkpoint}: the metadata lists no params leaves")
    num_params = sum(int(math.prod(r["shape"])) for r in rows)
    if args.devices is None:
        args.devices = int(meta.get("mesh", {}).get(meta.get("axis") or "data", 0)) or None
    if args.stage is None and meta.get("stage") is not None:
        args.stage = int(meta["stage"])
    if args.precision is None:
        dtype = (meta.get("precision") or {}).get("param_dtype", "float32")
        args.precision = trees.PRECISION_NAMES.get(dtype, "fp32")
    args.ema = args.ema or bool(meta.get("has_ema"))
    print(
        f"{args.from_checkpoint}: step {meta.get('step')}, stage {meta.get('stage')}, "
        f"mesh {meta.get('mesh')}, {num_params:,} params"
        + (", with an EMA" if meta.get("has_ema") else "")
    )
    return num_params


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.from_checkpoint:
        num_params = _from_checkpoint(args, parser)
    elif args.model == "gpt":
        missing = [f for f in ("layers", "hidden") if getattr(args, f) is None]
        if missing:
            parser.error(f"--model gpt needs {' and '.join('--' + f for f in missing)}")
        num_params = memory.gpt_param_count(args.layers, args.hidden, args.vocab, args.seq_len)
        print(
            f"gpt: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
            f"seq-len {args.seq_len} -> {num_params:,} params"
        )
    else:
        num_params = args.params
    if args.devices is None:
        parser.error("--devices is required (or --from-checkpoint with a saved mesh)")
    if args.precision is None:
        args.precision = "bf16"
    if args.layer_params is not None and args.layers is None:
        parser.error("--layer-params needs --layers (how many layers the stack holds)")
    activations = {k: getattr(args, k) for k in ("batch", "seq", "heads", "ckpt_every")}
    if args.logits:
        activations["vocab"] = args.vocab
    if any(v is not None for v in activations.values()):
        missing = [
            f"--{k.replace('_', '-')}"
            for k in ("batch", "seq", "heads", "layers", "hidden")
            if getattr(args, k) is None
        ]
        if missing:
            parser.error(f"activation estimate needs {', '.join(missing)} as well")
        activations.update(layers=args.layers, hidden=args.hidden)
    try:
        names = ("stage", "optimizer", "precision", "ema", "layer_params")
        estimates = memory.estimate_memory(
            num_params,
            args.devices,
            **pick(args, *names),
            gather_model=args.layer_params is None,
            **(
                {"layers": args.layers} if args.layer_params and "layers" not in activations else {}
            ),
            **activations,
        )
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    print(memory.format_table(estimates, gpu_memory=args.gpu_memory))
    return 0


COMMAND = Command(
    "estimate",
    "Estimate per-device memory for ZeRO stages 0-3.",
    _configure,
    _run,
    ESTIMATE_DESCRIPTION,
)
