"""The bucketed sharded EMA (``ShardedEMA(bucket_leaves_up_to=K)``): small float leaves in one
``[N, L]`` bucket. It must equal the numpy EMA and the per-leaf EMA, add no communication,
hold the same bytes per device, survive donation, and read/write the same checkpoints and
torch files as the per-leaf EMA.

Expected numbers come from numpy (test_ema.py's reference EMA), from the per-leaf mode, or
from the sharding rule written out here; never from the bucket code under test.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_ema as base
import tolerance
from conftest import require
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero.distributed.host import replicator as _replicator
from jaxzero.memory import collective_bytes, device_bytes

# At N = 8 the mlp32 EMA's per-device blocks are fc1.kernel 68, fc1.bias 4, fc2.kernel 20 and
# fc2.bias 5 (replicated) elements; at N = 2: 272, 16, 80, 5; at N = 1: 544, 32, 160, 5. So
# K = 32 buckets a mix of sharded and replicated leaves and keeps the big kernels per-leaf.
K = 32


def bucketed_ema(schedule, every=1, start_step=0, k=K):
    e = base.make_ema(schedule, every, start_step)
    return jz.ShardedEMA(
        e.decay, tau=e.tau, schedule=e.schedule, every=every, start_step=start_step,
        bucket_leaves_up_to=k,
    )  # fmt: skip


def bucketed_step(stage, n, schedule, every=1, start_step=0, k=K):
    def build():
        _, loss_fn, _ = base.problem("mlp32")
        zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(n), stage=stage)
        return jz.make_train_step(loss_fn, zero, ema=bucketed_ema(schedule, every, start_step, k))

    return base._cached(("bucket_step", stage, n, schedule, every, start_step, k), build)


def assert_same(got, want, *, exact, what=""):
    """Bit for bit when ``exact``; else within 1e-7 absolute + 2 ulp relative: the two storages
    are separate XLA fusions, and LLVM may contract ``d * e + (1 - d) * x`` into an FMA in one
    and not the other (torch_compatible=True forbids that, hence bit-exact)."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, what
        if exact:
            assert x.tobytes() == y.tobytes(), what
        else:
            # one FMA contraction's rounding (the docstring), not a sum's order: 2 fp32 ulps
            np.testing.assert_allclose(x, y, rtol=2.4e-7, atol=1e-7, err_msg=str(what))


def expected_local_size(shape, n):
    """Per-device elements under the documented rule (largest dim divisible by n)."""
    spec = base.expected_spec(shape, n)
    size = math.prod(shape)
    return size // n if spec != P() else size


def expected_rows(per_leaf_host, n, k):
    """The bucket's (single) row built from a per-leaf host EMA: row i = device i's blocks of
    the float leaves with at most k elements per device, smallest first (ties: tree order)."""
    rows = [[] for _ in range(n)]
    leaves = [np.asarray(x) for x in jax.tree.leaves(per_leaf_host)]
    small = [x for x in leaves if expected_local_size(x.shape, n) <= k]
    for x in sorted(small, key=lambda x: expected_local_size(x.shape, n)):
        spec = base.expected_spec(x.shape, n)
        d = None if spec == P() else len(spec) - 1
        for i in range(n):
            block = x if d is None else np.split(x, n, axis=d)[i]
            rows[i].append(block.reshape(-1))
    return np.stack([np.concatenate(r) for r in rows])


# --------------------------------------------------------------------------- 1. equivalence

CASES = [(0, 1, "constant"), (1, 2, "yolov5_fast"), (2, 8, "yolov5_slow"), (3, 8, "tf")]


