"""A loss that reduces over the data axes itself, what a pmap program leaves in a port: refused
before the first step with the line and the fix (under the step's mean it would train at 1/N
of the gradient), never by advice that leads back to it; a loss normalised by a count over the
whole batch trains exactly as jz.GlobalMean; collectives the loss uses on purpose are kept
when asked; and the step's arguments that would drop model state or a key are refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerance import derived_atol, max_distance, reference_run

import jaxzero as jz

N = 8
MODEL = nn.Dense(4)
PARAMS = MODEL.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]


def _batches(steps=3, rows=32):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, 8)).astype(np.float32),
            "y": rng.normal(size=(rows, 4)).astype(np.float32),
            # labels kept per row: the devices' counts differ (1 to 4 of their 4 rows)
            "mask": (rng.random(rows) > 0.4).astype(np.float32),
        }
        for _ in range(steps)
    ]


def _per_row(p, b):
    return ((MODEL.apply({"params": p}, b["x"]) - b["y"]) ** 2).mean(-1) * b["mask"]


def mean_loss(p, b):
    return jnp.mean((MODEL.apply({"params": p}, b["x"]) - b["y"]) ** 2)


def pmean_leftover(p, b):  # pmap's `loss = jax.lax.pmean(loss, "data")`, left in the port
    return jax.lax.pmean(mean_loss(p, b), "data")


def psum_count(p, b):  # Hugging Face's token-weighted recipe under pmap
    return _per_row(p, b).sum() / jax.lax.psum(b["mask"].sum(), "data")


def global_mean(p, b):  # the same loss, as jaxzero computes it
    return jz.GlobalMean(_per_row(p, b).sum(), b["mask"].sum())


def token_mean(p, b):  # the single-device loss both mean
    return _per_row(p, b).sum() / b["mask"].sum()


def _zero(stage, axis="data", tx=None):
    mesh = jz.data_parallel_mesh(N, axis=axis)
    return jz.ZeRO(tx or optax.sgd(0.1), mesh, stage=stage, axis=axis)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_pmean_left_in_the_loss_is_refused_before_any_step(stage):
    step = jz.make_train_step(pmean_leftover, _zero(stage))
    state = step.init(PARAMS)
    with pytest.raises(ValueError) as e:
        step(state, _batches(1)[0])
    msg = str(e.value)
    assert "test_loss_collectives.py:" in msg and "pmean_leftover" in msg, msg
    assert "1/N of the gradient" in msg and "drop jax.lax.pmean(loss" in msg, msg
    # refused while tracing: the state was not donated and trains with the fixed loss
    fixed = jz.make_train_step(mean_loss, _zero(stage))
    state, metrics = fixed(state, _batches(1)[0])
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))


def test_a_psum_of_the_count_is_refused_naming_global_mean():
    step = jz.make_train_step(psum_count, _zero(2))
    with pytest.raises(ValueError, match=r"return jz\.GlobalMean\(loss\.sum\(\), num_labels\)"):
        step(step.init(PARAMS), _batches(1)[0])


def test_an_unbound_batch_axis_says_remove_it_and_renaming_does_not_run_silently():
    """pmap's axis was "batch": the loss fails on jaxzero's "data" mesh. The message says to
    remove the collective, not to rename the axis; renaming it anyway is refused too."""

    def leftover(p, b):
        return jax.lax.pmean(mean_loss(p, b), "batch")

    step = jz.make_train_step(leftover, _zero(2))
    with pytest.raises(ValueError) as e:
        step(step.init(PARAMS), _batches(1)[0])
    msg = str(e.value)
    assert "Remove it; do not rename the mesh axis" in msg and "left from a pmap program" in msg
    assert "jz.data_parallel_mesh(axis='batch')" not in msg, msg
    renamed = jz.make_train_step(leftover, _zero(2, axis="batch"))
    with pytest.raises(ValueError, match="the loss reduces over the data axes itself"):
        renamed(renamed.init(PARAMS), _batches(1)[0])


def test_a_batchnorm_axis_name_the_mesh_lacks_still_says_name_the_axis():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False, axis_name="batch")(nn.Dense(4)(x))

    variables = Net().init(jax.random.key(0), jnp.zeros((2, 8)))

    def loss(p, ms, b, rng):
        out, new = Net().apply({"params": p, **ms}, b["x"], mutable=["batch_stats"])
        return jnp.mean((out - b["y"]) ** 2), (new, None)

    step = jz.make_train_step(loss, _zero(2), stateful=True)
    state = step.init(variables["params"], model_state={"batch_stats": variables["batch_stats"]})
    with pytest.raises(ValueError, match=r"normalization layer built with axis_name="):
        step(state, _batches(1)[0])


@pytest.mark.parametrize(
    "stage,accum,tx,offload",
    [
        (0, 1, "sgd", None),
        (1, 2, "sgd", None),
        (2, 1, "clip_adamw", None),
        (3, 2, "clip_adamw", None),
        (2, 2, "clip_adamw", "optimizer"),  # the factor streamed with the update
    ],
)
def test_global_mean_trains_as_single_device_optax_on_the_token_mean(stage, accum, tx, offload):
    """sum(total) / sum(count) over every device and micro-batch: the devices' counts differ,
    so a mean of per-device (or per-micro-batch) means would not land here."""
    txs = {
        "sgd": optax.sgd(0.1),
        "clip_adamw": optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    }
    batches = _batches()
    zero = jz.ZeRO(txs[tx], jz.data_parallel_mesh(N), stage=stage, offload=offload)
    step = jz.make_train_step(global_mean, zero, accum_steps=accum)
    state = step.init(PARAMS)
    losses, norms = [], []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    want_p, _ = reference_run(txs[tx], PARAMS, token_mean, batches)
    reversed_rows = [jax.tree.map(lambda x: x[::-1], b) for b in batches]
    other_p, _ = reference_run(txs[tx], PARAMS, token_mean, reversed_rows)
    atol = derived_atol(want_p, other_p)
    assert max_distance(jz.gather(state.params), want_p) <= atol
    # the step's reported loss and norm are the single-device ones, step by step
    p = PARAMS
    state_tx = txs[tx].init(p)
    for b, loss, norm in zip(batches, losses, norms, strict=True):
        value, g = jax.value_and_grad(token_mean)(p, b)
        np.testing.assert_allclose(loss, float(value), rtol=1e-5)
        np.testing.assert_allclose(norm, float(optax.tree.norm(g)), rtol=1e-5)
        u, state_tx = txs[tx].update(g, state_tx, p)
        p = optax.apply_updates(p, u)
    # the mean of the per-device token means is another number: the test can tell them apart
    shard_means = np.mean([float(token_mean(PARAMS, _rows(batches[0], d))) for d in range(N)])
    assert abs(shard_means - float(token_mean(PARAMS, batches[0]))) > 1e-3


def _rows(b, d, per=4):
    return jax.tree.map(lambda x: x[d * per : (d + 1) * per], b)


def test_the_gradient_of_a_pmean_leftover_was_one_nth():
    """What the refusal prevents, measured: with the check waived, a pmean left in the loss
    trains on 1/N of the plain mean loss's gradient norm."""
    b = _batches(1)[0]
    norms = {}
    for name, fn in (("plain", mean_loss), ("leftover", pmean_leftover)):
        step = jz.make_train_step(fn, _zero(2), allow_loss_collectives=True)
        _, m = step(step.init(PARAMS), b)
        norms[name] = float(m["grad_norm"])
    want = float(optax.tree.norm(jax.grad(mean_loss)(PARAMS, b)))
    np.testing.assert_allclose(norms["plain"], want, rtol=1e-5)
    np.testing.assert_allclose(norms["leftover"], want / N, rtol=1e-5)


