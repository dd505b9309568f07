"""The NVMe step (jaxzero/train/nvme_step.py, decision 50): the optimizer state in a file on
disk, updated a group of leaves at a time through the swapper's window, trains as the host
offload does and as plain single-device optax; a skipped step leaves the file unchanged; the
update's host memory is the window, not the state.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance

import jaxzero as jz
from jaxzero.train.nvme_step import NVMe, make_nvme_train_step
from jaxzero.zero.offload import parts

N = 8
BF16 = jz.Precision("bfloat16", "float32", "float32")


def _problem(steps=3):
    """An MLP whose two large kernels (8,192 and 32,768 elements) are above parts.SMALL, so
    their state goes to disk, and whose biases and last kernel stay resident."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(k[0], (16, 512)) * 0.1,
        "b1": jnp.zeros(512),
        "w2": jax.random.normal(k[1], (512, 64)) * 0.1,
        "w3": jax.random.normal(k[2], (64, 8)) * 0.1,
        "b3": jnp.zeros(8),
    }
    assert params["w1"].size > parts.SMALL and params["w3"].size <= parts.SMALL

    def loss_fn(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        h = jnp.tanh(h @ p["w2"])
        return jnp.mean((h @ p["w3"] + p["b3"] - b["y"]) ** 2)

    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(32, 16)).astype(np.float32),
            "y": rng.normal(size=(32, 8)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return params, loss_fn, batches


TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-2))


def _zero(stage, precision="fp32", **kw):
    return jz.ZeRO(
        TX, jz.data_parallel_mesh(N), stage=stage, offload="optimizer", precision=precision, **kw
    )


def _host_offload(zero, params, loss_fn, batches):
    """``(params, master, opt_state)`` as numpy after each step, and each step's metrics."""
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    seen, metrics = [], []
    for b in batches:
        state, m = step(state, b)
        # read back now: no program of this step is in flight when the NVMe step starts
        seen.append(
            jax.tree.map(np.asarray, jz.gather((state.params, state.master, state.opt_state)))
        )
        metrics.append(_counters(m, state))
    return seen, metrics


def _counters(m, state):
    got = {k: np.asarray(m[k]) for k in ("finite", "skipped", "step", "grad_norm")}
    if state.loss_scale is not None:
        got["loss_scale"] = np.asarray(state.loss_scale.scale)
    return got


def _nvme(zero, params, loss_fn, batches, path, **kw):
    """:func:`_host_offload`'s with the state on disk under ``path`` (read back from the file
    after each step), and the last state."""
    step = make_nvme_train_step(loss_fn, zero, NVMe(path, **kw))
    state = step.init(params)
    seen, metrics = [], []
    for b in batches:
        state, m = step(state, b)
        opt_state, master = state.optimizer_state()
        seen.append((jax.tree.map(np.asarray, jz.gather(state.params)), master, opt_state))
        metrics.append(_counters(m, state))
    return seen, metrics, state


