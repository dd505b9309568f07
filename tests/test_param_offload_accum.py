"""``ZeRO(offload=("optimizer", "params"))`` with micro-batches (``accum_steps > 1``): each
layer's reduced gradient is summed into a host accumulator of the stacks' shapes in
``output_dtype``, the params stay as they are until the update, and the streamed update reads
and divides the sum (decision 42).

Numbers: on 8 simulated CPU devices the run equals the same run with the params on the device,
and plain single-device optax within the tolerance that bf16's rounding of the gradient sets. Memory: the deviceless H100 compile holds the state and the params as
its host arguments, as with one micro-batch, and the accumulator as its only host temporary,
written and read a layer's slice at a time in the backward loop.
"""

from __future__ import annotations

import math
import re

import jax
import optax
import pytest
from models import run_steps, stack_problem
from offload_checks import (
    assert_host_params_run_equals_device_run,
    assert_master_is_bf16_optax,
)

import jaxzero as jz
from jaxzero import gpu
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, make_problem, model_shape

N = 8
PARAMS = ("optimizer", "params")
ACCUM = 2


def _zero(off, tx):
    return jz.ZeRO(
        tx, jz.data_parallel_mesh(N), stage=3, layers="layers", precision="bf16", offload=off
    )


@pytest.fixture(scope="module")
def problem():
    return stack_problem(layers=2, steps=2)


def _run(off, tx, problem):
    params, loss_fn, batches = problem
    zero = _zero(off, tx)
    return run_steps(zero, loss_fn, zero.init(params), batches, None, accum_steps=ACCUM)


def test_accumulated_gradients_train_like_the_device_params(problem):
    """clip + AdamW (the streamed update's global norm reads the divided sums), 2 steps of 2
    micro-batches: losses, params, master and optimizer state equal the run with the params
    on the device (its accumulator there, in the same dtype and order); the params and the
    state stay in pinned host memory."""
    tx = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, eps=1e-6))
    host, losses = _run(PARAMS, tx(), problem)
    device, device_losses = _run("optimizer", tx(), problem)
    assert_host_params_run_equals_device_run(host, losses, device, device_losses)
    assert int(host.step) == int(device.step) == len(problem[2])


def test_accumulated_gradients_follow_single_device_optax(problem):
    """SGD, 2 steps of 2 micro-batches: the fp32 master is single-device optax's on the whole
    batch, within 8x the spread of that reference rerun in other summation orders with its
    loss on the bf16 cast (tests/tolerance.py), and the steps moved the params far past it.
    SGD's update is linear in the gradient, so bf16's rounding of it stays a rounding of the
    step (Adam's division by sqrt(v) makes a last-bit change of a tiny gradient a share of the
    learning rate: its bf16 spread is as large as the steps)."""
    run = lambda tx: _run(PARAMS, tx, problem)[0]
    assert_master_is_bf16_optax(run, optax.sgd(0.1), problem, moved=50)


SHAPE = model_shape(layers=4, hidden=512, heads=4, vocab=512, seq=64, batch=1)