@pytest.mark.parametrize("stage,n,schedule", CASES)
def test_bucketed_matches_numpy_ema_over_50_steps(stage, n, schedule):
    params, _, batches = base.problem("mlp32")
    step = bucketed_step(stage, n, schedule)
    state = step.init(params)
    assert isinstance(state.ema.ema, jz.BucketedTree)
    want_len = sum(
        expected_local_size(x.shape, n)
        for x in jax.tree.leaves(params)
        if expected_local_size(x.shape, n) <= K
    )
    (row,) = state.ema.ema.bucket  # fewer than LEAVES_PER_ROW small leaves: one row
    assert row.shape == (n, want_len)
    assert row.sharding == NamedSharding(step.zero.mesh, P("data"))
    big = [x for x in jax.tree.leaves(params) if expected_local_size(x.shape, n) > K]
    assert [x.shape for x in jax.tree.leaves(state.ema.ema.rest)] == [x.shape for x in big]
    checked = (1, 2, 25, base.STEPS)
    trajectory, emas = [], {}
    for t, b in enumerate(batches, 1):
        state, _ = step(state, b)
        trajectory.append(base.np64(state.params))
        if t in checked:  # host copies: the next step donates these buffers
            emas[t] = (
                np.asarray(jax.device_get(state.ema.ema.bucket[0]), np.float64),
                jax.device_get(jz.unbucket_ema(state.ema)),
            )
    want = base.reference_ema(params, trajectory, base.DECAYS[schedule])
    for t in checked:
        (rows, per_leaf), (want_ema, want_n) = emas[t], want[t - 1]
        assert int(per_leaf.updates) == want_n == t
        # The raw bucket rows, laid out independently from the numpy EMA.
        err = np.max(np.abs(rows - expected_rows(want_ema, n, K)))
        assert err <= base.ATOL, f"step {t}: bucket off by {err:.3g}"
        base.assert_close(per_leaf.ema, want_ema, base.ATOL, f"step {t}")
    gathered = jz.gather(state.ema)
    assert jax.tree.structure(gathered) == jax.tree.structure(params)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(gathered))
    base.assert_close(gathered, want[-1][0], base.ATOL, "gather")


def test_every_and_start_step_and_skip_match_per_leaf():
    """every / start_step gating and a skipped (non-finite) step: the bucketed EMA equals the
    per-leaf EMA bit for bit after every step."""
    params, _, batches = base.problem("mlp32")
    per_leaf = base.train_step("mlp32", 0, 8, "tf", 3, 5)
    bucketed = bucketed_step(0, 8, "tf", 3, 5)
    a, b = per_leaf.init(params), bucketed.init(params)
    for t, batch in enumerate(batches[:12], 1):
        if t == 8:  # would average (training step 8); skipped, so steps 8 and 11 come later
            batch = {"x": batch["x"].copy(), "y": batch["y"]}
            batch["x"][0, 0] = np.nan
        a, _ = per_leaf(a, batch)
        b, metrics = bucketed(b, batch)
        assert bool(metrics["finite"]) == (t != 8)
        assert int(a.ema.updates) == int(b.ema.updates), t
        got = jax.device_get(jz.unbucket_ema(b.ema).ema)
        assert_same(got, jax.device_get(a.ema.ema), exact=False, what=t)
    assert int(b.ema.updates) == 3  # training steps 5, 8, 11


@pytest.mark.parametrize("torch_compatible", [False, True])
def test_bucketed_equals_per_leaf_bitwise(torch_compatible):
    params, loss_fn, batches = base.problem("mlp32")
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=2)
    kw = dict(tau=3.0, torch_compatible=torch_compatible)
    steps = [
        jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.9, bucket_leaves_up_to=k, **kw))
        for k in (0, K)
    ]
    a, b = (s.init(params) for s in steps)
    for batch in batches[:4]:
        a, _ = steps[0](a, batch)
        b, _ = steps[1](b, batch)
    assert isinstance(b.ema.ema, jz.BucketedTree) and not isinstance(a.ema.ema, jz.BucketedTree)
    host_a = jax.device_get(a.ema.ema)
    assert_same(jax.device_get(jz.gather(b.ema)), host_a, exact=torch_compatible)
    (rows,) = jax.device_get(b.ema.ema.bucket)
    assert_same(rows, expected_rows(host_a, 8, K).astype(np.float32), exact=torch_compatible)


