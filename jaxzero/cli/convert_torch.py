"""``jaxzero convert torch2jax|jax2torch``: the flags and the printed summary of
:mod:`jaxzero.interop.torch.convert`."""

from __future__ import annotations

import argparse

from jaxzero.cli.command import pick, positive_int, run_conversion
from jaxzero.interop.torch.convert import (
    CONSOLIDATED_FILE,
    ConversionResult,
    ConvertError,
    jax_to_torch,
    torch_to_jax,
)

DIRECTIONS = ("torch2jax", "jax2torch")
DESCRIPTION = """\
Convert between PyTorch ZeroRedundancyOptimizer(AdamW) checkpoints and jaxzero (Orbax)
checkpoints. Only AdamW (one param group) is supported.

examples:
  jaxzero convert torch2jax --model model.pt --optim-dir ranks/ --world-size 2 --out ckpt/
  jaxzero convert torch2jax --model model.pt --optim consolidated.pt --out ckpt/ --dry-run
  jaxzero convert jax2torch --ckpt ckpt/ --out torch_out/ --world-size 4 --consolidated
"""


_TORCH2JAX = (
    "torch state_dict + ZeRO(AdamW) state -> jaxzero Orbax checkpoint",
    "Convert a torch model state_dict and ZeroRedundancyOptimizer(AdamW) state (consolidated, "
    "or per-rank local files) to a jaxzero Orbax checkpoint.",
)
_JAX2TORCH = (
    "jaxzero Orbax checkpoint (AdamW) -> torch model.pt + ZeRO state files",
    "Convert a jaxzero AdamW checkpoint to torch: model.pt, per-rank ZeroRedundancyOptimizer "
    "local state dicts and/or a consolidated one.",
)


def add_subcommands(sub) -> None:
    """Add ``torch2jax`` and ``jax2torch`` to the ``convert`` subparsers ``sub``."""
    _add_torch2jax(sub)
    _add_jax2torch(sub)


def _add_torch2jax(sub) -> None:
    t = sub.add_parser("torch2jax", help=_TORCH2JAX[0], description=_TORCH2JAX[1])
    t.add_argument("--model", required=True, metavar="MODEL.pt", help="torch state_dict file")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--optim", metavar="OPT.pt", help="consolidated zero.state_dict() file")
    src.add_argument("--optim-dir", metavar="DIR", help="directory of per-rank files (*rank<r>.pt)")
    t.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="torch ranks (required with --optim-dir)",
    )
    t.add_argument("--out", metavar="ORBAX_DIR", help="checkpoint directory to create")
    t.add_argument("--devices", type=positive_int, metavar="N", help="mesh size (default: all)")
    t.add_argument(
        "--stage", type=int, choices=[0, 1, 2, 3], default=1, help="ZeRO stage (default: 1)"
    )
    t.add_argument("--name-map", metavar="MAP.json", help='{"torch_name": "a/b/kernel"}')
    t.add_argument("--dry-run", action="store_true", help="print a summary, write nothing")
    t.set_defaults(_convert=_run_torch2jax, _convert_parser=t)


def _add_jax2torch(sub) -> None:
    j = sub.add_parser("jax2torch", help=_JAX2TORCH[0], description=_JAX2TORCH[1])
    j.add_argument("--ckpt", required=True, metavar="ORBAX_DIR")
    j.add_argument("--out", metavar="DIR", help="output directory")
    j.add_argument("--world-size", type=positive_int, metavar="N", help="torch ranks")
    j.add_argument("--consolidated", action="store_true", help="also write " + CONSOLIDATED_FILE)
    j.add_argument("--name-map", metavar="MAP.json", help='{"torch_name": "a/b/kernel"}')
    j.add_argument("--step", type=int, help="checkpoint step (default: newest)")
    j.add_argument("--devices", type=positive_int, metavar="N", help="mesh size (default: all)")
    j.add_argument("--lr", type=float)
    j.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"))
    j.add_argument("--eps", type=float)
    j.add_argument("--weight-decay", type=float)
    j.add_argument("--dry-run", action="store_true", help="print a summary, write nothing")
    j.set_defaults(_convert=_run_jax2torch, _convert_parser=j)


def _run(convert, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return run_conversion(convert, args, parser, format_summary, (ConvertError,))


def _run_torch2jax(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    names = ("optim", "optim_dir", "world_size", "devices", "stage", "name_map", "dry_run")
    return _run(lambda: torch_to_jax(args.model, args.out, **pick(args, *names)), args, parser)


def _run_jax2torch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    names = ("world_size", "consolidated", "name_map", "step", "devices", "lr", "eps")
    kwargs = pick(args, *names, "weight_decay", "dry_run")
    betas = tuple(args.betas) if args.betas else None
    return _run(lambda: jax_to_torch(args.ckpt, args.out, betas=betas, **kwargs), args, parser)


def format_summary(s: ConversionResult) -> str:
    """The text ``jaxzero convert`` prints for a conversion."""
    lines = []
    if s.direction == "torch2jax":
        src = s.source
        what = f"--optim {src['optim']}" if src["optim"] else f"--optim-dir {src['optim_dir']}"
        lines.append(f"torch2jax: {src['model']} + {what} (world size {src['world_size']})")
    else:
        lines.append(f"jax2torch: {s.ckpt}")
    lines.append(f"step {s.step}; optimizer {s.optimizer}: " + ", ".join(
        f"{k}={s.hyperparams[k]}" for k in ("lr", "betas", "eps", "weight_decay")
    ))  # fmt: skip
    lines.append(f"{len(s.params)} params (torch name, torch shape, tree path, owner rank):")
    for p in s.params:
        shape = p.torch_shape if p.torch_shape is not None else p.shape
        owner = "-" if p.owner_rank is None else p.owner_rank
        lines.append(f"  {p.name:<40} {str(tuple(shape)):<16} {p.path:<40} rank {owner}")
    if s.direction == "torch2jax":
        target = f"{s.out}/{s.step}/{{state,metadata}}"
        lines.append(f"ZeRO stage {s.stage} on {s.devices} devices")
        lines.append(("would write: " if s.dry_run else "wrote: ") + target)
    else:
        lines.append(("would write: " if s.dry_run else "wrote: ") + ", ".join(s.files))
    if s.dry_run:
        lines.append("dry run: nothing written")
    return "\n".join(lines)
