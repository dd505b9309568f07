"""The sharded EMA: equals a numpy EMA of the parameter trajectory, adds no communication,
holds 1/N of an fp32 copy per device in the master's shards, survives donation, and rejects
bad input with clear errors.

Every expected number comes from numpy or a formula written out here (decay schedules, the
sharding rule, byte counts), never from jaxzero itself.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.gpu.models import MLP, Transformer
from jaxzero.memory import collective_bytes, device_bytes

STEPS = 50
ATOL = 1e-6


# --------------------------------------------------------------------------- problems
# Built once per module (flax's eager init and every compile are slow on a shared CPU).

_CACHE = {}


def _cached(key, build):
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


def problem(name):
    """(params, loss_fn, batches): jaxzero.gpu.models' MLP and make_problem("mlp")'s data and
    loss, with STEPS = 50 batches of 32.

    "mlp" is the 17 -> 31 -> 5 MLP (no leaf shards at N = 2 or 8); "mlp32" has a 32-wide
    hidden layer, so that at N = 2 and 8 the EMA has sharded leaves ((17, 32) on dim 1,
    (32,), (32, 5) on dim 0) and a replicated one (the (5,) bias). Parameters are drawn with
    numpy (lecun-normal kernels, small biases): flax's eager init (make_problem) costs seconds
    of this file's time budget on a shared CPU.
    """

    def build():
        hidden = {"mlp": 31, "mlp32": 32}[name]
        model = MLP(hidden=hidden, out=5)
        rng = np.random.default_rng(0)

        def dense(n_in, n_out):
            return {
                "kernel": (rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)).astype(np.float32),
                "bias": (0.1 * rng.normal(size=(n_out,))).astype(np.float32),
            }

        params = {"fc1": dense(17, hidden), "fc2": dense(hidden, 5)}

        def loss_fn(p, b):
            return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

        data = np.random.default_rng(0)  # make_problem's recipe
        batches = [
            {
                "x": data.normal(size=(32, 17)).astype(np.float32),
                "y": data.normal(size=(32, 5)).astype(np.float32),
            }
            for _ in range(STEPS)
        ]
        return params, loss_fn, batches

    return _cached(name, build)


def transformer_params():
    """jaxzero.gpu.models' Transformer params: shapes from jax.eval_shape, values from numpy
    (their values do not matter for placement and bytes)."""

    def build():
        shapes = jax.eval_shape(
            lambda: Transformer().init(jax.random.PRNGKey(0), jnp.zeros((1, 6, 32)))["params"]
        )
        rng = np.random.default_rng(0)
        return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), jnp.float32), shapes)

    return _cached("transformer", build)


def make_ema(schedule, every=1, start_step=0):
    decay, kwargs = {
        "constant": (0.95, {}),
        "yolov5_fast": (0.9, {"tau": 1.0}),
        "yolov5_slow": (0.9999, {"tau": 2000.0}),
        "tf": (0.999, {"schedule": "tf"}),
    }[schedule]
    return jz.ShardedEMA(decay, every=every, start_step=start_step, **kwargs)


def train_step(problem_name, stage, n, schedule=None, every=1, start_step=0):
    """A cached TrainStep (adam 1e-2) so tests on the same configuration share one compile;
    schedule=None builds the step without an EMA."""

    def build():
        _, loss_fn, _ = problem(problem_name)
        zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(n), stage=stage)
        ema = None if schedule is None else make_ema(schedule, every, start_step)
        return jz.make_train_step(loss_fn, zero, ema=ema)

    return _cached(("step", problem_name, stage, n, schedule, every, start_step), build)


def nan_batch(batch):
    """A copy of ``batch`` with one NaN input: its step's gradient is non-finite (skipped)."""
    bad = {"x": batch["x"].copy(), "y": batch["y"]}
    bad["x"][0, 0] = np.nan
    return bad


def np64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(tree))


# --------------------------------------------------------------------------- 1. equivalence

