"""Start a multi-process jax program on this machine.

    python -m jaxzero.cli.launch --processes 2 --devices-per-process 4 train.py [args...]
    python -m jaxzero.cli.launch --processes 2 -m mypackage.train [args...]

Starts ``--processes`` copies of ``python -u train.py args...``, each with the environment
:func:`jaxzero.distributed.initialize` reads:

* ``JAXZERO_COORDINATOR=127.0.0.1:<port>`` (a free port unless ``--port``),
  ``JAXZERO_NUM_PROCESSES``, ``JAXZERO_PROCESS_ID``, and ``JAXZERO_BIND_ADDRESS`` (the same
  address: the coordination service listens on ``--host`` only, not on every interface);
* with ``--devices-per-process K``: ``XLA_FLAGS=... --xla_force_host_platform_device_count=K``
  (K simulated CPU devices per process) and ``JAXZERO_LOCAL_DEVICE_IDS`` (process ``i`` gets
  accelerators ``i*K .. i*K+K-1``: the node's GPUs split between the processes);
* ``JAXZERO_HEARTBEAT_TIMEOUT`` with ``--heartbeat-timeout``;
* on a machine with NVIDIA GPUs, jaxzero's recommended XLA GPU flags in ``XLA_FLAGS`` (those
  not already set there; ``--no-xla-flags`` or ``JAXZERO_NO_XLA_FLAGS=1`` opts out), printed.

Every line a process prints is forwarded with a ``[p<i>]`` prefix (stdout to stdout, stderr
to stderr). When a process fails (non-zero exit or killed by a signal) the launcher waits up
to ``--grace`` seconds (default 0) for the others to stop by themselves, then terminates them
(SIGTERM, then SIGKILL) and exits with the failed process's code (128+signal when killed).
``--timeout`` bounds the whole run (exit code 124). Exit code 0 means every process exited 0.

This is a single-node launcher (for testing and one multi-GPU machine); on a cluster use the
scheduler (``srun``) and let :func:`jaxzero.distributed.initialize` auto-detect it.

This is the command line only (``build_parser``, ``parse_args``, ``main``); the library side
(``launch``, ``process_env``, ``free_port``) is :mod:`jaxzero.distributed.launch`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from jaxzero.cli.command import pick
from jaxzero.distributed.launch import launch


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (``python -m jaxzero.cli.launch --help``)."""
    ap = argparse.ArgumentParser(
        prog="python -m jaxzero.cli.launch",
        description="Run a jax program in several local processes (jaxzero.distributed).",
    )
    ap.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
    ap.add_argument(
        "--devices-per-process",
        type=int,
        help="simulated CPU devices per process (XLA_FLAGS), and the accelerators each "
        "process uses (process i: i*K .. i*K+K-1)",
    )
    ap.add_argument("--host", default="127.0.0.1", help="coordinator host (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    ap.add_argument("--timeout", type=float, help="stop everything after this many seconds")
    ap.add_argument(
        "--heartbeat-timeout",
        type=int,
        help="seconds without heartbeat after which jax declares a process dead (jax: 100)",
    )
    ap.add_argument(
        "--grace",
        type=float,
        default=0.0,
        help="after a process fails, wait this long for the others to exit before stopping them",
    )
    ap.add_argument(
        "--no-xla-flags",
        dest="xla_flags",
        action="store_false",
        help="do not add jaxzero's recommended XLA GPU flags (only added on GPU machines)",
    )
    ap.add_argument("-m", dest="module", action="store_true", help="run a module (python -m)")
    ap.add_argument("script", help="the script (or with -m, the module) to run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's arguments parsed from ``argv`` (default ``sys.argv[1:]``)."""
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    run = (["-m"] if a.module else []) + [a.script, *a.args]

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    names = ("processes", "devices_per_process", "host", "port", "timeout", "heartbeat_timeout")
    names += ("xla_flags",)
    return launch(run, grace=a.grace, **pick(a, *names))


if __name__ == "__main__":
    sys.exit(main())
