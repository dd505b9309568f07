"""``jz.checkpoint.export(state, path, opt_state=True)``: the master, the optax state and the
step counter (the model state's collections beside them), the tree a Flax ``TrainState``
holds, read back by ``load_export(path, target=ts)`` into the user's own ``TrainState`` by key
path (``optax.MultiSteps``' fields are not in alphabetical order), and continued under
jaxzero by ``adopt``; the default export is unchanged."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import plain_flax
import pytest
from flax.training import train_state

import jaxzero as jz
from jaxzero import checkpoint as ck

K = 3


@pytest.fixture(scope="module")
def run():
    tx = plain_flax.chain("multisteps")
    model, params = plain_flax.model_and_params()
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(8), stage=3, precision="bf16")
    step = jz.make_train_step(plain_flax.loss_fn(model), zero, ema=jz.ShardedEMA(0.9))
    state = step.init(params)
    for b in plain_flax.batches(K):
        state, _ = step(state, b)
    return tx, params, step, state


def _flax_state(tx, params):
    """The user's own TrainState, its optax state from their own tx.init."""
    return train_state.TrainState.create(apply_fn=None, params=params, tx=tx)


@pytest.mark.parametrize("name", ["dir", "export.msgpack"])
def test_export_with_the_optimizer_state_reads_into_a_flax_train_state(run, tmp_path, name):
    tx, params, step, state = run
    path = ck.export(state, tmp_path / name, opt_state=True)
    # jaxzero's own view of the state, gathered: the fp32 master, not the bf16 compute params
    want = {
        "params": jz.gather(state.master),
        "opt_state": jz.gather(state.opt_state),
        "step": state.step,
    }
    want = jax.device_get(want)
    ts = ck.load_export(path, target=_flax_state(tx, params))
    assert type(ts) is train_state.TrainState and type(ts.opt_state) is type(tx.init(params))
    got = {"params": ts.params, "opt_state": ts.opt_state, "step": ts.step}
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_equal(got, want)
    assert int(ts.opt_state.mini_step) == 1 and int(ts.step) == K
    # without a target: plain dicts keyed by the Flax TrainState's fields and optax's names
    plain = ck.load_export(path)
    assert sorted(plain) == ["opt_state", "params", "step"]
    assert sorted(plain["opt_state"]) == sorted(tx.init(params)._fields)
    # and jaxzero continues it as it continues its own state
    adopted = ck.adopt(path if name == "dir" else ts, step)
    chex.assert_trees_all_equal(jz.gather(adopted.opt_state), want["opt_state"])
    chex.assert_trees_all_equal(jz.gather(adopted.master), want["params"])


def test_export_defaults_and_refusals(run, tmp_path):
    tx, params, _, state = run
    # the default is unchanged: the EMA alone, its tree the params'
    ema = ck.load_export(ck.export(state, tmp_path / "ema"))
    chex.assert_trees_all_equal(ema, jax.device_get(jz.ema_params(state, jnp.float32)))
    # an EMA export read into the user's params tree (and dtype)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    got = ck.load_export(tmp_path / "ema", target=bf16)
    chex.assert_trees_all_equal(got, jax.device_get(jz.ema_params(state, jnp.bfloat16)))
    assert jax.tree.leaves(got)[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"continues the master weights, not their EMA"):
        ck.export(state, tmp_path / "x", opt_state=True, which="ema")
    with pytest.raises(ValueError, match=r"export\(opt_state=True\) picks from a jaxzero"):
        ck.export(state.params, tmp_path / "x", opt_state=True)
    with pytest.raises(ValueError, match=r"export\(which='params'\) picks from a jaxzero"):
        ck.export(state.params, tmp_path / "x", which="params")  # no effect on a plain tree
    assert not (tmp_path / "x").exists()


def test_export_carries_the_model_state_beside(tmp_path):
    tx = plain_flax.chain("clip_adamw")
    _, params = plain_flax.model_and_params()
    stats = {"bn": {"mean": np.arange(8.0, dtype=np.float32), "var": np.ones(8, np.float32)}}
    state = jz.ZeRO(tx, jz.data_parallel_mesh(8), stage=3).init(
        params, model_state={"batch_stats": stats}
    )
    path = ck.export(state, tmp_path / "bn", opt_state=True)
    plain = ck.load_export(path)
    assert sorted(plain) == ["batch_stats", "opt_state", "params", "step"]
    chex.assert_trees_all_equal(plain["batch_stats"], stats)
    chex.assert_trees_all_equal(plain["params"], jax.device_get(params))
