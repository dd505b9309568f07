"""The evaluator of ``units=``: the loss's jaxpr cut into unit segments (:class:`Segments`)
and run segment by segment, each gathering its unit's weights where it starts
(:class:`Evaluator`; the design is in :mod:`jaxzero.zero.units.plan`'s docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

import jaxzero.zero.units.chain as unit_chain
from jaxzero._compat import JIT_PRIMITIVES, REMAT_PRIMITIVES
from jaxzero.zero.collectives import Comm
from jaxzero.zero.jaxpr_eval import bind as _bind
from jaxzero.zero.jaxpr_eval import is_remat as _is_remat
from jaxzero.zero.jaxpr_eval import read as _read
from jaxzero.zero.jaxpr_eval import reads as read_vars
from jaxzero.zero.jaxpr_eval import runs as _segments
from jaxzero.zero.layers.plan import gather_leaf
from jaxzero.zero.units.patterns import OUTSIDE
from jaxzero.zero.units.patterns import warn_units_together as _warn_units_together

MARK = "jaxzero_unit_gather"


def is_marker(eqn) -> bool:
    return eqn.primitive.name in JIT_PRIMITIVES and eqn.params.get("name") == MARK


def is_jit(eqn) -> bool:
    """A nested ``jax.jit`` call that is not a unit's gather marker."""
    return eqn.primitive.name in JIT_PRIMITIVES and not is_marker(eqn)


def _is_var(v) -> bool:
    return not isinstance(v, jcore.Literal)


class Segments:
    """The loss's jaxpr cut into unit segments: which equations read which unit's weights
    (each gathered weight is lazy, a gather marker's output, or eager, an outside leaf that
    several segments read), the segments as runs of equations with one label, and where each
    variable is defined and last read. ``plan``: the step's :class:`~.plan.UnitPlan`."""

    def __init__(self, plan, jaxpr, n_params: int):
        self.plan, self.jaxpr = plan, jaxpr
        self.leaf_of = {v: i for i, v in enumerate(jaxpr.invars[:n_params])}
        self.lazy: dict = {}  # gathered var -> its leaf index
        self.eager: dict = {}  # outside leaves read by several segments: gathered at the start
        self.eqns = []
        for eqn in jaxpr.eqns:
            if is_marker(eqn):
                self.lazy[eqn.outvars[0]] = self.leaf_of[eqn.invars[0]]
            else:
                self.eqns.append(eqn)
        labels = self._labels()
        shared = self._shared_outside(_segments(labels))
        if shared:  # a tied embedding: one gather and one reduce-scatter, as without prefetch
            self.eager = {v: self.lazy.pop(v) for v in shared}
            labels = self._labels()
        self.segments = _segments(labels)
        _warn_units_together(self.eqns, labels)
        eqns = self.eqns
        last, self.defined_at = {}, {}
        for k, eqn in enumerate(eqns):
            for v in eqn.invars:
                if not isinstance(v, jcore.Literal):
                    last[v] = k
            self.defined_at.update((v, k) for v in eqn.outvars)
        for v in jaxpr.outvars:
            if not isinstance(v, jcore.Literal):
                last[v] = len(eqns)
        self.last_use = last

    def _labels(self) -> list[frozenset]:
        """Per equation: the units whose weights it reads (:meth:`_label`)."""
        self.unit_of = {v: self.plan.units[i] for v, i in self.lazy.items()}
        return [self._label(eqn) for eqn in self.eqns]

    def _shared_outside(self, segments) -> list:
        """The gathered leaves outside the units that more than one segment reads."""
        count: dict = {}
        for kind, lo, hi in segments:
            if kind is None:
                continue
            eqns = self.eqns[lo:hi]
            read = {v for e in eqns for v in e.invars if _is_var(v) and v in self.lazy}
            for v in read:
                if self.plan.units[self.lazy[v]] == OUTSIDE:
                    count[v] = count.get(v, 0) + 1
        return [v for v, c in count.items() if c > 1]

    def _label(self, eqn) -> frozenset:
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        units = frozenset(self.unit_of[v] for v in ins if v in self.unit_of)
        if len(units) == 1 and ins and all(v in self.unit_of for v in ins):
            for v in eqn.outvars:  # computed from one unit's weights only: part of the unit
                self.unit_of[v] = next(iter(units))
        return units

    def _live(self, v, hi) -> bool:
        return not isinstance(v, jcore.DropVar) and self.last_use.get(v, -1) >= hi


