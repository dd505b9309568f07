"""``ZeRO(offload="optimizer", offload_update="delayed", delay_after=W)``: ZeRO-Offload's
delayed parameter update (DPU) at stage 3 per layer. After ``W`` exact steps, each step takes
its gradient at the params before the update the step before left pending, and applies that
update beside its forward (the rows in ``jaxzero.scan_layers``' loop, no gather waiting for
them). On 8 simulated devices with 2 micro-batches, each step's loss and the flushed master
and optimizer state are those of a plain single-device optax loop written here from that
definition (the gradient of step ``t`` at ``w[t - 1]``, the update applied to ``w[t]``),
within tests/tolerance.py's rule; bad combinations are refused before any state exists.
"""

from __future__ import annotations

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import stacked_linear
import tolerance

import jaxzero as jz

N = 8
BF16 = jz.Precision("bfloat16", "float32", "float32")
TX = {
    "adamw": optax.adamw(1e-2, weight_decay=0.1),
    # a clip below the gradients' norm (about 0.5 on these batches): the clip scales every step
    "clip_adamw": optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1)),
}
# 4 layers: the delayed forward runs layer 0's half, layer 1's, layer 2's (which writes the
# rows of layers 1 and 3 back in one copy) and the last layer
L = 4
STEPS = 4


def _problem(steps=STEPS, gathered=False, layers=L):
    """tests/stacked_linear.py's problem with the ReLU."""
    return stacked_linear.problem(steps, layers, gathered=gathered, relu=True)


def _delayed_optax(tx, params, loss_fn, batches, exact_steps, order=lambda b: b):
    """Plain single-device optax with ZeRO-Offload's delayed update, from its definition:
    ``w[t]`` the params after ``t`` updates; step ``t`` takes its gradient (and its loss) at
    ``w[t]`` for the first ``exact_steps`` steps (the first step always: nothing came before
    it) and at ``w[t - 1]`` after them, and applies the update to ``w[t]``. The loss reads
    the bf16 cast of the params, as the step's compute copy. ``order``: the batch's rows
    reordered (a rerun for the tolerance). Returns ``(params, opt_state, losses)``."""
    cast = lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
    on_cast = lambda p, b: loss_fn(cast(p), order(b))
    options = tolerance.compiler_options()
    loss_grad = jax.jit(jax.value_and_grad(on_cast), compiler_options=options)
    update = jax.jit(
        lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)),
        compiler_options=options,
    )
    w, before, s, losses = params, params, tx.init(params), []
    for t, b in enumerate(batches):
        at = w if t < max(exact_steps, 1) else before
        loss, g = loss_grad(at, b)
        losses.append(float(loss))
        new, s = update(g, s, w)
        w, before = new, w
    return w, s, np.array(losses)


def _zero(tx, stage=3, **kw):
    kw = {"precision": BF16, "layers": "layers", "offload": "optimizer", **kw}
    return jz.ZeRO(tx, jz.data_parallel_mesh(N), stage=stage, **kw)


def _gathered(tree):
    return jax.tree.map(np.asarray, jz.gather(tree))


