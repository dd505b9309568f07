"""Optimizer offload's update, streamed through the device (decision 32): the state stays in
pinned host memory, and the update fetches it a chunk at a time, computes on the device and
writes each chunk back into the state's own (donated) buffers.

The update is traced once and cut into parts (:mod:`jaxzero.zero.offload.parts`). The
prologue (small values several parts read: a global norm, a step count) and the parts that
are not elementwise (Adafactor's factored moments, LAMB's per-leaf norms) run whole, on the
device, under jit's sharding. An elementwise part (Adam's, the EMA's, the casts) runs, also
under jit's sharding, in a ``fori_loop`` over chunks of a dimension the sharding leaves whole
(:func:`chunk_dim`), each chunk fetched to the device and written back in place with
``dynamic_update_slice`` into the state leaf it replaces. An ``optimization_barrier`` chain
runs the parts one after another, so the device never holds more than one part's chunk (or
one whole non-elementwise part).

In the prologue, a full reduction (sum, max, min, and, or, product over every axis) of a large
value computed elementwise from large values of one spec, at least one in host memory (the
sum of squares of a global norm, a finite check, of host-resident gradients), runs the same
way: a ``fori_loop`` over chunks, each chunk of those values fetched, the elementwise chain
computed on it and reduced, the chunks' values combined by the reduction's monoid. Such a
host value is never fetched whole, unless another equation of the prologue reads it whole.

A master kept as a 16-bit remainder and a carry bit (:mod:`jaxzero.zero.offload.remainder`,
decision 47) is traced as the fp32 master it stands for: where a part fetches it (whole or a
chunk of rows) the remainder's bytes are fetched and joined on the device with the same rows
of its bf16 compute copy, and where the new master is written back it is split there and only
the remainder's bytes go to the host.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, Var
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero.zero.offload.parts as stream_parts
import jaxzero.zero.offload.remainder as remainder
from jaxzero._compat import bind_params
from jaxzero.mesh import to_varying, varying_axes
from jaxzero.zero import jaxpr_eval

__all__ = ["CHUNK", "chunk_dim", "rows_per_chunk", "run", "run_rows"]

DEVICE, HOST = jax.memory.Space.Device, jax.memory.Space.Host

#: elements of a device's shards that one iteration of an elementwise part fetches (per leaf)
CHUNK = 1 << 22


def rows_per_chunk(rows: int, row_elements: int, chunk: int, multiple: int = 1) -> int:
    """The most rows, dividing ``rows`` and a multiple of ``multiple`` (which divides
    ``rows``), whose elements fit ``chunk`` (at least ``multiple`` rows)."""
    fit = max(multiple, chunk // max(1, row_elements))
    return max(d for d in range(multiple, min(rows, fit) + 1, multiple) if rows % d == 0)


def _run_eqns(jaxpr, eqns, env, shape=None, axes=()):
    """``jaxpr``'s equations ``eqns`` evaluated into ``env``; with ``shape`` (a chunk's), a
    scalar broadcast to a large value broadcasts to the chunk instead. ``axes``: inside
    ``shard_map``, the mesh axes the rows' shards vary over, to which every operand (a
    replicated scalar, a literal) is cast first, as a primitive bound directly requires."""
    for i in eqns:
        eqn = jaxpr.eqns[i]
        chunked = shape is not None and eqn.primitive.name == "broadcast_in_dim"
        chunked = chunked and stream_parts.big(eqn.outvars[0])
        if not chunked and not axes:
            jaxpr_eval.bind(eqn, env)
            continue
        params = bind_params(eqn)
        if chunked:
            params = {**params, "shape": shape}
            if "sharding" in params:  # the chunk's sharding is jit's to choose
                params["sharding"] = None
        args = [jaxpr_eval.read(env, v) for v in eqn.invars]
        if axes:
            args = [
                to_varying(jnp.asarray(x, v.aval.dtype), axes)
                for x, v in zip(args, eqn.invars, strict=True)
            ]
        out = eqn.primitive.bind(*args, **params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out], strict=True))
    return env


class _Run:
    """One streamed evaluation: the values known so far and where each lives, a part run
    whole (:meth:`whole`) or in a loop over chunks (:meth:`chunked`), the prologue with its
    full reductions over host values in loops over chunks (:meth:`prologue`)."""

    def __init__(self, plan, mesh, specs, host, to_device, alias, stored):
        self.plan, self.mesh = plan, mesh
        jaxpr = plan.jaxpr.jaxpr
        self.stored = stored  # a remainder-stored master input -> its compute copy's input
        # outputs written back as remainders: those replacing a stored input
        self.stored_out = {v for v, u in alias.items() if u in stored}
        self.spec = dict(zip(jaxpr.invars, specs, strict=True))
        self.host = {v for v, h in zip(jaxpr.invars, host, strict=True) if h}
        self.to_device = to_device  # jaxpr outvars that end on the device
        self.alias = alias  # output -> the host input whose buffer it replaces
        self.protected = {v for v in jaxpr.outvars if v in set(jaxpr.invars)}
        self.chain = None
        self.written = set()  # outputs already written to host memory
        self.given = {}  # a deferred state input -> its rows, on the device (run_rows' given=)

    def chained(self, vals):
        if self.chain is not None:
            vals, _ = jax.lax.optimization_barrier((vals, self.chain))
        return vals

    def fetched(self, v, x, env=None):
        """``x``, the value of ``v``, in device memory (a stored master joined there with its
        compute copy, read from ``env``)."""
        if v in self.stored:
            w = self.stored[v]
            return self._joined(v, x, self.fetched(w, env[w]))
        return jax.device_put(x, DEVICE) if v in self.host else x

    def _joined(self, v, rem, compute):
        """The fp32 master from the stored ``rem`` of ``v`` and its ``compute`` rows."""
        if v in self.host:
            rem = jax.device_put(rem, DEVICE)
        return remainder.join(compute, rem, axis=-1)

    def piece(self, v, src, start, c, k, env, loop=None):
        """Rows ``[start, start + c)`` along ``k`` of ``src``, the value of ``v``, in device
        memory; a stored master's joined with its compute copy's rows, read from ``loop``
        (``{input: buffer}``, the inputs a loop writes chunk by chunk) or ``env``."""
        if v in self.given:  # fetched by the caller (packed rows)
            return self.given[v]
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, c, k, allow_negative_indices=False)
        if v not in self.stored:
            return jax.device_put(cut(src), DEVICE) if v in self.host else cut(src)
        w = self.stored[v]
        compute = self.piece(w, (loop or {}).get(w, env[w]), start, c, k, env)
        return self._joined(v, remainder.rows(src, start, c, k), compute)

    def multiple(self, vs, k, shape) -> int:
        """The rows a chunk along ``k`` must be a multiple of: 8 along a stored master's last
        axis (its carry bytes), else 1."""
        last = k == len(shape) - 1
        return 8 if last and any(v in self.stored or v in self.stored_out for v in vs) else 1

    def whole(self, env, part):
        """``part`` under jit's sharding, its host inputs fetched whole."""
        vals = self.chained([env[v] for v in part.inputs])
        vals = [self.fetched(v, x, env) for v, x in zip(part.inputs, vals, strict=True)]
        local = dict(zip(part.inputs, vals, strict=True))
        local.update(zip(self.plan.jaxpr.jaxpr.constvars, self.plan.jaxpr.consts, strict=True))
        local = _run_eqns(self.plan.jaxpr.jaxpr, part.eqns, local)
        outs = [local[v] for v in part.outputs]
        self.chain = outs
        return dict(zip(part.outputs, outs, strict=True))

    def streamable(self, part) -> P | None:
        """The one spec of ``part``'s large inputs when it can run in chunks, else None."""
        if not part.elementwise or not all(stream_parts.big(v) for v in part.outputs):
            return None
        if not self.host.intersection(part.inputs) and self.to_device.issuperset(part.outputs):
            return None  # the state kept on the device (offload_fraction): updated whole there
        return self._spec([v for v in part.inputs if stream_parts.big(v)])

    def _spec(self, bigs) -> P | None:
        """The one spec of the large values ``bigs`` (of one shape) when it leaves a dimension
        to chunk, else None."""
        specs = {self.spec.get(v) for v in bigs}
        if len(specs) != 1 or None in specs:
            return None
        spec = next(iter(specs))
        return spec if chunk_dim(spec, bigs[0].aval.shape) is not None else None

    def _chunks(self, spec, shape, chunk, vs=()):
        """``(dimension, rows, chunk shape)`` of a loop over chunks of ``shape`` under ``spec``,
        each at most ``chunk`` elements per device (whole carry bytes of the stored masters
        among ``vs``)."""
        local = NamedSharding(self.mesh, spec).shard_shape(shape)
        k = chunk_dim(spec, shape)
        per_row = math.prod(local) // shape[k]
        c = rows_per_chunk(shape[k], per_row, chunk, self.multiple(vs, k, shape))
        return k, c, shape[:k] + (c,) + shape[k + 1 :]

    def once(self, part) -> tuple[list[int], list[int]]:
        """``part``'s equations cut in two: those that compute small values from small values
        alone (Adam's bias corrections from the step count), evaluated once for every chunk
        (:meth:`scalars`), and the rest, evaluated on each chunk's rows. A scalar is then
        computed in one place whichever loop reads it, so a row update run later
        (:func:`run_rows`) reads the same bits as the chunk loop would have."""
        eqns = self.plan.jaxpr.jaxpr.eqns
        small = lambda i: not any(stream_parts.big(v) for v in (*eqns[i].invars, *eqns[i].outvars))
        return [i for i in part.eqns if small(i)], [i for i in part.eqns if not small(i)]

    def scalars(self, part, small_env) -> dict:
        """``small_env`` with the values of ``part``'s small equations (:meth:`once`)."""
        return _run_eqns(self.plan.jaxpr.jaxpr, self.once(part)[0], dict(small_env))

    def rows(self, part, big, srcs, small_env, cut, env, loop=None):
        """``part``'s values on the rows ``cut`` = ``(start, rows, dimension, chunk shape)``:
        its large inputs' rows cut from ``srcs`` (fetched where they live in host memory; a
        stored master's joined with its compute copy's rows, read from ``loop`` or ``env``),
        its small values (:meth:`scalars`) from ``small_env``. Returns the evaluation's
        values."""
        start, c, k, shape = cut
        pieces = [self.piece(v, x, start, c, k, env, loop) for v, x in zip(big, srcs, strict=True)]
        # inside shard_map, a replicated scalar varies over the axes its rows' shards do
        axes = tuple(sorted({a for x in pieces for a in varying_axes(x)}))
        envl = {**small_env, **dict(zip(big, pieces, strict=True))}
        return _run_eqns(self.plan.jaxpr.jaxpr, self.once(part)[1], envl, shape, axes)

    def put(self, acc, v, y, start, k):
        """``acc`` (the buffer of output ``v``) with the rows ``y`` of ``v`` written at
        ``start`` along ``k``: into host memory unless ``v`` stays on the device, a stored
        master's as its remainder."""
        if v in self.stored_out:  # only the remainder's bytes go back
            y = remainder.split(y, y.astype(jnp.bfloat16), axis=-1)
        y = y if v in self.to_device else jax.device_put(y, HOST)
        if v in self.stored_out:
            return remainder.put_rows(acc, y, start, k)
        return jax.lax.dynamic_update_slice_in_dim(acc, y, start, k, allow_negative_indices=False)

    def deferrable(self, part, spec, defer) -> bool:
        """Whether ``part`` can run later a row at a time (:func:`run_rows`): it streams along
        its first dimension, every large host value it reads is one of the inputs ``defer``
        names, and every output it writes to host memory replaces one of them."""
        if spec is None or chunk_dim(spec, part.outputs[0].aval.shape) != 0:
            return False
        reads = [v for v in part.inputs if v in self.host and stream_parts.big(v)]
        if not reads or not defer.issuperset(reads):
            return False
        return all(v in self.to_device or self.alias.get(v) in reads for v in part.outputs)

    def pending_reads(self, parts) -> list:
        """What the deferred ``parts``' rows read besides their large host state, in a fixed
        order: the small values (the prologue's, a part's own scalars from :meth:`once`) and
        the device inputs (the gradients; a stored master's compute copy)."""
        eqns = self.plan.jaxpr.jaxpr.eqns
        out = []
        for part in parts:
            for v in jaxpr_eval.reads([eqns[i] for i in self.once(part)[1]]):
                for w in (v, self.stored.get(v)):
                    state = w in self.host and stream_parts.big(w)
                    if w is not None and not state and w not in out:
                        out.append(w)
        return out

    def chunked(self, env, part, spec, chunk):
        """``part`` in a loop over chunks of an unsplit dimension, under jit's sharding: each
        chunk of its host inputs fetched, computed, and its host outputs written back in
        place (into the input of the same dtype that nothing reads afterwards)."""
        big = [v for v in part.inputs if stream_parts.big(v)]
        small = [v for v in part.inputs if not stream_parts.big(v)]
        shape = part.outputs[0].aval.shape
        k, c, chunk_shape = self._chunks(spec, shape, chunk, (*big, *part.outputs))
        into = []
        for v in part.outputs:
            u = self.alias.get(v)
            if v in self.to_device:  # a device input nothing reads after this part, as v is typed
                ok = u is not None and u not in self.host
                ok = ok and (u not in big or u not in self.protected)
                ok = ok and (u.aval.shape, u.aval.dtype) == (v.aval.shape, v.aval.dtype)
            else:
                ok = u in big and u in self.host and u not in self.protected
            into.append(u if ok and u not in into else None)
        big_vals, small_vals = self.chained(([env[v] for v in big], [env[v] for v in small]))
        small_vals = [self.fetched(v, x, env) for v, x in zip(small, small_vals, strict=True)]
        small_env = self.scalars(part, zip(small, small_vals, strict=True))

        def body(j, carry):
            start = j * c
            loop = {u: acc for u, acc in zip(into, carry, strict=True) if u is not None}
            srcs = [loop.get(v, x) for v, x in zip(big, big_vals, strict=True)]
            envl = self.rows(part, big, srcs, small_env, (start, c, k, chunk_shape), env, loop)
            return tuple(
                self.put(acc, v, envl[v], start, k)
                for acc, v in zip(carry, part.outputs, strict=True)
            )

        init = []
        for u, v in zip(into, part.outputs, strict=True):
            if u is not None:
                init.append(big_vals[big.index(u)] if u in big else env[u])
                continue
            z = jnp.zeros(shape, v.aval.dtype)
            if v in self.stored_out:
                z = remainder.split(z, z.astype(jnp.bfloat16), axis=-1)
            init.append(z if v in self.to_device else jax.device_put(z, HOST))
        outs = list(jax.lax.fori_loop(0, shape[k] // c, body, tuple(init)))
        self.written.update(v for v in part.outputs if v not in self.to_device)
        self.chain = outs
        return dict(zip(part.outputs, outs, strict=True))

    def prologue(self, env, part, chunk):
        """``part`` as :meth:`whole` runs it, except the full reductions of a large value that
        :func:`stream_parts.reductions` finds computed elementwise from values of one spec, at
        least one in host memory: they run in loops over chunks (:meth:`reduced`), one loop
        for the reductions that read the same values (:meth:`_group`), and the
        large values that only such loops read are never fetched or computed whole."""
        jaxpr = self.plan.jaxpr.jaxpr
        ok = lambda bigs: any(v in self.host for v in bigs) and self._spec(bigs) is not None
        loops = stream_parts.reductions(jaxpr, part, ok)
        looped = set(loops).union(*loops.values())
        rest = [jaxpr.eqns[i] for i in part.eqns if i not in looped]
        whole = set(jaxpr_eval.reads(rest))
        vals = self.chained([env[v] for v in part.inputs])
        local = {
            v: self.fetched(v, x, env) if v in whole or not stream_parts.big(v) else x
            for v, x in zip(part.inputs, vals, strict=True)
        }
        local.update(zip(jaxpr.constvars, self.plan.jaxpr.consts, strict=True))
        done = set()
        for i in part.eqns:
            if i in loops and i not in done:
                group = self._group(loops, i, local, done)
                done.update(group)
                sums = self.reduced(local, [(j, loops[j]) for j in group], chunk, env)
                local.update(
                    (jaxpr.eqns[j].outvars[0], r) for j, r in zip(group, sums, strict=True)
                )
            elif i not in looped:
                _run_eqns(jaxpr, (i,), local)
        outs = [local[v] for v in part.outputs]
        self.chain = outs
        return dict(zip(part.outputs, outs, strict=True))

    def _group(self, loops, i, local, done) -> list[int]:
        """Reduction ``i`` and the later ones that read the same large values, of one shape,
        whose small inputs are known now: one loop reads those values once for all of them
        (a finite check, the metrics' norm and ``clip_by_global_norm``'s read each gradient)."""
        jaxpr = self.plan.jaxpr.jaxpr

        def key(j):
            reads = jaxpr_eval.reads([jaxpr.eqns[e] for e in (*loops[j], j)])
            return tuple(v for v in reads if stream_parts.big(v)), jaxpr.eqns[j].invars[
                0
            ].aval.shape

        def ready(j):
            reads = jaxpr_eval.reads([jaxpr.eqns[e] for e in (*loops[j], j)])
            return all(stream_parts.big(v) or v in local for v in reads)

        return [i] + [j for j in loops if j > i and j not in done and key(j) == key(i) and ready(j)]

    def reduced(self, local, items, chunk, env):
        """The full reductions ``items`` (``(equation, its chain)`` pairs of the jaxpr, over
        large values of one shape) in one loop over chunks under jit's sharding: each chunk of
        the large values the chains read from ``local`` sliced (and fetched, from host memory)
        once, the chains computed on the chunk, each reduction's chunk combined with the chunks
        before by its monoid (``env``: where a stored master's compute copy is read). Returns
        the reductions' values."""
        jaxpr = self.plan.jaxpr.jaxpr
        eqns = sorted(set().union(*(e for _, e in items)))
        reads = jaxpr_eval.reads([jaxpr.eqns[j] for j in (*eqns, *(i for i, _ in items))])
        big = [v for v in reads if stream_parts.big(v)]
        small = {v: local[v] for v in reads if not stream_parts.big(v)}
        shape = jaxpr.eqns[items[0][0]].invars[0].aval.shape
        k, c, chunk_shape = self._chunks(self._spec(big), shape, chunk, big)
        big_vals = self.chained([local[v] for v in big])
        ops = [jaxpr.eqns[i] for i, _ in items]

        def body(j, accs):
            envl = dict(small)
            for v, y in zip(big, big_vals, strict=True):
                envl[v] = self.piece(v, y, j * c, c, k, env)
            _run_eqns(jaxpr, eqns, envl, chunk_shape)
            return tuple(
                _MONOIDS[e.primitive.name](a, e.primitive.bind(envl[e.invars[0]], **bind_params(e)))
                for e, a in zip(ops, accs, strict=True)
            )

        init = tuple(_identity(e.primitive.name, e.outvars[0].aval.dtype) for e in ops)
        accs = list(jax.lax.fori_loop(0, shape[k] // c, body, init))
        self.chain = accs
        return accs


def chunk_dim(spec: P, shape) -> int | None:
    """The first dimension of ``shape`` that ``spec`` leaves unsplit and that has more than
    one row (None when there is none)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return next((d for d, e in enumerate(entries) if e is None and shape[d] > 1), None)


#: how two chunks' values of a full reduction combine
_MONOIDS = {
    "reduce_sum": jax.lax.add,
    "reduce_max": jax.lax.max,
    "reduce_min": jax.lax.min,
    "reduce_and": jax.lax.bitwise_and,
    "reduce_or": jax.lax.bitwise_or,
    "reduce_prod": jax.lax.mul,
}


def _identity(name: str, dtype):
    """The value, in ``dtype``, of the reduction ``name`` over no elements."""
    dtype = jnp.dtype(dtype)
    if name in ("reduce_max", "reduce_min"):
        low = name == "reduce_max"
        if dtype == jnp.bool_:
            return jnp.asarray(not low)
        if jnp.issubdtype(dtype, jnp.inexact):
            return jnp.asarray(-jnp.inf if low else jnp.inf, dtype)
        info = jnp.iinfo(dtype)
        return jnp.asarray(info.min if low else info.max, dtype)
    if name == "reduce_and":  # every bit set
        return jnp.asarray(np.invert(np.zeros((), dtype)))
    return jnp.asarray(1 if name == "reduce_prod" else 0, dtype)


def _global_shape(mesh, spec, local) -> tuple[int, ...]:
    """The global shape whose shards under ``spec`` have the shape ``local``."""
    entries = tuple(spec) + (None,) * (len(local) - len(spec))
    size = lambda e: math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e))
    return tuple(n if e is None else n * size(e) for n, e in zip(local, entries, strict=True))


def _traced(fn, args, *, mesh, specs, host, device_outputs, alias, stored, local=False):
    """``fn`` traced on ``args``' avals (``local``: ``args`` are shards inside a
    ``shard_map`` over ``mesh``, traced at their global shapes) and cut into parts: ``(the
    run, its values so far, the output tree, which outputs stay on the device, args' tree)``."""
    flat, tree = jax.tree.flatten(args, is_leaf=remainder.is_stored)
    shape = lambda x, s: _global_shape(mesh, s, x.shape) if local else x.shape
    aval = lambda x, s: jax.ShapeDtypeStruct(
        shape(x.lo, s) if remainder.is_stored(x) else shape(x, s),
        jnp.float32 if remainder.is_stored(x) else x.dtype,
    )
    avals = tuple(aval(x, s) for x, s in zip(flat, specs, strict=True))
    closed, out_tree = stream_parts.flat_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), avals)
    plan = stream_parts.plan(closed)
    jaxpr = closed.jaxpr
    n_out = len(jaxpr.outvars)
    if isinstance(device_outputs, int):
        device_outputs = [i >= n_out - device_outputs for i in range(n_out)]
    stays = list(device_outputs)
    dev = {v for v, d in zip(jaxpr.outvars, stays, strict=True) if d and isinstance(v, Var)}
    pairs = {}
    for o, i in sorted(alias.items()):
        v = jaxpr.outvars[o]
        if isinstance(v, Var) and v not in pairs:
            pairs[v] = jaxpr.invars[i]
    stored = {jaxpr.invars[i]: jaxpr.invars[j] for i, j in (stored or {}).items()}
    r = _Run(plan, mesh, specs, host, dev, pairs, stored)
    env = dict(zip(jaxpr.invars, flat, strict=True))
    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    return r, env, out_tree, stays, tree


def _deferred(r, defer) -> tuple[list, list]:
    """The parts :meth:`_Run.deferrable` by the flat input flags ``defer``, and what they
    read that is carried to :func:`run_rows` (:meth:`_Run.pending_reads`)."""
    jaxpr = r.plan.jaxpr.jaxpr
    names = {v for v, d in zip(jaxpr.invars, defer, strict=True) if d}
    parts = [p for p in r.plan.parts if r.deferrable(p, r.streamable(p), names)]
    rows = {p.outputs[0].aval.shape[0] for p in parts}
    if len(rows) > 1:
        raise ValueError(
            f"the deferred state leaves have first dimensions {sorted(rows)}; deferring runs "
            f"their update a row of the same first (layer) dimension at a time: flag only the "
            f"leaves of one stack."
        )
    consts = set(jaxpr.constvars)
    return parts, [v for v in r.pending_reads(parts) if v not in consts]


def run(
    fn,
    args,
    *,
    mesh,
    specs,
    host,
    device_outputs,
    alias,
    chunk: int | None = None,
    stored=None,
    defer=None,
):
    """``fn(*args)`` computed on the device, streamed from and into host memory.

    Args:
      fn: a function of pytrees of arrays (traced once, as on the device).
      args: its arguments; ``specs`` and ``host`` give, per flat leaf, its PartitionSpec and
        whether it lives in host memory (the state, which ``fn``'s outputs replace). A
        :class:`~jaxzero.zero.offload.remainder.Remainder` is one leaf: the fp32 master it
        stands for, which ``fn`` is traced with.
      device_outputs: how many of the last flat outputs stay on the device, the others
        written to host memory; or, per flat output, whether it stays on the device.
      alias: ``{flat output index: flat input index}``, the state leaf each host output
        replaces; it is written chunk by chunk into that leaf's (donated) buffer.
      chunk: elements per device that one loop iteration fetches of each leaf (default
        :data:`CHUNK`).
      stored: ``{flat input index: flat input index}``: each Remainder leaf's bf16 compute
        copy (packed row by row: ``remainder.split(..., axis=-1)``); an output that replaces a
        Remainder (``alias``) is written back as one.
      defer: per flat input leaf, whether it is a state leaf of a layer stack whose update
        runs later, a row at a time (:func:`run_rows`, inside the next step's layer loop):
        the parts that stream along the first dimension and read no other host value are
        left undone.

    Returns:
      ``fn(*args)``'s outputs, each where ``device_outputs`` puts it; with ``defer``,
      ``(outputs, pending)``: a deferred part's host outputs are its state leaves unchanged
      and its device outputs None, and ``pending`` is what :func:`run_rows` reads (the
      gradients' and the prologue's values those parts take).
    """
    chunk = CHUNK if chunk is None else chunk
    where = dict(mesh=mesh, specs=specs, host=host, device_outputs=device_outputs, alias=alias)
    r, env, out_tree, stays, _ = _traced(fn, args, stored=stored, **where)
    plan, jaxpr = r.plan, r.plan.jaxpr.jaxpr
    later, pending = _deferred(r, defer) if defer is not None else ([], [])
    env.update(r.prologue(env, plan.prologue, chunk))
    for part in plan.parts:
        if any(part is p for p in later):  # its state stays as it is; what it will read is carried
            small = [v for v in part.inputs if not stream_parts.big(v)]
            env.update(r.scalars(part, ((v, r.fetched(v, env[v], env)) for v in small)))
            env.update((v, None if v in r.to_device else env[r.alias[v]]) for v in part.outputs)
            r.written.update(v for v in part.outputs if v not in r.to_device)
            continue
        spec = r.streamable(part)
        env.update(r.whole(env, part) if spec is None else r.chunked(env, part, spec, chunk))
    outs = []
    for i, v in enumerate(jaxpr.outvars):
        x = jnp.asarray(v.val) if isinstance(v, Literal) else env[v]
        if x is None:  # a deferred part's device output: :func:`run_rows` gives its rows
            outs.append(x)
            continue
        if v in r.stored_out and not remainder.is_stored(x):  # computed whole on the device
            x = remainder.split(x, x.astype(jnp.bfloat16), axis=-1)
        on_host = isinstance(v, Var) and (v in r.host or v in r.written)
        if stays[i] == on_host:
            x = jax.device_put(x, DEVICE if on_host else HOST)
        outs.append(x)
    outs = jax.tree.unflatten(out_tree, outs)
    return outs if defer is None else (outs, tuple(env[v] for v in pending))


def trace_rows(fn, args, *, mesh, specs, host, device_outputs, alias, stored=None):
    """``fn`` traced on ``args``' (global) avals for :func:`run_rows`' ``traced=``: call it
    outside the ``shard_map`` whose layer loop runs the rows. The arguments are :func:`run`'s."""
    where = dict(mesh=mesh, specs=specs, host=host, device_outputs=device_outputs, alias=alias)
    r, env, _, _, tree = _traced(fn, args, stored=stored, **where)
    closed = r.plan.jaxpr
    return r, {v: env[v] for v in closed.jaxpr.constvars}, tree


def pending_specs(fn, args, *, defer, mesh, specs, host, device_outputs, alias, stored=None):
    """The PartitionSpec of each value that :func:`run` with ``defer=`` returns as ``pending``,
    as a ``shard_map`` that calls :func:`run_rows` with ``local=True`` takes them: a large
    value in its deferred part's one spec (the rows cut it there), a small one replicated.
    The arguments are :func:`run`'s."""
    where = dict(mesh=mesh, specs=specs, host=host, device_outputs=device_outputs, alias=alias)
    r, _, _, _, _ = _traced(fn, args, stored=stored, **where)
    later, reads = _deferred(r, defer)

    def spec(v):
        if not stream_parts.big(v):
            return P()
        return next(r.streamable(part) for part in later if v in part.inputs)

    return tuple(spec(v) for v in reads)


def run_rows(
    fn,
    args,
    pending,
    start,
    rows: int,
    *,
    mesh,
    specs,
    host,
    device_outputs,
    alias,
    defer,
    stored=None,
    local: bool = False,
    traced=None,
    given=None,
):
    """Rows ``[start, start + rows)`` of the first (layer) dimension of the update that
    :func:`run` with ``defer=`` left undone: each deferred part's host state rows fetched from
    ``args`` as they are now, computed with what ``pending`` carried, and written back into
    the state leaves they replace.

    Args:
      fn, args, mesh, specs, host, device_outputs, alias, defer, stored: as :func:`run` was
        given them (``args``: the same leaves, the host state as it is now; the leaves
        ``pending`` carries are not read).
      pending: the second value :func:`run` returned.
      start: the first row (may be traced: a layer loop's index).
      rows: how many.
      local: ``args`` and ``pending`` are each device's shards, inside a ``shard_map`` over
        ``mesh`` whose in_specs are ``specs`` (and the specs ``pending``'s values had): the
        rows are the shards' rows (a layer loop inside the step's ``shard_map``).
      traced: :func:`trace_rows`' result for these arguments, made outside the ``shard_map``
        (traced inside it, ``fn`` may read differently: a replicated scalar mixed with the
        shards is marked varying there, one more value than ``run`` carried).

      given: ``{flat input index: its rows}``: the rows of deferred state leaves already on
        the device (:class:`~jaxzero.zero.offload.packed.PackedRows` fetches a layer's state
        in one copy), read instead of ``args``' leaves; their new rows are returned instead
        of written.

    Returns:
      ``(args, new)``: ``args`` with those rows written into the deferred state leaves, and
      ``{flat output index: its rows}`` for each deferred output that stays on the device
      (the new compute params' rows). With ``given``: ``(args, new, written)``, ``written``
      the new rows of each leaf of ``given`` (``{flat input index: its rows}``, on the
      device), which ``args`` leaves as they were.
    """
    where = dict(mesh=mesh, specs=specs, host=host, device_outputs=device_outputs, alias=alias)
    if traced is None:
        r, env, _, _, tree = _traced(fn, args, stored=stored, local=local, **where)
    else:
        r, consts, tree = traced
        env = dict(consts)
        flat = jax.tree.leaves(args, is_leaf=remainder.is_stored)
        env.update(zip(r.plan.jaxpr.jaxpr.invars, flat, strict=True))
    later, reads = _deferred(r, defer)
    if len(reads) != len(pending):
        raise ValueError(
            f"pending holds {len(pending)} values and the deferred parts read {len(reads)}: "
            f"pass run_rows the function and arguments run(..., defer=) was given."
        )
    invars = r.plan.jaxpr.jaxpr.invars
    values = [env[v] for v in invars]
    r.given = {invars[k]: x for k, x in (given or {}).items()}
    env.update(zip(reads, pending, strict=True))
    bufs = {}  # a deferred state leaf -> its buffer with the rows written so far
    rows_of = {}
    for part in later:
        big = [v for v in part.inputs if stream_parts.big(v)]
        small = {v: env[v] for v in reads if not stream_parts.big(v)}
        shape = part.outputs[0].aval.shape
        if local:  # the deferred parts' large values all have the part's one spec
            shape = NamedSharding(mesh, r.streamable(part)).shard_shape(shape)
        cut = (start, rows, 0, (rows, *shape[1:]))
        srcs = [bufs.get(v, env[v]) for v in big]
        envl = r.rows(part, big, srcs, small, cut, env, bufs)
        for v in part.outputs:
            if v in r.to_device:
                rows_of[v] = envl[v]
                continue
            u = r.alias[v]
            if u in r.given:  # a later part reads the new rows, as it would the buffer
                r.given[u] = envl[v]
                continue
            bufs[u] = r.put(bufs.get(u, env[u]), v, envl[v], start, 0)
    jaxpr = r.plan.jaxpr.jaxpr
    new = {o: rows_of[v] for o, v in enumerate(jaxpr.outvars) if v in rows_of}
    flat = [bufs.get(v, x) for v, x in zip(invars, values, strict=True)]
    if given is not None:
        return jax.tree.unflatten(tree, flat), new, {k: r.given[invars[k]] for k in given}
    return jax.tree.unflatten(tree, flat), new
