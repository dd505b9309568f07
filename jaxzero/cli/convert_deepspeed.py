"""``jaxzero convert deepspeed2jax|jax2deepspeed``: the flags of
:mod:`jaxzero.interop.deepspeed.convert` and the printed summary."""

from __future__ import annotations

import argparse

from jaxzero.cli.command import pick, positive_int, run_conversion
from jaxzero.cli.params_from import deepspeed_name_map

DIRECTIONS = ("deepspeed2jax", "jax2deepspeed")
_DS2JAX = "DeepSpeed ZeRO checkpoint -> jaxzero Orbax checkpoint (params + AdamW state)"
_JAX2DS = "jaxzero Orbax checkpoint -> DeepSpeed ZeRO checkpoint for a stage and world size"
DESCRIPTION = """\
DeepSpeed ZeRO 1/2/3 checkpoints (fp32/bf16, FusedAdam or torch AdamW) are read without
DeepSpeed installed; what jax2deepspeed writes loads in DeepSpeed's engine.load_checkpoint.
Without --params-from the jaxzero tree is keyed by the torch names in torch layout;
--params-from MODULE:FUNCTION (a function returning the Flax params or their jax.eval_shape)
writes that structure (Linear weights as transposed kernels, ...), which restores into the
Flax model. On a machine without a GPU, --devices N simulates N CPU devices.
examples:
  jaxzero convert deepspeed2jax ds_run/ --out ckpt/ --stage 2 --devices 8
  jaxzero convert deepspeed2jax ds_run/ --out ckpt/ --params-from mymodel:params
  jaxzero convert jax2deepspeed ckpt/ --out ds_run/ --stage 3 --world-size 16
"""


def add_subcommands(sub) -> None:
    """Add ``deepspeed2jax`` and ``jax2deepspeed`` to the ``convert`` subparsers ``sub``."""
    d = sub.add_parser(
        "deepspeed2jax",
        help=_DS2JAX,
        description=_DS2JAX + ". The jaxzero stage and device count are yours.",
    )
    d.add_argument("save_dir", metavar="SAVE_DIR", help="the dir given to save_checkpoint")
    d.add_argument("--out", metavar="DIR", help="Orbax checkpoint directory to create")
    d.add_argument("--tag", help="checkpoint tag (default: the one in SAVE_DIR/latest)")
    d.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=2, help="jaxzero stage")
    d.add_argument("--devices", type=positive_int, metavar="N", help="mesh size (default: all)")
    d.add_argument(
        "--params-from",
        metavar="MODULE:FUNCTION",
        help="the Flax params structure to write: a function of no arguments returning the "
        "params or their jax.eval_shape (imported from the current directory or PYTHONPATH)",
    )
    d.add_argument(
        "--name-map",
        metavar="MAP.json",
        help='{"torch_name": "a/b/kernel"} (with --params-from: overrides single names)',
    )
    d.add_argument("--dry-run", action="store_true", help="print a summary, write nothing")
    d.set_defaults(_convert=_ds2jax, _convert_parser=d)
    j = sub.add_parser(
        "jax2deepspeed",
        help=_JAX2DS,
        description=_JAX2DS + ". DeepSpeed's engine.load_checkpoint(SAVE_DIR) continues from "
        "it; zero_to_fp32 reads it.",
    )
    j.add_argument("ckpt_dir", metavar="DIR", help="jaxzero checkpoint (from deepspeed2jax)")
    j.add_argument("--out", metavar="SAVE_DIR", help="DeepSpeed save dir to write")
    j.add_argument("--stage", type=int, choices=[1, 2, 3], required=True, help="ZeRO stage")
    j.add_argument("--world-size", type=positive_int, required=True, metavar="W", help="ranks")
    j.add_argument("--tag", help="checkpoint tag (default: global_step<step>)")
    j.add_argument("--step", type=int, help="jaxzero checkpoint step (default: newest)")
    j.add_argument("--devices", type=positive_int, metavar="N", help="mesh size (default: all)")
    j.add_argument("--dry-run", action="store_true", help="print a summary, write nothing")
    j.set_defaults(_convert=_jax2ds, _convert_parser=j)


def _run(convert, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    summary = lambda result: result.summary()
    return run_conversion(convert, args, parser, summary, (ValueError, TypeError))


def _ds2jax(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from jaxzero.interop.deepspeed.convert import deepspeed_to_jax

    def convert():
        kwargs = pick(args, "tag", "stage", "devices", "name_map", "dry_run")
        if args.params_from is not None:
            kwargs["name_map"] = deepspeed_name_map(
                args.save_dir, args.tag, args.params_from, args.name_map
            )
        return deepspeed_to_jax(args.save_dir, args.out, **kwargs)

    return _run(convert, args, parser)


def _jax2ds(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from jaxzero.interop.deepspeed.convert import jax_to_deepspeed

    kwargs = pick(args, "stage", "world_size", "step", "devices", "tag", "dry_run")
    return _run(lambda: jax_to_deepspeed(args.ckpt_dir, args.out, **kwargs), args, parser)
