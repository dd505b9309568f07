"""Prefetch across units: the chain of ``units=`` segments as one ``jax.custom_vjp``
(MaxText's ``prefetch_fsdp_weights``; FSDP2's forward and backward prefetch).

:mod:`jaxzero.zero.units` cuts the loss's jaxpr into *pieces*: a segment per unit (the
equations that read its weights) and the equations between them. With
``ZeRO(units=..., prefetch=True)`` the pieces from the first unit's to the last unit's run as
one custom VJP whose

* **forward** gathers unit ``k + 1``'s shards while unit ``k`` computes (the gather waits for
  unit ``k``'s weights and its input, so at most two units are gathered at a time and no two
  gathers can be combined), runs each piece, and saves only each piece's inputs (the
  activations at the unit boundaries) and the last unit's gathered weights (FSDP2 does not
  reshard the last unit after its forward: its backward comes next);
* **backward** walks the pieces in reverse: it recomputes unit ``k`` from its saved input
  (``jax.vjp``, a model's own ``nn.remat`` inlined: it would recompute a second time), gathers
  unit ``k - 1``'s shards under unit ``k``'s backward (once unit ``k``'s cotangent, weights and
  recomputed output exist, and unit ``k + 1``'s gradient is reduced: not hoisted to the
  start) and reduce-scatters unit ``k``'s weight gradient, which must be reduced before unit
  ``k - 1``'s is (so it runs under unit ``k - 1``'s recompute and is not combined with it).
  XLA:GPU keeps one collective in flight at a time: with the gather free to start before the
  recompute, jax 0.12's scheduler gave it the whole unit and left the reduce-scatter exposed
  (16 x 2048 GPT at N = 64: 0.66 of the bytes hidden, 0.94 in this order; decision 49). At
  most three units' worth are live: W(k), W(k - 1) and dW(k).

Every order is a data dependency (``0 * token`` added to the next collective's input, which
XLA does not fold for floats; :func:`after`), not an ``optimization_barrier``: XLA:GPU drops
barriers before its collective combiners run. Nothing here is differentiated, so the tokens
have no backward. Each piece is recomputed in the backward (the model's own remat policy is
not kept: FLOPs of one more forward for a model that does not remat, none for one that
remats every block); only the pieces' inputs are saved for it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxzero.mesh import in_host_memory, to_varying, varying_axes
from jaxzero.zero.collectives import gather_after_recompute, reduce_leaves
from jaxzero.zero.jaxpr_eval import bind, bind_unrematted
from jaxzero.zero.jaxpr_eval import reads as read_vars
from jaxzero.zero.layers.plan import gather_leaf, gather_shard
from jaxzero.zero.offload.sums import add_on_host
from jaxzero.zero.wire.encodings import Exact


def fetched(x):
    """``x`` in device memory (fetched when it lives in host memory: parameter offload)."""
    return jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x


def token(values):
    """A one-element float32 that exists once every array of ``values`` does (the sum of
    their first elements): what the next collective waits for."""
    t = [jax.lax.slice(x.reshape(-1), (0,), (1,)).astype(jnp.float32) for x in values]
    return sum(t[1:], t[0])


def finite_token(values):
    """A one-element float32, zero, that exists once the first array of ``values`` does (its
    first element times 0, that element taken as 0 where it is not finite, so the product is
    an exact +0); a zero constant when ``values`` holds no element."""
    arrays = [x for x in values if jnp.size(x) > 0]
    if not arrays:
        return jnp.zeros((1,), jnp.float32)
    t = jax.lax.slice(arrays[0].reshape(-1), (0,), (1,)).astype(jnp.float32)
    return jnp.abs(jnp.where(jnp.isfinite(t), t, 0)) * 0


def after(x, tok):
    """``x``, not read before ``tok`` exists: ``x + 0 * tok`` (XLA does not fold it for
    floats, so it is a data dependency the collective combiners and the scheduler keep)."""
    if tok is None:
        return x
    return x + (tok[0] * 0).astype(x.dtype)


def barrier(values: list, ties: list) -> list:
    """``values``, not read before every array of ``ties`` exists, and not merged (CSE) with
    copies computed before: an ``optimization_barrier`` over both, here where it stays (a
    gradient's reduce-scatter waiting for the previous one, a recompute for its cotangent;
    a ``0 * token`` added instead would be fused into the gemm that computes the value and
    make the gemm wait). Only the values device-varying over every axis some tie varies
    over go through it: the barrier types its outputs varying over the union of its inputs'
    axes, which would change the others' type."""
    if not ties:
        return values
    axes = set().union(*(varying_axes(t) for t in ties))
    idx = [k for k, x in enumerate(values) if axes <= set(varying_axes(x))]
    if not idx:
        return values
    tied, _ = jax.lax.optimization_barrier(([values[k] for k in idx], ties))
    out = list(values)
    for k, x in zip(idx, tied, strict=True):
        out[k] = x
    return out


