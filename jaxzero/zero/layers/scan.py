"""``scan_layers``: run a stack of layers, one layer's weights whole at a time, the next
layer's all-gather in flight while this one computes (FSDP2's prefetch).

    block = Block(cfg, parent=None)                          # a detached flax module
    stack = jaxzero.stacked_params(self, "layers", block, n_layers, x)
    x = jaxzero.scan_layers(lambda w, h: block.apply({"params": w}, h), stack, x)

``fn(layer_params, carry) -> carry`` is one layer; ``stack`` holds every layer's params on a
leading layer axis (what ``nn.scan(variable_axes={"params": 0})`` builds, so the params tree is
the same: ``params["layers"]``). Each layer is rematerialised (its inputs are kept, its inside
is recomputed in the backward), as ``nn.remat`` inside ``nn.scan`` does.

Outside a per-layer ZeRO step it is that scan (``jax.lax.scan`` of ``jax.checkpoint``). Inside
a stage-2 step with ``layers=`` it is the same scan with :func:`jaxzero.gather_layer` applied to
each layer (the backward reduce-scatters each layer's gradient in the loop). Inside a
per-layer stage-3 step it is a double-buffered loop written out by hand (``jax.custom_vjp``):

* forward: layer 0 is gathered before the loop; iteration ``i`` starts the all-gather of layer
  ``i + 1`` and runs layer ``i`` on the weights the previous iteration gathered, so the
  gather's only consumer is the next iteration and XLA's scheduler runs it under layer ``i``'s
  gemms. The last layer runs after the loop (no gather of a layer that does not exist).
* backward: the mirror image, a reverse scan: the last layer is gathered again once the
  cotangent exists; iteration ``i`` recomputes layer ``i``, then starts the all-gather of
  layer ``i - 1`` while it takes layer ``i``'s vjp, and reduce-scatters layer ``i``'s
  gradient, which XLA's collective pipeliner (on by default) moves into the next iteration,
  where it runs under the recompute. XLA:GPU keeps one collective in flight at a time: with
  the gather free to start at the top, jax 0.12's scheduler (and jax 0.10's at N = 64 on
  small layers) gave it every gemm and left the reduce-scatter exposed, so the gather waits
  for the recompute's output (a data dependency: decision 49). The backward's gathers also
  wait for the cotangent (an optimization barrier), else XLA hoists them to the step's
  start, where they are exposed and held through the forward.

Exposed by construction: layer 0's forward gather, the last layer's backward gather and layer
0's reduce-scatter (nothing of the stack computes next to them). Bytes: every layer gathered
once forward and once backward, plus one more gather of layer 0 at the backward's last
iteration (a loop of the same body throughout: the scheduler's pipelining needs it; a 1/L
share more all-gather bytes than :func:`gather_layer`'s loop). Memory: one more layer of
gathered weights (the one in flight), and in the backward one layer's unreduced gradient
while the next layer's recompute runs (LLaMA-7B at N = 64: 0.10-0.24 GB, a layer is 0.40 GB).
Keeping the last layer's forward weights for its backward
(FSDP's way) would save a gather but measured 2.2 layers more memory (decision 20 in
BUILD_NOTES).

``fn`` may close over arrays (positions, masks, tied weights): they are hoisted with
``jax.closure_convert`` and their gradients summed over the layers. Per-layer inputs that are
not differentiated (dropout keys, layer indices) go in ``xs``: ``fn(w, carry, xs[i])``.
Per-layer outputs (``with_ys=True``: ``fn`` returns ``(carry, y)``) come back stacked, as
``jax.lax.scan``'s ``ys``; their cotangents enter each layer's backward with the carry's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.mesh import in_host_memory, to_varying, varying_axes
from jaxzero.zero.collectives import gather_after_recompute
from jaxzero.zero.layers.backward import (
    accumulated,
    at,
    deferred,
    in_place,
    put,
    reduce_tree,
    zeros,
)
from jaxzero.zero.layers.plan import LayerPlan, current_plan, gather_layer, gather_shard

__all__ = ["scan_layers", "stacked_init", "stacked_params"]


def stacked_init(module, length: int, collection: str = "params"):
    """An init function for ``self.param(name, stacked_init(module, length), *args)``: the
    ``collection`` variables of ``length`` independently initialised copies of the (detached)
    flax ``module``, stacked on a leading layer axis."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length={length!r} must be a positive int (the number of layers).")

    def init(rng, *args, **kwargs):
        one = lambda key: module.init(key, *args, **kwargs)[collection]
        return jax.vmap(one)(jax.random.split(rng, length))

    return init


