"""The runtime side of a multi-process run: :func:`initialize` (connect the processes, cluster
detection), the batch of each process (:func:`process_batch_slice`, :func:`global_batch`),
and cross-process checks and results (:func:`check_same_on_all_processes`,
:func:`gather_to_host`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxzero.distributed.bind import (
    coordinator_bind_address,
    is_loopback,
    pin_gloo,
    split_host_port,
)
from jaxzero.trees import batch_rows
from jaxzero.xla_flags import apply_xla_flags

ENV_COORDINATOR = "JAXZERO_COORDINATOR"
ENV_NUM_PROCESSES = "JAXZERO_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXZERO_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAXZERO_LOCAL_DEVICE_IDS"
ENV_HEARTBEAT_TIMEOUT = "JAXZERO_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "JAXZERO_INIT_TIMEOUT"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer.") from None


def cluster_detected() -> bool:
    """Whether jax's own auto-detection would find a cluster (SLURM, Open MPI, Cloud TPU,
    Kubernetes, or ``JAX_COORDINATOR_ADDRESS``) in this environment."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    try:
        from jax._src import clusters

        return any(
            not env.opt_in_only_method and env.is_env_present()
            for env in clusters.ClusterEnv._cluster_types
        )
    except Exception:  # noqa: BLE001 - private API moved: fall back to the common variables
        return any(
            k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_ID")
        )


def _cpu_platform_possible() -> bool:
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    return not platforms or "cpu" in platforms.split(",")


# The arguments of initialize() that the launcher's environment variables can fill in.
_LAUNCH_ARGS = (
    "coordinator_address",
    "num_processes",
    "process_id",
    "local_device_ids",
    "heartbeat_timeout_seconds",
    "initialization_timeout",
)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    cpu_collectives: str | None = "gloo",
    heartbeat_timeout_seconds: int | None = None,
    initialization_timeout: int | None = None,
    shutdown_timeout_seconds: int | None = None,
    cluster_detection_method: str | None = None,
    bind_address: str | None = None,
    xla_flags: bool = True,
) -> bool:
    """Connect this process to the others: a thin wrapper over ``jax.distributed.initialize``.

    Call it first, before anything that starts a jax backend (``jax.devices()``, creating
    arrays, ``model.init``). Unset arguments come from, in order:

    1. the environment ``python -m jaxzero.cli.launch`` sets: ``JAXZERO_COORDINATOR``
       (``host:port`` of process 0), ``JAXZERO_NUM_PROCESSES``, ``JAXZERO_PROCESS_ID``,
       ``JAXZERO_LOCAL_DEVICE_IDS`` (comma-separated), ``JAXZERO_HEARTBEAT_TIMEOUT`` and
       ``JAXZERO_INIT_TIMEOUT`` (seconds), ``JAXZERO_BIND_ADDRESS``;
    2. jax's cluster auto-detection (SLURM, Open MPI, Cloud TPU, ``JAX_COORDINATOR_ADDRESS``;
       ``cluster_detection_method="mpi4py"`` for other MPIs).

    When neither gives anything (a plain single-process run), nothing is initialised and
    False is returned, so scripts can call it unconditionally.

    Args:
      coordinator_address: ``host:port`` where process 0 serves the coordination service.
      num_processes: total number of processes.
      process_id: this process's index, ``0..num_processes-1``.
      local_device_ids: restrict this process to these local accelerators (GPU ids).
      cpu_collectives: cross-process collectives of the CPU backend (``"gloo"`` or
        ``"mpi"``), set when the CPU platform may be used; None leaves jax's setting.
      heartbeat_timeout_seconds: a process that sends no heartbeat for this long is declared
        dead and every other process is stopped with an error (jax's default: 100 s).
      initialization_timeout: how long to wait for all processes to connect (default 300 s).
      shutdown_timeout_seconds: how long a finishing process waits for the others at exit.
      cluster_detection_method: passed to jax (e.g. ``"mpi4py"``, ``"deactivate"``).
      bind_address: the interface (``host`` or ``host:port``) process 0's coordination
        service listens on. Default: ``JAXZERO_BIND_ADDRESS``; else, when the coordinator is a
        loopback address (one machine), that address only, and gloo's listeners too; else
        jax's default (``JAX_COORDINATOR_BIND_ADDRESS``, or every interface).
      xla_flags: first :func:`jaxzero.xla_flags.apply_xla_flags` (GPU runs only; any count).

    Returns: True when the process is (now, or already was) part of a distributed run.
    Raises:
      RuntimeError: a jax backend was already started (from ``jax.distributed.initialize``).
      ValueError: a malformed ``JAXZERO_*`` variable or ``bind_address``.
    """
    _ = xla_flags and apply_xla_flags()
    if jax.distributed.is_initialized():
        return True
    given = (coordinator_address, num_processes, process_id, local_device_ids)
    given += (heartbeat_timeout_seconds, initialization_timeout)
    args, from_env = _from_launch_env(dict(zip(_LAUNCH_ARGS, given, strict=True)))
    explicit = (args["coordinator_address"], args["num_processes"], args["process_id"])
    if all(v is None for v in explicit) and cluster_detection_method is None:
        if not cluster_detected():
            return False  # a single-process run: nothing to connect
    if from_env:
        _check_complete(explicit)
        if cluster_detection_method is None:
            # The launcher's variables are complete; a surrounding SLURM allocation must not
            # override them (jax would e.g. pin each process to GPU $SLURM_LOCALID).
            cluster_detection_method = "deactivate"
    if cpu_collectives is not None and _cpu_platform_possible():
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    bind = coordinator_bind_address(args["coordinator_address"], bind_address)
    kwargs = dict(
        args,
        cluster_detection_method=cluster_detection_method,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
        coordinator_bind_address=bind,
    )
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if v is not None})
    _pin_gloo_on_one_machine(args["coordinator_address"])
    return True


