"""Simulated CPU devices: the XLA flags every jaxzero program that simulates devices on a CPU
(tests, examples, benchmarks, the one-machine launcher) sets before jax starts a backend.

XLA:CPU runs the collectives of its simulated devices in-process; when one device thread
reaches a collective long after the others (a loaded laptop or CI machine), XLA aborts the
whole process once the rendezvous waits past its termination timeout ("Termination timeout
... Exiting to ensure a consistent program state"). The timeouts below are raised far above
anything a healthy run needs, so a slow machine is slow rather than dead.

jax's persistent compilation cache is turned off for several simulated devices: an XLA:CPU
executable loaded from it loses the order between a program's collectives and those of its
loops (the loop body is deserialized with a communicator of its own), and a step with
collectives in a loop (``scan_layers`` at stage 3) then aborts ("Check failed: id <
num_threads") or hangs on its first launch (decision 52).
"""

from __future__ import annotations

import os
import warnings

from jaxzero.xla_flags import backend_started, gpu_present

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
COLLECTIVE_TIMEOUT_FLAGS = (
    "--xla_cpu_collective_call_terminate_timeout_seconds=1200",
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=300",
)


def cpu_xla_flags(devices: int | None, flags: str = "") -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with the collective timeouts added (unless set) and,
    when ``devices`` is given, exactly one device-count flag: ``devices`` replaces any there;
    None keeps the one there, or adds 8 when there is none."""
    parts = flags.split()
    if devices is not None or not any(p.startswith(DEVICE_COUNT_FLAG) for p in parts):
        parts = [p for p in parts if not p.startswith(DEVICE_COUNT_FLAG)]
        parts.append(f"{DEVICE_COUNT_FLAG}={8 if devices is None else int(devices)}")
    for flag in COLLECTIVE_TIMEOUT_FLAGS:
        if not any(p.startswith(flag.split("=")[0] + "=") for p in parts):
            parts.append(flag)
    return " ".join(parts)


def simulate_cpu_devices(devices: int | None = None) -> str:
    """Set ``XLA_FLAGS`` for simulated CPU devices (see :func:`cpu_xla_flags`); call it before
    anything starts a jax backend (``jax.devices()``, creating arrays). It only affects the CPU
    platform: on GPUs the flags are inert. Returns the new value.

    Raises:
      RuntimeError: jax's CPU backend has started already with fewer devices than asked for
        (XLA reads the flags only when it starts); nothing is changed. A backend started with
        more devices warns that the count was not applied.

    Where jax would not start its CUDA backend (:func:`jaxzero.xla_flags.gpu_present`, the
    one GPU detection the launcher and the XLA flags use too) it also selects the CPU platform
    (unless ``JAX_PLATFORMS`` says otherwise): ``jax[cuda12]`` is installed for deviceless GPU
    compiles, and without a GPU jax's probe of the CUDA plugin prints a traceback before
    falling back to the CPU.
    """
    flags = cpu_xla_flags(devices, os.environ.get("XLA_FLAGS", ""))
    count = _device_count(flags)
    _check_not_started(count)
    os.environ["XLA_FLAGS"] = flags
    import jax

    if "JAX_PLATFORMS" not in os.environ and not gpu_present():
        jax.config.update("jax_platforms", "cpu")
    if count > 1 and not gpu_present():
        _no_persistent_cache(jax)
    return os.environ["XLA_FLAGS"]


def persistent_cache_dir(jax) -> str | None:
    """The directory of jax's persistent compilation cache when it is on, else None."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")


def _no_persistent_cache(jax) -> None:
    """Turn jax's persistent compilation cache off (module docstring: decision 52), saying so
    when one was configured."""
    if not jax.config.jax_enable_compilation_cache:
        return
    where = persistent_cache_dir(jax)
    jax.config.update("jax_enable_compilation_cache", False)
    if where:
        warnings.warn(
            f"jaxzero.simulate_cpu_devices turned off jax's persistent compilation cache "
            f"({where}): an XLA:CPU program loaded from it loses the order of its collectives "
            f"against its loops, and a step on several simulated devices then aborts or "
            f"hangs. Unset JAX_COMPILATION_CACHE_DIR / jax_compilation_cache_dir for "
            f"simulated devices to silence this.",
            UserWarning,
            stacklevel=3,
        )


def requested_cpu_devices() -> int | None:
    """The CPU device count this process asked for: ``XLA_FLAGS``'s device-count flag (what
    :func:`simulate_cpu_devices` sets) or jax's ``jax_num_cpu_devices``; None when neither
    says."""
    flags = os.environ.get("XLA_FLAGS", "")
    if any(p.startswith(DEVICE_COUNT_FLAG + "=") for p in flags.split()):
        try:
            return _device_count(flags)
        except ValueError:
            return None
    import jax

    n = getattr(jax.config, "jax_num_cpu_devices", -1)
    return n if isinstance(n, int) and n > 0 else None


def _device_count(flags: str) -> int:
    """The device count the ``XLA_FLAGS`` value ``flags`` (from :func:`cpu_xla_flags`) asks for."""
    counts = [p.split("=", 1)[1] for p in flags.split() if p.startswith(DEVICE_COUNT_FLAG + "=")]
    return int(counts[-1])


def _check_not_started(want: int) -> None:
    """Raise when jax's CPU backend runs already with fewer than ``want`` devices (warn when
    with more): simulated devices must be asked for before it starts."""
    if not backend_started():
        return
    import jax

    if jax.default_backend() != "cpu":
        return  # a GPU run: the CPU flags are inert anyway
    have = jax.local_device_count()
    if have == want:
        return
    msg = (
        f"simulate_cpu_devices({want}) was called after jax started its CPU backend with "
        f"{have} device{'s' if have != 1 else ''}; XLA reads the device count only when the "
        f"backend starts. Call jaxzero.simulate_cpu_devices({want}) before the first jax call "
        f"that touches devices (jax.devices(), creating an array, jaxzero.data_parallel_mesh()),"
        f" or set XLA_FLAGS={DEVICE_COUNT_FLAG}={want} (or "
        f"jax.config.update('jax_num_cpu_devices', {want})) before it."
    )
    if have < want:
        raise RuntimeError(msg)
    warnings.warn(msg + f" This process keeps its {have} devices.", UserWarning, stacklevel=3)
