"""What ``import jaxzero`` does before jax starts a backend: a quiet start on a machine without
an NVIDIA GPU where jax's CUDA plugin is installed (the ``gpu-compile`` extra, for deviceless
GPU compiles). Imported first by ``jaxzero/__init__.py``; elsewhere it does nothing.

Measured on a CPU-only machine with the ``gpu-compile`` extra (jax 0.10.2, jax's CUDA 12
plugin, no CUDA runtime), ``import jax`` and a first ``jax.devices()`` print:

* ``Could not find cuda drivers on your machine, GPU will not be used.`` (``cudart_stub.cc``,
  absl's C++ log, each after absl's ``WARNING: All log messages before absl::InitializeLog()
  is called are written to STDERR``) once per plugin library loaded: three when jax imports
  the plugin's kernels, one when the first backend start loads ``cuda_plugin_extension``.
  C++ writes them to file descriptor 2 during the library load; ``TF_CPP_MIN_LOG_LEVEL``,
  ``ABSL_MIN_LOG_LEVEL``, ``GLOG_minloglevel`` and ``JAX_PLATFORMS=cpu`` leave them.
* with ``JAX_PLATFORMS`` unset, at the first backend start, jax's ``Jax plugin configuration
  error`` with the plugin's traceback (its CUDA version check finds no CUDA) before it falls
  back to the CPU.

So, where the CUDA plugin is installed and :func:`jaxzero.xla_flags.gpu_present` finds no GPU:

1. jax's CPU platform is selected (``jax.config``, this process only) unless ``JAX_PLATFORMS``
   or ``jax.config.jax_platforms`` names the platforms already or a backend has started. The
   plugin then skips its version check, as it does whenever the platforms leave out CUDA,
   and still registers itself: deviceless GPU compiles (:mod:`jaxzero.gpu`) work as before
   (the command line does the same, ``jaxzero/cli/backend.py``);
2. with the platforms CPU only, jax is imported and its plugins initialised (what jax's first
   backend start does before it starts one; no backend starts here) with those log lines
   (only those: every other byte written to file descriptor 2 meanwhile is written back)
   taken out.

When jax was imported before jaxzero its three import-time lines are printed already.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from jaxzero._compat import cuda_plugin
from jaxzero.xla_flags import backend_started, gpu_present

# The CUDA runtime stub's line and absl's header before it (absl's C++ log format).
_STUB = re.compile(rb"^[IWE]\d{4} [\d:.]+\s+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers")
_ABSL_HEADER = b"WARNING: All log messages before absl::InitializeLog() is called are written"


def _without_stub_lines(text: bytes) -> bytes:
    """``text`` less the CUDA stub's lines and the absl header line directly before each."""
    lines = text.splitlines(keepends=True)
    drop = set()
    for i, line in enumerate(lines):
        if _STUB.match(line):
            drop.add(i)
            if i > 0 and lines[i - 1].startswith(_ABSL_HEADER):
                drop.add(i - 1)
    return b"".join(line for i, line in enumerate(lines) if i not in drop)


@contextlib.contextmanager
def _stub_lines_dropped() -> Iterator[None]:
    """File descriptor 2 goes to a temporary file inside the block; afterwards its bytes, less
    the CUDA stub's lines, are written to the real one (nothing when fd 2 cannot be moved)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = _without_stub_lines(held.read())
            if kept:
                os.write(2, kept)


def _platforms_chosen() -> bool:
    import jax

    return bool(os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms)


def _cpu_only() -> bool:
    import jax

    platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    return platforms.strip().lower() == "cpu"


def quiet_cpu_start() -> bool:
    """Steps 1 and 2 of the module docstring where they apply; returns whether they did."""
    if cuda_plugin() is None or gpu_present():
        return False
    with _stub_lines_dropped():
        import jax
        from jax._src import xla_bridge

        if backend_started():
            return False
        if not _platforms_chosen():
            jax.config.update("jax_platforms", "cpu")
        if not _cpu_only():
            return False  # the user asked for more than the CPU: jax's own start, unchanged
        # What jax's first backend start does first (once per process): import and initialise
        # the plugins, which loads the CUDA plugin's libraries; no backend starts here.
        register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if register is not None:
            register()
    return True


quiet_cpu_start()
