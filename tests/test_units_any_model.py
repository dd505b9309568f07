"""``ZeRO(stage=3, units=...)`` on models as users bring them: widths the device count does not
divide (replicated leaves inside a unit, decision 3), a 3-device mesh, and Hugging Face's
FlaxLlamaForCausalLM and FlaxT5ForConditionalGeneration (tiny configs, random init). Every
step is checked against plain single-device optax."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hf_models import hf_llama, token_batches
from models import reference_run, train

import jaxzero as jz

TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, eps=1e-6, weight_decay=0.1))


class OddBlock(nn.Module):
    """A residual MLP block of width 36: on 8 devices its (36, 64) and (64, 36) kernels and
    64-bias are sharded, its 36-bias and norm scale replicated."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(36, name="out")(jax.nn.gelu(nn.Dense(64, name="up")(x)))
        return nn.LayerNorm(name="norm")(x + h)


class OddLoop(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = OddBlock(name=f"block_{i}")(x)
        return nn.Dense(5, name="head")(x)


def test_units_with_leaves_eight_does_not_divide_match_single_device_optax():
    model = OddLoop()
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    batches = [{"x": normal(32, 36), "y": normal(32, 5)} for _ in range(2)]
    params = model.init(jax.random.key(0), batches[0]["x"][:1])["params"]
    loss_fn = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
    ref_params, ref_opt = reference_run(TX, params, loss_fn, batches)
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(8), stage=3, units=r"block_\d+")
    specs = zero.param_specs(params)["block_1"]
    assert specs["up"]["kernel"] != jax.P() and specs["out"]["bias"] == jax.P()  # both kinds
    state = train(zero, loss_fn, params, batches)
    chex.assert_trees_all_close(jz.gather(state), ref_params, atol=1e-5)
    chex.assert_trees_all_close(jz.gather(state.opt_state), ref_opt, atol=1e-5)


def test_hf_llama_units_on_3_devices_match_single_device_optax():
    """Tiny FlaxLlama (hidden 32, ffn 48, vocabulary 64) on a 3-device mesh: only the ffn's 48
    divides by 3, so the attention kernels, norm scales, embedding and head are replicated."""
    params, loss_fn = hf_llama()
    batches = token_batches(64, 8, steps=2)
    ref_params, ref_opt = reference_run(TX, params, loss_fn, batches)
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(3), stage=3, units=r"model/layers/\d+")
    layer = zero.param_specs(params)["model"]["layers"]["1"]
    assert layer["mlp"]["up_proj"]["kernel"] != jax.P()
    assert layer["self_attn"]["q_proj"]["kernel"] == jax.P()
    state = train(zero, loss_fn, params, batches)
    chex.assert_trees_all_close(jz.gather(state), ref_params, atol=1e-5)
    chex.assert_trees_all_close(jz.gather(state.opt_state), ref_opt, atol=1e-5)
