"""The loss of the opt-in offload modes against the exact run: the remainder master and the
bf16 optimizer state, on a real training run.

    python benchmarks/opt_in_loss.py --out benchmarks/results/opt_in_loss \\
        --plot docs/_static/opt_in_loss.png

The demo's CNN (``examples/digits.py``, 151K params) on scikit-learn's bundled digits (no
download), bf16 compute params with an fp32 master, ``ZeRO(stage=2)`` with the optimizer
offloaded on 8 simulated CPU devices, AdamW with warm-up and cosine decay, the same initial
params, data order and seed for every run. Three runs in one process:

* ``exact``: ``offload="optimizer"``, the fp32 master and fp32 Adam moments in host memory;
* ``remainder``: ``offload=("optimizer", "remainder")``, the fp32 master kept as a 16-bit
  remainder and a carry bit beside the bf16 params (decision 47). It is exact, so its params
  and master must equal the exact run's bit for bit;
* ``bf16 moments``: ``offload="optimizer"`` with ``jz.with_state_dtype(tx, jnp.bfloat16)``,
  the moments stored in bfloat16 and the math in fp32 (decision 48). Not exact.

It prints each run's mean training loss per ``--every`` steps, its test loss and accuracy
on the held-out split, its host bytes per device, the remainder run's largest difference from
the exact run's params and master (expected 0) and the bf16-moment run's (absolute, and
relative to each leaf's largest value). ``--out`` writes the tables to ``<out>.md``,
``--plot`` the three loss curves to a PNG (matplotlib).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxzero as jz  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import digits_cnn  # noqa: E402

REMAINDER = ("optimizer", "remainder")
#: name -> (offload, store the moments in bf16, the run it must equal bit for bit)
RUNS = {
    "exact": ("optimizer", False, None),
    "remainder": (REMAINDER, False, "exact"),
    "bf16 moments": ("optimizer", True, None),
    "remainder + bf16 moments": (REMAINDER, True, "bf16 moments"),
}


def _host_bytes(tree) -> int:
    """Bytes of ``tree``'s leaves in pinned host memory on one device."""
    return sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(tree)
        if leaf.sharding.memory_kind == "pinned_host"
        for s in leaf.addressable_shards[:1]
    )


def train(offload, tx, params, loss_fn, data, steps, batch, predict, test):
    """One run: its per-step losses, test loss, test accuracy (%), host bytes per device,
    and its final params and fp32 master gathered to numpy."""
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(), stage=2, precision="bf16", offload=offload)
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    (x, y), rng = data, np.random.default_rng(0)
    losses = np.empty(steps)
    order = np.empty(0, np.int64)
    for i in range(steps):
        if len(order) < batch:  # a new epoch: the same order for every run
            order = rng.permutation(len(x))
        idx, order = order[:batch], order[batch:]
        state, m = step(state, {"x": x[idx], "y": y[idx]})
        losses[i] = float(m["loss"])
    host = _host_bytes((state.master, state.opt_state))
    final = jax.tree.map(np.asarray, jz.gather(state.params))
    master = jax.tree.map(np.asarray, jz.gather(state.fp32_master()))
    logits = np.asarray(predict(final, test[0]), np.float32)
    accuracy = float(np.mean(logits.argmax(-1) == test[1])) * 100
    test_loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, test[1]).mean())
    return losses, test_loss, accuracy, host, final, master


