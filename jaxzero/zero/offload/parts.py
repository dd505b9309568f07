"""The offloaded update cut into parts that can stream: a function of pytrees traced once to a
flat jaxpr (calls inlined, ``cond`` as a select), then split into a prologue and independent
parts, one per group of leaves (decision 32).

Two leaves' updates are one part when a large value connects them. A small value (at most
:data:`SMALL` elements: a global norm, Adam's step count) that several parts read is computed
once, by the prologue, and handed to them; one that only a part's own values feed stays in it.
So ``clip_by_global_norm`` is a prologue of the norm and a part per leaf, Adam a part per leaf,
and a chain that mixes leaves through a large value (a flattened ``optax.flatten`` vector) is
one part. A part whose every large value has one shape and is computed elementwise
(``elementwise``) can run in chunks along its first dimension, and so can a full reduction of
a large value computed elementwise (:func:`reductions`: the prologue's norms and finite checks).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.extend.core import Var

from jaxzero._compat import call_jaxpr
from jaxzero.zero import jaxpr_eval

#: values of at most this many elements are small: computed where they are needed, or once
#: by the prologue when several parts need them
SMALL = 4096

#: primitives computed element by element (with scalar operands broadcast): a part made of
#: these runs in chunks
ELEMENTWISE = frozenset(
    "abs add and atan2 ceil clamp convert_element_type copy copy_p cos div eq erf exp exp2 "
    "expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg "
    "nextafter not or pow rem round rsqrt select_n sign sin sqrt square sub tan tanh xor".split()
)

#: reductions of every axis that :func:`reductions` offers to run in chunks: the chunks' values
#: combine by the reduction's monoid (add, max, min, and, or, multiply)
FULL_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_and reduce_or reduce_prod".split()
)


@dataclasses.dataclass(frozen=True)
class Part:
    """Equations (indices into the flat jaxpr, in order) and the values they read from
    outside (``inputs``: the jaxpr's inputs or the prologue's values) and give (``outputs``)."""

    eqns: tuple[int, ...]
    inputs: tuple[Var, ...]
    outputs: tuple[Var, ...]
    elementwise: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """A flat jaxpr cut into ``prologue`` and ``parts``."""

    jaxpr: jax.extend.core.ClosedJaxpr
    prologue: Part
    parts: tuple[Part, ...]


def flat_jaxpr(fn, avals):
    """``(closed jaxpr, output tree)`` of ``fn(*avals)`` with every call inlined and every
    ``cond`` evaluated as a select of its branches, so each equation is one primitive."""
    flat, tree = jax.tree.flatten(avals)
    flat_fn = lambda *xs: fn(*jax.tree.unflatten(tree, xs))
    closed, shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*flat)
    inline = lambda *xs: _inline(closed.jaxpr, closed.consts, list(xs))
    return jax.make_jaxpr(inline)(*flat), jax.tree.structure(shapes)


def _inline(jaxpr, consts, args):
    """``jaxpr`` evaluated with calls inlined and ``cond`` as a select of every branch."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        inner = call_jaxpr(eqn)
        ins = [jaxpr_eval.read(env, v) for v in eqn.invars]
        if inner is not None:
            outs = _inline(*inner, ins)
        elif eqn.primitive.name == "cond":
            index, *ops = ins
            branches = [_inline(b.jaxpr, b.consts, ops) for b in eqn.params["branches"]]
            outs = [
                jax.lax.select_n(index, *vals) if len(vals) > 1 else vals[0]
                for vals in zip(*branches, strict=True)
            ]
        else:
            jaxpr_eval.bind(eqn, env)
            continue
        env.update(zip(eqn.outvars, outs, strict=True))
    return [jaxpr_eval.read(env, v) for v in jaxpr.outvars]


def _size(v) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def big(v) -> bool:
    return isinstance(v, Var) and _size(v) > SMALL


def large(shape) -> bool:
    """Whether a value of ``shape`` is :func:`big` (streamed in rows or chunks)."""
    return math.prod(shape) > SMALL


class _Groups:
    """Union-find over jaxpr variables."""

    def __init__(self):
        self.parent = {}

    def find(self, v):
        self.parent.setdefault(v, v)
        while self.parent[v] is not v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


def _group(jaxpr):
    """``(groups, sources)``: the union-find of the large values and of the small values that
    equations on large values give, and for every other small value the grouped values that
    feed it (resolved to groups by :func:`_owners` once every union is made)."""
    groups, sources = _Groups(), {}
    for eqn in jaxpr.eqns:
        bigs = [v for v in (*eqn.invars, *eqn.outvars) if big(v)]
        if bigs:
            for v in (*bigs[1:], *eqn.outvars):
                groups.union(v, bigs[0])
            continue
        feed = frozenset().union(*(_sources(groups, sources, v) for v in eqn.invars))
        for v in eqn.outvars:
            sources[v] = feed
    return groups, sources


def _sources(groups, sources, v) -> frozenset:
    if not isinstance(v, Var):
        return frozenset()
    if v in groups.parent:
        return frozenset({v})
    return sources.get(v, frozenset())


def _owners(groups, sources, v) -> frozenset:
    """The groups that feed ``v`` (its own, for a grouped value)."""
    return frozenset(groups.find(x) for x in _sources(groups, sources, v))


