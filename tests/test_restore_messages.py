"""Restore errors that say what the checkpoint has and what the call should pass, and an fp32
checkpoint restored into a bf16 ZeRO (its params become the master).

Expected numbers are the uninterrupted runs' states, gathered before saving."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from digits_problem import digits_problem, host
from test_model_state import cnn_loss, cnn_problem

import jaxzero as jz
from jaxzero import checkpoint as ck


def test_forgotten_model_state_and_rng_are_named(tmp_path):
    params, model_state, batches = cnn_problem(steps=2)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=2)
    ema = jz.ShardedEMA(0.9)
    step = jz.make_train_step(cnn_loss("data"), zero, ema=ema, stateful=True)
    state = step.init(params, model_state=model_state, rng=jax.random.key(0))
    for b in batches:
        state, _ = step(state, b)
    want = host(state)
    ck.save(tmp_path, 2, state, zero=zero)
    with pytest.raises(ValueError, match=r"has model state \(.*batch_stats.*pass model_state="):
        ck.restore(tmp_path, zero, params, ema=ema)
    with pytest.raises(ValueError, match=r"has an rng key .* pass rng=jax\.random\.key\(0\)"):
        ck.restore(tmp_path, zero, params, ema=ema, model_state=model_state)
    # What the messages say to pass restores the state, bit for bit.
    got = ck.restore(
        tmp_path, zero, params, ema=ema, model_state=model_state, rng=jax.random.key(1)
    )
    assert sorted(host(got)) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(host(got)[k], v, err_msg=k)


def run_digits(zero, steps, ema=None):
    params, loss_fn, batches = digits_problem(steps=steps + 1)
    step = jz.make_train_step(loss_fn, zero, ema=ema)
    state = step.init(params)
    for b in batches[:steps]:
        state, _ = step(state, b)
    return params, loss_fn, batches, step, state


def test_ema_from_a_checkpoint_without_one_says_how_to_start_one(tmp_path):
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2)
    params, loss_fn, batches, step, state = run_digits(zero, 2)
    ck.save(tmp_path, 2, state, zero=zero)
    reference, _ = step(state, batches[2])  # the uninterrupted run, one step further
    ema = jz.ShardedEMA(0.99)
    with pytest.raises(ValueError, match=r"has no EMA .* restore without ema=, then start"):
        ck.restore(tmp_path, zero, params, ema=ema)
    # The recipe the message gives.
    state = ck.restore(tmp_path, zero, params)
    state = state.replace(
        ema=zero.init(
            jz.gather(state.master if state.master is not None else state.params),
            ema=ema,
            model_state=state.model_state,
        ).ema
    )
    for e, p in zip(
        jax.tree.leaves(jz.gather(state.ema.ema)), jax.tree.leaves(host(state.params)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(e), p)
    assert int(state.ema.updates) == 0
    # ...and training goes on with it: the params follow the uninterrupted run.
    with_ema = jz.make_train_step(loss_fn, zero, ema=ema)
    state, _ = with_ema(state, batches[2])
    for a, b in zip(
        jax.tree.leaves(host(state.params)), jax.tree.leaves(host(reference.params)), strict=True
    ):
        # the same step resumed: a few ulps, under tests/tolerance.py's 16-ulp floor
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert int(state.ema.updates) == 1


@pytest.mark.parametrize("n,stage,check_dtypes", [(8, 2, True), (4, 3, False)])
def test_fp32_checkpoint_restores_into_a_bf16_zero(tmp_path, n, stage, check_dtypes):
    ema = jz.ShardedEMA(0.99)
    zero32 = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2)
    params, loss_fn, batches, _, state = run_digits(zero32, 2, ema=ema)
    want = {
        "params": host(state.params),
        "opt": host(state.opt_state),
        "ema": host(state.ema),
    }
    ck.save(tmp_path, 2, state, zero=zero32)
    zero16 = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(n), stage=stage, precision="bf16")
    got = ck.restore(tmp_path, zero16, params, ema=ema, check_dtypes=check_dtypes)
    # The fp32 params are the master; the compute params are their bf16 cast.
    for k, v in want["params"].items():
        np.testing.assert_array_equal(host(got.master)[k], v, err_msg=k)
        np.testing.assert_array_equal(host(got.params)[k], v.astype(jnp.bfloat16), err_msg=k)
    for k, v in want["opt"].items():
        np.testing.assert_array_equal(host(got.opt_state)[k], v, err_msg=k)
    for k, v in want["ema"].items():
        np.testing.assert_array_equal(host(got.ema)[k], v, err_msg=k)
    assert jax.tree.leaves(got.params)[0].dtype == jnp.bfloat16
    # It is a state the bf16 step trains (same shardings as its own init).
    step16 = jz.make_train_step(loss_fn, zero16, ema=ema)
    fresh = step16.init(params)
    assert jax.tree.map(lambda x: x.sharding, got) == jax.tree.map(lambda x: x.sharding, fresh)
    got, _ = step16(got, batches[2])
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(got.master))


def test_bf16_checkpoint_restores_into_an_fp32_zero(tmp_path):
    """The other way: the checkpoint's fp32 master becomes the params."""
    ema = jz.ShardedEMA(0.99)
    zero16 = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2, precision="bf16")
    params, loss_fn, batches, _, state = run_digits(zero16, 2, ema=ema)
    want = {"master": host(state.master), "opt": host(state.opt_state), "ema": host(state.ema)}
    ck.save(tmp_path, 2, state, zero=zero16)
    zero32 = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=3)
    got = ck.restore(tmp_path, zero32, params, ema=ema)
    assert got.master is None
    for k, v in want["master"].items():
        np.testing.assert_array_equal(host(got.params)[k], v, err_msg=k)
    for k, v in want["opt"].items():
        np.testing.assert_array_equal(host(got.opt_state)[k], v, err_msg=k)
    for k, v in want["ema"].items():
        np.testing.assert_array_equal(host(got.ema)[k], v, err_msg=k)
    step32 = jz.make_train_step(loss_fn, zero32, ema=ema)
    got, _ = step32(got, batches[2])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got.params))
