"""Smoke test of ``benchmarks/run.py``: every configuration runs, and the jaxzero rows agree
with the ZeRO formulas (persistent bytes within 2%, collective payloads within 5%)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import repo_module

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
N = 8
CONFIGS = ["dp", "fsdp"] + [f"zero{s}-{p}" for p in ("fp32", "bf16") for s in range(4)]


def expected_persistent(phi, stage, precision):
    """Independent statement of the ZeRO accounting (params + master + Adam, bytes/device)."""
    if precision == "fp32":
        return {0: 12 * phi, 1: 4 * phi + 8 * phi / N, 2: 4 * phi + 8 * phi / N, 3: 12 * phi / N}[
            stage
        ]
    return {0: 14 * phi, 1: 2 * phi + 12 * phi / N, 2: 2 * phi + 12 * phi / N, 3: 14 * phi / N}[
        stage
    ]


def expected_collectives(phi, stage, bytes_per_param):
    b = bytes_per_param * phi
    return {
        0: {"all-reduce": b},
        1: {"all-reduce": b, "all-gather": b},
        2: {"reduce-scatter": b, "all-gather": b},
        3: {"all-gather": b, "reduce-scatter": b},
    }[stage]


# slow, every test of the smoke run (benchmarks/run.py --smoke, a minute of compiles): make test
# keeps the same claims on the library itself: tests/test_stages.py's persistent bytes against
# the ZeRO formula and each stage's collectives in the compiled HLO, per stage
SMOKE = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "run.json"
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "run.py"),
            "--quick",
            "--smoke",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        result = json.load(f)
    assert os.path.exists(str(out)[: -len(".json")] + ".md")
    return result, proc.stdout


@SMOKE
def test_every_configuration_present_and_timed(smoke):
    result, stdout = smoke
    assert sorted(result["configs"]) == sorted(CONFIGS)
    for name in CONFIGS:
        row = result["configs"][name]
        assert row["step_ms_median"] > 0, name
        assert row["ratio_vs_dp"] > 0, name
        assert row["temp_bytes"] > 0, name
    assert result["configs"]["dp"]["ratio_vs_dp"] == pytest.approx(1.0)
    for key in ("ratio_replicated_over_stage2", "ratio_replicated_over_stage0"):
        assert result["ema"][key] > 0
    assert "| zero3-bf16 |" in stdout  # the markdown table is printed


@SMOKE
def test_persistent_bytes_match_formula(smoke):
    result, _ = smoke
    phi = result["model"]["params"]
    for name, row in result["configs"].items():
        stage = {"dp": 0, "fsdp": 3}.get(row["stage"], row["stage"])
        want = expected_persistent(phi, stage, row["precision"])
        got = row["persistent_bytes"]
        assert row["persistent_bytes_min"] == got, f"{name}: devices hold different amounts"
        assert 0 <= got / want - 1 < 0.02, (name, got, want)


@SMOKE
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_jaxzero_collectives_match_theory(smoke, stage, precision):
    result, _ = smoke
    phi = result["model"]["params"]
    row = result["configs"][f"zero{stage}-{precision}"]
    # XLA:CPU widens bf16 collectives to f32; the program itself asks for bf16.
    if precision == "bf16":
        requested = {d for v in row["collective_dtypes_requested"].values() for d in v}
        assert "bf16" in requested, row["collective_dtypes_requested"]
    width = 2 if precision == "bf16" and result["backend"] != "cpu" else 4
    theory = expected_collectives(phi, stage, width)
    payload = row["collectives"]["payload"]
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        got, want = payload.get(kind, 0), theory.get(kind, 0)
        if want:
            assert abs(got - want) / want < 0.05, (kind, got, want)
        else:  # only scalars (loss mean, finite check) may travel outside the theory
            assert got < 0.001 * 4 * phi, (kind, got)
    assert row["collectives_ok"]


@pytest.fixture(scope="module")
def overlap_table():
    """``benchmarks/overlap.py --tiny``'s table (both flag sets, N = 8), run in this process:
    the GPU compiles are deviceless (tests/test_gpu.py). Three variants are left out here
    because tests/test_gpu.py compiles the same steps (stage 0 with its one all-reduce, stage
    3 with gather_layer, stage 3 without the compute copy, which also leaves out the
    vocabulary-parallel row): 8 of the table's 24 compiles."""
    bench = repo_module("overlap_bench", "benchmarks", "overlap.py")
    skip = ("jaxzero stage 0 (all-reduce", "gather_layer", "no compute copy")  # + vocab-parallel
    variants = [v for v in bench.VARIANTS if not any(k in v[0] for k in skip)]
    lines = bench.table(bench.TINY, N, variants)
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[1] in ("default", "recommended"):
            rows[cells[0], cells[1]] = cells[2:]
    return bench, rows, [label for label, _ in variants]


