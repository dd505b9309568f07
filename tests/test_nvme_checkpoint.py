"""Checkpoints of the NVMe tier's state (jaxzero/checkpoint/nvme.py, decision 50): saved a group
of leaves at a time, restored into a fresh state file at the same or another device count, and
a run killed in the middle of an update resumes from its last checkpoint with the numbers of a
run never interrupted.

Expected numbers come from the host offload's step (``offload="optimizer"``, itself checked
against plain optax) and from plain optax on one device (tests/tolerance.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest
import tolerance
from test_nvme_step import BF16, TX, _problem, _same

import jaxzero as jz
from jaxzero import checkpoint
from jaxzero.checkpoint.structure import flat_leaves

N = 8


def _nvme_zero(path, n=N, stage=2, **kw):
    os.makedirs(path, exist_ok=True)
    return jz.ZeRO(TX, jz.data_parallel_mesh(n), stage=stage, offload=jz.NVMe(path), **kw)


def _host_run(params, loss_fn, batches):
    """The host offload's state after ``batches``, uninterrupted, as numpy."""
    zero = jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload="optimizer")
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)
    return jax.tree.map(np.asarray, jz.gather((state.params, state.opt_state)))


def _read(state):
    """``(params, opt_state)`` of an NVMe state as numpy (the optax state read from its file)."""
    opt_state, master = state.optimizer_state()
    assert master is None  # fp32: the params are the master
    return jax.tree.map(np.asarray, jz.gather(state.params)), opt_state


@pytest.mark.bitwise  # the host offload's and the NVMe tier's programs, bit for bit
def test_a_checkpoint_of_the_disk_state_restores_at_8_and_4_devices(tmp_path):
    """Two clip + AdamW steps at stage 2 with the state on disk, saved; restored into a fresh
    file at 8 devices and at 4, each trains two more steps (the save through an asynchronous
    manager, and a step of the saved run before it commits): at 8 devices the params and the
    optax state equal the host offload's uninterrupted four steps (the disk's leaves bit for
    bit, the resident ones within 4 ulps: test_nvme_step's rule), at 4 they are within
    tests/tolerance.py's rule of plain optax. The checkpoint holds the host offload's leaves:
    its metadata names every leaf of the host offload's state, the disk ones in the NVMe item."""
    params, loss_fn, batches = _problem(4)
    zero = _nvme_zero(tmp_path / "run")
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    for b in batches[:2]:
        state, _ = step(state, b)
    saved = _read(state)
    ckpt = tmp_path / "ckpt"
    mngr = checkpoint.manager(ckpt)  # asynchronous: the disk leaves are written on return
    assert checkpoint.save(mngr, 2, state, zero=zero)
    state, _ = step(state, batches[2])  # updates the file in place while the step commits
    checkpoint.wait(mngr)
    mngr.close()
    state.close()

    report = checkpoint.verify(ckpt)  # every leaf, the disk ones too, against its checksum
    assert report.ok and report.steps[0].checked == report.steps[0].leaves, str(report)
    text = checkpoint.inspect(ckpt)
    assert "on disk (the NVMe tier's nvme item): 4 leaves" in text and "opt_state.1.0.nu.w2" in text
    meta = checkpoint.load_metadata(ckpt, 2)
    host = jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload="optimizer")
    want_names = {".".join(p) for p in flat_leaves(host.abstract_state(params))}
    got_names = {r["path"] for r in meta["leaves"]} | {r["path"] for r in meta["nvme"]["leaves"]}
    assert got_names == want_names
    assert {r["path"] for r in meta["nvme"]["leaves"]} == {
        "opt_state.1.0.mu.w1", "opt_state.1.0.nu.w1", "opt_state.1.0.mu.w2", "opt_state.1.0.nu.w2",
    }  # fmt: skip

    want = _host_run(params, loss_fn, batches)
    plain, plain_opt, atol = tolerance.reference(TX, params, loss_fn, batches)
    for n in (8, 4):
        zero_n = _nvme_zero(tmp_path / f"r{n}", n)
        restored = checkpoint.restore(ckpt, zero_n, params)
        assert int(restored.step) == 2
        if n == N:  # the round trip: the saved state, bit for bit
            chex.assert_trees_all_equal(_read(restored), saved)
        # jz.gather of the state: its compute params, as of the state in memory
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, jz.gather(restored)), saved[0])
        step_n = jz.make_train_step(loss_fn, zero_n)
        for b in batches[2:]:
            restored, _ = step_n(restored, b)
        got_params, got_opt = _read(restored)
        if n == N:
            jax.tree.map(_same, (got_params, got_opt), want)
        else:
            chex.assert_trees_all_close(got_params, plain, atol=atol)
        restored.close()


