"""The package's shape, checked on every run: no import cycle and no oversized module, class
or function (the team's structure tool), and the step's phases named in the compiled HLO."""

import os
import subprocess
import sys

import jax
import optax
import pytest
from models import make_problem

import jaxzero as jz

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "..", "shared", "tools", "structure.py")


def test_structure_check_passes():
    assert os.path.isfile(TOOL), f"the structure tool is missing at {TOOL}"
    out = subprocess.run(
        [sys.executable, TOOL, "jaxzero", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "import cycles: none" in out.stdout
    assert "structure: 0 problems" in out.stdout


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_phases_are_named_in_the_hlo(stage):
    params, loss_fn, batches = make_problem("wide_mlp", steps=1)
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=stage)
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.9))
    state = step.init(params)
    hlo = step.lower(state, batches[0]).compile().as_text()
    # Op metadata carries the jax.named_scope path of every op.
    phases = ["forward_backward", "reduce_gradients", "optimizer_update", "ema_update"]
    if stage == 3:
        phases.append("gather_params")
    else:
        phases.append("gather_updated_params")
    missing = [p for p in phases if p not in hlo]
    assert not missing, f"phases {missing} are not named in the compiled HLO"
    jax.clear_caches()