def _max_abs(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _max_rel(a, b) -> tuple[float, float, str]:
    """Per leaf, the largest |a - b| over the largest |b| and the norm of a - b over b's: the
    largest of each over the leaves, and the leaf of the first."""
    rows = []
    for path, u in jax.tree_util.tree_leaves_with_path(a):
        v = np.asarray(_at(b, path), np.float64)
        d = np.asarray(u, np.float64) - v
        rows.append(
            (
                float(np.max(np.abs(d)) / np.max(np.abs(v))),
                float(np.linalg.norm(d) / np.linalg.norm(v)),
                jax.tree_util.keystr(path, simple=True, separator="/"),
            )
        )
    worst = max(rows)
    return worst[0], max(r[1] for r in rows), worst[2]


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--every", type=int, default=500, help="steps per mean-loss row")
    parser.add_argument("--out", help="write the tables to <out>.md")
    parser.add_argument("--plot", help="write the three loss curves to this PNG")
    args = parser.parse_args(argv)
    train_data, test, params, loss_fn, predict = digits_cnn()
    warmup = min(100, args.steps // 10)
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup, args.steps, 3e-5)
    adamw = optax.adamw(sched, weight_decay=1e-4)
    out, seconds = {}, {}
    for name, (offload, bf16_state, _) in RUNS.items():
        tx = jz.with_state_dtype(adamw, jnp.bfloat16) if bf16_state else adamw
        t0 = time.perf_counter()
        out[name] = train(
            offload, tx, params, loss_fn, train_data, args.steps, args.batch, predict, test
        )
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {args.steps} steps in {seconds[name]:.0f} s", flush=True)
    exact = out["exact"]
    same = [
        f"- {name} against {ref}, after {args.steps} steps: the largest difference of the bf16 "
        f"params {_max_abs(out[name][4], out[ref][4]):g}, of the fp32 master "
        f"{_max_abs(out[name][5], out[ref][5]):g}."
        for name, (*_, ref) in RUNS.items()
        if ref is not None
    ]
    bf_abs = _max_abs(out["bf16 moments"][5], exact[5])
    bf_rel, bf_norm, bf_leaf = _max_rel(out["bf16 moments"][5], exact[5])
    devices = jax.devices()
    command = f"python benchmarks/opt_in_loss.py --steps {args.steps} --batch {args.batch}"
    if args.out:
        command += f" --out {os.path.relpath(args.out, ROOT)}"
    if args.plot:
        command += f" --plot {os.path.relpath(args.plot, ROOT)}"
    n_params = sum(p.size for p in jax.tree.leaves(params))
    lines = [
        "# The opt-in offload modes against the exact run: the digits CNN",
        "",
        f"Command: `{command}`",
        "",
        f"Date: {datetime.date.today()}; jax {jax.__version__}, optax {optax.__version__}; "
        f"{len(devices)} simulated {devices[0].platform.upper()} devices. The digits CNN "
        f"({n_params:,} params), {args.steps} steps of {args.batch} images, stage 2, bf16 "
        "compute params, AdamW with warm-up and cosine decay, the same initial params and "
        'data order for every run: `exact` (`offload="optimizer"`, fp32 master and moments), '
        '`remainder` (`offload=("optimizer", "remainder")`), `bf16 moments` '
        '(`offload="optimizer"`, `jz.with_state_dtype(tx, jnp.bfloat16)`) and both opt-ins '
        "together. Mean training loss per "
        f"{args.every} steps:",
        "",
        "| steps | " + " | ".join(RUNS) + " | bf16 moments - exact |",
        "|---|" + "---|" * (len(RUNS) + 1),
    ]
    for end in range(args.every, args.steps + 1, args.every):
        means = {k: out[k][0][end - args.every : end].mean() for k in RUNS}
        diff = means["bf16 moments"] - means["exact"]
        lines.append(
            f"| {end - args.every + 1}-{end} | "
            + " | ".join(f"{v:.6f}" for v in means.values())
            + f" | {diff:+.6f} |"
        )
    lines += [
        "",
        "| run | test loss | test accuracy | master + optimizer state in host memory per "
        "device | wall time (shared 2-core machine) |",
        "|---|---|---|---|---|",
    ]
    for k, (_, test_loss, accuracy, host, *_) in out.items():
        lines.append(
            f"| {k} | {test_loss:.4f} | {accuracy:.2f} % | {host:,} B | {seconds[k]:.0f} s |"
        )
    lines += [""] + same
    lines += [
        f"- bf16 moments against exact, the fp32 master: the largest difference {bf_abs:.3g}; "
        f"relative to its leaf's largest value {bf_rel:.3g} at most (`{bf_leaf}`); the norm "
        f"of the difference over the leaf's norm {bf_norm:.3g} at most.",
    ]
    print("\n".join(lines))
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.plot:
        _plot(out, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _plot(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    window = min(50, max(1, len(out["exact"][0]) // 10))
    for k, (losses, *_) in out.items():
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        exact = RUNS[k][2] is None  # a remainder run is drawn dashed over the run it equals
        style = dict(lw=3.0, alpha=0.6) if exact else dict(ls="--", lw=1.2)
        ax.plot(np.arange(window, len(losses) + 1), smooth, label=k, **style)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    ax.set_title("digits CNN, stage 2, optimizer offloaded, bf16 params")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
