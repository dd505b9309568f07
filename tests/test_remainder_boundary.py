"""The fp32 master at the boundary of ``offload=("optimizer", "remainder")`` (decision 47):
checkpoints hold the fp32 master whatever the storage, so a checkpoint saved with the
remainder restores into plain optimizer offload, into no offload and onto 4 devices, and a
checkpoint saved without it restores into the remainder; ``state.fp32_master()``,
``jz.gather`` of it and the exports give the fp32-master run's master bit for bit. The
expected numbers come from runs that never kept a remainder (8 simulated CPU devices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_remainder_step import SHAPES, _bits, _problem, _rebuilt_bits

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero.evaluation import gather_to_host
from jaxzero.zero.offload import remainder

N = 8
BF16 = jz.Precision("bfloat16", "float32", "float32")
REMAINDER = ("optimizer", "remainder")
#: two leaves large enough to be kept as remainders, two small ones kept fp32
EMA = jz.ShardedEMA(0.9, tau=2.0)
STEPS, SAVE_AT = 4, 2


def _zero(offload, n=N, stage=2):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, eps=1e-6))
    return jz.ZeRO(tx, jz.data_parallel_mesh(n), stage=stage, offload=offload, precision=BF16)


def _train(zero, loss_fn, state, batches):
    step = jz.make_train_step(loss_fn, zero, ema=EMA)
    for b in batches:
        state, _ = step(state, b)
    return state


def _assert_bits_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def _assert_state_equal(state, want):
    """``state`` equals ``want`` bit for bit, its master read as fp32 whatever it keeps."""
    for part in ("params", "opt_state", "ema"):
        _assert_bits_equal(getattr(state, part), getattr(want, part))
    _assert_bits_equal(state.fp32_master(), want.fp32_master())
    assert int(state.step) == int(want.step)


def _stored(state) -> set[str]:
    return {k for k, m in state.master.items() if remainder.is_stored(m)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fp32-master run (plain optimizer offload, 4 steps, the state at step 2 saved), the
    remainder run's state at step 2 saved, and the no-offload run's at step 2 saved."""
    params, loss_fn, batches = _problem()
    out = {"params": params, "loss_fn": loss_fn, "batches": batches, "dirs": {}, "at": {}}
    for name, off in (("fp32", "optimizer"), ("remainder", REMAINDER), ("device", None)):
        zero = _zero(off)
        state = _train(zero, loss_fn, zero.init(params, ema=EMA), batches[:SAVE_AT])
        d = tmp_path_factory.mktemp(name) / "ckpt"
        assert ck.save(str(d), SAVE_AT, state, zero=zero, ema=EMA, wait=True)
        out["dirs"][name], out["at"][name] = str(d), state
        if name == "fp32":  # uninterrupted, from a fresh state (training donates its input)
            out["end"] = _train(zero, loss_fn, zero.init(params, ema=EMA), batches)
    assert _stored(out["at"]["remainder"]) == {"w1", "w2"}
    return out


def test_fp32_master_joins_the_remainder_bit_for_bit(runs):
    rem, fp32 = runs["at"]["remainder"], runs["at"]["fp32"]
    joined = rem.fp32_master()
    for k in SHAPES:
        assert joined[k].dtype == jnp.float32
        assert joined[k].sharding == fp32.master[k].sharding  # the fp32 master's shards, host
        np.testing.assert_array_equal(_bits(joined[k]), _bits(fp32.master[k]))
    for k in ("w1", "w2"):  # and the remainder is what numpy rebuilds
        np.testing.assert_array_equal(_rebuilt_bits(rem.master[k], rem.params[k]), _bits(joined[k]))
    assert fp32.fp32_master() is fp32.master  # nothing stored: the master itself


def test_the_checkpoints_hold_the_same_fp32_master(runs):
    """The remainder run's checkpoint has the fp32 run's leaves, shapes and dtypes, and the
    same master: the storage setting leaves no trace in it."""
    rows = {}
    for name in ("fp32", "remainder"):
        meta = ck.load_metadata(runs["dirs"][name])
        rows[name] = [(r["path"], r["shape"], r["dtype"]) for r in meta["leaves"]]
        sums = meta["checksums"]["leaves"]
        rows[name + "_master"] = {k: v for k, v in sums.items() if k.startswith("master.")}
    assert rows["fp32"] == rows["remainder"]
    assert rows["fp32_master"] == rows["remainder_master"]


