"""``ZeRO(offload=("optimizer", "params"))``: the bf16 compute params in pinned host memory
too, each layer of a ``jz.scan_layers`` stack fetched a layer ahead, each layer's gradient
written into its own params' host slot (decision 37).

Numbers: on 8 simulated CPU devices the run equals the same run with the params on the
device and with nothing offloaded (to 1e-6), and single-device fp32 optax within bf16's
rounding (checkpoints moving between the settings: test_offload.py). Memory: the deviceless H100 compile holds
in host memory exactly the offloaded state plus the params (restated from the sharding
rule), with no host temporaries (the gradients take the params' bytes), and no
parameter bytes among the device's arguments. Bad configurations are refused before any
state exists.
"""

from __future__ import annotations

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import run_steps, stack_problem
from offload_checks import h100_stage3
from tolerance import reference_run

import jaxzero as jz
from jaxzero import cli, gpu
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, make_problem, model_shape

N = 8
PARAMS = ("optimizer", "params")
TX = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, eps=1e-6))


def _zero(off, **kw):
    kw = {"stage": 3, "layers": "layers", "precision": "bf16", **kw}
    return jz.ZeRO(TX(), jz.data_parallel_mesh(N), offload=off, **kw)


def _numpy(tree):
    return jax.tree.map(np.asarray, jz.gather(tree))


