"""Stages 3 and 2 per layer: ``ZeRO(layers=...)`` + ``jaxzero.gather_layer`` in a scanned model
(stage 3 gathers each layer; stage 2 reduce-scatters each layer's gradient in the backward).

Checked against plain single-device optax (same data, same seed), against today's
whole-model stage 3, and on the compiled HLO / memory analysis: the parameter all-gathers and
gradient reduce-scatters of the layer stack sit inside the scanned loop, and peak temp memory
grows with depth by the activation checkpoints only, not by the layers' weights.
"""

from __future__ import annotations

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance
from jax.sharding import PartitionSpec as P
from models import stage3_per_layer_and_whole_bf16, train

import jaxzero as jz
from jaxzero.gpu.models import make_problem
from jaxzero.memory import collective_ops

# Cases whose configuration reduces the whole gradient after the backward (micro-batches at
# stages 0/1, a replica axis) are warned about by design (the two tests below that build one
# pin the warning); here it is expected.
pytestmark = pytest.mark.filterwarnings("ignore:ZeRO\\(stage=.*reduces no layer's gradient")

CHAINS = {
    "sgd_nesterov_cosine": lambda: optax.sgd(
        optax.warmup_cosine_decay_schedule(0.0, 0.05, 3, 10), momentum=0.9, nesterov=True
    ),
    # eps 1e-6: the attention key kernel's true gradient is ~0 (softmax shift-invariance),
    # and Adam with eps 1e-8 turns float noise there into O(lr) steps no two summation orders
    # agree on (the whole-model stage 3 differs from single-device by 2e-4 with eps 1e-8).
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(3e-3, eps=1e-6, weight_decay=0.1)
    ),
}


@pytest.mark.parametrize(
    "chain,n,accum,stage",
    [
        # slow: the second optimizer and N = 2 (clip_adamw at N = 8 stays for every stage)
        pytest.param("sgd_nesterov_cosine", 8, 1, 3, marks=pytest.mark.slow),
        ("clip_adamw", 8, 1, 3),
        pytest.param("clip_adamw", 2, 4, 3, marks=pytest.mark.slow),
        ("clip_adamw", 8, 1, 2),
        pytest.param("sgd_nesterov_cosine", 2, 4, 2, marks=pytest.mark.slow),
        ("clip_adamw", 8, 1, 1),
        pytest.param("sgd_nesterov_cosine", 2, 4, 1, marks=pytest.mark.slow),
        ("clip_adamw", 8, 1, 0),
        pytest.param("sgd_nesterov_cosine", 2, 4, 0, marks=pytest.mark.slow),
    ],
)
def test_per_layer_matches_single_device(chain, n, accum, stage):
    params, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer)
    tx = CHAINS[chain]()
    ref_params, ref_opt, atol = tolerance.reference(tx, params, loss_fn, batches)
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(n), stage=stage, layers="layers")
    state = train(zero, loss_fn, params, batches, accum_steps=accum)
    chex.assert_trees_all_close(jz.gather(state), ref_params, atol=atol)
    chex.assert_trees_all_close(jz.gather(state.opt_state), ref_opt, atol=atol)
    # Every layer-stack leaf kept its layer axis whole and is split on another one.
    for path, x in jax.tree_util.tree_flatten_with_path(state.params["layers"])[0]:
        spec = tuple(x.sharding.spec)
        assert not spec or spec[0] is None, (path, spec)
        shard = x.addressable_shards[0].data.shape
        assert shard[0] == x.shape[0], (path, shard)


# slow: the gather_layer model; make test keeps the same claim on the scan_layers model
# (tests/test_scan_layers.py::test_scan_layers_per_layer_equals_whole_model_stage3_bf16_with_ema)
@pytest.mark.slow
def test_per_layer_equals_whole_model_stage3_with_ema_bf16():
    """Same numbers as gathering the whole model up front (bf16 compute, fp32 master and
    reduce, EMA on the same shards): only where the gathers happen differs."""
    params, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer, steps=4)
    ema = jz.ShardedEMA(0.9, tau=2.0)
    per_layer, whole = stage3_per_layer_and_whole_bf16(params, loss_fn, batches, ema)
    # bf16 compute on both sides: an fp32 reference's spread does not measure its rounding
    # (1e-6: 8 fp32 ulps of the largest master value, about 1; the runs are bit-equal here)
    chex.assert_trees_all_close(jz.gather(per_layer.master), jz.gather(whole.master), atol=1e-6)
    chex.assert_trees_all_close(jz.gather(per_layer.ema), jz.gather(whole.ema), atol=1e-6)
    chex.assert_trees_all_close(
        jz.gather(per_layer.opt_state), jz.gather(whole.opt_state), atol=1e-6
    )


