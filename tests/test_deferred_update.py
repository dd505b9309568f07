"""``ZeRO(offload="optimizer", offload_update="deferred")``: each step leaves the layer
stacks' streamed update in host memory undone (a ``PendingState``) and the next step
applies it before its forward; ``TrainStep.flush`` applies what is left (decision 51, its
second stage). On 8 simulated devices, several steps and a flush give plain single-device
optax's master and optimizer state (tests/tolerance.py's rule, the loss on the bf16 cast of
the master), at stages 1, 2 and 3; a non-finite step is skipped; the readers of a state
refuse one with an update pending (a refused save writes nothing); a flushed state
checkpoints, restores onto 4 and 8 devices and continues as plain optax.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import stacked_linear
import tolerance

import jaxzero as jz
from jaxzero import checkpoint as ck

# make_train_step warns that stages 1 and 2 with layers= reduce no layer in the backward here
# (a float32 reduce of bf16 compute): the stacks stay unsplit along the layer axis all the same
pytestmark = pytest.mark.filterwarnings("ignore:ZeRO\\(stage=:UserWarning")

N = 8
BF16 = jz.Precision("bfloat16", "float32", "float32")
TX = {
    "adamw": optax.adamw(1e-2, weight_decay=0.1),
    # a clip below the gradients' norm (about 0.5 on these batches): the clip scales every step
    "clip_adamw": optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1)),
}


# the stack's (L, D, W) kernel is streamed (> 4096 elements a leaf); the forward's loop runs
# layers 1-4's rows in two trips of two (the even and odd layers' packed rows), layer 5's after
L = 6
D, W = stacked_linear.D, stacked_linear.W


def _problem(steps=3, gathered=False, layers=L):
    """tests/stacked_linear.py's problem."""
    return stacked_linear.problem(steps, layers, gathered=gathered)


def _losses(tx, params, loss_fn, batches):
    """Plain optax's loss (on the bf16 cast) at each batch, on the params before that batch's
    update and on those a step behind (the first batch's on the initial params)."""
    cast = lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
    options = tolerance.compiler_options()  # the references' compile option
    on_cast = lambda p, b: loss_fn(cast(p), b)
    cast_loss = jax.jit(on_cast, compiler_options=options)
    grad = jax.jit(jax.grad(on_cast), compiler_options=options)
    p, before, s, out = params, params, tx.init(params), []
    for b in batches:
        out.append((float(cast_loss(p, b)), float(cast_loss(before, b))))
        u, s = tx.update(grad(p, b), s, p)
        p, before = optax.apply_updates(p, u), p
    return np.array(out).T


def _zero(tx, stage, n=N, **kw):
    kw = {"precision": BF16, "layers": "layers", "offload": "optimizer", **kw}
    return jz.ZeRO(tx, jz.data_parallel_mesh(n), stage=stage, **kw)


def _gathered(tree):
    return jax.tree.map(np.asarray, jz.gather(tree))


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _assert_is_optax(state, tx, params, loss_fn, batches):
    """The flushed state's fp32 master and optimizer state are single-device optax's (its loss
    on the bf16 cast), within tests/tolerance.py's spread of that reference, which moved the
    params far past it; the compute params are the master's bf16 cast."""
    ref, ref_opt, atol = tolerance.reference_cast(tx, params, loss_fn, batches, jnp.bfloat16)
    assert tolerance.max_distance(ref, params) > 20 * atol
    master = _gathered(state.master)
    chex.assert_trees_all_close(master, ref, atol=atol, rtol=0)
    chex.assert_trees_all_close(_gathered(state.opt_state), ref_opt, atol=atol, rtol=0)
    cast = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), master)
    chex.assert_trees_all_equal(_gathered(state.params), cast)
    assert _kinds((state.master, state.opt_state)) == {"pinned_host"}
    return atol


@pytest.mark.parametrize(
    "stage,name,accum",
    [(1, "adamw", 2), (2, "clip_adamw", 1), (3, "adamw", 1), (3, "clip_adamw", 2)],
)
def test_deferred_steps_then_flush_give_plain_optax(stage, name, accum):
    """Three steps, each applying the stacks' rows the step before left, then a flush: plain
    optax's three updates. Before the flush the stacks' master is a step behind (farther
    from optax than the tolerance); where the next forward runs the rows (stage 3; with
    micro-batches the first one's forward, and the second reads the stacks it wrote), the
    stacks' kernel state is in the packed rows alone, and the tree holds empty
    placeholders."""
    _deferred_steps_are_optax(stage, name, accum, L)


