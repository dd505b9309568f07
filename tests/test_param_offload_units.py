"""``ZeRO(stage=3, units=..., offload=("optimizer", "params"))``: the params offloaded for a
model as Hugging Face writes it (FlaxLlama, a Python loop of blocks), with no model change
(decision 42). The unit chain (``prefetch=True``) fetches each unit's shards from host memory
where it gathers them, and each unit's reduced gradient goes back to the host as soon as it
exists.

Numbers: on 8 simulated CPU devices the run equals the run with the params on the device, and
single-device optax within the tolerance that bf16's rounding of the gradient sets. Memory:
the deviceless H100 compile holds the state and the params in host memory and nothing more
(the gradients take the params' bytes), and the device's arguments are the batch and two
counters. What is not built is refused with the fix; micro-batches:
tests/test_param_offload_units_accum.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from models import run_steps
from offload_checks import (
    assert_host_params_run_equals_device_run,
    assert_master_is_bf16_optax,
)

import jaxzero as jz
from jaxzero import cli, gpu
from jaxzero.gpu.models import hf_llama, token_batches

N = 8
PARAMS = ("optimizer", "params")
UNITS = r"model/layers/\d+"


def _zero(off, tx, devices=N, **kw):
    mesh = jz.data_parallel_mesh(devices)
    return jz.ZeRO(tx, mesh, stage=3, units=UNITS, precision="bf16", offload=off, **kw)


@pytest.fixture(scope="module")
def problem():
    params, loss_fn = hf_llama()
    return params, loss_fn, token_batches(64, 8, steps=2)


def _run(off, tx, problem, devices=N):
    params, loss_fn, batches = problem
    zero = _zero(off, tx, devices)
    return run_steps(zero, loss_fn, zero.init(params), batches, None)


# 1 device: the chain orders each unit's fetch and each gradient's trip to the host itself
@pytest.mark.parametrize("devices", [N, 1])
def test_units_params_offload_trains_like_the_device_params(problem, devices):
    """Tiny FlaxLlama (2 blocks, hidden 32), clip + AdamW, 2 steps: losses, params, master and
    optimizer state equal the run with the params on the device; the params are in pinned
    host memory."""
    tx = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, eps=1e-6))
    host, losses = _run(PARAMS, tx(), problem, devices)
    device, device_losses = _run("optimizer", tx(), problem, devices)
    assert_host_params_run_equals_device_run(host, losses, device, device_losses)


def test_units_params_offload_follows_single_device_optax(problem):
    """SGD, 2 steps: the fp32 master is single-device optax's on the whole batch within 8x
    the spread of that reference rerun in other summation orders with its loss on the bf16
    cast (tests/tolerance.py; SGD keeps bf16's rounding a rounding of the step), and the steps
    moved the params far past it."""
    run = lambda tx: _run(PARAMS, tx, problem)[0]
    assert_master_is_bf16_optax(run, optax.sgd(0.5), problem, moved=20)


def test_gpu_units_params_offload_holds_state_and_params_on_the_host_and_nothing_more():
    """Deviceless H100, FlaxLlama 4 blocks x 512 at N = 8, bf16 Adam with an EMA: the host
    holds the fp32 master, mu, nu and EMA (16 bytes per local element) and the bf16 params (2),
    plus the counters; its temporaries are the 4 bytes the optimizer offload has too, and every
    host output aliases its input: the unit gradients take the params' bytes. The device's
    arguments are the batch and two counters."""
    params, loss_fn = hf_llama(
        layers=4, hidden=512, ffn=1536, vocab=512, seq=64, heads=4, abstract=True
    )
    batch = {k: jax.ShapeDtypeStruct((N, 64), jnp.int32) for k in ("x", "y")}
    local = sum(math.prod(x.shape) // N for x in jax.tree.leaves(params))  # every dim splits
    mesh = gpu.compile_only_mesh("h100", N)
    zero = jz.ZeRO(optax.adam(1e-3), mesh, stage=3, precision="bf16", units=UNITS, offload=PARAMS)
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.99))
    report = gpu.compile_report(step, params, batch)
    want = 18 * local + 2 * 4
    assert report.host_argument_bytes == report.host_output_bytes == want
    assert report.host_alias_bytes == want
    assert report.host_temp_bytes <= 4
    assert report.argument_bytes == 2 * 4 * 64 + 2 * 4  # one 64-token row of x and y each


def test_units_params_offload_refuses_what_is_not_built(capsys):
    """``prefetch=False`` (each unit its own segment) is refused naming the fix, before any
    state exists; ``jaxzero plan --loop python --prefetch off`` says so as a usage error before
    compiling. (Micro-batches are built: tests/test_param_offload_units_accum.py.)"""
    with pytest.raises(ValueError, match=r"prefetch=False .* not built for it. Drop"):
        _zero(PARAMS, optax.sgd(0.1), prefetch=False)
    argv = ["plan", "--devices", "8", "--layers", "2", "--hidden", "64", "--heads", "2"]
    argv += ["--loop", "python", "--offload", "optimizer,params", "--prefetch", "off"]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "prefetch=False" in capsys.readouterr().err


def test_gpu_units_params_offload_on_one_gpu_never_holds_the_whole_model():
    """Deviceless H100, one GPU (DeepSpeed's ZeRO-Offload case), FlaxLlama 6 blocks x 1024,
    bf16 Adam: the device's peak stays below the bf16 params' bytes (156 MB): the chain
    fetches each unit after the previous one and sends each unit's gradient to the host before
    the next is reduced. Without those orders XLA fetched every unit at once and sent every
    gradient at the end: 200 MB (decision 42)."""
    shape = {"layers": 6, "hidden": 1024, "ffn": 2816, "vocab": 512, "seq": 64, "heads": 8}
    params, loss_fn = hf_llama(**shape, abstract=True)
    batch = {k: jax.ShapeDtypeStruct((1, 64), jnp.int32) for k in ("x", "y")}
    mesh = gpu.compile_only_mesh("h100", 1)
    zero = jz.ZeRO(optax.adam(1e-3), mesh, stage=3, precision="bf16", units=UNITS, offload=PARAMS)
    report = gpu.compile_report(jz.make_train_step(loss_fn, zero), params, batch)
    bf16_params = 2 * sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert report.peak_bytes < 0.75 * bf16_params