# --------------------------------------------------------------------------- 2. no communication


def _collectives(hlo):
    return {k: (v["count"], v["bytes"]) for k, v in collective_bytes(hlo).items()}


def _entry_fusions(hlo):
    entry = hlo[hlo.index("ENTRY") :]
    return entry.count(" fusion(")


# The sharded configurations of the tests above, so that their compiles are shared.
COLLECTIVE_CASES = [(0, 8, "tf", 3, 5), (2, 8, "yolov5_slow", 1, 0)]


@pytest.mark.parametrize("stage,n,schedule,every,start_step", COLLECTIVE_CASES)
def test_bucketed_ema_adds_no_collectives(stage, n, schedule, every, start_step):
    params, _, batches = base.problem("mlp32")
    with_ema = bucketed_step(stage, n, schedule, every, start_step)
    without = base.train_step("mlp32", stage, n)
    s_with = with_ema.zero.abstract_state(params, ema=with_ema.ema)
    assert isinstance(s_with.ema.ema, jz.BucketedTree)
    hlo_with = with_ema.lower(s_with, batches[0]).compile().as_text()
    hlo_without = without.lower(without.zero.abstract_state(params), batches[0]).compile()
    assert _collectives(hlo_with) == _collectives(hlo_without.as_text())

    def standalone(ema, state):
        zero = with_ema.zero
        update = jax.jit(
            lambda s: zero.update_ema(ema, s.ema, zero.master_view(s), step=s.step, apply=True)
        )
        return update.lower(state).compile().as_text()

    hlo = standalone(with_ema.ema, s_with)
    assert all(count == 0 for count, _ in _collectives(hlo).values())
    # Fewer kernels than the per-leaf update: the point of the bucket.
    per_leaf = base.train_step("mlp32", stage, n, schedule, every, start_step)
    hlo_leaf = standalone(per_leaf.ema, per_leaf.zero.abstract_state(params, ema=per_leaf.ema))
    assert _entry_fusions(hlo) < _entry_fusions(hlo_leaf)


def test_gather_is_one_all_gather_per_sharded_leaf():
    params, _, _ = base.problem("mlp32")
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2)
    hlos = []
    for k in (0, K):
        state = zero.init(params, ema=jz.ShardedEMA(0.9, bucket_leaves_up_to=k))
        gathered = jz.gather(state.ema)
        # The program jz.gather runs (its cached jit for this mesh).
        hlos.append(_replicator(zero.mesh).lower(state.ema.ema).compile().as_text())
        for x, p in zip(jax.tree.leaves(gathered), jax.tree.leaves(params), strict=True):
            np.testing.assert_array_equal(np.asarray(x), p)
    per_leaf, bucketed = ({k: v for k, v in _collectives(h).items() if v[0]} for h in hlos)
    assert set(bucketed) == set(per_leaf) == {"all-gather"}
    n_sharded = sum(base.expected_spec(p.shape, 8) != P() for p in jax.tree.leaves(params))
    assert 0 < bucketed["all-gather"][0] <= n_sharded
    assert bucketed["all-gather"][1] == per_leaf["all-gather"][1]


# --------------------------------------------------------------------------- 3. memory and placement


