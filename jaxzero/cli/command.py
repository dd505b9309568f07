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


_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def memory_size(text: str) -> int:
    """A byte size flag (``80GB``, ``79.6GiB``, ``24000MB``) as bytes."""
    from jaxzero import memory

    try:
        return memory.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def param_count(text: str) -> int:
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


def run_conversion(convert, args: argparse.Namespace, parser, summary, errors=(ValueError,)):
    """Run a ``jaxzero convert`` direction: ``convert()`` then print ``summary(result)``.

    ``--out`` is required unless ``--dry-run``; ``errors`` (plus FileNotFoundError and
    ImportError) become one stderr line naming the flags (exit status 2).
    """
    try:
        if not args.dry_run and args.out is None:
            raise ValueError("`out` is required (or `dry_run`)")
        result = convert()
    except (*errors, ValueError, FileNotFoundError, ImportError) as e:
        parser.error(as_flags(str(e)))
    print(summary(result))
    return 0
