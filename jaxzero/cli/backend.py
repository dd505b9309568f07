"""The jax platform a ``jaxzero`` command runs on, chosen before jax starts a backend.

``jax[cuda12]`` (``make test`` installs its CUDA plugin for deviceless GPU compiles) is often
present on machines without an NVIDIA GPU. With ``JAX_PLATFORMS`` unset, jax initialises that
plugin when its first backend starts; the plugin's CUDA version check calls ``cuInit``, which
fails without a driver, and jax logs the failure with its traceback ("Jax plugin configuration
error ... cuInit(0) failed") before it falls back to the CPU. The error is real but says
nothing about the command: there is no GPU to use.

:func:`select_cpu_without_gpu` selects the CPU platform in that case (the CUDA plugin is
installed, :func:`jaxzero.xla_flags.gpu_present` finds no NVIDIA device, ``JAX_PLATFORMS``
is unset). The plugin then skips its version check, as it does whenever the requested
platforms leave out CUDA, and still registers itself: deviceless GPU compiles
(``jaxzero plan``, :func:`jaxzero.gpu.compile_only_mesh`) work as before.
:func:`simulate_devices` gives a command asked for ``--devices N`` on such a machine N
simulated CPU devices (:func:`jaxzero.simulate_cpu_devices`).
"""

from __future__ import annotations

import os

from jaxzero.simulate import DEVICE_COUNT_FLAG, simulate_cpu_devices
from jaxzero.xla_flags import cuda_plugin_installed, gpu_present

__all__ = ["select_cpu_without_gpu", "simulate_devices"]


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _platforms_chosen() -> bool:
    """Whether the platforms are named (``JAX_PLATFORMS`` or ``jax.config``) already."""
    import jax

    return bool(os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms)


def select_cpu_without_gpu() -> bool:
    """Select jax's CPU platform when jax's CUDA plugin is installed and this machine has no
    NVIDIA GPU, unless the platforms are chosen already or a backend has started; returns
    whether it did (see the module docstring for why)."""
    if not cuda_plugin_installed() or gpu_present() or _platforms_chosen() or _backend_started():
        return False
    import jax

    jax.config.update("jax_platforms", "cpu")
    return True


def _cpu_count_chosen() -> bool:
    """Whether the CPU device count is set already (``XLA_FLAGS`` or ``jax.config``)."""
    import jax

    return (
        DEVICE_COUNT_FLAG in os.environ.get("XLA_FLAGS", "") or jax.config.jax_num_cpu_devices > 0
    )


def simulate_devices(devices: int | None) -> bool:
    """Simulate ``devices`` CPU devices for a command's ``--devices N`` where this process
    runs on the CPU (no GPU, ``JAX_PLATFORMS`` unset or ``cpu``), no backend has started and
    no CPU device count is set already (the user's count wins); returns whether it did. On a
    GPU machine ``--devices`` picks N of the GPUs."""
    if devices is None or gpu_present() or _backend_started() or _cpu_count_chosen():
        return False
    if os.environ.get("JAX_PLATFORMS", "cpu").lower() not in ("", "cpu"):
        return False
    simulate_cpu_devices(devices)
    return True