def stacked_params(module, name: str, block, length: int, *args, **kwargs):
    """A flax linen ``module``'s stack of ``length`` ``block`` layers under ``params[name]``:
    created with :func:`stacked_init` by ``init``, read as it is otherwise. (``self.param``
    would check the stored shapes against the init's, which a per-layer stage-3 step's
    shards do not match.)"""
    return stored_param(module, name, stacked_init(block, length), *args, **kwargs)


def stored_param(module, name: str, init, *args, **kwargs):
    """``module.param(name, init, *args)`` when ``init`` runs; the stored value as it is
    otherwise, without flax's check of its shape against ``init``'s (a stage-3 step hands the
    loss shards)."""
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, init, *args, **kwargs)


def _layers_of(tree, what: str = "a stack") -> int:
    """The layer count of ``tree``: its leaves' common axis-0 length."""
    leaves = jax.tree.leaves(tree)
    if not leaves or any(jnp.ndim(x) == 0 for x in leaves):
        raise ValueError(
            f"scan_layers needs {what}: a tree of arrays with the layer index on axis 0 "
            f"(got {jax.tree.map(jnp.shape, tree)})."
        )
    sizes = {x.shape[0] for x in leaves}
    if len(sizes) != 1:
        raise ValueError(f"scan_layers: {what}'s leaves disagree on the layer count: {sizes}.")
    return sizes.pop()


