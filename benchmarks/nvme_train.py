"""Training with the optimizer state on disk (the NVMe tier, decision 50) at a few GB: the
process's peak resident memory against the state it trains, and the step against the same
step with the state in host memory, in the same process.

    python benchmarks/nvme_train.py                       # a 3 GB state under /tmp
    python benchmarks/nvme_train.py --gb 3 --out benchmarks/results/nvme_train.md

The model: ``--leaves`` square kernels of ``--side`` (bf16 compute params on one device, an
fp32 master, ``optax.adam``'s mu and nu: 12 bytes per parameter on disk), a loss of the
squared activations of one batch. Two runs of ``--steps`` steps, one after the other:

* ``nvme``: ``ZeRO(stage=1, offload=jz.NVMe(dir, buffer_count=4, buffer_mb=...))``, one
  kernel's state per buffer, so the window is ``4 x 12 x side**2`` bytes;
* ``host``: ``ZeRO(stage=1, offload="optimizer")``, the whole state in host memory.

Before each phase (init, each step) the peak resident set (``VmHWM``) is reset to the current
one (``/proc/self/clear_refs``) and read after it, against the resident set before the run's
init: the most the run held at once in that phase. On one simulated CPU device the device's
arrays (the compute params, the gradients) are host memory too, and both runs hold the same
ones; so the difference between the runs' peaks is what the NVMe tier keeps out of memory,
set beside the state on disk less the window. The process runs with glibc's mmap threshold
fixed at 1 MiB (set on re-exec), so freed buffers leave the process and the peaks are live
bytes. The NVMe run's phases all come before the host run allocates its state. The table
prints the state's bytes, the window, each phase's peak, the median step of each run and
their ratio, and how many of the two runs' final params differ, and by how much. Under XLA's
default flags the update's fusions differ between the two programs, so a few params may
differ in their last bit (decision 50: bit for bit under the test suite's flags).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

MMAP = "MALLOC_MMAP_THRESHOLD_"
if os.environ.get(MMAP) != str(1 << 20):  # before anything allocates: re-exec with it set
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, MMAP: str(1 << 20)})

from jaxzero.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxzero as jz  # noqa: E402

STATE_BYTES = 12  # an fp32 master, Adam's mu and nu per parameter


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset() -> int:
    """Set the peak resident set to the current one; return the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def loss_fn(p, b):
    return sum(jnp.mean((b["x"].astype(w.dtype) @ w).astype(jnp.float32) ** 2) for w in p.values())


def train(zero, params, batch, steps):
    """Init and ``steps`` steps; each phase's peak resident memory above the run's start
    (``VmRSS`` before init) and the steps' seconds."""
    step = jz.make_train_step(loss_fn, zero)
    start = status("VmRSS")
    reset()
    state = step.init(params)
    jax.block_until_ready(state.params)
    peaks, seconds = [status("VmHWM") - start], []
    for _ in range(steps):
        reset()
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state.params, metrics))
        seconds.append(time.perf_counter() - t0)
        peaks.append(status("VmHWM") - start)
    final = {k: np.asarray(v) for k, v in state.params.items()}
    if hasattr(state, "close"):
        state.close()
    return peaks, seconds, final


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=3.0, help="state on disk, GB (sets --leaves)")
    ap.add_argument("--side", type=int, default=2048, help="each kernel is side x side")
    ap.add_argument("--steps", type=int, default=3, help="steps of each run (>= 2)")
    ap.add_argument("--buffers", type=int, default=4, help="the NVMe window's buffer_count")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the state's file goes")
    ap.add_argument("--out", help="also write the table to this .md file")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step compiles, the table times the rest")
    per_leaf = STATE_BYTES * args.side**2
    leaves = max(1, round(args.gb * 1e9 / per_leaf))
    rng = np.random.default_rng(0)
    params = {
        f"w{i:03d}": (rng.standard_normal((args.side, args.side)) * 0.02).astype(np.float32)
        for i in range(leaves)
    }
    batch = {"x": rng.standard_normal((8, args.side)).astype(np.float32)}
    precision = jz.Precision("bfloat16", "float32", "bfloat16")
    mesh = jz.data_parallel_mesh(1)
    tx = optax.adam(1e-3)
    root = tempfile.mkdtemp(prefix="jaxzero-nvme-train-", dir=args.dir)
    try:
        nvme = jz.NVMe(root, buffer_count=args.buffers, buffer_mb=per_leaf / 2**20)
        disk_zero = jz.ZeRO(tx, mesh, stage=1, offload=nvme, precision=precision)
        disk = train(disk_zero, params, batch, args.steps)
        on_disk = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    host_zero = jz.ZeRO(tx, mesh, stage=1, offload="optimizer", precision=precision)
    host = train(host_zero, params, batch, args.steps)

    window = args.buffers * per_leaf
    compute = 2 * leaves * args.side**2  # the bf16 compute params
    diff = max(float(np.max(np.abs(disk[2][k] - host[2][k]))) for k in params)
    differ = sum(int(np.sum(disk[2][k] != host[2][k])) for k in params)
    gb = lambda n: f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.1f} MB"
    median = lambda s: statistics.median(s[1:])  # the first step compiles
    lines = [
        "`" + " ".join(["python benchmarks/nvme_train.py", *(argv or sys.argv[1:])]) + "`",
        "",
        f"{leaves} kernels of {args.side} x {args.side} ({leaves * args.side**2:,} params), "
        f"bf16 compute params on one simulated CPU device, fp32 master, Adam; "
        f"{args.steps} steps per run; state file under {args.dir}; "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, jax {jax.__version__}; "
        f"{datetime.date.today()}.",
        "",
        f"State on disk {gb(on_disk)}; the window {gb(window)} ({args.buffers} buffers); "
        f"the compute params {gb(compute)}.",
        "",
        "| phase | nvme: peak above the run's start | host: peak above the run's start |",
        "|---|---|---|",
    ]
    names = ["init"] + [f"step {i + 1}" for i in range(args.steps)]
    for name, a, b in zip(names, disk[0], host[0], strict=True):
        lines.append(f"| {name} | {gb(a)} | {gb(b)} |")
    saved = max(host[0]) - max(disk[0])
    lines += [
        "",
        f"The runs' peaks: nvme {gb(max(disk[0]))}, host {gb(max(host[0]))}; the host run "
        f"holds {gb(saved)} more, against the state on disk less the window, "
        f"{gb(on_disk - window)}. The state on disk is {on_disk / window:.1f}x the window.",
        "",
        f"Median step after the first: nvme {median(disk[1]):.2f} s, host "
        f"{median(host[1]):.2f} s: host / nvme {median(host[1]) / median(disk[1]):.2f}x "
        f"(the disk moves {gb(2 * on_disk)} a step: "
        f"{2 * on_disk / 1e9 / median(disk[1]):.2f} GB/s of step time).",
        "",
        f"Final params: {differ:,} of {leaves * args.side**2:,} differ between the runs, "
        f"by at most {diff:.3g}.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
