"""The host Adam table: one AdamW step on the same fp32 state, on this machine's CPU, in one
process, beside the memory-bandwidth bound (issue 41, decision 32).

    taskset -c 0,1 python benchmarks/offload.py --threads 2 --out benchmarks/results/offload.md

Rows, each ``lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01`` on one flat fp32
tensor of ``--params`` elements (params, gradient, mu, nu: 16 bytes per parameter):

- jaxzero's host update: ``jax.jit`` of ``optax.adamw``'s update + ``apply_updates`` with the
  params and the optimizer state donated, on XLA:CPU (what an update on the host CPU
  compiles to; ``ZeRO(offload=...)`` streams the state through the GPU instead and updates
  it there, decision 32);
- ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (``adamw_mode=True``; JIT-built on first use:
  set ``TORCH_EXTENSIONS_DIR`` to keep the build);
- ``torch.optim.AdamW(fused=True)`` and ``torch.optim.AdamW(foreach=True)``.

Threads: ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` get ``--threads``; XLA:CPU sizes
its thread pool from the CPUs the process may run on, so pin the process with ``taskset``
to that many CPUs. Each row is the median (and the minimum) of ``--steps`` timed steps after
two untimed ones. The bound: an AdamW step reads params, gradient, mu and nu (16 bytes per
parameter) and writes params, mu and nu (12 bytes); at the copy bandwidth measured in the same
run (``numpy.copyto`` of 1.6 GB, read + write bytes over time) that is the fastest any
implementation could go.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
TRAFFIC = 28  # bytes per parameter per step: read p, g, mu, nu; write p, mu, nu


def _times(step, sync, steps: int) -> list[float]:
    for _ in range(2):
        step()
    sync()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        out.append(time.perf_counter() - t)
    return out


def copy_bandwidth(n: int, steps: int) -> float:
    """Bytes per second read + written by a large ``numpy.copyto``."""
    import numpy as np

    src, dst = np.ones(4 * n, np.float32), np.empty(4 * n, np.float32)
    ts = _times(lambda: np.copyto(dst, src), lambda: None, steps)
    return 2 * src.nbytes / min(ts)


def jax_adamw(p0, g0, steps: int) -> tuple[list[float], int]:
    """The timings, and how many loops over the state XLA:CPU compiled the update into (the
    entry's fusions with a state-sized result)."""
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)

    def update(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, g = jnp.asarray(p0), jnp.asarray(g0)
    box = [p, tx.init(p)]
    fn = jax.jit(update, donate_argnums=(0, 1)).lower(box[0], box[1], g).compile()
    stats = fn.memory_analysis()
    assert stats.temp_size_in_bytes < 1024, stats  # in place: no state-sized temporary

    entry = fn.as_text().split("ENTRY")[1]
    head = lambda line: line.split(" fusion(")[0]
    loops = sum(f"f32[{p0.size}]" in head(x) for x in entry.splitlines() if " fusion(" in x)

    def step():
        box[0], box[1] = fn(box[0], box[1], g)

    return _times(step, lambda: jax.block_until_ready(box[0]), steps), loops


def torch_rows(p0, g0, steps: int) -> dict[str, list[float]]:
    import torch

    def run(make):
        p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
        p.grad = torch.from_numpy(g0.copy())
        opt = make([p])
        with torch.no_grad():
            return _times(opt.step, lambda: None, steps)

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return {
        "DeepSpeedCPUAdam": run(lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **kw)),
        "torch AdamW fused=True": run(lambda ps: torch.optim.AdamW(ps, fused=True, **kw)),
        "torch AdamW foreach=True": run(lambda ps: torch.optim.AdamW(ps, foreach=True, **kw)),
    }


def table(rows: dict[str, list[float]], n: int, bandwidth: float) -> list[str]:
    bound = TRAFFIC / bandwidth * 1e9
    base = statistics.median(rows["DeepSpeedCPUAdam"]) / n * 1e9
    lines = [
        "| implementation | ns/param (median) | ns/param (min) | / DeepSpeedCPUAdam | / bound |",
        "|---|---|---|---|---|",
    ]
    for name, ts in rows.items():
        med, low = statistics.median(ts) / n * 1e9, min(ts) / n * 1e9
        lines.append(f"| {name} | {med:.2f} | {low:.2f} | {med / base:.2f}x | {med / bound:.2f}x |")
    lines.append(f"| bound: {TRAFFIC} B/param at the copy bandwidth | {bound:.2f} | | | 1.00x |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=50_331_648, help="fp32 elements (>= 50M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--out", help="write the table as markdown here")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    cpus = len(os.sched_getaffinity(0))
    if cpus != args.threads:
        print(
            f"warning: {cpus} CPUs allowed, {args.threads} threads asked: XLA:CPU uses "
            f"{cpus}; run under taskset -c 0-{args.threads - 1}",
            file=sys.stderr,
        )
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(args.params, dtype=np.float32)
    g0 = rng.standard_normal(args.params, dtype=np.float32)
    bandwidth = copy_bandwidth(args.params, args.steps)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax_times, loops = jax_adamw(p0, g0, args.steps)
    rows = {"jaxzero host update (jit adamw, donated, XLA:CPU)": jax_times}
    rows.update(torch_rows(p0, g0, args.steps))
    import deepspeed
    import jax

    head = [
        "# Host AdamW step, one process, same fp32 state and threads",
        "",
        f"Command: `{' '.join(['python', *sys.argv])}`.",
        f"{args.params:,} fp32 params (16 bytes each of params, gradient, mu, nu); "
        f"{args.threads} threads (OMP_NUM_THREADS, torch.set_num_threads; XLA:CPU: the "
        f"{cpus} CPUs the process may use); median and min of {args.steps} steps. "
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"shared with other work (load {os.getloadavg()[0]:.1f}); copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (read + write). jax {jax.__version__}, torch "
        f"{torch.__version__}, DeepSpeed {deepspeed.__version__}. XLA:CPU compiles the "
        f"jitted update into {loops} loops over the state (fusions with a state-sized "
        f"result), each reading and writing memory; DeepSpeedCPUAdam makes one pass.",
        "",
    ]
    text = "\n".join(head + table(rows, args.params, bandwidth)) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
