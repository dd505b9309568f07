"""Stage 3 per module for models as people write them (FSDP2's ``fully_shard``): a Python loop
of Linen blocks, an NNX list of layers.

``ZeRO(stage=3, units=r"block_\\d+")`` names the units by a pattern over the params' key paths;
each distinct path prefix the pattern matches (``block_0``, ``block_1``, ...; ``layers/0``, ...
for an ``nnx.List``) is one unit, and every leaf outside the units (embeddings, the final norm)
is gathered whole at the start of the loss as without ``units=``. The model is not changed.
Units may nest (``fully_shard`` on a sub-module, then on its parent): a leaf belongs to the
deepest unit named, and the parent's other weights, read before and after the sub-unit runs,
form two segments of the parent (:mod:`jaxzero.zero.unit_patterns`: the rule, the checks).

Inside the step the loss gets each unit's leaves as shards. :func:`run` traces the loss once to
a jaxpr with a marker where each unit leaf would be gathered, and evaluates that jaxpr
equation by equation under the step's own transformations. The equations that read a unit's
weights, from the first to the last with nothing of another unit between, form one *segment*;
each segment runs as a ``jax.checkpoint`` that

* all-gathers the unit's shards first (in ``param_dtype``, device-varying; the backward of that
  gather reduce-scatters the unit's gradient in ``reduce_dtype`` as soon as the segment's
  backward is done: :func:`jaxzero.zero.layers.gather_shard` / ``_gather_leaf``);
* saves for the backward whatever the model saves (activations; a user's ``nn.remat`` keeps its
  own policy) except the gathered weights and copies of them (a transpose, reshape or widening
  cast of a matrix is recomputed, not saved: Hugging Face's ``FlaxConv1D`` computes
  ``kernel.T``), which its backward gathers again (FSDP's ``reshard_after_forward=True``).

With ``ZeRO(prefetch=True)`` (the default) the segments from the first unit's to the last's
run instead as one custom VJP that prefetches across units and gathers the leaves outside the
units where they are read (:mod:`jaxzero.zero.unit_chain`); what follows is
``prefetch=False``.

Order (``0 * token`` added to each shard, and that token's cotangent): segment ``k + 1``'s
gather may start once segment ``k``'s weights are whole (XLA cannot fold every unit's gather
into one combined gather up front); segment ``k``'s backward starts once segment ``k + 1``'s
gradient is reduce-scattered (no two units' full gradients are held for one combined
reduce-scatter after the backward). Measured on the deviceless H100 compile
(docs/decisions/33-units.md): XLA overlaps the forward gathers with the unit's own compute, not
the previous unit's (the schedule is the same when the next gather must wait for this unit's
outputs), and the backward's gathers and the reduce-scatters are exposed, because
``jax.checkpoint``'s backward waits on every cotangent of its segment at once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from jaxzero._compat import JIT_PRIMITIVES, REMAT_PRIMITIVES
from jaxzero.zero import unit_chain
from jaxzero.zero.collectives import Comm
from jaxzero.zero.hooks import LossHook
from jaxzero.zero.jaxpr_eval import bind as _bind
from jaxzero.zero.jaxpr_eval import inline_calls
from jaxzero.zero.jaxpr_eval import is_remat as _is_remat
from jaxzero.zero.jaxpr_eval import read as _read
from jaxzero.zero.jaxpr_eval import reads as read_vars
from jaxzero.zero.jaxpr_eval import runs as _segments
from jaxzero.zero.layers import _gather_leaf, gather_shard
from jaxzero.zero.specs import spec_dim, subtree_mask
from jaxzero.zero.unit_patterns import (
    OUTSIDE,
    check,
    mask,
    patterns,
    prefetch_option,
    unit_names,
)
from jaxzero.zero.unit_patterns import warn_units_together as _warn_units_together

MARK = "jaxzero_unit_gather"
__all__ = ["build_plan", "check", "mask", "patterns", "prefetch_option", "run", "unit_names"]


def build_plan(
    comm: Comm, units: tuple[str, ...], local_params, specs, prefetch: bool = True, tables=()
) -> UnitPlan | None:
    """The :class:`UnitPlan` of a stage-3 step with ``units`` (None without), from the local
    params and their global ``specs``; with ``prefetch`` the leaves outside the units are
    gathered where they are read too (:data:`OUTSIDE`), except the ``vocab_parallel`` tables
    (``tables``: their names), which are never gathered."""
    if not units:
        return None
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    dims = [spec_dim(s) for s in flat_specs]
    names = unit_names(local_params, units, outside=prefetch)
    if tables:
        names = [
            None if t else u for u, t in zip(names, vocab_mask(local_params, tables), strict=True)
        ]
    return UnitPlan(comm, names, dims, prefetch=prefetch)


@dataclasses.dataclass
class UnitPlan(LossHook):
    """Per flat params leaf: its unit (None: not in a unit) and the dimension its shard was
    split on (None: replicated); ``segments``: how many segments the last trace ran. As a
    :class:`~jaxzero.zero.hooks.LossHook` it runs the loss unit by unit (:func:`run`)."""

    comm: Comm
    units: list[str | None]
    dims: list[int | None]
    segments: int = 0
    prefetch: bool = True

    def wrap(self, fn):
        return lambda params, *rest: run(self, fn, params, *rest)


def _marker(comm: Comm, d):
    def unit_gather(x):
        return gather_shard(comm, x, d)

    unit_gather.__name__ = MARK
    return jax.jit(unit_gather)


def _is_marker(eqn) -> bool:
    return eqn.primitive.name in JIT_PRIMITIVES and eqn.params.get("name") == MARK


def run(plan: UnitPlan, fn, params, *rest):
    """``fn(params, *rest)`` with each unit's leaves (shards in ``params``) gathered segment by
    segment (see the module docstring)."""
    leaves, treedef = jax.tree.flatten(params)

    def traced(leaves, rest):
        full = [
            x if u is None else _marker(plan.comm, d)(x)
            for x, u, d in zip(leaves, plan.units, plan.dims, strict=True)
        ]
        return fn(jax.tree.unflatten(treedef, full), *rest)

    closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(leaves, rest)
    flat = list(leaves) + jax.tree.leaves(rest)
    if any(_is_jit(e) for e in closed.jaxpr.eqns):  # a jitted loss (or model): inline it
        inline = lambda *a: inline_calls(closed.jaxpr, closed.consts, a, _is_jit)
        closed = jax.make_jaxpr(inline)(*flat)
    outs = _Evaluator(plan, closed.jaxpr, len(leaves)).run(closed.consts, flat)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def vocab_mask(params, tables) -> list[bool]:
    """Per flat leaf: under one of the ``vocab_parallel`` tables."""
    return jax.tree.leaves(subtree_mask(params, tables))


def _is_var(v) -> bool:
    return not isinstance(v, jcore.Literal)


def _is_jit(eqn) -> bool:
    """A nested ``jax.jit`` call that is not a unit's gather marker."""
    return eqn.primitive.name in JIT_PRIMITIVES and not _is_marker(eqn)


