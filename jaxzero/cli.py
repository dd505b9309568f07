"""The ``jaxzero`` command line.

Subcommands live in the :data:`COMMANDS` registry. To add one (``inspect``,
``convert``, ...), write a ``configure(parser)`` that adds its arguments and a
``run(args, parser) -> int`` that does the work (report bad input with
``parser.error(msg)``), then register it next to ``estimate`` at the bottom of
the registry section::

    register(Command("inspect", "Inspect a checkpoint.", _configure_inspect, _run_inspect))

``main`` builds one subparser per registered command, in registration order.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Callable, Sequence

from jaxzero import memory

PROG = "jaxzero"


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single stderr line (then exit status 2)."""

    def error(self, message):
        message = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: ``configure`` adds its arguments, ``run`` returns the exit code."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, argparse.ArgumentParser], int | None]
    description: str | None = None


COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add ``command`` to the registry (a name may be registered once)."""
    if command.name in COMMANDS:
        raise ValueError(f"subcommand {command.name!r} is already registered; pick another name")
    COMMANDS[command.name] = command
    return command


# --------------------------------------------------------------------------- argument types

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def _param_count(text: str) -> int:
    """'7e9', '7000000000', '7B', '350M', '1.5T' -> int parameter count (> 0)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid parameter count {text!r}; write e.g. 7e9, 7B or 350M (must be positive)"
        )
    value = round(float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"parameter count must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


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
stage 2 also the grads, stage 3 also the params. GB = 1e9 bytes.

examples:
  jaxzero estimate --params 7.5e9 --devices 64
  jaxzero estimate --model gpt --layers 32 --hidden 4096 --devices 8 --gpu-memory 80GB
  jaxzero estimate --params 7B --devices 8 --stage 3 --ema \\
      --layers 32 --hidden 4096 --heads 32 --batch 4 --seq 2048 --ckpt-every 1
"""


def _configure_estimate(p: argparse.ArgumentParser) -> None:
    size = p.add_argument_group("model size (give --params or --model)")
    which = size.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--params", type=_param_count, metavar="N", help="total parameter count, e.g. 7e9, 7B, 350M"
    )
    which.add_argument(
        "--from-checkpoint",
        metavar="DIR",
        help="read the parameter count (and, unless given, devices, stage and precision) "
        "from a jaxzero checkpoint's metadata",
    )
    which.add_argument(
        "--model",
        choices=["gpt"],
        help="derive the count from a GPT shape: 12*L*h^2 + (vocab+seq_len)*h "
        "(needs --layers and --hidden)",
    )
    size.add_argument(
        "--layers",
        type=_positive_int,
        metavar="L",
        help="transformer layers (for --model gpt and for activations)",
    )
    size.add_argument(
        "--hidden",
        type=_positive_int,
        metavar="H",
        help="model width (for --model gpt and for activations)",
    )
    size.add_argument(
        "--vocab",
        type=_positive_int,
        default=50257,
        help="vocabulary size for --model gpt (default: %(default)s)",
    )
    size.add_argument(
        "--seq-len",
        type=_positive_int,
        default=1024,
        metavar="S",
        help="position embeddings for --model gpt (default: %(default)s)",
    )

    train = p.add_argument_group("training setup")
    train.add_argument(
        "--devices",
        type=_positive_int,
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

    act = p.add_argument_group(
        "activations (optional; need --batch, --seq, --heads, --layers and --hidden)"
    )
    act.add_argument("--batch", type=_positive_int, help="per-device micro-batch size")
    act.add_argument("--seq", type=_positive_int, help="training sequence length")
    act.add_argument("--heads", type=_positive_int, help="attention heads")
    act.add_argument(
        "--ckpt-every",
        type=_positive_int,
        metavar="CI",
        help="layers between activation checkpoints (default: 1)",
    )
    act.add_argument(
        "--logits",
        action="store_true",
        help="add the f32 logits over --vocab (logits, softmax, gradient: 12*batch*seq*vocab)",
    )
    train.add_argument(
        "--layer-params",
        type=_param_count,
        metavar="N",
        help="stage 3 one layer at a time (ZeRO(layers=...)): parameters of one layer; adds "
        "that layer gathered with its gradient and the full gradients outside the stack "
        "(needs --layers)",
    )


def _from_checkpoint(args, parser) -> int:
    """Fill the parameter count (and missing devices/stage/precision) from checkpoint metadata."""
    from jaxzero import checkpoint  # imports orbax: only for this option

    try:
        meta = checkpoint.load_metadata(args.from_checkpoint)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    rows = [r for r in meta.get("leaves", []) if str(r["path"]).startswith("params")]
    if not rows:
        parser.error(f"{args.from_checkpoint}: the metadata lists no params leaves")
    num_params = sum(int(math.prod(r["shape"])) for r in rows)
    if args.devices is None:
        args.devices = int(meta.get("mesh", {}).get(meta.get("axis") or "data", 0)) or None
    if args.stage is None and meta.get("stage") is not None:
        args.stage = int(meta["stage"])
    if args.precision is None:
        dtype = (meta.get("precision") or {}).get("param_dtype", "float32")
        args.precision = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp32")
    print(
        f"{args.from_checkpoint}: step {meta.get('step')}, stage {meta.get('stage')}, "
        f"mesh {meta.get('mesh')}, {num_params:,} params"
    )
    return num_params


def _run_estimate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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
        estimates = memory.estimate_memory(
            num_params,
            args.devices,
            stage=args.stage,
            optimizer=args.optimizer,
            precision=args.precision,
            ema=args.ema,
            layer_params=args.layer_params,
            **(
                {"layers": args.layers} if args.layer_params and "layers" not in activations else {}
            ),
            **activations,
        )
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    print(memory.format_table(estimates, gpu_memory=args.gpu_memory))
    return 0


register(
    Command(
        "estimate",
        "Estimate per-device memory for ZeRO stages 0-3.",
        _configure_estimate,
        _run_estimate,
        ESTIMATE_DESCRIPTION,
    )
)

# Register further subcommands (inspect, convert, ...) here.
# --------------------------------------------------------------------------- inspect

INSPECT_DESCRIPTION = """\
Show a jaxzero checkpoint directory: its complete steps (and any interrupted
saves, which are ignored), then for one step (default: the newest complete one)
the jaxzero version, ZeRO stage, mesh, precision policy, optimizer, user
metadata, and every state leaf's path, shape, dtype, bytes and partition spec.
Reads metadata only; nothing is loaded onto devices and nothing is written.

examples:
  jaxzero inspect /ckpt/run1
  jaxzero inspect /ckpt/run1 --step 1000
"""


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="checkpoint directory (the CheckpointManager root)")
    p.add_argument(
        "--step", type=int, metavar="STEP", help="step to describe (default: newest complete)"
    )


def _run_inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from jaxzero import checkpoint  # imports jax/orbax: only for this command

    try:
        text = checkpoint.inspect(args.directory, step=args.step)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(text)
    return 0


register(
    Command(
        "inspect",
        "Inspect a jaxzero checkpoint directory.",
        _configure_inspect,
        _run_inspect,
        INSPECT_DESCRIPTION,
    )
)

# `jaxzero convert torch2jax|jax2torch` lives with its implementation (imports nothing heavy).
from jaxzero.convert import register_cli as _register_convert  # noqa: E402

_register_convert(sys.modules[__name__])

from jaxzero import cli_plan as _plan  # noqa: E402  (`jaxzero plan`; imports jax only when run)

register(
    Command(
        "plan", "Compile the step for a GPU cluster.", _plan.configure, _plan.run, _plan.DESCRIPTION
    )
)


# --------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per registered command."""
    parser = _Parser(prog=PROG, description="ZeRO memory sharding for JAX: command-line tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS.values():
        p = sub.add_parser(
            cmd.name,
            help=cmd.help,
            description=cmd.description or cmd.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.configure(p)
        p.set_defaults(_command=cmd, _parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``jaxzero`` with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    Bad arguments print one ``jaxzero ...: error: ...`` line to stderr and raise
    ``SystemExit(2)``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"choose a command: {', '.join(COMMANDS)}")
    code = args._command.run(args, args._parser)
    return 0 if code is None else code


if __name__ == "__main__":
    sys.exit(main())
