"""Any optax chain on the host: a function traced as on the device, then evaluated equation by
equation with every array it creates moved into host memory beside its inputs (decision 32).

Inside ``compute_on("device_host")`` the inputs of the offloaded update are typed
``float32<host>``, but an array that the traced code creates (``jnp.zeros_like``, a
broadcast scalar, ``leaf.imag`` of a real leaf) is typed device memory. jax refuses any
primitive that mixes the two ("memory_space of all inputs passed to `add` must be the
same"), and a ``lax.cond`` whose branches differ in memory space. So ``clip_by_global_norm``,
LAMB, Adafactor and ``MultiSteps`` all failed with offload.

:func:`host_typed` traces ``fn`` once with device-typed abstract inputs, where every chain
traces. It then evaluates the jaxpr on the host-typed inputs. Before each primitive, the
device-typed operands of an equation that also reads host arrays move to host memory with
``jax.device_put``. On the host this is a relabelling: the array was computed there. Call
primitives (nested ``jit``, ``custom_jvp``/``custom_vjp`` calls, ``checkpoint``) are
evaluated inline. A ``cond`` evaluates every branch and selects the result, because the
branches' memory spaces differ and jax's ``cond`` inside ``compute_on`` is unreliable
(jax-ml/jax#23887). The outputs end in host memory.
"""

from __future__ import annotations

import jax

from jaxzero._compat import bind_params, call_jaxpr, memory_space_is_host

_HOST = jax.memory.Space.Host


def host_typed(fn):
    """``fn`` (a function of pytrees of arrays) evaluated with every array it creates in host
    memory beside its inputs: call it inside ``compute_on("device_host")``."""

    def run(*args):
        flat, tree = jax.tree.flatten(args)
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
        flat_fn = lambda *xs: fn(*jax.tree.unflatten(tree, xs))
        closed, shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
        outs = _evaluate(closed.jaxpr, closed.consts, flat)
        return jax.tree.unflatten(jax.tree.structure(shapes), [_to_host(x) for x in outs])

    return run


def _to_host(x):
    """A non-scalar device-typed array moved to host memory (scalars are typed neither)."""
    if jax.numpy.ndim(x) and not memory_space_is_host(x):
        return jax.device_put(x, _HOST)
    return x


def _aligned(values):
    """``values`` with the device-typed arrays moved to host memory when any is there."""
    if any(jax.numpy.ndim(x) and memory_space_is_host(x) for x in values):
        return [_to_host(x) for x in values]
    return values


def _evaluate(jaxpr, consts, args):
    env = {}
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        outs = _equation(eqn, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn, invals):
    inner = call_jaxpr(eqn)
    if inner is not None:  # a call: evaluated inline, its inner arrays moved the same way
        sub, consts = inner
        return _evaluate(sub, consts, invals)
    if eqn.primitive.name == "cond":
        index, *ops = invals
        branches = [_evaluate(b.jaxpr, b.consts, ops) for b in eqn.params["branches"]]
        return [
            jax.lax.select_n(index, *_aligned(list(outs))) if len(outs) > 1 else outs[0]
            for outs in zip(*branches, strict=True)
        ]
    ans = eqn.primitive.bind(*_aligned(invals), **bind_params(eqn))
    return ans if eqn.primitive.multiple_results else [ans]
