"""What Orbax and tensorstore print during jaxzero's checkpoint calls, kept off the user's
stderr; nothing else is silenced, and only while a jaxzero call runs.

* :func:`orbax_calls`: Orbax logs ``Metadata file does not exist: <step>/_CHECKPOINT_METADATA``
  (absl, WARNING) at every read of a step saved without its step metadata file, then reads
  the step as usual. That one message is dropped from the ``absl`` logger while the
  call runs.
* :func:`collect_leftovers`: a read that fails inside Orbax's asyncio restore leaves the reads of
  the other arrays behind (coroutines never awaited, tasks and futures whose exception nobody
  retrieved, a closed event loop). Python reports them when it collects them, which may be
  at any later point of the user's program. After a failed read they are collected at once,
  with asyncio's reports of exactly those leftovers, the never-awaited-coroutine warnings and
  the unraisable exceptions they raise dropped; the read's error is reported by jaxzero. A
  leftover still running then (its read not yet failed, on a loaded machine) is collected
  later, at the latest when the interpreter exits: from the first failed read on, the
  unraisable exceptions and asyncio's reports of Orbax's own coroutines and tasks (their
  code in the ``orbax`` package) are dropped whenever they come, and so is the
  ``RuntimeError: Event loop is closed`` that tensorstore reports when a read it still ran
  completes after Orbax closed the loop awaiting it (its done callback's
  ``loop.call_soon_threadsafe``, reported with no object); nothing else is.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator

# Orbax's message (absl logger, WARNING) for a step without _CHECKPOINT_METADATA.
_ABSL_DROPPED = ("Metadata file does not exist",)
# asyncio's reports (asyncio logger, ERROR) of what a failed gather leaves behind.
_ASYNCIO_DROPPED = (
    "Task exception was never retrieved",
    "Future exception was never retrieved",
    "Task was destroyed but it is pending",
)


class _Drop(logging.Filter):
    """Drops the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_ABSL = _Drop(_ABSL_DROPPED)
_ASYNCIO = _Drop(_ASYNCIO_DROPPED)
_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def orbax_calls() -> Iterator[None]:
    """Orbax's missing-step-metadata warning dropped while the block runs (re-entrant)."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            logging.getLogger("absl").addFilter(_ABSL)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                logging.getLogger("absl").removeFilter(_ABSL)


def _leftover(unraisable) -> bool:
    """An unraisable exception from what a failed asyncio read left behind."""
    import asyncio
    import inspect

    obj = unraisable.object
    if inspect.iscoroutine(obj) or isinstance(obj, asyncio.Future):
        return True
    return isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
        unraisable.exc_value
    )


class _DropOrbaxLater(logging.Filter):
    """asyncio's reports (:data:`_ASYNCIO_DROPPED`) of a task of Orbax's."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith(_ASYNCIO_DROPPED) and f"{os.sep}orbax{os.sep}" in text)


_later_installed = False


def _drop_orbax_leftovers_later() -> None:
    """From now on, drop the unraisable exceptions and asyncio's reports of Orbax's own
    leftovers whenever they are collected (installed once)."""
    global _later_installed
    with _lock:
        if _later_installed:
            return
        _later_installed = True

    # the hook may run while the interpreter exits, its modules' globals cleared: it reads
    # only what it was given here
    def hook(
        unraisable,
        previous=sys.unraisablehook,
        marker=f"{os.sep}orbax{os.sep}",
        asyncio_dir=f"{os.sep}asyncio{os.sep}",
    ):
        obj = unraisable.object
        get_coro = getattr(obj, "get_coro", None)
        code = getattr(get_coro() if callable(get_coro) else obj, "cr_code", None)
        if code is not None and marker in code.co_filename:
            return
        # a tensorstore read that completes after Orbax closed its loop: tensorstore's done
        # callback, native code, calls loop.call_soon_threadsafe and reports the
        # RuntimeError with no object (PyErr_WriteUnraisable(NULL))
        tb = getattr(unraisable, "exc_traceback", None)
        if (
            obj is None
            and isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
            and tb is not None
            and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
            and asyncio_dir in tb.tb_frame.f_code.co_filename
        ):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_DropOrbaxLater())


def collect_leftovers() -> None:
    """Collect what a failed read left behind now, with Python's and asyncio's reports of it
    dropped (call it once the read's exception is no longer referenced), and drop the reports
    of Orbax's leftovers still running from now on."""
    _drop_orbax_leftovers_later()
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _leftover(unraisable):
            previous(unraisable)

    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addFilter(_ASYNCIO)
    sys.unraisablehook = hook
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
            )
            gc.collect()
    finally:
        sys.unraisablehook = previous
        asyncio_logger.removeFilter(_ASYNCIO)