# Decay schedules written out independently of jaxzero (n = number of this update, from 1),
# for the ShardedEMAs make_ema builds.
DECAYS = {
    "constant": lambda n: 0.95,
    "yolov5_fast": lambda n: 0.9 * (1.0 - math.exp(-n / 1.0)),
    "yolov5_slow": lambda n: 0.9999 * (1.0 - math.exp(-n / 2000.0)),
    "tf": lambda n: min(0.999, n / (9.0 + n)),
}


def reference_ema(params0, trajectory, decay_fn, *, every=1, start_step=0):
    """numpy float64 EMA of ``trajectory`` (params after steps 1, 2, ...), per the ShardedEMA
    docstring: t = steps taken; t < start_step copies (counter frozen); else average iff
    (t - start_step) % every == 0. Returns (EMA, counter) after every step."""
    ema, updates, out = np64(params0), 0, []
    for t, p in enumerate(trajectory, start=1):
        if t < start_step:
            ema = p
        elif (t - start_step) % every == 0:
            updates += 1
            d = decay_fn(updates)
            ema = jax.tree.map(lambda e, x, d=d: d * e + (1.0 - d) * x, ema, p)
        out.append((ema, updates))
    return out


def assert_close(got, want, atol, what):
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want)
    for (path, g), w in zip(flat_got, flat_want, strict=True):
        err = float(np.max(np.abs(np.asarray(g, np.float64) - w)))
        assert err <= atol, f"{what}: {jax.tree_util.keystr(path)} off by {err:.3g} > {atol}"


def run_and_check(problem_name, stage, n, schedule, *, every=1, start_step=0):
    params, _, batches = problem(problem_name)
    assert len(batches) == STEPS
    step = train_step(problem_name, stage, n, schedule, every, start_step)
    state = step.init(params)
    trajectory, emas = [], []
    for b in batches:
        state, _ = step(state, b)
        # The params trajectory, assembled on the host (fp32: params == master).
        trajectory.append(np64(state.params))
        emas.append((jax.device_get(state.ema.ema), int(state.ema.updates)))
    want = reference_ema(params, trajectory, DECAYS[schedule], every=every, start_step=start_step)
    for t, ((got_ema, got_n), (want_ema, want_n)) in enumerate(zip(emas, want, strict=True), 1):
        assert got_n == want_n, f"step {t}: updates {got_n} != {want_n}"
        assert_close(got_ema, want_ema, ATOL, f"step {t}")
    # The one-off gather returns the same EMA, replicated.
    gathered = jz.gather(state.ema)
    for leaf in jax.tree.leaves(gathered):
        assert leaf.sharding.is_fully_replicated
    assert_close(gathered, want[-1][0], ATOL, "gather(state.ema)")
    # The EMA is far from the params, so the comparison can tell them apart.
    if schedule != "yolov5_slow":  # (its d = n/2000 keeps the EMA within 1e-4 of the params)
        diff = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(
                jax.tree.leaves(want[-1][0]), jax.tree.leaves(trajectory[-1]), strict=True
            )
        )
        assert diff > 100 * ATOL
    if n > 1 and problem_name == "mlp32":
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.ema.ema))
    return state


# (problem, stage, N, schedule): every stage, every N and every schedule appear; the
# 32-wide MLP makes N = 2 and N = 8 shard.
EQUIVALENCE_CASES = [
    ("mlp", 0, 1, "constant"),
    ("mlp32", 1, 2, "yolov5_fast"),
    ("mlp32", 2, 8, "yolov5_slow"),
    ("mlp32", 3, 8, "tf"),
]
# (stage, N, schedule, every, start_step) on mlp32; stage 0 at N = 8 is a replicated master
# with a sharded EMA. (every and start_step are also checked one at a time, standalone.)
GATED_CASES = [(0, 8, "tf", 3, 5)]


def test_equivalence_cases_cover_every_value():
    assert {c[1] for c in EQUIVALENCE_CASES} == {0, 1, 2, 3}
    assert {c[2] for c in EQUIVALENCE_CASES} == {1, 2, 8}
    assert {c[3] for c in EQUIVALENCE_CASES} == set(DECAYS)