def _slice(jaxpr, targets, stop) -> tuple[int, ...]:
    """Indices of the equations that compute ``targets`` from the values in ``stop``."""
    need, chosen = set(targets) - stop, []
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if any(v in need for v in eqn.outvars):
            chosen.append(i)
            need.update(v for v in eqn.invars if isinstance(v, Var) and v not in stop)
    return tuple(reversed(chosen))


def _inputs(jaxpr, eqns, stop) -> tuple[Var, ...]:
    """The values ``eqns`` read from outside (all in ``stop``, as :func:`_slice` cut them)."""
    return tuple(v for v in jaxpr_eval.reads([jaxpr.eqns[i] for i in eqns]) if v in stop)


def _elementwise(jaxpr, eqns) -> bool:
    shapes = set()
    for i in eqns:
        eqn = jaxpr.eqns[i]
        bigs = [v for v in (*eqn.invars, *eqn.outvars) if big(v)]
        if not bigs:
            continue
        shapes.update(v.aval.shape for v in bigs)
        if eqn.primitive.name == "broadcast_in_dim":
            if eqn.invars[0].aval.shape:
                return False
        elif eqn.primitive.name not in ELEMENTWISE:
            return False
        elif any(isinstance(v, Var) and not big(v) and v.aval.shape for v in eqn.invars):
            return False
    return len(shapes) == 1 and bool(next(iter(shapes)))


def plan(closed) -> Plan:
    """``closed`` (from :func:`flat_jaxpr`) cut into a prologue and independent parts."""
    jaxpr = closed.jaxpr
    groups, sources = _group(jaxpr)
    group_of = {}
    shared = set()  # small values a part reads that other parts feed: the prologue's
    for i, eqn in enumerate(jaxpr.eqns):
        bigs = [v for v in (*eqn.invars, *eqn.outvars) if big(v)]
        if not bigs:
            continue
        g = groups.find(bigs[0])
        group_of.setdefault(g, []).append(i)
        for v in eqn.invars:
            if isinstance(v, Var) and not big(v) and _owners(groups, sources, v) - {g}:
                shared.add(v)
    inputs = set(jaxpr.invars) | set(jaxpr.constvars)
    outs = {}  # group -> its outputs
    pro_out = []
    for v in jaxpr.outvars:
        if not isinstance(v, Var) or v in inputs:
            continue
        mine = _owners(groups, sources, v)
        if len(mine) == 1 and next(iter(mine)) in group_of:
            outs.setdefault(next(iter(mine)), []).append(v)
        elif v not in pro_out:
            pro_out.append(v)
    made = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    shared = tuple(sorted(shared, key=made.__getitem__))
    pro_eqns = _slice(jaxpr, (*shared, *pro_out), inputs)
    prologue = Part(pro_eqns, _inputs(jaxpr, pro_eqns, inputs), (*shared, *pro_out))
    stop = inputs | set(shared)
    parts = []
    for g in sorted(outs, key=lambda g: group_of[g][0]):
        eqns = _slice(jaxpr, outs[g], stop)
        parts.append(
            Part(eqns, _inputs(jaxpr, eqns, stop), tuple(outs[g]), _elementwise(jaxpr, eqns))
        )
    return Plan(closed, prologue, tuple(parts))


def _full_reduction(eqn) -> bool:
    x = eqn.invars[0]
    return (
        eqn.primitive.name in FULL_REDUCTIONS
        and big(x)
        and tuple(sorted(eqn.params["axes"])) == tuple(range(len(x.aval.shape)))
    )


def _chain(jaxpr, made, x) -> tuple[int, ...] | None:
    """The equations (of those in ``made``, ``{value: equation}``) that compute the large value
    ``x`` elementwise from large values they do not compute, in order; None when a large value
    on the way is not computed elementwise."""
    need, chosen = [x], set()
    while need:
        v = need.pop()
        if v in made and made[v] not in chosen:
            chosen.add(made[v])
            need.extend(u for u in jaxpr.eqns[made[v]].invars if big(u))
    eqns = tuple(sorted(chosen))
    return eqns if not eqns or _elementwise(jaxpr, eqns) else None


def reductions(jaxpr, part: Part, ok) -> dict[int, tuple[int, ...]]:
    """``{equation: its chain}`` for the full reductions in ``part`` that can run in chunks: each
    reduces every axis of a large value that its chain (equations of ``part``, see
    :func:`_chain`) computes elementwise from large values it reads from outside, which
    ``ok(those values)`` accepts. Every large value a chain computes or reads is read in
    ``part`` only by chosen chains and reductions, and is none of ``part``'s outputs: the other
    equations of ``part`` never need it whole."""
    made = {v: i for i in part.eqns for v in jaxpr.eqns[i].outvars}
    found = {}
    for i in part.eqns:
        eqn = jaxpr.eqns[i]
        if not _full_reduction(eqn):
            continue
        eqns = _chain(jaxpr, made, eqn.invars[0])
        if eqns is None:
            continue
        outside = [v for v in jaxpr_eval.reads([jaxpr.eqns[j] for j in eqns]) if big(v)]
        if ok(outside or [eqn.invars[0]]):
            found[i] = eqns
    while True:
        inside = set(found).union(*found.values())
        whole = {v for v in part.outputs if big(v)}
        for i in part.eqns:
            if i not in inside:
                whole.update(v for v in jaxpr.eqns[i].invars if big(v))
        drop = [
            i
            for i, eqns in found.items()
            if any(big(v) and v in whole for j in (*eqns, i) for v in jaxpr.eqns[j].invars)
        ]
        if not drop:
            return found
        for i in drop:
            del found[i]
