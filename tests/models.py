"""The tests' optax chains, single-device references and training loops. The models and
problems they train are :mod:`jaxzero.gpu.models`' (``make_problem``)."""

from __future__ import annotations

import jax
import optax

import jaxzero as jz
from jaxzero.gpu.models import make_problem


def decay_mask(params):
    """Weight decay on matrices only (no decay on biases and norm scales)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def chains():
    """The optax chains every stage must reproduce."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 3, 10)
    return {
        "adamw_masked": optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask),
        "clip_adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
        "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=16),
        "lamb": optax.lamb(1e-2),
        "sgd_nesterov_cosine": optax.sgd(schedule, momentum=0.9, nesterov=True),
        "multisteps_adam": optax.MultiSteps(optax.adam(3e-3), every_k_schedule=4),
    }


def stack_problem(**kw):
    """``make_problem("stack", ...)`` with jaxzero's ``scan_layers`` and ``stacked_params``
    (``kw``: layers, steps, xs, ys)."""
    return make_problem("stack", scan_layers=jz.scan_layers, stacked_params=jz.stacked_params, **kw)


def run_steps(zero, loss_fn, state, batches, ema, **step_kw):
    """``(state, losses)`` after one jaxzero train step per batch from ``state`` (``step_kw``:
    make_train_step's)."""
    step = jz.make_train_step(loss_fn, zero, ema=ema, **step_kw)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def train(zero, loss_fn, params, batches, **kw):
    """The state after one jaxzero train step per batch (``kw``: make_train_step's)."""
    step = jz.make_train_step(loss_fn, zero, **kw)
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)
    return state


def stage3_per_layer_and_whole_bf16(params, loss_fn, batches, ema):
    """The final states of stage 3 with ``layers="layers"`` and without (bf16 compute, fp32
    master and reduce, Adam, ``ema``) on 8 devices: only where the gathers happen differs."""
    mesh = jz.data_parallel_mesh(8)
    pol = jz.Precision("bfloat16", "float32", "float32")
    tx = optax.adam(1e-2, eps=1e-6)
    return tuple(
        train(jz.ZeRO(tx, mesh, stage=3, precision=pol, **kw), loss_fn, params, batches, ema=ema)
        for kw in ({"layers": "layers"}, {})
    )
