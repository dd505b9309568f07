#!/usr/bin/env bash
# The offload check on one GPU, in one call of at most ~9 minutes, with the machine's own
# python3 (jax with its CUDA plugin, flax, optax, orbax, chex, PyTorch): nothing installed,
# the repository on PYTHONPATH. Run from the repository root:
#
#     OUT=/some/folder bash benchmarks/gpu_offload_check.sh
#
# Writes under $OUT: run.log (everything printed, the versions and nvidia-smi first),
# pcie_duplex.md and pcie_duplex_async16.md (both PCIe directions at once, PyTorch's two
# streams beside XLA's, without and with XLA's parallel async compute limit of 16), and
# offload_gpu_accum8.md and offload_gpu_accum1.md (the 1.32B GPT's offload rows beside their
# predictions). Each part runs under its own time limit, so one that hangs or runs long leaves
# the others' results; a part cut short still has its finished rows in run.log.
set -o pipefail
OUT=${OUT:?set OUT to the folder to write into}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# the step and compile_report's AOT compile of it are one compile with a persistent cache
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxzero-xla-cache}
PY=${PYTHON:-python3}
LOG=$OUT/run.log
START=$SECONDS
declare -A RC

log() { echo "== [$((SECONDS - START)) s] $*" | tee -a "$LOG"; }

# part NAME SECONDS CMD...: run CMD under a time limit, its output appended to run.log
part() {
    local name=$1 limit=$2
    shift 2
    log "$name (limit ${limit} s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    RC[$name]=$?
    log "$name: exit ${RC[$name]}"
}

log "header"
{
    date -u
    git rev-parse HEAD 2>/dev/null || true
    nvidia-smi
    "$PY" -c 'import sys, jax, jaxlib, flax, optax, orbax.checkpoint as oc, chex, jaxzero
print("python", sys.version.split()[0])
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__,
      "optax", optax.__version__, "orbax-checkpoint", oc.__version__, "chex", chex.__version__)
print("devices", jax.devices())'
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee -a "$LOG"

# (a) both PCIe directions at once: XLA's rows beside PyTorch's two streams
part pcie_duplex 60 "$PY" benchmarks/pcie_duplex.py --torch --rounds 3 \
    --out "$OUT/pcie_duplex.md"
part pcie_duplex_async16 60 env \
    XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_experimental_parallel_async_compute_limit=16" \
    "$PY" benchmarks/pcie_duplex.py --torch --rounds 3 --out "$OUT/pcie_duplex_async16.md"

# (b) the 1.32B GPT: plain jax.jit, then the jaxzero rows in the order named (most wanted first)
part offload_gpu_accum8 200 "$PY" benchmarks/offload_gpu.py --accum 8 --rounds 2 --steps 3 \
    --offloads optimizer optimizer+deferred optimizer+delayed optimizer,remainder off \
    optimizer,remainder+bf16state optimizer+bf16state --out "$OUT/offload_gpu_accum8.md"
part offload_gpu_accum1 200 "$PY" benchmarks/offload_gpu.py --accum 1 --rounds 2 --steps 3 \
    --offloads optimizer+deferred optimizer+delayed optimizer,remainder+bf16state optimizer \
    optimizer,remainder optimizer+bf16state off --out "$OUT/offload_gpu_accum1.md"

log "done; exit codes (124: cut at its limit):"
for name in pcie_duplex pcie_duplex_async16 offload_gpu_accum8 offload_gpu_accum1; do
    echo "  $name ${RC[$name]}" | tee -a "$LOG"
done
ls -l "$OUT" | tee -a "$LOG"