@pytest.mark.parametrize("stage", [0, 2])
def test_bucketed_bytes_per_device_transformer(stage):
    n, k = 8, 64
    params = base.transformer_params()
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(n), stage=stage)
    state = zero.init(params, ema=jz.ShardedEMA(0.999, bucket_leaves_up_to=k))
    shapes = [x.shape for x in jax.tree.leaves(params)]
    phi = sum(math.prod(s) for s in shapes)
    r = sum(math.prod(s) for s in shapes if base.expected_spec(s, n) == P())
    small = [s for s in shapes if expected_local_size(s, n) <= k]
    assert 0 < len(small) < len(shapes)
    # The bucket holds what the leaves it replaces held per device: no overhead at all.
    exact = 4 * (phi - r) // n + 4 * r
    per_device = device_bytes(state.ema.ema)
    assert len(per_device) == n and set(per_device.values()) == {exact}
    (bucket,) = state.ema.ema.bucket
    length = sum(expected_local_size(s, n) for s in small)
    assert bucket.shape == (n, length)
    assert all(s.data.shape == (1, length) for s in bucket.addressable_shards)


def test_bucketed_ema_survives_donation_and_compiles_once():
    params, _, batches = base.problem("mlp32")
    step = bucketed_step(3, 8, "tf")

    def signature(s):
        leaves = [s.ema.updates, *jax.tree.leaves(s.ema.ema)]
        return [(jax.typeof(x), x.sharding, x.dtype, x.shape) for x in leaves]

    state = step.init(params)
    sig0 = signature(state)
    for i, b in enumerate(batches[:3]):
        old = state
        state, _ = step(state, b)
        if i == 0:
            assert old.ema.ema.bucket[0].is_deleted()
        assert signature(state) == sig0
    if hasattr(step.jitted, "_cache_size"):
        assert step.jitted._cache_size() == 1


# --------------------------------------------------------------------------- 4. consumers


def test_ema_params_and_model_state_match_per_leaf_mode():
    params, _, _ = base.problem("mlp32")
    model_state = {
        "stats": {"mean": np.arange(32, dtype=np.float32), "var": np.ones(5, np.float32)},
        "count": np.arange(3, dtype=np.int32),
    }
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=2, precision="bf16")
    out = []
    for k in (0, K):
        # torch_compatible: no FMA contraction, so both storages round the same way.
        ema = jz.ShardedEMA(0.3, bucket_leaves_up_to=k, torch_compatible=True)
        state = zero.init(params, ema=ema, model_state=model_state)
        target = zero._ema_target(zero.master_view(state), state.model_state)
        shifted = jax.tree.map(
            lambda m: (
                m + jax.device_put(np.full(m.shape, 0.5, m.dtype), m.sharding)
                if jnp.issubdtype(m.dtype, jnp.floating)
                else m + 1
            ),
            target,
        )
        update = jax.jit(lambda e, m, ema=ema: zero.update_ema(ema, e, m, step=1, apply=True))
        state = state.replace(ema=update(state.ema, shifted))
        out.append((jz.ema_params(state), jz.ema_model_state(state), jz.gather(state.ema)))
    assert isinstance(state.ema.ema, jz.BucketedTree)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
        assert a.dtype == b.dtype and b.sharding.is_fully_replicated
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    ema_state = out[1][1]
    np.testing.assert_array_equal(ema_state["count"], model_state["count"] + 1)  # copied
    assert ema_state["count"].dtype == np.int32
    mean = model_state["stats"]["mean"].astype(np.float64)
    np.testing.assert_allclose(ema_state["stats"]["mean"], 0.3 * mean + 0.7 * (mean + 0.5), 1e-6)


