"""The ``jaxzero`` command line (console script ``jaxzero = "jaxzero.cli:main"``): the
registry of subcommands and the entry point.

Each subcommand module (:mod:`~jaxzero.cli.estimate`, :mod:`~jaxzero.cli.inspect`,
:mod:`~jaxzero.cli.convert`, :mod:`~jaxzero.cli.plan`) defines a :class:`~jaxzero.cli.command.Command` named
``COMMAND``: a ``configure(parser)`` that adds its arguments and a
``run(args, parser) -> int`` that does the work (reporting bad input with
``parser.error(msg)``). This module imports them and registers them in :data:`COMMANDS`; to
add one, write such a module and add its command to :data:`BUILTIN`. Others can call
:func:`register` themselves. :func:`main` builds one subparser per registered command,
in registration order.

The registry lives in this ``__init__`` rather than in a ``main.py``: ``jaxzero.cli.main`` must
be the function (for the console script) and would hide such a module, and ``COMMANDS`` stays
one module attribute that callers (and tests) can patch.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from jaxzero.cli.backend import select_cpu_without_gpu
from jaxzero.cli.command import Command, Parser
from jaxzero.cli.convert import COMMAND as CONVERT
from jaxzero.cli.estimate import COMMAND as ESTIMATE
from jaxzero.cli.inspect import COMMAND as INSPECT
from jaxzero.cli.plan import COMMAND as PLAN

__all__ = ["COMMANDS", "Command", "Parser", "build_parser", "main", "register"]

PROG = "jaxzero"
BUILTIN = (ESTIMATE, INSPECT, CONVERT, PLAN)
COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add ``command`` to the registry (a name may be registered once)."""
    if command.name in COMMANDS:
        raise ValueError(f"subcommand {command.name!r} is already registered; pick another name")
    COMMANDS[command.name] = command
    return command


for _command in BUILTIN:
    register(_command)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per registered command."""
    parser = Parser(prog=PROG, description="ZeRO memory sharding for JAX: command-line tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
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
    ``SystemExit(2)``. On a machine without an NVIDIA GPU that has jax's CUDA plugin, the
    command runs on jax's CPU platform (:mod:`jaxzero.cli.backend`: no CUDA plugin traceback;
    deviceless GPU compiles still work).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"choose a command: {', '.join(COMMANDS)}")
    select_cpu_without_gpu()
    code = args._command.run(args, args._parser)
    return 0 if code is None else code
