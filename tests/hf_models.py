"""Tiny Hugging Face Flax models (``transformers``, random init, no download): models jaxzero's
authors did not write, as users bring them (no jaxzero logic here)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _transformers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import transformers
        from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return transformers


def _params(init, abstract):
    return (jax.eval_shape(init) if abstract else init())["params"]


def _token_loss(logits, labels):
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def hf_llama(
    layers=2, hidden=32, ffn=48, vocab=64, seq=8, dtype=jnp.float32, abstract=False, heads=2
):
    """(params, loss_fn) of FlaxLlamaForCausalLM: blocks ``model/layers/0`` ... in a Python
    loop; its attention softmax runs in float32 whatever ``dtype`` is."""
    t = _transformers()
    config = t.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        # FlaxLlama keeps num_pos of its sin/cos columns: at least 2 x head_dim
        max_position_embeddings=max(seq, hidden),
    )
    model = t.FlaxLlamaForCausalLM(config, dtype=dtype, _do_init=False)
    ids = jnp.zeros((1, seq), jnp.int32)
    params = _params(lambda: model.module.init(jax.random.key(0), ids, ids, ids), abstract)

    def loss_fn(p, b):
        x = b["x"]
        pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        logits = model.module.apply({"params": p}, x, jnp.ones_like(x), pos)[0]
        return _token_loss(logits, b["y"])

    return params, loss_fn


def _relative_position_bucket(
    relative_position, bidirectional=True, num_buckets=32, max_distance=128
):
    """FlaxT5Attention's own bucketing with ``jnp.clip(x, max=)``: transformers 4.57 calls
    ``jnp.clip(x, a_max=)``, which jax 0.10 no longer accepts."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0) * num_buckets
        relative_position = jnp.abs(relative_position)
    else:
        relative_position = -jnp.clip(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (
        jnp.log(relative_position / max_exact)
        / jnp.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    )
    large = jnp.clip(large, max=num_buckets - 1)
    buckets += jnp.where(is_small, relative_position, large)
    return buckets.astype("i4")


def hf_t5(layers=2, d_model=32, d_ff=48, vocab=64, seq=8, dtype=jnp.float32, abstract=False):
    """(params, loss_fn) of FlaxT5ForConditionalGeneration: an encoder and a decoder, blocks
    ``encoder/block/0`` ... and ``decoder/block/0`` ...; the shared embedding outside both."""
    t = _transformers()
    from transformers.models.t5 import modeling_flax_t5

    attention = modeling_flax_t5.FlaxT5Attention
    attention._relative_position_bucket = staticmethod(_relative_position_bucket)
    config = t.T5Config(
        vocab_size=vocab,
        d_model=d_model,
        d_kv=d_model // 2,
        d_ff=d_ff,
        num_layers=layers,
        num_heads=2,
        dropout_rate=0.0,
    )
    model = t.FlaxT5ForConditionalGeneration(config, dtype=dtype, _do_init=False)
    ids = jnp.zeros((1, seq), jnp.int32)
    init = lambda: model.module.init(jax.random.key(0), ids, ids, ids, ids)
    params = _params(init, abstract)

    def loss_fn(p, b):
        x = b["x"]
        ones = jnp.ones_like(x)
        logits = model.module.apply({"params": p}, x, ones, b["y"], ones, deterministic=True)[0]
        return _token_loss(logits, b["y"])

    return params, loss_fn


def token_batches(vocab, seq, steps=2, batch=24, seed=0):
    """``steps`` batches of random token ids ``{"x", "y"}``, ``[batch, seq]`` each."""
    rng = np.random.default_rng(seed)
    tokens = lambda: rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    return [{"x": tokens(), "y": tokens()} for _ in range(steps)]
