"""Tests for jaxzero.memory: ZeRO estimates, HLO collective parsing, measured bytes."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero import memory
from jaxzero.memory import (
    COLLECTIVE_KINDS,
    MemoryEstimate,
    collective_bytes,
    collective_ops,
    device_bytes,
    estimate_memory,
    format_table,
    gpt_param_count,
    max_device_bytes,
    measure,
    parse_bytes,
    replica_group_size,
    replica_groups,
)

GB = 10**9


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


# --------------------------------------------------------------------------- estimates


def test_zero_paper_7_5b_on_64_devices():
    phi, n, k = 7_500_000_000, 64, 12  # Adam, mixed precision: K = 12 (fp32 master + m + v)
    by_hand = [
        (2 + 2 + k) * phi,  # stage 0
        2 * phi + 2 * phi + k * phi // n,  # stage 1
        2 * phi + (2 + k) * phi // n,  # stage 2
        (2 + 2 + k) * phi // n,  # stage 3
    ]
    assert all(phi % n == 0 for _ in by_hand)  # so the integer divisions above are exact
    est = estimate_memory(7.5e9, 64)
    assert [e.stage for e in est] == [0, 1, 2, 3]
    assert [e.total for e in est] == by_hand
    # The paper's Figure 1 figures, rounded to one decimal (GB = 1e9 bytes).
    assert [round(e.total / GB, 1) for e in est] == [120.0, 31.4, 16.6, 1.9]


def test_fields_per_stage_mixed_adam():
    phi, n = 1000, 8
    e0, e1, e2, e3 = estimate_memory(phi, n)
    assert (e0.params, e0.grads, e0.optimizer) == (2 * phi, 2 * phi, 12 * phi)
    assert (e1.params, e1.grads, e1.optimizer) == (2 * phi, 2 * phi, 12 * phi // n)
    assert (e2.params, e2.grads, e2.optimizer) == (2 * phi, 2 * phi // n, 12 * phi // n)
    assert (e3.params, e3.grads, e3.optimizer) == (2 * phi // n, 2 * phi // n, 12 * phi // n)
    for e in (e0, e1, e2, e3):
        assert e.ema == 0 and e.activations == 0
        assert e.total == e.params + e.grads + e.optimizer


@pytest.mark.parametrize(
    "optimizer,precision,p,k",
    [
        ("adam", "bf16", 2, 12),
        ("adam", "fp16", 2, 12),
        ("adam", "fp32", 4, 8),  # no separate master copy in fp32
        ("sgd", "bf16", 2, 8),  # momentum 4 + master 4
        ("sgd", "fp32", 4, 4),
        ("adafactor", "bf16", 2, 4),  # factored moments ~0 + master 4
        ("adafactor", "fp32", 4, 0),
    ],
)
def test_optimizer_and_precision_bytes(optimizer, precision, p, k):
    phi, n = 64_000, 16
    e0, _, _, e3 = estimate_memory(phi, n, optimizer=optimizer, precision=precision)
    assert e0.total == (p + p + k) * phi
    assert e3.total == (p + p + k) * phi // n
    assert e0.optimizer_name == optimizer and e0.precision == precision


@pytest.mark.parametrize(
    "optimizer,precision,k",
    [
        ("adam", "bf16", 8),  # two bf16 moments 2 + 2, fp32 master 4
        ("adam", "fp32", 4),  # the moments alone: the fp32 params are the master
        ("sgd", "bf16", 6),  # momentum 2 + master 4
    ],
)
def test_state_dtype_stores_the_optimizer_state_in_two_bytes(optimizer, precision, k):
    """``state_dtype="bf16"`` (``jz.with_state_dtype``): 2 bytes per optimizer-state value;
    the master and the EMA keep 4, and offloaded the host holds the narrower state."""
    phi, n = 64_000, 16
    p = 4 if precision == "fp32" else 2
    e = estimate_memory(
        phi, n, stage=3, optimizer=optimizer, precision=precision, state_dtype="bf16", ema=True
    )
    assert e.optimizer == k * phi // n and e.ema == 4 * phi // n
    assert e.total == (p + p + k + 4) * phi // n
    host = estimate_memory(phi, n, stage=2, state_dtype="bf16", offload="optimizer")
    assert host.host == 8 * phi // n and host.optimizer == 0
    with pytest.raises(ValueError, match="state_dtype='fp32'.*bf16, fp16"):
        estimate_memory(phi, n, state_dtype="fp32")


def test_ema_is_sharded_at_every_stage():
    phi, n = 8000, 8
    for e in estimate_memory(phi, n, ema=True):
        assert e.ema == 4 * phi // n
        assert e.total == e.params + e.grads + e.optimizer + 4 * phi // n


def test_stage3_without_compute_copy_drops_the_16_bit_params():
    """FSDP's layout (``Precision(compute_copy=False)``): the mixed-precision stage-3 state is
    the fp32 master + Adam's moments (12 bytes) and the sharded bf16 gradient (2 bytes) per
    element of the shard; the other stages, and fp32, are unchanged."""
    phi, n = 1001, 8
    shard = 126  # ceil(1001 / 8)
    e3 = estimate_memory(phi, n, stage=3, compute_copy=False)
    assert (e3.params, e3.grads, e3.optimizer) == (0, 2 * shard, 12 * shard)
    both = estimate_memory(phi, n, compute_copy=False)
    assert both[:3] == estimate_memory(phi, n)[:3] and both[3] == e3
    fp32 = estimate_memory(phi, n, stage=3, precision="fp32", compute_copy=False)
    assert fp32 == estimate_memory(phi, n, stage=3, precision="fp32")
    with pytest.raises(ValueError, match=r"compute_copy=False is stage 3's layout \(got stage=2\)"):
        estimate_memory(phi, n, stage=2, compute_copy=False)
    # parameter offload needs the 16-bit copy apart from the master, as ZeRO says
    with pytest.raises(
        ValueError, match=r"compute_copy=False with offload=\('optimizer', 'params'\)"
    ):
        estimate_memory(phi, n, stage=3, compute_copy=False, offload=("optimizer", "params"))
    with pytest.raises(TypeError, match=r"compute_copy must be a bool, got 'no'"):
        estimate_memory(phi, n, stage=3, compute_copy="no")


def test_uneven_shard_rounds_up():
    phi, n = 1001, 8  # padded flat shard: ceil(1001 / 8) = 126 elements per device
    e = estimate_memory(phi, n, stage=3, ema=True)
    assert (e.params, e.grads, e.optimizer, e.ema) == (2 * 126, 2 * 126, 12 * 126, 4 * 126)


def test_single_stage_returns_one_estimate():
    e = estimate_memory(10**6, 4, stage=2)
    assert isinstance(e, MemoryEstimate) and e.stage == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.total = 0


def test_activations_formula():
    b, s, h, nl, a = 4, 1024, 2048, 24, 16
    for ci in (1, 2, 5):
        ckpt = 2 * b * s * h * math.ceil(nl / ci)
        work = b * s * ci * (16 * h + 2 * a * s)
        ests = estimate_memory(1e9, 8, batch=b, seq=s, hidden=h, layers=nl, heads=a, ckpt_every=ci)
        assert {e.activations for e in ests} == {ckpt + work}  # independent of the stage
        assert all(e.total == e.params + e.grads + e.optimizer + ckpt + work for e in ests)


def test_logits_fp32_activations_and_stage3_gathered_working_set():
    b, s, h, nl, a, v = 1, 2048, 4096, 32, 32, 32000
    shape = dict(batch=b, seq=s, hidden=h, layers=nl, heads=a)
    ckpt16 = 2 * b * s * h * nl
    work16 = b * s * (16 * h + 2 * a * s)
    logits = 3 * 4 * b * s * v  # f32 logits, their softmax and their gradient
    e16 = estimate_memory(7e9, 64, stage=3, vocab=v, **shape)
    assert e16.activations == ckpt16 + work16 + logits
    e32 = estimate_memory(7e9, 64, stage=3, precision="fp32", **shape)
    assert e32.activations == 2 * (ckpt16 + work16)  # 4-byte activations
    layer = 12 * h * h
    rest = 7_000_000_000 - nl * layer  # embeddings and head: outside the layer stack
    for prec, pb in (("bf16", 2), ("fp32", 4)):
        ests = estimate_memory(7e9, 64, precision=prec, layer_params=layer, **shape)
        # one layer whole with its full gradient, plus the full gradients outside the stack
        assert [e.gathered for e in ests] == [0, 0, 0, 2 * pb * layer + pb * rest]
        plain = estimate_memory(7e9, 64, precision=prec, **shape)
        assert ests[3].total == plain[3].total + 2 * pb * layer + pb * rest
    assert "gathered" in format_table(ests) and "gathered" not in format_table(plain)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((1e9, 8), {"layer_params": 1e6}, ValueError, "needs layers"),
        (
            (1e9, 8),
            dict(batch=1, seq=8, hidden=8, layers=2, heads=1, layer_params=6e8),
            ValueError,
            "exceeds num_params",
        ),
        ((1e9, 8), {"vocab": 1000}, ValueError, "batch, seq, hidden and layers"),
        ((-5, 8), {}, ValueError, "num_params"),
        ((0, 8), {}, ValueError, "num_params"),
        ((1e9, 0), {}, ValueError, "world_size"),
        (("7e9", 8), {}, TypeError, "num_params"),
        ((1.5, 8), {}, ValueError, "whole number"),
        ((1e9, 8), {"optimizer": "lamb"}, ValueError, "adam, sgd, adafactor"),
        ((1e9, 8), {"precision": "int8"}, ValueError, "bf16, fp16, fp32"),
        ((1e9, 8), {"stage": 4}, ValueError, "stage"),
        ((1e9, 8), {"batch": 2, "seq": 128}, ValueError, "missing hidden, layers, heads"),
        ((1e9, 8), {"heads": 8}, ValueError, "batch, seq, hidden and layers"),
        (
            (1e9, 8),
            dict(batch=1, seq=8, hidden=8, layers=2, heads=1, ckpt_every=3),
            ValueError,
            "ckpt_every",
        ),
    ],
)
def test_estimate_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        estimate_memory(*args, **kwargs)


def test_gpt_param_count():
    # GPT-2 small: 12 layers, 768 wide -> 124.3M (the usual "124M").
    assert gpt_param_count(12, 768) == 12 * 12 * 768**2 + (50257 + 1024) * 768 == 124_318_464
    assert gpt_param_count(2, 8, vocab=10, seq=4) == 12 * 2 * 64 + 14 * 8
    with pytest.raises(ValueError, match="layers"):
        gpt_param_count(0, 768)


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80 GiB") == 80 * 2**30
    assert parse_bytes("1.5gb") == 1_500_000_000
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(1234) == 1234
    for bad in ("80", "eighty GB", "80 XB", "-1GB", "0GB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)


def test_format_table_marks_fits():
    ests = estimate_memory(7.5e9, 64)
    table = format_table(ests, gpu_memory="32GB")
    lines = table.splitlines()
    assert "adam" in lines[0] and "64 devices" in lines[0]
    assert lines[1].split() == ["stage", "params", "grads", "optimizer", "total", "fits"]
    rows = {ln.split()[0]: ln for ln in lines[3:7]}
    assert rows["0"].endswith("NO") and "120.00 GB" in rows["0"]
    assert rows["1"].endswith("yes") and "31.41 GB" in rows["1"]
    assert lines[-1] == "fits in 32.00 GB: stage 1, 2, 3"
    assert format_table(ests, gpu_memory=10**9).splitlines()[-1].endswith("no stage")
    plain = format_table(estimate_memory(1e6, 2, stage=1, ema=True))
    assert "fits" not in plain and "ema" in plain.splitlines()[1]
    with pytest.raises(TypeError, match="MemoryEstimate"):
        format_table([1, 2])


# --------------------------------------------------------------------------- collectives


def _hlo(mesh, f, in_specs, out_specs, *args):
    g = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(g).lower(*args).compile().as_text()


def _only(summary, kind):
    others = {k: v["count"] for k, v in summary.items() if k != kind and v["count"]}
    assert not others, f"unexpected collectives {others}"
    return summary[kind]


def test_psum_all_reduce_bytes(mesh):
    x = jnp.ones((64, 32), jnp.float32)  # 8 x 32 per device
    s = collective_bytes(_hlo(mesh, lambda a: jax.lax.psum(a, "data"), P("data"), P(), x))
    ar = _only(s, "all-reduce")
    assert ar["count"] == 1 and ar["bytes"] == 8 * 32 * 4
    op = ar["ops"][0]
    assert op.shape == "f32[8,32]" and op.dtypes == ("f32",) and not op.is_async
    # jax 0.10 prints {{0,...,7}}, jax 0.12 mesh['data'=8] {'data'}: the same one group.
    assert replica_groups(op.replica_groups) == (tuple(range(8)),)
    assert set(s) == set(COLLECTIVE_KINDS)


def test_replica_groups_on_a_two_axis_mesh():
    """Groups read from the compiled HLO (either syntax) match the mesh layout: a psum over
    "data" groups each replica row, a gather over "replica" each column."""
    mesh2 = jax.make_mesh((2, 4), ("replica", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def f(a):
        return jax.lax.psum(a, "data"), jax.lax.all_gather(a, "replica")

    hlo = _hlo(mesh2, f, P(("replica", "data")), (P("replica"), P("data")), jnp.ones((16, 4)))
    s = collective_bytes(hlo)
    (ar,), (ag,) = s["all-reduce"]["ops"], s["all-gather"]["ops"]
    assert replica_groups(ar.replica_groups) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert replica_groups(ag.replica_groups) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert replica_group_size(ar.replica_groups) == 4 and replica_group_size(ag.replica_groups) == 2


# Collective lines as XLA prints them: jax 0.10 on CPU (explicit), XLA:GPU (iota), jax 0.12
# (mesh axes). Expected groups written by hand from each syntax's definition.
GROUP_SYNTAXES = [
    ("{{0,1,2,3},{4,5,6,7}}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("{{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['data'=8] {'data'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("mesh['r'=2,'d'=4] {'d'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['r'=2,'d'=4] {'r'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=2,'b'=2,'c'=2] {'a','c'}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    ("mesh['a'=2,'b'=2,'c'=2] {'b'}", ((0, 2), (1, 3), (4, 6), (5, 7))),
]


@pytest.mark.parametrize("text,groups", GROUP_SYNTAXES)
def test_replica_groups_read_in_every_syntax(text, groups):
    line = (
        f"  %rs = f32[1,4]{{1,0}} reduce-scatter(%p), channel_id=1, replica_groups={text}, "
        "use_global_device_ids=true, dimensions={0}, to_apply=%add"
    )
    (op,) = collective_ops(f"ENTRY %main {{\n{line}\n}}")
    assert op.replica_groups == text
    assert replica_groups(text) == groups
    assert replica_group_size(text) == len(groups[0])


def test_replica_groups_not_stated():
    assert replica_groups(None) is None and replica_group_size(None) is None
    # A mesh form with a device order beyond axes and sizes: the groups are not expanded, the
    # group size still is.
    odd = "mesh['r'=2,'d'=4] device_ids=[7,6,5,4,3,2,1,0] {'d'}"
    assert replica_groups(odd) is None and replica_group_size(odd) == 4


def test_all_gather_bytes(mesh):
    x = jnp.ones((64, 32), jnp.float32)
    f = lambda a: jax.lax.all_gather(a, "data", tiled=True)
    ag = _only(collective_bytes(_hlo(mesh, f, P("data"), P(), x)), "all-gather")
    assert ag["count"] == 1 and ag["bytes"] == 64 * 32 * 4  # the gathered, full array


def test_psum_scatter_bytes(mesh):
    x = jnp.ones((64, 32), jnp.float32)  # replicated in, 8 x 32 shard out
    f = lambda a: jax.lax.psum_scatter(a, "data", tiled=True)
    rs = _only(collective_bytes(_hlo(mesh, f, P(), P("data"), x)), "reduce-scatter")
    assert rs["count"] == 1 and rs["bytes"] == 64 * 32 * 4 // 8


def test_bf16_collectives(mesh):
    # XLA:CPU (jax 0.10.2) promotes bf16 all-reduce, all-gather and reduce-scatter
    # to f32 (convert -> f32 collective -> convert), so the HLO shows f32 and 4
    # bytes per element; GPU/TPU keep bf16 (2 bytes). The parser reports what
    # the HLO says, so accept either dtype but require bytes to match it.
    x = jnp.ones((64, 32), jnp.bfloat16)
    s = collective_bytes(_hlo(mesh, lambda a: jax.lax.psum(a, "data"), P("data"), P(), x))
    (op,) = _only(s, "all-reduce")["ops"]
    assert op.dtypes[0] in ("bf16", "f32")
    assert op.bytes == 8 * 32 * {"bf16": 2, "f32": 4}[op.dtypes[0]]


def test_tuple_all_reduce_sums_outputs(mesh):
    x = jnp.ones((64, 32), jnp.float32)
    f = lambda a: (jax.lax.psum(a, "data"), jax.lax.psum(2 * a[:, :16], "data"))
    ar = _only(collective_bytes(_hlo(mesh, f, P("data"), (P(), P()), x)), "all-reduce")
    assert ar["count"] in (1, 2)  # XLA may combine them into one tuple all-reduce
    assert ar["bytes"] == 8 * 32 * 4 + 8 * 16 * 4
    assert max(ar["ops"], key=lambda o: o.bytes).bytes >= 8 * 32 * 4


def test_all_to_all_and_ppermute(mesh):
    x = jnp.ones((64, 32), jnp.float32)
    f = lambda a: jax.lax.all_to_all(a, "data", 0, 0, tiled=True)
    a2a = _only(collective_bytes(_hlo(mesh, f, P("data"), P("data"), x)), "all-to-all")
    assert a2a["count"] == 1 and a2a["bytes"] == 8 * 32 * 4
    perm = [(i, (i + 1) % 8) for i in range(8)]
    f = lambda a: jax.lax.ppermute(a, "data", perm)
    cp = _only(collective_bytes(_hlo(mesh, f, P("data"), P("data"), x)), "collective-permute")
    assert cp["count"] == 1 and cp["bytes"] == 8 * 32 * 4


def test_collective_in_scan_counted_once(mesh):
    def f(c, xs):
        return jax.lax.scan(lambda c, x: (c + jax.lax.psum(x, "data"), None), c, xs)[0]

    hlo = _hlo(mesh, f, (P(), P(None, "data")), P(), jnp.ones(4), jnp.ones((5, 32)))
    ar = _only(collective_bytes(hlo), "all-reduce")
    assert ar["count"] == 1 and ar["bytes"] == 4 * 4  # static count, not x5 iterations


ASYNC_HLO = """\
HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (p0: bf16[16], p1: f32[4]) -> f32[8] {
  %ars = bf16[16]{0} all-reduce-start(%p0), replica_groups=[1,8]<=[8], to_apply=%add
  %ard = bf16[16]{0} all-reduce-done(%ars)
  %ags = (f32[4]{0}, f32[32]{0}) all-gather-start(%p1), dimensions={0}
  %agd = f32[32]{0} all-gather-done(%ags)
  %cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%p1)
  %cpd = f32[4]{0} collective-permute-done(%cps)
  %rss = ((f32[4]), f32[2]) reduce-scatter-start(%p1), to_apply=%add, dimensions={0}
  %rsd = f32[2] reduce-scatter-done(%rss)
  %ar2 = (pred[10]{0}, s4[5]{0}, f32[]) all-reduce(%a, %b, %c), to_apply=%add
  ROOT %t = (f32[32]) tuple(%agd)
}
"""


def test_async_pairs_counted_once_at_done():
    s = collective_bytes(ASYNC_HLO)
    assert s["all-reduce"]["count"] == 2
    # 16 bf16 + (10 pred + 5 packed s4 -> 3 bytes + f32 scalar)
    assert s["all-reduce"]["bytes"] == 16 * 2 + (10 + 3 + 4)
    assert (s["all-gather"]["count"], s["all-gather"]["bytes"]) == (1, 32 * 4)
    assert (s["collective-permute"]["count"], s["collective-permute"]["bytes"]) == (1, 16)
    assert (s["reduce-scatter"]["count"], s["reduce-scatter"]["bytes"]) == (1, 8)
    ard = s["all-reduce"]["ops"][0]
    assert ard.name == "ard" and ard.is_async and ard.computation == "main"
    assert ard.replica_groups == "[1,8]<=[8]"
    assert [o.name for o in collective_ops(ASYNC_HLO)] == ["ard", "agd", "cpd", "rsd", "ar2"]


def test_collective_parse_errors():
    with pytest.raises(TypeError, match="as_text"):
        collective_bytes(b"bytes")
    with pytest.raises(ValueError, match="zz9"):
        collective_bytes("%x = zz9[4] all-reduce(%y)")
    assert all(v["count"] == 0 for v in collective_bytes("").values())


# --------------------------------------------------------------------------- measured


def test_device_bytes_replicated_and_sharded(mesh):
    rep = jax.device_put(jnp.ones((64, 32), jnp.float32), NamedSharding(mesh, P()))
    shd = jax.device_put(jnp.ones((64, 32), jnp.bfloat16), NamedSharding(mesh, P("data")))
    assert device_bytes(rep) == {d: 64 * 32 * 4 for d in jax.devices()}
    assert device_bytes(shd) == {d: 64 * 32 * 2 // 8 for d in jax.devices()}
    tree = {"a": rep, "b": [shd, None], "c": 3, "d": np.ones(100)}  # host leaves skipped
    per = device_bytes(tree)
    assert list(per) == sorted(jax.devices(), key=lambda d: d.id)
    assert set(per.values()) == {64 * 32 * 4 + 64 * 32 * 2 // 8}
    assert max_device_bytes(tree) == 64 * 32 * 4 + 64 * 32 * 2 // 8
    assert device_bytes({}) == {} and max_device_bytes([1.0]) == 0


def test_device_bytes_partial_replication_and_single_device():
    mesh2 = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.device_put(jnp.zeros((16, 6), jnp.float32), NamedSharding(mesh2, P("a")))
    assert set(device_bytes(x).values()) == {16 * 6 * 4 // 4} and len(device_bytes(x)) == 8
    one = jax.device_put(jnp.zeros(10, jnp.int32), jax.devices()[3])
    assert device_bytes(one) == {jax.devices()[3]: 40}


def test_device_bytes_deleted_array():
    x = jnp.ones(4)
    x.delete()
    with pytest.raises(ValueError, match=r"\['w'\].*deleted"):
        device_bytes({"w": x})


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _State:
    params: jax.Array
    master: jax.Array
    opt_state: dict
    ema: jax.Array | None


class _FakeStep:
    """Stands in for a jaxzero train step: exposes .lower(state, batch)."""

    def __init__(self, mesh):
        def update(state, x):
            def grads(p, xb):
                g = jax.grad(lambda p: jnp.sum((xb @ p.astype(jnp.float32)) ** 2))(p)
                return jax.lax.psum(g, "data")

            g = jax.shard_map(
                grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False
            )(state.params, x)
            master = state.master - 0.1 * g.astype(jnp.float32)
            return dataclasses.replace(state, params=master.astype(jnp.bfloat16), master=master)

        self._jitted = jax.jit(update)

    def lower(self, state, batch):
        return self._jitted.lower(state, batch)


def test_measure_with_fake_step(mesh):
    rep, shd = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    state = _State(
        params=jax.device_put(jnp.ones((16, 4), jnp.bfloat16), rep),  # 128 B / device
        master=jax.device_put(jnp.ones((16, 4), jnp.float32), rep),  # 256 B / device
        opt_state={"mu": jax.device_put(jnp.zeros((64,), jnp.float32), shd)},  # 32 B / device
        ema=None,
    )
    batch = jax.device_put(jnp.ones((32, 16), jnp.float32), shd)  # 256 B / device
    out = measure(_FakeStep(mesh), state, batch)
    assert out["fields"] == {"params": 128, "master": 256, "opt_state": 32}
    assert out["state_bytes"] == 128 + 256 + 32
    assert set(out["state_bytes_per_device"].values()) == {416}
    assert out["argument_bytes"] == 416 + 256  # XLA reports per-device sizes
    assert out["output_bytes"] >= 128 + 256
    assert out["temp_bytes"] is not None and out["alias_bytes"] is not None
    ar = out["collectives"]["all-reduce"]
    assert ar["count"] >= 1 and max(o.bytes for o in ar["ops"]) == 16 * 4 * 4  # f32 grads


def test_measure_dict_state_and_bad_step(mesh):
    state = {"params": jnp.ones(8), "ema": None}
    out = measure(jax.jit(lambda s, b: s["params"] * b), state, jnp.float32(2.0))
    assert out["fields"] == {"params": 32} and out["state_bytes"] == 32
    assert all(v["count"] == 0 for v in out["collectives"].values())
    with pytest.raises(TypeError, match="jax.jit"):
        measure(lambda s, b: s, state, 1.0)


def test_module_exports():
    assert set(memory.__all__) <= set(dir(memory))


@pytest.mark.parametrize(
    "type_text,nbytes",
    [
        ("f32[]", 4),
        ("pred[7]", 7),
        ("s4[5]", 3),  # packed: ceil(5 * 4 / 8)
        ("u2[8]", 2),
        ("f16[3,2]", 12),
        ("s64[2]", 16),
        ("c64[2]", 16),
        ("f8e4m3fn[10]", 10),
        ("f8e4m3b11fnuz[10]", 10),
        ("f4e2m1fn[10]", 5),
        ("(s32[2]{0:T(128)}, /*index=1*/bf16[4,4]{1,0})", 8 + 32),
    ],
)
def test_element_sizes(type_text, nbytes):
    s = collective_bytes(f"  %x.1 = {type_text} all-gather(%y), dimensions={{0}}")
    assert (s["all-gather"]["count"], s["all-gather"]["bytes"]) == (1, nbytes)