def _pin_gloo_on_one_machine(coordinator_address: str | None) -> None:
    """A loopback coordinator means every process runs on this machine: gloo's listeners
    then bind to that address too (not to what the hostname resolves to)."""
    if coordinator_address is None or not _cpu_platform_possible():
        return
    host = split_host_port(coordinator_address, "coordinator_address")[0]
    if jax.config.jax_cpu_collectives_implementation == "gloo" and is_loopback(host):
        pin_gloo(host)


def _from_launch_env(args: dict) -> tuple[dict, bool]:
    """:func:`initialize`'s ``args`` with the unset ones read from the environment
    ``python -m jaxzero.cli.launch`` sets, and whether any of the three connection arguments
    (coordinator, number of processes, process id) came from it."""
    args = dict(args)
    from_env = False
    if args["coordinator_address"] is None and os.environ.get(ENV_COORDINATOR):
        args["coordinator_address"] = os.environ[ENV_COORDINATOR]
        from_env = True
    for key, env in (("num_processes", ENV_NUM_PROCESSES), ("process_id", ENV_PROCESS_ID)):
        if args[key] is None:
            args[key] = _env_int(env)
            from_env = from_env or args[key] is not None
    if args["local_device_ids"] is None and os.environ.get(ENV_LOCAL_DEVICE_IDS):
        raw = os.environ[ENV_LOCAL_DEVICE_IDS]
        try:
            args["local_device_ids"] = [int(v) for v in raw.split(",") if v.strip()]
        except ValueError:
            raise ValueError(
                f"{ENV_LOCAL_DEVICE_IDS}={raw!r} must be comma-separated integers."
            ) from None
    for key, env in (
        ("heartbeat_timeout_seconds", ENV_HEARTBEAT_TIMEOUT),
        ("initialization_timeout", ENV_INIT_TIMEOUT),
    ):
        if args[key] is None:
            args[key] = _env_int(env)
    return args, from_env


def _check_complete(explicit: tuple) -> None:
    """Raise when the launch environment gave only some of the three connection arguments."""
    if None in explicit:
        missing = [
            name
            for name, v in zip(
                (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID), explicit, strict=True
            )
            if v is None
        ]
        raise ValueError(
            f"incomplete jaxzero launch environment: {', '.join(missing)} not set (set all "
            f"three, or start the processes with `python -m jaxzero.cli.launch`)."
        )


# --------------------------------------------------------------------------------- data
def _batch_sharding(zero_or_sharding) -> NamedSharding:
    if isinstance(zero_or_sharding, NamedSharding):
        return zero_or_sharding
    mesh = getattr(zero_or_sharding, "mesh", None)
    spec = getattr(zero_or_sharding, "batch_spec", None)
    if mesh is None or spec is None:
        raise TypeError(
            f"expected a jaxzero.ZeRO (or the batch NamedSharding), got "
            f"{type(zero_or_sharding).__name__}."
        )
    return NamedSharding(mesh, spec())


def _local_blocks(sharding: NamedSharding, n: int) -> list[tuple[int, int]]:
    """Sorted distinct (start, stop) row blocks of a length-``n`` batch on this process."""
    blocks = set()
    for idx in sharding.addressable_devices_indices_map((n,)).values():
        s = idx[0]
        blocks.add((s.start or 0, n if s.stop is None else s.stop))
    return sorted(blocks)


