"""``ZeRO(offload="optimizer")``: the fp32 master, the optimizer state and the EMA in pinned
host memory, updated on the host. On simulated CPU devices the offloaded step gives the same
numbers as the step without offload (stages 1-3, bf16/fp16, loss scaling, micro-batches, EMA)
and as single-device optax; checkpoints move between the two; the arrays really are in
``pinned_host``. The device-memory saving is proven on the GPU compile (test_gpu_offload.py).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance
from models import run_steps, stack_problem

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero.gpu.models import make_problem
from jaxzero.zero.offload import placement as offload

N = 8
BF16 = jz.Precision("bfloat16", "float32", "float32")

# (problem, ZeRO keywords, make_train_step keywords)
CASES = [
    # slow: stage 1 with micro-batches (stage 1 stays in test_offload_matches_single_device_optax)
    pytest.param(
        "transformer",
        {"stage": 1, "precision": BF16},
        {"accum_steps": 2},
        id="stage1_bf16_accum",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "transformer",
        {"stage": 2, "precision": "fp16", "loss_scale": jz.DynamicLossScale(2.0**10)},
        {},
        id="stage2_fp16_scaled",
    ),
    # slow: whole-model stage 3 (stage 3 stays per layer, with the bf16 reduce below; the
    # whole model stays at stage 2)
    pytest.param(
        "transformer",
        {"stage": 3, "precision": BF16},
        {"accum_steps": 2},
        id="stage3_bf16",
        marks=pytest.mark.slow,
    ),
    # fp32 reduce: the stacks' gradients are not exact in bf16, so the loss gets fp32 stacks.
    # slow: per-layer stage 3 with the fp32 reduce (the bf16 reduce below stays)
    pytest.param(
        "scanned",
        {"stage": 3, "precision": BF16, "layers": "layers"},
        {},
        id="stage3_per_layer_bf16",
        marks=pytest.mark.slow,
    ),
    # "bf16" reduces in bf16 over 8 devices: the loss keeps the bf16 stacks (decision 32)
    pytest.param(
        "scanned",
        {"stage": 3, "precision": "bf16", "layers": "layers"},
        {"accum_steps": 2},
        id="stage3_per_layer_bf16_reduce",
    ),
    # slow: fp32 without a master (stage 2 stays, with fp16 loss scaling)
    pytest.param(
        "transformer", {"stage": 2}, {}, id="stage2_fp32_no_master", marks=pytest.mark.slow
    ),
]


def _problem(name, steps=3):
    extra = {"gather_layer": jz.gather_layer} if name == "scanned" else {}
    return make_problem(name, steps=steps, **extra)


def _zero(off, **kw):
    return jz.ZeRO(optax.adam(1e-2, eps=1e-6), jz.data_parallel_mesh(N), offload=off, **kw)


_run = run_steps


def _host_kinds(tree):
    """The memory kinds of every leaf and of each of its addressable shards."""
    kinds = set()
    for x in jax.tree.leaves(tree):
        kinds.add(x.sharding.memory_kind)
        kinds.update(s.data.sharding.memory_kind for s in x.addressable_shards)
    return kinds


def _numpy(tree):
    return jax.tree.map(np.asarray, jz.gather(tree))


def _assert_within_one_ulp(tree, other) -> None:
    """Each leaf of ``tree`` within one unit in the last place of its dtype of ``other``'s."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, x), y in zip(paths, jax.tree.leaves(other), strict=True):
        x, wide = np.asarray(x), np.asarray(y, np.float64)
        info = jnp.finfo(x.dtype)
        ulp = float(info.eps) * np.exp2(np.floor(np.log2(np.maximum(np.abs(wide), info.tiny))))
        assert np.all(np.abs(np.asarray(x, np.float64) - wide) <= ulp), jax.tree_util.keystr(path)


