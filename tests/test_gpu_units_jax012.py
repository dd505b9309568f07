"""XLA:GPU, deviceless: stage 3 per module (``units=``) at N = 64 H100s, the units' gathers
and reduce-scatters hidden behind the backward's compute on the running XLA (jax 0.10's and
jax 0.12's schedulers).

XLA:GPU keeps one collective in flight at a time, and the backward of unit k holds two: unit
k + 1's reduce-scatter and unit k - 1's all-gather (the prefetch). With the gather free to
start before unit k's recompute, the scheduler gave it the whole unit and ran the
reduce-scatter alone (the 4-block GPT below: 0.52 of the reduce-scatter bytes hidden, 0.63 of
all-gather + reduce-scatter, on jax 0.10 and 0.12). The gather waits for unit k's recomputed
output, so the reduce-scatter runs under the recompute (docs/decisions/49-jax012-overlap.md).

Expected bytes are restated from the sharding rule (tests/test_gpu.py's module docstring): a
leaf is split N ways on its largest dimension divisible by N, else replicated; bf16
gradients, each sharded leaf reduce-scattered once per step.
"""

from __future__ import annotations

import functools
import math

import jax
import optax
import pytest

import jaxzero as jz
from jaxzero import gpu
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape

N = 64
SHAPE = model_shape(
    layers=4, hidden=64, heads=2, vocab=128, seq=16, batch=1, arch="gpt", loop="python"
)


def split_bytes(params, n):
    """bf16 bytes per step of one block's sharded leaves and of the sharded leaves outside
    the blocks: what the step reduce-scatters (each once)."""
    block = rest = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not any(d % n == 0 for d in x.shape):
            continue
        size = 2 * math.prod(x.shape)
        if path[0].key == "block_0":
            block += size
        elif not path[0].key.startswith("block_"):
            rest += size
    return block, rest


@functools.cache
def compiled(flags):
    zero = jz.ZeRO(
        optax.adam(1e-3),
        gpu.compile_only_mesh("h100", N),
        stage=3,
        precision=jz.Precision.create("bf16", compute_copy=False),
        units=r"block_\d+",
    )
    step = jz.make_train_step(make_loss(SHAPE), zero)
    options = gpu.xla_options() if flags else None
    return gpu.compile_report(
        step, abstract_params(SHAPE), batch_shapes(SHAPE, N), compiler_options=options
    )


# slow: XLA's default flags (the recommended flags stay: the same claim)
@pytest.mark.parametrize(
    "flags",
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["recommended_flags", "default_flags"],
)
def test_gpu_units_hide_every_reduce_scatter_but_the_first_units_at_n64(flags):
    """4-block GPT, N = 64, units=: every reduce-scatter is hidden but block 0's (the chain's
    last backward: no unit's compute is left to run beside it): 1 - block / total of the
    reduce-scatter bytes, 0.76 here (0.52 with the gather free to start before the
    recompute). Over all-gathers and reduce-scatters together at least 0.8 (0.63 before)."""
    rep = compiled(flags)
    block, rest = split_bytes(abstract_params(SHAPE), N)
    total = SHAPE.layers * block + rest
    assert rep.payload("reduce-scatter") == total
    assert rep.hidden_share("reduce-scatter") == pytest.approx(1 - block / total)
    assert rep.hidden_share("all-gather", "reduce-scatter") >= 0.8
