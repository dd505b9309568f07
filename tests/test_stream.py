"""The streamed offload update (``jaxzero.zero.stream``, decision 32): how an optax update is cut
into parts, and that the chunked, streamed evaluation gives plain optax's numbers.

The parts are restated from what each chain computes: Adam updates each leaf from that leaf
alone (one elementwise part per large leaf, its step count in the prologue);
``clip_by_global_norm`` adds one norm over every leaf (the prologue), which each leaf's part
reads; Adafactor's factored moments reduce over rows and columns (not elementwise).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.zero import stream, stream_parts
from jaxzero.zero.offload import host_sharding

SHAPES = {"w": (64, 256), "v": (8192,), "b": (16,)}  # two large leaves, one small


def _tree(seed, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {
        k: jax.random.normal(key, s, dtype)
        for key, (k, s) in zip(keys, SHAPES.items(), strict=True)
    }


def _plan(tx):
    params = _tree(0)
    state = tx.init(params)

    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, state, params))
    closed, _ = stream_parts.flat_jaxpr(update, avals)
    return stream_parts.plan(closed)


def _big_output_shapes(part):
    return {v.aval.shape for v in part.outputs}


def test_adam_is_one_elementwise_part_per_large_leaf():
    plan = _plan(optax.adam(1e-3))
    assert len(plan.parts) == 2
    assert all(p.elementwise for p in plan.parts)
    shapes = sorted(tuple(sorted(_big_output_shapes(p))) for p in plan.parts)
    assert shapes == [((64, 256),), ((8192,),)]
    # the small leaf's new values and the new count come from the prologue
    assert {v.aval.shape for v in plan.prologue.outputs} >= {(16,), ()}


def test_a_global_norm_is_computed_once_and_read_by_every_part():
    plan = _plan(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    assert len(plan.parts) == 2 and all(p.elementwise for p in plan.parts)
    names = {plan.jaxpr.jaxpr.eqns[i].primitive.name for i in plan.prologue.eqns}
    assert "reduce_sum" in names and "sqrt" in names
    shared = set(plan.prologue.outputs)
    assert all(shared & set(p.inputs) for p in plan.parts)  # each part reads the scale


def test_factored_moments_are_not_elementwise():
    kw = {"min_dim_size_to_factor": 64, "multiply_by_parameter_scale": False}
    plan = _plan(optax.adafactor(1e-3, clipping_threshold=None, **kw))
    by_shape = {s: p.elementwise for p in plan.parts for s in _big_output_shapes(p)}
    assert by_shape[(64, 256)] is False  # row and column statistics (its part's outputs)
    assert by_shape[(64,)] is False and by_shape[(256,)] is False
    assert by_shape[(8192,)] is True  # a vector is not factored
    # the update's RMS clipping reduces over each leaf: no part is elementwise then
    plan = _plan(optax.adafactor(1e-3, **kw))
    assert not any(p.elementwise for p in plan.parts) and len(plan.parts) == 2


@pytest.mark.parametrize(
    "rows,row_elements,chunk,want",
    [(32, 100, 1000, 8), (32, 100, 50, 1), (12, 1, 5, 4), (7, 3, 100, 7), (7, 3, 20, 1)],
)
def test_rows_per_chunk_is_the_largest_divisor_that_fits(rows, row_elements, chunk, want):
    assert stream.rows_per_chunk(rows, row_elements, chunk) == want


def test_chunk_dim_skips_split_and_single_dimensions():
    assert stream.chunk_dim(P("data"), (64, 256)) == 1
    assert stream.chunk_dim(P(None, "data"), (1, 64, 8)) == 2
    assert stream.chunk_dim(P("data"), (64,)) is None


@pytest.mark.parametrize(
    "tx",
    [
        pytest.param(optax.adamw(1e-2, weight_decay=0.1), id="adamw"),
        pytest.param(optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)), id="clip_adam"),
        pytest.param(optax.adafactor(1e-2, min_dim_size_to_factor=64), id="adafactor"),
    ],
)
def test_streamed_update_in_many_chunks_equals_plain_optax(tx):
    """On 8 simulated devices, the state in pinned host memory, 16 elements a chunk (the
    (64, 256) leaf split over devices on its rows runs 128 loop iterations): the same new
    params and state as ``tx`` on one device, each output in the memory the caller asked."""
    mesh = jz.data_parallel_mesh(8)
    params, grads = _tree(1), _tree(2)
    state = tx.init(params)
    want = tx.update(grads, state, params)
    want = (optax.apply_updates(params, want[0]), want[1])

    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        new = optax.apply_updates(params, updates)
        return new, state, jax.tree.map(lambda x: x.astype(jnp.bfloat16), new)

    spec = lambda x: P("data") if x.ndim and x.shape[0] % 8 == 0 else P()
    host = lambda t: jax.tree.map(lambda x: jax.device_put(x, host_sharding(mesh, spec(x))), t)
    dev = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), t)
    args = (dev(grads), host(state), host(params))
    flat = jax.tree.leaves(args)
    specs = [spec(x) for x in flat]
    n_g, n_s = len(jax.tree.leaves(grads)), len(jax.tree.leaves(state))
    in_host = [False] * n_g + [True] * (len(flat) - n_g)
    p0 = n_g + n_s  # the params' leaves follow the gradient's and the state's
    alias = {o: p0 + o for o in range(len(jax.tree.leaves(params)))}
    alias.update({len(alias) + o: n_g + o for o in range(n_s)})

    @jax.jit
    def run(*args):
        return stream.run(
            update,
            args,
            mesh=mesh,
            specs=specs,
            host=in_host,
            device_outputs=len(jax.tree.leaves(params)),
            alias=alias,
            chunk=16,
        )

    new, new_state, compute = run(*args)
    tol = {"rtol": 1e-6, "atol": 1e-7}
    chex.assert_trees_all_close(jax.tree.map(np.asarray, (new, new_state)), want, **tol)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((new, new_state))}
    assert kinds == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(compute)} == {"device"}
