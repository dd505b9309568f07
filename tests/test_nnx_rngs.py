"""NNX modules that own their RNG streams (``nnx.Dropout(0.5, rngs=rngs)``), the usual NNX
style: the step runs, each device draws its own stream, the counters
advance, the state checkpoints, and the numbers equal the same model fed call-time rngs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxzero as jz


class Net(nnx.Module):
    def __init__(self, rngs, dropout_rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=dropout_rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def _batches(n=3):
    r = np.random.default_rng(0)
    return [
        {
            "x": r.normal(size=(16, 8)).astype(np.float32),
            "y": r.normal(size=(16, 4)).astype(np.float32),
        }
        for _ in range(n)
    ]


def _mse(module, batch, rngs=None):
    return jnp.mean((module(batch["x"], rngs=rngs) - batch["y"]) ** 2)


def _run(own_streams: bool, steps=3, state=None, start=0):
    model = Net(nnx.Rngs(0), nnx.Rngs(123) if own_streams else None)
    model_def, params, model_state = jz.flax_nnx.split(model)
    if own_streams:
        loss = model_def.stateful_loss(lambda m, b, rng: _mse(m, b))
    else:  # the reference: the same model, fed the step's key at call time

        def call_time(m, b, rng):
            key = jax.random.fold_in(jax.random.wrap_key_data(rng), 0)
            return _mse(m, b, rngs=nnx.Rngs(dropout=key))

        loss = model_def.stateful_loss(call_time)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(loss, zero, stateful=True)
    if state is None:
        state = step.init(params, model_state=model_state, rng=jax.random.key(7))
    for b in _batches()[start : start + steps]:
        state, _ = step(state, b)
    return step, zero, state


def _params(state):
    return jax.tree.map(np.asarray, jz.gather(state.params))


def test_own_rng_streams_train_and_equal_call_time_rngs():
    _, _, own = _run(own_streams=True)
    _, _, ref = _run(own_streams=False)
    for a, b in zip(jax.tree.leaves(_params(own)), jax.tree.leaves(_params(ref)), strict=True):
        np.testing.assert_array_equal(a, b)
    # Every device drew its own masks: the reference's keys fold in the device index
    # (tests/test_model_state.py checks that those differ per device).
    # One dropout draw per step on every device: the stored counter counts them.
    count = own.model_state["drop"]["rngs"]["count"]
    assert int(count) == 3
    # The stored seed key is kept (raw key data, checkpointable).
    assert own.model_state["drop"]["rngs"]["key"].dtype == jnp.uint32


def test_own_rng_streams_need_the_step_rng():
    model_def, params, model_state = jz.flax_nnx.split(Net(nnx.Rngs(0), nnx.Rngs(123)))
    loss = model_def.stateful_loss(lambda m, b, rng: _mse(m, b))
    step = jz.make_train_step(
        loss, jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2), stateful=True
    )
    state = step.init(params, model_state=model_state)  # no rng=
    with pytest.raises(ValueError, match="owns RNG streams.*rng=jax.random.key"):
        step(state, _batches(1)[0])


def test_own_rng_streams_checkpoint_and_resume(tmp_path):
    _, _, full = _run(own_streams=True, steps=3)
    step, zero, half = _run(own_streams=True, steps=2)
    jz.checkpoint.save(tmp_path / "ck", 2, half, zero=zero, wait=True)
    model_def, params, model_state = jz.flax_nnx.split(Net(nnx.Rngs(0), nnx.Rngs(123)))
    restored = jz.checkpoint.restore(
        tmp_path / "ck", zero, params, model_state=model_state, rng=jax.random.key(7)
    )
    _, _, resumed = _run(own_streams=True, steps=1, state=restored, start=2)
    for a, b in zip(jax.tree.leaves(_params(full)), jax.tree.leaves(_params(resumed)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(resumed.model_state["drop"]["rngs"]["count"]) == 3
