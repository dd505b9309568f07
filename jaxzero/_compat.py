"""Where jax 0.10 and jax 0.12 differ, decided here by asking the running jax/XLA.

Supported: jax 0.10.2 (Python 3.11) through 0.12.x (Python >= 3.12). Each function below
detects a feature rather than comparing version strings, so a release that keeps or restores
a feature keeps working; docs/compat.md lists every point and how to drop the oldest version.

Imports nothing of jaxzero (every other module may import it). Nothing here starts a jax
backend at import time; :func:`unknown_xla_flags` never starts one in this process, and
:func:`compile_option_accepted` compiles a scalar function (so it starts the default backend).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys

__all__ = [
    "CUDA_PLUGINS",
    "bind_params",
    "compute_on_host",
    "compile_option_accepted",
    "cuda_plugin",
    "gpu_compile_extra",
    "scan_counts",
    "unknown_xla_flags",
]

# jax's CUDA PJRT plugins, newest CUDA first: jax[cuda13] (jax >= 0.11's default on a CUDA 13
# machine) and jax[cuda12] (the only one for jax 0.10 on Linux x86-64 here).
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def scan_counts(params) -> tuple[int, int]:
    """``(consts, carry)``: how many of a ``scan`` equation's operands are loop constants and
    how many are the carry (the rest are the scanned ``xs``).

    jax 0.10 stores them as ``num_consts`` / ``num_carry``; jax 0.12 stores the operand
    structure as ``ft_in``, a flat tree of ``(consts, carry, xs)`` whose ``len`` is its leaf
    count.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def bind_params(eqn) -> dict:
    """The keyword arguments that re-bind a jaxpr equation's primitive (``get_bind_params``
    returns them alone from jax 0.10 on; older releases returned ``(subfuns, params)``, and a
    call primitive's subfuns are empty for the equations jaxzero re-binds)."""
    out = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(out, tuple):
        subfuns, out = out
        if subfuns:
            raise NotImplementedError(f"re-binding {eqn.primitive} with subfunctions")
    return out


# The call-like primitives whose inner jaxpr can be evaluated inline, and the parameter that
# holds it, by name across jax releases (jit was "pjit" before 0.7, remat "checkpoint" or
# "remat2", a custom_vjp call "custom_vjp_call" with "call_jaxpr" or the older "fun_jaxpr").
_CALL_JAXPR_PARAMS = {
    "pjit": ("jaxpr",),
    "jit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "call_jaxpr"),
    "checkpoint": ("jaxpr",),
    "remat2": ("jaxpr",),
}


#: a nested jax.jit call's primitive ("pjit" in jax 0.10, "jit" from 0.11 on)
JIT_PRIMITIVES = ("pjit", "jit")
#: jax.checkpoint / nn.remat's primitive ("checkpoint"; "remat2" in older releases)
REMAT_PRIMITIVES = ("checkpoint", "remat2")


def call_jaxpr(eqn):
    """``(jaxpr, consts)`` of a call-like equation (nested jit, custom_jvp/vjp call,
    checkpoint), whose outputs are its inner jaxpr evaluated on its inputs; None otherwise."""
    for name in _CALL_JAXPR_PARAMS.get(eqn.primitive.name, ()):
        inner = eqn.params.get(name)
        if inner is None:
            continue
        if hasattr(inner, "consts"):  # a ClosedJaxpr
            return inner.jaxpr, inner.consts
        return inner, []
    return None


def compute_on_host(fn):
    """``fn`` run on the devices' hosts, its outputs in host memory (the host-update design
    that decision 32 measured against the streamed one). jax 0.10's
    ``compute_on("device_host")`` is a decorator factory (the outputs stay where the host
    computed them); jax 0.12's takes the function with keyword-only ``compute_type`` and
    ``out_memory_spaces``."""
    import inspect

    import jax
    from jax.experimental.compute_on import compute_on

    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    return compute_on("device_host")(fn)


def cuda_plugin() -> str | None:
    """The module name of the installed jax CUDA plugin (``CUDA_PLUGINS`` order), or None."""
    if importlib.util.find_spec("jax_plugins") is None:
        return None
    return next((p for p in CUDA_PLUGINS if importlib.util.find_spec(p) is not None), None)


def gpu_compile_extra() -> str:
    """``pip install`` text for jax's CUDA plugin matching the installed jax: ``jax[cuda13]``
    for jax >= 0.11 (a CUDA 13 plugin exists from jax 0.7.2 on, and it is what current GPU
    images carry), ``jax[cuda12]`` before, pinned to this jax's version."""
    from importlib.metadata import version

    jax_version = version("jax")
    major_minor = tuple(int(x) for x in jax_version.split(".")[:2])
    cuda = "cuda13" if major_minor >= (0, 11) else "cuda12"
    return f'pip install "jax[{cuda}]=={jax_version}"'


_UNKNOWN_RE = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")


@functools.cache
def unknown_xla_flags(flags: tuple[str, ...]) -> frozenset[str]:
    """The names among ``flags`` (``"--name=value"``) that this XLA's ``XLA_FLAGS`` parser
    does not know.

    XLA aborts the process at its first backend start when ``XLA_FLAGS`` holds an unknown flag
    (``Unknown flags in XLA_FLAGS: --a=1 --b=2``), so the check runs in a child Python that
    starts the CPU backend with ``flags`` alone and reads that message; this process's backend
    and ``XLA_FLAGS`` are untouched. Cached per process (about 1-2 s the first time).

    Raises:
      RuntimeError: the child failed for another reason (its output is in the message).
    """
    if not flags:
        return frozenset()
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    child = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if child.returncode == 0:
        return frozenset()
    found = _UNKNOWN_RE.search(child.stderr)
    if not found:
        raise RuntimeError(
            "checking XLA flags: a Python with XLA_FLAGS="
            f"{' '.join(flags)!r} failed (exit {child.returncode}) without naming an unknown "
            f"flag:\n{child.stderr[-2000:]}"
        )
    return frozenset(f.lstrip("-").partition("=")[0] for f in found.group(1).split())


@functools.cache
def compile_option_accepted(name: str, value) -> bool:
    """Whether this XLA takes ``compiler_options={name: value}`` (what
    ``jax.jit(f).lower(...).compile(compiler_options=...)`` passes to XLA's DebugOptions):
    compiles a scalar function with it on the default backend. XLA answers ``No such compile
    option`` for a removed DebugOptions field (jax >= 0.11 for
    ``xla_gpu_enable_pipelined_all_gather``) and ``not a valid enum value`` for a bad value."""
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jnp.float32))
    try:
        lowered.compile(compiler_options={name: value})
    except Exception as err:  # jaxlib's JaxRuntimeError (INVALID_ARGUMENT)
        if "INVALID_ARGUMENT" in str(err):
            return False
        raise
    return True
