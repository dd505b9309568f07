"""The streamed update left undone for the layer stacks and run later a layer at a time
(``stream.run(..., defer=)`` then ``stream.run_rows``): the first stage of running step t's
update of layer i inside step t + 1's forward.

Expected numbers come from ``stream.run`` in one go, itself checked against plain optax in
tests/test_stream.py, and the whole comparison is bit for bit: the deferred rows evaluate the
same elementwise equations on the same elements, with the prologue's values (the global norm,
the step count, the finite flag) computed once, at the step that owns them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.zero.offload import host_sharding, remainder, stream

L = 4  # layers in the stacks
SHAPES = {"layers": {"w": (L, 64, 128), "v": (L, 8192), "g": (L, 16)}, "e": (64, 256)}
TX = {
    "clip_adamw": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)),
    "adam": optax.adam(1e-2),
}


def _tree(seed):
    flat, tree = jax.tree.flatten(SHAPES, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    return jax.tree.unflatten(
        tree, [jax.random.normal(k, s) for k, s in zip(keys, flat, strict=True)]
    )


def _spec(x):
    """Stacks split on their second dimension (the layer axis whole, as ``layers=`` keeps
    it), the other leaves on their first."""
    if x.ndim == 3 or (x.ndim == 2 and x.shape[0] == L and x.shape[1] % 8 == 0):
        return P(None, "data")
    return P("data") if x.ndim and x.shape[0] % 8 == 0 else P()


def _in_layers(path) -> bool:
    return getattr(path[0], "key", None) == "layers" or any(
        getattr(k, "key", None) == "layers" for k in path
    )


def _problem(tx, grads):
    """``(update, args, flags)``: an update returning the new fp32 master, the optimizer state,
    the bf16 compute params, the finite flag and the gradient's norm; its arguments (the
    gradients on the device, the state and master in host memory); and per flat argument
    ``(spec, in host memory, deferred)``."""
    master = _tree(1)
    state = tx.init(master)

    def update(grads, state, master):
        updates, state = tx.update(grads, state, master)
        new = optax.apply_updates(master, updates)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)
        new, state_out = keep(new, master), keep(state, state)
        compute = jax.tree.map(lambda x: x.astype(jnp.bfloat16), new)
        return new, state_out, compute, finite, optax.tree.norm(grads)

    args = (grads, state, master)
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    n_g = len(jax.tree.leaves(grads))
    flags = [
        (_spec(x), i >= n_g, i >= n_g and _in_layers(path)) for i, (path, x) in enumerate(leaves)
    ]
    return update, args, flags


def _alias(args):
    n_g, n_s = len(jax.tree.leaves(args[0])), len(jax.tree.leaves(args[1]))
    n_m = len(jax.tree.leaves(args[2]))
    alias = {o: n_g + n_s + o for o in range(n_m)}  # the new master into the master
    alias.update({n_m + o: n_g + o for o in range(n_s)})  # the new state into the state
    return alias


def _placed(args, flags, mesh):
    flat, tree = jax.tree.flatten(args)
    where = lambda s, h: host_sharding(mesh, s) if h else NamedSharding(mesh, s)
    return jax.tree.unflatten(
        tree, [jax.device_put(x, where(s, h)) for x, (s, h, _) in zip(flat, flags, strict=True)]
    )


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _close(got, want, rtol=1e-6, atol=1e-7):
    """Within a few fp32 ulps (the elementwise update in another XLA fusion), under
    tests/tolerance.py's 16-ulp floor; bf16 values within one bf16 ulp."""
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        bf16 = g.dtype == jnp.bfloat16
        g, w = g.astype(np.float32), w.astype(np.float32)
        np.testing.assert_allclose(g, w, rtol=2.0**-8 if bf16 else rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(TX))
