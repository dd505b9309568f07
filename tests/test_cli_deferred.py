"""``jaxzero plan --offload optimizer --offload-update deferred`` (and ``delayed``): the
stage-3 per-layer row compiled as a step with an update pending (decision 51), its label and
the ``ZeRO`` to paste, the same PCIe bytes as the exact update with more of them hidden, and
the flags it refuses."""

from __future__ import annotations

import contextlib
import functools
import io
import re

import optax
import pytest

import jaxzero as jz
from jaxzero import cli, gpu
from jaxzero.gpu.models import model_shape

ARGV = ["plan", "--devices", "8", "--layers", "8", "--hidden", "256", "--heads", "2"]
ARGV += ["--vocab", "256", "--seq", "64", "--batch", "1", "--stage", "3"]
ARGV += ["--stage3", "per-layer", "--offload", "optimizer", "--wide"]


def _row(out: str) -> dict[str, str]:
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    header = re.split(r"\s{2,}", lines[at].strip())
    cells = re.split(r"\s{2,}", lines[at + 2].strip())
    return dict(zip(header, cells, strict=True))


@functools.cache
def _plan(update: str) -> str:
    """``jaxzero plan``'s output for ARGV with ``--offload-update update``, once per process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*ARGV, "--offload-update", update]) == 0
    return out.getvalue()


def test_the_deferred_row_moves_the_same_bytes_and_hides_them():
    """The exact row hides none of its PCIe bytes; the deferred row moves the same bytes each
    way and hides most of them (decision 51's figures: all but layers 0 and 1's and the
    leaves outside the stack), and pastes the ZeRO it compiled."""
    exact = _row(_plan("exact"))
    out = _plan("deferred")
    deferred = _row(out)
    assert exact["stage"] == "3 per layer"
    assert deferred["stage"] == "3 per layer, deferred update"
    assert deferred["PCIe h2d"] == exact["PCIe h2d"] and deferred["PCIe d2h"] == exact["PCIe d2h"]
    assert exact["PCIe hidden"] == "0%"
    assert int(deferred["PCIe hidden"].rstrip("%")) >= 60
    # this small model is the link's: its hidden copies outlast the window they run in, the
    # forward (2 of the step's 8 x params x tokens FLOP), so the deferred step saves that
    # window alone, a quarter of the compute: its step is compute / 4 shorter than the exact
    # one's (compute + every byte's time), not the whole hidden transfer
    x = lambda row: float(row["x compute"].rstrip("x"))
    assert x(exact) - x(deferred) == pytest.approx(0.25, abs=0.011)
    paste = out[out.index("zero = jz.ZeRO(") :]
    assert 'offload_update="deferred"' in paste


def test_the_delayed_row_moves_the_same_bytes_and_hides_more_of_them():
    """The delayed row (ZeRO-Offload's DPU, the first delayed step compiled) moves the exact
    row's bytes each way, hides more of them than the deferred row (no gather waits for its
    rows: decision 51, 70% against 46% on 4 layers), is predicted in the same window (the
    first micro-batch's forward) and pastes the ZeRO it compiled."""
    exact, deferred = _row(_plan("exact")), _row(_plan("deferred"))
    out = _plan("delayed")
    delayed = _row(out)
    assert delayed["stage"] == "3 per layer, delayed update"
    assert delayed["PCIe h2d"] == exact["PCIe h2d"] and delayed["PCIe d2h"] == exact["PCIe d2h"]
    hidden = lambda row: int(row["PCIe hidden"].rstrip("%"))
    assert hidden(delayed) > hidden(deferred) >= 60
    x = lambda row: float(row["x compute"].rstrip("x"))
    assert x(exact) - x(delayed) == pytest.approx(0.25, abs=0.011)
    paste = out[out.index("zero = jz.ZeRO(") :]
    assert 'offload_update="delayed"' in paste


#: flags that leave no scanned per-layer stage-3 row with the whole state offloaded
REFUSED = [
    (["--offload-fraction", "0.5"], "no --offload-fraction"),
    (["--stage3", "whole"], "--stage3 per-layer or both"),
    (["--loop", "python"], "--loop scan"),
    (["--precision", "fp32"], "--precision bf16 or fp16"),
]


@pytest.mark.parametrize("extra,match", REFUSED)
def test_plan_refuses_a_deferred_update_where_it_cannot_run(extra, match, capsys):
    with pytest.raises(SystemExit):
        cli.main([*ARGV, "--offload-update", "deferred", *extra])
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("extra,match", REFUSED)
def test_plan_refuses_a_delayed_update_where_it_cannot_run(extra, match, capsys):
    with pytest.raises(SystemExit):
        cli.main([*ARGV, "--offload-update", "delayed", *extra])
    err = capsys.readouterr().err
    assert match in err and "--offload-update delayed runs" in err


def test_gpu_plan_refuses_a_deferred_update_without_its_case():
    """``jaxzero.gpu.plan`` of a deferred or delayed ZeRO without the (3, True) case, or with
    ``fit_offload``, is refused before anything compiles."""
    shape = model_shape(layers=2, hidden=256, heads=2, vocab=256, seq=64, batch=1)
    mesh = gpu.compile_only_mesh("h100", 8)
    kw = dict(stage=3, precision="bf16", layers="layers", offload="optimizer")
    for update in ("deferred", "delayed"):
        zero = jz.ZeRO(optax.adam(1e-3), mesh, offload_update=update, **kw)
        for plan_kw in ({"cases": [(3, False)]}, {"fit_offload": True}):
            with pytest.raises(ValueError, match=f"offload_update='{update}'"):
                gpu.plan(zero, shape, **plan_kw)