class Evaluator(Segments):
    """Runs the cut jaxpr (:class:`Segments`) under the caller's transformations, each unit
    segment as a ``jax.checkpoint`` that gathers its weights first, or the units together as
    one prefetching chain (:mod:`.chain`); see :mod:`.plan`'s docstring."""

    def run(self, consts, args, accs):
        """The loss's outputs from ``consts`` and ``args`` (the params' leaves first);
        ``accs``: per params leaf, its host gradient sum over the earlier micro-batches (None
        at the first, or where nothing is summed on the host)."""
        env = dict(zip(self.jaxpr.constvars, consts, strict=True))
        env.update(zip(self.jaxpr.invars, args, strict=True))
        self.accs = accs
        for v, i in self.eager.items():
            shard, d = env[self.jaxpr.invars[i]], self.plan.dims[i]
            if self.plan.sums.summing:  # its gradient added into its host accumulator
                env[v] = unit_chain.gathered_into_sum(self.plan.comm, shard, d, accs[i])
            else:  # fetched: its gradient goes back there
                env[v] = gather_leaf(self.plan.comm, unit_chain.fetched(shard), d)
        self.plan.segments = 0
        self.tokens: list = []  # per segment run: a scalar of its first gathered weight
        segments = self.segments
        if self.plan.prefetch:
            units = [k for k, (kind, _, _) in enumerate(segments) if kind]
            first, last = units[0], units[-1] + 1
            for _, lo, hi in segments[:first]:
                for eqn in self.eqns[lo:hi]:
                    _bind(eqn, env)
            self._chain(env, segments[first:last])
            segments = segments[last:]
        for kind, lo, hi in segments:
            if kind is None:
                for eqn in self.eqns[lo:hi]:
                    _bind(eqn, env)
            else:
                self._segment(env, lo, hi)
        return [_read(env, v) for v in self.jaxpr.outvars]

    def _chain(self, env, segments):
        """The segments from the first unit's to the last's as one custom VJP that prefetches
        across units (:mod:`jaxzero.zero.units.chain`)."""
        facts = (self.eqns, self.lazy, self.last_use, self.defined_at, frozenset([OUTSIDE]))
        pieces = unit_chain.pieces(segments, *facts)
        hi = segments[-1][2]
        defined = dict.fromkeys(v for p in pieces for e in p.eqns for v in e.outvars)
        outs = [v for v in defined if self._live(v, hi)]
        dim_of = lambda v: self.plan.dims[self.lazy[v]]
        chain = unit_chain.Chain(self.plan.comm, pieces, dim_of, outs, self.plan.sums.summing)
        shards = [env[self.jaxpr.invars[self.lazy[v]]] for v in chain.gathered]
        accs = [self.accs[self.lazy[v]] for v in chain.gathered]
        results = chain(shards, [env[v] for v in chain.ins], accs)
        env.update(zip(outs, results, strict=True))
        self.plan.segments += len(chain.units)

    def _segment(self, env, lo, hi):
        eqns = self.eqns[lo:hi]
        reads = read_vars(eqns)
        gathered = [v for v in reads if v in self.lazy]
        ins = [v for v in reads if v not in self.lazy]
        outs = [v for v in dict.fromkeys(v for e in eqns for v in e.outvars) if self._live(v, hi)]
        values = [env[self.jaxpr.invars[self.lazy[v]]] for v in gathered]
        shards = dict(zip(gathered, values, strict=True))
        after = self.tokens[-1] if self.tokens else None  # order: see the module docstring
        if all(_is_remat(e) for e in eqns if any(v in self.lazy for v in e.invars)):
            # nn.remat'd blocks: each gathers inside itself, under its own policy
            local, token = {v: env[v] for v in ins}, None
            for eqn in eqns:
                if _is_remat(eqn) and any(v in self.lazy for v in eqn.invars):
                    tok = self._remat(eqn, local, shards, after)
                    token = tok if token is None else token
                else:
                    _bind(eqn, local)
            env.update((v, local[v]) for v in outs)
        else:

            def body(shard_values, values, after):
                local = dict(zip(ins, values, strict=True))
                for v, x in zip(gathered, shard_values, strict=True):
                    local[v] = self._gather(v, x, after)
                for eqn in eqns:
                    _bind(eqn, local)
                return [local[v] for v in outs], self._token(gathered, local)

            results, token = jax.checkpoint(body, policy=_not_gathered)(
                [shards[v] for v in gathered], [env[v] for v in ins], after
            )
            env.update(zip(outs, results, strict=True))
        self.tokens.append(token)
        self.plan.segments += 1

    def _gather(self, v, shard, after):
        """The gathered weight ``v`` from its shard, not before ``after`` (:func:`_after`); the
        backward reduce-scatters its gradient. A replicated leaf (no dimension divisible by N,
        decision 3) is not gathered, so nothing orders it: it enters as it is, device-invariant
        over the data axis, and its backward all-reduces its gradient back to that type (a
        device-varying token added to it would make the input varying and the all-reduced
        gradient's type differ from it: jax refuses such a custom VJP)."""
        d = self.plan.dims[self.lazy[v]]
        return gather_leaf(self.plan.comm, shard if d is None else _after(shard, after), d)

    def _token(self, gathered, local):
        """:func:`_token` of the segment's first gathered weight that was sharded (the one
        whose gather orders the next segment's), or of its first weight when none was."""
        sharded = [v for v in gathered if self.plan.dims[self.lazy[v]] is not None]
        return _token(self.plan.comm, local[(sharded or gathered)[0]])

    def _remat(self, eqn, env, shards, after):
        """A model's own ``jax.checkpoint`` equation, re-bound with the gathers of the unit
        weights it reads moved inside it (its backward gathers them again); returns the
        token of its first gathered weight."""
        inner = eqn.params["jaxpr"]
        lazy = [v for v in eqn.invars if v in self.lazy]
        rest = [v for v in eqn.invars if v not in self.lazy]

        def body(shard_values, values, after):
            local = dict(
                zip(
                    lazy,
                    (self._gather(v, x, after) for v, x in zip(lazy, shard_values, strict=True)),
                    strict=True,
                )
            )
            local.update(zip(rest, values, strict=True))
            inner_env = {
                iv: _read(local, ov) for iv, ov in zip(inner.invars, eqn.invars, strict=True)
            }
            for e in inner.eqns:
                _bind(e, inner_env)
            return [_read(inner_env, v) for v in inner.outvars], self._token(lazy, local)

        remat = jax.checkpoint(
            body, policy=eqn.params.get("policy"), prevent_cse=eqn.params.get("prevent_cse", True)
        )
        out, token = remat([shards[v] for v in lazy], [_read(env, v) for v in rest], after)
        env.update(zip(eqn.outvars, out, strict=True))
        return token


