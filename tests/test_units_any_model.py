"""``ZeRO(stage=3, units=...)`` on models as users bring them: widths the device count does not
divide (replicated leaves inside a unit, decision 3), a 3-device mesh, and Hugging Face's
FlaxLlamaForCausalLM and FlaxT5ForConditionalGeneration (tiny configs, random init). Every
step is checked against plain single-device optax."""

from __future__ import annotations

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance
from models import train

import jaxzero as jz
from jaxzero.gpu.models import hf_llama, hf_t5, make_problem, model_shape, token_batches
from jaxzero.gpu.plan import row_estimate, unit_bound
from jaxzero.trees import path_strs
from jaxzero.zero.units import plan as units_mod

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


def _odd_problem():
    model = OddLoop()
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    batches = [{"x": normal(32, 36), "y": normal(32, 5)} for _ in range(2)]
    params = model.init(jax.random.key(0), batches[0]["x"][:1])["params"]
    loss_fn = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
    return params, loss_fn, batches


def test_units_with_leaves_eight_does_not_divide_match_single_device_optax():
    params, loss_fn, batches = _odd_problem()
    ref_params, ref_opt, atol = tolerance.reference(TX, params, loss_fn, batches)
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(8), stage=3, units=r"block_\d+")
    specs = zero.param_specs(params)["block_1"]
    assert specs["up"]["kernel"] != jax.P() and specs["out"]["bias"] == jax.P()  # both kinds
    state = train(zero, loss_fn, params, batches)
    chex.assert_trees_all_close(jz.gather(state), ref_params, atol=atol)
    chex.assert_trees_all_close(jz.gather(state.opt_state), ref_opt, atol=atol)


def test_hf_llama_units_on_3_devices_match_single_device_optax():
    """Tiny FlaxLlama (hidden 32, ffn 48, vocabulary 64) on a 3-device mesh: only the ffn's 48
    divides by 3, so the attention kernels, norm scales, embedding and head are replicated."""
    params, loss_fn = hf_llama()
    batches = token_batches(64, 8, steps=2)
    ref_params, ref_opt, atol = tolerance.reference(TX, params, loss_fn, batches)
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(3), stage=3, units=r"model/layers/\d+")
    layer = zero.param_specs(params)["model"]["layers"]["1"]
    assert layer["mlp"]["up_proj"]["kernel"] != jax.P()
    assert layer["self_attn"]["q_proj"]["kernel"] == jax.P()
    state = train(zero, loss_fn, params, batches)
    chex.assert_trees_all_close(jz.gather(state), ref_params, atol=atol)
    chex.assert_trees_all_close(jz.gather(state.opt_state), ref_opt, atol=atol)


def _names(params, patterns) -> dict:
    paths = ["/".join(path_strs(p)) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return dict(zip(paths, units_mod.unit_names(params, patterns), strict=True))


# slow: nested units on FlaxT5 (FlaxLlama's units and the nested-unit names stay)
@pytest.mark.slow
def test_nested_units_on_hf_t5_match_single_device_optax():
    """Tiny FlaxT5 (encoder-decoder, 2 + 2 blocks) with FSDP2's fully_shard on a sub-module and
    then on its parent: each block's self-attention sub-layer (``layer/0``) is a unit, and the
    block's unit keeps the rest (cross-attention, feed-forward); the shared embedding and the
    final norms are in no unit."""
    params, loss_fn = hf_t5()
    nested = (r"(encoder|decoder)/block/\d+", r"(encoder|decoder)/block/\d+/layer/0")
    names = _names(params, nested)
    q = "decoder/block/1/layer/0/SelfAttention/q/kernel"
    assert names[q] == "decoder/block/1/layer/0"
    assert names["decoder/block/1/layer/1/EncDecAttention/q/kernel"] == "decoder/block/1"
    assert names["encoder/block/0/layer/1/DenseReluDense/wi/kernel"] == "encoder/block/0"
    assert names["shared/embedding"] is None and names["encoder/final_layer_norm/weight"] is None
    batches = token_batches(64, 8, steps=2, batch=16)
    ref_params, ref_opt, atol = tolerance.reference(TX, params, loss_fn, batches)
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(8), stage=3, units=nested)
    state = train(zero, loss_fn, params, batches)
    chex.assert_trees_all_close(jz.gather(state), ref_params, atol=atol)
    chex.assert_trees_all_close(jz.gather(state.opt_state), ref_opt, atol=atol)