def test_checkpoint_round_trip_any_mode_any_n(tmp_path):
    params, _, batches = base.problem("mlp32")
    step = bucketed_step(2, 8, "constant")
    state = step.init(params)
    for b in batches[:3]:
        state, _ = step(state, b)
    want = jax.device_get(jz.gather(state.ema))
    ck.save(tmp_path / "b", 3, state, zero=step.zero)
    # On disk: the per-leaf EMA, as a per-leaf run writes it.
    paths = {row["path"] for row in ck.load_metadata(tmp_path / "b")["leaves"]}
    assert {"ema.ema.fc1.kernel", "ema.ema.fc2.bias"} <= paths
    assert not any("bucket" in p or "rest" in p for p in paths)
    for n, k in ((8, K), (2, K), (8, 0)):
        zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(n), stage=2)
        ema = jz.ShardedEMA(0.95, bucket_leaves_up_to=k)
        restored = ck.restore(tmp_path / "b", zero, params, ema=ema)
        assert isinstance(restored.ema.ema, jz.BucketedTree) == (k > 0)
        abstract = zero.abstract_state(params, ema=ema)
        for x, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
            assert x.sharding == a.sharding and x.shape == a.shape
        got = jax.device_get(jz.gather(restored.ema))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
        assert int(restored.ema.updates) == 3
    # An abstract TrainState target keeps its EMA's storage (here bucketed, laid out for N=2).
    zero2 = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(2), stage=2)
    abstract = zero2.abstract_state(params, ema=jz.ShardedEMA(0.95, bucket_leaves_up_to=K))
    restored = ck.restore(tmp_path / "b", zero2, abstract)
    assert restored.ema.ema.layout == abstract.ema.ema.layout
    assert restored.ema.ema.bucket[0].sharding == abstract.ema.ema.bucket[0].sharding
    assert_same(jax.device_get(jz.gather(restored.ema)), want, exact=True)
    # A per-leaf checkpoint restores into the bucketed form, too.
    per_leaf = ck.restore(tmp_path / "b", step.zero, params, ema=jz.ShardedEMA(0.95))
    ck.save(tmp_path / "p", 3, per_leaf, zero=step.zero)
    again = ck.restore(tmp_path / "p", step.zero, params, ema=step.ema)
    rows = np.asarray(jax.device_get(again.ema.ema.bucket[0]))
    assert rows.tobytes() == np.asarray(jax.device_get(state.ema.ema.bucket[0])).tobytes()


@pytest.mark.interop
def test_torch_export_import_match_per_leaf():
    torch = require("torch", "torch")
    from jaxzero.interop import torch as ti

    params, _, _ = base.problem("mlp32")
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2)
    bucketed = zero.init(params, ema=jz.ShardedEMA(0.9, bucket_leaves_up_to=K)).ema
    per_leaf = zero.init(params, ema=jz.ShardedEMA(0.9)).ema
    out_b, out_p = ti.export_ema(bucketed), ti.export_ema(per_leaf)
    assert list(out_b["param"]) == list(out_p["param"])
    for key, v in out_p["param"].items():
        assert torch.equal(out_b["param"][key], v), key
    ckpt = {"param": {k: v * 2 + 1 for k, v in out_p["param"].items()}, "updates": 7}
    got = ti.import_ema(bucketed, ckpt)
    assert isinstance(got.ema, jz.BucketedTree) and got.ema.layout == bucketed.ema.layout
    assert got.ema.bucket[0].sharding == bucketed.ema.bucket[0].sharding
    want = ti.import_ema(per_leaf, ckpt)
    assert int(got.updates) == 7
    for x, y in zip(
        jax.tree.leaves(jax.device_get(want.ema)),
        jax.tree.leaves(jax.device_get(jz.unbucket_ema(got).ema)),
        strict=True,
    ):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_bucket_ema_converts_both_ways():
    params, _, _ = base.problem("mlp32")
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=1)
    per_leaf = zero.init(params, ema=jz.ShardedEMA(0.9)).ema
    ema = jz.ShardedEMA(0.9, bucket_leaves_up_to=K)
    b = zero.bucket_ema(ema, per_leaf)
    assert isinstance(b.ema, jz.BucketedTree)
    assert zero.bucket_ema(ema, b) is b
    rows = np.asarray(jax.device_get(b.ema.bucket[0]))
    assert rows.tobytes() == expected_rows(params, 8, K).tobytes()
    back = jz.unbucket_ema(b)
    # Leaves outside the bucket are handed on, not copied (a checkpoint save unbuckets the
    # whole TrainState).
    assert back.ema["fc1"]["kernel"] is b.ema.rest["fc1"]["kernel"]
    for x, y in zip(jax.tree.leaves(back.ema), jax.tree.leaves(per_leaf.ema), strict=True):
        assert x.sharding == y.sharding
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    assert not isinstance(zero.bucket_ema(jz.ShardedEMA(0.9), b).ema, jz.BucketedTree)