# XLA:GPU's default all-gather combine threshold (xla_gpu_all_gather_combine_threshold_bytes):
# XLA combines the per-leaf gathers of a unit up to this size into one all-gather itself, so
# only a larger unit is gathered flat (which costs a copy of it).
COMBINED = 30 * 1024 * 1024


def gather_flat(comm, shards: list, dims: list, tok=None) -> list:
    """``shards`` (a unit's leaves) gathered as :func:`~jaxzero.zero.layers.gather_shard`
    gathers each along its ``dims`` entry (None: replicated, only cast), with ONE all-gather
    (FSDP2's copy-in): the sharded ones cast to the compute dtype, flattened and concatenated,
    all-gathered into [N, total], and each leaf's columns put back along its dimension
    (exact: only copies; the gathered buffer and its copies are alive together, one unit more
    than one gather per leaf holds). XLA's all-gather combiner would otherwise split a unit
    larger than its threshold (30 MiB by default) into several gathers, of which the scheduler
    hides only those it can start early (docs/decisions/39-flags-for-a-plain-script.md)."""
    out: list = [None] * len(dims)
    split = [k for k, d in enumerate(dims) if d is not None]
    for k, d in enumerate(dims):
        if d is None:
            out[k] = gather_shard(comm, shards[k], None)
    if not split:
        return out
    parts = [shards[k].astype(comm.param_dtype).reshape(-1) for k in split]
    flat = after(jnp.concatenate(parts) if len(parts) > 1 else parts[0], tok)
    every = jax.lax.all_gather(flat, comm.axis, axis=0, tiled=False)  # [N, total]
    n, at = every.shape[0], 0
    for k, part in zip(split, parts, strict=True):
        x, d = shards[k], dims[k]
        y = every[:, at : at + part.size].reshape((n,) + x.shape)
        at += part.size
        y = jnp.moveaxis(y, 0, d).reshape(x.shape[:d] + (n * x.shape[d],) + x.shape[d + 1 :])
        out[k] = to_varying(y, comm.batch_axes)
    return out


def _float(v) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.inexact)


@dataclasses.dataclass
class Piece:
    """A run of the loss's equations: a unit's segment (``gathered``: the gathered weights it
    reads) or the equations between two units (none). ``reads``: the other values it reads
    (defined before it); ``outs``: what it defines that is read after it; ``source``: the
    read defined last before it (its input activation; None when it reads only the loss's
    arguments); ``in_unit``: it reads a unit's weights, not only leaves outside the units."""

    eqns: list
    gathered: list
    reads: list
    outs: list
    source: object
    in_unit: bool = True  # reads a unit's weights (not only those outside the units)

    @property
    def unit(self) -> bool:
        return bool(self.gathered)


def pieces(segments, eqns, lazy, last_use, defined_at, outside=frozenset()) -> list[Piece]:
    """The :class:`Piece` of each ``(units, lo, hi)`` segment (``outside``: the name of the
    leaves outside the units, which do not make a piece a unit's)."""
    out = []
    for kind, lo, hi in segments:
        run = eqns[lo:hi]
        outside_reads = read_vars(run)
        gathered = [v for v in outside_reads if v in lazy]
        reads = [v for v in outside_reads if v not in lazy]
        outs = [
            v
            for v in dict.fromkeys(v for e in run for v in e.outvars)
            if not isinstance(v, jcore.DropVar) and last_use.get(v, -1) >= hi
        ]
        sources = [v for v in reads if _float(v) and defined_at.get(v, -1) >= 0]
        source = max(sources, key=lambda v: defined_at[v]) if sources else None
        out.append(Piece(run, gathered, reads, outs, source, bool(kind and kind - outside)))
    return out