@pytest.mark.parametrize("name,zkw,skw", CASES)
def test_offload_trains_like_the_device_state(name, zkw, skw):
    """Losses, master, optimizer state, EMA, step and skip counters of the offloaded run equal
    the run without offload after 3 steps, and its 16-bit compute params are within one unit
    in their last place (docs/guide/offload.md, "Same numbers")."""
    params, loss_fn, batches = _problem(name)
    ema = jz.ShardedEMA(0.9, tau=2.0)
    runs = {}
    for off in (None, "optimizer"):
        zero = _zero(off, **zkw)
        runs[off] = _run(zero, loss_fn, zero.init(params, ema=ema), batches, ema, **skw)
    (dev, loss_d), (host, loss_h) = runs[None], runs["optimizer"]
    np.testing.assert_allclose(loss_h, loss_d, rtol=1e-6)
    tol = {"rtol": 1e-6, "atol": 1e-8}
    for part in ("master", "opt_state", "ema"):
        chex.assert_trees_all_close(_numpy(getattr(host, part)), _numpy(getattr(dev, part)), **tol)
    if host.master is None:  # fp32: the params are the master
        chex.assert_trees_all_close(_numpy(host.params), _numpy(dev.params), **tol)
    else:  # 16-bit: each the cast of an equal master, on a rounding boundary to either neighbour
        _assert_within_one_ulp(_numpy(host.params), _numpy(dev.params))
    assert (int(host.step), int(host.skipped)) == (int(dev.step), int(dev.skipped))
    if host.loss_scale is not None:
        assert float(host.loss_scale.scale) == float(dev.loss_scale.scale)


# slow: every stage (tests/test_offload_chains.py keeps each stage against single-device optax:
# masked AdamW at stage 1, clipped Adam at stage 2, Adafactor and SGD at whole-model stage 3)
@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3)])
def test_offload_matches_single_device_optax(stage):
    """fp32 Adam, offloaded, against plain optax on one device with the full batch (the
    tolerance of tests/tolerance.py: the sharded sums reorder the gradient's arithmetic)."""
    params, loss_fn, batches = _problem("transformer")
    tx = optax.adam(1e-2, eps=1e-6)
    want, _, atol = tolerance.reference(tx, params, loss_fn, batches)
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(N), stage=stage, offload="optimizer")
    state, _ = _run(zero, loss_fn, zero.init(params), batches, None)
    chex.assert_trees_all_close(_numpy(state.params), want, rtol=1e-5, atol=atol)
    moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), want, params)))
    assert moved > 1e-2  # 3 Adam steps of 1e-2 moved the weights far past the tolerance


def test_state_lives_in_pinned_host_memory():
    """Master, optimizer state and EMA (every leaf and every addressable shard) are in
    ``pinned_host`` after init and after a step; params and counters stay on the device;
    the shardings are those of the run without offload."""
    params, loss_fn, batches = _problem("transformer", steps=1)
    ema = jz.ShardedEMA(0.9)
    zero = _zero("optimizer", stage=2, precision=BF16)
    specs = lambda t: jax.tree.map(lambda x: x.sharding.spec, t)
    plain = specs(_zero(None, stage=2, precision=BF16).init(params, ema=ema))
    state = zero.init(params, ema=ema)
    for when in ("init", "step"):
        if when == "step":  # the step donates the state it is given
            state = _run(zero, loss_fn, state, batches, ema)[0]
        for part in (state.master, state.opt_state, state.ema):
            assert _host_kinds(part) == {"pinned_host"}, when
        assert _host_kinds((state.params, state.step, state.skipped)) == {"device"}, when
        assert specs(state) == plain, when


