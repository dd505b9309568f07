"""Models with more than params: BatchNorm statistics (synced over the global batch), dropout
keys, Flax NNX modules, and a hand-written step built from ZeRO's public pieces."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance

import jaxzero as jz
from jaxzero import checkpoint as ck

N = 8


class CNN(nn.Module):
    """3 -> 7 -> 13 channels with BatchNorm: odd widths on purpose."""

    bn_axis: tuple | str | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        for i, c in enumerate((7, 13)):
            # no conv bias: BatchNorm subtracts the batch mean, so its true gradient is exactly
            # 0 and Adam would turn float noise in it into O(lr) updates
            x = nn.Conv(c, (3, 3), use_bias=False, name=f"conv{i + 1}")(x)
            x = nn.BatchNorm(
                use_running_average=not train,
                momentum=0.9,
                axis_name=self.bn_axis,
                name=f"bn{i + 1}",
            )(x)
            x = nn.relu(x)
        return nn.Dense(5, name="head")(x.mean((1, 2)))


def cnn_problem(steps=10, batch=32, seed=0):
    rng = np.random.default_rng(seed)
    variables = CNN().init(jax.random.PRNGKey(seed), jnp.zeros((1, 6, 6, 3)), train=False)
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
    batches = [
        {
            "x": rng.normal(size=(batch, 6, 6, 3)).astype(np.float32),
            "y": rng.integers(0, 5, size=(batch,)).astype(np.int32),
        }
        for _ in range(steps)
    ]
    return params, model_state, batches


def cnn_loss(bn_axis):
    model = CNN(bn_axis=bn_axis)

    def loss_fn(params, model_state, batch, rng):
        del rng
        logits, updates = model.apply(
            {"params": params, **model_state}, batch["x"], train=True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, (dict(updates), None)

    return loss_fn


def single_device_reference(tx, params, model_state, batches):
    loss_fn = cnn_loss(None)

    def step(p, ms, s, b):
        (_, (ms, _)), g = jax.value_and_grad(loss_fn, has_aux=True)(p, ms, b, None)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), ms, s

    step = jax.jit(step, compiler_options=tolerance.compiler_options())

    s = tx.init(params)
    for b in batches:
        params, model_state, s = step(params, model_state, s, b)
    return params, model_state


def run_cnn(bn_axis, stage=2, n=N, ema=None, steps=10):
    params, model_state, batches = cnn_problem(steps)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(n), stage=stage)
    step = jz.make_train_step(cnn_loss(bn_axis), zero, stateful=True, ema=ema)
    state = step.init(params, model_state=model_state, rng=jax.random.key(0))
    for b in batches:
        state, _ = step(state, b)
    return state, (params, model_state, batches)


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def test_sync_batchnorm_matches_single_device_and_unsynced_differs():
    state, (params, model_state, batches) = run_cnn(bn_axis="data")
    ref_p, ref_ms = single_device_reference(optax.adam(1e-2), params, model_state, batches)
    # stated: batch statistics are no mean over independent rows, which tests/tolerance.py needs
    # (the synced statistics reduce in another order: 6.6e-7 apart here)
    np.testing.assert_allclose(flat(jz.gather(state)), flat(ref_p), atol=1e-5)
    np.testing.assert_allclose(flat(state.model_state), flat(ref_ms), atol=1e-5)
    with pytest.warns(UserWarning, match=r"batch_stats .* with no reduction over the data axes"):
        unsynced, _ = run_cnn(bn_axis=None)
    stats_gap = np.abs(flat(unsynced.model_state) - flat(ref_ms)).max()
    assert stats_gap > 1e-3, stats_gap  # per-device statistics of 4 examples differ


def test_ema_averages_batch_stats():
    ema = jz.ShardedEMA(0.5)
    state, _ = run_cnn(bn_axis="data", ema=ema, steps=3)
    gathered = jz.gather(state.ema)
    assert set(gathered) == {"params", "model_state"}
    # reference: replay the EMA over the same trajectory of (params, batch_stats)
    params, model_state, batches = cnn_problem(3)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(N), stage=2)
    step = jz.make_train_step(cnn_loss("data"), zero, stateful=True)
    st = step.init(params, model_state=model_state, rng=jax.random.key(0))
    e_p, e_ms = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, model_state)
    for b in batches:
        st, _ = step(st, b)
        e_p = jax.tree.map(lambda e, x: 0.5 * e + 0.5 * np.asarray(x), e_p, jz.gather(st))
        e_ms = jax.tree.map(lambda e, x: 0.5 * e + 0.5 * np.asarray(x), e_ms, st.model_state)
    # the EMA's formula replayed in numpy over the same trajectory: one rounding per update
    np.testing.assert_allclose(flat(gathered["params"]), flat(e_p), atol=1e-6)
    np.testing.assert_allclose(flat(gathered["model_state"]), flat(e_ms), atol=1e-6)
    # evaluating with the EMA uses the EMA's statistics
    model = CNN()
    x = batches[0]["x"]
    out = model.apply({"params": gathered["params"], **gathered["model_state"]}, x, train=False)
    want = model.apply({"params": e_p, **e_ms}, x, train=False)
    # the same model on EMA weights 1e-6 apart (above): the forward carries that difference
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)


def test_ema_copies_integer_counters():
    ema = jz.ShardedEMA(0.9)
    state = ema.init({"w": jnp.ones(4), "count": jnp.asarray(3, jnp.int32)})
    state = ema.update(state, {"w": jnp.zeros(4), "count": jnp.asarray(7, jnp.int32)})
    assert int(state.ema["count"]) == 7
    np.testing.assert_allclose(np.asarray(state.ema["w"]), 0.9)


class Dropper(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        h = nn.Dense(16, name="fc1")(x)
        mask_probe = nn.Dropout(0.5, deterministic=not train)(jnp.ones((16,)))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(2, name="fc2")(h), mask_probe


def dropout_run(seed, steps=3, with_state=None):
    model = Dropper()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8)), train=False)["params"]
    rng = np.random.default_rng(1)
    batches = [{"x": rng.normal(size=(32, 8)).astype(np.float32)} for _ in range(steps)]

    def loss_fn(p, ms, b, key):
        out, probe = model.apply({"params": p}, b["x"], train=True, rngs={"dropout": key})
        return jnp.mean(out**2), (ms, probe)

    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(N), stage=2)
    step = jz.make_train_step(loss_fn, zero, stateful=True)
    state = with_state or step.init(params, model_state={}, rng=jax.random.key(seed))
    probes = []
    for b in batches:
        state, m = step(state, b)
        probes.append(np.asarray(m["aux"]))
    return state, probes, step


def test_dropout_reproducible_and_different_per_device(tmp_path):
    a, probes, _ = dropout_run(seed=7)
    b, _, _ = dropout_run(seed=7)
    for x, y in zip(jax.tree.leaves(jz.gather(a)), jax.tree.leaves(jz.gather(b)), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    # aux is averaged over the 8 devices: one shared mask would give values in {0, 2}
    # (inverted dropout scales kept units by 1/0.5); different masks give fractions.
    for p in probes:
        assert not np.all(np.isin(p, [0.0, 2.0])), p
    c, _, _ = dropout_run(seed=8)
    assert not np.array_equal(flat(jz.gather(a)), flat(jz.gather(c)))
    # the key is part of the state and survives a checkpoint round trip
    ck.save(str(tmp_path), 3, a, wait=True)
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(N), stage=2)
    restored = ck.restore(
        str(tmp_path),
        zero,
        jax.tree.map(np.asarray, a.params),
        model_state={},
        rng=jax.random.key(0),
    )
    assert np.array_equal(np.asarray(restored.rng), np.asarray(a.rng))


def test_stateful_bad_input():
    params, model_state, batches = cnn_problem(1)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(N), stage=2)

    def changes_structure(p, ms, b, r):
        loss, (new, aux) = cnn_loss("data")(p, ms, b, r)
        new = {"batch_stats": {"bn1": new["batch_stats"]["bn1"]}}
        return loss, (new, aux)

    step = jz.make_train_step(changes_structure, zero, stateful=True)
    state = step.init(params, model_state=model_state, rng=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"model_state changed structure: missing paths \[\"\['batch_stats'\]\['bn2'\]",
    ):
        step(state, batches[0])
    with pytest.raises(ValueError, match=r"model_state has a 'params' collection"):
        zero.init(params, model_state={"params": params}, rng=jax.random.key(0))


def test_apply_gradients_refuses_a_model_state_of_another_structure():
    # a hand-written step hands ZeRO.apply_gradients the new model state itself
    params, model_state, _ = cnn_problem(1)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(N), stage=2)
    state = zero.init(params, model_state=model_state, rng=jax.random.key(0))
    grads = jax.tree.map(jnp.zeros_like, state.params)
    dropped = {"batch_stats": {"bn1": model_state["batch_stats"]["bn1"]}}
    update = jax.jit(lambda s, g, m: zero.apply_gradients(s, g, model_state=m))
    with pytest.raises(
        ValueError,
        match=r"model_state changed structure: missing paths \[\"\['batch_stats'\]\['bn2'\]",
    ):
        update(state, grads, dropped)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hand_written_step_equals_make_train_step_bitwise(stage):
    import sys
    from pathlib import Path

    from jaxzero.gpu.models import make_problem

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from byo_step import make_my_step

    params, loss_fn, batches = make_problem("wide_mlp", steps=3)
    zero = jz.ZeRO(optax.adamw(1e-2), jz.data_parallel_mesh(N), stage=stage)
    ours = jz.make_train_step(loss_fn, zero)
    mine = make_my_step(loss_fn, zero, zero.abstract_state(params))
    a, b = ours.init(params), zero.init(params)
    for batch in batches:
        a, ma = ours(a, batch)
        b, mb = mine(b, batch)
        assert float(ma["loss"]) == float(mb["loss"])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_nnx_module_matches_linen_twin_stage3_with_ema():
    from flax import nnx

    from jaxzero.gpu.models import MLP

    class NnxMLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(17, 32, rngs=rngs)
            self.fc2 = nnx.Linear(32, 5, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jnp.tanh(self.fc1(x)))

    model_def, params, model_state = jz.flax_nnx.split(NnxMLP(nnx.Rngs(0)))
    assert model_state is None
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(16, 17)).astype(np.float32),
            "y": rng.normal(size=(16, 5)).astype(np.float32),
        }
        for _ in range(10)
    ]
    nnx_loss = model_def.loss(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    linen = MLP(hidden=32)
    linen_loss = lambda p, b: jnp.mean((linen.apply({"params": p}, b["x"]) - b["y"]) ** 2)
    results = []
    for loss_fn in (nnx_loss, linen_loss):
        zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(N), stage=3)
        step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.9))
        state = step.init(jax.tree.map(jnp.asarray, params))  # same initial weights
        for b in batches:
            state, _ = step(state, b)
        results.append((jz.gather(state), jz.gather(state.ema)))
    # the two losses sum in their own orders: tests/tolerance.py's rule of the Linen run
    # (the EMA is a convex combination of the params, within the same bound)
    _, _, atol = tolerance.reference(optax.adam(1e-2), params, linen_loss, batches)
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)
    trained = model_def.merge(results[0][0])
    # a forward on weights within that tolerance (1.2e-6 here): its matmuls carry the difference
    np.testing.assert_allclose(
        np.asarray(trained(batches[0]["x"])),
        np.asarray(linen.apply({"params": results[1][0]}, batches[0]["x"])),
        atol=1e-5,
    )


def test_nnx_non_array_state_refused():
    from flax import nnx

    class Bad(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 8, rngs=rngs)
            self.note = nnx.Variable("a string")

    with pytest.raises(TypeError, match=r"\['note'\] \(str\)"):
        jz.flax_nnx.split(Bad(nnx.Rngs(0)))
