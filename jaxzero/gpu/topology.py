"""Compile-only GPU meshes: a cluster of GPUs described to XLA, on a machine that has none.

The steps, in order (each named where it happens below):

1. **env**: ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` before jax's CUDA plugin initialises, so the
   plugin does not demand a driver (``cuInit``) it will never use;
2. **plugin**: jax's CUDA PJRT plugin (``jax_plugins.xla_cuda12`` from ``jax[cuda12]``, or
   ``jax_plugins.xla_cuda13`` from ``jax[cuda13]``, jax >= 0.11) must be importable: it holds
   XLA's GPU compiler;
3. **topology**: ``jax.experimental.topologies.get_topology_desc(platform="cuda",
   target_config=<GpuTargetConfigProto text>, topology="1xHxG")`` (H hosts of G GPUs) returns
   compile-only device objects;
4. **mesh**: a ``Mesh`` of those devices with ``AxisType.Auto`` axes, which ``jax.jit(...)
   .lower(abstract args).compile()`` compiles for; nothing can run on it.

Simulated CPU devices (``JAX_PLATFORMS=cpu``) can live in the same process: the topology does
not touch the default backend.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxzero._compat import gpu_compile_extra
from jaxzero.gpu.targets import gpu_spec, target_config
from jaxzero.xla_flags import cuda_plugin_installed, recommended_xla_flags, xla_options

__all__ = [
    "INSTALL_HINT",
    "PluginMissingError",
    "compile_only_mesh",
    "gpu_kind_of",
    "recommended_xla_flags",
    "topology_string",
    "xla_options",
]

_CHECKOUT_EXTRA = "gpu-compile-cuda13" if "cuda13" in gpu_compile_extra() else "gpu-compile"
INSTALL_HINT = (
    f"install jax's CUDA plugin: {gpu_compile_extra()} "
    f"(or, in a jaxzero checkout, pip install -e '.[{_CHECKOUT_EXTRA}]': the plugin, cuDNN and "
    "CUDA's ptxas without the other CUDA wheels)"
)
GPUS_PER_HOST = 8


class PluginMissingError(RuntimeError):
    """jax's CUDA plugin is absent or refused the topology (the message says how to fix it)."""


def topology_string(devices: int) -> str:
    """``"<partitions>x<hosts>x<gpus per host>"``: 8-GPU hosts when ``devices`` is a multiple of 8
    (``64 -> "1x8x8"``), else one host holding them all (``4 -> "1x1x4"``)."""
    if devices > GPUS_PER_HOST and devices % GPUS_PER_HOST == 0:
        return f"1x{devices // GPUS_PER_HOST}x{GPUS_PER_HOST}"
    return f"1x1x{devices}"


def _check_count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}, e.g. {name}=8.")
    return value


def _attached_gpus():
    """The GPUs attached to this process (empty when there are none or no CUDA backend)."""
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def _topology_devices(kind: str, devices: int, memory_bytes: int | None = None):
    # step 1, env: must precede the plugin's initialisation (a no-op once it has initialised).
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    # step 2, plugin: jax's CUDA plugin carries XLA:GPU.
    if not cuda_plugin_installed():
        raise PluginMissingError(
            f"compiling for {kind} GPUs needs jax's CUDA plugin (jax_plugins.xla_cuda12 or "
            f"xla_cuda13), which is not installed; {INSTALL_HINT}."
        )
    from jax.experimental import topologies

    topo = topology_string(devices)
    # step 3, topology: compile-only devices described by the bundled target config.
    try:
        desc = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(kind, memory_bytes), topology=topo
        )
    except Exception as e:  # jaxlib raises JaxRuntimeError / RuntimeError / ValueError
        raise PluginMissingError(
            f"jax's CUDA plugin refused the compile-only topology {topo!r} for {kind} "
            f"({type(e).__name__}: {e}); check that jax, jaxlib and the plugin have the same "
            f"version ({jax.__version__} here): {INSTALL_HINT}."
        ) from e
    found = list(desc.devices)
    if len(found) != devices:
        raise PluginMissingError(
            f"topology {topo!r} gave {len(found)} devices, expected {devices}; {INSTALL_HINT}."
        )
    return found


def compile_only_mesh(
    kind: str,
    devices: int | None,
    *,
    replicas: int = 1,
    axis: str = "data",
    memory_bytes: int | None = None,
):
    """A mesh of ``devices`` GPUs of ``kind`` to compile for (``jit(...).lower(...).compile()``).

    Without GPUs the devices are compile-only (see the module docstring for the steps). With
    GPUs attached and ``devices=None``, the attached GPUs are used (and ``kind`` only names the
    memory budget). With ``replicas > 1`` the mesh is ``("replica", axis)`` of shape
    ``(replicas, devices // replicas)``, as :func:`jaxzero.data_parallel_mesh` builds it.
    Axes are ``AxisType.Auto`` (jaxzero places its collectives itself). ``memory_bytes``: the
    compile-only devices' memory instead of the part's (``jaxzero plan --gpu-memory``: XLA's
    scheduler keeps the step under it).

    Raises:
      ValueError: an unknown ``kind``, bad counts, or ``devices=None`` with no GPU attached.
      PluginMissingError: jax's CUDA plugin is missing or refused the topology (the message
        says how to install it).
    """
    gpu_spec(kind)  # names the accepted kinds on a typo
    replicas = _check_count("replicas", replicas)
    if devices is None:
        found = _attached_gpus()
        if not found:
            raise ValueError(
                "devices=None means the attached GPUs, and this process sees none; pass the "
                "cluster size to compile for, e.g. compile_only_mesh('h100', 64)."
            )
    else:
        found = _topology_devices(kind, _check_count("devices", devices), memory_bytes)
    n = len(found)
    if n % replicas:
        raise ValueError(f"replicas={replicas} must divide the device count {n}.")
    # step 4, mesh: Auto axes, laid out like jaxzero.data_parallel_mesh.
    arr = np.asarray(found, dtype=object)
    if replicas == 1:
        return Mesh(arr, (axis,), axis_types=(AxisType.Auto,))
    return Mesh(
        arr.reshape(replicas, n // replicas),
        ("replica", axis),
        axis_types=(AxisType.Auto, AxisType.Auto),
    )


def gpu_kind_of(mesh) -> str | None:
    """The bundled GPU kind ("h100", "a100", "h200") of a mesh's devices, or None."""
    device_kind = str(getattr(mesh.devices.flat[0], "device_kind", "")).lower()
    for kind in ("h200", "h100", "a100"):
        if kind in device_kind:
            return kind
    return None
