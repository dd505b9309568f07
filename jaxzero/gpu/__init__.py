"""Planning for GPU clusters without a GPU: XLA:GPU compiles jaxzero's step for a described
cluster (``compile_only_mesh``), and ``compile_report`` / ``plan`` read the compiler's bytes,
collectives and kernels per device.

    mesh = jaxzero.gpu.compile_only_mesh("h100", 64)        # needs jax[cuda12], not a GPU
    zero = jz.ZeRO(optax.adam(1e-4), mesh, stage=3, precision="bf16")
    step = jz.make_train_step(loss_fn, zero)
    report = jaxzero.gpu.compile_report(step, param_shapes, batch_shapes)
    report.peak_bytes, report.verdict(), report.payload("all-gather", "bf16")
    report.host_transfers.h2d_bytes, report.transfer_summary()    # with ZeRO(offload=...)
"""

from jaxzero.gpu.hlo import (
    CollectiveTotal,
    collectives_per_step,
    computation_multipliers,
    kernel_bytes_per_step,
    kernels_per_step,
)
from jaxzero.gpu.models import ModelShape, model_shape
from jaxzero.gpu.offload_cost import OffloadCost, offload_cost
from jaxzero.gpu.overlap import OverlapTotal, overlap_per_step
from jaxzero.gpu.plan import PlanRow, WireTime, plan, plan_cases, wire_time
from jaxzero.gpu.report import CompileReport, compile_report, steady_state
from jaxzero.gpu.targets import GPU_KINDS, GpuSpec, gpu_spec, target_config
from jaxzero.gpu.topology import (
    INSTALL_HINT,
    PluginMissingError,
    compile_only_mesh,
    recommended_xla_flags,
    topology_string,
    xla_options,
)
from jaxzero.gpu.transfers import HostTransfers, host_transfers_per_step

__all__ = [
    "GPU_KINDS",
    "INSTALL_HINT",
    "CollectiveTotal",
    "CompileReport",
    "GpuSpec",
    "HostTransfers",
    "ModelShape",
    "OffloadCost",
    "OverlapTotal",
    "PlanRow",
    "PluginMissingError",
    "WireTime",
    "collectives_per_step",
    "compile_only_mesh",
    "compile_report",
    "steady_state",
    "computation_multipliers",
    "gpu_spec",
    "kernel_bytes_per_step",
    "host_transfers_per_step",
    "kernels_per_step",
    "model_shape",
    "offload_cost",
    "overlap_per_step",
    "plan",
    "plan_cases",
    "recommended_xla_flags",
    "target_config",
    "topology_string",
    "wire_time",
    "xla_options",
]