@pytest.mark.parametrize("layers,n", [(2, N), (4, N), (L, 1)])
def test_at_stage_3_the_row_a_pair_of_layers_leaves_runs_after_the_forward_loop(layers, n):
    """The forward's loop runs two layers' rows a trip (from the even and the odd layers'
    packed buffers), each trip fetching the next trip's first rows; with 4 layers the last
    row runs after its one trip, with 2 the loop has none. On one device the stacks do not
    vary over the mesh where the activations do (the loop's barrier keeps each's type).
    Three steps and a flush are plain optax's all the same."""
    _deferred_steps_are_optax(3, "clip_adamw", 1, layers, n)


def _deferred_steps_are_optax(stage, name, accum, layers, n=N):
    tx = TX[name]
    params, loss_fn, batches = _problem(layers=layers)
    step = jz.make_train_step(
        loss_fn, _zero(tx, stage, n, offload_update="deferred"), accum_steps=accum
    )
    state = step.init(params)
    assert state.pending is None  # the first step runs with nothing pending
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        assert state.pending is not None and bool(metrics["finite"])
        losses.append(float(metrics["loss"]))
    # each forward read the stacks the step before updated: plain optax's losses, not those of
    # the params a step behind
    want, stale = _losses(tx, params, loss_fn, batches)
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-5)
    assert np.abs(stale[1:] - want[1:]).min() > 1e-2
    if name == "clip_adamw":
        assert float(metrics["grad_norm"]) > 0.05
    packed = stage == 3  # the next forward runs the rows: the state packed
    assert (state.pending.packed is not None) == packed
    # the per-leaf plan says so: the stack's kernel (streamed in rows) packed, the rest leaves
    layouts = {r.path: r.layout for r in step.zero.plan(params, accum_steps=accum).rows}
    want = "packed_rows" if packed else "leaf"
    assert layouts == {"layers/w": want, "layers/g": "leaf", "b": "leaf", "k": "leaf"}
    if packed:  # the stacks' kernel state lives in the packed rows alone: the tree holds a
        # placeholder of one element per device
        kernels = [state.master["layers"]["w"], *_moments(state.opt_state, "w")]
        assert all(x.size == n for x in kernels), [x.shape for x in kernels]
        want_bytes = 3 * 4 * layers * D * W  # master, mu, nu: fp32 each
        assert sum(x.nbytes for x in state.pending.packed) == want_bytes
    else:
        behind = _gathered(state.master)["layers"]
    state = step.flush(state)
    assert state.pending is None and int(state.step) == len(batches)
    atol = _assert_is_optax(state, tx, params, loss_fn, batches)
    if not packed:
        assert tolerance.max_distance(behind, _gathered(state.master)["layers"]) > 20 * atol
    assert step.flush(state) is state  # nothing pending: as it is


def _moments(opt_state, name):
    """Adam's mu and nu leaves of the stack's ``name`` in ``opt_state``."""
    found = []
    for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if "layers" in keys and name in keys:
            found.append(x)
    assert len(found) == 2, found
    return found


def _forward_loops_update(step, state, batch) -> list[bool]:
    """For each of the compiled step's layer loops that all-gather the weights (the stage-3
    forwards, one a micro-batch), whether it also runs Adam's update (its square root): the
    rows inside that forward; in ascending order."""
    from jaxzero.memory.hlo_reader import parse_hlo

    hlo = parse_hlo(step.jitted.lower(state, step.place_batch(batch)).compile().as_text())

    def reached(name, seen):
        if name not in seen:
            seen.add(name)
            for inst in hlo.computation(name):
                for callee in inst.called():
                    reached(callee, seen)
        return seen

    loops = []
    for inst in hlo.instructions:
        if inst.opcode == "while":
            names = set().union(*(reached(b, set()) for b in inst.called("body")))
            loops.append({i.opcode for n in names for i in hlo.computation(n)})
    forward = [ops for ops in loops if "all-gather" in ops and "reduce-scatter" not in ops]
    return sorted("sqrt" in ops or "rsqrt" in ops for ops in forward)