def _layer_param_bytes(params, dtype_bytes):
    per_layer = sum(x.size // x.shape[0] for x in jax.tree.leaves(params["layers"]))
    return per_layer * dtype_bytes


def _compile(layers, *, per_layer, d_model=128, ff=512, n=8):
    params, loss_fn, _ = make_problem(
        "scanned", gather_layer=jz.gather_layer, layers=layers, d_model=d_model, ff=ff, steps=1
    )
    zero = jz.ZeRO(
        optax.sgd(0.1),
        jz.data_parallel_mesh(n),
        stage=3,
        layers="layers" if per_layer else None,
        skip_nonfinite=False,
    )
    step = jz.make_train_step(loss_fn, zero)
    state = zero.abstract_state(params)
    batch = {
        "x": jax.ShapeDtypeStruct((n, 6, d_model), jnp.float32),
        "y": jax.ShapeDtypeStruct((n, 6, 3), jnp.float32),
    }
    compiled = step.jitted.lower(state, batch).compile()
    return params, compiled


def _entry(hlo):
    return next(
        line.split()[1].lstrip("%") for line in hlo.splitlines() if line.startswith("ENTRY")
    )


# slow: make test keeps the layer collectives inside the scanned loop on the GPU compile
# (tests/test_gpu.py's scan_layers prefetch and stage-2 per-layer reduce-scatter tests)
@pytest.mark.slow
def test_layer_collectives_sit_in_the_scanned_loop():
    """The compiled HLO: the layer stack's all-gathers and reduce-scatters are inside the
    scanned loop bodies (per layer), moving 2x (forward + remat recompute) and 1x one layer's
    bytes; the entry computation gathers only the non-layer leaves (the head)."""
    n = 8
    params, compiled = _compile(4, per_layer=True)
    hlo = compiled.as_text()
    entry = _entry(hlo)
    ops = collective_ops(hlo)
    layer_bytes = _layer_param_bytes(params, 4)
    loop = [op for op in ops if op.computation != entry]
    # collective_ops counts a loop body once; all-gather bytes are the gathered (output) size,
    # reduce-scatter bytes the scattered one.
    ag = sum(op.bytes for op in loop if op.kind == "all-gather")
    rs = sum(op.bytes for op in loop if op.kind == "reduce-scatter")
    assert ag == pytest.approx(2 * layer_bytes, rel=0.01), (ag, layer_bytes)
    assert rs * n == pytest.approx(layer_bytes, rel=0.01), (rs, layer_bytes)
    entry_ag = sum(op.bytes for op in ops if op.computation == entry and op.kind == "all-gather")
    head_bytes = 4 * params["head"]["kernel"].size
    assert entry_ag == head_bytes, (entry_ag, head_bytes)
    # The whole-model stage 3 gathers the stack in the entry computation instead.
    _, whole = _compile(4, per_layer=False)
    whole_hlo = whole.as_text()
    whole_entry = _entry(whole_hlo)
    entry_ag = sum(
        op.bytes
        for op in collective_ops(whole_hlo)
        if op.kind == "all-gather" and op.computation == whole_entry
    )
    assert entry_ag >= 4 * layer_bytes, (entry_ag, layer_bytes)


# slow: stage 1 (stage 2 stays)
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_stage2_reduce_scatters_each_layer_in_the_backward_loop(stage):
    """Stage 2 with layers= (and stage 1 without micro-batches): the stack's gradient is
    reduce-scattered inside the scanned backward loop (layer by layer, as many bytes as the
    whole-gradient reduction), with no all-gather of parameters in the loop; without
    gather_layer in the model it falls back to the reduction after the backward."""
    params, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer, steps=1)
    plain_params, plain_loss, _ = make_problem("scanned", steps=1)
    n, hlos = 8, {}
    for name, p, fn in (("per_layer", params, loss_fn), ("plain", plain_params, plain_loss)):
        zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(n), stage=stage, layers="layers")
        step = jz.make_train_step(fn, zero)
        x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches[0])
        # the plain model's fallback to the whole reduction is said, at trace time
        said = pytest.warns(UserWarning, match="this model never did")
        with said if name == "plain" else contextlib.nullcontext():
            lowered = step.jitted.lower(zero.abstract_state(p), x)
        hlos[name] = lowered.compile().as_text()
    hlo = hlos["per_layer"]
    entry = _entry(hlo)
    ops = collective_ops(hlo)
    loop_rs = [op for op in ops if op.kind == "reduce-scatter" and op.computation != entry]
    assert loop_rs, [(op.kind, op.computation) for op in ops]
    assert not [op for op in ops if op.kind == "all-gather" and op.computation != entry]
    layer_bytes = _layer_param_bytes(params, 4)
    assert sum(op.bytes for op in loop_rs) == layer_bytes // n
    plain = collective_ops(hlos["plain"])
    assert all(op.computation == _entry(hlos["plain"]) for op in plain)


