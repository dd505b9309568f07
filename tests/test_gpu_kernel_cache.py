"""``jaxzero.gpu.compile_report``'s kernel cache: the compiles for compile-only devices of one
process share XLA:GPU's kernels (``xla_gpu_kernel_cache_file``, one file per process, which
XLA writes after a compile), the HLO a report reads is the one compiled without it, and the
report lists only the options its caller gave.

Deviceless compiles for 8 H100s, as tests/test_gpu.py (jax's CUDA plugin, no GPU).
"""

from __future__ import annotations

import os

import optax

import jaxzero as jz
from jaxzero import gpu
from jaxzero.gpu import report
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape

CACHE = "xla_gpu_kernel_cache_file"
TRITON_GEMM_OFF = {"xla_gpu_enable_triton_gemm": False}  # an option of the caller's


def test_compile_only_reports_share_one_kernel_cache_and_keep_the_hlo(monkeypatch):
    shape = model_shape(layers=2, hidden=256, heads=2, vocab=512, seq=16, batch=1)
    zero = jz.ZeRO(optax.adam(1e-3), gpu.compile_only_mesh("h100", 8), stage=3, layers="layers")
    step = jz.make_train_step(make_loss(shape), zero)
    params, batch = abstract_params(shape), batch_shapes(shape, 8)
    compile_once, seen, same_hlo = report._compile, [], []

    def recording(lowered, options):
        seen.append(dict(options))
        reused = len(seen) > 1  # the second compile finds the first one's kernels in the file
        out = compile_once(lowered, options)
        if reused:  # the same lowered step compiled without the cache: the HLO the report reads
            plain, _, _ = compile_once(lowered, {k: v for k, v in options.items() if k != CACHE})
            same_hlo.append(plain.as_text() == out[0].as_text())
        return out

    monkeypatch.setattr(report, "_compile", recording)
    first = gpu.compile_report(step, params, batch)
    path = seen[0][CACHE]
    assert os.path.getsize(path) > 0  # XLA wrote the kernels it built
    second = gpu.compile_report(step, params, batch, compiler_options=TRITON_GEMM_OFF)
    assert seen[1][CACHE] == path and same_hlo == [True]
    assert first.compiler_options == ()
    assert second.compiler_options == (("xla_gpu_enable_triton_gemm", "False"),)
