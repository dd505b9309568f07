"""What a pmap program leaves behind in a port: params from
``jax_utils.replicate`` and a batch from ``shard(batch)`` are named, with the fix; a batch or
params whose leading dimension legitimately equals the device count are not refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from flax.training.common_utils import shard

import jaxzero as jz

N = 8


class Net(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, x):
        rows, width = x.shape  # like FlaxGPT2's `batch_size, seq = input_ids.shape`
        return nn.Dense(N)(jnp.tanh(nn.Dense(self.hidden)(x.reshape(rows, width))))


def _params(hidden=16):
    return Net(hidden).init(jax.random.PRNGKey(0), jnp.zeros((1, N)))["params"]


PARAMS = _params()


def loss_fn(p, b, hidden=16):
    return jnp.mean((Net(hidden).apply({"params": p}, b["x"]) - b["y"]) ** 2)


def _batch(rows):
    data = np.random.default_rng(0)
    return {
        "x": data.normal(size=(rows, N)).astype(np.float32),
        "y": data.normal(size=(rows, N)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def step():
    return jz.make_train_step(loss_fn, jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(N), stage=2))


def test_replicated_params_are_named_at_init(step):
    with pytest.raises(ValueError, match=r"8 identical copies, as pmap's jax_utils\.replicate"):
        step.init(jax_utils.replicate(PARAMS))
    with pytest.raises(ValueError, match="remove the pmap axis: pass the unreplicated params"):
        step.zero.init(jax_utils.replicate(PARAMS))


def test_params_with_a_device_axis_are_named_when_the_loss_fails(step):
    # not copies (so init cannot tell), but the loss fails on them
    stacked = jax.tree.map(lambda x: jnp.stack([x + i for i in range(N)]), PARAMS)
    state = step.init(stacked)
    with pytest.raises(ValueError, match=r"every params leaf has a leading axis of 8") as e:
        step(state, _batch(32))
    assert "remove the pmap axis" in str(e.value) and e.value.__cause__ is not None


def test_sharded_batch_is_named_when_the_loss_fails(step):
    state = step.init(PARAMS)
    with pytest.raises(ValueError, match=r"as pmap's shard\(batch\) leaves it") as e:
        step(state, shard(_batch(32)))  # [8, 4, 8]
    assert "pass the global batch" in str(e.value)
    assert "too many values to unpack" in str(e.value.__cause__)


def test_a_leading_dimension_of_n_is_not_refused():
    # params whose every leaf leads with 8 (hidden 8: kernels [8, 8], biases [8]) and a
    # global batch of 8 rows: trained as given
    params = _params(hidden=N)
    assert all(x.shape[0] == N for x in jax.tree.leaves(params))
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(N), stage=2)
    step = jz.make_train_step(lambda p, b: loss_fn(p, b, hidden=N), zero)
    state = step.init(params)
    before = float(loss_fn(params, _batch(N), hidden=N))
    for _ in range(3):
        state, metrics = step(state, _batch(N))
    assert float(metrics["loss"]) < before