def _with_inf(batch):
    """``batch`` with an inf target in device 5's first row: a non-finite gradient."""
    bad = {k: np.array(v) for k, v in batch.items()}
    bad["y"][5 * (bad["y"].shape[0] // N)] = np.inf
    return bad


FP16 = jz.Precision("float16", "float32", "float32")


@pytest.mark.parametrize(
    "stage,precision",
    [(1, "fp32"), (2, "fp32"), (3, "fp32"), (3, BF16), (2, FP16)],
    ids=str,
)
def test_nvme_trains_bit_for_bit_like_the_host_offload(stage, precision, tmp_path):
    """Clip by global norm + AdamW for 4 steps, the third skipped (an inf in one device's
    batch): after every step the params, the master (bf16, fp16: on disk) and the optax state
    read back from the file equal the host offload's bit for bit, and so do the counters, the
    norm and (fp16) the dynamic loss scale, which the skipped step halves. The fp32 runs' finite
    steps also land within tests/tolerance.py's derived tolerance of plain single-device optax.

    Bit for bit under the suite's XLA flags (LLVM's optimisation off); with it on, XLA:CPU
    contracts multiply-adds differently in the two programs: decision 50, "The same numbers"."""
    params, loss_fn, batches = _problem(steps=4)
    batches[2] = _with_inf(batches[2])
    scale = jz.DynamicLossScale(init_scale=2.0**10, hysteresis=1) if precision is FP16 else None
    zero = _zero(stage, precision, loss_scale=scale)
    want, want_metrics = _host_offload(zero, params, loss_fn, batches)
    # w1's and w2's state in groups of their own: 0.3 MiB holds w2's fp32 mu and nu, not
    # also w1's; 0.45 MiB its master, mu and nu
    separate = precision in (BF16, FP16)
    mb = 0.45 if separate else 0.3
    got, metrics, state = _nvme(zero, params, loss_fn, batches, str(tmp_path), buffer_mb=mb)
    assert len(state.disk.groups) == 2 and state.disk.programs == 2 and state.disk.disk_bytes > 0
    on_disk = 3 if separate else 2  # (master,) mu, nu of each large kernel
    assert len(state.disk.leaves) == 2 * on_disk
    assert [bool(m["finite"]) for m in metrics] == [True, True, False, True]
    assert int(state.step) == 3 and int(state.skipped) == 1
    for k in range(len(batches)):
        jax.tree.map(np.testing.assert_array_equal, got[k], want[k])
        jax.tree.map(np.testing.assert_array_equal, metrics[k], want_metrics[k])
    if precision is FP16:
        assert metrics[2]["loss_scale"] == metrics[1]["loss_scale"] / 2
    if precision == "fp32":
        assert got[-1][1] is None and want[-1][1] is None  # the params are the master
        finite = [b for k, b in enumerate(batches) if k != 2]
        ref_p, ref_s, atol = tolerance.reference(TX, params, loss_fn, finite)
        chex.assert_trees_all_close(got[-1][0], jax.tree.map(np.asarray, ref_p), rtol=0, atol=atol)
        chex.assert_trees_all_close(got[-1][2], jax.tree.map(np.asarray, ref_s), rtol=0, atol=atol)


def test_skipped_step_leaves_the_file_unchanged(tmp_path):
    """A batch with an inf target on one device: the step is skipped (metrics say so, the
    counters move as the host offload's do), the state file's bytes, the params and the
    resident leaves are unchanged, and the next finite step trains."""
    params, loss_fn, batches = _problem(steps=3)
    zero = _zero(2)
    step = make_nvme_train_step(loss_fn, zero, NVMe(str(tmp_path), buffer_mb=0.3))
    state = step.init(params)
    state, _ = step(state, batches[0])
    path = state.disk.swapper.path
    with open(path, "rb") as f:
        before = f.read()
    params_before = jax.tree.map(np.asarray, jz.gather(state.params))
    resident_before = {i: np.asarray(x) for i, x in state.resident.items()}
    state, m = step(state, _with_inf(batches[1]))
    assert not bool(m["finite"]) and int(m["skipped"]) == 1 and int(state.step) == 1
    with open(path, "rb") as f:
        assert f.read() == before
    jax.tree.map(np.testing.assert_array_equal, jz.gather(state.params), params_before)
    for i, x in state.resident.items():
        np.testing.assert_array_equal(np.asarray(x), resident_before[i])
    state, m = step(state, batches[2])
    assert bool(m["finite"]) and int(state.step) == 2
    with open(path, "rb") as f:
        assert f.read() != before


# A process training a model whose state on disk is 4x the swapper's window: each update's
# peak resident memory (VmHWM reset before it, against VmRSS then; the first allocates the
# window's buffers and compiles the groups' programs) grows by at most
# the window, the new compute shards and a group's device copies in and out (simulated devices'
# memory is the process's), plus 16 MiB; loading the state would add all 96 MiB.
_RSS_SCRIPT = textwrap.dedent(
    """
    import sys
    import jaxzero as jz
    jz.simulate_cpu_devices(8)
    import jax, jax.numpy as jnp, numpy as np, optax
    from jaxzero.train.nvme_step import NVMe, make_nvme_train_step
    from jaxzero.zero.offload.nvme_update import DiskUpdate

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    grown = []
    plain_run = DiskUpdate.run

    def measured(self, *args):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        start = status("VmRSS")
        out = plain_run(self, *args)
        jax.block_until_ready(out)
        grown.append(status("VmHWM") - start)
        return out

    DiskUpdate.run = measured
    leaves, side = 8, 1024
    params = {f"w{i}": jnp.full((side, side), 0.01 * (i + 1)) for i in range(leaves)}

    def loss_fn(p, b):
        return sum(jnp.mean((b["x"] @ w.astype(jnp.float32)) ** 2) for w in p.values())

    pol = jz.Precision("bfloat16", "float32", "float32")
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2,
                   offload="optimizer", precision=pol)
    group = 3 * 4 * side * side  # a kernel's master, mu and nu
    step = make_nvme_train_step(
        loss_fn, zero, NVMe(sys.argv[1], buffer_count=2, buffer_mb=group / 2**20))
    state = step.init(params)
    batch = {"x": np.ones((8, side), np.float32)}
    for _ in range(3):
        state, m = step(state, batch)
    assert int(state.step) == 3
    assert state.disk.programs == 1  # eight groups of the same shapes: one program
    print(state.disk.disk_bytes, state.disk.window_bytes, group, 2 * leaves * side * side,
          *grown)
    """
)


def test_update_memory_is_the_window_not_the_state(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    on_disk, window, group, compute, *grown = map(int, proc.stdout.split())
    assert on_disk >= 4 * window and on_disk == 8 * group
    bound = window + compute + 2 * group + (16 << 20)
    assert len(grown) == 3 and max(grown) <= bound, (grown, bound, on_disk)
    assert bound < on_disk  # the bound would catch a step that loaded the state