def test_gather_and_ema_params_read_offloaded_state():
    """``jz.gather`` and ``jz.ema_params`` give the same trees as without offload. With the
    EMA and the master in host memory they return device arrays, every shard in device
    memory, that a jitted loss reads beside its device batch: a host operand there is a jax
    error (``memory_space of all inputs ... must be the same``). The loss on the gathered EMA
    is the loss on the EMA gathered without offload."""
    params, loss_fn, batches = _problem("transformer", steps=2)
    ema = jz.ShardedEMA(0.9)
    out, losses = {}, {}
    for off in (None, "optimizer"):
        zero = _zero(off, stage=3, precision=BF16)
        state, _ = _run(zero, loss_fn, zero.init(params, ema=ema), batches, ema)
        out[off] = (
            _numpy(state.master),
            _numpy(state.opt_state),
            jax.tree.map(np.asarray, jz.ema_params(state)),
        )
        trees = (jz.gather(state.ema), jz.ema_params(state), jz.gather(state.master))
        assert _host_kinds(trees) == {"device"}, off
        losses[off] = [float(jax.jit(loss_fn)(t, batches[0])) for t in trees[:2]]
    # the same sums on host and device: a few ulps, under tests/tolerance.py's 16-ulp floor
    chex.assert_trees_all_close(out["optimizer"], out[None], rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(losses["optimizer"], losses[None], rtol=1e-6)


PARAMS = ("optimizer", "params")


@pytest.mark.parametrize(
    "src,dst",
    [
        # slow: the offloaded -> device restore (device -> offloaded stays)
        pytest.param("optimizer", None, id="offloaded_to_device", marks=pytest.mark.slow),
        pytest.param(None, "optimizer", id="device_to_offloaded"),
        pytest.param(PARAMS, None, id="params_offloaded_to_device"),
        # slow: into parameter offload (out of it stays)
        pytest.param(
            "optimizer", PARAMS, id="optimizer_to_params_offloaded", marks=pytest.mark.slow
        ),
    ],
)
def test_checkpoints_restore_across_offload_settings_and_continue(src, dst, tmp_path):
    """A checkpoint saved from either setting restores into the other (host memory kinds
    where the target offloads; the params too with ``("optimizer", "params")``) and
    training continues as in the setting that wrote it."""
    params_off = PARAMS in (src, dst)
    kw = {"stage": 2, "precision": BF16}
    if params_off:
        kw = {"stage": 3, "precision": "bf16", "layers": "layers"}
        params, loss_fn, batches = stack_problem(layers=3, steps=4)
    else:
        params, loss_fn, batches = _problem("transformer", steps=4)
    ema = jz.ShardedEMA(0.9)
    zero_src, zero_dst = _zero(src, **kw), _zero(dst, **kw)
    state, _ = _run(zero_src, loss_fn, zero_src.init(params, ema=ema), batches[:2], ema)
    assert ck.save(str(tmp_path), 2, state, zero=zero_src, wait=True)
    restored = ck.restore(str(tmp_path), zero_dst, params, ema=ema)
    want_kind = "pinned_host" if dst else "device"
    assert _host_kinds((restored.master, restored.opt_state, restored.ema)) == {want_kind}
    if params_off:
        assert _host_kinds(restored.params) == {"pinned_host" if dst == PARAMS else "device"}
    chex.assert_trees_all_equal(_numpy(restored.params), _numpy(state.params))
    chex.assert_trees_all_equal(_numpy(restored.master), _numpy(state.master))
    chex.assert_trees_all_equal(_numpy(restored.opt_state), _numpy(state.opt_state))
    cont_src, _ = _run(zero_src, loss_fn, state, batches[2:], ema)
    cont_dst, _ = _run(zero_dst, loss_fn, restored, batches[2:], ema)
    tol = {"rtol": 1e-6, "atol": 1e-8}
    chex.assert_trees_all_close(_numpy(cont_dst.master), _numpy(cont_src.master), **tol)
    chex.assert_trees_all_close(_numpy(cont_dst.ema), _numpy(cont_src.ema), **tol)


def test_offload_refuses_stage0_and_unknown_values():
    mesh = jz.data_parallel_mesh(N)
    with pytest.raises(
        ValueError, match=r"offload='optimizer' needs stage 1, 2 or 3 \(got stage=0"
    ):
        jz.ZeRO(optax.sgd(0.1), mesh, stage=0, offload="optimizer")
    with pytest.raises(ValueError, match=r"offload='cpu' is not supported; use None"):
        jz.ZeRO(optax.sgd(0.1), mesh, stage=2, offload="cpu")
    with pytest.raises(ValueError, match=r"use offload=\('optimizer', 'params'\)"):
        jz.ZeRO(optax.sgd(0.1), mesh, stage=3, offload="params")


def test_offload_refuses_a_platform_without_pinned_host(monkeypatch):
    """Devices that address memories but no ``pinned_host`` are refused when the ZeRO is
    built (before any state exists)."""
    monkeypatch.setattr(offload, "memory_kinds", lambda mesh: ("device",))
    with pytest.raises(ValueError, match=r"needs 'pinned_host' memory, and the cpu devices"):
        jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(N), stage=2, offload="optimizer")


def test_a_dropped_memory_kind_is_an_error(monkeypatch):
    """A platform that hands back a host sharding without its memory kind (as compile-only
    devices do) is an error naming the kind, never a state silently left on the device."""

    class Dropping(jax.sharding.NamedSharding):
        def __init__(self, mesh, spec, memory_kind=None):
            super().__init__(mesh, spec)

    monkeypatch.setattr(offload, "NamedSharding", Dropping)
    zero = _zero("optimizer", stage=2)
    params, _, _ = _problem("mlp", steps=1)
    with pytest.raises(
        ValueError,
        match=r"asked for memory_kind='pinned_host' on the cpu mesh and got memory_kind='device'",
    ):
        zero.init(params)