def test_stage0_all_reduces_each_layer_in_the_backward_loop():
    """Stage 0 with layers=: the stack's gradient is all-reduced inside the scanned backward
    loop, one layer's bytes per iteration (the whole-gradient all-reduce's bytes in all), no
    all-gather anywhere. A model that uses the stack without gather_layer gets autodiff's own
    all-reduce where each layer's weights are used (the stacks enter the loss
    device-invariant): the same numbers as single-device optax."""
    params, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer, steps=1)
    n = 8
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(n), stage=0, layers="layers")
    step = jz.make_train_step(loss_fn, zero)
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches[0])
    hlo = step.jitted.lower(zero.abstract_state(params), x).compile().as_text()
    entry, ops = _entry(hlo), collective_ops(hlo)
    assert {op.kind for op in ops} == {"all-reduce"}
    loop_ar = [op for op in ops if op.computation != entry]
    assert sum(op.bytes for op in loop_ar) == _layer_param_bytes(params, 4)
    plain_params, plain_loss, plain_batches = make_problem("scanned", steps=3)
    tx = CHAINS["clip_adamw"]()
    ref_params, _, atol = tolerance.reference(tx, plain_params, plain_loss, plain_batches)
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(n), stage=0, layers="layers")
    state = train(zero, plain_loss, plain_params, plain_batches)
    chex.assert_trees_all_close(jz.gather(state), ref_params, atol=atol)


@pytest.mark.parametrize("stage", [0, 1])
def test_stage1_with_micro_batches_keeps_one_all_reduce_after_the_backward(stage):
    """Stages 1 and 0 with layers= and 2 micro-batches accumulate the full local gradient and
    all-reduce it once after the loop (a reduction per micro-batch would add traffic):
    no reduce-scatter anywhere, the stack's gradient all-reduced in the entry computation."""
    params, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer, steps=1)
    n = 8
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(n), stage=stage, layers="layers")
    with pytest.warns(UserWarning, match=f"stage {stage} sums the local gradient over them"):
        step = jz.make_train_step(loss_fn, zero, accum_steps=2)
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batches[0])
    hlo = step.jitted.lower(zero.abstract_state(params), x).compile().as_text()
    ops = collective_ops(hlo)
    assert not [op for op in ops if op.kind == "reduce-scatter"]
    entry_ar = [op for op in ops if op.kind == "all-reduce" and op.computation == _entry(hlo)]
    assert sum(op.bytes for op in entry_ar) >= _layer_param_bytes(params, 4)


# slow: make test keeps the per-layer stage 3 memory on the GPU compile
# (tests/test_gpu.py::test_gpu_compiled_step_matches_zero_theory[3_per_layer-bf16])
@pytest.mark.slow
def test_temp_memory_grows_by_checkpoints_not_weights():
    """4 vs 16 scanned layers at fixed width: with per-layer gathering each extra layer adds
    exactly its gradient shard (1/N of its weights) and its activation checkpoint to temp
    memory; gathering the whole model adds at least the layer's full weights and gradient."""
    n, d_model, seq = 8, 128, 6
    temps = {}
    for per_layer in (True, False):
        for layers in (4, 16):
            params, compiled = _compile(layers, per_layer=per_layer, d_model=d_model, n=n)
            temps[per_layer, layers] = compiled.memory_analysis().temp_size_in_bytes
    layer_bytes = _layer_param_bytes(params, 4)
    checkpoint = 1 * seq * d_model * 4  # one sequence per device, f32
    grow_per_layer = (temps[True, 16] - temps[True, 4]) / 12
    grow_whole = (temps[False, 16] - temps[False, 4]) / 12
    assert grow_per_layer == pytest.approx(layer_bytes / n + checkpoint, rel=0.05), (
        grow_per_layer,
        layer_bytes,
    )
    assert grow_whole >= 1.5 * layer_bytes, (grow_whole, layer_bytes)


