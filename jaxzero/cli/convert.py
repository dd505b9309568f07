"""``jaxzero convert DIRECTION``: conversions between jaxzero checkpoints and other formats.

Each converter module in :data:`CONVERTERS` adds its directions with
``add_subcommands(subparsers)``, giving every direction's parser the defaults ``_convert``
(``run(args, parser) -> int``), and lists them in ``DIRECTIONS``; its ``DESCRIPTION`` joins
the command's help. To add a converter, write such a module and append it here.

``--devices N`` on a machine without a GPU runs on N simulated CPU devices
(:func:`jaxzero.cli.backend.simulate_devices`, before jax starts a backend).
"""

from __future__ import annotations

import argparse

import jaxzero.cli.convert_deepspeed as convert_deepspeed
import jaxzero.cli.convert_torch as convert_torch
from jaxzero.cli.backend import simulate_devices
from jaxzero.cli.command import Command, Parser

CONVERTERS = (convert_torch, convert_deepspeed)


def _configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION", parser_class=Parser)
    for converter in CONVERTERS:
        converter.add_subcommands(sub)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    run = getattr(args, "_convert", None)
    if run is None:
        directions = [d for c in CONVERTERS for d in c.DIRECTIONS]
        parser.error(f"choose a direction: {' or '.join(directions)}")
    simulate_devices(getattr(args, "devices", None))
    return run(args, args._convert_parser)


COMMAND = Command(
    "convert",
    "Convert torch ZeRO(AdamW) and DeepSpeed ZeRO checkpoints to jaxzero and back.",
    _configure,
    _run,
    "\n".join(c.DESCRIPTION for c in CONVERTERS),
)