class _Evaluator:
    def __init__(self, plan: UnitPlan, jaxpr, n_params: int):
        self.plan, self.jaxpr = plan, jaxpr
        self.leaf_of = {v: i for i, v in enumerate(jaxpr.invars[:n_params])}
        self.lazy: dict = {}  # gathered var -> its leaf index
        self.eager: dict = {}  # outside leaves read by several segments: gathered at the start
        self.eqns = []
        for eqn in jaxpr.eqns:
            if _is_marker(eqn):
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

    def run(self, consts, args):
        env = dict(zip(self.jaxpr.constvars, consts, strict=True))
        env.update(zip(self.jaxpr.invars, args, strict=True))
        for v, i in self.eager.items():
            env[v] = _gather_leaf(self.plan.comm, env[self.jaxpr.invars[i]], self.plan.dims[i])
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
        across units (:mod:`jaxzero.zero.unit_chain`)."""
        facts = (self.eqns, self.lazy, self.last_use, self.defined_at, frozenset([OUTSIDE]))
        pieces = unit_chain.pieces(segments, *facts)
        hi = segments[-1][2]
        defined = dict.fromkeys(v for p in pieces for e in p.eqns for v in e.outvars)
        outs = [v for v in defined if self._live(v, hi)]
        dim_of = lambda v: self.plan.dims[self.lazy[v]]
        chain = unit_chain.Chain(self.plan.comm, pieces, dim_of, outs)
        shards = [env[self.jaxpr.invars[self.lazy[v]]] for v in chain.gathered]
        results = chain(shards, [env[v] for v in chain.ins])
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
        return _gather_leaf(self.plan.comm, shard if d is None else _after(shard, after), d)

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

    def _live(self, v, hi) -> bool:
        return not isinstance(v, jcore.DropVar) and self.last_use.get(v, -1) >= hi


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
