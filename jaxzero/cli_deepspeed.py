"""``jaxzero convert deepspeed2jax`` / ``jax2deepspeed`` (argparse side of
:mod:`jaxzero.interop.deepspeed.convert`).

Wiring: inside the ``convert`` command's ``configure(p)``, call
``add_subcommands(sub)`` with the subparsers object; each parser sets ``_convert`` (a function
``args -> ConversionResult``), ``_convert_parser`` and ``_format`` (``result -> str``).
:func:`run` runs a parsed namespace: it prints the summary and returns 0, or reports a bad
input through the sub-parser (exit status 2).
"""

from __future__ import annotations

import argparse

__all__ = ["add_subcommands", "run"]

DS2JAX_HELP = "DeepSpeed ZeRO checkpoint -> jaxzero Orbax checkpoint (params + AdamW state)"
JAX2DS_HELP = "jaxzero Orbax checkpoint -> DeepSpeed ZeRO checkpoint for a stage and world size"


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def _ds2jax(args):
    from jaxzero.interop.deepspeed.convert import deepspeed_to_jax

    return deepspeed_to_jax(
        args.save_dir,
        args.out,
        tag=args.tag,
        stage=args.stage,
        devices=args.devices,
        name_map=args.name_map,
        dry_run=args.dry_run,
    )


def _jax2ds(args):
    from jaxzero.interop.deepspeed.convert import jax_to_deepspeed

    return jax_to_deepspeed(
        args.ckpt_dir,
        args.out,
        stage=args.stage,
        world_size=args.world_size,
        step=args.step,
        devices=args.devices,
        tag=args.tag,
        dry_run=args.dry_run,
    )


def add_subcommands(convert_subparsers) -> None:
    """Add ``deepspeed2jax`` and ``jax2deepspeed`` to the ``convert`` subparsers."""
    d = convert_subparsers.add_parser(
        "deepspeed2jax",
        help=DS2JAX_HELP,
        description=DS2JAX_HELP + ". Reads ZeRO 1/2/3 (fp32/bf16, FusedAdam or torch AdamW) "
        "without DeepSpeed installed; the jaxzero stage and device count are yours.",
    )
    d.add_argument("save_dir", metavar="SAVE_DIR", help="the dir given to save_checkpoint")
    d.add_argument("--out", metavar="DIR", help="Orbax checkpoint directory to create")
    d.add_argument("--tag", help="checkpoint tag (default: the one in SAVE_DIR/latest)")
    d.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=2, help="jaxzero stage")
    d.add_argument("--devices", type=_positive, metavar="N", help="mesh size (default: all)")
    d.add_argument("--name-map", metavar="MAP.json", help='{"torch_name": "a/b/kernel"}')
    d.add_argument("--dry-run", action="store_true", help="print a summary, write nothing")
    d.set_defaults(_convert=_ds2jax, _convert_parser=d, _format=lambda r: r.summary())

    j = convert_subparsers.add_parser(
        "jax2deepspeed",
        help=JAX2DS_HELP,
        description=JAX2DS_HELP + ". DeepSpeed's engine.load_checkpoint(SAVE_DIR) continues "
        "from it; zero_to_fp32 reads it.",
    )
    j.add_argument("ckpt_dir", metavar="DIR", help="jaxzero checkpoint (from deepspeed2jax)")
    j.add_argument("--out", metavar="SAVE_DIR", help="DeepSpeed save dir to write")
    j.add_argument("--stage", type=int, choices=[1, 2, 3], required=True, help="ZeRO stage")
    j.add_argument("--world-size", type=_positive, required=True, metavar="W", help="DP ranks")
    j.add_argument("--tag", help="checkpoint tag (default: global_step<step>)")
    j.add_argument("--step", type=int, help="jaxzero checkpoint step (default: newest)")
    j.add_argument("--devices", type=_positive, metavar="N", help="mesh size (default: all)")
    j.add_argument("--dry-run", action="store_true", help="print a summary, write nothing")
    j.set_defaults(_convert=_jax2ds, _convert_parser=j, _format=lambda r: r.summary())


def run(args) -> int:
    """Run a namespace parsed with the sub-parsers of :func:`add_subcommands`."""
    parser = args._convert_parser
    try:
        if not args.dry_run and args.out is None:
            raise ValueError("--out is required (or --dry-run)")
        result = args._convert(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        parser.error(str(e))
    print(args._format(result))
    return 0
