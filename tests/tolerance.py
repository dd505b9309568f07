"""The suite's one rule for how close a sharded run must land to plain single-device optax.

A tolerance picked by hand passes where it was picked and fails on another CPU: Adam divides by
``sqrt(v) + eps``, so a rounding of the gradient in its last bit moves an element of the update
by a share of the learning rate whatever the gradient's size, and XLA:CPU's vectorisation (so its
summation order) differs between CPUs and between jax releases. So the tolerance is measured
from the path's own rounding: the reference is run again with only the order of its sums
changed, the ways a data-parallel step changes it (the batch's rows reversed; the gradient as
the mean of ``n`` per-shard means, as the sharded step reduces it), and the tolerance is
:data:`SPREAD_MULTIPLE` times the largest distance between those exact references, never below
:data:`ULPS` float32 ulps of the largest floating value compared.

The references are plain ``jax.jit`` programs, compiled on jax 0.10 with XLA:CPU's elemental
fusion emitters (the compile option ``xla_cpu_use_fusion_emitters=False``), 4-5x faster to
compile than its default MLIR emitters. The steps compared against them compile as a user's do,
except in `make test`'s first pass, which compiles everything that way (tests/conftest.py).
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero._compat import compile_option_accepted

#: the tolerance, in multiples of the references' own spread (a sharded step's sums run in yet
#: another order: several such orders land within a few spreads of each other)
SPREAD_MULTIPLE = 8
#: the floor, in float32 ulps of the largest value compared (a path whose references agree
#: bit for bit still rounds its own sums once)
ULPS = 16


@functools.cache
def compiler_options() -> dict:
    """The references' compile options: XLA:CPU's elemental fusion emitters where this XLA has
    the choice (jax 0.10's; jax 0.12's has only the MLIR ones). A test_zero transformer case
    compiles each of its three reference steps in 0.18-0.25 s instead of 0.94-1.14 s."""
    name = "xla_cpu_use_fusion_emitters"
    return {name: False} if compile_option_accepted(name, False) else {}


#: ``digest -> (params, opt_state)`` of the reference runs this process has made
_RUNS: dict = {}


def _digest(traced, inputs) -> str:
    """What a reference run's result depends on: the step's jaxpr (its text and closed-over
    constants: the optimizer's hyperparameters, the loss, the gradient's order of sums) and
    every input value (the params, the optimizer state, each batch)."""
    h = hashlib.sha256(str(traced.jaxpr).encode())
    leaves, treedef = jax.tree.flatten((traced.jaxpr.consts, inputs))
    h.update(str(treedef).encode())
    for x in leaves:
        x = np.asarray(x)
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def reference_run(tx, params, loss_fn, batches, grad_fn=None):
    """``(params, opt_state)``: plain single-device optax over ``batches``, the gradient
    ``grad_fn(params, batch)`` (default ``jax.grad(loss_fn)``), compiled with
    :func:`compiler_options`. Stage-parametrized tests compare several sharded runs against
    one reference: a run this process already made for the same step and values is returned
    again (traced, neither compiled nor run)."""
    grad_fn = jax.grad(loss_fn) if grad_fn is None else grad_fn

    def step(p, s, b):
        u, s = tx.update(grad_fn(p, b), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step, compiler_options=compiler_options())
    batches = list(batches)
    p, s = params, tx.init(params)
    key = _digest(step.trace(p, s, batches[0]), (p, s, batches))  # jit keeps this trace
    if key not in _RUNS:
        for b in batches:
            p, s = step(p, s, b)
        _RUNS[key] = p, s
    return _RUNS[key]


def _reversed_rows(loss_fn):
    return lambda p, b: jax.grad(loss_fn)(p, jax.tree.map(lambda x: x[::-1], b))


def _shard_means(loss_fn, n):
    def grad(p, b):
        parts = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), b)
        g = jax.lax.map(lambda bi: jax.grad(loss_fn)(p, bi), parts)
        return jax.tree.map(lambda x: x.mean(0), g)

    return grad


def _host(x) -> np.ndarray:
    """``x`` on the host in the dtype jax gives it (``jnp.asarray``: a float64 array becomes
    float32). The distances are taken in numpy, in jax's dtypes, where the same eager jax ops
    would each be an XLA compile per leaf shape (tens per reference on a fresh model)."""
    return np.asarray(jnp.asarray(x))


def _distance(x, y) -> float:
    """``max |x - y|``, both in their jax result type (jax's promotion, not numpy's)."""
    x, y = _host(x), _host(y)
    dtype = jnp.result_type(x, y)
    return float(np.max(np.abs(x.astype(dtype) - y.astype(dtype))))


def max_distance(a, b) -> float:
    """The largest absolute elementwise distance between two trees of the same structure."""
    return max(jax.tree.leaves(jax.tree.map(_distance, a, b)), default=0.0)


def _largest(tree) -> float:
    """The largest magnitude among ``tree``'s floating leaves (an integer leaf such as Adam's
    step count is no value the floor's ulps are of: callers compare those exactly)."""
    floats = (_host(x) for x in jax.tree.leaves(tree))
    return max(
        (float(np.max(np.abs(x))) for x in floats if jnp.issubdtype(x.dtype, jnp.inexact)),
        default=0.0,
    )


