"""The NVMe tier's two benchmarks run end to end at a tiny size and print what they say:
``benchmarks/nvme.py`` (the swapper against plain I/O; it checks its own file's contents)
and ``benchmarks/nvme_train.py`` (a training run's peak resident memory against its state on
disk), whose byte counts are checked here against the formulas of the model it builds."""

from __future__ import annotations

import os
import re
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def _run(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_swapper_benchmark_prints_each_pass_beside_plain_io(tmp_path):
    text = _run(
        "nvme.py", "--gb", "0.05", "--group-mb", "4", "--rounds", "1", "--dir", str(tmp_path)
    )
    rows = (
        "plain write |",
        "plain read |",
        "swapper write |",
        "swapper read |",
        "swapper update (",
    )
    for row in rows:
        assert f"| {row}" in text, text
    assert os.listdir(tmp_path) == []  # its files are deleted at the end


def test_training_benchmark_prints_the_state_on_disk_the_window_and_each_phase(tmp_path):
    side, buffers, steps = 256, 2, 2
    out = tmp_path / "table.md"
    text = _run(
        "nvme_train.py", "--gb", "0.006", "--side", str(side), "--buffers", str(buffers),
        "--steps", str(steps), "--dir", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    leaves = int(re.search(r"(\d+) kernels of", text).group(1))
    assert leaves == round(0.006e9 / (12 * side * side))  # an fp32 master, mu and nu
    unit = {"MB": 1e6, "GB": 1e9}
    disk, window, compute = (
        float(number) * unit[u]
        for number, u in re.findall(
            r"([\d.]+) ([MG]B)",
            re.search(r"^State on disk .*$", text, re.M).group(0),
        )
    )
    # the file holds the state's bytes (Adam's step count and alignment add under 1%)
    state = 12 * leaves * side * side
    assert state <= disk + 0.05e6 and disk <= 1.01 * state + 0.05e6, (disk, state)
    assert abs(window - buffers * 12 * side * side) <= 0.05e6
    assert abs(compute - 2 * leaves * side * side) <= 0.05e6
    phases = re.findall(r"^\| (init|step \d) \|", text, re.M)
    assert phases == ["init"] + [f"step {i + 1}" for i in range(steps)]
    assert out.read_text().strip() == text.strip()
    assert [p for p in os.listdir(tmp_path) if p != "table.md"] == []  # the state's file removed