def test_deferred_rows_give_plain_optax_update(name):
    """On 8 simulated devices, 16 elements a chunk: ``run(defer=)`` updates what is outside
    the stacks (``e``, the small gains, the step count) and returns the stacks' large state
    leaves untouched; ``run_rows`` over the 4 layers, one layer per call, then gives the
    master, the state and the bf16 compute rows of plain optax on one device."""
    tx = TX[name]
    mesh = jz.data_parallel_mesh(8)
    update, args, flags = _problem(tx, jax.tree.map(lambda x: 3 * x, _tree(2)))
    want = update(*args)
    assert float(want[4]) > 1.0  # the clip is active (clip_adamw)
    n_s, n_m = len(_host(args[1])), len(_host(args[2]))
    kw = dict(
        mesh=mesh,
        specs=[s for s, _, _ in flags],
        host=[h for _, h, _ in flags],
        device_outputs=[False] * (n_m + n_s) + [True] * (n_m + 2),
        alias=_alias(args),
    )
    defer = [d for _, _, d in flags]
    placed = _placed(args, flags, mesh)
    first, pending = jax.jit(lambda *a: stream.run(update, a, defer=defer, chunk=16, **kw))(*placed)
    # outside the stacks, the small gains and the prologue's values: updated now
    _close(_host(first[3:]), _host(want[3:]))
    _close([first[0]["e"], first[0]["layers"]["g"]], [want[0]["e"], want[0]["layers"]["g"]])
    # the stacks' large leaves: untouched, their compute rows not given
    for k in ("w", "v"):
        np.testing.assert_array_equal(np.asarray(first[0]["layers"][k]), args[2]["layers"][k])
        assert first[2]["layers"][k] is None
        assert np.abs(np.asarray(want[0]["layers"][k]) - args[2]["layers"][k]).max() > 1e-3

    step_rows = jax.jit(
        lambda state, master, p, i: stream.run_rows(
            update, (placed[0], state, master), p, i, 1, defer=defer, **kw
        )
    )
    state, master, rows = first[1], first[0], []
    for i in range(L):
        (_, state, master), new = step_rows(state, master, pending, i)
        rows.append(new)
    _close(_host((master, state)), _host(want[:2]))
    assert {x.sharding.memory_kind for x in jax.tree.leaves((master, state))} == {"pinned_host"}
    # the bf16 rows of each stacked leaf, layer by layer: the new compute params
    compute0 = n_m + n_s  # the flat output index of the first compute leaf
    flat_want = jax.tree.leaves(want[2])
    assert len(rows[0]) == 2
    for o in rows[0]:
        got = np.concatenate([np.asarray(r[o]) for r in rows])
        _close([got], [flat_want[o - compute0]])


