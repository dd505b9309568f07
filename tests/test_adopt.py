"""Adopting a plain Flax/optax run: params, optax state and step counter from a Flax
``TrainState`` or a plain orbax checkpoint, continued under jaxzero exactly as the plain run
continues; the errors for a mismatching optax state and for a plain directory given to
``restore`` / ``inspect``."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tolerance
from flax.training import train_state
from models import decay_mask

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero import cli
from jaxzero.gpu.models import make_problem

K = 3  # steps before the switch, and after it

# The step counter matters: a warmup schedule, and weight decay masked to the matrices.
SCHEDULE = optax.linear_schedule(0.0, 2e-2, transition_steps=2 * K)
TX = optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE, weight_decay=0.1, mask=decay_mask)
)


@pytest.fixture(scope="module")
def problem():
    params, loss_fn, batches = make_problem("wide_mlp", steps=2 * K)

    @jax.jit
    def plain_step(ts, b):  # Flax's own single-device step
        return ts.apply_gradients(grads=jax.grad(loss_fn)(ts.params, b))

    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=TX)
    for b in batches[:K]:
        ts = plain_step(ts, b)
    done = ts
    for b in batches[K:]:
        ts = plain_step(ts, b)
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(), stage=3)
    return done, ts, jz.make_train_step(loss_fn, zero), batches[K:]


def _continued(step, state, batches):
    assert int(state.step) == K
    for b in batches:
        state, _ = step(state, b)
    return state


@functools.cache
def _atol():
    """tests/tolerance.py's tolerance of the whole plain run, the problem fixture's."""
    params, loss_fn, batches = make_problem("wide_mlp", steps=2 * K)
    return tolerance.reference(TX, params, loss_fn, batches)[2]


def _assert_same_run(state, ref):
    assert int(state.step) == int(ref.step) == 2 * K
    chex.assert_trees_all_close(jz.gather(state.params), ref.params, atol=_atol())
    chex.assert_trees_all_close(jz.gather(state.opt_state), ref.opt_state, atol=_atol())


def _save_tree(kind, path, ts):
    tree = {"params": ts.params, "opt_state": ts.opt_state, "step": ts.step}
    if kind == "standard":
        with ocp.StandardCheckpointer() as c:
            c.save(path, tree)
    elif kind == "pytree":
        with ocp.PyTreeCheckpointer() as c:
            c.save(path, ocp.args.PyTreeSave(tree))
    elif kind == "train_state":  # the Flax TrainState itself (tx and apply_fn are not saved)
        with ocp.StandardCheckpointer() as c:
            c.save(path, ts)
    else:  # a CheckpointManager directory, the way Flax examples save
        with ocp.CheckpointManager(path) as m:
            m.save(int(ts.step), args=ocp.args.StandardSave(tree))
            m.wait_until_finished()


@pytest.mark.parametrize("kind", ["standard", "pytree", "train_state", "manager"])
def test_adopt_plain_orbax_directory_continues_the_run(problem, kind, tmp_path):
    done, ref, step, rest = problem
    _save_tree(kind, tmp_path / "ckpt", done)
    state = ck.adopt(tmp_path / "ckpt", step)
    _assert_same_run(_continued(step, state, rest), ref)


def test_adopt_flax_train_state_in_memory(problem):
    done, ref, step, rest = problem
    _assert_same_run(_continued(step, ck.adopt(done, step), rest), ref)
    # the same through step.init, the optax state placed into its ZeRO shards
    state = step.init(done.params, opt_state=done.opt_state, step=done.step)
    fresh = step.init(done.params)
    assert jax.tree.map(lambda x: x.sharding, state) == jax.tree.map(lambda x: x.sharding, fresh)
    assert state.opt_state[1][0].mu["fc1"]["kernel"].sharding.spec != jax.sharding.PartitionSpec()
    _assert_same_run(_continued(step, state, rest), ref)


def test_replace_opt_state_places_nothing(problem):
    # what the guide says of state.replace(opt_state=...): an uncommitted optax state (a plain
    # jit's output) stays whole on one device until the first step moves it into its shards,
    # which then continues the run as init's does; a committed one is refused by the jit
    done, ref, step, rest = problem
    plain = jax.tree.map(jnp.copy, done.opt_state)  # the step donates what it is given
    assert not any(x.committed for x in jax.tree.leaves(plain))
    state = step.init(done.params, step=done.step).replace(opt_state=plain)
    one = {jax.devices()[0]}
    assert all(x.sharding.device_set == one for x in jax.tree.leaves(state.opt_state))
    _assert_same_run(_continued(step, state, rest), ref)
    committed = jax.device_put(jax.tree.map(np.asarray, done.opt_state), jax.devices()[0])
    state = step.init(done.params, step=done.step).replace(opt_state=committed)
    with pytest.raises(ValueError, match="incompatible devices"):
        step(state, rest[0])


def test_adopt_refuses_another_optimizer_state(problem, tmp_path):
    done, _, step, _ = problem
    other = optax.sgd(0.1, momentum=0.9).init(done.params)
    with pytest.raises(
        ValueError, match=r"missing \[1\]\[0\]\.count.* more; unexpected \[0\]\.trace"
    ):
        step.init(done.params, opt_state=other)
    wrong = jax.tree.map(lambda x: x[:1] if x.ndim == 2 else x, done.opt_state)
    with pytest.raises(
        ValueError, match=r"mu\['fc1'\]\['kernel'\] \(1, 32\) \(expected \(16, 32\)\)"
    ):
        step.init(done.params, opt_state=wrong)
    with ocp.StandardCheckpointer() as c:
        c.save(tmp_path / "sgd", {"params": done.params, "opt_state": other, "step": done.step})
    with pytest.raises(ValueError, match=r"missing opt_state\.1\.0\.count.*same optax"):
        ck.adopt(tmp_path / "sgd", step)
    with pytest.raises(ValueError, match=r"step=-1 must be .* int >= 0"):
        step.init(done.params, opt_state=done.opt_state, step=-1)
    with pytest.raises(TypeError, match="a dict with 'params' and 'opt_state'"):
        ck.adopt({"params": done.params}, step)


def test_plain_directory_is_named_by_restore_and_inspect(problem, tmp_path, capsys):
    done, _, step, _ = problem
    _save_tree("standard", tmp_path / "plain", done)
    _save_tree("manager", tmp_path / "mngr", done)
    adopt_hint = r"plain orbax checkpoint .* jaxzero\.checkpoint\.adopt\("
    with pytest.raises(FileNotFoundError, match=adopt_hint):
        ck.restore(tmp_path / "plain", step.zero, done.params)
    for where in ("plain", "mngr"):
        with pytest.raises(ValueError, match=adopt_hint):
            ck.inspect(tmp_path / where)
    with pytest.raises(ValueError, match=r"no 'state' item.*jaxzero\.checkpoint\.adopt"):
        ck.restore(tmp_path / "mngr", step.zero, done.params)
    with pytest.raises(SystemExit):  # `jaxzero inspect DIR`: the same sentence, one line
        cli.main(["inspect", str(tmp_path / "plain")])
    assert re.search(adopt_hint, capsys.readouterr().err)
    # and a jaxzero checkpoint given to adopt points to restore
    state = step.init(done.params)
    with ck.manager(tmp_path / "jz") as m:
        ck.save(m, 1, state, zero=step.zero)
    with pytest.raises(ValueError, match=r"is a jaxzero checkpoint.*checkpoint\.restore"):
        ck.adopt(tmp_path / "jz", step)


def test_adopt_needs_a_step_counter(problem):
    done, _, step, _ = problem
    tree = {"params": done.params, "opt_state": done.opt_state}
    with pytest.raises(ValueError, match="train_step=<optimizer steps taken>"):
        ck.adopt(tree, step)
    state = ck.adopt(tree, step, train_step=np.int64(K))
    assert int(state.step) == K and state.step.dtype == jnp.int32


class _BNState(train_state.TrainState):
    """A TrainState with BatchNorm statistics and a dropout key, as Flax examples define."""

    batch_stats: dict
    dropout_rng: jax.Array


def test_adopt_reads_model_state_collections(problem, tmp_path):
    done, _, step, _ = problem
    stats = {"bn": {"mean": jnp.arange(8.0), "var": jnp.ones((8,))}}
    ts = _BNState.create(
        apply_fn=None,
        params=done.params,
        tx=TX,
        batch_stats=stats,
        dropout_rng=jax.random.PRNGKey(3),
    ).replace(opt_state=done.opt_state, step=done.step)
    _save_tree("train_state", tmp_path / "bn", ts)
    for source in (ts, tmp_path / "bn"):
        state = ck.adopt(source, step.zero, collections=("batch_stats",), ignore=("dropout_rng",))
        assert int(state.step) == K
        chex.assert_trees_all_equal(jax.device_get(state.model_state), {"batch_stats": stats})
        chex.assert_trees_all_equal(jz.gather(state.opt_state), done.opt_state)
    with pytest.raises(ValueError, match=r"no \['ema'\] to read as the model state"):
        ck.adopt(tmp_path / "bn", step.zero, collections=("ema",))


def test_adopt_refuses_to_drop_a_collection(problem, tmp_path):
    # a TrainState subclass's batch_stats left out of collections= would be dropped, and the
    # stateful loss would fail much later on model_state None: refused, naming it and the fix
    done, _, step, _ = problem
    stats = {"bn": {"mean": jnp.arange(8.0), "var": jnp.ones((8,))}}
    ts = _BNState.create(
        apply_fn=None, params=done.params, tx=TX, batch_stats=stats, dropout_rng=jax.random.key(3)
    ).replace(opt_state=done.opt_state, step=done.step)
    _save_tree("train_state", tmp_path / "bn", ts)
    as_dict = {"params": done.params, "opt_state": done.opt_state, "step": 3, "batch_stats": stats}
    both = (
        r"holds \['batch_stats', 'dropout_rng'\] besides params, opt_state and step.*"
        r"collections=\('batch_stats',\) reads batch_stats as the model_state of a "
        r"stateful=True step.*ignore=\('dropout_rng',\) leaves dropout_rng behind"
    )
    for source in (ts, tmp_path / "bn"):
        with pytest.raises(ValueError, match=both):
            ck.adopt(source, step.zero)
        with pytest.raises(ValueError, match=r"holds \['batch_stats'\] .*collections="):
            ck.adopt(source, step.zero, ignore=("dropout_rng",))
        with pytest.raises(
            ValueError, match=r"holds \['dropout_rng'\] .*ignore=\('dropout_rng',\)"
        ):
            ck.adopt(source, step.zero, collections=("batch_stats",))
        # both left behind on purpose: read as a plain run
        state = ck.adopt(source, step.zero, ignore=("batch_stats", "dropout_rng"))
        assert state.model_state is None and int(state.step) == K
    with pytest.raises(ValueError, match=r"the adopted dict holds \['batch_stats'\]"):
        ck.adopt(as_dict, step.zero)
    with pytest.raises(ValueError, match=r"ignore=\('opt',\) names \['opt'\], which"):
        ck.adopt(as_dict, step.zero, collections=("batch_stats",), ignore=("opt",))
    with pytest.raises(ValueError, match=r"\['batch_stats'\] are both in collections="):
        ck.adopt(as_dict, step.zero, collections=("batch_stats",), ignore=("batch_stats",))


def test_adopted_optimizer_state_lands_where_the_placement_keeps_it(problem):
    # offload: the optax state lives in pinned host memory, the adopted one as the fresh one
    done, _, step, _ = problem
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(), stage=2, offload="optimizer")
    state = zero.init(done.params, opt_state=done.opt_state, step=done.step)
    fresh = zero.init(done.params)
    assert jax.tree.map(lambda x: x.sharding, state) == jax.tree.map(lambda x: x.sharding, fresh)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
    chex.assert_trees_all_equal(jz.gather(state.opt_state), done.opt_state)
