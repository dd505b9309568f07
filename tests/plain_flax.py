"""A plain Flax/optax problem that imports no jaxzero: the model, optax chains, loss and
batches that a test's parent process trains under jaxzero and its child process (which must
never import jaxzero) rebuilds as the user's own ``flax.training.train_state.TrainState``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


class MLP(nn.Module):
    """16 -> 32 -> 8 with tanh: every leaf divisible by 8, so stage 3 shards each 1/8."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="fc2")(jnp.tanh(nn.Dense(32, name="fc1")(x)))


def decay_mask(params):
    """Weight decay on the matrices only."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def chain(name: str) -> optax.GradientTransformation:
    """``"clip_adamw"``: clipping and masked AdamW; ``"multisteps"``: the same inside
    ``optax.MultiSteps`` (its state's fields are not in alphabetical order: a restore that
    goes by leaf order scrambles them)."""
    clip_adamw = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)
    )
    if name == "clip_adamw":
        return clip_adamw
    if name == "multisteps":
        return optax.MultiSteps(clip_adamw, every_k_schedule=2)
    raise ValueError(name)


def model_and_params():
    model = MLP()
    return model, model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]


def loss_fn(model):
    def loss(params, batch):
        pred = model.apply({"params": params}, batch["x"])
        return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)

    return loss


def batches(n: int, rows: int = 32) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, 16)).astype(np.float32),
            "y": rng.normal(size=(rows, 8)).astype(np.float32),
        }
        for _ in range(n)
    ]


def by_path(tree) -> dict:
    """``{keystr: numpy array}``: a tree keyed by its leaves' paths (an ``.npz``'s names)."""
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }
