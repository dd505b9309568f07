"""The streamed offload update (``jaxzero.zero.offload.stream``, decision 32): how an optax update is cut
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
from jaxzero.zero.offload import host_sharding, stream
from jaxzero.zero.offload import parts as stream_parts

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


# Gradients in host memory too (parameter offload): three large leaves that chunk along an
# unsplit dimension ((64, 256) and (40, 200) split on their rows, (4100,) replicated), one small.
HOST_GRAD_SHAPES = {"w": (64, 256), "m": (40, 200), "r": (4100,), "b": (16,)}


def _host_grads(seed):
    keys = jax.random.split(jax.random.key(seed), len(HOST_GRAD_SHAPES))
    shapes = HOST_GRAD_SHAPES.items()
    return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, shapes, strict=True)}


def _spec(x):
    return P("data") if x.ndim and x.shape[0] % 8 == 0 else P()


def _streamed(fn, args, *, device_outputs, alias, chunk=64, host=None):
    """``fn`` streamed under jit on 8 devices, each leaf of ``args`` in pinned host memory
    where ``host`` (one flag per flat leaf; default: every leaf) says, else on the devices:
    ``(the jitted function, its arguments)``."""
    mesh = jz.data_parallel_mesh(8)
    flat, tree = jax.tree.flatten(args)
    specs = [_spec(x) for x in flat]
    host = [True] * len(flat) if host is None else host
    where = lambda s, h: host_sharding(mesh, s) if h else NamedSharding(mesh, s)
    flat = [jax.device_put(x, where(s, h)) for x, s, h in zip(flat, specs, host, strict=True)]

    @jax.jit
    def run(*args):
        return stream.run(
            fn,
            args,
            mesh=mesh,
            specs=specs,
            host=host,
            device_outputs=device_outputs,
            alias=alias,
            chunk=chunk,
        )

    return run, tuple(jax.tree.unflatten(tree, flat))


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
    params, grads = _tree(1), _tree(2)
    state = tx.init(params)
    want = tx.update(grads, state, params)
    want = (optax.apply_updates(params, want[0]), want[1])

    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        new = optax.apply_updates(params, updates)
        return new, state, jax.tree.map(lambda x: x.astype(jnp.bfloat16), new)

    n_g, n_s = len(jax.tree.leaves(grads)), len(jax.tree.leaves(state))
    n = n_g + n_s + len(jax.tree.leaves(params))
    p0 = n_g + n_s  # the params' leaves follow the gradient's and the state's
    alias = {o: p0 + o for o in range(len(jax.tree.leaves(params)))}
    alias.update({len(alias) + o: n_g + o for o in range(n_s)})
    run, args = _streamed(
        update,
        (grads, state, params),
        device_outputs=len(jax.tree.leaves(params)),
        alias=alias,
        chunk=16,
        host=[False] * n_g + [True] * (n - n_g),
    )
    new, new_state, compute = run(*args)
    tol = {"rtol": 1e-6, "atol": 1e-7}
    chex.assert_trees_all_close(jax.tree.map(np.asarray, (new, new_state)), want, **tol)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((new, new_state))}
    assert kinds == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(compute)} == {"device"}


def _clip_adamw_with_host_grads():
    """``(update, its arguments, the streamed update, its arguments)``: clip_by_global_norm
    (active: the gradient's norm is about 170) and AdamW, with a finite check and the norm."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    params, grads = _host_grads(1), _host_grads(2)
    state = tx.init(params)

    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        return optax.apply_updates(params, updates), state, finite, optax.tree.norm(grads)

    n_g, n_s = len(jax.tree.leaves(grads)), len(jax.tree.leaves(state))
    alias = {o: n_g + n_s + o for o in range(n_g)}  # new params into params
    alias.update({n_g + o: n_g + o for o in range(n_s)})  # new state into state
    args = (grads, state, params)
    return (update, args, *_streamed(update, args, device_outputs=2, alias=alias))


def test_host_gradients_clip_adamw_streamed_equals_plain_optax():
    """Gradients, state and params in host memory, 64 elements a chunk (several loop
    iterations per leaf, in the prologue's norms and finite check and in every part): the same
    new params, state, finite check and norm as ``tx`` on one device."""
    update, args, run, host_args = _clip_adamw_with_host_grads()
    want = update(*args)
    assert want[3] > 1.0  # clipping is active
    got = run(*host_args)
    # one update, its norms summed in chunks: a few ulps, under tests/tolerance.py's 16-ulp floor
    chex.assert_trees_all_close(jax.tree.map(np.asarray, got), want, rtol=1e-6, atol=1e-7)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(got[:2])}
    assert kinds == {"pinned_host"}
    assert {x.sharding.memory_kind for x in got[2:]} == {"device"}


