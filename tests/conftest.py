"""Test configuration: 8 simulated CPU devices, set before jax starts any backend."""

import importlib
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # read when jax is imported: set it first

from jaxzero.simulate import cpu_xla_flags  # noqa: E402  (imports jax; no backend yet)

# 8 simulated devices, and XLA:CPU's collective rendezvous timeouts raised: on a loaded 2-core
# machine one simulated device can reach a collective long after the others, and XLA would
# abort the process after its default timeout.
os.environ["XLA_FLAGS"] = cpu_xla_flags(8, os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

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


def require(module, extra):
    """Import ``module`` or fail the test (or its module, at collection) naming the install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        error = err
    pytest.fail(
        f"{module} is needed by this test and is not installed ({error}); install the test "
        f"dependencies with `make test` (pip install -e '.[{extra}]')",
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
