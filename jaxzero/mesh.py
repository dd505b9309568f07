"""Building and checking the data-parallel mesh, and the memory its arrays live in."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxzero.simulate import DEVICE_COUNT_FLAG, requested_cpu_devices


def data_parallel_mesh(
    num_devices: int | None = None,
    axis: str = "data",
    *,
    replicas: int = 1,
    replica_axis: str = "replica",
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh whose devices all do data parallelism.

    With ``replicas == 1`` the mesh is 1-D, ``(axis,)``; with ``replicas > 1`` it is the hybrid
    (HSDP) mesh ``(replica_axis, axis)`` of shape ``(replicas, num_devices // replicas)``:
    state is sharded over ``axis`` and replicated over ``replica_axis``, and gradients are
    averaged over both.

    The axes are ``AxisType.Auto`` (GSPMD mode) on purpose: jax 0.10's default *Explicit* axes
    make ordinary Flax models fail under data parallelism (``nn.Embed`` gathers and ``x @ w``
    gradients ask for explicit ``out_sharding``), and jaxzero places every collective itself
    inside ``jax.shard_map`` anyway.

    Args:
      num_devices: how many devices to use (default: all of ``jax.devices()``).
      axis: name of the axis state is sharded over.
      replicas: size of the replica axis (1: plain 1-D mesh).
      replica_axis: name of the replica axis.
      devices: explicit device list (default ``jax.devices()``).

    Returns:
      A ``jax.sharding.Mesh``.

    Raises:
      ValueError: ``num_devices`` is not in ``1..len(devices)`` or not divisible by ``replicas``.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if num_devices is None else num_devices
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= len(devices):
        raise ValueError(
            f"num_devices={num_devices!r} must be an int in 1..{len(devices)} "
            f"(the devices visible to this process group); pass None to use all of them."
        )
    if not isinstance(replicas, int) or replicas < 1 or n % replicas:
        raise ValueError(f"replicas={replicas!r} must be a positive int dividing num_devices={n}.")
    if num_devices is None and n == 1 and devices[0].platform == "cpu":
        _warn_one_cpu_device(requested_cpu_devices())
    chosen = np.asarray(devices[:n], dtype=object)
    if replicas == 1:
        return Mesh(chosen, (axis,), axis_types=(AxisType.Auto,))
    return Mesh(
        chosen.reshape(replicas, n // replicas),
        (replica_axis, axis),
        axis_types=(AxisType.Auto, AxisType.Auto),
    )


@functools.cache
def _warn_one_cpu_device(requested: int | None) -> None:
    """Warn (once per process and count) that a mesh of all devices is one CPU device;
    ``requested``: the CPU device count the process asked for (None: it did not ask)."""
    if requested == 1:
        how = (
            f"as this process asked ({DEVICE_COUNT_FLAG}=1 in XLA_FLAGS, which "
            f"jaxzero.simulate_cpu_devices(1) sets, or jax_num_cpu_devices=1)"
        )
        fix = (
            "To simulate N devices, ask for N instead: jaxzero.simulate_cpu_devices(N) at the "
            "start of a new process (XLA reads the count once, when its backend starts)"
        )
    else:
        how = "the default"
        fix = (
            "To simulate N devices on a CPU, call jaxzero.simulate_cpu_devices(N) before the "
            "first jax call that touches devices (or set "
            f"XLA_FLAGS={DEVICE_COUNT_FLAG}=N before it)"
        )
    warnings.warn(
        f"jaxzero.data_parallel_mesh(): this process sees one CPU device ({how}), so nothing "
        f"is sharded: every stage runs as a one-device run. {fix}; pass num_devices=1 to ask "
        f"for one device on purpose, without this warning.",
        UserWarning,
        stacklevel=3,
    )


def check_mesh(mesh: Mesh, axis: str) -> None:
    """Raise a clear error when ``mesh`` cannot carry jaxzero's sharding over ``axis``."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
            f"build one with jaxzero.data_parallel_mesh()."
        )
    if axis not in mesh.axis_names:
        raise ValueError(
            f"mesh has no axis named {axis!r} (its axes are {tuple(mesh.axis_names)}); "
            f"pass axis=<one of them> to jaxzero.ZeRO or build the mesh with "
            f"jaxzero.data_parallel_mesh(axis={axis!r})."
        )
    explicit = [
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit
    ]
    if explicit:
        raise ValueError(
            f"mesh axes {explicit} are AxisType.Explicit; jaxzero needs AxisType.Auto axes "
            f"(GSPMD mode). Build the mesh with jaxzero.data_parallel_mesh() or "
            f"jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto, ...))."
        )


def warn_unnamed_replica_axes(mesh: Mesh, axis: str) -> None:
    """Warn about mesh axes other than ``axis`` that are not named as replica axes.

    jaxzero shards state over ``axis`` only and treats every other axis as a replica axis
    (state replicated over it, batch split over it, gradients averaged over it): a ``model``
    or ``tensor`` axis would silently become data parallelism.
    """
    others = [a for a in mesh.axis_names if a != axis and not str(a).startswith("replica")]
    if others:
        warnings.warn(
            f"mesh axes {others} are treated as replica axes (state replicated over them, "
            f"the batch split and gradients averaged over them); jaxzero does no tensor or "
            f"model parallelism. Name them 'replica...' (jaxzero.data_parallel_mesh("
            f"replicas=...) does) to say that this is what you want.",
            UserWarning,
            stacklevel=3,
        )


def mesh_platform(mesh: Mesh) -> str:
    """``"cpu"`` or ``"gpu"`` when every device of ``mesh`` is one (CUDA and ROCm devices, and
    compile-only GPU devices, are ``"gpu"``), else ``"mixed"``: what the EMA's default storage
    and the train step's CPU pacing depend on."""
    kinds = {
        "gpu" if d.platform in ("gpu", "cuda", "rocm") else d.platform for d in mesh.devices.flat
    }
    return kinds.pop() if len(kinds) == 1 else "mixed"


def in_host_memory(x) -> bool:
    """Whether the (traced) array ``x`` is typed to live in host memory.

    Args:
      x: an array or a tracer.

    Returns:
      True when its type's memory space is ``jax.memory.Space.Host``.
    """
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def varying_axes(x) -> tuple[str, ...]:
    """The mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return tuple(axis_type.varying) if axis_type is not None else ()


def to_varying(x, axes):
    """``pcast`` ``x`` to device-varying over those of ``axes`` it is not yet varying over."""
    varying = jax.typeof(x).manual_axis_type.varying
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x