#: where the remainder checkpoint is restored: plain optimizer offload, no offload, both on
#: 8 devices and on 4, and the remainder again on 4 devices
TARGETS = {
    "optimizer-8": ("optimizer", 8),
    "device-8": (None, 8),
    "optimizer-4": ("optimizer", 4),
    "remainder-4": (REMAINDER, 4),
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_remainder_checkpoint_restores_into_other_settings(runs, name):
    """Restored from the remainder run's checkpoint: the fp32-master run's master bit for bit,
    and two more steps equal two more from the fp32-master run's checkpoint restored into the
    same setting (a run that never kept a remainder)."""
    off, n = TARGETS[name]
    zero = _zero(off, n)
    params, loss_fn, batches = runs["params"], runs["loss_fn"], runs["batches"]
    got = ck.restore(runs["dirs"]["remainder"], zero, params, ema=EMA)
    want = ck.restore(runs["dirs"]["fp32"], zero, params, ema=EMA)
    target = zero.abstract_state(params, ema=EMA)
    for x, t in zip(
        jax.tree.leaves(got.master, is_leaf=remainder.is_stored),
        jax.tree.leaves(target.master, is_leaf=remainder.is_stored),
        strict=True,
    ):
        assert remainder.is_stored(x) == remainder.is_stored(t)
        for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(t), strict=True):
            assert a.sharding == b.sharding and a.shape == b.shape and a.dtype == b.dtype
    assert _stored(got) == ({"w1", "w2"} if off == REMAINDER else set())
    _assert_bits_equal(got.fp32_master(), runs["at"]["fp32"].master)
    _assert_state_equal(got, want)
    tail = batches[SAVE_AT:]
    _assert_state_equal(_train(zero, loss_fn, got, tail), _train(zero, loss_fn, want, tail))


@pytest.mark.parametrize("source", ["fp32", "device"])
def test_plain_checkpoints_restore_into_the_remainder(runs, source):
    """The reverse: the fp32-master run's and the no-offload run's checkpoints restore into
    the remainder on 8 devices with their fp32 master bit for bit; from the fp32-master run's,
    two more steps give its own step-4 state."""
    zero = _zero(REMAINDER)
    params, loss_fn, batches = runs["params"], runs["loss_fn"], runs["batches"]
    got = ck.restore(runs["dirs"][source], zero, params, ema=EMA)
    assert _stored(got) == {"w1", "w2"}
    assert got.master["w1"].lo.sharding.memory_kind == "pinned_host"
    _assert_bits_equal(got.fp32_master(), runs["at"][source].master)
    for k in ("w1", "w2"):
        np.testing.assert_array_equal(
            _rebuilt_bits(got.master[k], got.params[k]), _bits(runs["at"][source].master[k])
        )
    if source == "fp32":
        _assert_state_equal(_train(zero, loss_fn, got, batches[SAVE_AT:]), runs["end"])


def test_stage3_remainder_checkpoint_restores_into_stage2_plain(runs, tmp_path):
    """Stage 3 (the params sharded like the master): the joined master is the stage-3
    fp32-master run's, and its checkpoint restores into plain offload at stage 2 with it."""
    params, loss_fn, batches = runs["params"], runs["loss_fn"], runs["batches"]
    at = {}
    for off in ("optimizer", REMAINDER):
        zero = _zero(off, stage=3)
        at[off] = _train(zero, loss_fn, zero.init(params, ema=EMA), batches[:SAVE_AT])
    assert _stored(at[REMAINDER]) == {"w1", "w2"}
    _assert_bits_equal(at[REMAINDER].fp32_master(), at["optimizer"].master)
    assert ck.save(str(tmp_path), SAVE_AT, at[REMAINDER], zero=_zero(REMAINDER, stage=3), wait=True)
    got = ck.restore(str(tmp_path), _zero("optimizer"), params, ema=EMA)
    _assert_bits_equal(got.master, at["optimizer"].master)
    _assert_bits_equal(got.params, at["optimizer"].params)