def derived_atol(reference, *others) -> float:
    """:data:`SPREAD_MULTIPLE` times the largest distance from ``reference`` to ``others``
    (the same run with other summation orders), at least :data:`ULPS` ulps of its largest floating
    value."""
    spread = max(max_distance(reference, o) for o in others)
    floor = ULPS * float(np.finfo(np.float32).eps) * _largest(reference)
    return max(SPREAD_MULTIPLE * spread, floor)


def reference(tx, params, loss_fn, batches, n: int = 8):
    """``(params, opt_state, atol)``: plain single-device optax on the global batches, and the
    tolerance of a comparison against it (:func:`derived_atol` over the reference rerun with
    the batch's rows reversed and with the gradient as the mean of ``n`` shard means, for the
    params and the optimizer state together). ``loss_fn(params, batch)`` must be a mean over
    the batch's rows."""
    ref = reference_run(tx, params, loss_fn, batches)
    others = [reference_run(tx, params, loss_fn, batches, _reversed_rows(loss_fn))]
    if all(x.shape[0] % n == 0 for b in batches for x in jax.tree.leaves(b)):
        others.append(reference_run(tx, params, loss_fn, batches, _shard_means(loss_fn, n)))
    atol = derived_atol(ref, *others)
    moved = max_distance(ref[0], params)
    if not moved > 1000 * atol / SPREAD_MULTIPLE:
        raise ValueError(
            f"the reordered references are {atol / SPREAD_MULTIPLE:.3g} apart, against "
            f"{moved:.3g} moved by the steps: the loss is not a mean over independent rows "
            "(a dropout mask drawn per batch shape, a batch statistic), so reordering measures "
            "more than rounding; compare against reference_run with a stated tolerance"
        )
    return ref[0], ref[1], atol


def reference_cast(tx, params, loss_fn, batches, dtype, n: int = 8):
    """:func:`reference` for a run whose loss reads a 16-bit compute copy of fp32 master
    params: the single-device loss reads the params cast to ``dtype``, and the tolerance is the
    same reruns' spread, which that cast's rounding of the gradient sets. No guard on how far
    the steps moved: with Adam that rounding moves an element by a share of the learning rate,
    as far as the steps do, so compare with an optimizer linear in the gradient (SGD) and assert
    the distance moved against ``atol`` in the test."""
    cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)
    cast_loss = lambda p, b: loss_fn(cast(p), b)
    ref = reference_run(tx, params, cast_loss, batches)
    others = [
        reference_run(tx, params, cast_loss, batches, _reversed_rows(cast_loss)),
        reference_run(tx, params, cast_loss, batches, _shard_means(cast_loss, n)),
    ]
    return ref[0], ref[1], derived_atol(ref, *others)
