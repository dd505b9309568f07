"""Benchmark: replicated model EMA vs jaxzero's sharded EMA (and the one-off gather).

    python benchmarks/ema.py            # ~20M floats in 54 leaves, 5 rounds x 4 timed runs
    python benchmarks/ema.py --quick    # CI smoke: small tree, 1 round x 3 timed runs

Times, under ``jax.jit`` with ``block_until_ready``:

  (a) a replicated EMA: ``jax.tree.map(lambda e, p: d * e + (1 - d) * p, ema, params)`` on
      arrays replicated on every device (what a plain data-parallel EMA does);
  (b) jaxzero's per-leaf sharded EMA, ``ZeRO.update_ema`` (a ``shard_map`` over the EMA's
      shards): stage 2 (master and EMA both sharded 1/N, as ZeRO lays them out) and stage 0
      (replicated master, each device slicing its part; EMA sharded);
  (b') the same with ``ShardedEMA(bucket_leaves_up_to=K)`` (``--bucket``, default 4096): the
      EMA of every leaf with at most K elements per device in one ``[N, L]`` bucket, updated
      in one elementwise loop per device;
  (c) the one-off ``jz.gather(state.ema)`` that assembles the full EMA for eval/export
      (first call, compile included, and the median of repeated calls), per-leaf and bucketed.

(a), (b) and (b') are timed round-robin: in each round every case runs ``reps / rounds``
times in turn, so load drift on a shared machine hits all of them alike. Reported: the
median and min over all runs, each round's median, and for every ratio both the ratio of
the overall medians, the ratio of the mins (``*_of_mins``) and the median over rounds of the
same-round ratio (``*_per_round``, the headline). The acceptance ratio is (a) / (b') stage 2.

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

from jaxzero.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices()  # 8 simulated CPU devices unless XLA_FLAGS names a count

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
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


DEFAULT_BUCKET = 4096


def round_robin(cases: dict, *, rounds: int, per_round: int, warmup: int) -> dict:
    """Time every case ``per_round`` times per round, cases in turn, for ``rounds`` rounds.

    ``cases[name] = [fn, args]``; the first argument is donated and replaced by the output.
    Returns ``{name: [[ms, ...] per round]}``.
    """
    for fn, args in cases.values():
        for _ in range(warmup):  # the first call compiles
            args[0] = jax.block_until_ready(fn(*args))
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for k, (fn, args) in cases.items():
            this = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                args[0] = jax.block_until_ready(fn(*args))
                this.append((time.perf_counter() - t0) * 1e3)
            times[k].append(this)
    return times


def summary(rounds_ms: list[list[float]]) -> dict:
    flat = [t for r in rounds_ms for t in r]
    return {
        "median_ms": statistics.median(flat),
        "min_ms": min(flat),
        "reps": len(flat),
        "round_medians_ms": [statistics.median(r) for r in rounds_ms],
    }


def timeit(fn, args, *, reps: int, warmup: int) -> dict:
    """Median/min wall time in ms of ``fn(*args)`` (nothing donated)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "reps": reps}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small tree, few runs (CI smoke)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs (default 20, quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds (5, quick 1)")
    ap.add_argument(
        "--bucket",
        type=int,
        default=DEFAULT_BUCKET,
        help=f"bucket_leaves_up_to for (b'), elements per device (default {DEFAULT_BUCKET})",
    )
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ema.json)")
    args = ap.parse_args(argv)

    reps = args.reps or (3 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 5)
    per_round = max(1, -(-reps // rounds))
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

    # (a) replicated EMA on replicated arrays; (b) per-leaf and (b') bucketed sharded EMAs,
    # stage 2 (sharded master) and stage 0 (replicated master).
    from common import replicated_ema_update, sharded_ema_case

    rep_ema = replicated_ema_update(DECAY)
    cases = {"a_replicated": [rep_ema, [jax.device_put(host, replicated), params]]}
    bucket_info = None
    for prefix, ema in (
        ("b_sharded", jz.ShardedEMA(DECAY)),
        ("b_bucketed", jz.ShardedEMA(DECAY, bucket_leaves_up_to=args.bucket)),
    ):
        for stage in (2, 0):
            upd, upd_args = sharded_ema_case(mesh, params, ema, stage)
            cases[f"{prefix}_stage{stage}"] = [upd, upd_args]
            ema_tree = upd_args[0].ema
            if isinstance(ema_tree, jz.BucketedTree):
                layout = ema_tree.layout
                bucket_info = {
                    "bucket_leaves_up_to": args.bucket,
                    "leaves_in_bucket": len(layout.bucketed),
                    "leaves_per_leaf": len(layout.offsets) - len(layout.bucketed),
                    "bucket_floats_per_device": layout.length,
                }

    times = round_robin(cases, rounds=rounds, per_round=per_round, warmup=warmup)
    rows = {k: summary(v) for k, v in times.items()}
    finals = {k: args_[0] for k, (_, args_) in cases.items()}
    final_a = finals["a_replicated"]
    rows["a_replicated"]["ema_bytes_per_device"] = max(device_bytes(final_a).values())
    for k, final in finals.items():
        if k == "a_replicated":
            continue
        rows[k]["ema_bytes_per_device"] = max(device_bytes(final.ema).values())
        # Same number of updates from the same start: the EMAs must agree.
        got = jz.gather(final)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(final_a), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)

    # (c) the one-off gather of the sharded EMA (per-leaf and bucketed, stage 2).
    for key, final in (
        ("c_gather", finals["b_sharded_stage2"]),
        ("c_gather_bucketed", finals["b_bucketed_stage2"]),
    ):
        t0 = time.perf_counter()
        jax.block_until_ready(jz.gather(final))
        first_ms = (time.perf_counter() - t0) * 1e3
        res = timeit(lambda e: jz.gather(e), (final,), reps=reps, warmup=0)
        rows[key] = {**res, "first_call_ms": first_ms}
    # For reference: the bare all-gather of the per-leaf tree through one jit.
    per_leaf = finals["b_sharded_stage2"].ema
    full = jax.tree.map(lambda _: replicated, per_leaf)
    reused = jax.jit(lambda t: t, out_shardings=full)
    rows["c_gather_reused_jit"] = timeit(reused, (per_leaf,), reps=reps, warmup=warmup)

    a = rows["a_replicated"]
    ratios, per_round_ratios = {}, {}
    for prefix, short in (("b_sharded", "b"), ("b_bucketed", "bb")):
        for s in (2, 0):
            b = rows[f"{prefix}_stage{s}"]
            key = f"a_over_{short}_stage{s}"
            ratios[key] = a["median_ms"] / b["median_ms"]
            per_round_ratios[key] = [
                x / y for x, y in zip(a["round_medians_ms"], b["round_medians_ms"], strict=True)
            ]
            ratios[f"{key}_per_round"] = statistics.median(per_round_ratios[key])
            ratios[f"{key}_of_mins"] = a["min_ms"] / b["min_ms"]

    print()
    if bucket_info is not None:
        print(
            f"bucket_leaves_up_to={args.bucket}: {bucket_info['leaves_in_bucket']} leaves in "
            f"the bucket ({bucket_info['bucket_floats_per_device']} floats/device), "
            f"{bucket_info['leaves_per_leaf']} per-leaf"
        )
    print(f"timing: {rounds} round-robin rounds x {per_round} runs per case")
    print(f"{'case':<42}{'median ms':>11}{'min ms':>10}{'EMA MiB/device':>16}")
    labels = {
        "a_replicated": "(a) replicated tree.map EMA",
        "b_sharded_stage2": "(b) sharded EMA, stage 2",
        "b_sharded_stage0": "(b) sharded EMA, stage 0",
        "b_bucketed_stage2": "(b') bucketed sharded EMA, stage 2",
        "b_bucketed_stage0": "(b') bucketed sharded EMA, stage 0",
        "c_gather": "(c) gather(state.ema), repeated",
        "c_gather_bucketed": "(c) gather, bucketed, repeated",
        "c_gather_reused_jit": "(c) bare all-gather, one jit",
    }
    for key, label in labels.items():
        r = rows[key]
        mib = r.get("ema_bytes_per_device")
        mib = f"{mib / 2**20:16.2f}" if mib is not None else f"{'':>16}"
        print(f"{label:<42}{r['median_ms']:11.2f}{r['min_ms']:10.2f}{mib}")
    for key, label in (("c_gather", "(c) gather"), ("c_gather_bucketed", "(c) gather, bucketed")):
        print(f"{label + ', first call (compile)':<42}{rows[key]['first_call_ms']:11.2f}")
    print()
    names = {
        "a_over_b_stage2": "a / b  stage 2 (per-leaf)",
        "a_over_b_stage0": "a / b  stage 0 (per-leaf)",
        "a_over_bb_stage2": "a / b' stage 2 (bucketed)",
        "a_over_bb_stage0": "a / b' stage 0 (bucketed)",
    }
    for key, label in names.items():
        rounds_txt = " ".join(f"{x:.2f}" for x in per_round_ratios[key])
        print(
            f"ratio {label}: {ratios[key + '_per_round']:.2f}x median of rounds [{rounds_txt}], "
            f"{ratios[key]:.2f}x of medians, {ratios[key + '_of_mins']:.2f}x of mins"
        )
    acceptance = ratios["a_over_bb_stage2_per_round"]
    print(f"acceptance (a / b' stage 2, median of per-round ratios, >= 5x): {acceptance:.2f}x")

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
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
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
        "rounds": rounds,
        "runs_per_round": per_round,
        "bucket": bucket_info,
        "results": rows,
        "ratios": ratios,
        "per_round_ratios": per_round_ratios,
        "acceptance_ratio": acceptance,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
