"""The EMA on disk (decision 50, "The EMA"): with ``make_train_step(..., ema=ShardedEMA(...))``
the NVMe tier keeps the EMA of the master in its state file, each leaf in its master leaf's
group, updated from that group's new master; ``jz.ema_params`` reads it back a group at a time.

Expected numbers come from the host offload's step with the same EMA (its EMA in host memory,
updated by the streamed update), and from an EMA computed in numpy from plain single-device
optax's params after each applied step.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import tolerance
from test_nvme_step import TX, N, _problem, _same, _with_inf

import jaxzero as jz
from jaxzero import checkpoint

# one per stage: the yolov5 warm-up and the tf schedule, each with its decay formula below
EMAS = {
    1: (jz.ShardedEMA(0.9, tau=2.0), lambda n: 0.9 * (1 - math.exp(-n / 2.0))),
    2: (jz.ShardedEMA(0.8, schedule="tf"), lambda n: min(0.8, n / (9.0 + n))),
    3: (jz.ShardedEMA(0.9, tau=2.0), lambda n: 0.9 * (1 - math.exp(-n / 2.0))),
}


def _numpy_ema(params, loss_fn, finite_batches, decay_of):
    """The EMA of plain optax's params after each applied step, in float64 numpy
    (``e <- d_n e + (1 - d_n) p_n``, ``e_0`` the initial params), and the largest of the
    per-step tolerances (tests/tolerance.py): the EMA is a convex combination of the params,
    so it lands within the largest of their bounds."""
    ema = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    atol = 0.0
    for n in range(1, len(finite_batches) + 1):
        plain, _, a = tolerance.reference(TX, params, loss_fn, finite_batches[:n])
        atol = max(atol, a)
        d = decay_of(n)
        ema = jax.tree.map(
            lambda e, p, d=d: d * e + (1 - d) * np.asarray(p, np.float64), ema, plain
        )
    return ema, atol


@pytest.mark.bitwise  # the host offload's and the NVMe tier's programs, bit for bit
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_ema_on_disk_equals_the_host_offloads(stage, tmp_path):
    """Clip + AdamW for 4 steps, the third skipped (an inf in one device's batch), with an EMA
    (the yolov5 warm-up at stages 1 and 3, the tf schedule at 2): after every step the EMA
    read back from the file equals the host offload's (its EMA in host memory) bit for bit
    where its leaf is on disk, within 4 ulps where it is resident (test_nvme_step's rule), and
    its counter exactly; the skipped step leaves it unchanged. Each large EMA leaf sits in the
    group of its master's optax state. ``jz.ema_params`` of the last state equals the host
    offload's, replicated, and is within tests/tolerance.py's rule of an EMA computed in
    numpy from plain optax's params after each of the three applied steps."""
    params, loss_fn, batches = _problem(4)
    batches[2] = _with_inf(batches[2])
    ema, decay_of = EMAS[stage]
    mesh = jz.data_parallel_mesh(N)
    disk_zero = jz.ZeRO(TX, mesh, stage=stage, offload=jz.NVMe(tmp_path))
    host_zero = jz.ZeRO(TX, mesh, stage=stage, offload="optimizer")
    step = jz.make_train_step(loss_fn, disk_zero, ema=ema)
    host = jz.make_train_step(loss_fn, host_zero, ema=ema)
    state, want = step.init(params), host.init(params)

    disk = state.disk
    start = disk.n_o + disk.n_m
    ema_on_disk = [i for i in disk.leaves if i >= start]
    assert ema_on_disk  # w1's and w2's EMA
    for i in ema_on_disk:
        leaf = disk.leaves[i]
        beside = [disk.leaves[j] for j in disk.group_leaves[leaf.group] if j < disk.n_o]
        assert any(o.shape == leaf.shape for o in beside), i

    before = None
    for k, b in enumerate(batches):
        state, m = step(state, b)
        want, wm = host(want, b)
        assert bool(m["finite"]) == bool(wm["finite"]) == (k != 2)
        got = state.ema_state()
        ref = jax.tree.map(np.asarray, jz.gather(want.ema.ema))
        assert int(got.updates) == int(want.ema.updates) == k + (k < 2)
        for name in ref:
            _same(got.ema[name], ref[name])
        if k == 2:  # the skipped step: the EMA unchanged
            jax.tree.map(np.testing.assert_array_equal, got.ema, before)
        before = got.ema
    for name, x in jax.tree.map(np.asarray, jz.gather(want.params)).items():
        _same(jz.gather(state.params)[name], x)

    got = jz.ema_params(state)
    ref = jz.ema_params(want)
    for name in ref:
        assert got[name].sharding.is_fully_replicated
        assert got[name].dtype == ref[name].dtype
        _same(got[name], ref[name])
    formula, atol = _numpy_ema(params, loss_fn, [batches[0], batches[1], batches[3]], decay_of)
    for name in formula:
        np.testing.assert_allclose(np.asarray(got[name]), formula[name], rtol=0, atol=atol)
    state.close()


def test_an_ema_the_state_does_not_keep_is_refused(tmp_path):
    """A state made without an EMA: ``ema_params`` names the fix, a step made with one and
    ``checkpoint.save(..., ema=)`` are refused, and no checkpoint is written."""
    params, loss_fn, batches = _problem(1)
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload=jz.NVMe(tmp_path))
    state = jz.make_train_step(loss_fn, zero).init(params)
    with pytest.raises(ValueError, match="needs a state with an EMA"):
        jz.ema_params(state)
    with pytest.raises(ValueError, match="make the step with the ema= the state was made"):
        jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.9))(state, batches[0])
    ckpt = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="keeps no EMA"):
        checkpoint.save(ckpt, 0, state, zero=zero, ema=jz.ShardedEMA(0.9))
    assert not ckpt.exists()
    state.close()
