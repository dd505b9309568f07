"""Test configuration: 8 simulated CPU devices, set before jax starts any backend."""

import gc
import importlib
import importlib.util
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when jax is imported: set it first

from jaxzero.simulate import cpu_xla_flags  # noqa: E402  (imports jax; no backend yet)

# 8 simulated devices, and XLA:CPU's collective rendezvous timeouts raised: on a loaded 2-core
# machine one simulated device can reach a collective long after the others, and XLA would
# abort the process after its default timeout.
os.environ["XLA_FLAGS"] = cpu_xla_flags(8, os.environ.get("XLA_FLAGS", ""))
# LLVM's optimisation passes off for the suite's compiles (XLA's HLO passes, fusion and
# scheduling are unchanged): the tests compile hundreds of small programs that each run a few
# steps, and codegen time is most of it. Every expected number is computed in the same process.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# Each simulated device's ops on one thread: XLA:CPU runs the 8 devices' programs on threads of
# their own, and letting each also split its matmuls over an Eigen pool of the machine's cores
# oversubscribes a 2-core machine (two pytest workers x 8 devices x the pool). Measured on
# tests/test_precision.py: 67 s -> 42 s with two workers. Every expected number is computed in
# the same process, under the same flag.
if "--xla_cpu_multi_thread_eigen" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
# One LLVM module per program instead of 32 compiled in parallel: on 2 cores shared by two
# workers the split only adds its own work (tests/test_stages.py's compiles: 24.1 -> 22.1 s).
if "--xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"


# The fast codegen, asked for with JAXZERO_TEST_CODEGEN=fast (`make test`'s first pass):
# XLA:CPU's elemental fusion emitters instead of its MLIR ones, where this XLA still has the
# choice (jax 0.10's does, 0.12's does not). The MLIR emitters cost most of a small program's
# compile: tests/test_stages.py's compiles 24.1 -> 10.0 s, the module 38 -> 23 s. Every
# expected number is computed in the same process, under the same flag, except where a test
# holds two different programs to each other bit for bit (marker `bitwise`): the elemental
# emitters contract multiply-adds differently from one program to another, so those tests
# run under XLA's default codegen (`make test`'s second pass) and fail under this one.
FAST_CODEGEN = os.environ.get("JAXZERO_TEST_CODEGEN") == "fast"
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_has_legacy_emitters():
    """Whether this XLA knows the flag (an unknown one aborts the process): a subprocess asks
    once, and the workers inherit the answer."""
    known = os.environ.get("JAXZERO_TEST_LEGACY_EMITTERS")
    if known is None:
        import subprocess
        import sys

        env = dict(os.environ, XLA_FLAGS=LEGACY_EMITTERS, JAX_PLATFORMS="cpu")
        probe = [sys.executable, "-c", "import jax; jax.devices()"]
        ok = subprocess.run(probe, env=env, capture_output=True).returncode == 0
        known = os.environ["JAXZERO_TEST_LEGACY_EMITTERS"] = "1" if ok else "0"
    return known == "1"


if FAST_CODEGEN and "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    if _xla_has_legacy_emitters():
        os.environ["XLA_FLAGS"] += " " + LEGACY_EMITTERS

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# No persistent compilation cache: an XLA:CPU program loaded from it loses the order of its
# collectives against its loops (each loop body is deserialized with a communicator of its
# own), and a stage-3 per-layer step on the 8 simulated devices then aborts ("Check failed:
# id < num_threads") or hangs on its first launch: the rare `make test-all` deadlock
# (decision 52). A test that compiles a step with `step.lower(...).compile()` to read its HLO
# and then calls it reuses that executable through jit's own in-memory cache.
jax.config.update("jax_enable_compilation_cache", False)

import pytest  # noqa: E402

# Reference data from real torch / DeepSpeed runs, kept in the repository (tests/fixtures/README.md).
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def missing(what, path):
    """Fail (never skip) the calling test: ``what`` was not found at ``path``."""
    pytest.fail(
        f"{what} not found at {path}: the reference fixtures live in the repository under "
        "tests/fixtures; restore them from git (`git checkout -- tests/fixtures`)",
        pytrace=False,
    )


