"""The stacked linear problem of the deferred and delayed update tests.

``jz.scan_layers`` over a stack of linear layers, each adding ``x @ w + g`` to the carry, a
kernel and a bias outside the stack that make the carry's start, and a loss linear in the
output (or in its ReLU) with batches of -1, 0 and 1. Every gradient is then a mean of small
integers (times the ReLU's mask), exact in bf16 however the rows are split and summed, so the
bf16 cast's rounding never reaches AdamW's updates (the references' reruns in other summation
orders agree to the last bit), while the loss itself reads the params (a forward on the wrong
stacks is seen in the losses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxzero as jz

# the stack's (L, D, W) kernel is streamed (> 4096 elements a leaf)
D, W = 64, 128


def problem(steps, layers, *, gathered=False, relu=False):
    """``(params, loss_fn, batches)``.

    Args:
      steps: the number of batches.
      layers: the stack's length.
      gathered: the stack runs in a ``jax.lax.scan`` with ``jz.gather_layer`` instead.
      relu: the loss reads the output's ReLU: its mask depends on the params, so a gradient
        taken a step behind differs from the exact one (without it the gradient does not
        depend on the params).
    """
    ks = jax.random.split(jax.random.key(0), 4)
    params = {
        "layers": {
            "w": 0.05 * jax.random.normal(ks[0], (layers, D, W)),
            "g": 0.05 * jax.random.normal(ks[1], (layers, W)),
        },
        "b": 0.05 * jax.random.normal(ks[2], (W,)),
        "k": 0.05 * jax.random.normal(ks[3], (D, W)),
    }

    def loss_fn(p, batch):
        layer = lambda w, c: (c[0], c[1] + c[0] @ w["w"] + w["g"])
        h0 = batch["x"] @ p["k"] + p["b"]
        if gathered:
            body = lambda c, w: (layer(jz.gather_layer(w), c), None)
            (_, h), _ = jax.lax.scan(body, (batch["x"], h0), p["layers"])
        else:
            _, h = jz.scan_layers(layer, p["layers"], (batch["x"], h0))
        out = jnp.maximum(h, 0) if relu else h
        return jnp.mean(jnp.sum(out * batch["y"], axis=-1))

    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.integers(-1, 2, size=(32, D)).astype(np.float32),
            "y": rng.integers(-1, 2, size=(32, W)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return params, loss_fn, batches
