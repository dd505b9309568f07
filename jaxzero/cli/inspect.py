"""``jaxzero inspect``: a checkpoint directory's steps, metadata and leaves
(:func:`jaxzero.checkpoint.inspect`)."""

from __future__ import annotations

import argparse

from jaxzero.cli.command import Command

INSPECT_DESCRIPTION = """\
Show a jaxzero checkpoint directory: its complete steps (and any interrupted
saves, which are ignored), then for one step (default: the newest complete one)
the jaxzero version, ZeRO stage, mesh, precision policy, optimizer, layers=,
units= and offload= (in checkpoints that saved them), user metadata, and every
state leaf's path, shape, dtype, bytes and partition spec.
Reads metadata only; nothing is loaded onto devices and nothing is written.

With --verify it reads every array of every complete step (or of --step) and
checks it against the checksums saved with it: damaged steps are listed and the
exit status is 1.

examples:
  jaxzero inspect /ckpt/run1
  jaxzero inspect /ckpt/run1 --step 1000
  jaxzero inspect --verify /ckpt/run1
"""


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="checkpoint directory (the CheckpointManager root)")
    p.add_argument(
        "--step", type=int, metavar="STEP", help="step to describe (default: newest complete)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every array and check its checksum; exit 1 when a step is damaged",
    )


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from jaxzero import checkpoint  # imports jax/orbax: only for this command

    try:
        if args.verify:
            report = checkpoint.verify(args.directory, step=args.step)
        else:
            text = checkpoint.inspect(args.directory, step=args.step)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    if args.verify:
        print(report)
        return 0 if report.ok else 1
    print(text)
    return 0


COMMAND = Command(
    "inspect",
    "Inspect a jaxzero checkpoint directory.",
    _configure,
    _run,
    INSPECT_DESCRIPTION,
)