def _check_xs(xs, length: int) -> None:
    if _layers_of(xs, "xs") != length:
        raise ValueError(
            f"scan_layers xs must be arrays with the layer index on axis 0 ({length} layers), "
            f"got {jax.tree.map(jnp.shape, xs)}."
        )
    floats = [x.dtype for x in jax.tree.leaves(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if floats:
        raise TypeError(
            f"scan_layers xs are not differentiated, so they must be integer or key arrays "
            f"(rng keys, layer indices, masks); got {floats[0]}. Close fn over a float array "
            f"instead (its gradient is summed over the layers)."
        )


def scan_layers(fn: Callable, stack, carry, xs=None, *, with_ys: bool = False):
    """``carry`` after ``fn(layer_i_params, carry)`` for each layer of ``stack`` in order (see
    the module docstring). With ``xs`` (integer or key arrays with the layer index on axis 0,
    not differentiated: e.g. ``jax.random.split(key, n_layers)`` for dropout),
    ``fn(layer_i_params, carry, xs_i)``. With ``with_ys=True``, ``fn`` returns
    ``(carry, y)`` as ``jax.lax.scan``'s body does, and ``scan_layers`` returns
    ``(carry, ys)``: every layer's ``y`` stacked on a leading layer axis (per-layer auxiliary
    losses, intermediate activations), differentiable like the carry."""
    length = _layers_of(stack)
    if not isinstance(with_ys, bool):
        raise TypeError(f"with_ys={with_ys!r} must be True or False.")
    user = fn if xs is not None else (lambda w, c, x: fn(w, c))
    if xs is None:
        xs = jnp.arange(length)
    else:
        _check_xs(xs, length)
    if with_ys:
        layer_fn = lambda w, c, x: _pair(user(w, c, x))
    else:
        layer_fn = lambda w, c, x: (user(w, c, x), ())
    plan = current_plan()
    if plan is None or not plan.gather:
        body = lambda c, wx: layer_fn(gather_layer(wx[0]), c, wx[1])
        out, ys = jax.lax.scan(jax.checkpoint(body, prevent_cse=False), carry, (stack, xs))
        return (out, ys) if with_ys else out
    plan.calls += 1
    plan.scans += 1
    leaves, treedef = jax.tree.flatten(stack)
    dims = [plan.lookup(p, x[0]) for p, x in jax.tree_util.tree_flatten_with_path(stack)[0]]

    def gather(ls, i, after=None, kept=None, tok=None):
        """Layer ``i`` whole, from its shards ``ls`` or (the backward, hpZ) from the slices
        the forward ``kept`` (:meth:`~jaxzero.zero.wire.Wire.keep`); not before ``after``
        exists (an optimization barrier: else XLA hoists the backward's gathers to the start
        of the step, where they are exposed and held through the forward) nor before ``tok``
        (:func:`_after`: a data dependency, which the GPU scheduler keeps)."""
        # Cast (and wait for tok) before the barrier: the slice, the cast and the
        # subtraction are then one kernel (with the params in host memory, the slice is
        # fetched to the device first).
        shards = [plan.placement.fetch(x).astype(plan.comm.param_dtype) for x in at(ls, i)]
        parts = [None] * len(shards) if kept is None else kept(i)
        src = [x if p is None else p for x, p in zip(shards, parts, strict=True)]
        if tok is not None:
            src = [_after(x, tok) for x in src]
        if after is not None:
            src, _ = jax.lax.optimization_barrier((src, after))
        return treedef.unflatten(
            [
                gather_shard(plan.comm, x, d, kept=p is not None)
                for x, p, d in zip(src, parts, dims, strict=True)
            ]
        )

    closed, consts = jax.closure_convert(layer_fn, gather(leaves, 0), carry, at(xs, 0))
    accs = plan.sums.of(leaves)  # None, or each leaf's host gradient sum (None: the first)
    # the update the last step left pending, a layer at a time beside the forward (or None)
    owners = None if plan.rows is None else plan.rows.owners(leaves)
    run = _prefetching(plan, closed, gather, dims, length, owners)
    if owners is None:
        out, ys = run(leaves, carry, xs, consts, accs)
    else:
        rows = plan.rows
        (out, ys), (stacks, held) = run(leaves, carry, xs, consts, accs, rows.held, rows.pending)
        rows.record(stacks, held, owners)
    return (out, ys) if with_ys else out


def _pair(result):
    """``fn``'s ``(carry, y)`` under ``with_ys=True``, or a TypeError saying so."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"scan_layers(..., with_ys=True) needs fn to return (carry, y), as a jax.lax.scan "
            f"body does; it returned {type(result).__name__}."
        )
    return result


def _prefetching(plan: LayerPlan, fn, gather, dims, length, owners=None):
    """The custom-vjp double-buffered loop over ``length`` layers of
    ``fn(w, carry, x, *consts)``. With ``owners`` (the flat params index of each stack leaf
    whose rows the last step's update left pending, :class:`~jaxzero.zero.layers.rows.LayerRows`)
    the forward runs layer ``i + 1``'s rows beside layer ``i``'s compute before its gather,
    takes the host state and what the update left as two more arguments, returns the new
    stacks and host state beside its output, and the backward gathers from the new stacks;
    delayed (:attr:`LayerRows.delayed <jaxzero.zero.layers.rows.LayerRows.delayed>`), every
    gather, forward and backward, reads the stacks as they came in, so none waits for a row."""
    comm, saved = plan.comm, plan.activations

    def keep(w):  # hpZ: each leaf's within-node slice, for the backward's gather (or None)
        flat = jax.tree.leaves(w)
        return [comm.wire.keep(x, comm.axis, d) for x, d in zip(flat, dims, strict=True)]

    def forward(leaves, carry, xs, consts, accs):
        def body(state, i):
            c, w, kept = state
            nxt = gather(leaves, i + 1, c)  # in flight while layer i computes
            out, y = fn(w, c, at(xs, i), *consts)
            return (out, nxt, put(kept, keep(w), i)), (saved.store(c), y)

        w = gather(leaves, 0)
        first = (carry, w, _buffer(keep(w), length))
        (c, w, kept), (inputs, ys) = jax.lax.scan(body, first, jnp.arange(length - 1))
        out, y = fn(w, c, at(xs, length - 1), *consts)
        ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys, y)
        kept = put(kept, keep(w), length - 1)
        return (out, ys), (leaves, kept, inputs, c, xs, consts, accs)

    def forward_rows(leaves, carry, xs, consts, accs, held, pending):
        rows = plan.rows
        if rows.stacks == 1:
            return forward_one_stack(leaves, carry, xs, consts, accs, held, pending)
        if rows.delayed:
            return forward_delayed(leaves, carry, xs, consts, accs, held, pending)

        def half(state, i, odd, fetch):
            # layer i + 2's state rows fetched (under layer i's compute, for the next half),
            # layer i + 1's update from the rows the half before fetched, then its gather
            # (odd: whether i is, known while tracing: which packed buffers hold the rows)
            c, w, kept, ls, hs, ahead = state
            nxt_ahead = rows.fetch(hs, i + 2, int(odd)) if fetch else None
            ls, hs = rows.at(i + 1, ls, hs, pending, owners, int(not odd), ahead)
            nxt = gather(ls, i + 1, c)  # in flight while layer i computes
            out, y = fn(w, c, at(xs, i), *consts)
            return (out, nxt, put(kept, keep(w), i), ls, hs, nxt_ahead), (saved.store(c), y)

        def body(state, j):
            # layers 2j and 2j + 1, the even and the odd layers' rows from their own packed
            # buffers, an optimization barrier between them (else the second half's transfers
            # are scheduled at the top, beside nothing: decision 44)
            state, a = half(state, 2 * j, False, True)
            state, b = half(_barrier(state), 2 * j + 1, True, True)
            return state, jax.tree.map(lambda *x: jnp.stack(x), a, b)

        leaves, held = rows.at(0, leaves, held, pending, owners)
        ahead = rows.fetch(held, 1, 1)
        w = gather(leaves, 0)
        state = (carry, w, _buffer(keep(w), length), leaves, held, ahead)
        trips = max(0, (length - 2) // 2)  # the loop's last fetch is layer 2 * trips + 1's
        state, outs = jax.lax.scan(body, state, jnp.arange(trips))
        outs = jax.tree.map(lambda a: a.reshape((2 * trips, *a.shape[2:])), outs)
        for i in range(2 * trips, length - 1):  # the halves the loop leaves
            state, o = half(state, i, i % 2 == 1, i + 2 < length)
            outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), outs, o)
        (c, w, kept, leaves, held, _), (inputs, ys) = state, outs
        return last(c, w, kept, inputs, ys, xs, consts, accs, leaves, held)

    def forward_delayed(leaves, carry, xs, consts, accs, held, pending):
        """The rows delayed (every gather reads the stacks as they came in, so none waits
        for a row): layer ``i``'s state rows fetched under layer ``i``'s compute and applied
        under layer ``i + 1``'s; the last layer's fetched under layer 0's (the one half with
        a single copy: XLA:GPU runs two host copies beside compute at a time), applied with
        layer ``L - 3``'s under layer ``L - 2``'s and written back with them in one copy
        (from 3 layers; with 2, both under the last layer's), and layer ``L - 2``'s
        write-back in flight from the last layer through the backward. Only the leaves
        outside the stacks are left beside nothing (two stacks of packed rows, ``length >=
        2``); the last layer's rows stay on the device until layer ``L - 2``'s half, and
        layer ``L - 2``'s new rows until their write-back is done."""
        rows = plan.rows
        final = length - 1

        def half(state, i, odd, first=False, tail=None):
            # layer i's rows fetched (for the next half), layer i - 1's applied from the rows
            # the half before fetched (with ``tail``, the last layer's from theirs: the same
            # parity, consecutive rows, one write-back)
            c, w, kept, ls, hs, ahead = state
            nxt_ahead = rows.fetch(hs, i, int(odd))
            if tail is not None:
                pair, fetched = [i - 1, final], [ahead, tail]
                ls, hs = rows.at_together(pair, ls, hs, pending, owners, int(not odd), fetched)
            elif not first:
                ls, hs = rows.at(i - 1, ls, hs, pending, owners, int(not odd), ahead)
            nxt = gather(leaves, i + 1, c)  # in flight while layer i computes
            out, y = fn(w, c, at(xs, i), *consts)
            return (out, nxt, put(kept, keep(w), i), ls, hs, nxt_ahead), (saved.store(c), y)

        def body(state, j):  # layers 2j + 1 and 2j + 2, a barrier between (as forward_rows)
            state, a = half(state, 2 * j + 1, True)
            state, b = half(_barrier(state), 2 * j + 2, False)
            return state, jax.tree.map(lambda *x: jnp.stack(x), a, b)

        w = gather(leaves, 0)
        state = (carry, w, _buffer(keep(w), length), leaves, held, None)
        state, outs = half(state, 0, False, first=True)
        # the last layer's rows, fetched beside layer 0's (done by the barrier after it)
        state, tail = _barrier((state, rows.fetch(held, final, final % 2)))
        outs = jax.tree.map(lambda a: a[None], outs)
        # from 3 layers, the last layer's rows are applied with layer L - 3's (the same
        # parity) in layer L - 2's half and written back with them in one copy: the last
        # layer's half then has one write-back, beside which the update's small copies
        # leave a host-copy slot (two write-backs there: one was exposed at 24 layers)
        together = length >= 3
        stop = final - 1 if together else final  # the halves 1 .. stop - 1 apply one row
        trips = max(0, (stop - 1) // 2)  # the halves 1 .. 2 * trips, then those left
        if trips:
            state, more = jax.lax.scan(body, state, jnp.arange(trips))
            more = jax.tree.map(lambda a: a.reshape((2 * trips, *a.shape[2:])), more)
            outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs, more)
        for i in range(2 * trips + 1, final):
            odd = i % 2 == 1
            state, o = half(_barrier(state), i, odd, tail=tail if i == stop else None)
            outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), outs, o)
        # a barrier before the last layer (without it XLA left the last rows to the end of
        # the step, start beside done), and one after it that holds its output and the new
        # stacks but not the host state: the write-backs start beside the last layer and
        # are done after the backward (a barrier holding the host state too kept them beside
        # the last layer's compute, whose two host-copy slots the update's small copies
        # took; none at all let XLA write the new stacks later, a higher peak)
        (c, w, kept, ls, hs, prev), (inputs, ys) = _barrier(state), outs
        ls, hs = rows.at(final - 1, ls, hs, pending, owners, (final - 1) % 2, prev)
        if not together:
            ls, hs = rows.at(final, ls, hs, pending, owners, final % 2, tail)
        (out, (ls, hs)), res = last(c, w, kept, inputs, ys, xs, consts, accs, ls, hs, leaves)
        out, ls = _barrier((out, ls))
        return (out, (ls, hs)), res

    def forward_one_stack(leaves, carry, xs, consts, accs, held, pending):
        """The rows of the layers one after another (unpacked, or one stack)."""
        rows = plan.rows
        old = leaves if rows.delayed else None
        src = lambda ls: ls if old is None else old

        def body(state, i):
            c, w, kept, ls, hs = state
            ls, hs = rows.at(i + 1, ls, hs, pending, owners)  # layer i + 1's, then its gather
            nxt = gather(src(ls), i + 1, c)  # in flight while layer i computes
            out, y = fn(w, c, at(xs, i), *consts)
            return (out, nxt, put(kept, keep(w), i), ls, hs), (saved.store(c), y)

        leaves, held = rows.at(0, leaves, held, pending, owners)
        w = gather(src(leaves), 0)
        first = (carry, w, _buffer(keep(w), length), leaves, held)
        (c, w, kept, leaves, held), (inputs, ys) = jax.lax.scan(body, first, jnp.arange(length - 1))
        return last(c, w, kept, inputs, ys, xs, consts, accs, leaves, held, old)

    def last(c, w, kept, inputs, ys, xs, consts, accs, leaves, held, old=None):
        """The last layer after a forward loop that ran the rows, and the forward's result
        (``old``: the stacks the gathers read, delayed; the backward gathers from them)."""
        out, y = fn(w, c, at(xs, length - 1), *consts)
        ys = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys, y)
        kept = put(kept, keep(w), length - 1)
        read = leaves if old is None else old
        return ((out, ys), (leaves, held)), (read, kept, inputs, c, xs, consts, accs)

    def backward(res, cts):
        leaves, kept, inputs, c_last, xs, consts, accs = res
        stack, kept = kept, None  # hpZ: the gathers below read the slices the forward kept
        if any(k is not None for k in stack):
            kept = lambda i: at(stack, i)
        if owners is not None:  # the new stacks and host state are not differentiated
            cts = cts[0]
        ct, ct_ys = cts

        def layer(state, i, src=leaves, split=False):
            """Layer ``i``'s backward, layer ``i - 1``'s gather (from the stacks ``src``) and
            input fetch in flight: the next state, and layer ``i``'s weight gradient
            (unreduced leaves). With ``split``, the gather waits for layer ``i``'s recompute
            (its output's first element): the recompute is left to the reduce-scatter XLA's
            pipeliner moves into this iteration, the backward's gemms to the gather."""
            ct, w, c, dconsts = state
            prev = jnp.maximum(i - 1, 0)
            x = at(xs, i)
            if split:
                out, pull = jax.vjp(lambda w, c, *k: fn(w, c, x, *k), w, c, *consts)
                nxt = gather(src, prev, (ct, w), kept, _token(out))
            else:
                nxt = gather(src, prev, (ct, w), kept)  # in flight under layer i
            c_prev = _layer_input(saved, inputs, c_last, prev, length)  # fetched under layer i
            if not split:
                _, pull = jax.vjp(lambda w, c, *k: fn(w, c, x, *k), w, c, *consts)
            dw, dc, *dk = pull((ct, at(ct_ys, i)))
            dconsts = [a + b for a, b in zip(dconsts, dk, strict=True)]
            return (dc, nxt, c_prev, dconsts), jax.tree.leaves(dw)

        dk = [zeros(k) for k in consts]
        c = _layer_input(saved, inputs, c_last, length - 1, length)
        state = (ct, gather(leaves, length - 1, ct, kept), c, dk)
        if comm.wire.defers_reduce:
            (ct, _, _, dk), grads = deferred(comm, layer, state, leaves, dims, length)
        elif accs is not None:  # params offloaded, micro-batches: decision 42
            (ct, _, _, dk), grads = accumulated(comm, layer, state, leaves, accs, dims, length)
        elif plan.placement.params_on_host:
            (ct, _, _, dk), grads = in_place(comm, layer, state, leaves, dims, length)
        else:
            split = gather_after_recompute(comm)

            def body(state, i):  # XLA's pipeliner moves layer i's reduce-scatter under i - 1
                state, dw = layer(state, i, split=split)
                return state, reduce_tree(comm, dw, dims, leaves)

            steps = jnp.arange(length)
            (ct, _, _, dk), grads = jax.lax.scan(body, state, steps, reverse=True)
        no_grad = jax.tree.map(lambda x: np.zeros(np.shape(x), jax.dtypes.float0), xs)
        if owners is not None:  # nor are the host state and what the update left
            return grads, ct, no_grad, dk, None, None, None
        return grads, ct, no_grad, dk, None  # the accumulators are not differentiated

    fwd = forward if owners is None else forward_rows
    run = jax.custom_vjp(lambda *args: fwd(*args)[0])
    run.defvjp(fwd, backward)
    return run


