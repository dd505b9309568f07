"""Under precision="bf16" a Flax module still computes in its own dtype (float32 by default):
the step warns once, at trace time, when the loss's matmuls run in float32 (issue 17, 7)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxzero as jz


class Net(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(16, dtype=self.dtype)(x))
        return nn.Dense(8, dtype=self.dtype)(x)


def _step(dtype, precision):
    model = Net(dtype=dtype)
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]

    def loss(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]).astype(jnp.float32) - b["y"]) ** 2)

    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2, precision=precision)
    step = jz.make_train_step(loss, zero)
    batch = {"x": np.ones((16, 8), np.float32), "y": np.zeros((16, 8), np.float32)}
    return step, step.init(params), batch


def _warnings(dtype, precision):
    step, state, batch = _step(dtype, precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, _ = step(state, batch)
        step(state, batch)  # compiled once: no second warning
    return [w for w in caught if "matmul(s) of the loss run in float32" in str(w.message)]


def test_bf16_policy_with_float32_module_warns_once():
    caught = _warnings(jnp.float32, "bf16")
    assert len(caught) == 1
    assert "dtype=jnp.bfloat16" in str(caught[0].message)
    # The loss alone (no backward) has the two Dense layers' forward matmuls.
    assert "but 2 matmul(s)" in str(caught[0].message)


@pytest.mark.parametrize("dtype,precision", [(jnp.bfloat16, "bf16"), (jnp.float32, "fp32")])
def test_no_warning_when_the_module_computes_in_the_policy_dtype(dtype, precision):
    assert _warnings(dtype, precision) == []