@pytest.mark.parametrize(
    "name,delay_after,layers",
    [
        ("adamw", 1, L),
        ("clip_adamw", 2, L),
        # slow: more compiles of the same path; 5 layers run a loop trip (layers 1 and 2)
        # before the half that writes layers 2 and 4 back together, 3 write layers 0 and 2
        # (layer 0's rows from the first half), 2 run no half but layer 0's
        pytest.param("adamw", 1, 5, marks=pytest.mark.slow),
        pytest.param("adamw", 1, 3, marks=pytest.mark.slow),
        pytest.param("adamw", 1, 2, marks=pytest.mark.slow),
    ],
)
def test_delayed_steps_with_two_micro_batches_are_delayed_optax(name, delay_after, layers):
    """Four steps of 2 micro-batches and a flush: each step's loss is the delayed reference's
    (the first ``delay_after`` steps' the exact run's, the later ones' not), and the flushed
    master and optimizer state are the delayed reference's, farther from the exact run's
    than the tolerance."""
    tx = TX[name]
    params, loss_fn, batches = _problem(layers=layers)
    zero = _zero(tx, offload_update="delayed", delay_after=delay_after)
    step = jz.make_train_step(loss_fn, zero, accum_steps=2)
    state = step.init(params)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        assert state.pending is not None and bool(metrics["finite"])
        losses.append(float(metrics["loss"]))
    assert state.pending.delayed  # the last step's update is applied by a delayed step
    want_p, want_s, want_losses = _delayed_optax(tx, params, loss_fn, batches, delay_after)
    exact_p, _, exact_losses = _delayed_optax(tx, params, loss_fn, batches, len(batches))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    warm = delay_after
    np.testing.assert_allclose(losses[:warm], exact_losses[:warm], rtol=1e-5, atol=1e-5)
    assert np.abs(np.array(losses[warm:]) - exact_losses[warm:]).min() > 1e-3
    # tests/tolerance.py's rule: the delayed reference rerun with the rows reversed
    reversed_rows = lambda b: jax.tree.map(lambda x: x[::-1], b)
    rerun = _delayed_optax(tx, params, loss_fn, batches, delay_after, reversed_rows)
    atol = tolerance.derived_atol((want_p, want_s), rerun[:2])
    assert tolerance.max_distance(want_p, exact_p) > 20 * atol
    state = step.flush(state)
    assert state.pending is None and int(state.step) == len(batches)
    master = _gathered(state.master)
    chex.assert_trees_all_close(master, want_p, atol=atol, rtol=0)
    chex.assert_trees_all_close(_gathered(state.opt_state), want_s, atol=atol, rtol=0)
    cast = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), master)
    chex.assert_trees_all_equal(_gathered(state.params), cast)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"stage": 2}, r"needs stage 3 with layers= \(got stage=2\)"),
        ({"delay_after": 0}, r"delay_after=0 must be an int >= 1.*the first counted"),
        ({"delay_after": True}, r"delay_after=True must be an int >= 1"),
        ({"offload": None}, r"offload_update='delayed' .* built for offload='optimizer'"),
        ({"layers": None}, r"names none, so it would change nothing"),
        ({"precision": "fp32"}, r"keeps none \(the params are the master\)"),
        (
            {"offload_update": "deferred", "delay_after": 2},
            r"offload_update='deferred' delays nothing.*drop delay_after",
        ),
        ({"offload_update": None, "delay_after": 1}, r"offload_update=None delays nothing"),
    ],
)
def test_the_delayed_update_is_refused_where_it_is_not_built(kw, match):
    kw = {"offload_update": "delayed", **kw}
    stage = kw.pop("stage", 3)
    with pytest.raises(ValueError, match=match):
        _zero(optax.adam(1e-2), stage, **kw)


def test_delayed_defaults_to_the_first_step_exact_and_the_default_update_is_exact():
    """``delay_after`` defaults to 1 with ``"delayed"`` (the first step, which has nothing
    to delay) and stays None otherwise: the default ``offload_update`` delays nothing."""
    assert _zero(optax.adam(1e-2), offload_update="delayed").placement.delay_after == 1
    plain = _zero(optax.adam(1e-2))
    assert plain.offload_update is None and plain.placement.delay_after is None
    deferred = _zero(optax.adam(1e-2), offload_update="deferred")
    assert deferred.delay_after is None and deferred.placement.delay_after is None


def test_one_micro_batch_is_allowed():
    """With one micro-batch the delayed update's window is that forward, the deferred one's,
    and it still hides more there (no gather waits for a row: layers 0-1's rows beside
    compute, test_deferred_overlap.py): the step is built with no warning."""
    params, loss_fn, _ = _problem(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jz.make_train_step(loss_fn, _zero(optax.adam(1e-2), offload_update="delayed"))


def test_a_stack_without_scan_layers_is_refused_when_the_delay_begins():
    """A stack gathered by ``jz.gather_layer`` in the model's own loop runs no forward loop
    the delayed rows could run in: the first delayed step refuses it, naming scan_layers."""
    params, loss_fn, batches = _problem(2, gathered=True)
    zero = _zero(TX["adamw"], offload_update="delayed")
    step = jz.make_train_step(loss_fn, zero, accum_steps=2)
    state, _ = step(step.init(params), batches[0])
    with pytest.raises(ValueError, match=r"jaxzero\.scan_layers.*offload_update='deferred'"):
        step(state, batches[1])
