"""Writes tests/data/legacy_ckpt/ (an on-disk checkpoint) and legacy_ckpt.npz (the state it
holds, gathered to numpy) with the jaxzero of commit 0992101, before the package was split
into subpackages. Kept for the record: tests/test_legacy_checkpoint.py restores the committed
files with today's code; re-running this script with today's code would prove nothing.

    python tests/data/make_legacy_checkpoint.py   # from the repo root, 8 simulated devices
"""

import os
import shutil
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from models import make_problem  # noqa: E402

import jaxzero as jz  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    params, loss_fn, batches = make_problem("mlp", steps=3, seed=7)
    zero = jz.ZeRO(
        optax.adamw(1e-2, weight_decay=0.1), jz.data_parallel_mesh(8), stage=2, precision="bf16"
    )
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.9, tau=3.0))
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)
    out = os.path.join(HERE, "legacy_ckpt")
    shutil.rmtree(out, ignore_errors=True)
    jz.checkpoint.save(out, 3, state, zero=zero, wait=True)
    flat = {}
    parts = {
        "params": state.params,
        "master": state.master,
        "opt_state": state.opt_state,
        "ema": state.ema.ema,
    }
    for path, x in jax.tree_util.tree_flatten_with_path(jz.gather(parts))[0]:
        x = np.asarray(x)
        flat[jax.tree_util.keystr(path)] = x.astype(np.float32) if x.dtype.name == "bfloat16" else x
    flat["step"] = np.asarray(state.step)
    flat["ema_updates"] = np.asarray(state.ema.updates)
    np.savez(os.path.join(HERE, "legacy_ckpt.npz"), **flat)


if __name__ == "__main__":
    main()