def test_a_collective_kept_on_purpose_trains_as_the_global_batch():
    """A statistic over the whole batch that each device uses on its own rows (here the
    global mean of the inputs, a hand-written synchronised normalisation) is right under the
    step's mean: kept with allow_loss_collectives=True, it matches single-device optax."""

    def centred(p, b, center):
        return jnp.mean((MODEL.apply({"params": p}, b["x"] - center) - b["y"]) ** 2)

    def synced(p, b):
        return centred(p, b, jax.lax.pmean(b["x"].mean(0), "data"))

    def single(p, b):
        return centred(p, b, b["x"].mean(0))

    batches = _batches()
    with pytest.raises(ValueError, match="allow_loss_collectives=True"):
        step = jz.make_train_step(synced, _zero(3))
        step(step.init(PARAMS), batches[0])
    step = jz.make_train_step(synced, _zero(3), allow_loss_collectives=True)
    state = step.init(PARAMS)
    for b in batches:
        state, _ = step(state, b)
    want, _ = reference_run(optax.sgd(0.1), PARAMS, single, batches)
    other, _ = reference_run(
        optax.sgd(0.1), PARAMS, single, [jax.tree.map(lambda x: x[::-1], b) for b in batches]
    )
    assert max_distance(jz.gather(state.params), want) <= derived_atol(want, other)


def test_a_collective_in_the_aux_only_is_not_refused():
    def with_metric(p, b):
        loss = mean_loss(p, b)
        return loss, {"loss_sum": jax.lax.psum(loss, "data")}

    step = jz.make_train_step(with_metric, _zero(2))
    b = _batches(1)[0]
    state, m = step(step.init(PARAMS), b)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, PARAMS, jax.grad(mean_loss)(PARAMS, b))
    assert max_distance(jz.gather(state.params), want) < 1e-6
    per_device = [float(mean_loss(PARAMS, _rows(b, d))) for d in range(N)]
    np.testing.assert_allclose(float(m["aux"]["loss_sum"]), sum(per_device), rtol=1e-5)


def test_a_stateful_step_refuses_an_init_without_model_state():
    def loss(p, ms, b, rng):
        return mean_loss(p, b), (ms, None)

    step = jz.make_train_step(loss, _zero(2), stateful=True)
    with pytest.raises(ValueError, match=r"stateful .* init was not given one; pass it"):
        step.init(PARAMS)
    # a model with no state says so (jz.flax_nnx.split gives None for an nnx module without)
    state = step.init(PARAMS, model_state=None)
    b = _batches(1)[0]
    state, _ = step(state, b)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, PARAMS, jax.grad(mean_loss)(PARAMS, b))
    assert max_distance(jz.gather(state.params), want) < 1e-6


def test_rng_with_a_two_argument_loss_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"add the key argument \(loss_fn\(params, batch, rng\)"):
        jz.make_train_step(mean_loss, _zero(2), rng=True)
    with pytest.raises(TypeError, match=r"write it as loss_fn\(params, model_state, batch, rng\)"):
        jz.make_train_step(mean_loss, _zero(2), stateful=True)
