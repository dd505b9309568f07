"""``jaxzero plan --offload optimizer --nvme-gbps R W``: the NVMe tier's disk bytes per node,
disk time, step and ZeRO-Infinity efficiency, against formulas worked out here from the
parameter count (a tiny LLaMA on deviceless H100s, 2 scanned layers x 256 at N = 8, stage 3
per layer), and the flags it refuses."""

from __future__ import annotations

import re

import optax
import pytest
from compile_memo import H100, reuse_gpu_compiles

import jaxzero as jz
from jaxzero import cli
from jaxzero.gpu.offload_cost import OffloadCost, disk_cost

ARGV = ["plan", "--devices", "8", "--layers", "2", "--hidden", "256", "--heads", "2"]
ARGV += ["--vocab", "512", "--seq", "256", "--batch", "4", "--stage", "3"]
ARGV += ["--stage3", "per-layer"]
READ, WRITE = 200.0, 100.0  # GB/s: the disk's time above the exposed PCIe copies of this model
NODE = 4  # GPUs per node: half the cluster's, so the node's bytes are not the cluster's
H100_BF16 = 989.4e12  # dense bf16 FLOP/s (NVIDIA's H100 SXM datasheet)
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "ms": 1e-3, "s": 1.0}


def _value(cell: str) -> float:
    number, unit = cell.split()
    return float(number) * UNITS[unit]


def _nvme_row(out: str) -> dict[str, str]:
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage") and "disk/node" in line)
    header = re.split(r"\s{2,}", lines[at].strip())
    cells = re.split(r"\s{2,}", lines[at + 2].strip())
    assert len(header) == len(cells), (header, cells)
    return dict(zip(header, cells, strict=True))


def test_plan_nvme_prints_the_node_disk_bytes_time_step_and_efficiency(capsys, monkeypatch):
    """The disk's bytes each way per node = Adam's 12 bytes per parameter (fp32 master, m, v)
    over the 8 GPUs' shards, times the node's 4 GPUs; read and write times = bytes / rate;
    the disk time their sum; the step = compute + disk (the disk slower than the PCIe copies
    here); ZeRO-Infinity's efficiency = compute / (compute + disk) from the printed compute,
    and the compute = 8 x params x tokens at half the H100's bf16 peak. The compile is
    tests/test_bytes_per_param.py's plan too: one process compiles it once."""
    reuse_gpu_compiles(monkeypatch, H100)
    argv = [*ARGV, "--offload", "optimizer", "--gpus-per-node", str(NODE)]
    assert cli.main([*argv, "--nvme-gbps", str(READ), str(WRITE)]) == 0
    out = capsys.readouterr().out
    params = int(re.search(r"-> ([\d,]+) params", out).group(1).replace(",", ""))
    assert f"{READ:g} GB/s read and {WRITE:g} GB/s write per node" in out
    assert f"shared by {NODE} GPUs" in out
    header = out.splitlines()[0]
    assert header.endswith(
        f"offload optimizer to NVMe ({READ:g} GB/s read, {WRITE:g} GB/s write), paged through "
        "pinned host memory"
    ), header
    row = _nvme_row(out)
    assert row["stage"] == "3 per layer"

    disk = 12 * params / 8 * NODE  # each way, per node per step
    # the printed bytes: 2 decimals of MB, plus Adam's 4-byte step count per GPU
    assert _value(row["disk/node"]) == pytest.approx(disk, abs=0.005e6 + 4 * NODE)
    read, write = disk / (READ * 1e9), disk / (WRITE * 1e9)
    assert _value(row["read"]) == pytest.approx(read, rel=5e-3)
    assert _value(row["write"]) == pytest.approx(write, rel=5e-3)
    assert _value(row["disk"]) == pytest.approx(read + write, rel=5e-3)

    compute = _value(row["compute"])
    tokens = 256 * 4
    assert compute == pytest.approx(8 * params * tokens / (0.5 * H100_BF16), rel=5e-3)
    assert _value(row["step"]) == pytest.approx(compute + read + write, rel=5e-3)
    assert float(row["x compute"].rstrip("x")) == pytest.approx(
        (compute + read + write) / compute, abs=0.01
    )
    efficiency = compute / (compute + read + write)
    assert float(row["ZI eff."].rstrip("%")) / 100 == pytest.approx(efficiency, abs=2e-3)
    # the lines to paste build the NVMe tier, and that spelling is a ZeRO the step takes
    paste = out[out.index("zero = jz.ZeRO(") :].split("\n")[0]
    assert 'offload=jz.NVMe("/nvme/run")' in paste and 'offload="optimizer"' not in paste
    mesh = jz.data_parallel_mesh(8)
    zero = eval(paste.split("=", 1)[1], {"jz": jz, "tx": optax.adam(1e-3), "mesh": mesh})
    assert zero.offload == "optimizer" and zero.nvme == jz.NVMe("/nvme/run")


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--nvme-gbps", "10", "5"], "--nvme-gbps .*add --offload optimizer"),
        (
            ["--offload", "optimizer,params", "--nvme-gbps", "10", "5"],
            "--nvme-gbps .*add --offload optimizer",
        ),
        (["--offload", "auto", "--nvme-gbps", "10", "5"], "--nvme-gbps .*add --offload optimizer"),
        (["--offload", "optimizer", "--nvme-gbps", "0", "5"], "must be positive"),
        (["--offload", "optimizer", "--nvme-gbps", "10", "-5"], "must be positive"),
    ],
)
def test_plan_refuses_nvme_gbps_without_the_optimizer_offload_or_with_a_bad_rate(
    capsys, extra, message
):
    with pytest.raises(SystemExit) as e:
        cli.main([*ARGV, *extra])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def _cost(state_bytes: int, exposed_bytes: int, compute_seconds: float) -> OffloadCost:
    """An :class:`OffloadCost` of ``state_bytes`` per GPU whose PCIe copies take
    ``exposed_bytes`` at 1 GB/s, none hidden, after ``compute_seconds`` of 1e12 FLOP/s."""
    return OffloadCost(
        h2d_bytes=exposed_bytes,
        d2h_bytes=0,
        hidden_bytes=0,
        state_bytes=state_bytes,
        flops=compute_seconds * 1e12,
        compute_seconds=compute_seconds,
        gbps=1.0,
    )