@pytest.mark.parametrize("accum", [1, 2])
def test_at_stage_3_the_rows_run_inside_the_forward_layer_loop(accum):
    """Stage 3 per layer: the step after a deferred one runs the rows inside the forward's
    layer loop, beside the layer gathers (decision 51's third stage); with 2 micro-batches
    inside the first one's forward only. The first step, with nothing pending, updates
    nothing there. (The numbers: the stage-3 cases of
    test_deferred_steps_then_flush_give_plain_optax.)"""
    params, loss_fn, batches = _problem(2)
    zero = _zero(TX["adamw"], 3, offload_update="deferred")
    step = jz.make_train_step(loss_fn, zero, accum_steps=accum)
    state = step.init(params)
    assert _forward_loops_update(step, state, batches[0]) == [False] * accum
    state, _ = step(state, batches[0])
    assert state.pending is not None
    assert _forward_loops_update(step, state, batches[1]) == [False] * (accum - 1) + [True]


def test_at_stage_3_a_stack_gathered_by_gather_layer_runs_its_rows_before_the_forward():
    """A stack gathered by ``jz.gather_layer`` in the model's own loop (no ``scan_layers``
    loop to run the rows in): the step runs them before its forward, as at stages 1 and 2,
    and three steps and a flush are plain optax's."""
    tx = TX["adamw"]
    params, loss_fn, batches = _problem(gathered=True)
    step = jz.make_train_step(loss_fn, _zero(tx, 3, offload_update="deferred"))
    state = step.init(params)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    want, _ = _losses(tx, params, loss_fn, batches)
    # losses, not the state (tests/tolerance.py's rule is the state's, below): bf16 forwards
    # on params within that rule, where the params a step behind are 1e-2 away
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-5)
    _assert_is_optax(step.flush(state), tx, params, loss_fn, batches)