def test_a_bf16_state_with_its_master_on_disk_restores_at_2_devices(tmp_path):
    """bf16 compute at stage 3: the fp32 master's large leaves are on disk beside the optax
    state's. Saved at 8 devices after two steps and restored at 2: the master and the optax
    state read back from the new file, the bf16 params and the counters equal the saved ones
    bit for bit, and the params are the master's bf16 cast. With a disk leaf's saved checksum
    changed, ``verify`` names the leaf and ``restore`` raises CheckpointDamagedError."""
    params, loss_fn, batches = _problem(2)
    zero = _nvme_zero(tmp_path / "run", stage=3, precision=BF16)
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)
    saved = (jz.gather(state.params), *state.optimizer_state(), int(state.step))
    checkpoint.save(tmp_path / "ckpt", 2, state, zero=zero)
    state.close()
    on_disk = {r["path"] for r in checkpoint.load_metadata(tmp_path / "ckpt")["nvme"]["leaves"]}
    assert {"master.w1", "master.w2", "opt_state.1.0.mu.w1"} <= on_disk
    zero2 = _nvme_zero(tmp_path / "r2", 2, stage=3, precision=BF16)
    restored = checkpoint.restore(tmp_path / "ckpt", zero2, params)
    got = (jz.gather(restored.params), *restored.optimizer_state(), int(restored.step))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, saved))
    cast = jax.tree.map(lambda m: np.asarray(m).astype(jax.numpy.bfloat16), got[2])
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, got[0]), cast)
    restored.close()

    # a disk leaf whose numbers differ from its checksum: verify names it, restore refuses it
    index_file = tmp_path / "ckpt" / "2" / "nvme" / "leaves.json"
    index = json.loads(index_file.read_text())
    index["checksums"]["leaves"]["master.w1"] = "0" * 16
    index_file.write_text(json.dumps(index))
    report = checkpoint.verify(tmp_path / "ckpt")
    assert not report.ok and report.steps[0].leaf == "master.w1", str(report)
    with pytest.raises(checkpoint.CheckpointDamagedError, match="leaf master.w1"):
        checkpoint.restore(tmp_path / "ckpt", zero2, params)


def test_what_the_disk_checkpoint_does_not_take_is_refused_before_anything_is_written(tmp_path):
    """An EMA for a state without one, a state whose update failed, a step restored into another precision policy, and
    restore options the tier does not take: each raises naming the fix,
    and neither the checkpoint directory nor the NVMe directory gains a file."""
    params, loss_fn, batches = _problem(1)
    (tmp_path / "run").mkdir()
    zero = _nvme_zero(tmp_path / "run")
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="keeps no EMA"):
        checkpoint.save(ckpt, 0, state, zero=zero, ema=jz.ShardedEMA(0.9))
    assert not ckpt.exists()
    state.disk.broken = "the file was left part updated"
    with pytest.raises(RuntimeError, match="part updated"):
        checkpoint.save(ckpt, 0, state, zero=zero)
    assert not ckpt.exists()
    state.close()

    host = jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload="optimizer")
    host_state = jz.make_train_step(loss_fn, host).init(params)
    checkpoint.save(ckpt, 1, host_state, zero=host)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(ValueError, match="restores only into the precision policy"):
        checkpoint.restore(ckpt, _nvme_zero(fresh, precision=BF16), params)
    with pytest.raises(ValueError, match="saved without an EMA.*restore without ema="):
        checkpoint.restore(ckpt, _nvme_zero(fresh), params, ema=jz.ShardedEMA(0.9))
    for kw in ({"fallback": True}, {"check_dtypes": False}):
        with pytest.raises(ValueError, match="not supported by the NVMe tier"):
            checkpoint.restore(ckpt, _nvme_zero(fresh), params, **kw)
    assert os.listdir(fresh) == []


