"""The XLA GPU flags jaxzero recommends, and applying them before a GPU backend starts.

Each flag is kept because it measurably changes the compiled GPU step (the hidden share of
collective bytes or the memory; docs/decisions/28-xla-gpu-flags.md records the before/after,
and ``python benchmarks/overlap.py`` regenerates the peer table in docs/benchmarks.md).
``XLA_FLAGS`` is read once, when the first backend starts: :func:`apply_xla_flags` must run
before that (``jaxzero.distributed.initialize()`` calls it first; the launcher puts the flags
in each process's environment). For one compile, pass
:func:`xla_options` to ``jax.jit(f).lower(...).compile(compiler_options=...)`` instead
(``jaxzero.gpu.compile_report(..., compiler_options=)``).

Only a process that will run on NVIDIA GPUs gets them: a CPU run is never given GPU flags.
"""

from __future__ import annotations

import glob
import os
import sys
import warnings

from jaxzero._compat import compile_option_accepted, cuda_plugin, unknown_xla_flags

__all__ = [
    "OPT_OUT_ENV",
    "apply_xla_flags",
    "gpu_present",
    "recommended_xla_flags",
    "with_xla_flags",
    "xla_options",
]

OPT_OUT_ENV = "JAXZERO_NO_XLA_FLAGS"

# name -> value. Kept flags only (see the module docstring and docs/decisions/28-xla-gpu-flags.md).
# Measured and left out: xla_gpu_enable_while_loop_double_buffering (hides 6-12% more all-gather
# bytes of stage 3 per layer, but at N = 8 on the 8-layer GPT it halves the hidden share of the
# per-layer reduce-scatters of stage 2, 74% -> 37%, and adds 5% memory);
# xla_gpu_enable_pipelined_reduce_scatter (already XLA's default; the per-layer reduce-scatters
# of stages 2/3 rely on it: off, their hidden share drops from 94% to 0%);
# One entry per recommended setting: its spellings, newest XLA first, each as
# (XLA_FLAGS flag, compile-option value). XLA renamed the two pipelining switches (jax >= 0.11:
# an enum, xla_gpu_pipeline_*=on; the old boolean is gone from the compile options and kept in
# XLA_FLAGS as a deprecated alias); the first spelling the running XLA knows is used.
_RECOMMENDED = (
    # Start layer i+1's all-gather in layer i's loop iteration (per-layer stage 3): hidden
    # share of all-gather bytes 0% -> 36-37% (4-layer test decoder; 8-layer GPT, width 1024).
    (
        ("--xla_gpu_pipeline_all_gather=on", "COLLECTIVE_PIPELINING_MODE_ON"),
        ("--xla_gpu_enable_pipelined_all_gather=true", True),
    ),
    # Move each layer's all-reduce under the next layer's backward (stage 0 per layer): hidden
    # share of all-reduce bytes 1.5% -> 74%, args+temp 2468.4 -> 2410.0 MB (8-layer GPT, N = 8).
    (
        ("--xla_gpu_pipeline_all_reduce=on", "COLLECTIVE_PIPELINING_MODE_ON"),
        ("--xla_gpu_enable_pipelined_all_reduce=true", True),
    ),
    # Combine a layer's all-gathers into one (XLA's default threshold, 30 MiB, splits a wide
    # layer into one gather per leaf, and the scheduler keeps one all-gather in flight at a
    # time, so only the last covers the layer's gemms): LLaMA-7B, N = 64, stage 3
    # per layer: hidden share of all-gather bytes 36% -> 95%, peak 4.03 -> 4.00 GB; stages 1/2
    # per layer 35.55 -> 32.36 GB. 1 GiB (MaxText's value): a layer up to 1 GiB in one gather.
    (("--xla_gpu_all_gather_combine_threshold_bytes=1073741824", 1 << 30),),
)
# With quantized gradients (qgZ) only: two collectives in flight at once instead of one.
# scan_layers reduces layer i + 1's gradient with one all-to-all while layer i's backward
# computes and layer i - 1's all-gather is in flight; with one at a time the pipelined gathers
# wait behind it. LLaMA-7B, N = 64, stage 3 per layer, int8 weights and gradients, with the
# settings above (jax 0.10): hidden share 63% -> 94% (all-gather 48% -> 95%), peak 4.03 ->
# 3.94 GB; on 4 such layers jax 0.12 hides 0.38 -> 0.58 at a 7% higher peak. Left
# out of the exact step's set: there it raises the peak 4.00 -> 4.73 GB for 95% -> 94%.
_QUANTIZED_GRADS = ((("--xla_gpu_experimental_parallel_collective_overlap_limit=2", 2),),)


def _name(flag: str) -> str:
    return flag.lstrip("-").partition("=")[0]


def _settings(quantized_grads: bool) -> tuple:
    if not isinstance(quantized_grads, bool):
        raise TypeError(f"quantized_grads={quantized_grads!r} must be True or False.")
    return _RECOMMENDED + (_QUANTIZED_GRADS if quantized_grads else ())


