"""jaxzero.checkpoint: sharded save / restore / reshard, crash safety, bad input, export.

Expected numbers come from uninterrupted training runs (and plain Orbax / flax readers),
never from the checkpoint code under test.
"""

import os
import signal
import subprocess
import sys
import threading

import flax.serialization
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from models import chains

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero.gpu.models import MLP, make_problem

STEPS, SAVE_AT = 20, 10
HERE = os.path.dirname(os.path.abspath(__file__))


def tx():
    return optax.adam(1e-2)


def ema():
    return jz.ShardedEMA(0.99)


def host(state):
    """Gathered, unsharded numpy copy of every part of a TrainState."""
    to_np = lambda t: jax.tree.map(np.asarray, jz.gather(t))
    return {
        "step": int(state.step),
        "params": to_np(state.params),
        "opt_state": to_np(state.opt_state),
        "ema": to_np(state.ema.ema),
        "ema_updates": int(state.ema.updates),
    }


def assert_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def assert_close(a, b, tol=1e-6):
    # a resumed step against the uninterrupted one: under tests/tolerance.py's 16-ulp floor
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An uninterrupted 20-step run (stage 2, N=8, adam + EMA) that checkpoints step 10
    asynchronously and keeps training (donating the state) while the save is written."""
    params, loss_fn, batches = make_problem("mlp", steps=STEPS)
    zero = jz.ZeRO(tx(), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(loss_fn, zero, ema=ema())
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    mngr = ck.manager(directory, max_to_keep=3)
    state = step.init(params)
    snaps = {}
    for i, batch in enumerate(batches, 1):
        state, _ = step(state, batch)
        if i == SAVE_AT:
            snaps[i] = host(state)
            started = ck.save(
                mngr,
                i,
                state,
                zero=zero,
                metadata={"run": "unit-test", "lr": 1e-2},
                extra={"loader_pos": np.int64(i * 32)},
                optimizer="optax.adam(1e-2)",
            )
            assert started
    mngr.wait_until_finished()
    mngr.close()
    snaps[STEPS] = host(state)
    return {
        "params": params,
        "loss_fn": loss_fn,
        "batches": batches,
        "step": step,
        "dir": directory,
        "snaps": snaps,
    }


def resume(run, zero, *, step_fn=None):
    state, extra = ck.restore(run["dir"], zero, run["params"], ema=ema(), with_extra=True)
    assert int(state.step) == SAVE_AT
    assert int(extra["loader_pos"]) == SAVE_AT * 32
    step_fn = step_fn or jz.make_train_step(run["loss_fn"], zero, ema=ema())
    for batch in run["batches"][SAVE_AT:]:
        state, _ = step_fn(state, batch)
    return state


# ------------------------------------------------------------------------------ 1. round trip
def test_round_trip_is_bitwise(run):
    zero = run["step"].zero
    restored = ck.restore(run["dir"], zero, run["params"], ema=ema())
    assert_equal(host(restored), run["snaps"][SAVE_AT])
    # An abstract TrainState works as the target as well.
    abstract = zero.abstract_state(run["params"], ema=ema())
    assert_equal(host(ck.restore(run["dir"], zero, abstract)), run["snaps"][SAVE_AT])
    final = resume(run, zero, step_fn=run["step"])
    got, want = host(final), run["snaps"][STEPS]
    assert got["step"] == want["step"] == STEPS
    assert got["ema_updates"] == want["ema_updates"]
    for part in ("params", "opt_state", "ema"):
        assert_equal(got[part], want[part])


def test_save_refuses_existing_and_skips_interval_steps(run, tmp_path):
    zero = run["step"].zero
    state = ck.restore(run["dir"], zero, run["params"], ema=ema())
    with pytest.raises(ValueError, match=f"step {SAVE_AT} already exists"):
        ck.save(run["dir"], SAVE_AT, state, zero=zero)  # Orbax would return False
    mngr = ck.manager(tmp_path / "interval", save_interval_steps=5, async_save=False)
    # Orbax's default policy also saves the very first step (InitialSavePolicy).
    assert ck.save(mngr, 3, state) is True
    assert ck.save(mngr, 4, state) is False
    assert ck.save(mngr, 5, state, wait=True) is True
    with pytest.raises(ValueError, match="step 5 already exists"):
        ck.save(mngr, 5, state)
    assert mngr.all_steps() == [3, 5]
    mngr.close()


# ------------------------------------------------------------------------------ 2. resharding
RESHARD = {
    "n4": dict(n=4, stage=2),
    "n2": dict(n=2, stage=2),
    "n1": dict(n=1, stage=2),
    "stage0": dict(n=8, stage=0),
    "stage1": dict(n=8, stage=1),
    "stage3": dict(n=8, stage=3),
    "replicas2x4": dict(n=8, stage=2, replicas=2),
}


@pytest.mark.parametrize("name", list(RESHARD))
def test_restore_reshards_and_continues(run, name):
    cfg = RESHARD[name]
    mesh = jz.data_parallel_mesh(cfg["n"], replicas=cfg.get("replicas", 1))
    zero = jz.ZeRO(tx(), mesh, stage=cfg["stage"])
    target = zero.abstract_state(run["params"], ema=ema())
    restored = ck.restore(run["dir"], zero, run["params"], ema=ema())
    for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert x.sharding == t.sharding
        assert x.shape == t.shape and x.dtype == t.dtype
    assert_equal(host(restored), run["snaps"][SAVE_AT])  # restoring is an exact copy
    got, want = host(resume(run, zero)), run["snaps"][STEPS]
    assert got["step"] == STEPS
    for part in ("params", "opt_state", "ema"):
        assert_close(got[part], want[part])


def divisible_params():
    """A tiny model whose leaves divide by 8 (the MLP's 17/31/5 never do, so none of its
    leaves is ever sharded); values from numpy, not from jaxzero."""
    rng = np.random.default_rng(1)
    shapes = {
        "dense": {"kernel": (16, 24), "bias": (24,)},
        "head": {"kernel": (24, 5), "bias": (5,)},
    }
    return jax.tree.map(
        lambda s: rng.normal(size=s).astype(np.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


@pytest.fixture(scope="module")
def divisible_ckpt(tmp_path_factory):
    params = divisible_params()
    zero8 = jz.ZeRO(tx(), jz.data_parallel_mesh(8), stage=2)
    d = tmp_path_factory.mktemp("divisible") / "ckpt"
    assert ck.save(d, 0, zero8.init(params, ema=ema()), zero=zero8)
    return d, params


@pytest.mark.parametrize(
    "n,stage,replicas", [(4, 3, 1), (2, 1, 1), (8, 2, 2), (8, 0, 1), (1, 3, 1)], ids=str
)
def test_restore_loads_only_own_shards(divisible_ckpt, n, stage, replicas):
    """Sharded leaves come back as 1/N shards on each device (no full copy), with the saved
    values, whatever N, stage and mesh shape."""
    d, params = divisible_ckpt
    zero = jz.ZeRO(tx(), jz.data_parallel_mesh(n, replicas=replicas), stage=stage)
    restored = ck.restore(d, zero, params, ema=ema())
    target = zero.abstract_state(params, ema=ema())
    sharded = set()
    for (path, x), t in zip(
        jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(target), strict=True
    ):
        assert x.sharding == t.sharding
        if any(s is not None for s in t.sharding.spec):
            sharded.add(jax.tree_util.keystr(path))
            assert len(x.addressable_shards) == n
            for shard in x.addressable_shards:
                assert shard.data.size * zero.num_shards == x.size
    if zero.num_shards > 1:  # the EMA (and for stage >= 1 the optimizer state) is sharded
        assert any(p.startswith(".ema.ema['dense']['kernel']") for p in sharded), sharded
        assert (stage >= 1) == any(".opt_state" in p for p in sharded), sharded
        assert (stage == 3) == any(p.startswith(".params") for p in sharded), sharded
    assert_equal(jax.tree.map(np.asarray, jz.gather(restored.ema.ema)), params)
    assert_equal(jax.tree.map(np.asarray, jz.gather(restored.params)), params)


# ------------------------------------------------------------------------------ 3. crash safety
def test_killed_async_save_is_ignored(run, tmp_path):
    d = tmp_path / "crash"
    env = dict(os.environ)  # same XLA_FLAGS / JAX_PLATFORMS as this process
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "ckpt_worker.py"), str(d)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    watchdog = threading.Timer(90, proc.kill)  # a hung worker cannot block the test run
    watchdog.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("SLOW_SAVE_STARTED"):
                proc.send_signal(signal.SIGKILL)  # while the 200 MB extra is being written
                break
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert any(x.startswith("SAVED 2") for x in lines), "".join(lines[-20:])
    assert any(x.startswith("SLOW_SAVE_STARTED") for x in lines), "".join(lines[-20:])
    assert proc.returncode == -signal.SIGKILL
    names = sorted(os.listdir(d))
    assert "2" in names and "4" not in names, names  # killed mid-save: step 4 never committed
    assert any(n.startswith("4.orbax-checkpoint-tmp") for n in names), names

    zero = run["step"].zero
    state, extra = ck.restore(d, zero, run["params"], ema=ema(), with_extra=True)
    assert int(state.step) == 2 and int(extra["pos"]) == 2
    assert ck.latest_step(d) == 2
    assert "incomplete saves (ignored): 4.orbax-checkpoint-tmp" in ck.inspect(d)
    # Independent numbers: 2 plain steps of the same problem.
    params, loss_fn, batches = make_problem("mlp", steps=2)
    ref = run["step"]  # same zero and loss: reuses the compiled step
    s = ref.init(params)
    for b in batches:
        s, _ = ref(s, b)
    assert_equal(host(state), host(s))
    # A writable manager (the restarted job) removes the leftover and saves step 4 again.
    mngr = ck.manager(d)
    assert ck.save(mngr, 4, state, wait=True)
    mngr.close()
    names = sorted(os.listdir(d))
    assert "4" in names and not any("tmp" in n for n in names), names


# ------------------------------------------------------------------------------ 4. bad input
def test_different_model_names_the_path(run):
    zero = run["step"].zero
    other = divisible_params()
    with pytest.raises(ValueError, match=r"leaf params\.dense\.bias .*missing"):
        ck.restore(run["dir"], zero, other, ema=ema())
    narrow = jax.eval_shape(  # shapes only: restore needs no values
        MLP(hidden=15).init, jax.random.PRNGKey(0), np.zeros((1, 17), np.float32)
    )["params"]
    with pytest.raises(
        ValueError, match=r"params\.fc1\.bias has shape \(31,\) in the checkpoint but \(15,\)"
    ):
        ck.restore(run["dir"], zero, narrow, ema=ema())


def test_adam_checkpoint_into_sgd_chain(run):
    zero = jz.ZeRO(chains()["sgd_nesterov_cosine"], jz.data_parallel_mesh(8), stage=2)
    with pytest.raises(ValueError, match=r"opt_state\.0\.trace\..* missing.*ScaleByAdamState"):
        ck.restore(run["dir"], zero, run["params"], ema=ema())


def test_missing_ema_is_reported(run):
    with pytest.raises(ValueError, match=r"ema\.ema\..*pass ema="):
        ck.restore(run["dir"], run["step"].zero, run["params"])


def test_no_complete_step(run, tmp_path):
    zero = run["step"].zero
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.restore(tmp_path / "nowhere", zero, run["params"], ema=ema())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint step"):
        ck.restore(tmp_path / "empty", zero, run["params"], ema=ema())
    (tmp_path / "partial" / "7.orbax-checkpoint-tmp").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"interrupted.*7\.orbax-checkpoint-tmp"):
        ck.restore(tmp_path / "partial", zero, run["params"], ema=ema())
    assert (tmp_path / "partial" / "7.orbax-checkpoint-tmp").is_dir()  # restore deletes nothing
    with pytest.raises(FileNotFoundError, match=r"step 3 is not a complete checkpoint.*\[10\]"):
        ck.restore(run["dir"], zero, run["params"], ema=ema(), step=3)


# ------------------------------------------------------------------------------ 5. export / inspect
def test_export_ema_and_params(run, tmp_path):
    zero = run["step"].zero
    state = ck.restore(run["dir"], zero, run["params"], ema=ema())
    snap = run["snaps"][SAVE_AT]
    path = ck.export(state, tmp_path / "ema")
    with ocp.PyTreeCheckpointer() as plain:  # read back without jaxzero, no mesh
        tree = plain.restore(path)
    assert_equal(jax.tree.map(np.asarray, tree), snap["ema"])
    assert_equal(ck.load_export(path), snap["ema"])
    mp = ck.export(state, tmp_path / "params.msgpack", which="params")
    with open(mp, "rb") as f:
        assert_equal(flax.serialization.msgpack_restore(f.read()), snap["params"])
    with pytest.raises(FileExistsError):
        ck.export(state, mp, which="params")
    ck.export(state.opt_state[0].mu, mp, overwrite=True)  # any sharded tree
    assert_equal(ck.load_export(mp), snap["opt_state"][0].mu)
    with pytest.raises(ValueError, match="which="):
        ck.export(state, tmp_path / "x", which="bogus")


def test_inspect_and_metadata(run):
    text = ck.inspect(run["dir"])
    for needle in (
        "complete steps: 10",
        "ZeRO stage: 2",
        "mesh: {'data': 8} (8 devices",
        "'param_dtype': 'float32'",
        "optimizer: optax.adam(1e-2)",
        "optimizer state: ScaleByAdamState, EmptyState",
        "'run': 'unit-test'",
        "state: 20 leaves, 11504 bytes",  # 4 x (17*31 + 31 + 31*5 + 5) floats + 4 int32, x4B
        "loader_pos",
    ):
        assert needle in text, (needle, text)
    rows = {
        line.split()[0]: line.split()[1:]
        for line in text.splitlines()[1:]
        if line.startswith("    ")
    }
    assert rows["opt_state.0.mu.fc1.kernel"][:4] == ["(17,", "31)", "float32", str(17 * 31 * 4)]
    assert rows["ema.ema.fc2.bias"][:3] == ["(5,)", "float32", "20"]
    assert rows["step"][:3] == ["()", "int32", "4"]
    meta = ck.load_metadata(run["dir"])
    assert meta["jaxzero_version"] == jz.__version__ and meta["stage"] == 2
    assert meta["mesh"] == {"data": 8} and meta["user"] == {"run": "unit-test", "lr": 1e-2}
    params_leaves = jax.tree.leaves(run["params"])
    assert len(meta["leaves"]) == 4 * len(params_leaves) + 4  # params, mu, nu, ema + counters
    assert meta["total_bytes"] == 4 * sum(x.size * 4 for x in params_leaves) + 4 * 4


def test_inspect_shows_units_and_offload_saved_with_the_step(tmp_path):
    """A stage-3 per-unit, optimizer-offloaded state: the metadata keeps units= and offload=
    as given, and `jaxzero inspect` shows them (a checkpoint without them shows neither:
    test_legacy_checkpoint)."""
    from jaxzero import cli

    params, _, _ = make_problem("transformer", steps=1)
    zero = jz.ZeRO(tx(), jz.data_parallel_mesh(8), stage=3, units=r"layer\d+", offload="optimizer")
    ck.save(tmp_path / "c", 0, zero.init(params), zero=zero, wait=True)
    meta = ck.load_metadata(tmp_path / "c")
    assert (meta["units"], meta["offload"], meta["layers"]) == ([r"layer\d+"], "optimizer", None)
    text = ck.inspect(tmp_path / "c")
    assert "  units: ['layer\\\\d+']" in text and "  offload: optimizer" in text, text
    assert "  layers:" not in text
    assert cli.main(["inspect", str(tmp_path / "c")]) == 0