def process_batch_slice(zero, global_batch_size: int) -> slice:
    """The rows of a global batch of ``global_batch_size`` examples that this process loads.

    With the default mesh (``jax.devices()`` order, processes in order) process ``p`` of
    ``P`` owns the contiguous rows ``[p*B/P, (p+1)*B/P)``. Pass those rows (and only those) to
    :func:`global_batch`; the result then equals a single-process run on the full batch.

    Raises:
      ValueError: the batch does not split evenly over the mesh's devices, or this process's
        devices do not hold one contiguous block of rows (a mesh built from a device order
        that interleaves processes).
    """
    sharding = _batch_sharding(zero)
    n = int(global_batch_size)
    shards = sharding.mesh.size
    if n % shards:
        raise ValueError(f"global batch size {n} is not divisible by the mesh's {shards} devices.")
    blocks = _local_blocks(sharding, n)
    lo, hi = blocks[0][0], blocks[-1][1]
    covered = sum(b - a for a, b in blocks)
    if covered != hi - lo:
        raise ValueError(
            f"process {jax.process_index()} holds non-contiguous rows {blocks} of the batch; "
            f"build the mesh with each process's devices next to each other "
            f"(jaxzero.data_parallel_mesh() does)."
        )
    return slice(lo, hi)


def global_batch(local_batch, zero):
    """Assemble global batch arrays from every process's local slice.

    Each process passes a pytree of host arrays holding only ITS rows of the global batch
    (:func:`process_batch_slice`; all processes the same number of rows and the same
    leaves); the result is a pytree of global ``jax.Array``s of ``process_count`` times the
    rows, split over every device of ``zero``'s mesh like ``TrainStep`` expects
    (``zero.batch_spec()``). No data moves between processes. On a single process this is
    just ``device_put`` of the (whole) batch. Leaves that already are global arrays with
    this sharding are returned as they are.

    Args:
      local_batch: pytree of numpy (or process-local jax) arrays with a leading batch dim.
      zero: the :class:`jaxzero.ZeRO` (or the batch ``NamedSharding``).

    Raises:
      ValueError: leaves disagree on the number of local rows, or it does not divide by
        this process's number of devices in the mesh.
    """
    sharding = _batch_sharding(zero)
    me = jax.process_index()
    n_local_devices = sum(1 for d in sharding.mesh.devices.flat if d.process_index == me)
    if n_local_devices == 0:
        raise ValueError(f"process {me} has no device in the mesh; it cannot feed a batch.")
    rows = batch_rows(
        local_batch,
        what="local batch",
        skip=lambda x: isinstance(x, jax.Array) and x.sharding == sharding,
    )
    if rows:
        n = next(iter(rows.values()))
        if n % n_local_devices:
            raise ValueError(
                f"process {me}'s batch slice has {n} rows, not divisible by its "
                f"{n_local_devices} devices in the mesh. Each process passes only its own "
                f"rows of the global batch (jaxzero.distributed.process_batch_slice); the "
                f"global batch size must be a multiple of the total number of devices."
            )

    def one(x):
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(one, local_batch)


def check_same_on_all_processes(tree, what: str = "tree") -> None:
    """Raise ValueError naming the leaves of ``tree`` whose host values differ between
    processes (call it on every process; a no-op on one process).

    Host arrays given to jit on several processes are taken as the same replicated value
    everywhere without being compared: initial params drawn with a different seed per process
    give a "replicated" state that silently differs per process. Only a CRC32 per leaf is
    exchanged. Leaves that already are global (not fully addressable) ``jax.Array`` values are
    consistent by construction and skipped; abstract trees (tracers, ShapeDtypeStructs) are
    not checked. Every process must call it (it is a collective).
    """
    if jax.process_count() == 1:
        return
    import zlib

    from jax.experimental import multihost_utils

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if any(isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)) for _, x in leaves):
        return  # abstract (e.g. under jax.eval_shape): no values to compare
    paths, sums = [], []
    for path, x in leaves:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            continue
        data = np.ascontiguousarray(np.asarray(x))
        paths.append(jax.tree_util.keystr(path) or "<root>")
        sums.append(zlib.crc32(data.tobytes()) ^ zlib.crc32(str((data.shape, data.dtype)).encode()))
    table = np.asarray(
        multihost_utils.process_allgather(np.asarray(sums, np.uint32)), np.uint32
    ).reshape(jax.process_count(), len(sums))
    bad = [p for j, p in enumerate(paths) if np.any(table[:, j] != table[0, j])]
    if bad:
        raise ValueError(
            f"{what} differs between processes at {', '.join(bad[:5])}"
            + (f" (and {len(bad) - 5} more leaves)" if len(bad) > 5 else "")
            + ": every process must pass the same values (e.g. initialise with the same seed "
            "on every process, or restore them from a checkpoint)."
        )
