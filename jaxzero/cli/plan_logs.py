"""What ``jaxzero plan`` does with the log lines XLA prints while it compiles, and its progress.

XLA and absl write their C++ log lines (``W1128 17:04:28.424257 4041
hlo_rematerialization.cc:3231] Can't reduce memory use below ...``) straight to file
descriptor 2, below Python's ``sys.stderr``. Left there, they land in the middle of the table
and break the progress bar, and read as failures. :func:`xla_logs_captured` points descriptor
2 at a temporary file for the compiles and hands back the lines; :func:`log_summary` sums
them up in a few lines (``--verbose`` prints them as they were). The progress goes to the
terminal the command started with: a tqdm bar when both stdout and that stream are
terminals, else one plain line per compile (no carriage returns in a log file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import textwrap
from collections import Counter

__all__ = ["Captured", "log_summary", "progress", "xla_logs_captured"]

# absl's prefix: severity, MMDD hh:mm:ss.micros, thread id, file:line]
_ABSL = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\s\]]+:\d+)\] ?(.*)$")
_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to"
_SEVERITY = {"I": "info", "W": "warning", "E": "error", "F": "fatal"}
# what a kind means for the plan, where it is known
_MEANING = {
    "hlo_rematerialization": "(XLA's rematerialisation missed a memory target of its own: not "
    "an error; the verdict judges the compiled peak)",
    "cudart_stub": "(no CUDA driver on this machine: expected, the compiles are deviceless)",
}


@dataclasses.dataclass
class Captured:
    """The lines descriptor 2 received during :func:`xla_logs_captured` (filled in when it
    exits) and the stream progress should write to meanwhile."""

    stream: object
    lines: list[str] = dataclasses.field(default_factory=list)


def _writes_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def xla_logs_captured():
    """Point file descriptor 2 at a temporary file; yield a :class:`Captured` whose ``stream``
    still reaches the original stderr (``sys.stderr`` itself where it does not write to
    descriptor 2, e.g. under pytest's capsys). Descriptor 2 is restored on the way out,
    exceptions included, and ``lines`` holds what it received. The lines go to
    ``$TMPDIR/jaxzero-plan-xla-*.log``, removed then; a process XLA aborts leaves it behind."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    stream = os.fdopen(os.dup(saved), "w", buffering=1) if _writes_fd2(sys.stderr) else sys.stderr
    captured = Captured(stream)
    # a named file, removed on the way out: if XLA aborts the process, its lines stay there
    fd, path = tempfile.mkstemp(prefix="jaxzero-plan-xla-", suffix=".log")
    os.dup2(fd, 2)
    try:
        yield captured
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if stream is not sys.stderr:
            stream.close()
        with os.fdopen(fd, "rb") as f:
            f.seek(0)
            text = f.read().decode("utf-8", errors="replace")
        os.unlink(path)
        captured.lines = [line for line in text.splitlines() if line.strip()]


def _kind(line: str) -> tuple[str, str, str]:
    """``(severity, source, message)`` of one captured line: absl's ``file.cc:123`` source, or
    ``"absl"`` for its "before InitializeLog" preamble, or ``"other"``."""
    m = _ABSL.match(line)
    if m:
        return _SEVERITY[m[1]], m[2], m[3]
    if line.startswith(_PREAMBLE):
        return "info", "absl", line
    return "-", "other", line


def log_summary(lines: list[str], width: int = 100) -> list[str]:
    """A few lines saying what XLA printed during the compiles: the count, then per kind
    (source file and line) its count, severity and first message, cut to ``width``, and
    what it means for the plan where that is known; ``[]`` when nothing was printed."""
    if not lines:
        return []
    kinds = Counter()
    first = {}
    for line in lines:
        severity, source, message = _kind(line)
        kinds[(severity, source)] += 1
        first.setdefault((severity, source), message)
    out = [
        f"XLA printed {len(lines)} log line{'s' * (len(lines) > 1)} during the compiles "
        f"({len(kinds)} kind{'s' * (len(kinds) > 1)}; --verbose prints them):"
    ]
    for (severity, source), count in kinds.most_common():
        line = f"  {count} x {severity} {source}: {first[(severity, source)]}"
        out.append(line if len(line) <= width else line[: width - 3] + "...")
        meaning = _MEANING.get(source.split(":")[0].removesuffix(".cc"))
        if meaning:
            out += textwrap.wrap(meaning, width, initial_indent="    ", subsequent_indent="    ")
    return out


def progress(total_hint: int, stream=None):
    """``(on_case, close)``: a tqdm bar on ``stream`` (default ``sys.stderr``) when it and
    stdout are terminals, else one plain line per compile."""
    stream = sys.stderr if stream is None else stream
    tty = all(getattr(s, "isatty", lambda: False)() for s in (stream, sys.stdout))
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not tty:

        def on_case(label, i, total):
            print(f"[{i + 1}/{total}] compiling stage {label} ...", file=stream, flush=True)

        return on_case, lambda: None
    bar = tqdm(total=total_hint, desc="compiling", unit="stage", file=stream, leave=False)

    def on_case(label, i, total):
        bar.n = i
        bar.set_postfix_str(f"stage {label}")  # refreshes the bar

    def close():
        bar.n = bar.total
        bar.close()

    return on_case, close
