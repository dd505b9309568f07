"""Which network interface a multi-process run listens on.

Process 0 serves jax's coordination service; ``jax.distributed.initialize`` binds it to
``[::]:port`` (every interface) unless it is given ``coordinator_bind_address``. A run whose
coordinator is a loopback address (every ``python -m jaxzero.cli.launch`` run on one machine)
has no reason to accept connections from other hosts, so :func:`coordinator_bind_address` binds
it to that address; otherwise the user chooses (``bind_address=`` / ``JAXZERO_BIND_ADDRESS``,
or jax's ``JAX_COORDINATOR_BIND_ADDRESS``) and jax's default stays.

The CPU backend's gloo collectives open one listener per process on the address this
machine's hostname resolves to (often 127.0.x.1, but the public address on many cloud
hosts); :func:`pin_gloo` makes them listen on the loopback coordinator's address instead.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import warnings

ENV_BIND_ADDRESS = "JAXZERO_BIND_ADDRESS"
JAX_ENV_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"


def split_host_port(address: str, what: str = "address") -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 address -> (host, port).

    Raises:
      ValueError: an empty host, an unclosed bracket, or a port that is not 0..65535.
    """
    text = str(address).strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{what}={address!r}: expected '[ipv6]' or '[ipv6]:port'.")
        port = rest[1:] if rest else None
    elif text.count(":") > 1:  # a bare IPv6 address: no port
        host, port = text, None
    else:
        host, sep, port = text.partition(":")
        port = port if sep else None
    if not host:
        raise ValueError(f"{what}={address!r} has no host.")
    if port is None:
        return host, None
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{what}={address!r}: the port must be an integer 0..65535.")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ip_is_loopback(text: str) -> bool:
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or a name) means this machine only: a loopback IP
    (127.0.0.0/8, ::1, ::ffff:127.x), ``localhost``, or a name that resolves only to those."""
    try:
        return _ip_is_loopback(host)
    except ValueError:
        pass
    if host.lower() == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(_ip_is_loopback(info[4][0]) for info in infos)


def coordinator_bind_address(
    coordinator_address: str | None, bind_address: str | None = None
) -> str | None:
    """The ``host:port`` to pass to ``jax.distributed.initialize(coordinator_bind_address=)``,
    or None for jax's default (``JAX_COORDINATOR_BIND_ADDRESS``, else every interface).

    In order: ``bind_address``, then ``JAXZERO_BIND_ADDRESS`` (either may omit the port: the
    coordinator's is used); then, unless ``JAX_COORDINATOR_BIND_ADDRESS`` is set, the
    coordinator's own address when its host is a loopback address.

    Raises:
      ValueError: a malformed address, or one without a port when the coordinator's address
        is not known here (it comes from cluster auto-detection).
    """
    what = "bind_address"
    if bind_address is None and os.environ.get(ENV_BIND_ADDRESS, "").strip():
        bind_address, what = os.environ[ENV_BIND_ADDRESS], ENV_BIND_ADDRESS
    coord = None
    if coordinator_address is not None:
        coord = split_host_port(coordinator_address, "coordinator_address")
    if bind_address is not None:
        host, port = split_host_port(bind_address, what)
        if port is None:
            if coord is None or coord[1] is None:
                raise ValueError(
                    f"{what}={bind_address!r} has no port and the coordinator's address is "
                    f"not known here (cluster auto-detection): pass 'host:port'."
                )
            port = coord[1]
        return join_host_port(host, port)
    if os.environ.get(JAX_ENV_BIND_ADDRESS) or coord is None or coord[1] is None:
        return None
    return join_host_port(*coord) if is_loopback(coord[0]) else None


def pin_gloo(host: str) -> bool:
    """Make the CPU backend's gloo collectives listen on ``host`` (call after
    ``jax.distributed.initialize``, before any backend starts). Returns False, with a
    warning, when this jax has no way to (private API moved)."""
    try:
        from jax._src import distributed as jax_distributed
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        make_gloo = _jax.make_gloo_tcp_collectives
        make_cpu_client = xla_bridge.make_cpu_client
    except (ImportError, AttributeError):
        warnings.warn(
            f"jaxzero could not pin gloo's CPU collectives to {host}: they listen on the "
            f"address this machine's hostname resolves to.",
            stacklevel=3,
        )
        return False
    import jax

    def cpu_client():
        client = jax_distributed.global_state.client
        if client is None or jax.config.jax_cpu_collectives_implementation != "gloo":
            return make_cpu_client()
        return make_cpu_client(collectives=make_gloo(distributed_client=client, hostname=host))

    # The same registration as jax's own CPU factory, with the listener's host given.
    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)
    return True
