"""Every ```python block of README.md runs as written, after a prelude that defines what the
blocks leave to the reader (``params``, ``loss_fn``, ``batches``, ``tx``, ``mesh``): a small
Linen model written as a Python loop of blocks named ``block_0``, ``block_1`` (so the
``units=`` snippet has units to find), on the 8 simulated CPU devices."""

from __future__ import annotations

import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxzero as jz
from jaxzero.gpu.models import Residual

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


class _Loop(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = Residual(32, name=f"block_{i}")(x)
        return nn.Dense(4, name="head")(x)


def _prelude():
    model = _Loop()
    params = model.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.normal(size=(16, 4))}
        for _ in range(2)
    ]
    return {
        "jz": jz,  # later blocks read on from the first, which imports it
        "optax": optax,
        "params": params,
        "loss_fn": lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2),
        "batches": batches,
        "tx": optax.adamw(1e-3),
        "mesh": jz.data_parallel_mesh(8),
    }


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2, "README.md's ```python blocks were not found"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    namespace = _prelude()
    exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), namespace)
    assert isinstance(namespace["zero"], jz.ZeRO)
    if namespace["zero"].units:  # the units= block: build and step it
        zero = namespace["zero"]
        step = jz.make_train_step(namespace["loss_fn"], zero)
        state = step.init(namespace["params"])
        state, metrics = step(state, namespace["batches"][0])
        assert np.isfinite(float(metrics["loss"]))
