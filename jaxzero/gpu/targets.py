"""GPU targets for deviceless XLA:GPU compilation: public hardware figures and the text form of
XLA's ``GpuTargetConfigProto`` built from them.

XLA's GPU compiler needs a description of the device it compiles for (SM count, compute
capability, shared memory, bandwidth, ...). On a machine with GPUs it reads it from the driver;
without one, ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``
takes it as a text proto. :func:`target_config` writes that proto for each bundled part from
the figures below (vendor datasheets / the CUDA occupancy tables), so no file ships with the
package.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPU_KINDS", "PCIE_SOURCES", "GpuSpec", "gpu_spec", "target_config"]

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """The figures of one GPU part that XLA's cost models and the memory verdict use.

    ``memory_bytes`` is the device memory the planner budgets against (HBM total as the
    driver reports it); bandwidth is in bytes/s and the clock in GHz. ``bf16_flops`` is the
    dense bf16 tensor-core peak (FLOP/s, no sparsity) and ``pcie_bytes_per_s`` the pinned
    host <-> device copy rate per GPU that the offload cost assumes (:data:`PCIE_SOURCES`).
    """

    kind: str
    name: str
    sm_count: int
    compute_capability: tuple[int, int]
    memory_bandwidth: float
    l2_cache_bytes: int
    clock_ghz: float
    memory_bytes: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    fpus_per_core: int
    bf16_flops: float = 0.0
    pcie_bytes_per_s: float = 0.0


# One row per part: kind, name, SMs, compute capability, memory bandwidth (B/s), L2, clock (GHz),
# memory (B), shared memory per SM, per block (opt-in), FP32 units per SM.
# fmt: off
_SPECS = {spec.kind: spec for spec in (
    GpuSpec("h100", "NVIDIA H100 80GB HBM3", 132, (9, 0), 3.35e12, 50 * MIB, 1.98, 84_929_347_584, 228 * KIB, 227 * KIB, 128),  # noqa: E501
    GpuSpec("a100", "NVIDIA A100-SXM4-80GB", 108, (8, 0), 2.039e12, 40 * MIB, 1.41, 80 * GIB, 164 * KIB, 163 * KIB, 64),  # noqa: E501
)}
# fmt: on

# Dense bf16 tensor-core peaks (NVIDIA's H100 SXM5 and A100 datasheets: 989.4 and 312 TFLOPS
# without sparsity) and the pinned host <-> device copy rate the offload cost assumes.
_SPECS["h100"] = dataclasses.replace(_SPECS["h100"], bf16_flops=989.4e12, pcie_bytes_per_s=55e9)
_SPECS["a100"] = dataclasses.replace(_SPECS["a100"], bf16_flops=312e12, pcie_bytes_per_s=25e9)

#: Where each ``pcie_bytes_per_s`` default comes from (none measured on this project's
#: machines, which have no GPU).
PCIE_SOURCES = {
    "h100": "55 GB/s: pinned device-to-host copies measured on an H100 host with PCIe Gen5 "
    "x16 (64 GB/s nominal), as reported in NVIDIA-NeMo/RL issue 3976",
    "h200": "55 GB/s: the H100's PCIe Gen5 x16 link and measured pinned rate (same host interface)",
    "a100": "25 GB/s: PCIe Gen4 x16 (32 GB/s nominal) at the ~80% a pinned copy reaches on "
    "Gen4 hosts (jax-ml/jax#21438 quotes 25 GB/s for a CUDA pinned copy); not measured here",
}

# The H200 is the H100's chip (same SMs, clocks, caches) with more, faster memory.
_SPECS["h200"] = dataclasses.replace(
    _SPECS["h100"],
    kind="h200",
    name="NVIDIA H200",
    memory_bandwidth=4.8e12,
    memory_bytes=141 * 10**9,
)

GPU_KINDS = tuple(_SPECS)

# The same on every part bundled here (CUDA limits for compute capability 8.0 and 9.0).
_COMMON = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 48 * KIB,
    "threads_per_core_limit": 2048,
    "block_dim_limit_x": 2_147_483_647,
    "block_dim_limit_y": 65_535,
    "block_dim_limit_z": 65_535,
    "registers_per_core_limit": 65_536,
    "registers_per_block_limit": 65_536,
}
# The cuDNN and CUDA runtime versions the compiler may assume (jax[cuda12] 0.10 ships 9.x/12.x).
_DNN_VERSION = (9, 8)
_RUNTIME_VERSION = (12, 8, 0)


def gpu_spec(kind: str) -> GpuSpec:
    """The :class:`GpuSpec` of ``kind`` ("h100", "a100" or "h200", case-insensitive)."""
    if not isinstance(kind, str):
        raise TypeError(f"gpu kind must be a string such as 'h100', got {type(kind).__name__}.")
    spec = _SPECS.get(kind.strip().lower())
    if spec is None:
        raise ValueError(f"unknown GPU kind {kind!r}; use one of {', '.join(GPU_KINDS)}.")
    return spec


def target_config(kind: str, memory_bytes: int | None = None) -> str:
    """The text ``GpuTargetConfigProto`` of ``kind``, for ``get_topology_desc(target_config=)``;
    ``memory_bytes``: the device memory it states instead of the part's (a smaller budget, which
    XLA's scheduler then keeps the step's buffers under).

    Fields: ``gpu_device_info`` (thread/block/shared-memory/register limits, SM count, FPUs per
    SM, memory bandwidth, L2 size, clock, device memory, compute capability),
    ``platform_name``, ``dnn_version_info``, ``runtime_version`` and
    ``device_description_str``.
    """
    s = gpu_spec(kind)
    info = {
        **{k: _COMMON[k] for k in ("threads_per_block_limit", "threads_per_warp")},
        "shared_memory_per_block": _COMMON["shared_memory_per_block"],
        "shared_memory_per_core": s.shared_memory_per_core,
        "threads_per_core_limit": _COMMON["threads_per_core_limit"],
        "core_count": s.sm_count,
        "fpus_per_core": s.fpus_per_core,
        **{k: _COMMON[k] for k in ("block_dim_limit_x", "block_dim_limit_y", "block_dim_limit_z")},
        "memory_bandwidth": int(s.memory_bandwidth),
        "l2_cache_size": s.l2_cache_bytes,
        "clock_rate_ghz": s.clock_ghz,
        "device_memory_size": s.memory_bytes if memory_bytes is None else int(memory_bytes),
        "shared_memory_per_block_optin": s.shared_memory_per_block_optin,
    }
    major, minor = s.compute_capability
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in info.items()]
    lines += ["  cuda_compute_capability {", f"    major: {major}", f"    minor: {minor}", "  }"]
    lines += [
        f"  {k}: {_COMMON[k]}" for k in ("registers_per_core_limit", "registers_per_block_limit")
    ]
    lines += ["}", 'platform_name: "CUDA"']
    lines += [
        "dnn_version_info {",
        f"  major: {_DNN_VERSION[0]}",
        f"  minor: {_DNN_VERSION[1]}",
        "}",
    ]
    rt = _RUNTIME_VERSION
    lines += [
        "runtime_version {",
        f"  major: {rt[0]}",
        f"  minor: {rt[1]}",
        f"  patch: {rt[2]}",
        "}",
    ]
    lines.append(f'device_description_str: "{s.name}"')
    return "\n".join(lines) + "\n"
