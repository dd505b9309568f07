"""An fp32 master kept as its bf16 compute copy plus a 16-bit remainder and a carry bit
(jaxzero.zero.offload.remainder).

Every expectation is the fp32 bit pattern itself, read through numpy views: the masters are
built from their bits, a rebuilt master must have the same bits, and the bf16 rounding the
cause rests on is checked against round-to-nearest-even written on the integers here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.zero.offload.remainder import (
    Remainder,
    carry_bytes,
    host_bytes_per_param,
    join,
    split,
)

LOS = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
TIE = 0x8000

_split = jax.jit(split)
_join = jax.jit(join)
_cast = jax.jit(lambda x: x.astype(jnp.bfloat16))


def _floats(bits):
    return np.asarray(bits, np.uint32).view(np.float32)


def _bits(x):
    return np.asarray(x).view(np.uint32)


def _bf16_bits(x):
    return np.asarray(x).view(np.uint16).astype(np.uint32)


def _rne_high(bits):
    """The bf16 pattern of finite fp32 ``bits`` rounded to nearest, ties to even, on the
    integers (the largest finite value rounds up to inf)."""
    b = bits.astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32)


def _adversarial():
    """Every finite high half (subnormals, +-0, the largest finite value, the values just below
    each power of two) of either sign with each low half in LOS (the ties among them), and
    +-inf."""
    highs = np.arange(0x7F80, dtype=np.uint32)  # 0x0000..0x7F7F: every finite high half
    highs = np.concatenate([highs, highs | 0x8000])
    bits = ((highs[:, None] << 16) | LOS[None, :]).reshape(-1)
    return np.concatenate([bits, np.array([0x7F800000, 0xFF800000], np.uint32)])


def _random_finite(n, seed):
    bits = np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint32)
    return bits[(bits & 0x7F800000) != 0x7F800000]


def _roundtrip(bits, compute_bits=None):
    master = jnp.asarray(_floats(bits))
    if compute_bits is None:
        compute = _cast(master)
    else:
        compute = jnp.asarray(compute_bits.astype(np.uint16).view(jnp.bfloat16))
    rem = _split(master, compute)
    return np.asarray(_join(compute, rem)), rem, compute


def test_the_adversarial_values_include_what_they_claim():
    bits = _adversarial()
    f = _floats(bits)
    assert np.isin(
        np.array([0x00000001, 0x007FFFFF, 0x80000001, 0x00008000, 0x00018000], np.uint32), bits
    ).all()  # fp32 subnormals, and bf16 subnormal ties with an even and an odd high half
    assert {0.0, np.finfo(np.float32).max, -np.finfo(np.float32).max} <= set(f[np.isfinite(f)])
    assert np.isinf(f).sum() == 2 and np.signbit(f[f == 0]).any()
    assert np.float32(np.nextafter(np.float32(2.0), np.float32(0.0))) in f
    assert np.float32(np.nextafter(np.float32(-0.5), np.float32(0.0))) in f


def test_the_cast_rounds_to_nearest_even_so_the_high_half_is_truncated_or_one_above():
    bits = np.concatenate([_adversarial(), _random_finite(1 << 18, 0)])
    h = _bf16_bits(_cast(jnp.asarray(_floats(bits))))
    trunc = bits >> 16
    assert np.array_equal(h, _rne_high(bits))
    assert np.all((h == trunc) | (h == trunc + 1))
    # the ties: an even truncated half stays, an odd one rounds up
    tie = (bits & 0xFFFF) == TIE
    assert np.array_equal(h[tie] - trunc[tie], trunc[tie] & 1)
    # the largest finite value rounds to inf in bf16
    top = bits == 0x7F7FFFFF
    assert np.isinf(np.asarray(_cast(jnp.asarray(_floats(bits[top]))), np.float32)).all()


def test_exact_over_every_finite_high_half_with_the_adversarial_low_halves():
    bits = _adversarial()
    got, rem, compute = _roundtrip(bits)
    assert np.array_equal(_bits(got), bits)
    assert np.array_equal(np.asarray(rem.lo), (bits & 0xFFFF).astype(np.uint16))
    want_carry = (_bf16_bits(compute) != bits >> 16).astype(np.uint8)
    assert np.array_equal(np.asarray(rem.carry), np.packbits(want_carry, bitorder="little"))


def test_exact_over_a_million_random_finite_bit_patterns():
    bits = _random_finite(1 << 20, 1)
    got, _, _ = _roundtrip(bits)
    assert np.array_equal(_bits(got), bits)


@pytest.mark.parametrize("rounding", ["truncate", "half_up"])
def test_exact_whatever_rounding_made_the_compute_copy(rounding):
    """The rebuild reads only that the high half is truncated or one above."""
    bits = np.concatenate([_adversarial(), _random_finite(1 << 16, 2)])
    finite = np.isfinite(_floats(bits))
    trunc = bits >> 16
    up = (bits & 0xFFFF) >= TIE if rounding == "half_up" else np.zeros(bits.shape, bool)
    h = np.where(finite, trunc + up, trunc)
    got, _, _ = _roundtrip(bits, h)
    assert np.array_equal(_bits(got), bits)


def test_a_nan_master_stays_a_nan():
    bits = np.array(
        [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF],
        np.uint32,
    )
    got, _, _ = _roundtrip(bits)
    assert np.isnan(got).all()  # the payload may differ: the step keeps NaN out of the master


def test_sixteen_bits_cannot_tell_the_two_masters_of_a_tie_apart():
    """Two masters, one below the other, share the bf16 value and the low half: whatever rule
    rebuilds from (h, lo) gets one of them wrong, and the carry bit tells them apart."""
    even = (0x3F80 << 16) | TIE  # 1 + 2^-8: truncated half 0x3F80 (even), rounds down to it
    odd = (0x3F7F << 16) | TIE  # just below: truncated half 0x3F7F (odd), rounds up to 0x3F80
    pair = np.array([even, odd], np.uint32)
    got, rem, compute = _roundtrip(pair)
    h = _bf16_bits(compute)
    lo = np.asarray(rem.lo)
    assert h[0] == h[1] == 0x3F80 and lo[0] == lo[1] == TIE and even != odd
    # the lo-only rule that reads lo >= 0x8000 as "rounded up" rebuilds the odd one only
    lo_only = ((h - (lo >= TIE)) << 16) | lo
    assert lo_only[1] == odd and lo_only[0] != even
    assert np.unpackbits(np.asarray(rem.carry), count=2, bitorder="little").tolist() == [0, 1]
    assert np.array_equal(_bits(got), pair)
    # over every finite high half, the lo-only rule fails exactly at the ties that round down
    bits = _adversarial()
    _, rem, compute = _roundtrip(bits)
    h, lo = _bf16_bits(compute), np.asarray(rem.lo).astype(np.uint32)
    wrong = (((h - (lo >= TIE)) << 16) | lo) != bits
    finite = np.isfinite(_floats(bits))
    assert np.array_equal(wrong[finite], ((lo == TIE) & ((bits >> 16) % 2 == 0))[finite])
    assert wrong.sum() == 2 * 0x7F80 // 2  # half the finite high halves of either sign are even


@pytest.mark.parametrize("shape", [(), (1,), (7,), (8,), (9,), (3, 5), (2, 3, 4), (0,), (4, 0)])
def test_any_leaf_shape(shape):
    bits = np.random.default_rng(3).integers(0, 0x7F000000, size=shape, dtype=np.uint32)
    master = jnp.asarray(_floats(bits))
    rem = _split(master, _cast(master))
    assert rem.lo.shape == shape and rem.lo.dtype == jnp.uint16
    assert rem.carry.shape == (-(-bits.size // 8),) == (carry_bytes(bits.size),)
    assert rem.carry.dtype == jnp.uint8
    assert np.array_equal(_bits(_join(_cast(master), rem)), bits)


def test_host_bytes_per_param():
    assert host_bytes_per_param() == 2.125
    n = 1000
    master = jnp.zeros((n,), jnp.float32)
    rem = split(master, master.astype(jnp.bfloat16))
    assert rem.lo.nbytes + rem.carry.nbytes == n * host_bytes_per_param()


def test_under_shard_map_on_local_shards_not_a_multiple_of_eight():
    mesh = jz.data_parallel_mesh(8)
    rows, cols = 13, 3  # each device's shard: 39 elements, 5 carry bytes
    bits = _random_finite(8 * rows * cols + 64, 4)[: 8 * rows * cols].reshape(8 * rows, cols)
    bits[0, :2] = [(0x3F80 << 16) | TIE, (0x3F7F << 16) | TIE]  # a tie pair on device 0
    scalar = np.array(0x3F7F8000, np.uint32)
    masters = {"w": jnp.asarray(_floats(bits)), "s": jnp.asarray(_floats(scalar))}
    specs = {"w": P("data"), "s": P()}
    rem_specs = {k: Remainder(s, s) for k, s in specs.items()}

    def local_split(m):
        return jax.tree.map(lambda x: split(x, x.astype(jnp.bfloat16)), m)

    def local_join(c, r):
        return jax.tree.map(join, c, r)

    split_sm = jax.jit(
        jax.shard_map(local_split, mesh=mesh, in_specs=(specs,), out_specs=rem_specs)
    )
    join_sm = jax.jit(
        jax.shard_map(local_join, mesh=mesh, in_specs=(specs, rem_specs), out_specs=specs)
    )
    computes = jax.tree.map(lambda x: x.astype(jnp.bfloat16), masters)
    rems = split_sm(masters)
    assert rems["w"].carry.shape == (8 * 5,) and rems["s"].carry.shape == (1,)
    # each device packed its own shard's carry bits
    h = _bf16_bits(computes["w"])
    want = [
        np.packbits((h[i] != bits[i] >> 16).reshape(-1).astype(np.uint8), bitorder="little")
        for i in np.split(np.arange(8 * rows), 8)
    ]
    assert np.array_equal(np.asarray(rems["w"].carry), np.concatenate(want))
    got = join_sm(computes, rems)
    assert np.array_equal(_bits(got["w"]), bits)
    assert np.array_equal(_bits(got["s"]), scalar)


def test_refuses_a_compute_copy_that_is_not_bfloat16_and_a_master_that_is_not_float32():
    master = jnp.ones((3,), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16.*float16.*astype"):
        split(master, master.astype(jnp.float16))
    with pytest.raises(ValueError, match="float32 master"):
        split(master.astype(jnp.bfloat16), master.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"shape \(3,\).*\(2,\)"):
        split(master, master[:2].astype(jnp.bfloat16))
    rem = split(master, master.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16.*float32"):
        join(master, rem)
    with pytest.raises(ValueError, match="remainder split"):
        join(jnp.ones((4,), jnp.bfloat16), rem)


def _mlp_problem():
    k = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(k[0], (16, 64)) * 0.3,
        "b1": jnp.zeros((64,)),
        "w2": jax.random.normal(k[1], (64, 5)) * 0.2,
        "b2": jnp.zeros((5,)),
    }
    x = jax.random.normal(k[2], (32, 16))
    y = jax.random.randint(k[3], (32,), 0, 5)

    def loss(p):
        h = jax.nn.relu(x.astype(jnp.bfloat16) @ p["w1"] + p["b1"])
        logits = (h @ p["w2"] + p["b2"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return params, loss


def test_two_hundred_adamw_steps_stored_as_compute_copy_and_remainder_are_exact():
    """A run that keeps the fp32 master and one that keeps only (bf16 copy, remainder), the
    master rebuilt before each update and split again after it, end with the same bits."""
    params, loss = _mlp_problem()
    tx = optax.adamw(3e-3, weight_decay=1e-2)

    @jax.jit
    def update(master, compute, opt):
        # the offloaded step: gradients of the bf16 copy, the update on the fp32 master
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(loss)(compute))
        updates, opt = tx.update(grads, opt, master)
        return optax.apply_updates(master, updates), opt

    def cast(t):
        return jax.tree.map(_cast, t)

    def split_tree(m, c):
        return jax.tree.map(_split, m, c)

    def join_tree(c, r):
        return jax.tree.map(_join, c, r)

    def same(a, b):
        return all(
            np.array_equal(_bits(x), _bits(y))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )

    master, opt = params, tx.init(params)
    carried = 0
    for _ in range(200):
        compute = cast(master)
        rem = split_tree(master, compute)
        assert same(join_tree(compute, rem), master)
        carried += sum(int(np.unpackbits(np.asarray(r.carry)).sum()) for r in _rems(rem))
        master, opt = update(master, compute, opt)
    assert carried > 0  # the rounding went up somewhere, every step's check used the carry

    compute, opt = cast(params), tx.init(params)
    rem = split_tree(params, compute)
    for _ in range(200):
        new, opt = update(join_tree(compute, rem), compute, opt)
        compute = cast(new)
        rem = split_tree(new, compute)
    assert same(join_tree(compute, rem), master)
    assert not same(params, master)  # it trained


def _rems(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Remainder))