def test_at_stage_3_the_ema_stacks_follow_the_rows_run_in_the_forward():
    """With a constant-decay EMA, three deferred stage-3 steps (the rows of the last two run
    in the next forward's loop) and a flush: the EMA is 0.9 x the previous one + 0.1 x each
    step's new master, with plain optax's masters after one, two and three batches."""
    tx = TX["adamw"]
    params, loss_fn, batches = _problem()
    ema = jz.ShardedEMA(0.9, schedule="constant")
    step = jz.make_train_step(loss_fn, _zero(tx, 3, offload_update="deferred"), ema=ema)
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)
    state = step.flush(state)
    atol = _assert_is_optax(state, tx, params, loss_fn, batches)
    want = jax.tree.map(np.asarray, params)
    for k in range(1, len(batches) + 1):
        ref = tolerance.reference_cast(tx, params, loss_fn, batches[:k], jnp.bfloat16)[0]
        want = jax.tree.map(lambda e, m: 0.9 * e + 0.1 * np.asarray(m), want, ref)
    chex.assert_trees_all_close(_gathered(state.ema), want, atol=atol, rtol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_nonfinite_step_is_skipped_with_its_rows(stage):
    """A NaN batch between two finite ones: the step is skipped, its deferred rows leave the
    stacks as they are (at stage 3 in the next forward's loop), and the flushed state is
    optax's two finite updates."""
    tx = TX["adamw"]
    params, loss_fn, batches = _problem()
    bad = dict(batches[1], x=np.full_like(batches[1]["x"], np.nan))
    step = jz.make_train_step(loss_fn, _zero(tx, stage, offload_update="deferred"))
    state = step.init(params)
    for b in (batches[0], bad, batches[2]):
        state, metrics = step(state, b)
    state = step.flush(state)
    assert (int(state.step), int(state.skipped)) == (2, 1)
    _assert_is_optax(state, tx, params, loss_fn, [batches[0], batches[2]])


def test_readers_refuse_a_state_with_an_update_pending(tmp_path):
    """``jz.gather``, ``fp32_master`` (exports), ``ema_params``, ``checkpoint.save`` and a
    step without deferral refuse a state whose update is pending, naming ``flush``; after the
    flush they read it, and the EMA's stacks are averaged with the step's new master."""
    params, loss_fn, batches = _problem(steps=1)
    ema = jz.ShardedEMA(0.9, schedule="constant")
    zero = _zero(TX["adamw"], 3, offload_update="deferred")
    step = jz.make_train_step(loss_fn, zero, ema=ema)
    state, _ = step(step.init(params), batches[0])
    flush = r"state = step\.flush\(state\)"
    with pytest.raises(ValueError, match=r"jaxzero\.gather reads this state.*" + flush):
        jz.gather(state)
    with pytest.raises(ValueError, match=r"fp32_master reads this state.*" + flush):
        state.fp32_master()
    with pytest.raises(ValueError, match=r"jaxzero\.ema_params reads this state.*" + flush):
        jz.ema_params(state)
    # refused before anything is written: no directory, and no step (nor a partial one) in a
    # manager's directory
    with pytest.raises(ValueError, match=r"jaxzero\.checkpoint\.save reads this state.*" + flush):
        ck.save(tmp_path / "dir", 1, state, zero=zero, ema=ema)
    assert not (tmp_path / "dir").exists()
    mngr = ck.manager(tmp_path / "mngr", async_save=False)
    with pytest.raises(ValueError, match=r"jaxzero\.checkpoint\.save reads this state.*" + flush):
        ck.save(mngr, 1, state, zero=zero, ema=ema, wait=True)
    assert mngr.all_steps() == [] and not list((tmp_path / "mngr").iterdir())
    mngr.close()
    plain = jz.make_train_step(loss_fn, _zero(TX["adamw"], 3), ema=ema)
    with pytest.raises(ValueError, match=r"does not defer it.*" + flush):
        plain(state, batches[0])
    state = step.flush(state)
    assert jax.tree.leaves(jz.gather(state)) and jax.tree.leaves(jz.ema_params(state))
    _assert_is_optax(state, TX["adamw"], params, loss_fn, batches)
    master = _gathered(state.master)
    want = jax.tree.map(lambda p, m: 0.9 * np.asarray(p) + 0.1 * m, params, master)
    # the EMA's formula replayed in numpy on the gathered master: one rounding per element
    chex.assert_trees_all_close(_gathered(state.ema), want, atol=1e-6, rtol=0)


def test_a_flushed_state_checkpoints_and_restores_onto_4_and_8_devices(tmp_path):
    """Two deferred steps at stage 3 (clip + AdamW) on 8 devices, a flush and a save; the
    checkpoint restores as saved into a deferred ``ZeRO`` on 4 devices and on 8, and two more
    deferred steps and a flush on each give plain optax's four updates (the two after the
    restore read the restored stacks: their losses are optax's)."""
    tx = TX["clip_adamw"]
    params, loss_fn, batches = _problem(steps=4)
    zero = _zero(tx, 3, offload_update="deferred")
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    for b in batches[:2]:
        state, _ = step(state, b)
    assert state.pending is not None
    state = step.flush(state)
    saved = jax.tree.map(np.asarray, jz.gather((state.master, state.opt_state, state.params)))
    assert ck.save(tmp_path / "ckpt", 2, state, zero=zero)
    want, _ = _losses(tx, params, loss_fn, batches)
    for n in (4, 8):
        zero_n = _zero(tx, 3, n=n, offload_update="deferred")
        restored = ck.restore(tmp_path / "ckpt", zero_n, params)
        assert restored.pending is None and int(restored.step) == 2
        assert {len(x.sharding.device_set) for x in jax.tree.leaves(restored)} == {n}
        got = jax.tree.map(
            np.asarray, jz.gather((restored.master, restored.opt_state, restored.params))
        )
        chex.assert_trees_all_equal(got, saved)  # restoring is an exact copy
        step_n = jz.make_train_step(loss_fn, zero_n)
        losses = []
        for b in batches[2:]:
            restored, metrics = step_n(restored, b)
            assert restored.pending is not None and bool(metrics["finite"])
            losses.append(float(metrics["loss"]))
        # losses, not the state: bf16 forwards on params within tests/tolerance.py's rule
        np.testing.assert_allclose(losses, want[2:], rtol=1e-5, atol=1e-5)
        restored = step_n.flush(restored)
        assert restored.pending is None and int(restored.step) == len(batches)
        _assert_is_optax(restored, tx, params, loss_fn, batches)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"offload": None}, r"built for offload='optimizer'"),
        ({"offload": ("optimizer", "params"), "precision": "bf16"}, r"built for offload="),
        ({"layers": None}, r"names none, so it would change nothing"),
        ({"precision": "fp32"}, r"keeps none \(the params are the master\)"),
        ({"offload_update": "later"}, r"offload_update='later' is not supported"),
    ],
)
def test_the_deferred_update_is_refused_where_it_changes_nothing(kw, match):
    kw = {"offload_update": "deferred", **kw}
    with pytest.raises(ValueError, match=match):
        _zero(optax.adam(1e-2), 3, **kw)
