"""``jaxzero plan --offload auto --gpu-memory SIZE`` and ``--offload-fraction F`` on a tiny
shape (deviceless H100s, 2 scanned layers x 256 at N = 8, stage 3 per layer): auto compiles
everything offloaded, then the smallest fraction the linear model says fits, and prints it
with the PCIe columns; the flags that would not act are refused with the fix."""

from __future__ import annotations

import re

import pytest

from jaxzero import cli
from jaxzero.memory import parse_bytes

ARGV = ["plan", "--devices", "8", "--layers", "2", "--hidden", "256", "--heads", "2"]
ARGV += ["--vocab", "512", "--seq", "16", "--stage", "3", "--stage3", "per-layer"]
# between the step without offload (9.80 MB) and with all of it offloaded (6.38 MB)
LIMIT = "8MB"


def _row(out):
    return next(line for line in out.splitlines() if line.startswith("3 per layer"))


def _mb(cell) -> float:
    return parse_bytes(cell.replace(" ", "")) / 1e6


def test_gpu_plan_offload_auto_picks_the_smallest_fraction_that_fits(capsys):
    assert cli.main([*ARGV, "--offload", "auto", "--gpu-memory", LIMIT]) == 0
    out = capsys.readouterr().out
    assert "offload the smallest fraction of the optimizer that fits" in out
    assert "8.00 MB per GPU" in out
    header = next(line for line in out.splitlines() if line.startswith("stage"))
    assert "offloaded" in header and "PCIe h2d" in header
    cells = re.split(r"\s{2,}", _row(out))
    f = float(cells[1])
    assert 0 < f < 1
    peak, host, h2d = _mb(cells[2]), _mb(cells[5]), _mb(cells[11])
    assert peak <= 8.0 and cells[7].startswith("fits in")
    # the compiles tried: everything offloaded (its peak and host bytes), then f
    tried = re.search(r"3 per layer: 1: ([\d.]+) MB, \d+%; ([\d.]+): ([\d.]+) MB, \d+%", out)
    assert tried and float(tried.group(2)) == f and float(tried.group(3)) == pytest.approx(peak)
    full_peak = float(tried.group(1))
    full_host = 2.95  # the host bytes with everything offloaded (tests/test_gpu_offload.py)
    # f is the linear model's smallest: one hundredth less would not fit by the model
    assert full_peak + (1 - f) * full_host <= 8.0 + 0.03
    assert full_peak + (1 - (f - 0.01)) * full_host > 8.0 - 0.03
    # the host holds at least f of the state, and the PCIe bytes moved are that host state
    assert f * full_host <= host + 0.01 and h2d == pytest.approx(host, rel=0.02)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--offload-fraction", "0.5"], "--offload-fraction 0.5 needs --offload optimizer"),
        (
            ["--offload", "auto", "--offload-fraction", "0.5"],
            "--offload-fraction 0.5 needs --offload optimizer",
        ),
        (["--offload", "optimizer", "--offload-fraction", "1.5"], r"must be a number in \(0, 1\]"),
        (["--offload", "optimizer", "--gpu-memory", "lots"], "--gpu-memory"),
    ],
)
def test_plan_refuses_offload_flags_that_would_not_act(capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        cli.main([*ARGV, *extra])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)
