"""The loss of opt-in bfloat16 optimizer state against the exact float32 state, on a real run.

    python benchmarks/state_dtype.py --out benchmarks/results/state_dtype

The demo's CNN (``examples/digits.py``, 151K params) on scikit-learn's digits, bf16 compute
params with an fp32 master, ``ZeRO(stage=2, offload="optimizer")`` on 8 simulated CPU devices
(every GPU when present), AdamW with warm-up and cosine decay, batch 64, the same data order
and seed for every run. Two runs:

* ``exact``: the fp32 Adam moments (today's default);
* ``bf16 moments``: ``jz.with_state_dtype(tx, jnp.bfloat16)``: the moments stored in bfloat16,
  the math in fp32 (half the state's host bytes and PCIe bytes per step).

It prints, every 200 steps, each run's mean training loss over those steps and the bf16 run's
difference from the exact one, then each run's test loss and accuracy and its optimizer
state's host bytes per device; with ``--out`` it writes that table to ``<out>.md`` and plots
both curves to ``<out>.png`` (matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxzero as jz  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import digits_cnn  # noqa: E402


def run(name, tx, params, loss_fn, data, steps, batch, predict, test):
    mesh = jz.data_parallel_mesh()
    zero = jz.ZeRO(tx, mesh, stage=2, precision="bf16", offload="optimizer")
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    (x, y), rng = data, np.random.default_rng(0)
    losses = []
    order = np.empty(0, np.int64)
    for _ in range(steps):
        if len(order) < batch:  # a new epoch: the same order for every run
            order = rng.permutation(len(x))
        idx, order = order[:batch], order[batch:]
        state, m = step(state, {"x": x[idx], "y": y[idx]})
        losses.append(float(m["loss"]))
    host = sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(state.opt_state)
        if leaf.sharding.memory_kind == "pinned_host"
        for s in leaf.addressable_shards[:1]
    )
    logits = np.asarray(predict(jz.gather(state.params), test[0]), np.float32)
    accuracy = float(np.mean(logits.argmax(-1) == test[1]))
    test_loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, test[1]).mean())
    return np.array(losses), test_loss, accuracy * 100, host


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", help="write <out>.md (the table) and <out>.png (the curves)")
    args = parser.parse_args(argv)
    train, test, params, loss_fn, predict = digits_cnn()
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 100, args.steps, 3e-5)
    adamw = optax.adamw(sched, weight_decay=1e-4)
    runs = {
        "exact": adamw,
        "bf16 moments": jz.with_state_dtype(adamw, jnp.bfloat16),
    }
    out = {
        k: run(k, tx, params, loss_fn, train, args.steps, args.batch, predict, test)
        for k, tx in runs.items()
    }
    exact = out["exact"][0]
    devices = jax.devices()
    lines = [
        "# bf16 optimizer state against the exact fp32 state: the digits CNN",
        "",
        f"Command: `python benchmarks/state_dtype.py --steps {args.steps} --batch {args.batch}"
        + (f" --out {os.path.relpath(args.out, ROOT)}`" if args.out else "`"),
        "",
        f"Date: {datetime.date.today()}; jax {jax.__version__}, optax {optax.__version__}; "
        f"{len(devices)} {devices[0].platform.upper()} devices. The digits CNN (151K params), "
        f"{args.steps} steps of {args.batch} images, stage 2, bf16 compute, fp32 master, "
        '`offload="optimizer"`, AdamW with warm-up and cosine decay; the same data order for '
        "both runs.",
        "",
        "| steps | exact: mean loss | bf16 moments: mean loss | difference |",
        "|---|---|---|---|",
    ]
    for end in range(200, args.steps + 1, 200):
        a, b = exact[end - 200 : end].mean(), out["bf16 moments"][0][end - 200 : end].mean()
        lines.append(f"| {end - 199}-{end} | {a:.5f} | {b:.5f} | {b - a:+.5f} |")
    lines += ["", "| run | test loss | test accuracy | optimizer state in host memory per device |"]
    lines.append("|---|---|---|---|")
    for k, (_, test_loss, accuracy, host) in out.items():
        lines.append(f"| {k} | {test_loss:.4f} | {accuracy:.2f} % | {host} B |")
    print("\n".join(lines))
    if not args.out:
        return 0
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(7, 4))
    window = 50
    for k, (losses, *_) in out.items():
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window, len(losses) + 1), smooth, label=k)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    print(f"wrote {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
