"""One streamed evaluation of the offloaded update (:mod:`jaxzero.zero.offload.stream`): the
values known so far and where each lives, each part run whole or in a loop over chunks of a
dimension its sharding leaves whole, each chunk fetched and written back in place."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero.zero.offload.parts as stream_parts
from jaxzero._compat import bind_params
from jaxzero.zero import jaxpr_eval

DEVICE, HOST = jax.memory.Space.Device, jax.memory.Space.Host

#: elements of a device's shards that one iteration of an elementwise part fetches (per leaf)
CHUNK = 1 << 22


def rows_per_chunk(rows: int, row_elements: int, chunk: int) -> int:
    """The most rows, dividing ``rows``, whose elements fit ``chunk`` (at least one row)."""
    fit = max(1, chunk // max(1, row_elements))
    return max(d for d in range(1, min(rows, fit) + 1) if rows % d == 0)


def _run_eqns(jaxpr, eqns, env, shape=None):
    """``jaxpr``'s equations ``eqns`` evaluated into ``env``; with ``shape`` (a chunk's), a
    scalar broadcast to a large value broadcasts to the chunk instead."""
    for i in eqns:
        eqn = jaxpr.eqns[i]
        chunked = shape is not None and eqn.primitive.name == "broadcast_in_dim"
        if not (chunked and stream_parts.big(eqn.outvars[0])):
            jaxpr_eval.bind(eqn, env)
            continue
        params = {**bind_params(eqn), "shape": shape}
        if "sharding" in params:  # the chunk's sharding is jit's to choose
            params["sharding"] = None
        env[eqn.outvars[0]] = eqn.primitive.bind(jaxpr_eval.read(env, eqn.invars[0]), **params)
    return env


class Run:
    """One streamed evaluation: the values known so far and where each lives, a part run
    whole (:meth:`whole`) or in a loop over chunks (:meth:`chunked`)."""

    def __init__(self, plan, mesh, specs, host, to_device, alias):
        self.plan, self.mesh = plan, mesh
        jaxpr = plan.jaxpr.jaxpr
        self.spec = dict(zip(jaxpr.invars, specs, strict=True))
        self.host = {v for v, h in zip(jaxpr.invars, host, strict=True) if h}
        self.to_device = to_device  # jaxpr outvars that end on the device
        self.alias = alias  # output -> the host input whose buffer it replaces
        self.protected = {v for v in jaxpr.outvars if v in set(jaxpr.invars)}
        self.chain = None
        self.written = set()  # outputs already written to host memory

    def chained(self, vals):
        if self.chain is not None:
            vals, _ = jax.lax.optimization_barrier((vals, self.chain))
        return vals

    def fetched(self, v, x):
        """``x``, the value of ``v``, in device memory."""
        return jax.device_put(x, DEVICE) if v in self.host else x

    def whole(self, env, part):
        """``part`` under jit's sharding, its host inputs fetched whole."""
        vals = self.chained([env[v] for v in part.inputs])
        vals = [self.fetched(v, x) for v, x in zip(part.inputs, vals, strict=True)]
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

    def _chunks(self, spec, shape, chunk):
        """``(dimension, rows, chunk shape)`` of a loop over chunks of ``shape`` under ``spec``,
        each at most ``chunk`` elements per device."""
        local = NamedSharding(self.mesh, spec).shard_shape(shape)
        k = chunk_dim(spec, shape)
        c = rows_per_chunk(shape[k], math.prod(local) // shape[k], chunk)
        return k, c, shape[:k] + (c,) + shape[k + 1 :]

    def chunked(self, env, part, spec, chunk):
        """``part`` in a loop over chunks of an unsplit dimension, under jit's sharding: each
        chunk of its host inputs fetched, computed, and its host outputs written back in
        place (into the input of the same dtype that nothing reads afterwards)."""
        jaxpr = self.plan.jaxpr.jaxpr
        big = [v for v in part.inputs if stream_parts.big(v)]
        small = [v for v in part.inputs if not stream_parts.big(v)]
        shape = part.outputs[0].aval.shape
        k, c, chunk_shape = self._chunks(spec, shape, chunk)
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
        small_vals = [self.fetched(v, x) for v, x in zip(small, small_vals, strict=True)]

        def body(j, carry):
            start = j * c
            envl = dict(zip(small, small_vals, strict=True))
            for v, x in zip(big, big_vals, strict=True):
                src = carry[into.index(v)] if v in into else x
                s = jax.lax.dynamic_slice_in_dim(src, start, c, k, allow_negative_indices=False)
                envl[v] = jax.device_put(s, DEVICE) if v in self.host else s
            _run_eqns(jaxpr, part.eqns, envl, chunk_shape)
            new = []
            for acc, v in zip(carry, part.outputs, strict=True):
                y = envl[v] if v in self.to_device else jax.device_put(envl[v], HOST)
                new.append(
                    jax.lax.dynamic_update_slice_in_dim(
                        acc, y, start, k, allow_negative_indices=False
                    )
                )
            return tuple(new)

        init = []
        for u, v in zip(into, part.outputs, strict=True):
            if u is not None:
                init.append(big_vals[big.index(u)] if u in big else env[u])
                continue
            z = jnp.zeros(shape, v.aval.dtype)
            init.append(z if v in self.to_device else jax.device_put(z, HOST))
        outs = list(jax.lax.fori_loop(0, shape[k] // c, body, tuple(init)))
        self.written.update(v for v in part.outputs if v not in self.to_device)
        self.chain = outs
        return dict(zip(part.outputs, outs, strict=True))


def chunk_dim(spec: P, shape) -> int | None:
    """The first dimension of ``shape`` that ``spec`` leaves unsplit and that has more than
    one row (None when there is none)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return next((d for d, e in enumerate(entries) if e is None and shape[d] > 1), None)