def test_a_nested_pattern_left_no_leaf_is_refused_by_name():
    """On tiny FlaxLlama's params: the layer and its attention are both units (no error), but
    a layer pattern whose every leaf a deeper pattern claims is named with the one that
    shadows it and the rule."""
    params, _ = hf_llama(abstract=True)
    mesh = jz.data_parallel_mesh(8)
    jz.ZeRO(
        TX, mesh, stage=3, units=(r"model/layers/\d+", r"model/layers/\d+/self_attn")
    ).abstract_state(params)
    shadowed = (r"model/layers/\d+", r"model/layers/\d+/(self_attn|mlp|\w+_layernorm)")
    with pytest.raises(ValueError) as info:
        jz.ZeRO(TX, mesh, stage=3, units=shadowed).abstract_state(params)
    msg = str(info.value)
    assert repr(shadowed[0]) in msg and repr(shadowed[1]) in msg, msg
    assert "model/layers/0" in msg and "deepest" in msg, msg


@pytest.mark.parametrize(
    "model,units",
    [
        ("llama", {"model/layers/0", "model/layers/1"}),
        ("t5", {f"{part}/block/{i}" for part in ("encoder", "decoder") for i in (0, 1)}),
        ("linen_loop", {"layer0", "layer1"}),
    ],
)
def test_no_match_error_suggests_a_pattern_built_from_the_params_paths(model, units):
    """A pattern that matches nothing is refused with one built from the numbered path
    segments the params repeat; that suggestion names exactly the model's blocks."""
    if model == "llama":
        params, _ = hf_llama(abstract=True)
    elif model == "t5":
        params, _ = hf_t5(abstract=True)
    else:
        params = make_problem("transformer", steps=1)[0]
    with pytest.raises(ValueError, match="fullmatches no params path") as info:
        jz.ZeRO(TX, jz.data_parallel_mesh(8), stage=3, units=r"blocks?_\d+").abstract_state(params)
    suggested = re.search(r"try units=r'([^']+)'", str(info.value))
    assert suggested, str(info.value)
    assert set(units_mod.unit_names(params, (suggested[1],))) - {None} == units


def test_no_match_error_without_numbered_blocks_says_what_a_unit_is():
    params = {"encoder": {"kernel": jnp.zeros((8, 8))}, "head": {"kernel": jnp.zeros((8, 2))}}
    with pytest.raises(ValueError, match="A unit is a subtree of the params") as info:
        jz.ZeRO(TX, jz.data_parallel_mesh(8), stage=3, units=r"block_\d+").abstract_state(params)
    assert "try units=" not in str(info.value)


def test_plan_estimates_a_unit_row_with_three_units_gathered_not_the_whole_model():
    """`jaxzero plan`'s estimate column: the whole-model stage 3 row counts the model gathered
    in bf16 (p Φ), the "3 per unit" row the formula unit_bound states, (3p + g) unit +
    g (Φ - L unit), p = g = 2 bytes (the running unit, the prefetched one and the last one
    kept for its backward; 2p without prefetch); the rest (state, activations) is the same in
    both."""
    shape = model_shape(layers=4, hidden=64, heads=2, vocab=128, seq=16, arch="gpt", loop="python")
    whole = row_estimate(shape, 8, 3, False, "bf16", False, False)
    unit = row_estimate(shape, 8, 3, True, "bf16", False, False, per="unit")
    phi, u, p = shape.num_params, shape.layer_params, 2
    assert whole.gathered == p * phi
    assert unit.gathered == 4 * p * u + p * (phi - 4 * u)
    assert unit.total - unit.gathered == whole.total - whole.gathered
    assert unit.total == unit_bound(shape, 8, compute_copy=False)
    lean = row_estimate(shape, 8, 3, True, "bf16", False, False, per="unit", prefetch=False)
    assert unit.total - lean.total == p * u
    assert lean.total == unit_bound(shape, 8, compute_copy=False, prefetch=False)