# slow: the overlap benchmark's table (16 deviceless compiles; tests/test_gpu.py pins the same
# hidden shares per stage): 149 s
@pytest.mark.slow
def test_overlap_benchmark_rows_match_the_formulas(overlap_table):
    """Every variant in the table is measured with both flag sets; the stage-2 rows move the same bytes with
    or without the per-layer reduction, and the per-layer rows (stage 2, and stage 1 without
    micro-batches) hide exactly the layer stack's share of the reduce-scatter bytes
    (everything outside the stack is reduced after the loop: the same derivation as
    tests/test_gpu.py) and all-reduce no gradient; the whole-gradient stage-2 row hides none,
    stage 1 without layers= all-reduces; plain DP shows no reduce-scatter or all-gather; stage 3
    per layer launches no more kernels than the GSPMD peer; no row hides more than its
    "max AG / RS" ceiling, and the per-layer rows' ceiling is the stack's share."""
    import jax

    from jaxzero.gpu.models import abstract_params

    bench, rows, labels = overlap_table
    assert set(rows) == {(label, f) for label in labels for f in ("default", "recommended")}
    s = s_stack = 0
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params(bench.TINY))[0]:
        in_stack = path[0].key == "layers"
        dims = x.shape[1:] if in_stack else x.shape
        if any(d % N == 0 for d in dims):
            s += x.size
            s_stack += x.size if in_stack else 0
    whole, per_layer = "jaxzero stage 2 (whole-gradient reduction)", "jaxzero stage 2 per layer"
    stage1, stage1_per_layer = (
        "jaxzero stage 1 (all-reduce after the backward)",
        "jaxzero stage 1 per layer",
    )
    for flags in ("default", "recommended"):
        assert rows[whole, flags][0] == rows[per_layer, flags][0]  # collective bytes
        assert rows[whole, flags][2] == "0.00"
        for label in (per_layer, stage1_per_layer):
            assert float(rows[label, flags][2]) == pytest.approx(s_stack / s, abs=0.006)
            assert rows[label, flags][3] == "-"  # no gradient all-reduced
            # the ceiling: the stack's reductions can hide under the next layer's backward,
            # the rest waits for the last gemm, the updated params' gather follows it
            ag_max, rs_max = rows[label, flags][6].split(" / ")
            assert ag_max == "0.00"
            assert float(rs_max) == pytest.approx(s_stack / s, abs=0.006)
        # stage 1 without layers=: the gradient all-reduced, nothing reduce-scattered
        assert rows[stage1, flags][2] == "-" and rows[stage1, flags][3] != "-"
        assert rows["plain DP (jit, replicated)", flags][1:3] == ["-", "-"]
        # stage 3 per layer launches no more kernels than the GSPMD peer (each layer's slice
        # and bf16 cast are one kernel)
        stage3 = "jaxzero stage 3 per layer (scan_layers: prefetch)"
        assert int(rows[stage3, flags][5]) <= int(rows["GSPMD-annotation FSDP (peer)", flags][5])
    for cells in rows.values():  # no row hides more than its data flow allows
        for hidden, ceiling in zip(cells[1:3], cells[6].split(" / "), strict=True):
            assert (hidden == "-") == (ceiling == "-")
            assert hidden == "-" or float(hidden) <= float(ceiling)


def test_offload_gpu_benchmark_runs_tiny_on_a_cpu(capsys):
    """``benchmarks/offload_gpu.py --tiny`` (a 2 x 64 GPT on one CPU device, accum 2) runs end
    to end: the plain jit row first, jaxzero with offload off and ``"optimizer"`` measured
    beside a prediction whose PCIe bytes are the fp32 master and Adam's two moments each way
    (12 bytes per parameter: one device holds all of them), and the params offload (with its
    host gradient accumulator at accum 2) measured too, moving more than the optimizer
    offload; ``--fraction 0.5`` adds a row of half the optimizer state offloaded, predicted
    between no offload and all of it."""
    from jaxzero.gpu.models import model_shape
    from jaxzero.memory import format_bytes

    bench = repo_module("offload_gpu_bench", "benchmarks", "offload_gpu.py")
    bench.main(["--tiny", "--fraction", "0.5"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")]
    labels = [r[0].lstrip("| ") for r in rows[1:]]
    assert labels == [
        "plain jax.jit optax",
        "jaxzero, offload off",
        "jaxzero, offload optimizer",
        "jaxzero, offload optimizer,params",
        "jaxzero, offload optimizer, fraction 0.5",
    ]
    by = dict(zip(labels, rows[1:], strict=True))
    for label in labels:
        assert float(by[label][2]) > 0 and float(by[label][5]) > 0  # measured, predicted
    phi = model_shape(layers=2, hidden=64, vocab=256, seq=32, arch="gpt").num_params
    moved = by["jaxzero, offload optimizer"][6]
    assert moved.startswith(f"host->device {format_bytes(12 * phi)}, device->host ")
    assert by["jaxzero, offload optimizer,params"][6].startswith("host->device ")
    assert float(by["jaxzero, offload optimizer,params"][5]) > float(by[labels[2]][5])
    # half the state offloaded: fewer exposed PCIe bytes than all of it, more than none
    half = float(by["jaxzero, offload optimizer, fraction 0.5"][5])
    assert float(by[labels[1]][5]) < half < float(by[labels[2]][5])


def test_pcie_duplex_benchmark_moves_what_it_says_on_a_cpu(capsys):
    """``benchmarks/pcie_duplex.py --tiny``: the four loops over a pinned-host buffer run on one
    CPU device and each result matches numpy (the script asserts it: a loop that moved nothing
    would fail), one row each, the in-place loop the 1.00x baseline."""
    repo_module("pcie_duplex_bench", "benchmarks", "pcie_duplex.py").main(["--tiny"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    rows = [[c.strip("| ") for c in r] for r in rows if r[0].startswith("| ")]
    assert [r[0] for r in rows[1:]] == ["fetch", "write", "in place", "two buffers, pipelined"]
    assert rows[3][3] == "1.00x"
    assert all(float(r[2]) > 0 for r in rows[1:])
