"""The suite's tolerance rule (tests/tolerance.py): its floor is ulps of the largest floating
value compared, whatever integer leaves (Adam's step count) the compared trees hold."""

import jax.numpy as jnp
import numpy as np
import optax
from tolerance import SPREAD_MULTIPLE, ULPS, derived_atol, reference_run

EPS = float(np.finfo(np.float32).eps)


def test_the_floor_is_ulps_of_the_largest_float_leaf():
    ref = {"w": jnp.array([0.5, -2.0]), "count": jnp.array(0, jnp.int32)}
    assert derived_atol(ref, ref) == ULPS * EPS * 2.0


def test_an_integer_leaf_does_not_raise_the_floor():
    floats = {"w": jnp.array([0.5, -2.0])}
    with_count = {**floats, "count": jnp.array(1000, jnp.int32)}
    assert derived_atol(with_count, with_count) == derived_atol(floats, floats)


def test_above_the_floor_the_tolerance_is_the_spread_times_the_multiple():
    ref = {"w": jnp.array([0.5, -2.0]), "count": jnp.array(3, jnp.int32)}
    other = {"w": jnp.array([0.5, -2.0 + 2.0**-10]), "count": jnp.array(3, jnp.int32)}
    assert derived_atol(ref, other) == SPREAD_MULTIPLE * 2.0**-10


def _sgd_on_a_target(target):
    """``reference_run`` of SGD (lr 0.5) on ``mean((w * x - target)**2)``, ``target`` closed
    over as an array (a constant of the step's jaxpr, not its text), two batches."""
    loss = lambda p, b: jnp.mean((p["w"] * b - target) ** 2)
    batches = [jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])]
    return reference_run(optax.sgd(0.5), {"w": jnp.array(0.25)}, loss, batches)[0]["w"]


def _sgd_by_hand(target):
    w = 0.25
    for x in ([1.0, 2.0], [3.0, -1.0]):
        x = np.array(x)
        w -= 0.5 * np.mean(2 * (w * x - target) * x)
    return w


def test_a_reference_run_is_reused_only_for_the_same_jaxpr_constants_and_values():
    first = _sgd_on_a_target(jnp.array([0.5, 1.0]))
    np.testing.assert_allclose(first, _sgd_by_hand(np.array([0.5, 1.0])), rtol=1e-6)
    assert _sgd_on_a_target(jnp.array([0.5, 1.0])) is first  # a new tx and loss, same program
    other = _sgd_on_a_target(jnp.array([0.5, 2.0]))  # only a constant's value differs
    np.testing.assert_allclose(other, _sgd_by_hand(np.array([0.5, 2.0])), rtol=1e-6)
    assert other is not first
