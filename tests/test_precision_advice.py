"""Under precision="bf16" a Flax module still computes in its own dtype (float32 by default):
the step warns once, at trace time, when the loss's matmuls run in float32."""

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


def test_the_warning_names_where_the_float32_matmuls_are():
    (caught,) = _warnings(jnp.float32, "bf16")
    assert "Net/Dense_0" in str(caught.message) and "Net/Dense_1" in str(caught.message)


def _llama_warning(dtype, units):
    from jaxzero.gpu.models import hf_llama, token_batches

    params, loss_fn = hf_llama(layers=2, dtype=dtype, abstract=True)
    mesh = jz.data_parallel_mesh(8)
    zero = jz.ZeRO(optax.adam(1e-3), mesh, stage=3, precision="bf16", units=units)
    step = jz.make_train_step(loss_fn, zero)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), token_batches(64, 8)[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step.jitted.trace(zero.abstract_state(params), batch)
    (message,) = [str(w.message) for w in caught if "run in float32" in str(w.message)]
    return message


def test_a_model_built_in_bf16_is_not_told_to_build_in_bf16():
    """Hugging Face's FlaxLlama built in bf16 computes its attention scores in float32 on
    purpose (``attention_softmax_in_fp32``: flax's dot_product_attention_weights with
    dtype=float32, one q.k matmul per layer): the warning says where they are and that they may
    be deliberate, and gives no dtype advice."""
    message = _llama_warning(jnp.bfloat16, None)
    assert "but 2 matmul(s)" in message, message
    for i in (0, 1):
        assert f"model/layers/{i}/self_attn" in message, message
    assert "deliberate" in message and "dtype=jnp.bfloat16" not in message, message


def test_a_model_built_in_float32_is_told_which_modules_upcast_weights_under_units():
    """FlaxLlama built in float32: its 15 Dense layers (7 per block and the head) take upcast
    bf16 weights, found through units='s gathers, and are named by their modules (units= re-binds
    the loss equation by equation); its 4 attention matmuls do not take weights."""
    message = _llama_warning(jnp.float32, r"model/layers/\d+")
    assert "but 19 matmul(s)" in message and "15 of them on bfloat16 weights" in message, message
    assert "model/layers/0/self_attn/q_proj" in message and "dtype=jnp.bfloat16" in message
