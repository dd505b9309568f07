"""Inputs from wherever users have them: params committed to one device or sharded on another
mesh, and a state that a previous step call already donated."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.gpu.models import make_problem


def _host(state):
    return jax.tree.map(np.asarray, jz.gather(state.params))


def _placements(params):
    other = jz.data_parallel_mesh(4)
    return {
        "numpy": jax.tree.map(np.asarray, params),
        "one_device": jax.device_put(params, jax.devices()[0]),
        "last_device": jax.device_put(params, jax.devices()[7]),
        "other_mesh_sharded": jax.tree.map(
            lambda x: jax.device_put(
                x, NamedSharding(other, P("data") if x.shape[0] % 4 == 0 else P())
            ),
            params,
        ),
    }


@pytest.mark.parametrize(
    "where,stage",
    [
        # slow: each placement at a second and third stage (each placement stays at one stage,
        # every stage stays: numpy at 3, one_device at 2, last_device at 0, other_mesh_sharded
        # at 3)
        pytest.param("numpy", 0, marks=pytest.mark.slow),
        pytest.param("numpy", 2, marks=pytest.mark.slow),
        ("numpy", 3),
        pytest.param("one_device", 0, marks=pytest.mark.slow),
        ("one_device", 2),
        pytest.param("one_device", 3, marks=pytest.mark.slow),
        ("last_device", 0),
        pytest.param("last_device", 2, marks=pytest.mark.slow),
        pytest.param("last_device", 3, marks=pytest.mark.slow),
        pytest.param("other_mesh_sharded", 0, marks=pytest.mark.slow),
        pytest.param("other_mesh_sharded", 2, marks=pytest.mark.slow),
        ("other_mesh_sharded", 3),
    ],
)
def test_init_accepts_params_wherever_they_live(stage, where):
    params, loss_fn, batches = make_problem("wide_mlp", steps=2)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=stage)
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.9))
    placed = _placements(params)[where]
    state = step.init(placed)
    want = step.init(jax.tree.map(np.asarray, params))
    mesh_devices = set(zero.mesh.devices.flat)
    for x in jax.tree.leaves(state):
        assert x.sharding.device_set == mesh_devices
    for b in batches:
        state, _ = step(state, b)
        want, _ = step(want, b)
    for a, b in zip(jax.tree.leaves(_host(state)), jax.tree.leaves(_host(want)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_calling_the_step_with_a_donated_state_is_a_clear_error():
    params, loss_fn, batches = make_problem("wide_mlp", steps=2)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    new_state, _ = step(state, batches[0])
    with pytest.raises(ValueError, match="donated to the previous step call"):
        step(state, batches[1])
    # The returned state still works, and nothing was half-run.
    new_state, metrics = step(new_state, batches[1])
    assert int(metrics["step"]) == 2


class _BatchNormNet(nn.Module):
    axis_name: str = "batch"

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        return nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x).sum(-1)


def _bn_problem():
    model = _BatchNormNet()
    v = model.init(jax.random.key(0), np.ones((2, 4), np.float32))

    def loss(p, s, b, r):
        y, new = model.apply({"params": p, **s}, b["x"], mutable=["batch_stats"])
        return ((y - b["y"]) ** 2).mean(), (new, None)

    batch = {"x": np.ones((16, 4), np.float32), "y": np.ones((16,), np.float32)}
    return v["params"], {"batch_stats": v["batch_stats"]}, loss, batch


def test_batchnorm_axis_name_that_is_not_the_mesh_axis_is_a_clear_error():
    params, model_state, loss, batch = _bn_problem()
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(loss, zero, stateful=True)
    state = step.init(params, model_state=model_state, rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"mesh axes are \('data',\).*axis='batch'"):
        step(state, batch)


def test_batchnorm_axis_name_works_when_the_mesh_axis_is_renamed():
    params, model_state, loss, batch = _bn_problem()
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8, axis="batch"), stage=2, axis="batch")
    step = jz.make_train_step(loss, zero, stateful=True)
    state = step.init(params, model_state=model_state, rng=jax.random.key(0))
    state, metrics = step(state, batch)
    assert int(metrics["step"]) == 1


def test_a_second_mesh_axis_not_named_as_a_replica_axis_warns():
    devices = np.array(jax.devices()).reshape(2, 4)
    auto = (jax.sharding.AxisType.Auto,) * 2
    model_mesh = jax.sharding.Mesh(devices, ("model", "data"), axis_types=auto)
    with pytest.warns(UserWarning, match=r"\['model'\] are treated as replica axes"):
        jz.ZeRO(optax.sgd(0.1), model_mesh, stage=2)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8, replicas=2), stage=2)


def test_stateful_step_needs_no_rng_when_the_model_draws_none():
    """A BatchNorm model without dropout: ``stateful=True`` with no ``rng=``;
    the numbers equal a run that passes a key the model never uses."""
    params, model_state, loss, batch = _bn_problem()
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8, axis="batch"), stage=2, axis="batch")
    step = jz.make_train_step(loss, zero, stateful=True)
    no_rng = step.init(params, model_state=model_state)
    with_rng = step.init(params, model_state=model_state, rng=jax.random.key(0))
    for _ in range(2):
        no_rng, _ = step(no_rng, batch)
        with_rng, _ = step(with_rng, batch)
    assert no_rng.rng is None
    for a, b in zip(jax.tree.leaves(_host(no_rng)), jax.tree.leaves(_host(with_rng)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_step_keeps_few_calls_in_flight_on_simulated_cpu_devices():
    """XLA:CPU admits 32 programs in flight per simulated device and launches each device's
    share from a thread pool in no set order; a loop that ran >32 multi-device steps ahead
    deadlocked under load (7 devices waited in an all-reduce for the 8th, whose launch
    waited for a slot held by later steps). The step waits for older calls so that at most
    CPU_MAX_IN_FLIGHT are pending when it returns."""
    import time

    from jaxzero.train.step import CPU_MAX_IN_FLIGHT

    params, loss_fn, batches = make_problem("mlp", steps=40, batch=16)

    def slow_loss(p, b):  # each device sleeps 20 ms per step: the host runs far ahead
        jax.debug.callback(lambda: time.sleep(0.02))
        return loss_fn(p, b)

    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(slow_loss, zero)
    state = step.init(params)
    seen = []
    for b in batches:
        state, m = step(state, b)
        seen.append(m["grad_norm"])
        pending = sum(not x.is_ready() for x in seen)
        assert pending <= CPU_MAX_IN_FLIGHT, (len(seen), pending)
    assert CPU_MAX_IN_FLIGHT < 32


def test_a_step_waits_for_another_steps_calls_on_simulated_cpu_devices():
    """Two steps' programs in flight together deadlocked the slow set: XLA:CPU runs every
    simulated device's collectives on one pool of as many threads as devices, and gdb showed
    six threads in one program's all-gather and two in another's reduce-scatter. A step's
    call on a CPU mesh first waits for the calls another step still has in flight, so when
    it returns those are done (without it the other step's calls are still sleeping)."""
    import time

    params, loss_fn, batches = make_problem("mlp", steps=4, batch=16)

    def slow_loss(p, b):  # each device sleeps 50 ms per step: the host runs far ahead
        jax.debug.callback(lambda: time.sleep(0.05))
        return loss_fn(p, b)

    mesh = jz.data_parallel_mesh(8)
    first = jz.make_train_step(slow_loss, jz.ZeRO(optax.sgd(0.1), mesh, stage=2))
    second = jz.make_train_step(loss_fn, jz.ZeRO(optax.sgd(0.1), mesh, stage=3))
    a, b = first.init(params), second.init(params)
    a, _ = first(a, batches[0])
    b, m = second(b, batches[0])  # both compiled
    m["grad_norm"].block_until_ready()
    pending = []
    for batch in batches[1:]:
        a, m = first(a, batch)
        pending.append(m["grad_norm"])
    assert not pending[-1].is_ready()  # the host ran ahead of the sleeping devices
    b, _ = second(b, batches[1])
    assert all(x.is_ready() for x in pending)