def test_deferred_rows_keep_a_remainder_master():
    """The fp32 master of the (4, 64, 128) stack kept as its bf16 compute copy and a 16-bit
    remainder: the deferred rows join each layer's master from the compute rows ``pending``
    carries, and write back only the remainder; joined with the new bf16 rows it is plain
    optax's new master, and the state is plain optax's."""
    tx = optax.adam(1e-2)
    mesh = jz.data_parallel_mesh(8)
    master = _tree(1)
    state = tx.init(master)
    grads = _tree(2)

    def update(grads, state, master, compute):
        del compute  # read through the stored master
        updates, state = tx.update(grads, state, master)
        new = optax.apply_updates(master, updates)
        return new, state, jax.tree.map(lambda x: x.astype(jnp.bfloat16), new)

    compute = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
    big = lambda x: x.ndim == 3  # the (4, 64, 128) stack: a remainder along its last axis
    stored_master = remainder.store(
        master, jax.tree.map(lambda m, c: c if big(m) else None, master, compute)
    )
    args = (grads, state, stored_master, compute)
    leaf = remainder.is_stored
    paths = jax.tree_util.tree_flatten_with_path(args, is_leaf=leaf)[0]
    counts = [len(jax.tree.leaves(a, is_leaf=leaf)) for a in args]
    n_g, n_s, n_m, _ = counts
    flat, tree = jax.tree.flatten(args, is_leaf=leaf)
    specs = [_spec(x.lo if leaf(x) else x) for x in flat]
    host = [n_g <= i < n_g + n_s + n_m for i in range(len(flat))]
    defer = [h and _in_layers(p) for h, (p, _) in zip(host, paths, strict=True)]
    stored = {
        n_g + n_s + j: n_g + n_s + n_m + j for j, x in enumerate(flat[n_g + n_s :][:n_m]) if leaf(x)
    }
    assert len(stored) == 1
    alias = {o: n_g + n_s + o for o in range(n_m)}
    alias.update({n_m + o: n_g + o for o in range(n_s)})
    kw = dict(
        mesh=mesh,
        specs=specs,
        host=host,
        device_outputs=[False] * (n_m + n_s) + [True] * n_m,
        alias=alias,
        chunk=16,
        stored=stored,
    )

    def placed():
        def put(x, s, h):
            where = host_sharding(mesh, s) if h else NamedSharding(mesh, s)
            if leaf(x):
                return jax.tree.map(lambda y: jax.device_put(y, where), x)
            return jax.device_put(x, where)

        return jax.tree.unflatten(tree, [put(*a) for a in zip(flat, specs, host, strict=True)])

    want = update(grads, state, master, compute)
    rows_kw = {k: v for k, v in kw.items() if k != "chunk"}
    first, pending = jax.jit(lambda *a: stream.run(update, a, defer=defer, **kw))(*placed())
    start = placed()
    step_rows = jax.jit(
        lambda state, master, p, i: stream.run_rows(
            update, (start[0], state, master, start[3]), p, i, 1, defer=defer, **rows_kw
        )
    )
    state, master, rows = first[1], first[0], []
    for i in range(L):
        (_, state, master, _), new = step_rows(state, master, pending, i)
        rows.append(new)
    rem = master["layers"]["w"]
    assert leaf(rem) and {x.sharding.memory_kind for x in jax.tree.leaves(rem)} == {"pinned_host"}
    w = (
        n_m
        + n_s
        + [k for k, _ in paths[n_g + n_s :][:n_m]].index(
            next(k for k, x in paths[n_g + n_s :][:n_m] if leaf(x))
        )
    )
    compute_w = jnp.concatenate([r[w] for r in rows])
    _close([remainder.join(compute_w, jax.device_get(rem), axis=-1)], [want[0]["layers"]["w"]])
    _close(_host(state), _host(want[1]))


def test_deferred_rows_run_on_the_shards_inside_shard_map():
    """``run_rows(local=True)`` inside a ``shard_map`` over the 8 devices (as the forward's
    layer loop will call it): each device updates its shards' rows of the host state in
    place, and the result, gathered, is plain optax's."""
    tx = TX["clip_adamw"]
    mesh = jz.data_parallel_mesh(8)
    update, args, flags = _problem(tx, jax.tree.map(lambda x: 3 * x, _tree(2)))
    want = update(*args)
    n_s, n_m = len(_host(args[1])), len(_host(args[2]))
    specs = [s for s, _, _ in flags]
    kw = dict(
        mesh=mesh,
        specs=specs,
        host=[h for _, h, _ in flags],
        device_outputs=[False] * (n_m + n_s) + [True] * (n_m + 2),
        alias=_alias(args),
    )
    defer = [d for _, _, d in flags]
    placed = _placed(args, flags, mesh)
    first, pending = jax.jit(lambda *a: stream.run(update, a, defer=defer, chunk=16, **kw))(*placed)
    tree = jax.tree.structure(args)
    spec_tree = jax.tree.unflatten(tree, specs)
    pending_specs = tuple(x.sharding.spec for x in pending)

    def layers(flat_args, pending):
        def body(i, a):
            new_args, rows = stream.run_rows(
                update, a, pending, i, 1, defer=defer, local=True, **kw
            )
            return new_args

        return jax.lax.fori_loop(0, L, body, flat_args)

    sm = jax.shard_map(layers, mesh=mesh, in_specs=(spec_tree, pending_specs), out_specs=spec_tree)
    _, state, master = jax.jit(sm)((placed[0], first[1], first[0]), pending)
    _close(_host((master, state)), _host(want[:2]))
    assert {x.sharding.memory_kind for x in jax.tree.leaves((master, state))} == {"pinned_host"}