# --------------------------------------------------------------------------- 5. errors


@pytest.mark.parametrize("bad", [-1, 1.5, "64", True, "ALL"])
def test_bad_threshold_names_the_value(bad):
    with pytest.raises(
        ValueError,
        match=rf"bucket_leaves_up_to={bad!r} must be None \(automatic\), 'all' or an int",
    ):
        jz.ShardedEMA(0.9, bucket_leaves_up_to=bad)


def test_default_threshold_is_per_leaf_on_cpu_and_all_means_every_float_leaf():
    """None (the default) keeps a CPU mesh's EMA per leaf; "all" puts every float leaf in
    rows of at most LEAVES_PER_ROW leaves (on GPU meshes None means "all": tests/test_gpu.py)."""
    from jaxzero.ema.ema import LEAVES_PER_ROW

    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2)
    params = {f"w{i:03d}": jnp.full((8 * (1 + i % 3),), float(i)) for i in range(200)}
    assert jz.ShardedEMA(0.9).bucket_leaves_up_to is None
    state = zero.init(params, ema=jz.ShardedEMA(0.9))
    assert not isinstance(state.ema.ema, jz.BucketedTree)
    state = zero.init(params, ema=jz.ShardedEMA(0.9, bucket_leaves_up_to="all"))
    rows = state.ema.ema.bucket
    assert len(rows) == -(-200 // LEAVES_PER_ROW) == 3
    assert sum(r.shape[1] for r in rows) == sum(x.size // 8 for x in params.values())
    back = jax.device_get(jz.unbucket_ema(state.ema).ema)
    assert all(np.array_equal(back[k], np.asarray(v)) for k, v in params.items())


def test_numpy_int_threshold_accepted():
    assert jz.ShardedEMA(0.9, bucket_leaves_up_to=np.int64(7)).bucket_leaves_up_to == 7


def test_standalone_update_of_bucketed_state_says_what_to_do():
    params, _, _ = base.problem("mlp32")
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2)
    ema = jz.ShardedEMA(0.9, bucket_leaves_up_to=K)
    state = zero.init(params, ema=ema)
    with pytest.raises(ValueError, match="zero.update_ema"):
        ema.update(state.ema, params)


@functools.cache
def _several_rows(stage):
    """A 200-leaf tree trained 3 steps with its EMA per leaf and in rows ("all")."""
    params = {f"w{i:03d}": jnp.full((8 * (1 + i % 3), 3), 0.1 * i) for i in range(200)}
    batches = [jnp.linspace(-1.0, 1.0, 16).reshape(16, 1) * (t + 1) for t in range(3)]

    def loss_fn(p, x):
        return sum(jnp.mean((v * x[: v.shape[0] % 16 + 1].mean()) ** 2) for v in p.values())

    states = []
    for k in (0, "all"):
        zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=stage)
        ema = jz.ShardedEMA(0.9, torch_compatible=True, bucket_leaves_up_to=k)
        step = jz.make_train_step(loss_fn, zero, ema=ema)
        state = step.init(params)
        for x in batches:
            state, _ = step(state, x)
        states.append(state)
    return params, states[0], states[1]


