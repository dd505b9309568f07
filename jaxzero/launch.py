"""``python -m jaxzero.launch``: start a multi-process jax program on this machine.

The command line of :func:`jaxzero.distributed.launch.launch` (see its module docstring for
the environment, output and failure handling); ``free_port``, ``process_env`` and ``launch``
are re-exported here so ``from jaxzero import launch; launch.launch(...)`` keeps working.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from jaxzero.distributed.launch import DEVICE_COUNT_FLAG as DEVICE_COUNT_FLAG
from jaxzero.distributed.launch import free_port as free_port
from jaxzero.distributed.launch import launch as launch
from jaxzero.distributed.launch import process_env as process_env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m jaxzero.launch",
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
    ap.add_argument("-m", dest="module", action="store_true", help="run a module (python -m)")
    ap.add_argument("script", help="the script (or with -m, the module) to run")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    run = (["-m"] if a.module else []) + [a.script, *a.args]

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    return launch(
        run,
        processes=a.processes,
        devices_per_process=a.devices_per_process,
        host=a.host,
        port=a.port,
        timeout=a.timeout,
        heartbeat_timeout=a.heartbeat_timeout,
        grace=a.grace,
    )


if __name__ == "__main__":
    sys.exit(main())
