"""The demo's model (``examples/digits.py``'s CNN, 151K params) as a small training problem
for the checkpoint tests: ``(params, loss_fn, batches)`` on random 8x8 images (no data set
needed; the checkpoints, not the accuracy, are under test)."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def cnn():
    spec = importlib.util.spec_from_file_location(
        "digits_example", os.path.join(ROOT, "examples", "digits.py")
    )
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
    return module.CNN()


def digits_problem(steps: int = 4, batch: int = 16, seed: int = 0):
    model = cnn()
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 8, 8, 1)))["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    rng = np.random.default_rng(seed)
    batches = [
        {
            "x": rng.uniform(size=(batch, 8, 8, 1)).astype(np.float32),
            "y": rng.integers(0, 10, size=(batch,)).astype(np.int32),
        }
        for _ in range(steps)
    ]
    return params, loss_fn, batches


def host(state):
    """Every array of a TrainState, gathered to numpy, keyed by its path."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in flat}
