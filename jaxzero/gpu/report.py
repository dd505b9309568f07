"""``compile_report``: what XLA's GPU compiler makes of a jaxzero train step, per device."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding

from jaxzero.gpu.hlo import (
    CollectiveTotal,
    collectives_per_step,
    computation_multipliers,
    kernels_per_step,
)
from jaxzero.gpu.overlap import OverlapTotal, overlap_per_step
from jaxzero.gpu.targets import gpu_spec
from jaxzero.gpu.topology import gpu_kind_of
from jaxzero.gpu.transfers import HostTransfers, host_transfers_per_step
from jaxzero.memory import format_bytes
from jaxzero.train.state import TrainState, with_pending
from jaxzero.zero.offload import placement as host_memory

__all__ = ["TRITON_GEMM_OFF", "CompileReport", "compile_report", "steady_state"]

# The XLA:GPU of jax 0.10 finds no Triton tiling for some small dots (a ViT's attention output
# projection over 4 images x 17 tokens per device: "Couldn't find output tile sizes that satisfy
# hlo: %dot = f32[68,64]"); the same step compiles with the gemms left to cuBLAS, so
# compile_report retries with this option (tests/test_gpu_fallback.py).
TRITON_GEMM_OFF = {"xla_gpu_enable_triton_gemm": False}
_TRITON_TILING = re.compile(r"Couldn't find output tile sizes[^%]*(%\S+ = \S+)?")


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """Per-device figures of one compiled step (bytes unless noted).

    ``argument/output/alias/temp`` come from ``compiled.memory_analysis()``; ``peak_bytes`` is
    ``argument + output - alias + temp`` (the donated state's outputs reuse its buffers), in
    device memory; ``host_*`` are the same figures in host memory (``ZeRO(offload=...)``:
    memory kind ``pinned_host``), and ``host_bytes`` their ``argument + output - alias +
    temp``;
    ``hbm_bytes`` is the GPU's memory (None when the mesh is not a bundled GPU kind), and
    ``headroom_bytes = hbm_bytes - peak_bytes``. ``collectives`` are per (kind, dtype) with loop
    trip counts applied; ``kernels_per_step`` counts device launches (see
    :func:`jaxzero.gpu.hlo.kernels_per_step`); ``overlap`` is per collective kind the payload
    bytes and those the schedule hides behind compute (:mod:`jaxzero.gpu.overlap`; read with
    :meth:`hidden_share`); ``compiler_options`` the XLA options the step was compiled with;
    ``hlo_text`` is the scheduled HLO. ``triton_gemm_fallback`` is None, or XLA's error when
    the first compile failed in its Triton gemm emitter ("Couldn't find output tile sizes
    ...") and the figures are those of the retry with ``xla_gpu_enable_triton_gemm=False``
    (:data:`TRITON_GEMM_OFF`: cuBLAS gemms; :meth:`verdict` says so). ``host_transfers``
    are the bytes the step moves between pinned host memory and the GPU, each direction, and
    the share the schedule hides behind compute, read from the HLO
    (:mod:`jaxzero.gpu.transfers`; :meth:`transfer_summary`, :meth:`transfer_seconds`).

    The verdict compares with the whole HBM; a JAX process gets 75% of it unless
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (e.g. ``.95``) or ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
    says otherwise, and CUDA/NCCL take a few hundred MB of their own.
    """

    kind: str | None
    devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    hbm_bytes: int | None
    collectives: tuple[CollectiveTotal, ...]
    kernels_per_step: int
    trip_counts_known: bool
    compile_seconds: float
    hlo_text: str = dataclasses.field(repr=False, compare=False)
    overlap: tuple[OverlapTotal, ...] = ()
    compiler_options: tuple[tuple[str, str], ...] = ()
    triton_gemm_fallback: str | None = None
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_alias_bytes: int = 0
    host_temp_bytes: int = 0
    host_transfers: HostTransfers = HostTransfers()

    @property
    def host_bytes(self) -> int:
        return (
            self.host_argument_bytes
            + self.host_output_bytes
            - self.host_alias_bytes
            + self.host_temp_bytes
        )

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.hbm_bytes is None else self.hbm_bytes - self.peak_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.hbm_bytes is None else self.headroom_bytes >= 0

    def payload(self, kind: str, dtype: str | None = None) -> int:
        """Payload bytes per device per step of one collective kind (optionally one dtype)."""
        return sum(c.bytes for c in self.collectives if c.kind == kind and dtype in (None, c.dtype))

    def hidden_share(self, *kinds: str) -> float:
        """Hidden bytes over payload bytes of those collective kinds (default: all), byte-
        weighted with loop trip counts (see :mod:`jaxzero.gpu.overlap`); 1.0 when none move."""
        return self._share("hidden_bytes", kinds)

    def hideable_share(self, *kinds: str) -> float:
        """As :meth:`hidden_share`, for the bytes any schedule of this step's data flow could
        hide (:mod:`jaxzero.gpu.overlap`): the ceiling no XLA flag can lift."""
        return self._share("hideable_bytes", kinds)

    def _share(self, field: str, kinds) -> float:
        rows = [o for o in self.overlap if not kinds or o.kind in kinds]
        total = sum(o.bytes for o in rows)
        return sum(getattr(o, field) for o in rows) / total if total else 1.0

    def overlap_summary(self) -> str:
        """``"all-gather 52% of max 81%, reduce-scatter 90% of max 99%"``: the hidden share and
        its ceiling (:meth:`hideable_share`) per kind moving 1 KiB or more per step (``"none"``
        when nothing does)."""
        parts = [
            f"{o.kind} {o.share:.0%} of max {o.bound:.0%}" for o in self.overlap if o.bytes >= 1024
        ]
        return ", ".join(parts) or "none"

    def transfer_seconds(self, gbps: float | None = None) -> tuple[float, float]:
        """``(all, exposed)`` seconds of the host <-> device bytes at ``gbps`` GB/s (1e9
        bytes/s; default the GPU kind's pinned copy rate, ``GpuSpec.pcie_bytes_per_s``), both
        directions one after the other; exposed: those no compute kernel overlaps."""
        if gbps is None:
            if self.kind is None:
                raise ValueError("no GPU kind to take a PCIe rate from: pass gbps=.")
            gbps = gpu_spec(self.kind).pcie_bytes_per_s / 1e9
        if isinstance(gbps, bool) or not isinstance(gbps, int | float) or not gbps > 0:
            raise ValueError(f"gbps={gbps!r} must be a positive number of GB/s.")
        t, rate = self.host_transfers, gbps * 1e9
        return t.bytes / rate, t.exposed_bytes / rate

    def transfer_summary(self) -> str:
        """``"host->device 2.95 MB, device->host 2.95 MB, 0% hidden"`` per step (``"none"``
        when nothing crosses)."""
        t = self.host_transfers
        if not t.bytes:
            return "none"
        return (
            f"host->device {format_bytes(t.h2d_bytes)}, device->host "
            f"{format_bytes(t.d2h_bytes)}, {t.share:.0%} hidden"
        )

    def dtypes(self, kind: str) -> set[str]:
        """The element types the collectives of ``kind`` move."""
        return {c.dtype for c in self.collectives if c.kind == kind}

    def verdict(self) -> str:
        """``"fits in 85.00 GB with 12.30 GB to spare"`` or ``"short by 3.10 GB of 85.00 GB"``
        (a figure under 1 GB in MB or KB: ``--gpu-memory 5MB``'s tiny plans), followed by
        ``" (without Triton gemms)"`` when :attr:`triton_gemm_fallback` is set."""
        note = " (without Triton gemms)" if self.triton_gemm_fallback else ""
        if self.hbm_bytes is None:
            return f"needs {format_bytes(self.peak_bytes)} (no GPU kind to compare with){note}"
        if self.fits:
            spare = format_bytes(self.headroom_bytes)
            return f"fits in {format_bytes(self.hbm_bytes)} with {spare} to spare{note}"
        short, of = format_bytes(-self.headroom_bytes), format_bytes(self.hbm_bytes)
        return f"short by {short} of {of}{note}"

    def collective_summary(self) -> str:
        """``"all-gather bf16 1.20 GB x64, ..."``: payload per step and launches, per kind and
        dtype (collectives under 1 KiB, such as the finite-check and norm scalars, left out)."""
        parts = [
            f"{c.kind} {c.dtype} {format_bytes(c.bytes)} x{c.launches}"
            for c in self.collectives
            if c.bytes >= 1024
        ]
        return ", ".join(parts) or "none"


def _abstract_state(step, state_or_shapes, model_state, rng):
    zero = step.zero
    if isinstance(state_or_shapes, TrainState):
        state = state_or_shapes
    else:
        return zero.abstract_state(state_or_shapes, ema=step.ema, model_state=model_state, rng=rng)
    # a state with an update pending (offload_update="deferred"): the state's own
    # shardings, and what the update left as the step that made it placed it
    pending = state.pending
    plain = with_pending(state, None) if pending is not None else state
    shardings = zero.state_shardings(plain)
    out = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), plain, shardings
    )
    if pending is None:
        return out
    kept = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    values = tuple(kept(x) for x in pending.values)
    packed = pending.packed  # in pinned host memory, which an abstract shape may not say
    if packed is not None:
        packed = pending.packing.avals(host_memory.host_sharding(zero.mesh, pending.packing.spec))
    before = None if pending.before is None else {k: kept(x) for k, x in pending.before.items()}
    return with_pending(out, pending.replace(values=values, packed=packed, before=before))


def steady_state(step, param_shapes, batch_shapes):
    """What to compile ``step`` on for its steady figures: ``param_shapes`` itself, or where
    the step leaves an update pending (``ZeRO(offload_update="deferred")``) the abstract
    :class:`~jaxzero.train.state.PendingState` its first step returns (``jax.eval_shape``: the
    next steps run the pending rows, the first does not), marked delayed where the update is
    (``offload_update="delayed"``: the steps after its exact ones).

    Args:
      step: a :class:`jaxzero.TrainStep`.
      param_shapes: the params as ShapeDtypeStructs (or arrays).
      batch_shapes: the global batch's shapes.
    """
    zero = step.zero
    if not zero.placement.defers:
        return param_shapes
    state = zero.abstract_state(param_shapes, ema=step.ema)
    batch = _abstract_batch(step, batch_shapes)
    with jax.set_mesh(zero.mesh):
        state = jax.eval_shape(step.jitted, state, batch)[0]
    if not zero.placement.delays:
        return state
    return with_pending(state, state.pending.replace(delayed=True))


def _abstract_batch(step, batch_shapes):
    zero = step.zero
    sharding = NamedSharding(zero.mesh, zero.batch_spec())
    need = zero.num_batch_shards * step.accum_steps
    leaves = jax.tree_util.tree_flatten_with_path(batch_shapes)[0]
    if not leaves:
        raise ValueError("batch_shapes is an empty tree; pass the global batch's shapes.")
    for path, x in leaves:
        shape = tuple(getattr(x, "shape", ()))
        if not shape or shape[0] % need:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path) or '<root>'} has shape {shape}: the "
                f"leading (global batch) dimension must be a multiple of devices "
                f"({zero.num_batch_shards}) x accum_steps ({step.accum_steps}) = {need}."
            )
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), batch_shapes
    )


def _memory(compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    if isinstance(stats, Sequence):
        stats = stats[0] if stats else None
    if stats is None:
        raise RuntimeError("the compiler gave no memory analysis for this step.")
    kinds = ("argument", "output", "alias", "temp")
    kinds += tuple(f"host_{k}" for k in kinds)
    return {k: int(getattr(stats, f"{k}_size_in_bytes", 0) or 0) for k in kinds}


def _check_host(step, state, mem) -> None:
    """An offloading step whose compile holds less in host memory than its offloaded state
    lost the memory kinds on the way (compile-only devices drop them silently)."""
    if not step.zero.offload:
        return
    want = host_memory.offloaded_bytes(state, step.zero.offload_fraction)
    if mem["host_argument"] < want:
        raise RuntimeError(
            f"ZeRO(offload={step.zero.offload!r}) asked for {format_bytes(want)} per device of "
            f"state in pinned host memory, and the compiled step takes "
            f"{format_bytes(mem['host_argument'])} from the host: the memory kinds were "
            f"dropped on the way to XLA (state shardings on a compile-only mesh's concrete "
            f"devices lose them). Build the state with zero.abstract_state / "
            f"zero.state_shardings and compile under jax.set_mesh(mesh)."
        )


@functools.cache
def _kernel_cache() -> dict:
    """XLA:GPU's kernel cache for this process's :func:`compile_report` compiles for
    compile-only devices, as a compile option: one file, made at the first compile and
    removed at exit. A kernel one compile
    built (LLVM, then a ``ptxas`` run: about 40% of a compile) is reused by the next compile
    that has the same fusion (a plan's rows, a test file's steps); the HLO and the memory
    figures are XLA's before any kernel is built, and are the same with and without it. Per
    compile, not in ``XLA_FLAGS``: no subprocess may share the file, which XLA rewrites
    after each compile (a compile that reads a half-written one fails)."""
    where = tempfile.mkdtemp(prefix="jaxzero-xla-kernels-")
    atexit.register(shutil.rmtree, where, True)
    return {"xla_gpu_kernel_cache_file": os.path.join(where, "kernels.bin")}


def _compile(lowered, options: dict) -> tuple[object, dict, str | None]:
    """``(compiled, options used, fallback)``: ``lowered.compile(options)``; where XLA:GPU's
    Triton gemm emitter cannot tile a dot, it compiles again with :data:`TRITON_GEMM_OFF`
    added, and ``fallback`` is the first error's words naming the dot (else None)."""
    try:
        return lowered.compile(options or None), options, None
    except Exception as e:  # jaxlib's JaxRuntimeError
        found = _TRITON_TILING.search(str(e))
        if found is None or options.get("xla_gpu_enable_triton_gemm") is False:
            raise
    retry = {**options, **TRITON_GEMM_OFF}
    return lowered.compile(retry), retry, found.group(0).strip()


def compile_report(
    step,
    state_or_shapes,
    batch_shapes,
    *,
    kind: str | None = None,
    model_state=None,
    rng=None,
    compiler_options: dict | None = None,
) -> CompileReport:
    """Compile ``step`` for its mesh (e.g. :func:`compile_only_mesh`) and report per device.

    Args:
      step: a :class:`jaxzero.TrainStep` (``jz.make_train_step``) whose ZeRO is built over the
        mesh to compile for.
      state_or_shapes: a :class:`jaxzero.TrainState` (concrete or abstract; re-sharded onto the
        step's mesh) or the params' shapes (``jax.eval_shape`` of the init), from which
        ``zero.abstract_state(shapes, ema=step.ema, model_state=, rng=)`` is built.
      batch_shapes: the GLOBAL batch as arrays or ``ShapeDtypeStruct`` values.
      kind: the GPU kind for the memory verdict; default: read from the mesh's devices.
      compiler_options: XLA debug options for this compile only, e.g.
        ``jaxzero.gpu.xla_options(jaxzero.gpu.recommended_xla_flags())``
        (``{"xla_gpu_enable_pipelined_all_gather": True, ...}``); unlike ``XLA_FLAGS`` they
        may differ between compiles of one process.

    Nothing is allocated or run: ``step.jitted.lower(abstract state, abstract batch)
    .compile(compiler_options)``, for compile-only devices with this process's kernel cache
    (XLA:GPU reuses the kernels an earlier compile built). When XLA:GPU's Triton gemm emitter
    finds no tiling for a dot ("Couldn't find output tile sizes that satisfy hlo: %dot =
    f32[68,64]", seen on a ViT at some batch sizes), the step is compiled again with
    ``xla_gpu_enable_triton_gemm=False`` and the report says so (``triton_gemm_fallback``,
    :meth:`CompileReport.verdict`).
    """
    if not hasattr(step, "jitted") or not hasattr(step, "zero"):
        raise TypeError(
            f"step must be a jaxzero.TrainStep (from jaxzero.make_train_step), got "
            f"{type(step).__name__}."
        )
    mesh = step.zero.mesh
    kind = gpu_kind_of(mesh) if kind is None else gpu_spec(kind).kind
    state = _abstract_state(step, state_or_shapes, model_state, rng)
    batch = _abstract_batch(step, batch_shapes)
    t0 = time.perf_counter()
    with host_memory.lowering(mesh, step.zero.offload):
        lowered = step.jitted.lower(state, batch)
    given = compiler_options or {}
    # compile-only devices share this process's kernels (attached GPUs: the step's own
    # compile, whose options the report's compile must not change, is the one to reuse)
    cache = _kernel_cache() if mesh.devices.flat[0] not in jax.devices() else {}
    compiled, used, fallback = _compile(lowered, {**cache, **given})
    # the options the caller gave (and the Triton retry's), not the kernel cache's file
    options = {k: v for k, v in used.items() if k in given or k not in cache}
    seconds = time.perf_counter() - t0
    hlo = compiled.as_text()
    mem = _memory(compiled)
    _check_host(step, state, mem)
    return CompileReport(
        kind=kind,
        devices=math.prod(mesh.devices.shape),
        argument_bytes=mem["argument"],
        output_bytes=mem["output"],
        alias_bytes=mem["alias"],
        temp_bytes=mem["temp"],
        hbm_bytes=None if kind is None else gpu_spec(kind).memory_bytes,
        collectives=collectives_per_step(hlo, step.zero.num_shards),
        kernels_per_step=kernels_per_step(hlo),
        trip_counts_known=computation_multipliers(hlo)[1],
        compile_seconds=seconds,
        hlo_text=hlo,
        overlap=overlap_per_step(hlo, step.zero.num_shards),
        compiler_options=tuple(sorted((k, str(v)) for k, v in options.items())),
        triton_gemm_fallback=fallback,
        host_transfers=host_transfers_per_step(hlo),
        **{f"{k}_bytes": mem[k] for k in mem if k.startswith("host_")},
    )
