"""What ``jaxzero plan`` prints, on a tiny shape (deviceless H100s, 2 scanned layers x 256 at
N = 8, stage 3 per layer): a table that fits 100 columns by default (``--wide``: every
column), no carriage returns when the output is not a terminal, XLA's fd-2 log lines summed
up after the table instead of inside it, the verdict judged on the compiled peak (the
formula estimate beside it explained), and a ``jz.ZeRO(...)`` line that builds the row."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import sys
import textwrap
import types

import jax
import optax
import pytest
from compile_memo import H100, reuse_gpu_compiles

import jaxzero as jz
from jaxzero import cli, gpu
from jaxzero.cli.plan import formula_note, log_summary, progress
from jaxzero.gpu import offload_fraction
from jaxzero.gpu.plan import plan_tx
from jaxzero.memory import format_bytes

ARGV = ["plan", "--devices", "8", "--layers", "2", "--hidden", "256", "--heads", "2"]
ARGV += ["--vocab", "512", "--seq", "16", "--stage", "3", "--stage3", "per-layer"]
# what XLA:GPU printed on a 1.3B GPT's probe compiles, straight to file descriptor 2
PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
REMAT = (
    "W1128 17:04:28.424257    4041 hlo_rematerialization.cc:3231] Can't reduce memory use "
    "below 17.30GiB (18581353966 bytes) by rematerialization; only reduced to 24.49GiB"
)
# the columns of the table before --wide existed, "estimate" now "formula est."
WIDE = ["stage", "GPU-compiled", "formula est.", "state", "host", "host est.", "verdict"]
WIDE += ["hidden AG+RS", "kernels", "PCIe h2d", "PCIe d2h", "PCIe hidden", "step @55 GB/s"]
WIDE += ["x compute", "ZI eff.", "collectives per step (hidden share)"]


def _noisy_plan(monkeypatch, rows_seen):
    """``gpu.plan`` that writes XLA's lines to fd 2 before each compile, as XLA does."""
    real = gpu.plan

    def spy(*a, **kw):
        on_case = kw["on_case"]

        def noisy(label, i, total):
            on_case(label, i, total)
            os.write(2, f"{PREAMBLE}\n{REMAT}\n".encode())

        rows = real(*a, **{**kw, "on_case": noisy})
        rows_seen.extend(rows)
        return rows

    monkeypatch.setattr(gpu, "plan", spy)


def _cells(line):
    return re.split(r"\s{2,}", line.strip())


def test_plan_prints_a_compact_table_xla_logs_after_it_and_a_zero_to_paste(capfd, monkeypatch):
    """``--offload auto --gpu-memory 8MB`` (tests/test_cli_offload_fraction.py's tight step,
    one bisection): every line after the description fits 100 columns, the columns are the
    compact ones, nothing has a carriage return, XLA's lines are summed up on stderr and
    nowhere verbatim, fd 2 is back afterwards, and the pasted ZeRO line builds the row's
    ZeRO: stage 3 per layer, the optimizer offloaded at the table's fraction. The three
    compiles are that test's too: one process compiles them once."""
    monkeypatch.setattr(offload_fraction, "BISECTIONS", 1)
    reuse_gpu_compiles(monkeypatch, "8 x h100, 8MB")
    rows = []
    _noisy_plan(monkeypatch, rows)
    assert cli.main([*ARGV, "--offload", "auto", "--gpu-memory", "8MB"]) == 0
    os.write(2, b"fd 2 restored\n")
    out, err = capfd.readouterr()
    assert "\r" not in out and "\r" not in err
    assert REMAT not in out + err and PREAMBLE not in out + err
    assert "fd 2 restored" in err
    # the probe's 2 lines, and whatever XLA itself printed (its CUDA stub's, once a process)
    summary = re.search(
        r"XLA printed (\d+) log lines during the compiles \((\d+) kinds; "
        r"--verbose prints them\):",
        err,
    )
    assert summary and int(summary[1]) >= 2 and int(summary[2]) >= 2, err
    remat = r"  (\d+) x warning hlo_rematerialization.cc:3231: Can't reduce memory use below "
    assert int(re.search(remat, err)[1]) >= 1, err
    assert "    (XLA's rematerialisation missed a memory target of its own: not an error" in err
    assert "[1/1] compiling stage 3 per layer ..." in err
    assert "auto's compiles per stage: offloaded share -> GPU peak (hidden AG+RS)" in out
    lines = out.splitlines()
    assert all(len(line) <= 100 for line in lines[1:]), max(lines[1:], key=len)
    head = lines.index(next(line for line in lines if line.startswith("stage")))
    header, (row,) = _cells(lines[head]), [x for x in lines if x.startswith("3 per layer")]
    assert header == [
        "stage",
        "offloaded",
        "GPU peak",
        "verdict",
        "step @55 GB/s",
        "host",
        "hidden AG+RS",
    ]
    cells = _cells(row)
    (r,) = rows
    assert cells[2] == format_bytes(r.report.peak_bytes)
    spare = format_bytes(8_000_000 - r.report.peak_bytes)
    assert cells[3] == f"fits, {spare} spare"
    assert "which the verdict judges against 8.00 MB per GPU" in " ".join(lines)
    assert "estimate" not in lines[head]
    # the lines to paste: Python that builds the row's ZeRO
    pick = lines.index(next(line for line in lines if line.startswith("pick: 3 per layer")))
    code = "\n".join(line[2:] for line in lines[pick + 1 :] if line.startswith("  "))
    ns = {"jz": jz, "tx": optax.adam(1e-3), "mesh": jz.data_parallel_mesh(8)}
    exec(code, ns)
    zero = ns["zero"]
    assert type(zero) is jz.ZeRO and zero.stage == 3
    assert zero.offload_fraction == float(cells[1]) < 1
    assert zero.precision == jz.Precision.create("bf16")
    fresh = jz.ZeRO(optax.adam(1e-3), ns["mesh"], stage=3, layers="layers", offload="optimizer")
    assert (zero.layers, zero.offload) == (fresh.layers, fresh.offload)


