"""The library side of the one-machine launcher (its command line:
``python -m jaxzero.cli.launch``).

:func:`launch` starts ``processes`` copies of ``python -u *argv``, each with the environment
:func:`jaxzero.distributed.initialize` reads (built by :func:`process_env`):

* ``JAXZERO_COORDINATOR=<host>:<port>`` (a free port unless ``port``),
  ``JAXZERO_NUM_PROCESSES``, ``JAXZERO_PROCESS_ID``, and ``JAXZERO_BIND_ADDRESS`` (the same
  address: the coordination service listens on ``host`` only, not on every interface);
* with ``devices_per_process=K``: ``XLA_FLAGS=... --xla_force_host_platform_device_count=K``
  (K simulated CPU devices per process) and ``JAXZERO_LOCAL_DEVICE_IDS`` (process ``i`` gets
  accelerators ``i*K .. i*K+K-1``: the node's GPUs split between the processes);
* ``JAXZERO_HEARTBEAT_TIMEOUT`` with ``heartbeat_timeout``;
* on a machine with NVIDIA GPUs (:func:`jaxzero.xla_flags.gpu_present`), jaxzero's recommended
  XLA GPU flags appended to ``XLA_FLAGS`` (those the user has not set; ``xla_flags=False`` or
  ``JAXZERO_NO_XLA_FLAGS=1`` opts out), announced on stderr. Never on a CPU-only run.

Every line a process prints is forwarded with a ``[p<i>]`` prefix (stdout to stdout, stderr
to stderr). When a process fails (non-zero exit or killed by a signal) the launcher waits up
to ``grace`` seconds (default 0) for the others to stop by themselves, then terminates them
(SIGTERM, then SIGKILL) and returns the failed process's code (128+signal when killed).
``timeout`` bounds the whole run (code 124). 0 means every process exited 0.

This is a single-node launcher (for testing and one multi-GPU machine); on a cluster use the
scheduler (``srun``) and let :func:`jaxzero.distributed.initialize` auto-detect it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from jaxzero.distributed.bind import join_host_port
from jaxzero.simulate import cpu_xla_flags
from jaxzero.xla_flags import gpu_present, with_xla_flags


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and release it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(
    process_id: int,
    processes: int,
    coordinator: str,
    *,
    devices_per_process: int | None = None,
    heartbeat_timeout: int | None = None,
    base: dict | None = None,
) -> dict:
    """The environment of process ``process_id`` (``base``: default ``os.environ``)."""
    env = dict(os.environ if base is None else base)
    env["JAXZERO_COORDINATOR"] = coordinator
    env["JAXZERO_BIND_ADDRESS"] = coordinator
    env["JAXZERO_NUM_PROCESSES"] = str(processes)
    env["JAXZERO_PROCESS_ID"] = str(process_id)
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_process is not None:
        k = devices_per_process
        env["XLA_FLAGS"] = cpu_xla_flags(k, env.get("XLA_FLAGS", ""))
        env["JAXZERO_LOCAL_DEVICE_IDS"] = ",".join(
            str(d) for d in range(process_id * k, (process_id + 1) * k)
        )
    if heartbeat_timeout is not None:
        env["JAXZERO_HEARTBEAT_TIMEOUT"] = str(int(heartbeat_timeout))
    return env


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _forward(stream, out: TextIO, prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if not line.endswith("\n"):
            line += "\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen], wait: float = 5.0) -> None:
    """SIGTERM the process groups still running, SIGKILL them after ``wait`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        if all(p.poll() is not None for p in live):
            return


def _check_launch_args(argv: Sequence[str], processes, devices_per_process) -> None:
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes={processes!r} must be a positive int.")
    if devices_per_process is not None and (
        not isinstance(devices_per_process, int) or devices_per_process < 1
    ):
        raise ValueError(f"devices_per_process={devices_per_process!r} must be a positive int.")
    if not argv:
        raise ValueError("nothing to run: pass a script (and its arguments) or -m module.")


def _forward_output(
    p: subprocess.Popen, prefix: str, stdout: TextIO, stderr: TextIO, lock: threading.Lock
) -> list[threading.Thread]:
    """Daemon threads that copy ``p``'s stdout and stderr, each line prefixed, to ours."""
    threads = []
    for stream, out in ((p.stdout, stdout), (p.stderr, stderr)):
        t = threading.Thread(target=_forward, args=(stream, out, prefix, lock))
        t.daemon = True
        t.start()
        threads.append(t)
    return threads


def _wait(
    procs: list[subprocess.Popen],
    note: Callable[[str], None],
    *,
    grace: float,
    timeout: float | None,
    started: float,
) -> int:
    """Poll ``procs`` until all have exited; after the first failure wait ``grace`` seconds,
    then stop the rest; stop all at ``timeout`` seconds after ``started``. Returns the
    launch's exit code (see :func:`launch`)."""
    processes = len(procs)
    code = 0
    failed_at = None
    reported: set[int] = set()
    while True:
        for i, p in enumerate(procs):
            rc = p.poll()
            if rc is None or i in reported:
                continue
            reported.add(i)
            if rc != 0:
                if failed_at is None:
                    failed_at = time.monotonic()
                    code = _exit_code(rc)
                    others = processes - len(reported)
                    note(
                        f"process {i} {_describe(rc)}"
                        + (
                            f"; stopping the other {others} process(es)"
                            + (f" in {grace:g} s unless they exit" if grace > 0 else "")
                            if others
                            else ""
                        )
                    )
                else:
                    note(f"process {i} {_describe(rc)} on its own")
        if len(reported) == processes:
            break
        now = time.monotonic()
        if failed_at is not None and now - failed_at >= grace:
            live = [i for i, p in enumerate(procs) if p.poll() is None]
            note(f"terminating process(es) {live}")
            _stop(procs)
            for i in live:
                reported.add(i)
            break
        if timeout is not None and now - started > timeout:
            live = [i for i, p in enumerate(procs) if p.poll() is None]
            note(f"timeout after {timeout:g} s; terminating process(es) {live}")
            _stop(procs)
            code = 124
            break
        time.sleep(0.05)
    return code


def launch_base_env(env: dict | None, xla_flags: bool, gpu: bool | None = None):
    """``(environment, applied flags)``: ``env`` (default ``os.environ``) with the recommended
    XLA GPU flags when ``xla_flags`` and the processes will run on GPUs (``gpu``: default
    :func:`jaxzero.xla_flags.gpu_present` of that environment)."""
    base = dict(os.environ if env is None else env)
    if not xla_flags or not (gpu_present(base) if gpu is None else gpu):
        return base, []
    return with_xla_flags(base)


def launch(
    argv: Sequence[str],
    *,
    processes: int,
    devices_per_process: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float | None = None,
    heartbeat_timeout: int | None = None,
    grace: float = 0.0,
    env: dict | None = None,
    python: str | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    xla_flags: bool = True,
) -> int:
    """Run ``python -u *argv`` in ``processes`` local processes; return the exit code.

    ``argv`` is what follows ``python`` (``["train.py", "--lr", "1e-3"]`` or
    ``["-m", "pkg.train"]``). See the module docstring for the environment, output and
    failure handling. Returns 0 when every process exited 0; otherwise the first failed
    process's code (128+signal when it was killed by one), or 124 on ``timeout``.
    """
    _check_launch_args(argv, processes, devices_per_process)
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    lock = threading.Lock()
    started = time.monotonic()

    def note(msg: str) -> None:
        with lock:
            stderr.write(f"[launch] +{time.monotonic() - started:.1f}s {msg}\n")
            stderr.flush()

    coordinator = join_host_port(host, port or free_port(host))
    env, applied = launch_base_env(env, xla_flags)
    if applied:
        note(f"applied XLA GPU flags {' '.join(applied)} (opt out: JAXZERO_NO_XLA_FLAGS=1)")
    cmd = [python or sys.executable, "-u", *argv]
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    try:
        for i in range(processes):
            p = subprocess.Popen(
                cmd,
                env=process_env(
                    i,
                    processes,
                    coordinator,
                    devices_per_process=devices_per_process,
                    heartbeat_timeout=heartbeat_timeout,
                    base=env,
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped with its children
            )
            procs.append(p)
            threads += _forward_output(p, f"[p{i}] ", stdout, stderr, lock)
        note(
            f"started {processes} processes (coordinator {coordinator}"
            + (f", {devices_per_process} devices each" if devices_per_process else "")
            + "): "
            + " ".join(cmd[2:])
        )
        code = _wait(procs, note, grace=grace, timeout=timeout, started=started)
    except BaseException:  # KeyboardInterrupt, SIGTERM turned into SystemExit: no orphans
        _stop(procs)
        raise
    finally:
        for t in threads:
            t.join(timeout=5)
    if code == 0:
        note(f"all {processes} processes exited 0 in {time.monotonic() - started:.1f} s")
    return code