@pytest.mark.parametrize("problem_name,stage,n,schedule", EQUIVALENCE_CASES)
def test_matches_numpy_ema_over_50_steps(problem_name, stage, n, schedule):
    state = run_and_check(problem_name, stage, n, schedule)
    assert int(state.step) == STEPS
    assert int(state.ema.updates) == STEPS


@pytest.mark.parametrize("stage,n,schedule,every,start_step", GATED_CASES)
def test_every_and_start_step_in_train_step(stage, n, schedule, every, start_step):
    state = run_and_check("mlp32", stage, n, schedule, every=every, start_step=start_step)
    t = np.arange(1, STEPS + 1)
    expected_updates = int(np.sum((t >= start_step) & ((t - start_step) % every == 0)))
    assert expected_updates == 16  # t = 5, 8, ..., 50
    assert int(state.ema.updates) == expected_updates


@pytest.mark.parametrize(
    "every,start_step,averaged",
    [(3, 0, [3, 6, 9, 12]), (1, 5, [5, 6, 7, 8, 9, 10, 11, 12]), (3, 5, [5, 8, 11])],
)
def test_every_and_start_step_semantics_standalone(every, start_step, averaged):
    """Scalar EMA driven by explicit steps t = 1..12: before start_step it copies (counter
    frozen), from start_step on it averages when (t - start_step) % every == 0 and holds
    otherwise."""
    ema = jz.ShardedEMA(0.5, every=every, start_step=start_step)
    state = ema.init({"w": jnp.zeros((), jnp.float32)})
    e, updates = 0.0, 0
    for t in range(1, 13):
        x = float(t)
        state = ema.update(state, {"w": jnp.asarray(x, jnp.float32)}, step=t)
        if t < start_step:
            e = x  # copy
        elif t in averaged:
            updates += 1
            e = 0.5 * e + 0.5 * x
        assert int(state.updates) == updates, t
        assert float(state.ema["w"]) == e, t
    assert updates == len(averaged)
    # step=None means "always update".
    ema = jz.ShardedEMA(0.5)
    s = ema.update(ema.init({"w": jnp.zeros(())}), {"w": jnp.ones(())})
    assert (int(s.updates), float(s.ema["w"])) == (1, 0.5)


# --------------------------------------------------------------------------- 2. no communication


def _collective_summary(hlo_text):
    return {k: (v["count"], v["bytes"]) for k, v in collective_bytes(hlo_text).items()}


# (N, schedule, every, start_step) per stage: the sharded (N > 1) configurations of the tests
# above, so that the with-EMA compile is shared with them.
COLLECTIVE_CASES = {
    0: (8, "tf", 3, 5),
    1: (2, "yolov5_fast", 1, 0),
    2: (8, "yolov5_slow", 1, 0),
    3: (8, "tf", 1, 0),
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ema_adds_no_collectives(stage):
    params, _, batches = problem("mlp32")
    n, schedule, every, start_step = COLLECTIVE_CASES[stage]
    with_ema = train_step("mlp32", stage, n, schedule, every, start_step)
    without = train_step("mlp32", stage, n)
    # Abstract states (ShapeDtypeStructs with the ZeRO shardings): nothing is allocated.
    s_with = with_ema.zero.abstract_state(params, ema=with_ema.ema)
    s_without = without.zero.abstract_state(params)
    hlo_with = with_ema.lower(s_with, batches[0]).compile().as_text()
    hlo_without = without.lower(s_without, batches[0]).compile().as_text()
    a, b = _collective_summary(hlo_with), _collective_summary(hlo_without)
    assert hlo_with != hlo_without  # the EMA is in the compiled step
    assert a == b
    assert sum(count for count, _ in b.values()) > 0  # the gradient reduction is seen
    # The standalone update on the shards (master = the params' local slice) has no
    # collective at all.
    zero, ema = with_ema.zero, with_ema.ema
    update = jax.jit(
        lambda s: zero.update_ema(ema, s.ema, zero.master_view(s), step=s.step, apply=True)
    )
    hlo = update.lower(s_with).compile().as_text()
    assert all(count == 0 and nbytes == 0 for count, nbytes in _collective_summary(hlo).values())


# --------------------------------------------------------------------------- 3. memory and placement


def expected_spec(shape, n):
    """The documented rule: shard the largest dim divisible by n (earliest on ties)."""
    best = None
    for d, size in enumerate(shape):
        if size % n == 0 and size > 0 and (best is None or size > shape[best]):
            best = d
    return P() if best is None else P(*([None] * best + ["data"]))


def transformer_state(stage, precision="fp32"):
    def build():
        zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=stage, precision=precision)
        return zero.init(transformer_params(), ema=jz.ShardedEMA(0.999))

    return _cached(("transformer_state", stage, precision), build)


