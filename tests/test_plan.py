"""The per-leaf plan (``ZeRO.plan``): every configuration the suite builds, leaf by leaf,
against what the step's own masks, the wire report and a placed state say (the shardings and
memory kinds of the arrays ``ZeRO.init`` makes, their bytes from ``addressable_shards``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.trees import path_strs
from jaxzero.zero.layers import vocab

N = 8


def _params(kind):
    """Leaves named like the models each feature acts on, shapes chosen so some split and
    some do not (a 5-wide head bias replicates)."""
    z = lambda *s: jnp.zeros(s, jnp.float32)
    common = {"head": {"kernel": z(32, 5), "bias": z(5)}, "norm": {"scale": z(32)}}
    if kind == "stack":
        return {
            "layers": {"w": z(2, 32, 64), "b": z(2, 64)},
            "embed": {"table": z(128, 32)},
            **common,
        }
    if kind == "blocks":
        blocks = {f"block_{i}": {"kernel": z(32, 32), "bias": z(32)} for i in range(2)}
        return {**blocks, "embed": {"table": z(128, 32)}, **common}
    return {"dense": {"kernel": z(16, 32), "bias": z(32)}, **common}


CONFIGS = {
    # name: (params kind, ZeRO kwargs, accum_steps, EMA)
    **{f"stage{s}": ("plain", {"stage": s}, 1, None) for s in range(4)},
    "stage2_accum": ("plain", {"stage": 2}, 2, jz.ShardedEMA(0.9)),
    **{f"stage{s}_layers": ("stack", {"stage": s, "layers": "layers"}, 1, None) for s in range(4)},
    "stage0_layers_accum": ("stack", {"stage": 0, "layers": "layers"}, 2, None),
    "stage1_layers_accum": ("stack", {"stage": 1, "layers": "layers"}, 2, None),
    "stage3_layers_vocab": (
        "stack",
        {"stage": 3, "layers": "layers", "vocab_parallel": "embed"},
        1,
        None,
    ),
    "stage3_units": ("blocks", {"stage": 3, "units": r"block_\d+"}, 1, None),
    "stage3_units_no_prefetch": (
        "blocks",
        {"stage": 3, "units": r"block_\d+", "prefetch": False},
        1,
        None,
    ),
    "stage3_units_vocab": (
        "blocks",
        {"stage": 3, "units": r"block_\d+", "vocab_parallel": "embed"},
        1,
        None,
    ),
    **{
        f"stage{s}_offload": ("plain", {"stage": s, "offload": "optimizer"}, 1, jz.ShardedEMA(0.9))
        for s in (1, 2, 3)
    },
    "stage2_offload_fraction": (
        "plain",
        {"stage": 2, "offload": "optimizer", "offload_fraction": 0.5},
        1,
        None,
    ),
    "stage3_params_offload_accum": (
        "stack",
        {
            "stage": 3,
            "layers": "layers",
            "offload": ("optimizer", "params"),
            "precision": "bf16",
        },
        2,
        None,
    ),
    "stage3_bf16_ema_rows": (
        "plain",
        {"stage": 3, "precision": "bf16"},
        1,
        jz.ShardedEMA(0.9, bucket_leaves_up_to=4096),
    ),
    "stage3_quantized": (
        "stack",
        {"stage": 3, "layers": "layers", "precision": "bf16", "quantize": "both"},
        1,
        None,
    ),
    "stage3_hpz": (
        "stack",
        {"stage": 3, "layers": "layers", "precision": "bf16", "hpz_partition_size": 2},
        1,
        None,
    ),
}


def _zero(kw):
    return jz.ZeRO(optax.adamw(1e-3), jz.data_parallel_mesh(N), **kw)


def _flat(tree):
    return ["/".join(path_strs(p)) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _mask(mask, params):
    return dict(zip(_flat(params), jax.tree.leaves(mask), strict=True)) if mask else {}


def _device0_bytes(tree) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        shard = next(s for s in x.addressable_shards if s.device == jax.devices()[0])
        total += shard.data.nbytes
    return total


def _old_masks(zero, params, accum):
    """(stacked, tables, whole) by path: each feature's own mask, combined as the gradient
    path combined them before the plan."""
    from jaxzero.zero.layers import plan as layers
    from jaxzero.zero.specs import subtree_mask
    from jaxzero.zero.units import patterns

    if zero.units:
        stacked = patterns.mask(params, zero.units, zero.prefetch)
    else:
        stacked = subtree_mask(params, zero.layers) if zero.stage == 3 else None
    p, replicas = zero.precision, zero.replica_axes
    invariant = (
        zero.stage == 0 and accum == 1 and layers.reduces_in_backward(0, zero.layers, p, replicas)
    )
    whole = subtree_mask(params, zero.layers) if invariant else None
    return (
        _mask(stacked, params),
        _mask(vocab.mask(zero.vocab_parallel, params), params),
        _mask(whole, params),
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_plan_agrees_with_the_step_and_the_placed_state(name):
    kind, kw, accum, ema = CONFIGS[name]
    params = _params(kind)
    zero = _zero(kw)
    plan = zero.plan(jax.eval_shape(lambda: params), accum_steps=accum, ema=ema)
    assert [r.path for r in plan.rows] == _flat(params)
    # the loss gets as shards exactly the leaves the plan gathers a layer or a unit at a time:
    # the expectations composed from the features' own masks, as the step did before it read
    # the plan (units' leaves, all of them with prefetch; the stage-3 stacks; the tables)
    stacked, tables, whole = _old_masks(zero, params, accum)
    for row in plan.rows:
        shards = stacked.get(row.path, False) and not tables.get(row.path, False)
        assert (row.gather == "per_layer" or row.gather.startswith("unit:")) == shards, row
        assert (row.gather == "vocab_rows") == tables.get(row.path, False), row
        assert (row.gather == "invariant") == (whole.get(row.path, False) and accum == 1), row
        assert (row.reduce == "complete") == (row.gather == "vocab_rows"), row
        if zero.stage < 3:
            assert row.gather in ("none", "invariant"), row
    # the wire report names the same leaves
    report = zero.quantized_leaves(params)
    for row in plan.rows:
        gathered = row.path in report.gathered and row.gather not in ("vocab_rows",)
        assert row.wire.split("/")[0].startswith("int8") == gathered, (row, report)
    # what init places: specs, memory kinds and bytes on device 0
    state = zero.init(params, ema=ema)
    placed = dict(zip(_flat(params), jax.tree.leaves(state.params), strict=True))
    for row in plan.rows:
        x = placed[row.path]
        assert x.sharding.spec == row.param_spec or (
            x.sharding.spec in (P(), P(None)) and row.param_spec == P()
        ), (row.path, x.sharding.spec, row.param_spec)
        kind_ = x.sharding.memory_kind or "device"
        assert (kind_ == "pinned_host") == (row.params_memory == "pinned_host"), row
    totals = plan.totals()
    assert totals["params"] == _device0_bytes(state.params)
    assert totals["master"] == (_device0_bytes(state.master) if state.master is not None else 0)
    assert totals["opt_state"] == _device0_bytes(state.opt_state)
    if ema is not None:
        assert totals["ema"] == _device0_bytes(state.ema)
        stored = state.ema.ema
        layout = stored.layout.rows if isinstance(stored, jz.BucketedTree) else [None] * 99
        for row, r in zip(plan.rows, layout, strict=False):
            assert row.ema == ("per_leaf" if r is None else "rows"), (row, r)
    host = [
        x
        for x in jax.tree.leaves((state.master, state.opt_state, state.ema))
        if (x.sharding.memory_kind or "device") == "pinned_host"
    ]
    state_on_host = sum(r.host_state_bytes for r in plan.rows) + sum(
        o.bytes for o in plan.other if o.memory == "pinned_host"
    )
    assert state_on_host == _device0_bytes(host)
    if not zero.offload:
        assert {r.memory for r in plan.rows} == {"device"}
    # the printed table names every leaf once, with its bytes and where they live
    text, wide = str(plan), plan.table(wide=True)
    assert all(text.count(f"\n{r.path} ") == 1 for r in plan.rows), text
    assert "per device:" in text and "on the device" in " ".join(text.split())
    for row in plan.rows:  # every decision on the leaf's own line when wide
        (line,) = [x for x in wide.splitlines() if x.startswith(row.path + " ")]
        assert row.gather in line and row.memory in line and row.wire in line, line


def test_the_columns_each_feature_decides():
    """The decisions spelled out for one layout of each feature (independent of the masks)."""
    stack = _params("stack")
    plan = _zero({"stage": 3, "layers": "layers", "vocab_parallel": "embed"}).plan(stack)
    assert plan["layers/w"].gather == "per_layer" and plan["layers/w"].reduce == "in_backward"
    assert plan["layers/w"].param_spec == P(None, "data")  # contiguous: first non-layer dim
    assert plan["embed/table"].gather == "vocab_rows" and plan["embed/table"].reduce == "complete"
    assert plan["head/bias"].gather == "whole" and plan["head/bias"].reduce == "all_reduce"
    assert plan["head/kernel"].reduce == "reduce_scatter"
    s1 = _zero({"stage": 1, "layers": "layers"})
    assert s1.plan(stack)["head/kernel"].reduce == "reduce_scatter"  # stage 1 reduces as 2
    assert s1.plan(stack, accum_steps=2)["head/kernel"].reduce == "all_reduce"
    assert s1.plan(stack, accum_steps=2)["layers/w"].reduce == "all_reduce"
    s0 = _zero({"stage": 0, "layers": "layers"}).plan(stack)
    assert s0["layers/w"].gather == "invariant" and s0["layers/w"].reduce == "in_backward"
    blocks = _params("blocks")
    units = _zero({"stage": 3, "units": r"block_\d+", "vocab_parallel": "embed"}).plan(blocks)
    assert units["block_1/kernel"].gather == "unit:block_1"
    assert units["head/kernel"].gather == "unit:(outside the units)"  # prefetch gathers it
    assert units["embed/table"].gather == "vocab_rows"
    bytes_ = units["block_0/kernel"].bytes
    assert bytes_["params"] == 32 * 32 * 4 // N and bytes_["opt_state"] == 2 * 32 * 32 * 4 // N
    fraction = _zero({"stage": 2, "offload": "optimizer", "offload_fraction": 0.5})
    memory = fraction.plan(_params("plain")).column("memory")
    assert "pinned_host" in memory.values() and "device" in memory.values(), memory


def test_two_features_that_claim_one_leaf_are_refused_in_the_builder():
    from jaxzero.zero import plan as leaf_plan

    rows = [{"path": "embed/table", "gather": "whole"}]
    with pytest.raises(ValueError, match="units= and vocab_parallel= disagree on leaf"):
        leaf_plan._merge(
            rows,
            [
                ("units=", [{"gather": "unit:embed"}]),
                ("vocab_parallel=", [{"gather": "vocab_rows"}]),
            ],
        )
    assert np.asarray(rows[0]["gather"] == "unit:embed")