def _kinds(tree):
    return {
        s.data.sharding.memory_kind for x in jax.tree.leaves(tree) for s in x.addressable_shards
    }


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({}, id="bf16"),
        # slow: fp16 with dynamic loss scaling (bf16 stays)
        pytest.param(
            {"precision": "fp16", "loss_scale": jz.DynamicLossScale(2.0**10)},
            id="fp16_scaled",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_param_offload_trains_like_the_device_params(kw):
    """Losses, master, optimizer state, EMA and counters after 3 steps equal the runs with the
    params on the device (optimizer offload) and with nothing offloaded, and the 16-bit params
    are within one unit in their last place: each is the cast of a master equal to 1e-6, and a
    master that sits on a rounding boundary casts to either neighbour (fp16 on jax 0.12: 1 of
    6144). The params, master, optimizer state and EMA are in pinned host memory throughout."""
    params, loss_fn, batches = stack_problem(layers=3, steps=3)
    ema = jz.ShardedEMA(0.9, tau=2.0)
    runs = {}
    for off in (None, "optimizer", PARAMS):
        zero = _zero(off, **kw)
        runs[off] = run_steps(zero, loss_fn, zero.init(params, ema=ema), batches, ema)
    host, losses = runs[PARAMS]
    assert _kinds((host.params, host.master, host.opt_state, host.ema)) == {"pinned_host"}
    tol = {"rtol": 1e-6, "atol": 1e-8}
    for off in (None, "optimizer"):
        other, other_losses = runs[off]
        np.testing.assert_allclose(losses, other_losses, rtol=1e-6)
        for part in ("master", "opt_state", "ema"):
            chex.assert_trees_all_close(
                _numpy(getattr(host, part)), _numpy(getattr(other, part)), **tol
            )
        _assert_within_one_ulp(_numpy(host.params), _numpy(other.params))
        assert (int(host.step), int(host.skipped)) == (int(other.step), int(other.skipped))


def _assert_within_one_ulp(tree, other) -> None:
    """Each leaf of ``tree`` within one unit in the last place of its dtype of ``other``'s."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, x), y in zip(paths, jax.tree.leaves(other), strict=True):
        x, wide = np.asarray(x), np.asarray(y, np.float64)
        info = jnp.finfo(x.dtype)
        tiny, eps = float(info.tiny), float(info.eps)
        ulp = eps * np.exp2(np.floor(np.log2(np.maximum(np.abs(wide), tiny))))
        assert np.all(np.abs(np.asarray(x, np.float64) - wide) <= ulp), jax.tree_util.keystr(path)


def test_param_offload_follows_single_device_optax():
    """The fp32 master after 3 steps is plain single-device fp32 optax's within what the
    bf16 forward and the bf16 gradient reduction round."""
    params, loss_fn, batches = stack_problem(layers=3, steps=3)
    ref, _ = reference_run(TX(), params, loss_fn, batches)
    zero = _zero(PARAMS)
    state, _ = run_steps(zero, loss_fn, zero.init(params), batches, None)
    # bf16's rounding of the forward and the reduce against fp32 optax, not a sum's order
    # (Adam turns it into a share of the lr 3e-3 per step: 1.05e-2 apart here)
    chex.assert_trees_all_close(_numpy(state.master), ref, atol=2e-2)
    # and far from the initial params: the steps moved them by more than the tolerance
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), ref, params)
    assert max(jax.tree.leaves(moved)) > 5e-3


def test_param_offload_refuses_what_would_not_fetch_layer_by_layer():
    mesh = jz.data_parallel_mesh(N)
    tx = optax.adam(1e-3)
    with pytest.raises(ValueError, match=r"needs stage=3"):
        jz.ZeRO(tx, mesh, stage=2, precision="bf16", offload=PARAMS)
    with pytest.raises(ValueError, match=r"use offload=\('optimizer', 'params'\)"):
        jz.ZeRO(tx, mesh, stage=3, layers="layers", precision="bf16", offload="params")
    with pytest.raises(ValueError, match=r"has no layers="):
        jz.ZeRO(tx, mesh, stage=3, precision="bf16", offload=PARAMS)
    with pytest.raises(ValueError, match=r"prefetch=False .* not built"):
        jz.ZeRO(
            tx, mesh, stage=3, units="block_*", precision="bf16", offload=PARAMS, prefetch=False
        )
    with pytest.raises(ValueError, match=r"needs a 16-bit compute copy"):
        jz.ZeRO(tx, mesh, stage=3, layers="layers", offload=PARAMS)  # fp32: no copy
    fsdp = jz.Precision.create("bf16", compute_copy=False)
    with pytest.raises(ValueError, match=r"needs a 16-bit compute copy"):
        jz.ZeRO(tx, mesh, stage=3, layers="layers", precision=fsdp, offload=PARAMS)
    with pytest.raises(ValueError, match=r"not built with quantized gradients"):
        jz.ZeRO(
            tx, mesh, stage=3, layers="layers", precision="bf16", offload=PARAMS, quantize="grads"
        )


def test_param_offload_refuses_a_stack_run_by_gather_layer():
    """An nn.scan over gather_layer cannot fetch host stacks a layer at a time: refused
    when the step is traced, before any state changes."""
    params, loss_fn, batches = make_problem("scanned", steps=1, gather_layer=jz.gather_layer)
    zero = _zero(PARAMS)
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    with pytest.raises(ValueError, match=r"gather_layer \(an nn.scan over the stack\) cannot"):
        step(state, batches[0])
    assert int(state.step) == 0  # not donated: the call failed while tracing


SHAPE = model_shape(layers=4, hidden=512, heads=4, vocab=512, seq=64, batch=1)


def _gpu_report(off):
    zero = h100_stage3(N, offload=off)
    step = jz.make_train_step(make_loss(SHAPE), zero, ema=jz.ShardedEMA(0.99))
    return gpu.compile_report(step, abstract_params(SHAPE), batch_shapes(SHAPE, N))


def _local_stack_shapes():
    """Each layer stack's shape per device: split 8 ways on its first divisible non-layer
    dimension."""
    shapes = set()
    for x in jax.tree.leaves(abstract_params(SHAPE)["layers"]):
        d = next(d for d in range(1, len(x.shape)) if x.shape[d] % N == 0)
        shapes.add(x.shape[:d] + (x.shape[d] // N,) + x.shape[d + 1 :])
    return shapes


# a write of one layer's device slice into a stack in host memory (S(5)), as XLA:GPU's async
# dynamic-update-slice prints it: the host operand's shape is captured
_HOST_WRITE = re.compile(
    r"dynamic-update-slice\S* = \(\(bf16\[([\d,]+)\]\{[\d,]*:S\(5\)\}, bf16\[1,"
)


def _local_elements():
    """Elements per device of every param leaf, by the sharding rule (split 8 ways on the
    first divisible dimension, a stack's layer axis skipped, else whole)."""
    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params(SHAPE))[0]:
        skip = 1 if path[0].key == "layers" else 0
        split = any(d % N == 0 for d in x.shape[skip:])
        total += math.prod(x.shape) // (N if split else 1)
    return total


def test_gpu_param_offload_holds_state_and_params_on_the_host_and_nothing_more():
    """Deviceless H100, 4 scanned layers x 512 at N = 8, bf16 Adam with an EMA: the host
    holds the fp32 master, mu, nu and EMA (16 bytes per local element) and the bf16 params
    (2), plus Adam's and the EMA's counters, and nothing else: no temporaries, every output
    aliased to its input (the gradients are written into the params' buffers). The device's
    arguments hold no parameter bytes (the batch and two counters only), and its peak is below
    optimizer offload's by at least the bf16 params (2 bytes per local element; their
    gradient's 2 are partly spent on the reduce-scatter in flight under the next layer's
    backward, decision 44). Each stack's gradient leaves the device one layer's slice at a
    time: the compiled step writes a [1, ...] device slice into every stack's host buffer, and
    its reduce-scatters are as hidden as optimizer offload's (written in the same iteration,
    none was)."""
    local = _local_elements()
    host = _gpu_report(PARAMS)
    want = 18 * local + 2 * 4
    assert host.host_argument_bytes == want
    assert host.host_temp_bytes == 0
    assert host.host_alias_bytes == host.host_output_bytes == want
    # the device's arguments: the int32 tokens and labels, the step and skip counters
    assert host.argument_bytes == 2 * 4 * SHAPE.batch * SHAPE.seq + 2 * 4
    device = _gpu_report("optimizer")
    assert device.peak_bytes - host.peak_bytes >= 2 * local
    rs = lambda report: report.hidden_share("reduce-scatter")
    assert rs(host) >= rs(device) > 0, (rs(host), rs(device))
    # the per-layer transfer: every stack's gradient is written into its host buffer one
    # layer's slice at a time (in the backward loop)
    writes = {tuple(int(d) for d in m.split(",")) for m in _HOST_WRITE.findall(host.hlo_text)}
    assert writes == _local_stack_shapes()


def test_plan_cli_offloads_the_params_at_stage_3_only(capsys):
    """``jaxzero plan --offload optimizer,params`` plans stage 3 (its default) with the host
    at 14 bytes per local parameter (bf16 params 2, fp32 master 4, Adam 8: the gradient
    takes the params' bytes) by the estimate, the compiled host column equal to it plus
    the state's counters and the batch-free device state; stage 2 is refused."""
    argv = ["plan", "--devices", "8", "--layers", "4", "--hidden", "512", "--heads", "4"]
    argv += ["--vocab", "512", "--seq", "64", "--stage3", "per-layer"]
    assert cli.main([*argv, "--offload", "optimizer,params", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "offload optimizer and params to pinned host memory" in out
    row = next(line for line in out.splitlines() if line.startswith("3 per layer"))
    est = jz.estimate_memory(SHAPE.num_params, N, stage=3, offload=PARAMS)
    assert (est.host, est.params, est.grads, est.optimizer) == (
        14 * -(-SHAPE.num_params // N),
        0,
        0,
        0,
    )
    assert jz.memory.format_bytes(est.host) in row
    assert not any(line.startswith(("1 ", "2 ")) for line in out.splitlines())
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--stage", "2", "--offload", "optimizer,params"])
    assert e.value.code == 2
    assert "needs stage=3" in capsys.readouterr().err