def test_disk_cost_adds_the_reads_and_writes_and_takes_the_slower_of_disk_and_pcie():
    """8 GB per GPU x 4 GPUs at 16 GB/s read and 8 GB/s write: 2 s + 4 s. The step is
    compute + 6 s while the PCIe copies take 1 s, compute + 9 s when they take 9 s; the
    efficiency is the paper's ait x bw / (ait x bw + peak) with ait = FLOP / (2 x 8 GB)
    and bw = 2 x 32 GB / 6 s / 4 GPUs, which is 3 / (3 + 6)."""
    d = disk_cost(_cost(8 * 10**9, 10**9, 3.0), 16, 8, 4)
    assert (d.bytes, d.read_seconds, d.write_seconds) == (32 * 10**9, 2.0, 4.0)
    assert d.step_seconds == pytest.approx(9.0) and d.slowdown == pytest.approx(3.0)
    ait, bw, peak = 3e12 / 16e9, 64e9 / 6 / 4, 1e12
    assert d.efficiency == pytest.approx(ait * bw / (ait * bw + peak))
    assert d.efficiency == pytest.approx(3 / 9)
    assert disk_cost(_cost(8 * 10**9, 9 * 10**9, 3.0), 16, 8, 4).step_seconds == 12.0


@pytest.mark.parametrize(
    "read,write,gpus",
    [(0, 8, 4), (16, -1, 4), (True, 8, 4), (16, 8, 0), (16, 8, 2.0)],
)
def test_disk_cost_refuses_rates_that_are_not_positive_and_a_gpu_count_not_an_int(
    read, write, gpus
):
    with pytest.raises(ValueError, match="must be a positive"):
        disk_cost(_cost(8, 0, 1.0), read, write, gpus)
