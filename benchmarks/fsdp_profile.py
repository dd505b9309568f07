"""Why "FSDP by annotation" steps faster than jaxzero on simulated CPU devices (issue 8, point 3).

    python benchmarks/fsdp_profile.py           # run.py's full model (25M params), ~3 min
    python benchmarks/fsdp_profile.py --quick   # run.py's quick model

Compiles hand-written DP, GSPMD-annotation FSDP and jaxzero stages 2/3 (fp32) exactly as
``benchmarks/run.py`` builds them, then prints per configuration: XLA's per-device
``cost_analysis()`` (flops, bytes accessed), the distinct matmul output shapes in the compiled
HLO (a ``[local batch tokens, …]`` shape is data parallelism; ``[global batch tokens, …]`` with
a weight dimension divided by N is tensor parallelism), and the median step time over
interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

from jaxzero.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices()  # 8 simulated CPU devices unless XLA_FLAGS names a count
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxzero as jz  # noqa: E402


def main(argv=None) -> None:
    import run as R
    from common import init_params, make_batch, make_loss

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    spec = R.MODELS["quick" if args.quick else "full"]
    cfg, seq, gbatch = spec["cfg"], spec["seq"], spec["batch"]
    mesh = jz.data_parallel_mesh(8)
    params_host = jax.device_get(init_params(cfg, seq))
    params_abs = jax.eval_shape(lambda: params_host)
    _, loss_fn = make_loss(cfg)
    batch = jax.device_put(make_batch(cfg, gbatch, seq), NamedSharding(mesh, P("data")))
    tx = optax.adam(1e-3)
    configs = [
        R.baseline_config("dp", loss_fn, tx, mesh, params_abs),
        R.baseline_config("fsdp", loss_fn, tx, mesh, params_abs),
        R.zero_config(2, "fp32", loss_fn, tx, mesh, params_abs),
        R.zero_config(3, "fp32", loss_fn, tx, mesh, params_abs),
    ]
    exe, states = {}, {}
    print(f"model: d={cfg.d_model} L={cfg.layers} vocab={cfg.vocab}, {gbatch}x{seq} tokens")
    for c in configs:
        states[c.name] = c.init(params_host)
        exe[c.name] = c.lower(states[c.name], batch).compile()
        cost = exe[c.name].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        dots = sorted(
            set(re.findall(r"= f32(\[[0-9,]*\])\S* (?:dot|convolution)\(", exe[c.name].as_text()))
        )
        print(
            f"{c.name:>11}: flops {cost.get('flops', 0):.3g}, bytes accessed "
            f"{cost.get('bytes accessed', 0) / 1e9:.2f} GB; matmul shapes {' '.join(dots)}"
        )
    times = {c.name: [] for c in configs}
    for _ in range(args.rounds + 1):
        for c in configs:
            t0 = time.perf_counter()
            out, _ = c.call(exe[c.name], states[c.name], batch)
            jax.block_until_ready(out)
            times[c.name].append(time.perf_counter() - t0)
            states[c.name] = out
    dp = statistics.median(times["dp"][1:])
    for name, t in times.items():
        med = statistics.median(t[1:])
        print(f"{name:>11}: median step {1e3 * med:.0f} ms ({med / dp:.2f}x DP)")


if __name__ == "__main__":
    main()