@pytest.mark.parametrize("stage", [0, 2])
def test_ema_bytes_per_device_transformer(stage):
    n = 8
    params = transformer_params()
    state = transformer_state(stage)
    sizes = [math.prod(x.shape) for x in jax.tree.leaves(params)]
    replicated = [
        math.prod(x.shape) for x in jax.tree.leaves(params) if not any(d % n == 0 for d in x.shape)
    ]
    phi, r = sum(sizes), sum(replicated)
    assert r == 3 and (phi - r) % n == 0  # the head's (3,) bias is the one replicated leaf
    per_device = device_bytes(state.ema.ema)
    assert len(per_device) == n
    exact = 4 * (phi - r) // n + 4 * r  # each device: 1/N of the sharded leaves, all of r
    for dev, nbytes in per_device.items():
        assert nbytes == exact, dev
        assert nbytes <= 4 * phi / n + 4 * r
    assert exact < 4 * phi / (n - 1)  # far from a replicated fp32 copy (4 * phi)


@pytest.mark.parametrize(
    "stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")]
)
def test_ema_leaves_in_master_shards(stage, precision):
    n = 8
    mesh = jz.data_parallel_mesh(n)
    state = transformer_state(stage, precision)
    ema_leaves = jax.tree_util.tree_flatten_with_path(state.ema.ema)[0]
    if precision == "bf16":
        master = state.master  # the separate fp32 master copy
    elif stage in (1, 2):
        master = state.opt_state[0].mu  # adam's mu lives in the master's shards
    elif stage == 3:
        master = state.params
    else:
        master = None  # stage 0: replicated master; the EMA is sharded anyway
    n_sharded = 0
    for i, (path, e) in enumerate(ema_leaves):
        want = NamedSharding(mesh, expected_spec(e.shape, n))
        assert e.sharding == want, jax.tree_util.keystr(path)
        assert e.dtype == jnp.float32
        n_sharded += not e.sharding.is_fully_replicated
        if master is not None and stage >= 1:
            assert e.sharding == jax.tree.leaves(master)[i].sharding, jax.tree_util.keystr(path)
    assert n_sharded == len(ema_leaves) - 1
    assert state.ema.updates.sharding == NamedSharding(mesh, P())


# --------------------------------------------------------------------------- 4. jit + donation


def test_ema_survives_donation_and_compiles_once():
    params, _, batches = problem("mlp32")
    step = train_step("mlp32", 3, 8, "tf")  # stage 3: params, master and EMA all sharded
    state = step.init(params)

    def signature(s):
        leaves = [s.ema.updates, *jax.tree.leaves(s.ema.ema)]
        return [(jax.typeof(x), x.sharding, x.dtype, x.shape) for x in leaves]

    sig0 = signature(state)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.ema.ema))
    sigs = []
    for i, b in enumerate(batches[:3]):
        old = state
        state, _ = step(state, b)
        if i == 0:
            # The state was donated: its buffers are gone, the new ones are alive.
            assert all(x.is_deleted() for x in jax.tree.leaves(old.ema))
        sigs.append(signature(state))
    assert sigs[0] == sig0
    assert sigs[2] == sig0
    assert int(state.ema.updates) == 3
    # A step skipped for a non-finite gradient leaves the EMA unchanged bit for bit.
    before = jax.device_get(state.ema)
    bad = nan_batch(batches[3])
    state, metrics = step(state, bad)
    assert not bool(metrics["finite"])
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.ema)), jax.tree.leaves(before), strict=True
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert signature(state) == sig0
    if hasattr(step.jitted, "_cache_size"):
        assert step.jitted._cache_size() == 1
    else:  # pragma: no cover - other jax versions
        assert len({str(s) for s in sigs}) == 1


