"""Test configuration: 8 simulated CPU devices, set before jax starts any backend."""

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

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures")


@pytest.fixture(scope="session")
def fixtures_dir():
    path = os.path.abspath(FIXTURES)
    if not os.path.isdir(path):
        pytest.skip(f"shared fixtures not found at {path}")
    return path


def fixture_case(fixtures_dir, *parts):
    """``(directory, manifest)`` of the shared fixture case ``fixtures_dir/*parts``
    (skips the test when the case is absent)."""
    d = os.path.join(fixtures_dir, *parts)
    if not os.path.isdir(d):
        pytest.skip(f"fixture {d} not found")
    with open(os.path.join(d, "manifest.json")) as f:
        return d, json.load(f)
