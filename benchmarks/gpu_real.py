"""On a real GPU: the EMA's kernel launches, timed, and the deviceless compile checked against
the real one (issue 15).

    python benchmarks/gpu_real.py            # needs a GPU (jax with its CUDA plugin)
    python benchmarks/gpu_real.py --out benchmarks/results/gpu_real.md

On the GPUs attached to this process (a ``data`` mesh over all of them), for the 350-leaf
YOLOv5s-shaped tree of :func:`jaxzero.gpu.models.detector_tree` (31.6M floats):

  (a) a replicated EMA, ``jax.tree.map(lambda e, p: d * e + (1 - d) * p, ema, params)`` under
      ``jax.jit`` (what a plain data-parallel EMA does: a kernel per leaf);
  (b) jaxzero's sharded EMA stored per leaf (``bucket_leaves_up_to=0``);
  (c) jaxzero's sharded EMA in rows (the GPU default): a few kernels.

Each is timed as the median over rounds of 50 back-to-back jitted updates (state donated,
``block_until_ready`` at the end of a round), with the ratio to (a) from the same process.
Each program's kernel count is read from the HLO the real GPU compiled and from the HLO that
XLA:GPU compiles for the same program on compile-only devices of the same kind
(:func:`jaxzero.gpu.compile_only_mesh`, what CI checks without a GPU); they should agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import gpu  # noqa: E402
from jaxzero.gpu.models import detector_tree  # noqa: E402

DECAY = 0.999


ROWS = None  # the rows case's bucket_leaves_up_to (None: the GPU default, every leaf)


def _programs(mesh, tree):
    """``{case: (jitted update, args builder)}`` on ``mesh`` for abstract or concrete runs."""
    zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=2)
    rep = NamedSharding(mesh, P())
    out = {
        "replicated tree.map": (
            jax.jit(
                lambda e, p: jax.tree.map(lambda e, p: DECAY * e + (1 - DECAY) * p, e, p),
                donate_argnums=0,
            ),
            lambda params: tuple(
                jax.tree.map(lambda x: jax.device_put(np.asarray(x), rep), params) for _ in "ep"
            ),
        )
    }
    flat = sum(x.size for x in jax.tree.leaves(tree))
    out["bound: one flat array"] = (
        jax.jit(lambda e, p: DECAY * e + (1 - DECAY) * p, donate_argnums=0),
        lambda params: (jnp.zeros((flat,), jnp.float32), jnp.ones((flat,), jnp.float32)),
    )
    for name, k in (("jaxzero per leaf", 0), ("jaxzero rows", ROWS)):
        ema = jz.ShardedEMA(DECAY, bucket_leaves_up_to=k)
        fn = jax.jit(
            lambda s, m, z=zero, em=ema: z.update_ema(em, s, m, step=None, apply=True),
            donate_argnums=0,
        )

        def args(params, z=zero, em=ema):
            # The master shards the optimizer just wrote (what the train step hands the EMA).
            master = jax.device_put(params, jz.zero.specs.named(z.mesh, z.shard_specs(params)))
            return z.init(params, ema=em).ema, master

        out[name] = (fn, args)
    return zero, out


def _abstract_args(mesh, tree, case):
    zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=2)
    if case == "bound: one flat array":
        flat = sum(x.size for x in jax.tree.leaves(tree))
        return (jax.ShapeDtypeStruct((flat,), jnp.float32),) * 2
    if case == "replicated tree.map":
        rep = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
            tree,
        )
        return rep, rep
    ema = jz.ShardedEMA(DECAY, bucket_leaves_up_to=0 if case == "jaxzero per leaf" else ROWS)
    master = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        zero.shard_specs(tree),
    )
    return zero.abstract_state(tree, ema=ema).ema, master


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="write the table (markdown) here too")
    ap.add_argument("--cpu", action="store_true", help="smoke-run on the CPU devices")
    ap.add_argument(
        "--leaves-per-row",
        type=int,
        default=None,
        help="rows of this many leaves (default jaxzero.ema.ema.LEAVES_PER_ROW)",
    )
    ap.add_argument(
        "--bucket", type=int, default=None, help="the rows case's bucket_leaves_up_to (all)"
    )
    args = ap.parse_args(argv)
    global ROWS
    ROWS = args.bucket
    if args.leaves_per_row:
        from jaxzero.ema import ema as sharded_ema

        sharded_ema.LEAVES_PER_ROW = args.leaves_per_row
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus and not args.cpu:
        print("no GPU attached: run this on a GPU machine (jax with its CUDA plugin)")
        return 2
    devs = gpus or jax.devices()
    n = len(devs)
    mesh = jz.data_parallel_mesh(n)
    tree = detector_tree()
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), tree)
    _, programs = _programs(mesh, tree)
    kind = "h200" if "H200" in devs[0].device_kind else "h100"
    try:
        deviceless = gpu.compile_only_mesh(kind, n)
        _, dl_programs = _programs(deviceless, tree)
    except Exception as e:  # the compile-only plugin may refuse next to real GPUs
        deviceless, why = None, f"n/a ({type(e).__name__}: {str(e)[:60]})"
    rows, times = [], {}
    for case, (fn, build) in programs.items():
        state, other = build(params)
        real_hlo = fn.lower(state, other).compile().as_text()
        if deviceless is None:
            dl_kernels = why
        else:
            dl_fn = dl_programs[case][0]
            dl = dl_fn.lower(*_abstract_args(deviceless, tree, case)).compile().as_text()
            dl_kernels = gpu.kernels_per_step(dl)
        state = fn(state, other)  # compile and warm up
        jax.block_until_ready(state)
        per_round = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.reps):
                state = fn(state, other)
            jax.block_until_ready(state)
            per_round.append((time.perf_counter() - t0) / args.reps * 1e6)
        times[case] = statistics.median(per_round)
        rows.append((case, gpu.kernels_per_step(real_hlo), dl_kernels, times[case]))
    base = times["replicated tree.map"]
    from jaxzero.ema import ema as sharded_ema

    lines = [
        f"rows of at most {sharded_ema.LEAVES_PER_ROW} leaves, bucket_leaves_up_to={ROWS}. "
        f"EMA update of a 350-leaf YOLOv5s-shaped tree (31.6M floats) on {n} x "
        f"{devs[0].device_kind}, jax {jax.__version__}: median of {args.rounds} rounds x "
        f"{args.reps} updates ({devs[0].platform})",
        "",
        "| case | kernels (real compile) | kernels (deviceless compile) | us per update | "
        "vs replicated |",
        "|---|---|---|---|---|",
    ]
    for case, k, dk, t in rows:
        lines.append(f"| {case} | {k} | {dk} | {t:.1f} | {base / t:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
