"""The unscanned decoders of jaxzero.gpu.models (benchmarks/units.py): the Linen Python loop of
blocks (``loop="python"``/``"python_noremat"``) and its NNX twin (``nnx_model``), checked
against the scanned decoder on the same weights and against the parameter-count formula."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxzero.gpu.models import Decoder, abstract_params, make_loss, model_shape, nnx_model

# fp32 params: XLA's reference attention (cuDNN's fused kernel has no CPU or fp32 form)
GPT = model_shape(layers=3, hidden=32, heads=2, vocab=64, seq=8, arch="gpt", loop="python")
LLAMA = dataclasses.replace(GPT, arch="llama", ffn=48)


def _batch(shape, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, shape.vocab, size=(2, shape.seq + 1)).astype(np.int32)
    return {"x": jnp.asarray(tokens[:, :-1]), "y": jnp.asarray(tokens[:, 1:])}


def _init(shape, seed=0):
    tokens = jnp.zeros((1, shape.seq), jnp.int32)
    return Decoder(shape).init(jax.random.key(seed), tokens)["params"]


def _unstack(scanned, layers):
    """The scanned decoder's params with its layer stack split into ``block_i``."""
    out = {k: v for k, v in scanned.items() if k != "layers"}
    for i in range(layers):
        out[f"block_{i}"] = jax.tree.map(lambda x, i=i: x[i], scanned["layers"])
    return out


def _size(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=["gpt", "llama"])
def test_python_loop_params_are_one_subtree_per_block(shape):
    params = abstract_params(shape)
    blocks = {f"block_{i}" for i in range(shape.layers)}
    assert blocks <= set(params) and "layers" not in params
    stacked = abstract_params(dataclasses.replace(shape, loop="prefetch"))["layers"]
    for name in blocks:  # each block is one layer of the stack, without the layer axis
        got = jax.tree.map(lambda x: x.shape, params[name])
        assert got == jax.tree.map(lambda x: x.shape[1:], stacked)
    assert _size(params) == shape.num_params


# (arch, loop): both loops on the GPT, one each on LLaMA (each pair is a few CPU compiles)
@pytest.mark.parametrize(
    "shape,loop",
    [
        # slow: the GPT's remat and no-remat loops against the scan (the LLaMA's stays)
        pytest.param(GPT, "python", id="gpt-python", marks=pytest.mark.slow),
        pytest.param(GPT, "python_noremat", id="gpt-python_noremat", marks=pytest.mark.slow),
        pytest.param(LLAMA, "python", id="llama-python"),
    ],
)
def test_python_loop_loss_equals_the_scanned_decoder_on_the_same_weights(shape, loop):
    """The scanned decoder (scan_layers over a stacked layer axis) is the reference: its
    params unstacked into block_0..block_{L-1} give the Python loop the same loss and the
    same gradients (restacked)."""
    scanned_shape = dataclasses.replace(shape, loop="prefetch")
    scanned = _init(scanned_shape)
    batch = _batch(shape)
    want, want_grads = jax.jit(jax.value_and_grad(make_loss(scanned_shape)))(scanned, batch)
    loop_shape = dataclasses.replace(shape, loop=loop)
    got, grads = jax.jit(jax.value_and_grad(make_loss(loop_shape)))(
        _unstack(scanned, shape.layers), batch
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    want_grads = _unstack(want_grads, shape.layers)
    assert set(grads) == set(want_grads)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        # one device, no optimizer step: two forms of one model's gradient, a few ulps apart
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=["gpt", "llama"])
def test_nnx_list_params_match_the_formula(shape):
    params, _ = nnx_model(shape)
    assert list(params["layers"]) == list(range(shape.layers))
    assert _size(params) == shape.num_params
    h, v = shape.hidden, shape.vocab
    if shape.arch == "gpt":  # tied head, learned positions
        assert set(params) == {"embed", "pos", "layers", "final_norm"}
        assert params["pos"].shape == (shape.seq, h)
    else:
        assert set(params) == {"embed", "layers", "head", "final_norm"}
        assert params["head"]["kernel"].shape == (h, v)
    assert params["embed"]["embedding"].shape == (v, h)


@pytest.mark.parametrize(
    "shape,loop",
    [
        pytest.param(GPT, "python", id="gpt-python"),
        # slow: the NNX twin of the no-remat GPT (the remat GPT and the LLaMA stay)
        pytest.param(GPT, "python_noremat", id="gpt-python_noremat", marks=pytest.mark.slow),
        pytest.param(LLAMA, "python_noremat", id="llama-python_noremat"),
    ],
)
def test_nnx_list_loss_equals_the_linen_loop_on_the_same_weights(shape, loop):
    """The Linen loop's params with block_i moved to layers/i: the same loss and gradients
    through jz.flax_nnx.split's model_def.loss, in fp32."""
    shape = dataclasses.replace(shape, loop=loop)
    linen = _init(shape, seed=1)
    blocks = {f"block_{i}" for i in range(shape.layers)}
    as_nnx = {k: v for k, v in linen.items() if k not in blocks}
    as_nnx["layers"] = {i: linen[f"block_{i}"] for i in range(shape.layers)}
    template, loss_fn = nnx_model(shape, dtype=jnp.float32)
    assert jax.tree.structure(template) == jax.tree.structure(as_nnx)
    batch = _batch(shape, seed=1)
    want, want_grads = jax.jit(jax.value_and_grad(make_loss(shape)))(linen, batch)
    got, grads = jax.jit(jax.value_and_grad(loss_fn))(as_nnx, batch)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # one device, no optimizer step: two forms of one model's gradient, a few ulps apart
    for i in range(shape.layers):
        jax.tree.map(
            lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6),
            grads["layers"][i],
            want_grads[f"block_{i}"],
        )
    np.testing.assert_allclose(
        grads["embed"]["embedding"], want_grads["embed"]["embedding"], rtol=1e-5, atol=1e-6
    )


def test_nnx_list_computes_in_the_given_dtype():
    """bf16 params through a bf16-built NNX model: every matmul in bf16 (an nnx.Embed built
    without dtype= would compute the head in float32)."""
    params, loss_fn = nnx_model(GPT)
    bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    jaxpr = jax.make_jaxpr(loss_fn)(bf16, _batch(GPT))
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and {v.aval.dtype for e in dots for v in e.invars} == {jnp.dtype(jnp.bfloat16)}


def test_nnx_model_refuses_a_scanned_loop():
    with pytest.raises(ValueError, match="loop='python'"):
        nnx_model(dataclasses.replace(GPT, loop="prefetch"))


def test_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="python_noremat"):
        dataclasses.replace(GPT, loop="for")