def _barrier(tree):
    """``jax.lax.optimization_barrier`` of ``tree``'s leaves, one barrier per set of mesh axes
    they vary over: a barrier's outputs vary over every axis any of its operands does, and a
    loop's carry must keep each leaf's (on one device, the stacks are invariant and the
    activations vary). Each barrier also takes a scalar that exists once every leaf does
    (summed over the axes: no bytes on one device), so no leaf's consumer moves above another
    group's producers."""
    flat, tree_def = jax.tree.flatten(tree)
    groups: dict = {}
    for k, x in enumerate(flat):
        groups.setdefault(varying_axes(x), []).append(k)
    if len(groups) == 1:
        return tree_def.unflatten(jax.lax.optimization_barrier(flat))
    firsts = [
        jnp.ravel(x)[:1].astype(jnp.float32) for x in flat if jnp.size(x) and not in_host_memory(x)
    ]
    axes = tuple(sorted({a for group in groups for a in group}))
    token = jax.lax.psum(sum(0 * jnp.where(jnp.isfinite(t), t, 0) for t in firsts), axes)
    for group, ks in groups.items():
        t = to_varying(token, group)
        out, _ = jax.lax.optimization_barrier(([flat[k] for k in ks], t))
        for k, y in zip(ks, out, strict=True):
            flat[k] = y
    return tree_def.unflatten(flat)