def _pick(known, settings=_RECOMMENDED) -> list[tuple[str, object]]:
    """The first spelling of each of ``settings`` that ``known(flag, option)`` accepts; a
    setting with none is left out with a warning naming it."""
    out = []
    for spellings in settings:
        chosen = next((s for s in spellings if known(*s)), None)
        if chosen is None:
            warnings.warn(
                f"jaxzero: this XLA (jaxlib {_jaxlib_version()}) knows none of "
                f"{', '.join(f for f, _ in spellings)}; that recommended XLA flag is left out",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            out.append(chosen)
    return out


def _jaxlib_version() -> str:
    from importlib.metadata import version

    return version("jaxlib")


def recommended_xla_flags(*, quantized_grads: bool = False) -> list[str]:
    """``["--xla_gpu_pipeline_all_gather=on", ...]``: the XLA GPU flags jaxzero recommends for
    training (see the module docstring for why each is kept), spelled as this XLA's
    ``XLA_FLAGS`` parser knows them (checked by :func:`jaxzero._compat.unknown_xla_flags`, in
    a child process); a flag this XLA does not know is left out with a warning.
    ``quantized_grads=True`` (a step with ``ZeRO(quantize="grads" or "both")``) adds two
    collectives in flight at once, which the per-layer quantized gradient reduction needs."""
    settings = _settings(quantized_grads)
    unknown = unknown_xla_flags(tuple(f for spellings in settings for f, _ in spellings))
    return [flag for flag, _ in _pick(lambda flag, _: _name(flag) not in unknown, settings)]


def xla_options(
    flags: list[str] | None = None, *, quantized_grads: bool = False
) -> dict[str, object]:
    """``{"xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_ON", ...}``: ``flags`` as
    ``compile(compiler_options=...)`` takes them. Default: the recommended flags (with
    ``quantized_grads`` as :func:`recommended_xla_flags` takes it), each in the first spelling
    this XLA's compile options accept (checked by compiling a scalar function,
    :func:`jaxzero._compat.compile_option_accepted`); one it does not take is left out with a
    warning."""
    if flags is None:
        known = lambda f, v: compile_option_accepted(_name(f), v)
        return {_name(f): v for f, v in _pick(known, _settings(quantized_grads))}
    if quantized_grads:
        raise ValueError(
            "xla_options(flags, quantized_grads=True): quantized_grads picks among the "
            "recommended flags; pass flags=None, or add the flag to your list yourself."
        )
    out: dict[str, object] = {}
    for flag in flags:
        name, _, value = flag.lstrip("-").partition("=")
        out[name] = (
            int(value)
            if value.isdigit()
            else {"true": True, "false": False}.get(value.lower(), value)
        )
    return out


def cuda_plugin_installed() -> bool:
    """Whether jax's CUDA plugin is importable: ``jax[cuda12]`` or ``jax[cuda13]``
    (:data:`jaxzero._compat.CUDA_PLUGINS`); either carries XLA's GPU compiler."""
    return cuda_plugin() is not None


def gpu_present(environ=None) -> bool:
    """Whether jax would start its CUDA backend in this process, decided without starting it:
    jax's CUDA plugin is installed, ``JAX_PLATFORMS`` (when set) allows cuda/gpu,
    ``CUDA_VISIBLE_DEVICES`` (when set) names a device, and an NVIDIA device node exists (or,
    under WSL2, its GPU paravirtualisation node ``/dev/dxg``: never taken for "no GPU", since
    ``import jaxzero`` selects the CPU platform where this says there is none)."""
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    if env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    if not cuda_plugin_installed():
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg")


def with_xla_flags(environ: dict, flags: list[str] | None = None) -> tuple[dict, list[str]]:
    """``(environment, applied)``: ``environ`` with ``flags`` (default the recommended ones)
    appended to ``XLA_FLAGS``, except those whose name ``XLA_FLAGS`` already sets (the user's
    value wins); nothing when ``JAXZERO_NO_XLA_FLAGS`` is set to a non-empty value."""
    env = dict(environ)
    if env.get(OPT_OUT_ENV, "") not in ("", "0"):
        return env, []
    current = env.get("XLA_FLAGS", "")
    named = {f.lstrip("-").partition("=")[0] for f in current.split()}
    applied = [
        f
        for f in (recommended_xla_flags() if flags is None else flags)
        if f.lstrip("-").partition("=")[0] not in named
    ]
    if applied:
        env["XLA_FLAGS"] = " ".join([*current.split(), *applied])
    return env, applied


def apply_xla_flags(flags: list[str] | None = None, *, gpu: bool | None = None) -> list[str]:
    """Add the recommended XLA GPU flags to this process's ``XLA_FLAGS`` when it will run on
    GPUs (``gpu``: default :func:`gpu_present`) and no backend has started yet; prints what
    it applied to stderr and returns it ([] when nothing was: CPU run, opt-out, already set,
    or a backend already running)."""
    if not (gpu_present() if gpu is None else gpu):
        return []
    if backend_started():
        return []
    env, applied = with_xla_flags(dict(os.environ), flags)
    if applied:
        os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]
        print(
            f"jaxzero: applied XLA GPU flags {' '.join(applied)} (opt out: {OPT_OUT_ENV}=1)",
            file=sys.stderr,
        )
    return applied


def backend_started() -> bool:
    """Whether jax has started a backend (XLA_FLAGS would no longer be read)."""
    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and getattr(xb, "_backends", None))