@pytest.mark.bitwise  # the host offload's and the NVMe tier's programs, bit for bit
def test_a_checkpoint_carries_the_ema_on_disk(tmp_path):
    """Two clip + AdamW steps at stage 2 with an EMA (yolov5 warm-up) on disk, saved: every
    leaf verifies, the EMA's disk leaves too; restored into a fresh file, the EMA read back
    equals the saved one bit for bit, and two more steps give the host offload's EMA and params
    after four uninterrupted steps (disk leaves bit for bit, resident ones within 4 ulps:
    test_nvme_step's rule). The step restores into the host offload's state in memory with the
    saved EMA, and a host-offload step with an EMA restores into the tier with its EMA, bit for
    bit. Restoring without ema= is refused naming the fix, and the directory gains no file."""
    params, loss_fn, batches = _problem(4)
    ema = jz.ShardedEMA(0.9, tau=2.0)
    zero = _nvme_zero(tmp_path / "run")
    step = jz.make_train_step(loss_fn, zero, ema=ema)
    state = step.init(params)
    for b in batches[:2]:
        state, _ = step(state, b)
    saved = state.ema_state()
    ckpt = tmp_path / "ckpt"
    checkpoint.save(ckpt, 2, state, zero=zero)
    state.close()
    report = checkpoint.verify(ckpt)
    assert report.ok and report.steps[0].checked == report.steps[0].leaves, str(report)

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(ValueError, match="saved with an EMA.*pass ema="):
        checkpoint.restore(ckpt, _nvme_zero(fresh), params)
    assert os.listdir(fresh) == []
    zero8 = _nvme_zero(fresh)
    state = checkpoint.restore(ckpt, zero8, params, ema=ema)
    got = state.ema_state()
    assert int(got.updates) == int(saved.updates) == 2
    chex.assert_trees_all_equal(got.ema, saved.ema)
    step = jz.make_train_step(loss_fn, zero8, ema=ema)
    for b in batches[2:]:
        state, _ = step(state, b)
    host_zero = jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload="optimizer")
    host = jz.make_train_step(loss_fn, host_zero, ema=ema)
    want = host.init(params)
    for b in batches:
        want, _ = host(want, b)
    ref = jax.tree.map(np.asarray, jz.gather((want.params, want.ema.ema)))
    got = (jax.tree.map(np.asarray, jz.gather(state.params)), state.ema_state().ema)
    jax.tree.map(_same, got, ref)
    state.close()

    in_memory = checkpoint.restore(ckpt, host_zero, params, ema=ema)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, jz.gather(in_memory.ema.ema)), saved.ema)

    host_state = host.init(params)
    for b in batches[:2]:
        host_state, _ = host(host_state, b)
    checkpoint.save(tmp_path / "host", 2, host_state, zero=host_zero, ema=ema)
    state = checkpoint.restore(
        tmp_path / "host", _nvme_zero(tmp_path / "from_host"), params, ema=ema
    )
    chex.assert_trees_all_equal(
        state.ema_state().ema, jax.tree.map(np.asarray, jz.gather(host_state.ema.ema))
    )
    state.close()


@pytest.mark.bitwise  # the host offload's and the NVMe tier's programs, bit for bit
def test_a_step_restores_across_the_host_offload_and_the_disk_tier(tmp_path):
    """Two steps of the host offload, saved, restored into the NVMe tier (its disk leaves read
    from the step's state item a group at a time) and trained two more steps: the params and
    optax state of the host offload's four uninterrupted steps (the disk's leaves bit for bit,
    the resident ones within 4 ulps). The other way, two NVMe steps saved and restored into the
    host offload: the NVMe state's params and optax state bit for bit, and two more steps
    within tests/tolerance.py's rule of plain optax."""
    params, loss_fn, batches = _problem(4)
    host = jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload="optimizer")
    host_step = jz.make_train_step(loss_fn, host)
    state = host_step.init(params)
    for b in batches[:2]:
        state, _ = host_step(state, b)
    checkpoint.save(tmp_path / "host", 2, state, zero=host)
    zero = _nvme_zero(tmp_path / "run")
    restored = checkpoint.restore(tmp_path / "host", zero, params)
    step = jz.make_train_step(loss_fn, zero)
    for b in batches[2:]:
        restored, _ = step(restored, b)
    jax.tree.map(_same, _read(restored), _host_run(params, loss_fn, batches))
    restored.close()

    nvme_state = step.init(params)
    for b in batches[:2]:
        nvme_state, _ = step(nvme_state, b)
    checkpoint.save(tmp_path / "nvme", 2, nvme_state, zero=zero)
    saved = _read(nvme_state)
    nvme_state.close()
    back = checkpoint.restore(tmp_path / "nvme", host, params)
    got = jax.tree.map(np.asarray, jz.gather((back.params, back.opt_state)))
    chex.assert_trees_all_equal(got, saved)
    for b in batches[2:]:
        back, _ = host_step(back, b)
    plain, _, atol = tolerance.reference(TX, params, loss_fn, batches)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, jz.gather(back)), plain, atol=atol)


