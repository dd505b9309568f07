"""One process of the multi-process tests (tests/test_multiprocess.py).

    python -m jaxzero.cli.launch --processes 2 --devices-per-process 4 tests/mp_worker.py \\
        --out DIR [--steps 10] [--ckpt DIR --save-at 5] [--resume] [--die-at K]

Trains an MLP (jaxzero.gpu.models, hidden width 32 so that most leaves are sharded; stage 2,
adam, ShardedEMA) on the mesh of every device of every process, each process feeding only
its rows of the global batch (jaxzero.distributed.global_batch), and writes
``DIR/p{process}.npz`` with the gathered params and EMA (keys ``params/...``, ``ema/...``,
plus ``step`` and ``ema_updates``). With ``--ckpt`` it saves a checkpoint at ``--save-at``
(waiting for it); with ``--resume`` it restores the newest checkpoint first and trains only the
remaining steps; with ``--die-at K`` process ``--die-process`` (default 1) SIGKILLs itself in
step K (after placing the step's batch, before its collectives), as a crashed host would.
``--check-mismatch`` reports that process-dependent params are refused.
``import mp_worker`` has no side effect (the test uses ``build`` for its reference run).
"""

import argparse
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jaxzero as jz  # noqa: E402
from jaxzero import checkpoint as ck  # noqa: E402
from jaxzero import distributed as dist  # noqa: E402
from jaxzero.gpu.models import MLP  # noqa: E402

BATCH = 32


def problem(steps=10, seed=0):
    """An MLP 17 -> 32 -> 5: fc1 and fc2's kernel shard over 8 (and 4) devices, fc2's bias
    (5) is replicated, so both kinds of leaves cross the process boundary."""
    model = MLP(hidden=32)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 17)))["params"]

    def loss_fn(p, b):
        return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    rng = np.random.default_rng(seed)
    batches = [
        {
            "x": rng.normal(size=(BATCH, 17)).astype(np.float32),
            "y": rng.normal(size=(BATCH, 5)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return params, loss_fn, batches


def build(num_devices=None):
    """(params, batches, zero, ema, step) of the test problem on ``num_devices`` (all)."""
    params, loss_fn, batches = problem()
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(num_devices), stage=2)
    ema = jz.ShardedEMA(0.9)
    step = jz.make_train_step(loss_fn, zero, ema=ema)
    return params, batches, zero, ema, step


def flat(prefix, tree):
    return {
        prefix + jax.tree_util.keystr(k): v
        for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def main() -> int:
    t0 = time.monotonic()
    multi = dist.initialize()  # before anything starts a jax backend
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ckpt")
    ap.add_argument("--save-at", type=int, default=5)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--die-at", type=int)
    ap.add_argument("--die-process", type=int, default=1)
    ap.add_argument("--check-mismatch", action="store_true")
    args = ap.parse_args()

    me, nproc = jax.process_index(), jax.process_count()
    print(
        f"process {me}/{nproc}: {jax.local_device_count()} local of {jax.device_count()} "
        f"devices, distributed={multi}, ready in {time.monotonic() - t0:.1f}s",
        flush=True,
    )
    params, batches, zero, ema, step = build()
    rows = dist.process_batch_slice(zero, BATCH)
    start = 0
    mngr = ck.manager(args.ckpt) if args.ckpt else None
    if args.resume:
        state = ck.restore(mngr, zero, params, ema=ema)
        start = int(state.step)
        print(f"process {me}: resumed at step {start}", flush=True)
    else:
        dist.check_same_on_all_processes(params, "params")
        state = step.init(params)
    if args.check_mismatch:
        bumped = jax.tree.map(lambda x: np.asarray(x) + (me if x.ndim == 1 else 0), params)
        try:
            dist.check_same_on_all_processes(bumped, "params")
        except ValueError as e:
            print(f"process {me}: mismatch detected: {e}", flush=True)
    for i in range(start, args.steps):
        batch = dist.global_batch(jax.tree.map(lambda x: x[rows], batches[i]), zero)
        if args.die_at is not None and i + 1 == args.die_at and me == args.die_process:
            print(f"process {me}: dying in step {i + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state, metrics = step(state, batch)
        print(
            f"process {me}: step {int(metrics['step'])} loss {float(metrics['loss']):.6f}",
            flush=True,
        )
        if mngr is not None and i + 1 == args.save_at:
            ck.save(mngr, i + 1, state, zero=zero, wait=True)
            print(f"process {me}: saved step {i + 1}", flush=True)
    if mngr is not None:
        mngr.wait_until_finished()
        mngr.close()
    out = {
        **flat("params", dist.gather_to_host(state.params)),
        **flat("ema", dist.gather_to_host(state.ema)),
        "step": np.asarray(int(state.step)),
        "ema_updates": np.asarray(int(state.ema.updates)),
        "sharded_leaves": np.asarray(
            sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.ema.ema))
        ),
    }
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"p{me}.npz"), **out)
    print(f"process {me}: done in {time.monotonic() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