# Tests marked `interop` need torch and DeepSpeed (the torch extra). `make test-latest` runs
# without them (-m "not interop"): a module of such tests still imports (require() gives None),
# its tests are deselected, and the run ends with a line saying how many and why.
INTEROP_WHY = (
    "they need torch and DeepSpeed (pip install -e '.[torch]'), which this venv does not have "
    "(make test runs them on Python 3.11)"
)
_deselected_interop = []


def _deselects_interop(config):
    return "not interop" in (config.getoption("markexpr", "") or "")


def pytest_configure(config):
    global _interop_off
    _interop_off = _deselects_interop(config)


_interop_off = False


def pytest_deselected(items):
    if not _interop_off:  # -m "not slow" alone deselects some interop tests too: not this banner
        return
    _deselected_interop.extend(i.nodeid for i in items if i.get_closest_marker("interop"))


# Python's cyclic garbage collector less often, and never again over what the collection
# imported (jax, flax, the test modules: gc.freeze after it): a worker's heap grows with the
# traced and compiled steps, and each full collection walked all of it. Measured on six modules
# in one process (179 tests): collections 7.7 -> 0.8 s, user time 96 -> 87 s.
gc.set_threshold(10_000, 10, 10)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    out = getattr(session.config, "workeroutput", None)  # an xdist worker: tell the controller
    if out is not None:
        out["interop_deselected"] = len(_deselected_interop)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist, on the controller: each worker's count
    n = getattr(node, "workeroutput", {}).get("interop_deselected", 0)
    _deselected_interop.extend([None] * max(0, n - len(_deselected_interop)))


def pytest_terminal_summary(terminalreporter, config):
    if _deselected_interop:
        terminalreporter.write_sep(
            "!",
            f"{len(_deselected_interop)} interop tests deselected (-m 'not interop'): "
            f"{INTEROP_WHY}",
            yellow=True,
            bold=True,
        )


def repo_module(name, *parts):
    """The repository's script ``parts`` (e.g. ``"benchmarks", "overlap.py"``) imported as
    module ``name``, once per process (its dataclasses look their module up in sys.modules)."""
    import sys

    module = sys.modules.get(name)
    if module is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", *parts)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def require(module, extra):
    """Import ``module`` or fail the test (or its module, at collection) naming the install.
    In a run that deselects the ``interop`` tests (``-m "not interop"``), a missing module
    gives None: the module's tests are marked ``interop`` and never run."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        error = err
    if _interop_off:
        return None
    pytest.fail(
        f"{module} is needed by this test and is not installed ({error}); install the test "
        f"dependencies with `make test` (pip install -e '.[{extra}]')",
        pytrace=False,
    )


@pytest.fixture(autouse=True)
def _bitwise_needs_the_default_codegen(request):
    """A `bitwise` test under the fast codegen fails, naming the fix (never a silent pass)."""
    if request.node.get_closest_marker("bitwise") and LEGACY_EMITTERS in os.environ["XLA_FLAGS"]:
        pytest.fail(
            f"{request.node.nodeid} holds two XLA programs to each other bit for bit, which "
            f"holds under XLA:CPU's default codegen only, not under {LEGACY_EMITTERS} "
            "(JAXZERO_TEST_CODEGEN=fast): run it without JAXZERO_TEST_CODEGEN "
            "(`make test` runs the bitwise tests in a second pass)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def fixtures_dir():
    if not os.path.isdir(FIXTURES):
        missing("the fixtures directory", FIXTURES)
    return FIXTURES


def fixture_case(fixtures_dir, *parts):
    """``(directory, manifest)`` of the fixture case ``fixtures_dir/*parts`` (fails the test
    when the case is absent)."""
    d = os.path.join(fixtures_dir, *parts)
    if not os.path.isfile(os.path.join(d, "manifest.json")):
        missing(f"fixture case {'/'.join(parts)}", d)
    with open(os.path.join(d, "manifest.json")) as f:
        return d, json.load(f)