# --------------------------------------------------------------------------------- memory
_RSS_SCRIPT = """
import os, sys
import jaxzero as jz
jz.simulate_cpu_devices(1)
import jax, jax.numpy as jnp, numpy as np, optax
from jaxzero import checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")

def loss_fn(p, b):
    return sum(jnp.mean((b["x"].astype(w.dtype) @ w).astype(jnp.float32) ** 2) for w in p.values())

pol = jz.Precision("bfloat16", "float32", "bfloat16")
root = sys.argv[1]
leaves = int(sys.argv[2]); side = 1024
def zero_at(d, **kw):
    os.makedirs(d, exist_ok=True)
    return jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(1), stage=1, offload=jz.NVMe(d, **kw), precision=pol)
# warm-up: a small model saved and restored
z = zero_at(f"{root}/warm")
st = jz.make_train_step(loss_fn, z)
small_p = {"w": np.ones((128, 128), np.float32)}
s = st.init(small_p); s, _ = st(s, {"x": np.ones((8, 128), np.float32)})
checkpoint.save(f"{root}/warm-ckpt", 1, s, zero=z); s.close()
s = checkpoint.restore(f"{root}/warm-ckpt", zero_at(f"{root}/warm2"), small_p); s.close()

params = {f"w{i}": np.full((side, side), 0.01 * (i + 1), np.float32) for i in range(leaves)}
group = 3 * 4 * side * side
z = zero_at(f"{root}/run", buffer_count=2, buffer_mb=group / 2**20)
step = jz.make_train_step(loss_fn, z)
state = step.init(params)
state, _ = step(state, {"x": np.ones((8, side), np.float32)})
jax.block_until_ready(state.params)
start = reset()
checkpoint.save(f"{root}/ckpt", 1, state, zero=z)
saved = status("VmHWM") - start
window = state.disk.window_bytes; disk = state.disk.disk_bytes
state.close()
start = reset()
r = checkpoint.restore(f"{root}/ckpt", zero_at(f"{root}/r", buffer_count=2, buffer_mb=group / 2**20), params)
restored = status("VmHWM") - start
params_bytes = 2 * leaves * side * side  # the bf16 compute params, in the state item
print(disk, window, group, params_bytes, saved, restored)
"""


def test_save_and_restore_never_hold_the_state_in_memory_whole(tmp_path):
    """test_nvme_step's memory test for checkpoints: 8 kernels of 1024 x 1024, bf16 compute and
    an fp32 master, Adam, 96 MiB of state on disk in 8 groups, a window of 2 x 12 MiB, one
    device (after a warm-up save and restore of a small model). The process's peak resident
    memory (VmHWM reset before each) grows over ``save`` by at most the window, two groups and
    16 MiB, and over ``restore`` by at most the bf16 params (the state item), the window, two
    groups and 16 MiB: each bound below the 96 MiB a phase that held the state would add."""
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path), "8"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    on_disk, window, group, params, saved, restored = map(int, proc.stdout.split()[-6:])
    assert on_disk == 8 * group and on_disk >= 4 * window
    slack = 16 << 20
    assert saved <= window + 2 * group + slack < on_disk, (saved, on_disk)
    assert restored <= params + window + 2 * group + slack < on_disk, (restored, on_disk)


# --------------------------------------------------------------------------------- kill
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvme_ckpt_worker.py")


def _worker(*args, env=None):
    return subprocess.Popen(
        [sys.executable, WORKER, *map(str, args)],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.bitwise  # the host offload's and the NVMe tier's programs, bit for bit
def test_a_run_killed_in_the_middle_of_an_update_resumes_from_its_checkpoint(tmp_path):
    """A child process trains with the state on disk, checkpoints after step 2 and is killed
    (SIGKILL) in step 3's update, after the first group of the file is written and before the
    second. Its lock dies with it. A second process restores step 2 into the same NVMe
    directory: the torn file is detected (a warning naming the killed process) and rebuilt from
    the checkpoint, and two more steps give the params and optax state of the host offload's
    four uninterrupted steps (the disk's leaves bit for bit, the resident ones within 4 ulps)."""
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run.mkdir()
    marker = tmp_path / "in_update"
    child = _worker("train", run, ckpt, env={"NVME_CKPT_PAUSE": str(marker)})
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            if child.poll() is not None or time.monotonic() > deadline:
                out = child.stdout.read() if child.poll() is not None else ""
                pytest.fail(f"the worker did not reach step 3's update: {out[-3000:]}")
            time.sleep(0.1)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    assert (run / "optimizer_state.swp.updating").exists()  # the torn file's marker

    resumed = _worker("resume", run, ckpt, tmp_path / "resumed.npz")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    assert f"left part updated by process {child.pid}" in out
    assert not (run / "optimizer_state.swp.updating").exists()
    got = np.load(tmp_path / "resumed.npz")

    params, loss_fn, batches = _problem(4)
    want_params, want_opt = _host_run(params, loss_fn, batches)
    want = jax.tree.leaves((want_params, want_opt))
    assert len(got.files) == len(want)
    for i, value in enumerate(want):
        _same(got[f"leaf_{i}"], value)
