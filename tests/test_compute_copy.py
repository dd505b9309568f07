"""Stage 3 without a compute copy (``Precision(compute_copy=False)``, FSDP's mixed-precision
layout): the state holds the fp32 master shards alone as ``params``; the step casts each shard
to bf16 as it gathers it. Same numbers as the layout with the bf16 copy (to 1 ulp), close to
single-device optax on a bf16 loss, 2 bytes per parameter less per device, restorable both ways.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance
from models import run_steps

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero.gpu.models import make_problem
from jaxzero.memory import device_bytes

N = 8
COPY = jz.Precision("bfloat16", "float32", "float32")
NO_COPY = dataclasses.replace(COPY, compute_copy=False)
PROBLEMS = {
    "whole": ("transformer", {}),
    "per_layer": ("scanned", {"layers": "layers"}),
    "hybrid": ("transformer", {"replicas": 2}),  # HSDP: 2 replicas of 4 shards
}


def _problem(name, steps=4):
    problem, kw = PROBLEMS[name]
    extra = {"gather_layer": jz.gather_layer} if problem == "scanned" else {}
    return (*make_problem(problem, steps=steps, **extra), kw)


def _zero(precision, replicas=1, **kw):
    mesh = jz.data_parallel_mesh(N, replicas=replicas)
    return jz.ZeRO(optax.adam(1e-2, eps=1e-6), mesh, stage=3, precision=precision, **kw)


_run = run_steps


# slow: whole-model and hybrid (per layer stays)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param("whole", marks=pytest.mark.slow),
        "per_layer",
        pytest.param("hybrid", marks=pytest.mark.slow),
    ],
)
def test_no_copy_trains_like_the_copy(name):
    """The step reads the fp32 master shards in both layouts (stage 3 builds the loss from
    the master), so dropping the bf16 copy changes no number: losses, master, Adam state and
    EMA agree after 4 steps, with and without per-layer gathers and on a hybrid (replica x
    data) mesh, to the last bit but one
    (XLA:CPU fuses the Adam update differently when it also writes the cast: 1-ulp
    differences, 7e-9 on 0.01, in a few elements)."""
    params, loss_fn, batches, kw = _problem(name)
    ema = jz.ShardedEMA(0.9, tau=2.0)
    runs = {}
    for label, pol in (("copy", COPY), ("no_copy", NO_COPY)):
        zero = _zero(pol, **kw)
        runs[label] = _run(zero, loss_fn, zero.init(params, ema=ema), batches, ema)
    (copy, loss_c), (none, loss_n) = runs["copy"], runs["no_copy"]
    assert none.master is None
    assert {x.dtype for x in jax.tree.leaves(none.params)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(loss_n, loss_c, rtol=1e-6)
    ulp = {"rtol": 1e-6, "atol": 1e-8}
    chex.assert_trees_all_close(jz.gather(none.params), jz.gather(copy.master), **ulp)
    chex.assert_trees_all_close(jz.gather(none.opt_state), jz.gather(copy.opt_state), **ulp)
    chex.assert_trees_all_close(jz.gather(none.ema), jz.gather(copy.ema), **ulp)


@pytest.mark.parametrize("name", ["whole", "per_layer"])
def test_no_copy_matches_single_device_optax_on_the_bf16_loss(name):
    """Against plain optax (SGD) on one device, full batch, the loss evaluated on the bf16
    cast of fp32 params: equal up to bf16 rounding of the per-device gradients (summed in
    another order), far below the 4 steps' own movement. (SGD: Adam's first steps are
    sign-like and turn a bf16 rounding of a tiny gradient into a full step.)"""
    params, loss_fn, batches, kw = _problem(name)
    tx = optax.sgd(0.05)
    want, _, atol = tolerance.reference_cast(tx, params, loss_fn, batches, jnp.bfloat16)
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(N), stage=3, precision=NO_COPY, **kw)
    state, _ = _run(zero, loss_fn, zero.init(params), batches, None)
    chex.assert_trees_all_close(jz.gather(state.params), want, atol=atol)
    # 4 SGD steps moved the weights far past that tolerance (0.083 / 0.071 against 1.9e-3 / 2.6e-3)
    assert tolerance.max_distance(want, params) > 20 * atol


def test_no_copy_holds_12_bytes_per_parameter_over_n():
    """Persistent state per device, from the arrays' addressable shards: fp32 params (the
    master) + Adam's m and v = 12 Phi/N with no separate master, where the copy layout holds
    14 Phi/N (its bf16 params); leaves with no dimension divisible by N stay whole."""
    params, _, _, _ = _problem("whole", steps=1)
    phi = sum(x.size for x in jax.tree.leaves(params))
    whole = sum(x.size for x in jax.tree.leaves(params) if not any(d % N == 0 for d in x.shape))
    held = {}
    for label, pol in (("copy", COPY), ("no_copy", NO_COPY)):
        state = _zero(pol).init(params)
        held[label] = sum(
            next(iter(device_bytes(t).values()))
            for t in (state.params, state.master, state.opt_state)
            if t is not None
        )
    sharded = (phi - whole) / N + whole  # elements per device of one sharded copy
    count = 4  # Adam's int32 step count
    assert held["no_copy"] == pytest.approx(12 * sharded + count, abs=1)
    assert held["copy"] - held["no_copy"] == pytest.approx(2 * sharded, abs=1)


def test_no_copy_gathers_in_bf16():
    """The wire stays 16-bit: every all-gather of the lowered step moves bf16, one per
    sharded parameter, although the state holds fp32."""
    params, loss_fn, batches, _ = _problem("whole", steps=1)
    step = jz.make_train_step(loss_fn, _zero(NO_COPY))
    text = step.lower(step.init(params), batches[0]).as_text()
    gathers = [line for line in text.splitlines() if "stablehlo.all_gather" in line]
    assert gathers
    for line in gathers:
        assert "xbf16>" in line.split("->")[-1], line


def test_no_copy_needs_stage3_and_a_bool():
    with pytest.raises(ValueError, match=r"compute_copy=False\) needs stage=3 \(got stage=2\)"):
        jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(N), stage=2, precision=NO_COPY)
    with pytest.raises(TypeError, match=r"compute_copy='no' must be True or False"):
        jz.Precision(compute_copy="no")


# slow: the no-copy -> copy restore (copy -> no-copy stays)
@pytest.mark.parametrize(
    "direction", [pytest.param("no_copy_to_copy", marks=pytest.mark.slow), "copy_to_no_copy"]
)
def test_checkpoints_restore_across_the_two_layouts_and_continue(direction, tmp_path):
    """A checkpoint of either layout restores into the other (the master carries the
    weights, the bf16 params are its cast) and training continues as it would have in the
    layout that wrote it (to 1 ulp, as above)."""
    params, loss_fn, batches, _ = _problem("whole", steps=4)
    src, dst = (NO_COPY, COPY) if direction == "no_copy_to_copy" else (COPY, NO_COPY)
    zero_src, zero_dst = _zero(src), _zero(dst)
    state, _ = _run(zero_src, loss_fn, zero_src.init(params), batches[:2], None)
    assert ck.save(str(tmp_path), 2, state, zero=zero_src, wait=True)
    restored = ck.restore(str(tmp_path), zero_dst, params)
    master = lambda s: s.master if s.master is not None else s.params
    chex.assert_trees_all_equal(jz.gather(master(restored)), jz.gather(master(state)))
    want_dtype = jnp.bfloat16 if dst.compute_copy else jnp.float32
    assert {x.dtype for x in jax.tree.leaves(restored.params)} == {jnp.dtype(want_dtype)}
    if dst.compute_copy:
        chex.assert_trees_all_equal(
            jz.gather(restored.params),
            jax.tree.map(lambda x: x.astype(jnp.bfloat16), jz.gather(master(state))),
        )
    cont_src, _ = _run(zero_src, loss_fn, state, batches[2:], None)
    cont_dst, _ = _run(zero_dst, loss_fn, restored, batches[2:], None)
    # the same steps with and without the copy: under tests/tolerance.py's 16-ulp floor
    chex.assert_trees_all_close(
        jz.gather(master(cont_dst)), jz.gather(master(cont_src)), rtol=1e-6, atol=1e-8
    )
