"""The ``jaxzero`` command line (console script ``jaxzero = "jaxzero.cli:main"``)."""

from jaxzero.cli.registry import COMMANDS, Command, build_parser, main, register

__all__ = ["COMMANDS", "Command", "build_parser", "main", "register"]