def test_train_step_counter_counts_applied_steps_from_updates0():
    """In a train step the default EMA's counter is derived from the step's (they share a GPU
    kernel): it starts at ``updates0``, advances with every applied step, and not on a step
    skipped for a non-finite gradient; the averaged values use the same counts (yolov5 decay:
    ``d = 0.9 (1 - exp(-n / 2))`` with n = 8, 9 after updates0 = 7; numpy reference)."""
    params, loss_fn, batches = problem("mlp32")
    ema = jz.ShardedEMA(0.9, tau=2.0, updates0=7)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(loss_fn, zero, ema=ema)
    state = step.init(params)
    want = np64(params)
    bad = nan_batch(batches[1])
    for n, b in ((8, batches[0]), (None, bad), (9, batches[2])):
        state, metrics = step(state, b)
        assert bool(metrics["finite"]) == (n is not None)
        if n is not None:
            d = 0.9 * (1 - math.exp(-n / 2.0))
            want = jax.tree.map(lambda e, p, d=d: d * e + (1 - d) * p, want, np64(state.params))
    assert int(state.ema.updates) == 9
    assert int(state.step) == 2
    assert_close(jax.device_get(jz.gather(state.ema)), want, ATOL, "EMA after updates0=7")


# --------------------------------------------------------------------------- 5. standalone update


def test_non_float_leaves_copied_not_averaged():
    ema = jz.ShardedEMA(0.75)
    tree0 = {"w": jnp.array([1.0, 2.0], jnp.float32), "count": jnp.array([3, 4], jnp.int32)}
    tree1 = {"w": jnp.array([5.0, -2.0], jnp.float32), "count": jnp.array([10, 20], jnp.int32)}
    state = ema.init(tree0)
    assert state.ema["count"].dtype == jnp.int32
    np.testing.assert_array_equal(state.ema["count"], [3, 4])
    state = ema.update(state, tree1)
    np.testing.assert_array_equal(state.ema["count"], [10, 20])
    assert state.ema["count"].dtype == jnp.int32
    np.testing.assert_allclose(
        state.ema["w"], 0.75 * np.array([1.0, 2.0]) + 0.25 * np.array([5.0, -2.0]), rtol=1e-7
    )
    assert int(state.updates) == 1


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("start_step", [0, 5])  # 5: steps 1, 2 would copy, not average
def test_apply_false_leaves_state_unchanged(traced, start_step):
    ema = jz.ShardedEMA(0.9, tau=3.0, updates0=7, start_step=start_step)
    rng = np.random.default_rng(0)
    tree0 = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "i": jnp.arange(3)}
    tree1 = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "i": jnp.arange(3) + 5}
    state = ema.update(ema.init(tree0), tree1)  # a non-trivial state, counter 8
    assert int(state.updates) == 8
    update = jax.jit(ema.update) if traced else ema.update
    for step in (None, 1, 2):
        kwargs = {} if step is None else {"step": step}
        new = update(state, tree1, apply=jnp.asarray(False) if traced else False, **kwargs)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state), strict=True):
            assert a.dtype == b.dtype
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        # ... while apply=True with the same arguments does change it.
        moved = update(state, tree1, apply=jnp.asarray(True) if traced else True, **kwargs)
        assert not np.array_equal(np.asarray(moved.ema["w"]), np.asarray(state.ema["w"]))


# --------------------------------------------------------------------------- 6. errors


@pytest.mark.parametrize("decay", [0, 1, 1.5, -0.1, 0.0, 1.0])
def test_decay_outside_open_interval(decay):
    with pytest.raises(ValueError, match=r"decay=.*open interval \(0, 1\)"):
        jz.ShardedEMA(decay)


