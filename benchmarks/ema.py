"""Benchmark: replicated model EMA vs jaxzero's sharded EMA (and the one-off gather).

    python benchmarks/ema.py            # ~20M floats in ~50 leaves, 20 timed runs
    python benchmarks/ema.py --quick    # CI smoke: small tree, 3 timed runs

Times, under ``jax.jit`` with ``block_until_ready`` (median after warm-up):

  (a) a replicated EMA: ``jax.tree.map(lambda e, p: d * e + (1 - d) * p, ema, params)`` on
      arrays replicated on every device (what a plain data-parallel EMA does);
  (b) jaxzero's sharded EMA, ``ZeRO.update_ema`` (a ``shard_map`` over the EMA's shards):
      stage 2 (master and EMA both sharded 1/N, as ZeRO lays them out) and stage 0
      (replicated master, each device slicing its part; EMA sharded);
  (c) the one-off ``jz.gather(state.ema)`` that assembles the full EMA for eval/export
      (first call, compile included, and the median of repeated calls).

Without ``XLA_FLAGS`` naming a host device count, 8 simulated CPU devices are used. Writes
``benchmarks/results/ema.json`` (``ema_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero.memory import device_bytes  # noqa: E402

DECAY = 0.999


def make_tree(d_model: int, layers: int, vocab: int, seed: int = 0) -> dict:
    """A transformer-shaped float32 tree: per layer qkv/out/fc1/fc2 matrices, their biases and
    two layer norms (12 leaves), plus an embedding, a 17-way head, and small odd leaves
    ((3,), (31,), (33, 31)) that no device count divides (replicated by ZeRO)."""
    rng = np.random.default_rng(seed)

    def arr(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    tree = {"embed": arr(vocab, d_model)}
    for i in range(layers):
        tree[f"layer{i}"] = {
            "qkv": {"kernel": arr(d_model, 3 * d_model), "bias": arr(3 * d_model)},
            "out": {"kernel": arr(d_model, d_model), "bias": arr(d_model)},
            "fc1": {"kernel": arr(d_model, 4 * d_model), "bias": arr(4 * d_model)},
            "fc2": {"kernel": arr(4 * d_model, d_model), "bias": arr(d_model)},
            "ln1": {"scale": arr(d_model), "bias": arr(d_model)},
            "ln2": {"scale": arr(d_model), "bias": arr(d_model)},
        }
    tree["head"] = {"kernel": arr(d_model, 17), "bias": arr(17)}
    tree["odd"] = {"tiny": arr(3), "bias31": arr(31), "mat": arr(33, 31)}
    return tree


def timeit(fn, args, *, reps: int, warmup: int, feed_back: bool) -> dict:
    """Median/min wall time in ms of ``fn(*args)``; with ``feed_back`` the first argument is
    replaced by the output (it is donated)."""
    args = list(args)
    for _ in range(warmup):
        out = jax.block_until_ready(fn(*args))
        if feed_back:
            args[0] = out
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
        if feed_back:
            args[0] = out
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "reps": reps,
        "_out": out,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small tree, few runs (CI smoke)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs (default 20, quick 3)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ema.json)")
    args = ap.parse_args(argv)

    reps = args.reps or (3 if args.quick else 20)
    warmup = 1 if args.quick else 3
    d_model, layers, vocab = (64, 2, 100) if args.quick else (640, 4, 1000)
    here = os.path.dirname(os.path.abspath(__file__))
    out_path = args.out or os.path.join(
        here, "results", "ema_quick.json" if args.quick else "ema.json"
    )

    mesh = jz.data_parallel_mesh()
    n = mesh.shape["data"]
    host = make_tree(d_model, layers, vocab)
    leaves = jax.tree.leaves(host)
    floats = sum(x.size for x in leaves)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(host, replicated)
    print(
        f"devices: {n} x {jax.devices()[0].platform}, cpus: {os.cpu_count()}, jax {jax.__version__}"
    )
    print(
        f"tree: {floats / 1e6:.2f}M floats in {len(leaves)} leaves ({4 * floats / 2**20:.1f} MiB fp32)"
    )

    rows = {}

    # (a) replicated EMA on replicated arrays.
    rep_ema = jax.jit(
        lambda e, p: jax.tree.map(lambda e, p: DECAY * e + (1.0 - DECAY) * p, e, p),
        donate_argnums=0,
    )
    ema_a = jax.device_put(host, replicated)
    res = timeit(rep_ema, (ema_a, params), reps=reps, warmup=warmup, feed_back=True)
    final_a = res.pop("_out")
    rows["a_replicated"] = {**res, "ema_bytes_per_device": max(device_bytes(final_a).values())}

    # (b) jaxzero's sharded EMA: stage 2 (sharded master) and stage 0 (replicated master).
    ema = jz.ShardedEMA(DECAY)
    gather_state = None
    for stage in (2, 0):
        zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=stage)
        state = zero.init(params, ema=ema)
        master = jax.jit(zero.master_view)(state)
        step = jnp.asarray(1, jnp.int32)
        upd = jax.jit(
            lambda e, m, t, zero=zero: zero.update_ema(ema, e, m, step=t, apply=True),
            donate_argnums=0,
        )
        res = timeit(upd, (state.ema, master, step), reps=reps, warmup=warmup, feed_back=True)
        final_b = res.pop("_out")
        rows[f"b_sharded_stage{stage}"] = {
            **res,
            "ema_bytes_per_device": max(device_bytes(final_b.ema).values()),
        }
        # Same number of updates from the same start: the EMAs must agree.
        got = jz.gather(final_b)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(final_a), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
        if stage == 2:
            gather_state = final_b

    # (c) the one-off gather of the sharded EMA.
    t0 = time.perf_counter()
    jax.block_until_ready(jz.gather(gather_state))
    first_ms = (time.perf_counter() - t0) * 1e3
    res = timeit(lambda e: jz.gather(e), (gather_state,), reps=reps, warmup=0, feed_back=False)
    res.pop("_out")
    rows["c_gather"] = {**res, "first_call_ms": first_ms}
    # For reference: the same all-gather through one jit reused across calls (jz.gather builds
    # a new jax.jit per call, so each of its calls above traces and compiles again).
    full = jax.tree.map(lambda _: replicated, gather_state.ema)
    reused = jax.jit(lambda t: t, out_shardings=full)
    res = timeit(reused, (gather_state.ema,), reps=reps, warmup=warmup, feed_back=False)
    res.pop("_out")
    rows["c_gather_reused_jit"] = res

    a = rows["a_replicated"]["median_ms"]
    ratios = {f"a_over_b_stage{s}": a / rows[f"b_sharded_stage{s}"]["median_ms"] for s in (2, 0)}

    print()
    print(f"{'case':<34}{'median ms':>11}{'min ms':>10}{'EMA MiB/device':>16}")
    labels = {
        "a_replicated": "(a) replicated tree.map EMA",
        "b_sharded_stage2": "(b) sharded EMA, stage 2",
        "b_sharded_stage0": "(b) sharded EMA, stage 0",
        "c_gather": "(c) gather(state.ema), repeated",
        "c_gather_reused_jit": "(c) same all-gather, reused jit",
    }
    for key, label in labels.items():
        r = rows[key]
        mib = r.get("ema_bytes_per_device")
        mib = f"{mib / 2**20:16.2f}" if mib is not None else f"{'':>16}"
        print(f"{label:<34}{r['median_ms']:11.2f}{r['min_ms']:10.2f}{mib}")
    print(f"{'(c) gather, first call (compile)':<34}{rows['c_gather']['first_call_ms']:11.2f}")
    print()
    for k, v in ratios.items():
        print(f"ratio {k.replace('_', ' ')}: {v:.2f}x")

    result = {
        "benchmark": "ema",
        "quick": args.quick,
        "machine": {
            "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind,
            "device_count": jax.device_count(),
            "cpu_count": os.cpu_count(),
            "host": platform.machine(),
            "python": platform.python_version(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        },
        "jax_version": jax.__version__,
        "jaxzero_version": jz.__version__,
        "tree": {
            "floats": int(floats),
            "leaves": len(leaves),
            "fp32_bytes": int(4 * floats),
            "d_model": d_model,
            "layers": layers,
            "vocab": vocab,
        },
        "decay": DECAY,
        "warmup": warmup,
        "results": rows,
        "ratios": ratios,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
