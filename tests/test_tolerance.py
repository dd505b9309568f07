"""The suite's tolerance rule (tests/tolerance.py): its floor is ulps of the largest floating
value compared, whatever integer leaves (Adam's step count) the compared trees hold."""

import jax.numpy as jnp
import numpy as np
from tolerance import SPREAD_MULTIPLE, ULPS, derived_atol

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
