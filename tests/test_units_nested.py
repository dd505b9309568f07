"""``units=`` on a loss whose units sit inside a nested call. A ``jax.jit`` around the loss
(or the model) is evaluated inline, so each unit keeps its own segment; a ``jax.checkpoint``
(``nn.remat``) around several units cannot be split without changing what it saves, and it
gets a warning naming the units gathered together."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.gpu.models import Residual, make_problem
from jaxzero.zero.units import plan as units_mod

PATTERN = r"layer\d+"  # jaxzero.gpu.models' Transformer blocks


def _segments(loss_fn, params, batch, pattern=PATTERN):
    """How many unit segments :func:`jaxzero.zero.units.run` ran for ``loss_fn`` inside the
    8-device shard_map (units gathered segment by segment, the rest whole: the segments are
    the same with prefetch, which also gathers the rest where it is read)."""
    mesh = jz.data_parallel_mesh(8)
    zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=3)
    specs = zero.param_specs(params)
    plan = units_mod.build_plan(zero.comm, (pattern,), params, specs, prefetch=False)
    names = units_mod.unit_names(params, (pattern,))
    leaves, treedef = jax.tree.flatten(params)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    in_specs = [s if u is not None else P() for s, u in zip(flat_specs, names, strict=True)]

    def local(p, b):
        return jax.lax.pmean(units_mod.run(plan, loss_fn, p, b), "data")

    sm = jax.shard_map(
        local, mesh=mesh, in_specs=(jax.tree.unflatten(treedef, in_specs), P("data")), out_specs=P()
    )
    jax.jit(sm).lower(params, batch)
    return plan.segments


def test_a_jitted_loss_keeps_one_segment_per_unit_and_the_numbers():
    """``jax.jit(loss_fn)`` was one equation of the traced loss, so every unit landed in one
    segment (whole-model stage 3, silently). Now it is evaluated inline: the same segments as
    the plain loss, and the step equals single-device optax."""
    params, loss_fn, batches = make_problem("transformer", steps=3)
    plain = _segments(loss_fn, params, batches[0])
    assert plain == 2
    assert _segments(jax.jit(loss_fn), params, batches[0]) == plain
    tx = optax.adam(1e-2, eps=1e-6)
    want, _, atol = tolerance.reference(tx, params, loss_fn, batches)
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(8), stage=3, units=PATTERN)
    step = jz.make_train_step(jax.jit(loss_fn), zero)
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)
    got = jax.tree.map(np.asarray, jz.gather(state))
    chex.assert_trees_all_close(got, jax.tree.map(np.asarray, want), atol=atol, rtol=1e-5)


class _Pair(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Residual(name="block_1")(Residual(name="block_0")(x))


class _TwoUnderOneRemat(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(_Pair)(name="pair")(x)
        return nn.Dense(2, name="head")(x)


def test_two_units_under_one_remat_are_named_in_a_warning():
    """Two blocks under one ``nn.remat``: one checkpoint equation reads both units' weights,
    so both are gathered for it; the warning names them and the fix."""
    model = _TwoUnderOneRemat()
    params = model.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    loss_fn = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
    batch = {"x": np.ones((8, 16), np.float32), "y": np.zeros((8, 2), np.float32)}
    with pytest.warns(UserWarning, match=r"units pair/block_0, pair/block_1 \(2\) run inside"):
        segments = _segments(loss_fn, params, batch, pattern=r"pair/block_\d")
    assert segments == 1