def test_plan_wide_has_every_column_and_verbose_prints_xlas_lines(capfd, monkeypatch):
    """``--wide`` prints the columns the table had before (the estimate named "formula est."),
    the long verdict and the notes; ``--verbose`` prints XLA's lines as written, after the
    table. The pick without offload fraction: ``ZeRO(..., offload="optimizer")``. The
    compile is tests/test_gpu_offload.py's, test_remainder_plan.py's and
    test_state_dtype.py's plan too: one process compiles it once."""
    reuse_gpu_compiles(monkeypatch, H100)
    rows = []
    _noisy_plan(monkeypatch, rows)
    assert cli.main([*ARGV, "--offload", "optimizer", "--wide", "--verbose", "--leaves"]) == 0
    out, err = capfd.readouterr()
    assert "\r" not in out + err
    # --leaves: the picked row's per-leaf plan, every params leaf of the model once
    from jaxzero.gpu.models import abstract_params, model_shape

    leaves = out.split("per-leaf plan of 3 per layer (ZeRO.plan):")[1]
    shape = model_shape(layers=2, hidden=256, heads=2, vocab=512, seq=16)
    paths = [
        "/".join(str(k.key) for k in path)
        for path, _ in jax.tree_util.tree_flatten_with_path(abstract_params(shape))[0]
    ]
    assert "memory=pinned_host" in leaves  # the optimizer side offloaded, said once
    for path in paths:
        (line,) = [x for x in leaves.splitlines() if x.startswith(path + " ")]
        assert ("per_layer" in line) == path.startswith("layers/"), line
    assert "in pinned host memory" in leaves
    assert REMAT in err and REMAT not in out and "XLA printed" not in err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("stage"))
    assert _cells(header) == WIDE
    row = _cells(next(line for line in lines if line.startswith("3 per layer")))
    assert re.fullmatch(r"fits in 84\.93 GB with [\d.]+ GB to spare", row[6]), row[6]
    assert "all-gather bf16" in row[-1]
    assert "formula est.: jaxzero.estimate_memory" in out and "which the verdict judges" in out
    assert 'zero = jz.ZeRO(tx, mesh, stage=3, precision="bf16", layers="layers", ' in out
    assert 'offload="optimizer")' in out and "offload_fraction" not in out.split("pick:")[1]