class Chain:
    """The pieces from the first unit's to the last unit's, as one custom VJP (see the module
    docstring). ``shard_of(v)``: the shard (a loss argument) of gathered weight ``v``;
    ``dim_of(v)``: the dimension it is gathered on (None: a replicated leaf, not gathered);
    ``summing``: each unit's reduced gradient is added into its host accumulator over
    micro-batches (the params offloaded, ``accum_steps > 1``: decision 42)."""

    def __init__(self, comm, chain: list[Piece], dim_of, chain_outs, summing: bool = False):
        self.comm, self.pieces, self.dim_of = comm, chain, dim_of
        self.summing = summing
        self.units = [i for i, p in enumerate(chain) if p.unit]
        # the weights of the last unit and of what follows it are kept for their backward
        last = max((i for i in self.units if chain[i].in_unit), default=self.units[-1])
        self.kept = [i for i in self.units if i >= last]
        self.gathered = list(dict.fromkeys(v for p in chain for v in p.gathered))
        defined = {v for p in chain for e in p.eqns for v in e.outvars}
        self.ins = list(dict.fromkeys(v for p in chain for v in p.reads if v not in defined))
        self.saved = list(dict.fromkeys(v for p in chain for v in p.reads))
        self.outs = chain_outs
        # params offloaded on one device: each unit fetched after the previous one's token, and
        # each unit's reduction after the previous unit's gradient left for the host; else XLA
        # fetches every unit at once and sends every gradient at the end (FlaxLlama 6 x 1024 at
        # N = 1: 200 -> 96 MB). With several devices these orders serialise the collectives
        # (at N = 8: AG 0.91 -> 0.45 hidden, RS 0.83 -> 0), so there they are left out
        # (decision 42).
        self._one = comm.num_batch_shards == 1
        # the piece whose backward reduces a weight's gradient last (the backward runs the
        # pieces in reverse): there a micro-batch's gradient is complete, and summed
        self.last_reduced = {v: i for i in reversed(range(len(chain))) for v in chain[i].gathered}

    def __call__(self, shards, ins, accs):
        """The chain's outputs from the gathered weights' ``shards`` and its other inputs
        ``ins``; ``accs``: each weight's host gradient sum over the earlier micro-batches
        (None at the first, and without ``summing``), not differentiated."""
        fn = jax.custom_vjp(lambda s, i, a: self._forward(s, i, a)[0])
        fn.defvjp(self._forward, self._backward)
        return fn(shards, ins, accs)

    # -- gathers ---------------------------------------------------------------------------
    def _gather(self, i, shard_of, tok):
        """Piece ``i``'s weights gathered, not before ``tok``: on an exact wire, when they
        are more than XLA's default combine threshold (:data:`COMBINED`), its sharded leaves
        in one flat all-gather (:func:`gather_flat`), else one gather per leaf."""
        vs = self.pieces[i].gathered
        if not isinstance(self.comm.wire.weights, Exact) or self._bytes(vs, shard_of) <= COMBINED:
            return self._gather_per_leaf(i, shard_of, tok)
        return gather_flat(self.comm, [shard_of[v] for v in vs], [self.dim_of(v) for v in vs], tok)

    def _bytes(self, vs, shard_of) -> int:
        """The gathered bytes of the sharded leaves among ``vs``."""
        n, size = jax.lax.axis_size(self.comm.axis), jnp.dtype(self.comm.param_dtype).itemsize
        return sum(n * shard_of[v].size * size for v in vs if self.dim_of(v) is not None)

    def _gather_per_leaf(self, i, shard_of, tok):
        """Piece ``i``'s weights gathered one all-gather per leaf, not before ``tok``."""
        out = []
        for v in self.pieces[i].gathered:
            d = self.dim_of(v)
            shard = shard_of[v]
            if in_host_memory(shard) and tok is not None and self._one:  # not fetched before tok
                shard, _ = jax.lax.optimization_barrier((shard, tok))
            shard = fetched(shard)  # from host memory with the params offloaded
            x = shard if d is None else after(shard, tok)
            out.append(gather_shard(self.comm, x, d))
        return out

    def _next_unit(self, i, step):
        k = self.units.index(i) + step
        return self.units[k] if 0 <= k < len(self.units) else None

    # -- forward ---------------------------------------------------------------------------
    def _forward(self, shards, ins, accs):
        # a later micro-batch fetches no weight before the earlier ones' sums are written:
        # else XLA runs its forward under the previous backward, holding both
        shards = barrier(list(shards), [a for a in accs if a is not None])
        shard_of = dict(zip(self.gathered, shards, strict=True))
        env = dict(zip(self.ins, ins, strict=True))
        weights = {self.units[0]: self._gather(self.units[0], shard_of, None)}
        saved = {}
        for i, p in enumerate(self.pieces):
            saved.update((v, env[v]) for v in p.reads if v not in saved)
            if p.unit:
                nxt = self._next_unit(i, 1)
                if nxt is not None:  # unit k + 1 gathered under unit k's compute
                    tie = weights[i] + ([env[p.source]] if p.source is not None else [])
                    weights[nxt] = self._gather(nxt, shard_of, token(tie))
                env.update(zip(p.gathered, weights[i], strict=True))
            for eqn in p.eqns:
                bind(eqn, env)
            if p.unit:
                for v in p.gathered:
                    del env[v]
                if i not in self.kept:
                    del weights[i]
        res = ([saved[v] for v in self.saved], [weights[i] for i in self.kept], shards, accs)
        return [env[v] for v in self.outs], res

    # -- backward --------------------------------------------------------------------------
    def _backward(self, res, cts):
        saved_values, last_weights, shards, accs = res
        shard_of = dict(zip(self.gathered, shards, strict=True))
        acc_of = dict(zip(self.gathered, accs, strict=True))
        value = dict(zip(self.saved, saved_values, strict=True))
        ct = {v: c for v, c in zip(self.outs, cts, strict=True) if _float(v) and c is not None}
        grads: dict = {}
        weights = dict(zip(self.kept, last_weights, strict=True))
        reduced, sent = None, []  # token of the last unit's reduced gradients; sent to host
        for i in reversed(range(len(self.pieces))):
            p = self.pieces[i]
            outs = [v for v in p.outs if _float(v)]
            out_cts = [ct.pop(v, None) for v in outs]
            for v in p.outs:
                ct.pop(v, None)
            xs = [v for v in p.reads if _float(v)]
            fixed = {v: value[v] for v in p.reads if not _float(v)}
            w = weights.pop(i) if p.unit else []
            prev = self._next_unit(i, -1) if p.unit else None
            prefetch = prev is not None and prev not in weights

            def piece(w, x, p=p, fixed=fixed, xs=xs, outs=outs):
                env = dict(fixed)
                env.update(zip(xs, x, strict=True))
                env.update(zip(p.gathered, w, strict=True))
                for eqn in p.eqns:
                    bind_unrematted(eqn, env)
                return [env[v] for v in outs]

            given = [c for c in out_cts if c is not None]
            w, x = barrier(w, given), barrier([value[v] for v in xs], given)
            primal, vjp = jax.vjp(piece, w, x)
            if prefetch:  # under unit k's backward gemms (after its recompute, at large N)
                tie = w + given + ([reduced] if reduced is not None else [])
                tok = token(tie)
                if gather_after_recompute(self.comm):
                    tok = tok + finite_token(primal)
                weights[prev] = self._gather(prev, shard_of, tok)
            out_cts = [
                jnp.zeros_like(y) if c is None else c for y, c in zip(primal, out_cts, strict=True)
            ]
            dw, dxs = vjp(out_cts)
            for v, g in zip(xs, dxs, strict=True):
                ct[v] = g if v not in ct else ct[v] + g
            if p.unit:
                before = [reduced, *sent]
                reduced, sent = self._reduce(i, dw, shard_of, acc_of, grads, before)
        return [grads[v] for v in self.gathered], [ct.get(v) for v in self.ins], None

    def _reduce(self, i: int, dw, shard_of, acc_of, grads, before):
        """Reduce-scatter piece ``i``'s weight gradients ``dw`` after ``before`` (the previous
        unit's token and the gradients it sent to host memory, which must have left the
        device first: else XLA completes every copy at the end and holds every unit's
        gradient); returns their token and those of them sent to host memory. With
        ``summing``, a weight's gradient, once complete, is added into its host accumulator
        (``acc_of``) instead of written over its params."""
        p = self.pieces[i]
        ties = [t for t in before if t is not None]
        dw = [barrier([g], ties)[0] for g in dw]
        dims = [self.dim_of(v) for v in p.gathered]
        out = []
        for v, r in zip(p.gathered, reduce_leaves(self.comm, dw, dims), strict=True):
            r = r.astype(shard_of[v].dtype)
            total = r if v not in grads else fetched(grads[v]) + r
            if self.summing and self.last_reduced[v] == i:
                grads[v] = add_on_host(acc_of[v], total, self.comm.output_dtype)
            elif in_host_memory(shard_of[v]):  # each unit's gradient leaves the device at once
                grads[v] = jax.device_put(total, jax.memory.Space.Host)
            else:
                grads[v] = total
            out.append(r)
        return token(out), [grads[v] for v in p.gathered if in_host_memory(grads[v]) and self._one]


def gathered_into_sum(comm, shard, d, acc):
    """``shard`` (in host memory) fetched and gathered along ``d`` (None: replicated) as
    :func:`~jaxzero.zero.layers.plan.gather_leaf` gathers it, whose gradient, reduced as
    that gather's transpose reduces it, is added into ``acc``, its host accumulator over the
    earlier micro-batches (None at the first; decision 42): a leaf outside the units that
    several segments read (a tied embedding), gathered once for all of them."""

    def fwd(shard, acc):
        whole, pull = jax.vjp(lambda x: gather_leaf(comm, x, d), fetched(shard))
        return whole, (pull, acc)

    def bwd(res, ct):
        pull, acc = res
        (g,) = pull(ct)
        return add_on_host(acc, g, comm.output_dtype), None

    fn = jax.custom_vjp(lambda shard, acc: fwd(shard, acc)[0])
    fn.defvjp(fwd, bwd)
    return fn(shard, acc)