def _token(out):
    """A one-element float32 that exists once ``out`` (a layer's output) does: the first
    element of its first non-empty array, 0 where that is not finite (so that :func:`_after`
    subtracts an exact zero); None when ``out`` holds no element."""
    arrays = [x for x in jax.tree.leaves(out) if jnp.size(x) > 0]
    if not arrays:
        return None
    t = jax.lax.slice(jnp.reshape(arrays[0], -1), (0,), (1,)).astype(jnp.float32)
    return jnp.where(jnp.isfinite(t), t, 0)


def _after(x, tok):
    """``x``, not read before ``tok`` exists: ``x - 0 * |tok|`` (subtracting +0 leaves every
    value as it is, -0 included). XLA does not fold it for floats, so it is a data dependency
    that XLA:GPU's scheduler sees; an optimization barrier is gone by then."""
    return x - (jnp.abs(tok[0]) * 0).astype(x.dtype)


def _layer_input(saved, inputs, last, i, length):
    """Layer ``i``'s saved input on the device: ``inputs[i]`` (the forward loop's, layers
    0 .. L-2, fetched from where ``saved`` stored them; inside the backward loop the fetch
    depends on the layer index, so it cannot be hoisted to the backward's start) or ``last``
    (the last layer's, saved apart on the device: no copy of the stack of inputs; nothing
    is fetched for it when ``i`` is known at trace time)."""
    if length == 1 or (isinstance(i, int) and i == length - 1):
        return last
    pick = lambda xs: jax.lax.dynamic_index_in_dim(xs, jnp.minimum(i, length - 2), 0, False)
    return jax.tree.map(
        lambda xs, x: jnp.where(i == length - 1, x, saved.fetch(pick(xs))), inputs, last
    )


def _buffer(slices, length):
    """Zeros for ``length`` layers of each of ``slices`` (None stays None), written in place
    layer by layer (:func:`_put`): no concatenation, no second copy at the forward's end."""
    return jax.tree.map(
        lambda x: to_varying(jnp.zeros((length,) + x.shape, x.dtype), varying_axes(x)), slices
    )
