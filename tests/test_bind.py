"""A one-machine run listens on loopback only.

The multi-process tests start ``python -m jaxzero.cli.launch`` and, while its processes run, read
their listening TCP sockets from ``/proc`` (the socket inodes in ``/proc/<pid>/fd``, matched
against ``/proc/<pid>/net/tcp`` and ``tcp6``), then check the run's numbers. The address
choice itself (``coordinator_bind_address``) is checked without starting jax.
"""

import ipaddress
import os
import re
import socket
import subprocess
import sys
import time

import jax
import pytest

from jaxzero.distributed import bind, launch, runtime

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import test_multiprocess as mp  # noqa: E402  (its worker, environment and reference run)

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
POLL = 0.1


# ------------------------------------------------------------------ reading /proc
def _decode(hex_addr: str) -> tuple[str, int]:
    """``0100007F:1F90`` (tcp) or a 32-hex-digit tcp6 address -> ("127.0.0.1", 8080)."""
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    # the kernel prints each 32-bit word in host (little-endian) byte order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
        if m:
            out.add(m.group(1))
    return out


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == LISTEN and cols[9] in inodes:
                found.add(_decode(cols[1]))
    return found


def children(ppid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
            pids.append(int(name))
    return pids


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def launch_and_watch(tmp_path, argv, *, host=None, timeout=mp.RUN_TIMEOUT):
    """Run the launcher CLI on ``argv``; while it runs, poll its children's listeners.
    Returns (exit code, log text, {pid: {(address, port), ...}})."""
    cmd = [sys.executable, "-m", "jaxzero.cli.launch", "--processes", "2"]
    cmd += ["--devices-per-process", "4", "--timeout", str(timeout)]
    cmd += ["--host", host] if host else []
    log_path = tmp_path / "launch.log"
    seen: dict[int, set] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd + argv, cwd=ROOT, env=mp.env(), stdout=log, stderr=log)
        deadline = time.monotonic() + timeout + 30
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                for pid in children(proc.pid):
                    try:
                        seen.setdefault(pid, set()).update(listeners(pid))
                    except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
                        pass
                time.sleep(POLL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
    return proc.returncode, log_path.read_text(), seen


def coordinator_port(log: str) -> int:
    m = re.search(r"coordinator \S+:(\d+)", log)
    assert m, log[-3000:]
    return int(m.group(1))


def check_listeners(seen, log, *, allowed):
    """Both processes listened (gloo), process 0 served the coordinator's port, and every
    address satisfies ``allowed``."""
    everything = {a for s in seen.values() for a in s}
    assert sum(1 for s in seen.values() if s) == 2, (seen, log[-3000:])
    assert coordinator_port(log) in {port for _, port in everything}, (seen, log[-3000:])
    wrong = sorted(a for a in everything if not allowed(a[0]))
    assert not wrong, f"listening on {wrong} (all: {sorted(everything)})"


# ------------------------------------------------------------------ multi-process
@pytest.mark.multiprocess
def test_launch_listens_on_loopback_only_and_gives_the_same_numbers(tmp_path):
    """The default launch (coordinator 127.0.0.1): the coordination service and gloo listen on
    loopback only, and 2 x 4 devices still equal the 1 x 8 reference."""
    out = tmp_path / "out"
    rc, log, seen = launch_and_watch(tmp_path, [mp.WORKER, "--out", str(out)])
    assert rc == 0, log[-4000:]
    check_listeners(seen, log, allowed=is_loopback)
    mp.check_worker_output(mp.load(out))


SUM_OF_SQUARES = """
import time
from jaxzero import distributed as dist
assert dist.initialize()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jaxzero as jz
n = 4 * jax.device_count()
rows = np.arange(n, dtype=np.float32).reshape(jax.process_count(), -1)[jax.process_index()]
x = jax.make_array_from_process_local_data(NamedSharding(jz.data_parallel_mesh(), P("data")), rows)
total = jax.jit(lambda a: jnp.sum(a * a), out_shardings=NamedSharding(x.sharding.mesh, P()))(x)
print("total", int(total), flush=True)
time.sleep(2)  # let the test's poll see every listener even on a loaded machine
"""


def _can_bind(host: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


@pytest.mark.multiprocess
def test_launch_binds_everything_to_its_host(tmp_path):
    """``--host 127.0.0.2``: the coordination service AND gloo's listeners are on exactly that
    address (gloo would otherwise take what the hostname resolves to), and a cross-process
    reduction gives sum(i^2, i < n) = (n-1) n (2n-1) / 6."""
    host = "127.0.0.2"
    if not _can_bind(host):
        pytest.skip(f"{host} is not a local address here")
    program = tmp_path / "sum_of_squares.py"
    program.write_text(SUM_OF_SQUARES)
    rc, log, seen = launch_and_watch(tmp_path, [str(program)], host=host)
    assert rc == 0, log[-4000:]
    check_listeners(seen, log, allowed=lambda a: a in (host, f"::ffff:{host}"))
    n = 4 * 8
    for i in range(2):
        assert f"[p{i}] total {(n - 1) * n * (2 * n - 1) // 6}" in log, log[-3000:]


# ------------------------------------------------------------------ the address choice
@pytest.fixture
def no_bind_env(monkeypatch):
    monkeypatch.delenv(bind.ENV_BIND_ADDRESS, raising=False)
    monkeypatch.delenv(bind.JAX_ENV_BIND_ADDRESS, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "coordinator, want",
    [
        ("127.0.0.1:1234", "127.0.0.1:1234"),
        ("127.0.0.2:99", "127.0.0.2:99"),
        ("localhost:1234", "localhost:1234"),
        ("[::1]:1234", "[::1]:1234"),
        ("10.1.2.3:1234", None),  # another host may be the coordinator: jax's default
        ("[2001:db8::1]:1234", None),
        (None, None),  # cluster auto-detection
    ],
)
def test_bind_address_defaults_to_a_loopback_coordinator(no_bind_env, coordinator, want):
    assert bind.coordinator_bind_address(coordinator) == want


def test_bind_address_from_the_user(no_bind_env):
    f = bind.coordinator_bind_address
    assert f("10.1.2.3:1234", "10.1.2.3") == "10.1.2.3:1234"  # the coordinator's port
    assert f("10.1.2.3:1234", "0.0.0.0:5555") == "0.0.0.0:5555"
    assert f("10.1.2.3:1234", "fe80::1") == "[fe80::1]:1234"
    assert f("127.0.0.1:1234", "[::]") == "[::]:1234"  # the user may open it up again
    assert f(None, "10.1.2.3:77") == "10.1.2.3:77"
    no_bind_env.setenv(bind.ENV_BIND_ADDRESS, "192.168.0.9")
    assert f("10.1.2.3:1234") == "192.168.0.9:1234"
    assert f("10.1.2.3:1234", "10.0.0.1") == "10.0.0.1:1234"  # the argument wins
    no_bind_env.delenv(bind.ENV_BIND_ADDRESS)
    no_bind_env.setenv(bind.JAX_ENV_BIND_ADDRESS, "[::]:1234")
    assert f("127.0.0.1:1234") is None  # jax's own variable is respected


@pytest.mark.parametrize(
    "coordinator, given, message",
    [
        (None, "10.1.2.3", "has no port"),
        ("127.0.0.1:1", "10.1.2.3:http", "port must be an integer"),
        ("127.0.0.1:1", "10.1.2.3:70000", "port must be an integer"),
        ("127.0.0.1:1", "[::1", r"expected '\[ipv6\]'"),
        ("127.0.0.1:1", ":80", "has no host"),
    ],
)
def test_bind_address_errors(no_bind_env, coordinator, given, message):
    with pytest.raises(ValueError, match=message):
        bind.coordinator_bind_address(coordinator, given)
    no_bind_env.setenv(bind.ENV_BIND_ADDRESS, given)
    with pytest.raises(ValueError, match=bind.ENV_BIND_ADDRESS):
        bind.coordinator_bind_address(coordinator)


def test_is_loopback():
    for host in ("127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1", "localhost", "LOCALHOST"):
        assert bind.is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "192.0.2.2", "::ffff:10.0.0.1", "2001:db8::1"):
        assert not bind.is_loopback(host), host
    assert not bind.is_loopback("no-such-host.invalid")


def test_launcher_environment_binds_to_its_host():
    env = launch.process_env(1, 2, "127.0.0.2:4321", base={})
    assert env["JAXZERO_BIND_ADDRESS"] == env["JAXZERO_COORDINATOR"] == "127.0.0.2:4321"


def test_launcher_environment_brackets_ipv6():
    env = launch.process_env(0, 2, "[::1]:4321", base={})
    assert env["JAXZERO_BIND_ADDRESS"] == "[::1]:4321"


def test_initialize_passes_the_bind_address_and_pins_gloo(no_bind_env):
    """What ``initialize`` hands to jax (jax's own initialize replaced: nothing connects)."""
    calls = []
    no_bind_env.setattr(jax.distributed, "is_initialized", lambda: False)
    no_bind_env.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    no_bind_env.setattr(runtime, "pin_gloo", lambda host: calls.append({"gloo": host}))
    init = runtime.initialize
    assert init("127.0.0.1:1234", 2, 0, cpu_collectives=None)
    assert calls[0]["coordinator_bind_address"] == "127.0.0.1:1234"
    if jax.config.jax_cpu_collectives_implementation == "gloo":  # jax's default
        assert calls[1:] == [{"gloo": "127.0.0.1"}]
    calls.clear()
    assert init("10.0.0.1:1234", 2, 1, cpu_collectives=None)
    assert len(calls) == 1 and "coordinator_bind_address" not in calls[0]  # jax's default
    calls.clear()
    assert init("10.0.0.1:1234", 2, 0, cpu_collectives=None, bind_address="10.0.0.1")
    assert len(calls) == 1 and calls[0]["coordinator_bind_address"] == "10.0.0.1:1234"