def test_missing_stack_and_missing_gather_are_named():
    params, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer, steps=1)
    mesh = jz.data_parallel_mesh(8)
    with pytest.raises(ValueError, match="no subtree named 'blocks'"):
        jz.ZeRO(optax.sgd(0.1), mesh, stage=3, layers="blocks").init(params)
    with pytest.raises(TypeError, match="layers=3"):
        jz.ZeRO(optax.sgd(0.1), mesh, stage=3, layers=3)
    # A model that never calls gather_layer gets its layer shards: a clear error, not a
    # shape error deep inside the model.
    plain_params, plain_loss, _ = make_problem("scanned", steps=1)
    zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=3, layers="layers")
    step = jz.make_train_step(plain_loss, zero)
    state = step.init(plain_params)
    before = jax.tree.map(np.asarray, jz.gather(state))
    with pytest.raises(ValueError, match="never called jaxzero.gather_layer"):
        step(state, batches[0])
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, jz.gather(state)), before)


def test_gather_layer_is_identity_outside_a_step_and_names_foreign_leaves():
    params, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer, steps=1)
    tree = {"params": {"w": jnp.ones((3, 4))}}
    assert jz.gather_layer(tree) is tree
    # Inside the step, a leaf that is not part of the stack is refused by path.
    import flax.linen as nn

    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.ones, (x.shape[-1], 3))
            layers = self.param("layers", nn.initializers.ones, (2, 5))
            jz.gather_layer({"params": {"odd": w}})
            return x @ w + layers.sum()

    model = Bad()
    p = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=3, layers="layers")
    step = jz.make_train_step(lambda q, b: model.apply({"params": q}, b["x"]).mean(), zero)
    with pytest.raises(ValueError, match=r"\['odd'\].*not a layer"):
        step(step.init(p), {"x": np.ones((8, 4), np.float32)})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stack_split_dimension_per_stage(stage):
    """The sharding rule written out: a leaf splits on its largest dimension divisible by N; a
    named stack never on its layer axis, and where layers are gathered one at a time (stage 3)
    on its first divisible other dimension, so each layer's shard is one contiguous block."""
    abstract = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    params = {
        "layers": {"u": abstract(4, 16, 64), "w": abstract(16, 8), "odd": abstract(4, 3, 24)},
        "head": abstract(24, 16),
    }
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=stage, layers="layers")
    specs = zero.shard_specs(params)
    u = P(None, "data") if stage == 3 else P(None, None, "data")
    assert specs["layers"] == {"u": u, "w": P(None, "data"), "odd": P(None, None, "data")}
    assert specs["head"] == P("data")
    assert zero.ema_leaf_specs(params) == specs


# slow: stages 1 and 2 on the hybrid mesh (stage 0 stays)
@pytest.mark.parametrize(
    "stage", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_per_layer_on_a_hybrid_mesh_matches_single_device(stage):
    """A mesh with a replica axis (2 x 4): stage 0 reduces each layer in the backward (its
    stacks enter the loss invariant over every axis); stages 1/2 fall back to the whole
    reduction after the backward (the per-layer reduce-scatter's tile is replica-invariant, a
    cotangent of a loss leaf varying over the replica axis cannot be; they failed to trace
    before). Numbers: single-device optax."""
    params, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer, steps=2)
    tx = CHAINS["clip_adamw"]()
    ref_params, _, atol = tolerance.reference(tx, params, loss_fn, batches)
    mesh = jz.data_parallel_mesh(8, replicas=2)
    state = train(jz.ZeRO(tx, mesh, stage=stage, layers="layers"), loss_fn, params, batches)
    chex.assert_trees_all_close(jz.gather(state), ref_params, atol=atol)
