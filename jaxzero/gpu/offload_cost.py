"""What offload costs in step time: the host <-> device bytes the compiled step moves
(:mod:`jaxzero.gpu.transfers`), the share the schedule hides, and the step time predicted at a
PCIe bandwidth, beside ZeRO-Infinity's efficiency formula.

The model, per GPU per step:

* **compute**: ``8 x params x tokens`` FLOP (the forward, the rematerialised forward and the
  backward of a decoder that remats every layer; attention's ``seq^2`` terms left out) at
  :data:`MFU` of the GPU's dense bf16 peak;
* **transfer**: the HLO's host->device plus device->host bytes at the link's rate, the two
  directions one after the other (PCIe is full duplex: where a fetch and a write-back run
  at once this overstates the time); the **exposed** part is the bytes no compute kernel overlaps in the schedule;
* **step** = compute + exposed transfer, plus the hidden transfer's time beyond the compute
  its copies overlap (the whole step; a deferred update's rows run inside the first
  micro-batch's forward only: 2 of its ``8 x params x tokens``, so a quarter of the compute
  over the micro-batches) (the collectives' time is not in it: the plan shows their hidden
  share apart);
* **ZeRO-Infinity** (Rajbhandari et al. 2021, section 4): efficiency = ait x bw / (ait x bw +
  peak), with ``ait`` the FLOP per byte of offloaded state moved, the state read and written
  once per step (2 x its bytes), ``bw`` the link's bytes/s and ``peak`` the achieved FLOP/s.
  With 16 bytes of state per parameter sharded over N GPUs and the compute above, ait =
  seq x bsz x N / 4, the paper's figure. It assumes nothing overlaps.

With the state on NVMe (:class:`DiskCost`, ``jaxzero plan --nvme-gbps R W``) the disk is a
third tier, one per node and shared by that node's GPUs:

* **disk bytes**: each step reads and writes every offloaded state byte of the node's GPUs
  once (the swapper's pass over its groups, :mod:`jaxzero.zero.offload.nvme`): per GPU the
  compiled host arguments (the fp32 master and Adam's moments, 12 bytes per parameter over
  N), times the GPUs on the node;
* **disk time** = bytes / read rate + bytes / write rate: the pipelined pass overlaps a group's
  read, update and write with each other, but one disk serves the reads and the writes, so
  they add up (decision 50 measured the read-ahead/write-behind pass at 0.90x the plain
  read and write added together);
* **step** = compute + max(disk time, exposed PCIe time): the update pass runs after the
  backward, and a group's host <-> device copies overlap the disk's other groups;
* **ZeRO-Infinity** (section 4: efficiency = ait x bw / (ait x bw + peak), ait = the
  iteration's computation over the data moved, the optimizer state read and written once)
  with ``bw`` the disk's rate per GPU: 2 x bytes over the disk time, over the node's GPUs.
  It equals compute / (compute + disk time): the disk time not overlapped with compute.
"""

from __future__ import annotations

import dataclasses

from jaxzero.gpu.report import CompileReport
from jaxzero.gpu.targets import gpu_spec

__all__ = [
    "MFU",
    "DiskCost",
    "OffloadCost",
    "disk_cost",
    "offload_cost",
    "step_flops",
    "update_window",
]

#: The share of the dense bf16 peak the compute is assumed to reach (the issue's and
#: ZeRO-Infinity's worked examples use about half of peak).
MFU = 0.5


def step_flops(num_params: int, tokens: int) -> float:
    """``8 x num_params x tokens``: a rematerialised decoder's forward, recomputed forward
    and backward over ``tokens`` tokens (per GPU per step)."""
    return 8.0 * num_params * tokens


@dataclasses.dataclass(frozen=True)
class OffloadCost:
    """One compiled step's offload cost per GPU (module docstring). Bytes are the HLO's;
    ``state_bytes`` the offloaded state per GPU (the compiled host arguments); ``gbps`` the
    link in GB/s (1e9 bytes/s)."""

    h2d_bytes: int
    d2h_bytes: int
    hidden_bytes: int
    state_bytes: int
    flops: float
    compute_seconds: float
    gbps: float
    #: the share of the compute the hidden copies can overlap, the whole step by default
    window: float = 1.0

    @property
    def bytes(self) -> int:
        return self.h2d_bytes + self.d2h_bytes

    @property
    def hidden_share(self) -> float:
        return self.hidden_bytes / self.bytes if self.bytes else 1.0

    @property
    def transfer_seconds(self) -> float:
        return self.bytes / (self.gbps * 1e9)

    @property
    def exposed_seconds(self) -> float:
        return (self.bytes - self.hidden_bytes) / (self.gbps * 1e9)

    @property
    def hidden_seconds(self) -> float:
        return self.hidden_bytes / (self.gbps * 1e9)

    @property
    def step_seconds(self) -> float:
        """The compute, plus the hidden transfer's time beyond the compute its copies overlap
        (:attr:`window` of it: the copies the schedule overlaps with compute still take the
        link's time, and a window shorter than its copies waits for them), plus the exposed
        transfer."""
        window = self.window * self.compute_seconds
        return self.compute_seconds + max(0.0, self.hidden_seconds - window) + self.exposed_seconds

    @property
    def slowdown(self) -> float:
        """``step_seconds`` over the compute alone (the step without offload's transfers)."""
        return self.step_seconds / self.compute_seconds

    @property
    def formula_bytes(self) -> int:
        """The bytes ZeRO-Infinity's formula moves, the offloaded state read and written once."""
        return 2 * self.state_bytes

    @property
    def ait(self) -> float:
        """FLOP per byte of state moved (ZeRO-Infinity's arithmetic intensity)."""
        return self.flops / self.formula_bytes if self.formula_bytes else float("inf")

    @property
    def formula_efficiency(self) -> float:
        """ZeRO-Infinity's ``ait x bw / (ait x bw + peak)``, peak the achieved FLOP/s."""
        if not self.formula_bytes:
            return 1.0
        bw, peak = self.gbps * 1e9, self.flops / self.compute_seconds
        return self.ait * bw / (self.ait * bw + peak)


