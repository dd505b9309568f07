"""Golden tests of torch's parameter-to-rank partitions (jaxzero.interop.torch.partition,
jaxzero.greedy_partition) against real PyTorch fixtures, plus properties and bad input."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from jaxzero import greedy_partition
from jaxzero.interop.torch.partition import (
    ContiguousPlan,
    GreedyPlan,
    contiguous_partition,
    pack,
    stacked_sharding,
    unpack,
)

# ---------------------------------------------------------------------------------------------
# A: torch ZeroRedundancyOptimizer partitions


def _a_files(fixtures_dir):
    files = sorted(glob.glob(os.path.join(fixtures_dir, "A_zero_partition", "*.json")))
    assert files, "no A_zero_partition/*.json fixtures found"
    return files


def _check_a_file(path):
    with open(path) as f:
        fx = json.load(f)
    params = fx["params"]
    ws = fx["world_size"]
    assert [p["global_index"] for p in params] == list(range(len(params)))
    names = [p["name"] for p in params]
    plan = greedy_partition(
        [p["numel"] for p in params], ws, groups=[p["param_group"] for p in params]
    )
    assert isinstance(plan, GreedyPlan) and plan.world_size == ws

    # owners
    assert list(plan.owner) == [p["owner_rank"] for p in params]
    # per-rank, per-group ordered name lists (one entry per group, even when empty)
    got = [
        [{"param_group": g, "params": [names[i] for i in grp]} for g, grp in enumerate(rank)]
        for rank in plan.per_rank
    ]
    assert got == fx["partition_per_rank"]
    assert list(plan.rank_numel) == fx["rank_numel"]
    # bucket view: offsets, sizes and the dummy bucket of empty ranks
    assert len(fx["bucket_view"]) == ws
    for bv in fx["bucket_view"]:
        r = bv["rank"]
        assert plan.bucket_numel[r] == bv["bucket_numel"]
        assert (plan.rank_numel[r] == 0) == bv["dummy_bucket"]
        got_entries = [
            {"name": names[i], "offset": start, "numel": real}
            for i, start, _end, real in plan.bucket_entries(r)
        ]
        assert got_entries == bv["entries"]
        for e in bv["entries"]:
            assert plan.offsets[names.index(e["name"])] == e["offset"]


def test_zero_partition_fixtures(fixtures_dir):
    """Every A_zero_partition json is rebuilt from (numel, param_group) and world_size alone."""
    for path in _a_files(fixtures_dir):
        try:
            _check_a_file(path)
        except AssertionError as err:
            raise AssertionError(f"mismatch for {os.path.basename(path)}") from err


def test_zero_empty_ranks_get_dummy_bucket(fixtures_dir):
    # README A: in mlp_ws8, ranks 4-7 are empty and get a dummy bucket torch.zeros(1).
    with open(os.path.join(fixtures_dir, "A_zero_partition", "mlp_ws4.json")) as f:
        numels = [p["numel"] for p in json.load(f)["params"]]
    plan = greedy_partition(numels, 8)
    assert plan.rank_numel[4:] == (0, 0, 0, 0)
    assert plan.bucket_numel[4:] == (1, 1, 1, 1)
    assert all(group == () for rank in plan.per_rank[4:] for group in rank)


def test_groups_share_running_totals():
    # README A: totals carry over across groups, the sort is within each group only.
    plan = greedy_partition([1, 10, 5, 7], 2, groups=[1, 0, 1, 0])
    # group 0 by size: idx1 (10) -> r0, idx3 (7) -> r1; then group 1: idx2 (5) -> r1 (7 < 10),
    # idx0 (1) -> r0 (10 < 12)
    assert plan.per_rank == (((1,), (0,)), ((3,), (2,)))
    assert plan.owner == (0, 0, 1, 1)
    assert plan.rank_numel == (11, 12)
    # an id with no tensors is still an (empty) group
    assert greedy_partition([3], 2, groups=[1]).per_rank == (((), (0,)), ((), ()))


# ---------------------------------------------------------------------------------------------
# C: distributed ModelEMA partitions and 8-byte-aligned buckets


def _c_manifests(fixtures_dir):
    files = sorted(glob.glob(os.path.join(fixtures_dir, "C_dist_modelema", "*", "manifest.json")))
    assert files, "no C_dist_modelema/*/manifest.json fixtures found"
    return files


def _check_c_manifest(path):
    with open(path) as f:
        man = json.load(f)
    traj = np.load(os.path.join(os.path.dirname(path), "..", f"{man['model']}_trajectory.npz"))
    ws = man["world_size"]
    assert man["configs"]
    for cfg_name, cfg in man["configs"].items():
        keys = cfg["ema_keys_order"]
        step0 = [traj[f"step0/{k}"] for k in keys]
        itemsizes = {a.dtype.itemsize for a in step0}
        assert len(itemsizes) == 1, cfg_name
        plan = greedy_partition(
            [a.size for a in step0],
            ws,
            sort=False,
            itemsize=itemsizes.pop(),
            align_bytes=8,
        )
        assert [[keys[i] for i in plan.rank_order(r)] for r in range(ws)] == cfg["partition"]
        assert list(plan.rank_numel) == cfg["partition_numel"]
        assert len(cfg["per_rank"]) == ws
        for pr in cfg["per_rank"]:
            r = pr["rank"]
            assert [keys[i] for i in plan.rank_order(r)] == pr["owned_keys"]
            if not man["parameters_as_bucket_view"]:
                assert pr["bucket_info"] == {} and pr["bucket_numel"] is None
                continue
            got_info = {
                keys[i]: {"offset_start": a, "offset_end": b, "real_size": n}
                for i, a, b, n in plan.bucket_entries(r)
            }
            assert got_info == pr["bucket_info"]
            assert list(got_info) == list(pr["bucket_info"])  # partition order
            # torch makes no bucket (None) for a rank that owns nothing; the plan says 0
            assert plan.bucket_numel[r] == (pr["bucket_numel"] or 0)


def test_dist_modelema_fixtures(fixtures_dir):
    for path in _c_manifests(fixtures_dir):
        try:
            _check_c_manifest(path)
        except AssertionError as err:
            raise AssertionError(f"mismatch for {os.path.relpath(path, fixtures_dir)}") from err


def test_dist_modelema_cnn_readme_totals():
    # README C: cnn state_dict float entries, unsorted greedy -> ws2 [324, 854], ws4
    # [189, 58, 105, 826]. Shapes from README section 0 (BN buffers follow each BN's bias).
    bn1, bn2 = [7] * 4, [13] * 4
    numels = [7 * 3 * 3 * 3, 7, *bn1, 13 * 7 * 3 * 3, 13, *bn2, 5 * 13, 5]
    assert greedy_partition(numels, 2, sort=False).rank_numel == (324, 854)
    assert greedy_partition(numels, 4, sort=False).rank_numel == (189, 58, 105, 826)


@pytest.mark.parametrize("itemsize,grid", [(4, 2), (2, 4), (8, 1)])
def test_alignment_grid(itemsize, grid):
    plan = greedy_partition([3, 5, 1], 1, sort=False, itemsize=itemsize, align_bytes=8)
    slots = [-(-n // grid) * grid for n in (3, 5, 1)]
    assert plan.offsets == (0, slots[0], slots[0] + slots[1])
    assert plan.bucket_numel == (sum(slots),)
    assert plan.rank_numel == (9,)


def test_aligned_empty_rank_has_no_bucket():
    plan = greedy_partition([4], 3, sort=False, align_bytes=8)
    assert plan.bucket_numel == (4, 0, 0)
    assert greedy_partition([4], 3, sort=False, align_bytes=8, empty_bucket_numel=1).bucket_numel[
        1:
    ] == (1, 1)


# ---------------------------------------------------------------------------------------------
# properties

numel_lists = st.lists(st.integers(0, 50), min_size=0, max_size=12)


@st.composite
def greedy_cases(draw):
    numels = draw(numel_lists)
    ws = draw(st.integers(1, 6))
    groups = draw(st.lists(st.integers(0, 2), min_size=len(numels), max_size=len(numels)))
    sort = draw(st.booleans())
    itemsize = draw(st.sampled_from([2, 4, 8]))
    align = draw(st.sampled_from([None, 8]))
    return numels, ws, groups, sort, itemsize, align


@settings(max_examples=200, deadline=None)
@given(greedy_cases())
def test_greedy_properties(case):
    numels, ws, groups, sort, itemsize, align = case
    plan = greedy_partition(
        numels, ws, groups=groups, sort=sort, itemsize=itemsize, align_bytes=align
    )
    n = len(numels)
    flat = [i for r in range(ws) for i in plan.rank_order(r)]
    assert sorted(flat) == list(range(n))  # every tensor exactly once
    for r in range(ws):
        for g, grp in enumerate(plan.per_rank[r]):
            assert all(plan.owner[i] == r and groups[i] == g for i in grp)
    assert plan.rank_numel == tuple(sum(numels[i] for i in plan.rank_order(r)) for r in range(ws))
    assert sum(plan.rank_numel) == sum(numels)
    grid = 1 if align is None else 8 // itemsize
    for r in range(ws):
        end = 0
        for i, start, slot_end, real in plan.bucket_entries(r):
            assert start == end and real == numels[i]
            assert slot_end - start == -(-real // grid) * grid
            end = slot_end
        empty = 1 if align is None else 0
        assert plan.bucket_numel[r] == (end if plan.rank_order(r) else empty)
    # greedy rule, replayed independently: each placement went to the lowest least-loaded rank
    sizes = [0] * ws
    for g in sorted(set(groups)):
        order = [i for i in range(n) if groups[i] == g]
        if sort:
            order = sorted(order, key=lambda i: -numels[i])
        for i in order:
            assert plan.owner[i] == sizes.index(min(sizes))
            sizes[plan.owner[i]] += numels[i]


@st.composite
def shapes_lists(draw):
    return draw(
        st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple), max_size=8)
    )


def _arrays(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) + 1.0 for s in shapes]


@settings(max_examples=100, deadline=None)
@given(shapes_lists(), st.integers(1, 5), st.sampled_from([None, 8]), st.booleans())
def test_pack_unpack_roundtrip_numpy(shapes, ws, align, use_contiguous):
    arrays = _arrays(shapes)
    numels = [a.size for a in arrays]
    if use_contiguous:
        plan = contiguous_partition(numels, ws, align=align or 1)
        width = plan.shard_size
    else:
        plan = greedy_partition(numels, ws, sort=align is None, align_bytes=align)
        width = plan.max_bucket_numel
    stacked = pack(plan, arrays)
    assert isinstance(stacked, np.ndarray) and stacked.shape == (ws, width)
    assert stacked.dtype == np.float32
    # everything outside the tensors' own ranges is zero padding
    pad = np.ones(stacked.shape, bool)
    if use_contiguous:
        pad.reshape(-1)[: plan.total_numel] = False
    else:
        for i, n in enumerate(numels):
            pad[plan.owner[i], plan.offsets[i] : plan.offsets[i] + n] = False
    assert not stacked[pad].any()
    back = unpack(plan, stacked, shapes)
    assert len(back) == len(arrays)
    for a, b in zip(arrays, back, strict=True):
        assert b.shape == a.shape
        np.testing.assert_array_equal(a, b)


@settings(max_examples=100, deadline=None)
@given(numel_lists, st.integers(1, 8), st.integers(1, 4))
def test_contiguous_properties(numels, ws, align):
    plan = contiguous_partition(numels, ws, align=align)
    assert isinstance(plan, ContiguousPlan)
    assert plan.total_numel == sum(numels)
    assert plan.total_padded == plan.shard_size * ws
    assert plan.shard_size % align == 0
    assert plan.total_numel <= plan.total_padded < plan.total_numel + ws * align
    end = 0
    for (a, b), n in zip(plan.ranges, numels, strict=True):
        assert a == end and b - a == n
        end = b
    assert end == plan.total_numel
    for i, (a, b) in enumerate(plan.ranges):
        shard = plan.shard_size
        covered = [r for r in range(ws) if a < b and a < (r + 1) * shard and b > r * shard]
        assert list(plan.ranks_of(i)) == covered


def test_contiguous_example():
    plan = contiguous_partition([5, 3, 4], 3, align=2)
    assert plan.ranges == ((0, 5), (5, 8), (8, 12))
    assert (plan.total_padded, plan.shard_size) == (12, 4)
    assert plan.ranks_of(0) == (0, 1)
    plan = contiguous_partition([5, 3, 4], 4, align=2)
    assert (plan.total_padded, plan.shard_size) == (16, 4)


@pytest.mark.parametrize("kind", ["greedy", "aligned", "contiguous"])
def test_pack_unpack_jax_jit_and_sharding(kind):
    shapes = [(31, 17), (31,), (5, 31), (5,), (), (0, 3)]
    arrays = [jnp.asarray(a) for a in _arrays(shapes, seed=1)]
    numels = [int(np.prod(s)) for s in shapes]
    ws = 8
    plan = {
        "greedy": lambda: greedy_partition(numels, ws),
        "aligned": lambda: greedy_partition(numels, ws, sort=False, align_bytes=8),
        "contiguous": lambda: contiguous_partition(numels, ws, align=2),
    }[kind]()
    stacked = jax.jit(lambda xs: pack(plan, xs))(arrays)
    assert isinstance(stacked, jax.Array)
    np.testing.assert_array_equal(np.asarray(stacked), pack(plan, [np.asarray(a) for a in arrays]))
    mesh = Mesh(np.array(jax.devices()[:ws]), ("data",))
    sharded = jax.device_put(stacked, stacked_sharding(mesh))
    assert sharded.sharding.spec == jax.sharding.PartitionSpec("data", None)
    assert {s.data.shape for s in sharded.addressable_shards} == {(1, stacked.shape[1])}
    back = jax.jit(lambda s: unpack(plan, s, shapes))(sharded)
    for a, b in zip(arrays, back, strict=True):
        assert b.shape == a.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pack_mixed_numpy_jax_gives_jax():
    plan = greedy_partition([2, 3], 2)
    out = pack(plan, [np.ones(2, np.float32), jnp.zeros(3, jnp.float32)])
    assert isinstance(out, jax.Array)


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"numels": [1], "world_size": 0}, ValueError, "world_size must be >= 1, got 0"),
        ({"numels": [1], "world_size": 2.0}, TypeError, "world_size must be an int"),
        ({"numels": [1], "world_size": True}, TypeError, "world_size must be an int"),
        ({"numels": [1, -3], "world_size": 2}, ValueError, r"numels\[1\] must be >= 0, got -3"),
        ({"numels": [1, 2.5], "world_size": 2}, TypeError, r"numels\[1\] must be an int"),
        ({"numels": 7, "world_size": 2}, TypeError, "numels must be a sequence of ints"),
        ({"numels": [1, 2], "world_size": 2, "groups": [0]}, ValueError, "groups has 1 entries"),
        ({"numels": [1], "world_size": 2, "groups": [-1]}, ValueError, r"groups\[0\] must be >= 0"),
        (
            {"numels": [1], "world_size": 2, "itemsize": 16, "align_bytes": 8},
            ValueError,
            "align_bytes=8 is not a multiple of itemsize=16",
        ),
        (
            {"numels": [1], "world_size": 2, "align_bytes": 0},
            ValueError,
            "align_bytes must be >= 1",
        ),
    ],
)
def test_greedy_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        greedy_partition(**kwargs)


def test_contiguous_bad_input():
    with pytest.raises(ValueError, match="align must be >= 1, got 0"):
        contiguous_partition([1], 2, align=0)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        contiguous_partition([1], -1)
    with pytest.raises(ValueError, match=r"numels\[0\] must be >= 0"):
        contiguous_partition([-1], 2)


def test_pack_unpack_bad_input():
    plan = greedy_partition([2, 3], 2)
    with pytest.raises(ValueError, match="plan has 2 tensors but 1 arrays"):
        pack(plan, [np.zeros(2)])
    with pytest.raises(ValueError, match=r"arrays\[1\] has 4 elements but the plan expects 3"):
        pack(plan, [np.zeros(2), np.zeros(4)])
    with pytest.raises(TypeError, match="plan must be a GreedyPlan or ContiguousPlan"):
        pack({"owner": (0,)}, [np.zeros(2)])
    stacked = pack(plan, [np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match=r"shapes\[1\]=\(2, 2\) has 4 elements"):
        unpack(plan, stacked, [(2,), (2, 2)])
    with pytest.raises(ValueError, match="stacked has shape"):
        unpack(plan, stacked[:, :2], [(2,), (3,)])
    with pytest.raises(ValueError, match="plan has 2 tensors but 1 shapes"):
        unpack(plan, stacked, [(2,)])


def test_stacked_sharding_bad_axis():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    with pytest.raises(ValueError, match="axis 'data' is not a mesh axis"):
        stacked_sharding(mesh)
    assert stacked_sharding(mesh, "x").spec == jax.sharding.PartitionSpec("x", None)


def test_plans_are_frozen():
    plan = greedy_partition([1], 1)
    with pytest.raises(AttributeError):
        plan.owner = (1,)
    with pytest.raises(AttributeError):
        contiguous_partition([1], 1).shard_size = 3