def test_formula_note_explains_an_estimate_that_disagrees_with_the_verdict(monkeypatch):
    """A row that fits by its compiled peak while the formula estimate is over the GPU's
    memory (the 1.3B GPT's estimate beside "fits" on a 3.5 GB GPU), or the other way round,
    gets a note saying the compiled peak decides; rows where both agree get none. The
    compile is docs/guide/gpu-planning.md's stage 3 per layer too: one process compiles it
    once."""
    from jaxzero.gpu.models import model_shape

    reuse_gpu_compiles(monkeypatch, H100)

    shape = model_shape(layers=2, hidden=256, heads=2, vocab=512, seq=16)
    mesh = gpu.compile_only_mesh("h100", 8)
    zero = jz.ZeRO(plan_tx(), mesh, stage=3, precision="bf16", layers="layers")
    (row,) = gpu.plan(zero, shape)
    assert formula_note([row]) is None  # 84.93 GB: both fit
    peak = row.report.peak_bytes
    more = dataclasses.replace(row.estimate, activations=row.estimate.activations + 2 * peak)
    est = more.total
    over = dataclasses.replace(
        row, estimate=more, report=dataclasses.replace(row.report, hbm_bytes=peak + 1)
    )
    assert over.report.fits and est > peak + 1
    under = dataclasses.replace(row, report=dataclasses.replace(row.report, hbm_bytes=peak - 1))
    assert not under.report.fits and row.estimate.total <= peak - 1
    note = formula_note([over, under])
    assert note.startswith(
        f"formula est. against the verdict: 3 per layer fits at a compiled peak of "
        f"{format_bytes(peak)} where the formula says {format_bytes(est)}; 3 per layer is "
        f"short at a compiled peak of {format_bytes(peak)} where the formula says "
        f"{format_bytes(row.estimate.total)}."
    )
    assert "The verdict judges the compiled peak, never the formula" in note


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_a_bar_only_on_a_terminal(monkeypatch):
    """A tqdm bar (carriage returns) when stdout and the progress stream are terminals; one
    plain line per compile otherwise."""
    plain = io.StringIO()
    on_case, close = progress(2, plain)
    on_case("3", 0, 2)
    on_case("3 per layer", 1, 2)
    close()
    assert (
        plain.getvalue() == "[1/2] compiling stage 3 ...\n[2/2] compiling stage 3 per layer ...\n"
    )
    tty = _Tty()
    monkeypatch.setattr(sys, "stdout", _Tty())
    on_case, close = progress(2, tty)
    on_case("3", 0, 2)
    close()
    assert "\r" in tty.getvalue() and "compiling" in tty.getvalue()


def test_log_summary_counts_lines_per_kind_within_100_columns():
    lines = [PREAMBLE, REMAT, REMAT.replace("4041", "4042"), "free text from a plugin"]
    summary = log_summary(lines)
    assert summary[0] == (
        "XLA printed 4 log lines during the compiles (3 kinds; --verbose prints them):"
    )
    assert summary[1].startswith("  2 x warning hlo_rematerialization.cc:3231: Can't reduce ")
    assert summary[2].startswith("    (XLA's rematerialisation missed a memory target")
    assert "  1 x - other: free text from a plugin" in summary
    assert all(len(line) <= 100 for line in summary)
    assert log_summary([]) == []


@pytest.mark.parametrize(
    "case",
    [
        # stage 3 per unit, FSDP's layout, part of the optimizer offloaded, ZeRO++'s widths
        (
            3,
            "unit",
            "bf16",
            False,
            "optimizer",
            jz.Wire.create(weights=8, grads=4),
            False,
            None,
            0.5,
        ),
        # stage 3 per layer in fp32 with hpZ and int8 collectives
        (3, "layer", "fp32", True, None, "both", None, 4, None),
        # the params offloaded too
        (3, "layer", "bf16", True, ("optimizer", "params"), None, None, None, 1.0),
    ],
)
def test_paste_builds_the_zero_the_plan_compiled(case):
    """The pasted lines, run as Python, build the ZeRO that ``ZeRO(tx, mesh, **zero_options)``
    builds (the keyword arguments the plan compiled the row with), whatever the options."""
    from jaxzero.cli.plan import paste
    from jaxzero.gpu.plan import zero_options

    options = zero_options(*case)
    text = paste(types.SimpleNamespace(zero_options=options))
    assert all(len(line) <= 100 for line in text.splitlines()), text
    ns = {"jz": jz, "tx": optax.adam(1e-3), "mesh": jz.data_parallel_mesh(8)}
    exec(textwrap.dedent(text), ns)
    want = jz.ZeRO(ns["tx"], ns["mesh"], **options)
    for field in ["stage", "precision", *options]:
        assert getattr(ns["zero"], field) == getattr(want, field), field


def test_a_failed_compile_prints_xlas_lines_as_written(capfd, monkeypatch):
    """When a compile raises, XLA's captured lines may say why: they are printed whole, the
    error goes on, and file descriptor 2 is back."""
    fatal = "E1128 17:04:28.424257    4041 gpu_compiler.cc:1234] Compilation failed: out of tiles"

    def failing(*a, **kw):
        kw["on_case"]("3 per layer", 0, 1)
        os.write(2, f"{fatal}\n".encode())
        raise RuntimeError("INTERNAL: compilation failed")

    monkeypatch.setattr(gpu, "plan", failing)
    with pytest.raises(RuntimeError, match="compilation failed"):
        cli.main(ARGV)
    os.write(2, b"fd 2 restored\n")
    err = capfd.readouterr().err
    assert f"XLA's log lines during the compiles:\n{fatal}\nfd 2 restored" in err