@pytest.mark.parametrize("tau", [0, 0.0, -1.0])
def test_tau_not_positive(tau):
    with pytest.raises(ValueError, match=r"tau=.*must be > 0"):
        jz.ShardedEMA(0.9, tau=tau)


@pytest.mark.parametrize("every", [0, -3])
def test_every_below_one(every):
    with pytest.raises(ValueError, match=r"every=.*must be an int >= 1"):
        jz.ShardedEMA(0.9, every=every)


def _tree():
    return {
        "enc": {"bias": jnp.zeros((5,)), "kernel": jnp.zeros((16, 5))},
        "head": {"bias": jnp.zeros((3,)), "kernel": jnp.zeros((5, 3))},
    }


def test_update_with_renamed_leaf_names_path():
    ema = jz.ShardedEMA(0.9)
    state = ema.init(_tree())
    other = _tree()
    other["head"]["b"] = other["head"].pop("bias")
    with pytest.raises(ValueError, match=re.escape("['head']['bias']")):
        ema.update(state, other)


def test_update_with_other_shapes_names_first_differing_path():
    ema = jz.ShardedEMA(0.9)
    state = ema.init(_tree())
    other = _tree()
    other["enc"]["kernel"] = jnp.zeros((16, 6))
    other["head"]["kernel"] = jnp.zeros((6, 3))
    with pytest.raises(ValueError, match=re.escape("['enc']['kernel']")) as info:
        ema.update(state, other)
    assert "['head']" not in str(info.value)
    assert "(16, 5)" in str(info.value) and "(16, 6)" in str(info.value)


def test_train_step_with_ema_but_state_without():
    params, loss_fn, batches = problem("mlp")
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(2), stage=1)
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.9))
    with pytest.raises(ValueError, match="updates an EMA but state has none"):
        step(zero.init(params), batches[0])


def test_train_step_without_ema_but_state_with():
    params, loss_fn, batches = problem("mlp")
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(2), stage=1)
    step = jz.make_train_step(loss_fn, zero)
    with pytest.raises(ValueError, match="state carries an EMA but the step was built without"):
        step(zero.init(params, ema=jz.ShardedEMA(0.9)), batches[0])


# --------------------------------------------------------------------------- 7. ema_params


def test_ema_params_replicated_in_param_dtype():
    params, _, _ = problem("mlp32")
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=2, precision="bf16")
    ema = jz.ShardedEMA(0.3)
    state = zero.init(params, ema=ema)
    # Move the EMA off the params: one update toward a perturbed master (sharded, fp32).
    rng = np.random.default_rng(1)
    master = jax.tree.map(
        lambda m: m + jax.device_put(rng.normal(size=m.shape).astype(np.float32), m.sharding),
        zero.master_view(state),
    )
    update = jax.jit(lambda e, m: zero.update_ema(ema, e, m, step=1, apply=True))
    state = state.replace(ema=update(state.ema, master))
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.ema.ema))
    out = jz.ema_params(state)
    gathered = jz.gather(state.ema)
    host_ema = jax.device_get(state.ema.ema)  # assembled on the host, no jaxzero involved
    assert jax.tree.structure(out) == jax.tree.structure(params)
    for o, g, h, p in zip(
        jax.tree.leaves(out),
        jax.tree.leaves(gathered),
        jax.tree.leaves(host_ema),
        jax.tree.leaves(state.params),
        strict=True,
    ):
        assert o.dtype == jnp.bfloat16 == p.dtype
        assert o.shape == p.shape
        assert o.sharding.is_fully_replicated
        assert g.dtype == jnp.float32
        want = np.asarray(h, np.float32).astype(jnp.bfloat16)
        assert np.asarray(o).tobytes() == want.tobytes()
        assert np.asarray(o).tobytes() == np.asarray(g).astype(jnp.bfloat16).tobytes()
    # The EMA has moved away from the params (so the comparison above means something).
    assert any(
        not np.array_equal(np.asarray(o), np.asarray(p))
        for o, p in zip(jax.tree.leaves(out), jax.tree.leaves(state.params), strict=True)
    )
    # An explicit dtype is honoured.
    f32 = jz.ema_params(state, jnp.float32)
    for o, h in zip(jax.tree.leaves(f32), jax.tree.leaves(host_ema), strict=True):
        assert o.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(o), np.asarray(h))


