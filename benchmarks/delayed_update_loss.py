"""The loss of the delayed parameter update (ZeRO-Offload's DPU) against the exact update, on
a real run.

    python benchmarks/delayed_update_loss.py --out benchmarks/results/delayed_update_loss.md

The repo's decoder (``jaxzero.gpu.models.Decoder``: GPT blocks run by ``jz.scan_layers``,
4 layers, width 64) trained on one simulated CPU device by default (``--devices``: 8 take
several times as long a step on a 2-core machine, past this run's 15 minutes), stage 3 per
layer, bf16 compute, fp32 master, ``offload="optimizer"``, clip + AdamW with warm-up and cosine decay, 2
micro-batches a step, on sequences of a fixed random bigram language (each token's next
one drawn from a Dirichlet(0.1) row of 64: its entropy rate is the loss a perfect model
reaches). The same data order, seed and initial params for every run:

* ``exact``: the update after the backward (``offload_update=None``, the default);
* ``delayed``: ``offload_update="delayed"``, each step's gradient a step behind from the
  second step on;
* ``delayed, 100 exact``: the same after 100 exact steps (``delay_after=100``).

It prints, every 200 steps, each run's mean training loss over those steps and each delayed
run's difference from the exact one, then each run's loss on 64 held-out sequences (the
flushed, gathered params, on one device); with ``--out`` it writes that table.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero.gpu.models import init_params, make_loss, model_shape  # noqa: E402

VOCAB, SEQ, ACCUM = 64, 32, 2
RUNS = {
    "exact": {},
    "delayed": {"offload_update": "delayed"},
    "delayed, 100 exact": {"offload_update": "delayed", "delay_after": 100},
}


def bigram_language(seed: int = 0):
    """A sampler of ``(n, SEQ + 1)`` token sequences from a fixed random bigram model, and
    that model's entropy rate in nats (the loss floor)."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(VOCAB, 0.1), size=VOCAB)
    cum = probs.cumsum(1)
    stationary = np.linalg.matrix_power(probs, 200)[0]
    entropy = -np.sum(stationary[:, None] * probs * np.log(np.maximum(probs, 1e-30)))

    def sample(n, rng):
        out = np.empty((n, SEQ + 1), np.int32)
        out[:, 0] = rng.integers(0, VOCAB, n)
        for t in range(SEQ):
            u = rng.random(n)[:, None]
            out[:, t + 1] = np.minimum((u > cum[out[:, t]]).sum(1), VOCAB - 1)
        return out

    return sample, float(entropy)


def run(kw, params, loss_fn, batches, steps, devices):
    """One run: its per-step training losses and its flushed state."""
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, 3e-3, min(100, steps // 2), steps),
            weight_decay=0.1,
        ),
    )
    zero = jz.ZeRO(
        tx,
        jz.data_parallel_mesh(devices),
        stage=3,
        precision="bf16",
        layers="layers",
        offload="optimizer",
        **kw,
    )
    step = jz.make_train_step(loss_fn, zero, accum_steps=ACCUM)
    state = step.init(params)
    losses = []
    for i, b in enumerate(batches):
        if i == 3:  # compiled: the first step, the one with an update pending, a delayed one
            start = time.perf_counter()
        state, m = step(state, b)
        losses.append(m["loss"])
    jax.block_until_ready(state)
    per_step = (time.perf_counter() - start) / max(1, len(batches) - 3)
    print(f"{kw}: {per_step * 1e3:.0f} ms a step", file=sys.stderr, flush=True)
    return np.array([float(x) for x in losses]), step.flush(state)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=200)
    p.add_argument("--devices", type=int, default=1, help="simulated CPU devices the mesh uses")
    p.add_argument("--out", default=None, help="write the table to this .md file")
    args = p.parse_args(argv)
    shape = model_shape(
        arch="gpt", layers=4, hidden=64, heads=2, vocab=VOCAB, seq=SEQ, attention="xla"
    )
    params, loss_fn = init_params(shape), make_loss(shape)
    sample, entropy = bigram_language()
    rng = np.random.default_rng(1)
    rows = 8 * ACCUM  # sequences a step, whatever the mesh
    seqs = [sample(rows, rng) for _ in range(args.steps)]
    batches = [{"x": s[:, :-1], "y": s[:, 1:]} for s in seqs]
    held = sample(64, np.random.default_rng(2))
    held = {"x": held[:, :-1], "y": held[:, 1:]}
    eval_loss = jax.jit(lambda p: loss_fn(jax.tree.map(lambda x: x.astype("bfloat16"), p), held))
    losses, evals = {}, {}
    for name, kw in RUNS.items():
        losses[name], state = run(kw, params, loss_fn, batches, args.steps, args.devices)
        evals[name] = float(eval_loss(jz.gather(state.master)))
        print(f"{name}: held-out loss {evals[name]:.5f}", flush=True)
    names = list(RUNS)
    lines = [
        "# The delayed parameter update (DPU) against the exact update: a 4-layer decoder",
        "",
        f"Command: `python benchmarks/delayed_update_loss.py --steps {args.steps} "
        f"--devices {args.devices} --out benchmarks/results/delayed_update_loss.md`",
        "",
        f"Date: {datetime.date.today()}; jax {jax.__version__}, optax {optax.__version__}; "
        f"{args.devices} CPU device(s). `jaxzero.gpu.models.Decoder` (GPT, 4 layers x 64, "
        f"{shape.num_params:,} params, `jz.scan_layers`), {args.steps} steps of {rows} "
        f"sequences of {SEQ} tokens ({ACCUM} micro-batches), stage 3 per layer, bf16 compute, "
        f'fp32 master, `offload="optimizer"`, clip + AdamW with warm-up and cosine decay; a '
        f"fixed random bigram language of {VOCAB} tokens (entropy rate {entropy:.4f} nats: "
        f"the loss floor); the same data order and initial params for every run.",
        "",
        "| steps | "
        + " | ".join(f"{n}: mean loss" for n in names)
        + " | "
        + " | ".join(f"{n} - exact" for n in names[1:])
        + " |",
        "|---" * (2 * len(names)) + "|",
    ]
    for s in range(0, args.steps, args.every):
        means = [losses[n][s : s + args.every].mean() for n in names]
        diffs = [f"{m - means[0]:+.5f}" for m in means[1:]]
        lines.append(
            f"| {s + 1}-{min(s + args.every, args.steps)} | "
            + " | ".join(f"{m:.5f}" for m in means)
            + " | "
            + " | ".join(diffs)
            + " |"
        )
    lines += [
        "",
        "| run | held-out loss (64 sequences) | - exact |",
        "|---|---|---|",
    ]
    for n in names:
        lines.append(f"| {n} | {evals[n]:.5f} | {evals[n] - evals['exact']:+.5f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