# slow (24-31 s a case, a 200-leaf tree): make test keeps the one-row EMA bit for bit against
# the per-leaf one (test_bucketed_equals_per_leaf_bitwise) and the stage-3 bucketed EMA of
# layer stacks against numpy (test_bucketed_ema_of_layer_stacks_matches_numpy_...)
@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_several_rows_equal_per_leaf_bitwise(stage):
    """A 200-leaf tree in 3 rows ("all"), trained 3 steps: the EMA equals the per-leaf EMA
    bit for bit (torch_compatible rounds both products, so XLA's fusion choices cannot
    contract them differently), leaf for leaf, with the same counter."""
    params, per_leaf, rows = _several_rows(stage)
    assert len(rows.ema.ema.bucket) == 3
    a, b = jax.device_get(per_leaf.ema), jax.device_get(jz.unbucket_ema(rows.ema))
    assert int(a.updates) == int(b.updates) == 3
    for k in params:
        assert np.asarray(a.ema[k]).tobytes() == np.asarray(b.ema[k]).tobytes(), k
    moved = max(float(np.abs(np.asarray(a.ema[k]) - np.asarray(params[k])).max()) for k in params)
    assert moved > 1e-4


# slow: several rows to another N and storage; make test keeps the bucketed EMA's checkpoint
# round trip at any mode and N (test_checkpoint_round_trip_any_mode_any_n) and the storage
# conversion both ways (test_bucket_ema_converts_both_ways)
@pytest.mark.slow
def test_several_rows_checkpoint_to_other_n_and_storage(tmp_path):
    """A 3-row EMA saved at N=8 restores at N=4 (rows re-planned for 4) and per leaf, with
    the per-leaf EMA's bytes."""
    params, per_leaf, rows = _several_rows(2)
    want = jax.device_get(per_leaf.ema)
    ck.save(tmp_path / "r", 3, rows, zero=jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8)))
    for n, k in ((4, "all"), (8, 0)):
        zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(n), stage=2)
        restored = ck.restore(
            tmp_path / "r", zero, params, ema=jz.ShardedEMA(0.9, bucket_leaves_up_to=k)
        )
        assert isinstance(restored.ema.ema, jz.BucketedTree) == (k == "all")
        got = jax.device_get(jz.unbucket_ema(restored.ema))
        assert int(got.updates) == 3
        for name in params:
            assert np.asarray(got.ema[name]).tobytes() == np.asarray(want.ema[name]).tobytes()


# ------------------------------------------------- layer stacks: the ZeRO's rule, not the plain one


def _stack_problem():
    """A scanned 16-layer stack on 8 devices whose plain-rule split differs from the ZeRO's:
    ``w`` [16, 8] (the plain rule splits the layer axis, 16 being its largest dimension; a
    stack is never split there) and ``u`` [16, 8, 24] (largest non-layer dimension 24; per-layer
    stage 3 splits the first divisible one, 8). Both have at most 384 elements per device."""
    rng = np.random.default_rng(0)
    params = {
        "layers": {
            "w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
            "u": jnp.asarray(rng.normal(size=(16, 8, 24)) / 5, jnp.float32),
        },
        "b": jnp.zeros((8,), jnp.float32),
    }

    def layer(w, c):
        return jnp.tanh(((c @ w["u"]) @ w["u"].T) * w["w"])

    def loss_fn(p, batch):
        h = jz.scan_layers(layer, p["layers"], batch["x"] + p["b"])
        return jnp.mean((h - batch["y"]) ** 2)

    batches = [
        {"x": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32), "y": jnp.full((8, 8), 0.3)}
        for _ in range(4)
    ]
    return params, loss_fn, batches


