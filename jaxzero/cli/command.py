"""What every ``jaxzero`` subcommand shares: the parser whose errors are one line, the
:class:`Command` record the registry holds, and argument types."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable


class Parser(argparse.ArgumentParser):
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


def positive_int(text: str) -> int:
    """An argument type: an int > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


_ARGUMENT = re.compile(r"(?<!`)`(\w+)`(?!`)")


def as_flags(message: str) -> str:
    """A library message with the arguments it names in backticks (`` `world_size` ``) shown
    as this command line's flags (``--world-size``)."""
    return _ARGUMENT.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


def pick(args: argparse.Namespace, *names: str) -> dict:
    """``{name: args.name}`` for ``names``: parsed flags handed on as keyword arguments."""
    return {name: getattr(args, name) for name in names}