_LAYOUT = ("transpose", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "copy", "copy_p")
_NOT_SAVED = ("all_gather", "all_gather_invariant", *REMAT_PRIMITIVES)


def _token(comm: Comm, w):
    """One element of a gathered weight: what the next segment's gather waits for. On a
    hybrid mesh it is made replica-invariant (a one-element all-reduce over the replica
    axes), as the shards it orders are."""
    t = jax.lax.slice(w.reshape(-1), (0,), (1,)).astype(jnp.float32)
    if comm.replica_axes:
        t = jax.lax.psum(t, comm.replica_axes)
    return t


def _after(shard, token):
    """``shard``, not read before ``token`` (the previous segment's weights) exists: XLA
    cannot combine its gather with that segment's. In the backward the token's cotangent is a
    sum of its reduced gradient (times zero), so the previous segment's backward starts once
    this segment's gradient is reduce-scattered: XLA cannot hold every unit's full gradient
    for one combined reduce-scatter after the backward. A data dependency (adding
    ``0 * token``, which XLA does not fold for floats), not an optimization barrier: XLA:GPU
    drops barriers before its collective combiners run (with the recommended 1 GB all-gather
    threshold every unit's gather became one). Inside the segment, so the residual is the
    shard itself."""
    if token is None:
        return shard
    return shard + (token[0] * 0).astype(shard.dtype)


def _not_gathered(prim, *avals, **params) -> bool:
    """Save what the model saves, except the gathered weights (the all-gather's outputs) and
    copies of them: a transpose, reshape, broadcast or widening cast of a matrix (or larger) is
    recomputed from its input instead of saved (a model's ``kernel.T`` or
    ``kernel.astype(dtype)`` would otherwise keep a full-size copy of the unit's weights for the
    backward; on an activation it saves the same bytes or fewer, as the input is saved
    instead). A vector's copy (a norm's scale reshaped) is saved: a few bytes, and no second
    gather. A model's own ``jax.checkpoint`` (``nn.remat``) inside a segment keeps its policy:
    its outputs are not saved here either, so it recomputes what it chose to."""
    copy = prim.name in _LAYOUT or (
        prim.name == "convert_element_type"  # a narrowing cast is smaller than its input
        and jnp.dtype(params["new_dtype"]).itemsize >= avals[0].dtype.itemsize
    )
    if copy:
        return avals[0].ndim < 2
    return prim.name not in _NOT_SAVED
