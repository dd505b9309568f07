"""Evaluating a jaxpr equation by equation under the caller's transformations, as
``jax.core.eval_jaxpr`` does, keeping each equation's source line and module name stack
(profiles and :func:`jaxzero.precision.warn_wide_compute` name the model's modules, not the
evaluator). Used by ``units=`` (:mod:`jaxzero.zero.units`, :mod:`jaxzero.zero.units.chain`)."""

from __future__ import annotations

from jax.extend import core as jcore
from jax.extend import source_info_util

from jaxzero._compat import REMAT_PRIMITIVES, bind_params, call_jaxpr


def read(env, v):
    """``v``'s value: a literal's, or ``env``'s."""
    return v.val if isinstance(v, jcore.Literal) else env[v]


def reads(eqns) -> list:
    """The variables ``eqns`` read that they do not define, in first-read order."""
    defined = {v for e in eqns for v in e.outvars}
    out: dict = {}
    for e in eqns:
        out.update((v, None) for v in e.invars if not isinstance(v, jcore.Literal))
    return [v for v in out if v not in defined]


def bind(eqn, env) -> None:
    """``eqn`` bound on its inputs in ``env``, its outputs written to ``env``."""
    info = eqn.source_info
    names = source_info_util.current_name_stack() + info.name_stack
    with source_info_util.user_context(info.traceback, name_stack=names):
        ans = eqn.primitive.bind(*[read(env, v) for v in eqn.invars], **bind_params(eqn))
    outs = ans if eqn.primitive.multiple_results else [ans]
    for v, x in zip(eqn.outvars, outs, strict=True):
        env[v] = x


def is_remat(eqn) -> bool:
    """A ``jax.checkpoint`` (``nn.remat``) equation."""
    return eqn.primitive.name in REMAT_PRIMITIVES and "jaxpr" in eqn.params


def bind_unrematted(eqn, env) -> None:
    """:func:`bind`, with a ``jax.checkpoint`` equation (and those nested in it) evaluated
    inline: under a caller that already recomputes the equation for its backward, the
    checkpoint would recompute it a second time."""
    if not is_remat(eqn):
        bind(eqn, env)
        return
    inner = eqn.params["jaxpr"]
    local = {iv: read(env, ov) for iv, ov in zip(inner.invars, eqn.invars, strict=True)}
    for e in inner.eqns:
        bind_unrematted(e, local)
    for v, ov in zip(eqn.outvars, inner.outvars, strict=True):
        env[v] = read(local, ov)


def inline_calls(jaxpr, consts, args, is_call):
    """``jaxpr`` evaluated with every nested call that ``is_call(eqn)`` accepts evaluated
    inline (recursively). ``units=`` inlines nested ``jax.jit`` calls, so that the units'
    equations stand at the top level where they are segmented (a jitted loss was one
    equation: every unit in one segment). Inlining a jit call changes no value; other calls
    (``jax.checkpoint``, ``custom_vjp``) keep their meaning and stay whole."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        if is_call(eqn):
            inner, consts = call_jaxpr(eqn)
            outs = inline_calls(inner, consts, [read(env, v) for v in eqn.invars], is_call)
            env.update(zip(eqn.outvars, outs, strict=True))
        else:
            bind(eqn, env)
    return [read(env, v) for v in jaxpr.outvars]


def runs(labels) -> list[tuple[frozenset | None, int, int]]:
    """``(units or None, start, stop)`` runs over the equations: a segment from an equation
    that reads one unit's weights to the last one that reads them with no other unit's
    equation between; equations that read no unit weights between segments run on their own
    (None)."""
    out: list = []
    cur, start, tail = None, 0, 0  # tail: one past cur's last equation that read its units
    for k, units in enumerate(labels):
        if not units:
            continue
        if units == cur:
            tail = k + 1
            continue
        if cur is not None:
            out.append((cur, start, tail))
        if tail < k:
            out.append((None, tail, k))
        cur, start, tail = units, k, k + 1
    if cur is not None:
        out.append((cur, start, tail))
    if tail < len(labels):
        out.append((None, tail, len(labels)))
    return out
