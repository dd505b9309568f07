"""``jaxzero plan --offload auto --gpu-memory SIZE`` and ``--offload-fraction F`` on a tiny
shape (deviceless H100s, 2 scanned layers x 256 at N = 8, stage 3 per layer): auto compiles
everything offloaded, then the smallest fraction the linear model says fits, and prints it
with the PCIe columns; the flags that would not act are refused with the fix."""

from __future__ import annotations

import math
import re

import pytest
from compile_memo import reuse_gpu_compiles

from jaxzero import cli
from jaxzero.gpu import offload_fraction
from jaxzero.memory import parse_bytes

ARGV = ["plan", "--devices", "8", "--layers", "2", "--hidden", "256", "--heads", "2"]
ARGV += ["--vocab", "512", "--seq", "16", "--stage", "3", "--stage3", "per-layer"]
# between the step without offload (9.80 MB on an 80 GB H100) and with all of it offloaded
LIMIT = "8MB"


def _row(out):
    return next(line for line in out.splitlines() if line.startswith("3 per layer"))


def _mb(cell) -> float:
    """A bytes cell in MB, without the bytes per parameter a PCIe cell adds."""
    return parse_bytes(cell.split(" (")[0].replace(" ", "")) / 1e6


def test_gpu_plan_offload_auto_picks_the_smallest_fraction_that_fits(capsys, monkeypatch):
    """Compiled for 8 MB devices the step is tight: the linear model's fraction fits but XLA's
    scheduler then hides less of the all-gather + reduce-scatter bytes, so auto bisects
    towards 1. The row is the smallest fraction compiled that fits and hides as much as the
    step with everything offloaded. One bisection (three compiles: the test's time; the
    bisection itself is tests/test_offload_fraction.py's). The three compiles are
    tests/test_cli_plan_output.py's too: one process compiles them once."""
    monkeypatch.setattr(offload_fraction, "BISECTIONS", 1)
    reuse_gpu_compiles(monkeypatch, "8 x h100, 8MB")
    assert cli.main([*ARGV, "--wide", "--offload", "auto", "--gpu-memory", LIMIT]) == 0
    out = capsys.readouterr().out
    assert "offload the smallest fraction of the optimizer that fits" in out
    assert "8.00 MB per GPU" in out
    header = next(line for line in out.splitlines() if line.startswith("stage"))
    assert "offloaded" in header and "PCIe h2d" in header
    cells = re.split(r"\s{2,}", _row(out))
    f = float(cells[1])
    peak, host, h2d = _mb(cells[2]), _mb(cells[5]), _mb(cells[11])
    assert 0 < f < 1 and peak <= 8.0
    # the verdict in the limit's units, not "fits in 0.01 GB with 0.00 GB to spare"
    fits = re.fullmatch(r"fits in 8\.00 MB with ([\d.]+) (MB|KB) to spare", cells[7])
    assert fits, cells[7]
    spare = float(fits[1]) / (1 if fits[2] == "MB" else 1000)
    assert spare == pytest.approx(8.0 - peak, abs=0.006)
    note = out.split("per fraction tried: compiled peak, hidden AG+RS: 3 per layer: ")[1]
    tried = [
        (float(a), float(p), int(h))
        for a, p, h in re.findall(r"([\d.]+): ([\d.]+) MB, (\d+)%", note)
    ]
    (one, full_peak, full_hidden), rest = tried[0], tried[1:]
    assert one == 1.0 and rest
    # the first check is the linear model's: 2.95 MB of state (everything offloaded,
    # tests/test_gpu_offload.py), the device taking (1 - f) of it, rounded up to 0.01
    assert rest[0][0] == math.ceil(100 * (1 - (8.0 - full_peak) / 2.95)) / 100
    keeps = [a for a, p, h in rest if p <= 8.0 and h >= full_hidden - 2]
    assert f == min(keeps) and int(cells[8].split("%")[0]) >= full_hidden - 2
    # the host holds at least f of the state, and the PCIe bytes moved are that host state
    assert f * 2.95 <= host + 0.01 and h2d == pytest.approx(host, rel=0.02)


def test_gpu_plan_offload_auto_offloads_the_params_too_where_the_optimizer_is_not_enough(
    capsys, monkeypatch
):
    """Compiled for 5 MB devices the tiny step does not fit with the whole optimizer side
    offloaded (5.42 MB) but fits with the params offloaded too (4.52 MB): auto's row is
    ``--offload optimizer,params``'s own for the same memory, peak, host and PCIe bytes
    alike, and its note lists the fraction 1 that did not fit before the params. In fp32
    ZeRO does not build the params offload (it writes 16-bit gradients into the params' host
    buffers): the row stays at 1, short of the memory. ``--offload optimizer,params`` lowers
    the very module auto compiled last, so that compile is reused (a module of its own would
    be compiled, and its row still compared)."""
    reuse_gpu_compiles(monkeypatch, "8 x h100, 5MB")
    limit = ["--gpu-memory", "5MB"]
    assert cli.main([*ARGV, "--wide", "--offload", "auto", *limit]) == 0
    auto = capsys.readouterr().out
    assert cli.main([*ARGV, "--wide", "--offload", "optimizer,params", *limit]) == 0
    ref = re.split(r"\s{2,}", _row(capsys.readouterr().out))
    cells = re.split(r"\s{2,}", _row(auto))
    assert cells[1] == "1 + params" and cells[7].startswith("fits in")
    for k in (1, 4, 9, 10):  # compiled peak, host bytes, PCIe h2d and d2h
        assert cells[k + 1] == ref[k], (k, cells[k + 1], ref[k])
    note = auto.split("per fraction tried: compiled peak, hidden AG+RS: 3 per layer: ")[1]
    (one, peak_one), (params, peak_params) = re.findall(r"(1(?: \+ params)?): ([\d.]+) MB", note)
    assert (one, params) == ("1", "1 + params")
    assert float(peak_one) > 5.0 >= float(peak_params) == _mb(ref[1])
    assert cli.main([*ARGV, "--wide", "--precision", "fp32", "--offload", "auto", *limit]) == 0
    cells = re.split(r"\s{2,}", _row(capsys.readouterr().out))
    assert cells[1] == "1" and re.fullmatch(r"short by [\d.]+ (MB|KB) of 5\.00 MB", cells[7])


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


def test_plan_refuses_params_offload_beside_the_whole_stage3_row(capsys):
    """``--offload optimizer,params`` keeps the params on the host only where stage 3 fetches a
    layer at a time: with ``--stage3`` both (the default) or whole it is refused before any
    compile, naming ``--stage3 per-layer``."""
    argv = [a for a in ARGV if a not in ("--stage3", "per-layer")]
    for stage3 in ([], ["--stage3", "whole"]):
        with pytest.raises(SystemExit) as e:
            cli.main([*argv, *stage3, "--offload", "optimizer,params"])
        assert e.value.code == 2
        assert "Add --stage3 per-layer" in capsys.readouterr().err
