"""Flax params structures for ``jaxzero convert deepspeed2jax --params-from``: Linen twins of
the torch models behind tests/fixtures/E_deepspeed (tests/ds_worker.py's ``MlpB``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class MlpB(nn.Module):
    """fc1 Linear(32, 64) -> ln LayerNorm(64) -> GELU -> fc2 Linear(64, 64) -> GELU -> fc3
    Linear(64, 10), as torch computes it (LayerNorm eps 1e-5, exact GELU); the buffer
    ``in_scale`` multiplies the input."""

    @nn.compact
    def __call__(self, x, in_scale):
        h = nn.Dense(64, name="fc1")(x * in_scale)
        h = nn.LayerNorm(epsilon=1e-5, name="ln")(h)
        h = nn.gelu(h, approximate=False)
        h = nn.gelu(nn.Dense(64, name="fc2")(h), approximate=False)
        return nn.Dense(10, name="fc3")(h)


def mlp_b_params():
    """MlpB's params as shapes (``jax.eval_shape``: nothing allocated)."""
    x, scale = jnp.zeros((1, 32)), jnp.ones((32,))
    return jax.eval_shape(lambda: MlpB().init(jax.random.key(0), x, scale)["params"])


def mlp_b_variables():
    """MlpB's Flax variables (``{"params": ...}``), which --params-from refuses."""
    return {"params": mlp_b_params()}