def update_window(update: str | None, accum: int) -> float:
    """The share of a step's compute that its offloaded update's hidden copies can overlap,
    :func:`offload_cost`'s ``window``: the whole step for the update after the backward
    (``update`` None); for ``ZeRO(offload_update="deferred")`` or ``"delayed"`` the first of
    ``accum`` micro-batches' forward, where the rows run (2 of its 8 x params x tokens FLOP):
    ``1 / (4 x accum)``. A layer's copies start and end within its trip of that forward loop,
    so the forward bounds them (a delayed step's last write-backs run on into the backward)."""
    return 1 / (4 * accum) if update else 1.0


def offload_cost(
    report: CompileReport,
    num_params: int,
    tokens: int,
    *,
    kind: str | None = None,
    gbps: float | None = None,
    mfu: float = MFU,
    window: float = 1.0,
) -> OffloadCost:
    """The :class:`OffloadCost` of ``report`` for a model of ``num_params`` trained on
    ``tokens`` tokens per GPU per step, on ``kind`` (default the report's) at ``gbps`` GB/s
    (default the kind's ``pcie_bytes_per_s``, :data:`jaxzero.gpu.targets.PCIE_SOURCES`);
    ``window``: the share of the compute the hidden copies can overlap (1: the whole step;
    an update in the next forward's rows, :func:`update_window`)."""
    kind = kind or report.kind
    if kind is None:
        raise ValueError(
            "the report has no GPU kind (a mesh of no bundled GPU): pass kind='h100', 'h200' "
            "or 'a100'."
        )
    spec = gpu_spec(kind)
    if gbps is None:
        gbps = spec.pcie_bytes_per_s / 1e9
    if isinstance(gbps, bool) or not isinstance(gbps, int | float) or not gbps > 0:
        raise ValueError(f"gbps={gbps!r} must be a positive number of GB/s (1e9 bytes/s).")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu!r} must be in (0, 1]: the share of the bf16 peak reached.")
    if not 0 < window <= 1:
        raise ValueError(f"window={window!r} must be in (0, 1]: the share of the compute.")
    for name, v in (("num_params", num_params), ("tokens", tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int.")
    flops = step_flops(num_params, tokens)
    t = report.host_transfers
    return OffloadCost(
        h2d_bytes=t.h2d_bytes,
        d2h_bytes=t.d2h_bytes,
        hidden_bytes=t.hidden_bytes,
        state_bytes=report.host_argument_bytes,
        flops=flops,
        compute_seconds=flops / (mfu * spec.bf16_flops),
        gbps=float(gbps),
        window=window,
    )


@dataclasses.dataclass(frozen=True)
class DiskCost:
    """One row's NVMe cost per node per step (module docstring): ``cost`` the row's
    :class:`OffloadCost`, ``gpus`` the GPUs sharing the node's disk, ``read_gbps`` and
    ``write_gbps`` its rates in GB/s (1e9 bytes/s)."""

    cost: OffloadCost
    gpus: int
    read_gbps: float
    write_gbps: float

    @property
    def bytes(self) -> int:
        """The bytes the node's disk reads per step, and writes: every GPU's offloaded state."""
        return self.cost.state_bytes * self.gpus

    @property
    def read_seconds(self) -> float:
        return self.bytes / (self.read_gbps * 1e9)

    @property
    def write_seconds(self) -> float:
        return self.bytes / (self.write_gbps * 1e9)

    @property
    def seconds(self) -> float:
        """The disk's time per step: the reads then the writes (one disk serves both)."""
        return self.read_seconds + self.write_seconds

    @property
    def step_seconds(self) -> float:
        """Compute, then the update pass: the disk or the exposed PCIe copies, the slower."""
        return self.cost.compute_seconds + max(self.seconds, self.cost.exposed_seconds)

    @property
    def slowdown(self) -> float:
        """``step_seconds`` over the compute alone."""
        return self.step_seconds / self.cost.compute_seconds

    @property
    def ait(self) -> float:
        """ZeRO-Infinity's arithmetic intensity: FLOP per byte of state read and written."""
        return self.cost.ait

    @property
    def bytes_per_second(self) -> float:
        """The disk's rate per GPU over a read and a write of the state (``bw``)."""
        return 2 * self.bytes / self.seconds / self.gpus if self.bytes else float("inf")

    @property
    def efficiency(self) -> float:
        """ZeRO-Infinity's ``ait x bw / (ait x bw + peak)`` with the disk's ``bw``."""
        if not self.bytes:
            return 1.0
        bw, peak = self.bytes_per_second, self.cost.flops / self.cost.compute_seconds
        return self.ait * bw / (self.ait * bw + peak)


def disk_cost(cost: OffloadCost, read_gbps: float, write_gbps: float, gpus: int) -> DiskCost:
    """The :class:`DiskCost` of a row's ``cost`` with its state on a disk read at
    ``read_gbps`` and written at ``write_gbps`` GB/s, shared by ``gpus`` GPUs."""
    for name, v in (("read_gbps", read_gbps), ("write_gbps", write_gbps)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ValueError(f"{name}={v!r} must be a positive number of GB/s (1e9 bytes/s).")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} must be a positive int: the GPUs sharing the disk.")
    return DiskCost(cost, gpus, float(read_gbps), float(write_gbps))
