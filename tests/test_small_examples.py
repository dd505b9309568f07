"""The short examples run end to end (smoke mode) as a user would run them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxzero.simulate import cpu_xla_flags

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize(
    "script,env",
    [
        ("quickstart.py", {"QUICKSTART_STEPS": "3"}),
        ("nnx_example.py", {"NNX_STEPS": "3"}),
        ("byo_step.py", {}),
    ],
)
def test_example_runs(script, env, tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        cwd=tmp_path,
        env={**os.environ, **env, "XLA_FLAGS": cpu_xla_flags(8)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loss" in out.stdout
