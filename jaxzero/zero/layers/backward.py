"""The backward loops of :func:`jaxzero.scan_layers`' per-layer stage 3 that reduce each
layer's gradient by hand, where XLA's collective pipeliner cannot: deferred an iteration (a
wire whose reduction it does not move: qgZ), written in place into the params' host stacks
(parameter offload, two stages: decision 44), or added into host accumulators (parameter
offload with micro-batches: decision 42); and the slicing helpers the loops share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxzero.mesh import to_varying, varying_axes
from jaxzero.zero.collectives import Comm, reduce_leaves


def deferred(comm: Comm, layer, state, leaves, dims, length):
    """The backward loop with each layer's gradient reduced one iteration later, by hand: the
    last layer's backward runs first, then iteration ``i`` reduces layer ``i + 1``'s gradient
    (carried over) while layer ``i``'s backward computes, and layer 0's is reduced after the
    loop. For a wire whose reduction XLA's collective pipeliner does not move across
    iterations (qgZ's all-to-all): left in the iteration that computes it, it waits for the
    whole layer's backward and nothing computes beside it. Returns the final state and the
    reduced gradient stacks."""
    state, pending = layer(state, length - 1)

    def body(carry, i):
        state, pending, out = carry
        out = put(out, reduce_tree(comm, pending, dims, leaves), i + 1)  # under layer i
        state, pending = layer(state, i)
        return (state, pending, out), None

    out = [zeros(x) for x in leaves]
    steps = jnp.arange(length - 1)
    (state, pending, out), _ = jax.lax.scan(body, (state, pending, out), steps, reverse=True)
    return state, put(out, reduce_tree(comm, pending, dims, leaves), 0)


def in_place(comm: Comm, layer, state, leaves, dims, length):
    """The backward loop over stacks in host memory (parameter offload), in two stages:
    iteration ``i`` writes layer ``i + 2``'s reduced gradient (reduced one iteration earlier)
    into its slot of the stacks it carries, which nothing reads again, reduce-scatters layer
    ``i + 1``'s (computed one iteration earlier) under layer ``i``'s backward, and reads layer
    ``i - 1``'s params from the stacks as written. XLA then updates the stacks' host buffers in
    place: the gradient takes the params' bytes, and leaves the device layer by layer. A
    reduction whose result goes to the host in the iteration that computes it is exposed: XLA's
    collective pipeliner does not move it, and the write pulls it to the top of the next
    iteration when it is carried one (LLaMA-7B at N = 8: reduce-scatters 0% hidden, 93% in two
    stages, as with the params on the device; decision 44). The last two layers' backward run
    before the loop, the last two writes after it. On one device, with nothing to reduce, each
    gradient is written where it is computed (13B on one H100: 3.84 GB of device peak, 3.97 GB
    in two stages). Returns the final state and the gradient stacks (in the params' buffers)."""
    to_host = lambda gs: [jax.device_put(g, jax.memory.Space.Host) for g in gs]
    reduce = lambda dw: reduce_tree(comm, dw, dims, leaves)
    out = list(leaves)
    if comm.num_batch_shards == 1:

        def one(carry, i):
            state, out = carry
            state, dw = layer(state, i, out)
            # the write waits for the read of layer i - 1 (in the next layer's weights): else
            # the two overlap, and XLA copies the whole stack to keep the read's bytes
            dw, _ = jax.lax.optimization_barrier((dw, state[1]))
            return (state, put(out, to_host(reduce(dw)), i)), None

        (state, out), _ = jax.lax.scan(one, (state, out), jnp.arange(length), reverse=True)
        return state, out
    state, pending = layer(state, length - 1, out)
    if length == 1:
        return state, put(out, to_host(reduce(pending)), 0)
    ready = reduce(pending)  # the last layer's, under layer L - 2
    state, pending = layer(state, length - 2, out)

    def body(carry, i):
        state, pending, ready, out = carry
        out = put(out, to_host(ready), i + 2)  # before the read below: one version, in place
        ready = reduce(pending)  # layer i + 1's, under layer i
        state, pending = layer(state, i, out)
        return (state, pending, ready, out), None

    carry = (state, pending, ready, out)
    steps = jnp.arange(length - 2)
    (state, pending, ready, out), _ = jax.lax.scan(body, carry, steps, reverse=True)
    out = put(out, to_host(ready), 1)
    return state, put(out, to_host(reduce(pending)), 0)


def accumulated(comm: Comm, layer, state, leaves, accs, dims, length):
    """The backward loop over stacks in host memory with micro-batches (parameter offload,
    ``accum_steps > 1``): the params stay as they are (the next micro-batch's forward reads
    them), and iteration ``i`` adds layer ``i``'s reduced gradient, in ``output_dtype``, into
    layer ``i``'s slot of a host accumulator of the stacks' shapes: ``accs`` (the earlier
    micro-batches' sum, each slot fetched, added to on the device and written back in place)
    or, at the first micro-batch (``accs`` all None), the scan's stacked output, which XLA
    allocates in host memory (a zeros buffer would be made on the device and copied over).
    Returns the final state and the accumulators (the stacks' gradients so far)."""
    dtype = comm.output_dtype
    # with several devices each layer's sum waits for layer i - 1's gathered weights (the
    # next state's): else the scheduler puts the accumulator's transfers first and the
    # all-gathers lose their overlap (LLaMA-7B at N = 8: 40% hidden, 82% with the barrier);
    # with one there is nothing to gather and the barrier only holds the transfers back
    # (13B at N = 1: 31% of the PCIe bytes hidden, 14% with it; decision 42)
    barrier = lambda state, dw: jax.lax.optimization_barrier((dw, state[1]))[0]
    after = barrier if comm.num_batch_shards > 1 else (lambda state, dw: dw)
    to_host = lambda xs: [jax.device_put(x, jax.memory.Space.Host) for x in xs]
    steps = jnp.arange(length)
    if all(a is None for a in accs):  # the scan stacks each slot into a new host buffer

        def first(state, i):
            state, dw = layer(state, i)
            reduced = reduce_tree(comm, after(state, dw), dims, leaves)
            return state, to_host(g.astype(dtype) for g in reduced)

        return jax.lax.scan(first, state, steps, reverse=True)

    def body(carry, i):
        state, out = carry
        state, dw = layer(state, i)
        reduced = reduce_tree(comm, after(state, dw), dims, leaves)
        earlier = [jax.device_put(a, jax.memory.Space.Device) for a in at(out, i)]
        new = [a + g.astype(dtype) for a, g in zip(earlier, reduced, strict=True)]
        return (state, put(out, to_host(new), i)), None

    (state, out), _ = jax.lax.scan(body, (state, list(accs)), steps, reverse=True)
    return state, out


def reduce_tree(comm: Comm, dw, dims, leaves):
    """Each leaf of one layer's gradient reduced (reduce-scatter along its dim, or all-reduce)
    and returned in the dtype of the stack leaf it belongs to."""
    reduced = reduce_leaves(comm, jax.tree.leaves(dw), dims)
    return [
        to_varying(g.astype(x.dtype), varying_axes(x)) for g, x in zip(reduced, leaves, strict=True)
    ]


def at(xs, i):
    """Layer ``i``'s slice of ``xs``."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), xs)


def put(buffer, slices, i):
    """``buffer`` with layer ``i``'s ``slices`` written in."""
    return jax.tree.map(
        lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x, i, 0), buffer, slices
    )


def zeros(x):
    """Zeros of ``x``'s shape, dtype and device-variance."""
    return to_varying(jnp.zeros_like(x), varying_axes(x))