def _fetches(jaxpr):
    """The shapes of the values every ``device_put`` to device memory in ``jaxpr`` (and the
    jaxprs inside it) moves."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for v, d in zip(eqn.invars, eqn.params["devices"], strict=True):
                if d == jax.memory.Space.Device:
                    out.append(v.aval.shape)
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jax.extend.core.Jaxpr):
                    out += _fetches(sub)
    return out


def test_host_gradients_are_fetched_a_chunk_at_a_time_never_whole():
    """No ``device_put`` to the device in the streamed update moves a large gradient leaf whole
    (the prologue's norm and finite check reduce it chunk by chunk); chunks of it are moved."""
    _, args, run, host_args = _clip_adamw_with_host_grads()
    fetched = _fetches(jax.make_jaxpr(run)(*host_args).jaxpr)
    large = {g.shape for g in jax.tree.leaves(args[0]) if g.size > stream_parts.SMALL}
    assert len(large) == 3
    assert not large & set(fetched), fetched
    assert {(64, 8), (40, 10), (50,)} <= set(fetched)  # the chunks, 64 elements a device


def _reductions(grads):
    """Full reductions of each leaf's elementwise values, combined across leaves (so the
    prologue computes them): a max, a min, an and, an or, a product (of powers of two: exact in
    any order), an integer max, and a norm of the leaves scaled by their norm (a chain that
    reads a reduction before it)."""
    g = jax.tree.leaves(grads)
    each = lambda f: jnp.stack([f(x) for x in g])
    norm = optax.tree.norm(grads)
    return (
        jnp.max(each(lambda x: jnp.max(jnp.abs(x)))),
        jnp.min(each(jnp.min)),
        jnp.all(each(lambda x: jnp.all(jnp.abs(x) < 10))),
        jnp.all(each(lambda x: jnp.all(x < 3))),
        jnp.any(each(lambda x: jnp.any(x > 3.5))),
        jnp.any(each(lambda x: jnp.any(x > 100))),
        jnp.prod(each(lambda x: jnp.prod(jnp.where(x > 3, 2.0, jnp.where(x < -3, 0.5, 1.0))))),
        jnp.max(each(lambda x: jnp.max((x * 100).astype(jnp.int32)))),
        optax.tree.norm(jax.tree.map(lambda x: x / norm, grads)),
    )


def test_chunked_max_min_and_or_prod_combine_as_the_whole_reductions():
    """Every reduction of :func:`_reductions` over host gradients runs in chunks (no large leaf
    is fetched whole) and gives plain jnp's value, the boolean ones both ways."""
    grads = _host_grads(3)
    want = _reductions(grads)
    run, host_args = _streamed(_reductions, (grads,), device_outputs=len(want), alias={})
    fetched = _fetches(jax.make_jaxpr(run)(*host_args).jaxpr)
    assert not {(64, 256), (40, 200), (4100,)} & set(fetched), fetched
    got = jax.tree.map(np.asarray, run(*host_args))
    assert [bool(x) for x in got[2:6]] == [True, False, True, False]
    # reductions in chunks: a few ulps, under tests/tolerance.py's 16-ulp floor
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_host_value_another_equation_reads_whole_is_fetched_whole():
    """A transpose reads the (64, 256) leaf whole: that leaf is fetched whole and its max runs
    whole, the other leaves' maxes still run in chunks, and the numbers are plain jnp's."""

    def fn(grads):
        g = jax.tree.leaves(grads)
        top = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in g]))
        return top, jnp.sum(grads["w"].T[:3] * grads["b"][0])

    grads = _host_grads(4)
    run, host_args = _streamed(fn, (grads,), device_outputs=2, alias={})
    fetched = set(_fetches(jax.make_jaxpr(run)(*host_args).jaxpr))
    assert (64, 256) in fetched and not {(40, 200), (4100,)} & fetched
    # a max and one product sum: a few ulps, under tests/tolerance.py's 16-ulp floor
    chex.assert_trees_all_close(jax.tree.map(np.asarray, run(*host_args)), fn(grads), rtol=1e-6)