# slow: stages 1 and 2 (stage 3 stays: per-layer stage 3 splits the stacks on their first
# divisible non-layer dimension, the cut that scrambled the rows)
@pytest.mark.parametrize(
    "stage", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3]
)
def test_bucketed_ema_of_layer_stacks_matches_numpy_on_the_single_device_trajectory(stage):
    """The rows hold the master's own local pieces, cut by the ZeRO's sharding rule (layer
    stacks kept whole along the layer axis; split on their first divisible dimension at
    per-layer stage 3). Unpacked by the plain rule they came out scrambled (0.84 off here)."""
    params, loss_fn, batches = _stack_problem()
    tx, decay = optax.sgd(0.1, momentum=0.9), 0.5
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(8), stage=stage, layers="layers")
    ema = jz.ShardedEMA(decay, bucket_leaves_up_to=4096)
    step = jz.make_train_step(loss_fn, zero, ema=ema)
    state = step.init(params)
    bucketed = set(jax.tree.leaves(state.ema.ema.rest)) == set()
    assert isinstance(state.ema.ema, jz.BucketedTree) and bucketed
    # The independent trajectory: plain optax on one device, and numpy's EMA of it.
    p, opt = params, tx.init(params)
    want = base.np64(params)
    for b in batches:
        state, _ = step(state, b)
        updates, opt = tx.update(jax.grad(loss_fn)(p, b), opt, p)
        p = optax.apply_updates(p, updates)
        want = jax.tree.map(lambda e, x: decay * e + (1 - decay) * x, want, base.np64(p))
    got = jax.tree.map(np.asarray, jz.gather(state.ema))
    # the EMA averages the params: within their derived tolerance of plain optax
    _, _, atol = tolerance.reference(tx, params, loss_fn, batches)
    chex.assert_trees_all_close(got, want, atol=atol)
    # The rows are the per-leaf EMA the ZeRO's rule places: its specs, not the plain rule's.
    per_leaf = jz.unbucket_ema(state.ema).ema
    want_specs = zero.ema_leaf_specs(params)
    got_specs = jax.tree.map(lambda x: x.sharding.spec, per_leaf)
    assert got_specs == want_specs
    assert got_specs["layers"]["w"] == P(None, "data")
    assert got_specs["layers"]["u"] == (P(None, "data") if stage == 3 else P(None, None, "data"))


def test_layer_stacks_restore_from_stage2_onto_per_layer_stage3_and_continue(tmp_path):
    """Stage 2 with layers= splits ``u`` [16, 8, 24] on dimension 2, per-layer stage 3 on
    dimension 1: a checkpoint moves between the two layouts (each device reads its new
    slices), the bucketed EMA included, and training continues on the single-device
    trajectory (plain optax, numpy's EMA)."""
    params, loss_fn, batches = _stack_problem()
    tx, decay = optax.sgd(0.1, momentum=0.9), 0.5
    ema = jz.ShardedEMA(decay, bucket_leaves_up_to=4096)
    mesh = jz.data_parallel_mesh(8)
    zero2 = jz.ZeRO(tx, mesh, stage=2, layers="layers")
    zero3 = jz.ZeRO(tx, mesh, stage=3, layers="layers")
    step2 = jz.make_train_step(loss_fn, zero2, ema=ema)
    state = step2.init(params)
    for b in batches[:2]:
        state, _ = step2(state, b)
    assert ck.save(tmp_path / "ckpt", 2, state, zero=zero2)
    restored = ck.restore(tmp_path / "ckpt", zero3, params, ema=ema)
    u = restored.params["layers"]["u"]
    assert u.sharding.spec == P(None, "data") and u.addressable_shards[0].data.shape == (16, 1, 24)
    assert state.params["layers"]["u"].sharding.spec == P()  # stage 2: replicated params
    restored, _ = jz.make_train_step(loss_fn, zero3, ema=ema)(restored, batches[2])
    p, opt = params, tx.init(params)
    want = base.np64(params)
    for b in batches[:3]:
        updates, opt = tx.update(jax.grad(loss_fn)(p, b), opt, p)
        p = optax.apply_updates(p, updates)
        want = jax.tree.map(lambda e, x: decay * e + (1 - decay) * x, want, base.np64(p))
    _, _, atol = tolerance.reference(tx, params, loss_fn, batches[:3])
    chex.assert_trees_all_close(jax.tree.map(np.asarray, jz.gather(restored)), p, atol=atol)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, jz.gather(restored.ema)), want, atol=atol)