def test_ema_params_needs_an_ema():
    params, _, _ = problem("mlp")
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(2), stage=0)
    with pytest.raises(ValueError, match="needs a TrainState with an EMA"):
        jz.ema_params(zero.init(params))


# --------------------------------------------------------------------------- library bugs found


def test_zero_update_ema_renamed_leaf_names_path():
    """BUG (jaxzero/optimizer.py, ZeRO.update_ema, line ~291): with a params tree whose leaf
    is renamed, the tree.map inside the shard_map raises jax's raw "pytree structure error"
    before ShardedEMA.update's check_same_tree can name the path."""
    mesh = jz.data_parallel_mesh(8)
    zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=2)
    ema = jz.ShardedEMA(0.9)
    state = zero.init(_tree(), ema=ema)
    other = _tree()
    other["head"]["b"] = other["head"].pop("bias")
    with pytest.raises(ValueError, match=re.escape("missing paths [\"['head']['bias']\"]")):
        zero.update_ema(ema, state.ema, other, step=1, apply=True)


def test_zero_update_ema_shape_mismatch_reports_global_shapes():
    """BUG (jaxzero/optimizer.py, ZeRO.update_ema, line ~292): check_same_tree runs inside
    the shard_map on per-device blocks, so the error reports shard shapes ((2, 5) vs (4, 5))
    instead of the leaves' shapes ((16, 5) vs (32, 5))."""
    mesh = jz.data_parallel_mesh(8)
    zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=2)
    ema = jz.ShardedEMA(0.9)
    state = zero.init(_tree(), ema=ema)
    other = _tree()
    other["enc"]["kernel"] = jnp.zeros((32, 5))
    with pytest.raises(
        ValueError, match=re.escape("shape (16, 5) but the new one has shape (32, 5)")
    ):
        zero.update_ema(ema, state.ema, other, step=1, apply=True)


def test_numpy_scalar_hyperparameters_accepted():
    """BUG (jaxzero/ema.py, ShardedEMA.__post_init__, lines 84/86/94): isinstance(..., (int,
    float)) rejects numpy scalars, e.g. a decay of np.float32(0.9) read from a config fails
    with "must be in the open interval (0, 1)", which it is."""
    ema = jz.ShardedEMA(np.float32(0.9), tau=np.float32(2.0), every=np.int64(2))
    assert math.isclose(float(ema.decay), 0.9, rel_tol=1e-6)


_COMPILES = {"on": False, "count": 0}


def _count_backend_compiles(name, *_args, **_kwargs):
    if _COMPILES["on"] and name == "/jax/core/compile/backend_compile_duration":
        _COMPILES["count"] += 1


jax.monitoring.register_event_duration_secs_listener(_count_backend_compiles)


def test_repeated_gather_compiles_once():
    """BUG (jaxzero/gather.py, gather line 35 and ema_params line 48): each call builds a new
    ``jax.jit(lambda ...)``, so every call re-traces and recompiles (measured: ~0.5 s per
    gather of a 20M-float EMA vs ~0.1 s for the all-gather itself, benchmarks/ema.py).
    Evaluating the EMA every few hundred steps pays the compile every time."""
    params, _, _ = problem("mlp32")
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2)
    state = zero.init(params, ema=jz.ShardedEMA(0.9))
    jax.block_until_ready((jz.gather(state.ema), jz.ema_params(state)))  # first calls compile
    _COMPILES.update(on=True, count=0)
    try:
        for _ in range(2):
            jax.block_until_ready((jz.gather(state.ema), jz.ema_params(state)))
    finally:
        _COMPILES["on"] = False
    assert _COMPILES["count"] == 0
