"""Dropout without model state: ``make_train_step(loss_fn, zero, rng=True)`` hands a
stateless ``loss_fn(params, batch, rng)`` the device's key; the run equals a single-device
optax run that draws the same keys, derived here from the documented rule
``fold_in(fold_in(rng, step), device index)``."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance

import jaxzero as jz

N = 8


class DropMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = jnp.tanh(nn.Dense(32)(x))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(8)(h)


MODEL = DropMLP()


def loss_fn(p, b, rng):
    pred = MODEL.apply({"params": p}, b["x"], train=True, rngs={"dropout": rng})
    loss = jnp.mean((pred - b["y"]) ** 2)
    return loss, {"mean_pred": jnp.mean(pred)}


def _problem(steps=3, batch=32):
    data = np.random.default_rng(0)
    params = MODEL.init(jax.random.PRNGKey(1), jnp.zeros((1, 16)), train=False)["params"]
    batches = [
        {
            "x": data.normal(size=(batch, 16)).astype(np.float32),
            "y": data.normal(size=(batch, 8)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return params, batches


def _reference(tx, params, batches, seed):
    """One device: step t's gradient is the mean over the N row blocks of the loss's gradient
    on block d with the key fold_in(fold_in(seed key, t), d)."""
    rng = jax.random.PRNGKey(seed)

    def step(p, s, b, t):
        def global_loss(p):
            losses = []
            for d in range(N):
                rows = jax.tree.map(lambda x, d=d: x.reshape(N, -1, *x.shape[1:])[d], b)
                key = jax.random.fold_in(jax.random.fold_in(rng, t), d)
                losses.append(loss_fn(p, rows, key)[0])
            return jnp.mean(jnp.stack(losses))

        loss, g = jax.value_and_grad(global_loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    step = jax.jit(step, compiler_options=tolerance.compiler_options())
    p, s, losses = params, tx.init(params), []
    for t, b in enumerate(batches):
        p, s, loss = step(p, s, b, t)
        losses.append(float(loss))
    return p, s, losses


def test_stateless_rng_loss_equals_single_device_with_the_same_keys():
    params, batches = _problem()
    tx = optax.adam(1e-2)
    step = jz.make_train_step(loss_fn, jz.ZeRO(tx, jz.data_parallel_mesh(N), stage=2), rng=True)
    state = step.init(params, rng=jax.random.PRNGKey(7))
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    assert "mean_pred" in metrics["aux"]
    ref_p, ref_s, ref_losses = _reference(tx, params, batches, seed=7)
    # stated: dropout masks drawn per device, which tests/tolerance.py's reruns cannot keep
    # (1e-6: 15 fp32 ulps of the largest param, 0.56; the reference is 6e-8 off here)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    chex.assert_trees_all_close(jz.gather(state.params), ref_p, atol=1e-6)
    chex.assert_trees_all_close(jz.gather(state.opt_state), ref_s, atol=1e-6)
    # another seed draws other masks: the keys reach the loss
    other, _, _ = _reference(tx, params, batches, seed=8)
    # a bound the other masks' params must exceed: 100x the tolerance above
    assert not np.allclose(other["Dense_0"]["kernel"], ref_p["Dense_0"]["kernel"], atol=1e-4)


def test_rng_loss_needs_a_key_in_the_state():
    params, batches = _problem(steps=1)
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(N), stage=1)
    step = jz.make_train_step(loss_fn, zero, rng=True)
    state = step.init(params)
    with pytest.raises(ValueError, match=r"has no rng; create it with step\.init\(params, rng="):
        step(state, batches[0])
    with pytest.raises(ValueError, match="already gets the key. Drop rng=True"):
        jz.make_train_step(loss_fn, zero, rng=True, stateful=True)
