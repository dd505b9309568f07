"""Hugging Face's ``run_clm_flax.py`` training core, ported from ``jax.pmap`` to jaxzero.

    python examples/hf_clm.py                    # stage 3, 20 steps, a tiny FlaxGPT2
    python examples/hf_clm.py --stage 2 --steps 50
    python examples/hf_clm.py --units            # stage 3 one GPT-2 block at a time

What is kept from the recipe, unchanged: the model (``FlaxGPT2LMHeadModel``, here built from
a tiny ``GPT2Config`` in code, nothing downloaded), ``decay_mask_fn`` (no weight decay on
biases and LayerNorm scales), ``create_learning_rate_fn`` (linear warmup, then linear decay
to 0), AdamW, and the shifted next-token cross-entropy. What the port changes
(docs/guide/from-pmap.md maps each piece):

* no ``state.replicate()`` / ``unreplicate``: ``step.init(params, rng=...)`` places
  the state on the mesh (stage 3: each device holds 1/N of params, gradients and AdamW);
* no ``shard(batch)``: the step takes the global batch and splits it over the devices;
* no ``jax.lax.pmean`` of gradients or metrics: the step reduces the gradient and averages
  the loss over devices;
* no ``dropout_rng`` in the state, split per device and per step: ``rng=True`` hands the loss
  the device's key, ``fold_in(fold_in(rng, step), device index)``.

The data are synthetic token blocks (``group_texts``' output shape: ``input_ids``,
``attention_mask`` and ``labels`` = ``input_ids``), a noisy cyclic sequence the model learns.
"""

from __future__ import annotations

import argparse
import warnings

from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices()  # before any jax backend starts: 8 simulated CPU devices (inert on GPUs)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import traverse_util  # noqa: E402
from flax.training.common_utils import onehot  # noqa: E402

import jaxzero as jz  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # transformers' notice that Flax ends in v5
    from transformers import FlaxGPT2LMHeadModel, GPT2Config
    from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()


# ----------------------------------------------------------------- from run_clm_flax.py
def create_learning_rate_fn(num_train_steps, num_warmup_steps, learning_rate):
    """Linear warmup from 0, then linear decay to 0 (run_clm_flax.py's, per step)."""
    warmup_fn = optax.linear_schedule(
        init_value=0.0, end_value=learning_rate, transition_steps=num_warmup_steps
    )
    decay_fn = optax.linear_schedule(
        init_value=learning_rate,
        end_value=0,
        transition_steps=num_train_steps - num_warmup_steps,
    )
    return optax.join_schedules(schedules=[warmup_fn, decay_fn], boundaries=[num_warmup_steps])


def decay_mask_fn(params):
    """True where AdamW decays: not biases, not LayerNorm scales (run_clm_flax.py's)."""
    flat_params = traverse_util.flatten_dict(params)
    layer_norm_candidates = ["layernorm", "layer_norm", "ln"]
    layer_norm_named_params = {
        layer[-2:]
        for layer_norm_name in layer_norm_candidates
        for layer in flat_params
        if layer_norm_name in "".join(layer).lower()
    }
    flat_mask = {
        path: (path[-1] != "bias" and path[-2:] not in layer_norm_named_params)
        for path in flat_params
    }
    return traverse_util.unflatten_dict(flat_mask)


def loss_fn(logits, labels):
    """Next-token cross-entropy: logits at t predict the label at t + 1."""
    shift_logits = logits[..., :-1, :]
    shift_labels = labels[..., 1:]
    loss = optax.softmax_cross_entropy(shift_logits, onehot(shift_labels, shift_logits.shape[-1]))
    return loss.mean()


# ----------------------------------------------------------------- the tiny run
def gpt2(layers=2, width=32, heads=2, vocab=64, block_size=16, seed=0):
    """``(model, params)``: a tiny FlaxGPT2LMHeadModel, its config built in code (GPT-2's
    dropouts of 0.1 kept), and its initial params (HF's ``init_weights``, jitted: the eager
    init of ``model.params`` runs op by op)."""
    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=block_size
    )
    model = FlaxGPT2LMHeadModel(config, seed=seed, dtype=jnp.float32, _do_init=False)
    init = jax.jit(model.init_weights, static_argnums=1)
    params = init(jax.random.PRNGKey(seed), (1, block_size))
    return model, params


def optimizer(steps, warmup, learning_rate=3e-3, weight_decay=0.01):
    """run_clm_flax.py's AdamW (its default betas and eps) on the warmup schedule."""
    schedule = create_learning_rate_fn(steps, warmup, learning_rate)
    tx = optax.adamw(
        learning_rate=schedule,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=weight_decay,
        mask=decay_mask_fn,
    )
    return tx, schedule


def make_loss(model):
    """The loss of run_clm_flax.py's ``train_step``, as jaxzero's stateless rng loss."""

    def compute_loss(params, batch, dropout_rng):
        batch = dict(batch)
        labels = batch.pop("labels")
        logits = model(**batch, params=params, dropout_rng=dropout_rng, train=True)[0]
        return loss_fn(logits, labels)

    return compute_loss


def token_batches(steps, batch_size, block_size, vocab, seed=0):
    """``steps`` global batches shaped as ``group_texts`` makes them: a cyclic sequence over
    the vocabulary with 10% of the tokens replaced at random."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, size=(batch_size, 1))
        ids = (start + np.arange(block_size)) % vocab
        noise = rng.random(ids.shape) < 0.1
        ids = np.where(noise, rng.integers(0, vocab, ids.shape), ids).astype(np.int32)
        out.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids})
    return out


def train(
    stage=3,
    steps=20,
    warmup=4,
    batch_size=16,
    units=False,
    seed=0,
    model_kw=None,
    log=print,
):
    """Train the tiny GPT-2 with jaxzero; returns ``(state, losses)``."""
    model, params = gpt2(seed=seed, **(model_kw or {}))
    tx, schedule = optimizer(steps, warmup)
    zero = jz.ZeRO(
        tx,
        jz.data_parallel_mesh(),
        stage=stage,
        units=r"transformer/h/\d+" if units else None,
    )
    step = jz.make_train_step(make_loss(model), zero, rng=True)
    state = step.init(params, rng=jax.random.PRNGKey(seed))
    config = model.config
    losses = []
    for i, batch in enumerate(
        token_batches(steps, batch_size, config.n_positions, config.vocab_size, seed)
    ):
        lr = float(schedule(state.step))  # run_clm_flax.py logs the rate of the step taken
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        log(f"step {i + 1:3d}  loss {losses[-1]:.4f}  learning_rate {lr:.2e}")
    return state, losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    parser.add_argument("--units", action="store_true", help="stage 3, a GPT-2 block at a time")
    args = parser.parse_args(argv)
    _, losses = train(args.stage, args.steps, args.warmup, args.batch, args.units)
    print(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