def _local(path, x):
    """Elements per device of a param leaf by the sharding rule (split 8 ways on the first
    divisible dimension, a stack's layer axis skipped, else whole) and its local shape."""
    skip = 1 if path[0].key == "layers" else 0
    d = next((d for d in range(skip, len(x.shape)) if x.shape[d] % N == 0), None)
    shape = x.shape if d is None else x.shape[:d] + (x.shape[d] // N,) + x.shape[d + 1 :]
    return math.prod(shape), shape


# a write of one layer's f32 device slice into a stack-shaped buffer in host memory (S(5))
_HOST_SUM = re.compile(r"dynamic-update-slice\S* = \(\(f32\[([\d,]+)\]\{[\d,]*:S\(5\)\}, f32\[1,")


def test_gpu_accumulator_is_the_only_host_temporary():
    """Deviceless H100, 4 scanned layers x 512 at N = 8, bf16 Adam with an EMA, 2
    micro-batches: the host arguments are the state and the params (18 bytes per local
    element plus the counters), every host output aliases them (the new params go back into
    the params' buffers), and the one host temporary is the accumulator: at most 4 bytes (fp32)
    per local stack element, at least those of the leaves larger than one layer's norm
    scale (the two [4, 64] norm stacks may share a buffer: 2 KB). The backward loop writes
    each stack's sum into its host buffer a layer's f32 slice at a time."""
    mesh = gpu.compile_only_mesh("h100", N)
    zero = jz.ZeRO(
        optax.adam(1e-3), mesh, stage=3, precision="bf16", layers="layers", offload=PARAMS
    )
    step = jz.make_train_step(make_loss(SHAPE), zero, ema=jz.ShardedEMA(0.99), accum_steps=ACCUM)
    report = gpu.compile_report(step, abstract_params(SHAPE), batch_shapes(SHAPE, N * ACCUM))
    flat = jax.tree_util.tree_flatten_with_path(abstract_params(SHAPE))[0]
    local = sum(_local(p, x)[0] for p, x in flat)
    stacks = [_local(p, x) for p, x in flat if p[0].key == "layers"]
    want = 18 * local + 2 * 4
    assert report.host_argument_bytes == report.host_output_bytes == want
    assert report.host_alias_bytes == want
    accumulator = 4 * sum(n for n, _ in stacks)
    norms = 4 * sum(n for n, s in stacks if len(s) == 2)
    assert accumulator - norms <= report.host_temp_bytes <= accumulator
    # the plan's rows: the stacks' gradients host sums (in output_dtype), with one micro-batch none
    host_sums = lambda plan: sum(r.bytes["grads"] for r in plan.rows if r.accumulate == "host_sum")
    assert host_sums(zero.plan(abstract_params(SHAPE), accum_steps=ACCUM)) == accumulator
    assert host_sums(zero.plan(abstract_params(SHAPE), accum_steps=1)) == 0
    writes = {tuple(int(d) for d in m.split(",")) for m in _HOST_SUM.findall(report.hlo_text)}
    assert writes == {s for _, s in stacks}


def test_estimate_counts_the_accumulator():
    """``estimate_memory``'s host with the params offloaded: 14 bytes per local parameter
    (bf16 params 2, fp32 master 4, Adam 8), plus 4 per local stack parameter with
    micro-batches (the fp32 accumulator)."""
    est = lambda accum: jz.estimate_memory(
        SHAPE.num_params,
        N,
        stage=3,
        offload=PARAMS,
        layer_params=SHAPE.layer_params,
        layers=SHAPE.layers,
        accum_steps=accum,
    )
    shard = -(-SHAPE.num_params // N)
    stack = -(-(SHAPE.layer_params * SHAPE.layers) // N)
    assert est(1).host == 14 * shard
    assert est(ACCUM).host == 14 * shard + 4 * stack
    assert jz.estimate_memory(
        SHAPE.num_params, N, stage=3, offload="optimizer", accum_steps=2
    ).host == (jz.estimate_memory(SHAPE.num_params, N, stage=3, offload="optimizer").host)


def test_a_stack_the_model_changed_is_refused_before_any_state_changes(problem):
    """The accumulators belong to the stack leaves the step hands the loss; a model that hands
    jaxzero.scan_layers other arrays (here each leaf times one) is told so while the step is
    traced, and the state is not donated."""
    params, _, batches = problem

    def changed(fn, stack, x, *a, **k):
        return jz.scan_layers(fn, jax.tree.map(lambda s: s * 1, stack), x, *a, **k)

    kw = {"scan_layers": changed, "stacked_params": jz.stacked_params}
    _, loss_fn, _ = make_problem("stack", layers=2, steps=1, **kw)
    step = jz.make_train_step(loss_fn, _zero(PARAMS, optax.sgd(0.1)), accum_steps=ACCUM)
    state = step.init(params)
    with pytest.raises(ValueError, match=r"not those leaves .* or use accum_steps=1"):
        step(state, batches[0])
    assert int(state.step) == 0