def test_fp32_params_checkpoint_restores_into_the_remainder(runs, tmp_path):
    """A checkpoint without a separate master (fp32 params) restores into the remainder with
    its params as the master, bit for bit, and the bf16 params their cast."""
    params, loss_fn, batches = runs["params"], runs["loss_fn"], runs["batches"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, eps=1e-6))
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(N), stage=2, offload="optimizer")
    state = _train(zero, loss_fn, zero.init(params, ema=EMA), batches[:SAVE_AT])
    assert state.master is None
    want = jax.tree.map(np.asarray, jz.gather(state.params))
    assert ck.save(str(tmp_path), SAVE_AT, state, zero=zero, wait=True)
    got = ck.restore(str(tmp_path), _zero(REMAINDER), params, ema=EMA)
    assert _stored(got) == {"w1", "w2"}
    _assert_bits_equal(got.fp32_master(), want)
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), want)
    _assert_bits_equal(got.params, cast)


def test_restore_with_an_abstract_state_of_the_other_storage(runs):
    """An abstract remainder state as the template restores into plain offload and the
    reverse: the master is kept as the restoring ZeRO keeps it."""
    params = runs["params"]
    rem_abstract = _zero(REMAINDER).abstract_state(params, ema=EMA)
    plain_abstract = _zero("optimizer").abstract_state(params, ema=EMA)
    into_plain = ck.restore(runs["dirs"]["remainder"], _zero("optimizer"), rem_abstract, ema=EMA)
    assert _stored(into_plain) == set()
    into_rem = ck.restore(runs["dirs"]["fp32"], _zero(REMAINDER), plain_abstract, ema=EMA)
    assert _stored(into_rem) == {"w1", "w2"}
    for got in (into_plain, into_rem):
        _assert_bits_equal(got.fp32_master(), runs["at"]["fp32"].master)


def test_gather_and_export_see_the_fp32_master(runs, tmp_path):
    rem, fp32 = runs["at"]["remainder"], runs["at"]["fp32"]
    want = jax.tree.map(np.asarray, jz.gather(fp32.master))
    _assert_bits_equal(jz.gather(rem.fp32_master()), want)
    _assert_bits_equal(gather_to_host(rem.fp32_master()), want)
    with pytest.raises(ValueError, match=r"state\.fp32_master\(\)"):
        jz.gather(rem.master)
    path = ck.export(rem, tmp_path / "master", which="master")
    _assert_bits_equal(ck.load_export(path), want)
    path = ck.export(rem, tmp_path / "flax.msgpack", opt_state=True)
    out = ck.load_export(path)
    _assert_bits_equal(out["params"], want)
    plain = ck.load_export(ck.export(fp32, tmp_path / "fp32.msgpack", opt_state=True))
    _assert_bits_equal(out["opt_state"], plain["opt_state"])


def test_restore_refuses_params_that_are_not_the_masters_cast(runs):
    """A remainder beside params that are not the master's bf16 cast would rebuild another
    master: the split refuses."""
    state = runs["at"]["fp32"]
    target = _zero(REMAINDER).abstract_state(runs["params"], ema=EMA).master
    params = dict(state.params, w1=state.params["w1"] + jnp.bfloat16(1.0))
    with pytest.raises(ValueError, match="not its bf16 cast"):
        remainder.stored_like(state.master, params, target)


@pytest.mark.interop  # from_train_state needs torch (make test-latest has none)
def test_deepspeed_export_reads_the_fp32_master(runs):
    """``from_train_state`` (a DeepSpeed checkpoint of a jaxzero state) writes the fp32
    master of a remainder state, the same bits as from the fp32-master run's state."""
    from jaxzero.interop.deepspeed.jax_state import from_train_state

    group = {"names": sorted(SHAPES), "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-6}
    kw = {
        "param_groups": [{**group, "weight_decay": 1e-4}],
        "ds_config": {"gradient_clipping": 1.0},
    }
    rem = from_train_state(runs["at"]["remainder"], **kw)
    fp32 = from_train_state(runs["at"]["fp32"], **kw)
    assert sorted(rem.params) == sorted(SHAPES)
    for k in SHAPES:
        assert np.asarray(rem.params[k]).dtype == np.float32
        np.testing.assert_array_equal(
            _bits(np.asarray(rem.params[k])), _bits(np.asarray(fp32.params[k]))
        )
