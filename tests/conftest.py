"""Test configuration: 8 simulated CPU devices, set before jax starts any backend."""

import json
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    # On a loaded 2-core machine a simulated device can reach a collective long after the
    # others; XLA:CPU would abort the process after its default rendezvous timeout.
    + " --xla_cpu_collective_call_terminate_timeout_seconds=1200"
    + " --xla_cpu_collective_call_warn_stuck_timeout_seconds=300"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
