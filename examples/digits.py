"""Digits: a small CNN on scikit-learn's bundled 8x8 digits, trained with ZeRO + a sharded EMA.

    python examples/digits.py                       # stage 2, fp32, all devices (`make demo`)
    python examples/digits.py --stage 3 --bf16 --accum 2
    python examples/digits.py --run-name d --stop-after-epoch 4   # "interrupted" after epoch 4
    python examples/digits.py --run-name d --resume               # continues from its checkpoint
    python examples/digits.py --smoke                             # a handful of steps (CI)

On a CPU-only machine it runs on 8 simulated devices (``--xla_force_host_platform_device_count``);
with GPUs it uses every visible GPU. The data (1797 images, bundled with scikit-learn, no
download) is split train/test by ``--seed``; the training order of epoch ``e`` is a function of
``(seed, e)`` alone, so a run resumed from a checkpoint is bit-for-bit the uninterrupted run.

Every epoch: raw and EMA weights are evaluated on the test set (the EMA lives in 1/N shards and
is gathered only for this), and an Orbax checkpoint is written under ``runs/<name>/ckpt`` (the
sharded state, plus the epoch and the loss/accuracy history in its metadata). At the end: a
summary table (accuracy raw vs EMA; per-device bytes measured vs ``jz.estimate_memory``;
collective bytes per step from the compiled HLO; median step time), ``runs/<name>/summary.json``
and ``runs/<name>/report.png``.

The training harness below (:class:`Experiment`, :func:`run_experiment`, :func:`base_parser`) is
shared with ``examples/gpt_zero3.py``.
"""

from __future__ import annotations

import os

from jaxzero.simulate import simulate_cpu_devices

# Only affects the CPU platform: 8 simulated devices when there is no accelerator.
simulate_cpu_devices()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import checkpoint as ck  # noqa: E402
from jaxzero import memory as jm  # noqa: E402

# ============================================================================ shared harness


def base_parser(
    description: str,
    *,
    stage: int,
    epochs: int,
    batch: int,
    lr: float,
    ema_decay: float,
    run_name: str,
) -> argparse.ArgumentParser:
    """The command-line options both examples share (defaults per example)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--stage", type=int, default=stage, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--epochs", type=int, default=None, help=f"epochs (default {epochs})")
    p.add_argument("--batch", type=int, default=batch, help="global batch size (all devices)")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-batches")
    p.add_argument("--bf16", action="store_true", help="bf16 compute params, fp32 master")
    p.add_argument(
        "--offload",
        choices=("optimizer", "optimizer,params"),
        default=None,
        help="ZeRO(offload=...): the fp32 master, optimizer state and EMA in pinned host "
        "memory, with ',params' the params too (stage 3, --bf16, a model of layer stacks)",
    )
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (warm-up + cosine)")
    p.add_argument("--ema-decay", type=float, default=ema_decay, help="EMA decay (YOLOv5 schedule)")
    p.add_argument(
        "--ema-tau",
        type=float,
        default=None,
        help="YOLOv5 EMA warm-up time constant in steps (default: total steps / 10)",
    )
    p.add_argument("--seed", type=int, default=0, help="data split, data order and init")
    p.add_argument(
        "--run-name", default=None, help=f"output folder name (default {run_name}-s<stage>)"
    )
    p.add_argument("--out-dir", default="runs", help="parent folder of runs/<name>")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--smoke", action="store_true", help="a handful of steps (CI)")
    p.add_argument(
        "--stop-after-epoch",
        type=int,
        default=None,
        help="stop (as if interrupted) after checkpointing this epoch; no summary/report",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(default_epochs=epochs, default_run_name=run_name)
    return p


def finish_args(args, *, smoke_epochs: int = 2):
    if args.epochs is None:
        args.epochs = smoke_epochs if args.smoke else args.default_epochs
    if args.run_name is None:
        args.run_name = f"{args.default_run_name}-s{args.stage}" + ("-smoke" if args.smoke else "")
    if args.epochs < 1:
        raise SystemExit(f"--epochs={args.epochs} must be >= 1")
    if args.accum < 1:
        raise SystemExit(f"--accum={args.accum} must be >= 1")
    return args


@dataclasses.dataclass
class Experiment:
    """What :func:`run_experiment` needs to train and evaluate one model.

    ``batches(epoch)`` must be a deterministic function of the seed and ``epoch`` (that is what
    makes a resumed run equal an uninterrupted one). ``evaluate(params)`` gets a replicated
    params tree (raw weights or the gathered EMA) and returns the metric.
    """

    name: str  # e.g. "digits CNN"
    params: Any  # initial (host / device) params tree, float32
    loss_fn: Callable  # (params, batch) -> scalar loss
    tx: optax.GradientTransformation
    batches: Callable[[int], Iterable[dict]]
    steps_per_epoch: int
    evaluate: Callable[[Any], float]
    metric: str  # e.g. "test accuracy (%)"
    higher_is_better: bool
    example_batch: dict
    samples_per_step: int  # for the throughput figures
    config: dict  # the knobs that must match for a faithful resume
    after: Callable | None = None  # (state, summary) -> None: extra end-of-run output
    unit: str = "samples"  # what samples_per_step counts (images, tokens, ...)
    layers: tuple[str, ...] = ()  # nn.scan stacks: ZeRO(layers=...), stage 3 gathers per layer


def param_count(params) -> int:
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


def tree_sha256(tree) -> str:
    """SHA-256 of the gathered tree's bytes (leaf order = tree order): bit-exact comparisons."""
    h = hashlib.sha256()
    for x in jax.tree.leaves(jax.device_get(jz.gather(tree))):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def _field_bytes(state) -> dict[str, int]:
    """Max per-device bytes of each persistent component of a TrainState (real arrays, or
    ShapeDtypeStructs with shardings: then the bytes their shards would take)."""

    def nbytes(tree):
        if tree is None:
            return 0
        if all(isinstance(x, jax.Array) for x in jax.tree.leaves(tree)):
            return jm.max_device_bytes(tree)
        return sum(  # every shard of a ZeRO leaf has the same shape
            int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )

    return {
        "params": nbytes(state.params),
        "master": nbytes(state.master),
        "opt_state": nbytes(state.opt_state),
        "ema": nbytes(None if state.ema is None else state.ema.ema),
    }


def memory_by_stage(exp: Experiment, mesh, precision: str, ema, *, allocate=True) -> dict:
    """Per-device bytes of each stage's state, next to ``jz.estimate_memory`` for the same
    parameter count, precision and optimizer. With ``allocate`` each stage's state is
    initialised on the mesh and measured (``jaxzero.memory.max_device_bytes``); without it
    (``--smoke``) the bytes come from ``zero.abstract_state``'s shardings: the same numbers,
    with no compilation and no allocation."""
    phi, n = param_count(exp.params), int(mesh.shape["data"])
    out = {}
    for s in range(4):
        zero = jz.ZeRO(exp.tx, mesh, stage=s, precision=precision, layers=exp.layers)
        if allocate:
            state = zero.init(exp.params, ema=ema)
            measured = _field_bytes(state)
            del state
        else:
            measured = _field_bytes(zero.abstract_state(exp.params, ema=ema))
        est = jm.estimate_memory(phi, n, stage=s, optimizer="adam", precision=precision, ema=True)
        out[s] = {
            "measured": measured,
            "measured_total": sum(measured.values()),
            "method": "initialised and measured" if allocate else "abstract_state shardings",
            "estimate": {
                "params": est.params,
                "optimizer": est.optimizer,  # includes the fp32 master under bf16
                "ema": est.ema,
                "grads": est.grads,  # transient (inside the step), not in the persistent state
            },
            "estimate_persistent": est.params + est.optimizer + est.ema,
        }
    return out


def summary_table(s: dict) -> str:
    """The end-of-run text table."""
    lines = []
    w = 32
    lines.append(
        f"== {s['name']}: ZeRO stage {s['stage']}, {s['precision']}, {s['devices']} x "
        f"{s['platform']}, {s['num_params']:,} params, accum {s['accum']}, "
        f"{s['steps']} steps =="
    )
    lines.append(f"{'':{w}}{'raw':>12}{'EMA':>12}")
    lines.append(f"{s['metric']:{w}}{s['final']['raw']:>12.4f}{s['final']['ema']:>12.4f}")
    mem, est = s["memory"]["measured"], s["memory"]["estimate"]
    lines.append("")
    lines.append(
        f"{'per-device bytes (max over devices)':{w}}{'measured':>16}{'estimate':>16}"
        f"   (estimate_memory: adam, precision={s['precision']}, stage {s['stage']}, ema=True)"
    )
    rows = [
        ("params (compute copy)", mem["params"], est["params"]),
        ("master + optimizer state", mem["master"] + mem["opt_state"], est["optimizer"]),
        ("EMA", mem["ema"], est["ema"]),
    ]
    for label, m, e in rows:
        lines.append(f"  {label:{w - 2}}{m:>16,}{e:>16,}")
    tot_m = sum(r[1] for r in rows)
    tot_e = sum(r[2] for r in rows)
    lines.append(f"  {'total persistent':{w - 2}}{tot_m:>16,}{tot_e:>16,}")
    lines.append(f"  {'gradients (transient)':{w - 2}}{'-':>16}{est['grads']:>16,}")
    lines += [
        "  estimate = the ZeRO paper's accounting: bytes/param p = g = 4 (fp32) or 2 (bf16),",
        "  Adam K = 8 (+4 for the fp32 master under bf16), EMA 4 (always sharded); sharded terms",
        "  on ceil(P/N)-element flat shards. precision is passed explicitly (estimate_memory",
        "  defaults to bf16, ZeRO to fp32). measured is slightly higher: jaxzero replicates",
        "  leaves with no dimension divisible by N, and optax keeps scalar step counters.",
    ]
    lines.append("")
    lines.append(f"{'collectives per step (compiled HLO)':{w}}{'count':>8}{'bytes/device':>16}")
    for kind, d in s["collectives"].items():
        if d["count"]:
            lines.append(f"  {kind:{w - 2}}{d['count']:>8}{d['bytes']:>16,}")
    if not any(d["count"] for d in s["collectives"].values()):
        lines.append("  (none: a single device)")
    if s["accum"] > 1:
        lines.append("  (static counts: ops inside the accumulation scan run once per micro-batch)")
    if s["precision"] == "bf16" and s["platform"] == "cpu":
        lines.append("  (XLA:CPU upcasts bf16 collectives to f32: 4 bytes/element here, 2 on GPU)")
    lines.append("")
    if s["median_step_ms"] is not None:
        lines.append(
            f"{'median step time':{w}}{s['median_step_ms']:>12.2f} ms   "
            f"({s['samples_per_s']:,.0f} {s['unit']}/s, {s['timed_steps']} steps timed)"
        )
    lines.append(f"{'wall time (this process)':{w}}{s['wall_s']:>12.1f} s")
    return "\n".join(lines)


def plot_report(path: str, s: dict, history: dict, by_stage: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    loss = np.asarray(history["loss"], dtype=np.float64)
    steps = np.arange(1, len(loss) + 1)
    ax.plot(steps, loss, lw=0.8, alpha=0.45, color="tab:blue", label="per step")
    if len(loss) >= 5:
        k = max(2, min(25, len(loss) // 10))
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, lw=1.8, color="tab:blue", label=f"mean of {k}")
    if len(loss) and loss.min() > 0 and loss.max() / loss.min() > 20:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("training loss")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[1]
    ev = history["eval"]
    ep = [e["epoch"] for e in ev]
    ax.plot(ep, [e["raw"] for e in ev], "o-", label="raw weights")
    ax.plot(
        ep,
        [e["ema"] for e in ev],
        "s-",
        label=f"EMA (decay {s['ema_decay']}, tau {s['ema_tau']:g})",
    )
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel(s["metric"])
    ax.set_title(f"{s['metric']}: raw vs EMA" + (" (zoomed)" if s["higher_is_better"] else ""))
    if s["higher_is_better"] and ev:
        lo = min(
            min(e["raw"] for e in ev[len(ev) // 3 :]), min(e["ema"] for e in ev[len(ev) // 3 :])
        )
        ax.set_ylim(max(0.0, lo - 3.0), 100.5)
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[2]
    parts = [
        ("params", "params", "tab:blue"),
        ("master", "fp32 master", "tab:purple"),
        ("opt_state", "optimizer state", "tab:orange"),
        ("ema", "EMA", "tab:green"),
    ]
    xs = np.arange(4)
    bottom = np.zeros(4)
    how = "measured" if by_stage[0]["method"].startswith("init") else "from shardings"
    unit = 1e3
    for key, label, color in parts:
        vals = np.array([by_stage[i]["measured"][key] for i in range(4)]) / unit
        if vals.any():
            ax.bar(xs, vals, 0.6, bottom=bottom, label=f"{label} ({how})", color=color)
            bottom += vals
    est = np.array([by_stage[i]["estimate_persistent"] for i in range(4)]) / unit
    ax.plot(xs, est, "k_", ms=40, mew=2.5, label="estimate_memory (params+opt+EMA)")
    for i in range(4):
        ax.text(xs[i], bottom[i], f"{bottom[i]:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.45 * max(bottom.max(), est.max()))  # room for the legend
    ax.set_xticks(xs, [f"stage {i}" + (" (run)" if i == s["stage"] else "") for i in range(4)])
    ax.set_ylabel("KB per device (max over devices)")
    ax.set_title(f"persistent state per device, {s['devices']} devices, {s['precision']}")
    ax.legend(fontsize=8, loc="upper right", markerscale=0.35)
    ax.grid(alpha=0.3, axis="y")

    fig.suptitle(
        f"{s['name']}: ZeRO stage {s['stage']}, {s['devices']} x {s['platform']}, "
        f"final {s['metric']} raw {s['final']['raw']:.2f} / EMA {s['final']['ema']:.2f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.generic, np.ndarray)):
        return np.asarray(x).tolist()
    return x


def run_experiment(exp: Experiment, args) -> dict | None:
    """Train ``exp`` with ZeRO ``args.stage``; checkpoint, evaluate, report. Returns the
    summary dict (None when stopped early by ``--stop-after-epoch``)."""
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    mesh = jz.data_parallel_mesh()
    ndev = mesh.size
    precision = "bf16" if args.bf16 else "fp32"
    if args.batch % (ndev * args.accum):
        raise SystemExit(
            f"--batch {args.batch} must be a multiple of devices x accum = {ndev} x {args.accum}"
        )
    total_steps = args.epochs * exp.steps_per_epoch
    tau = args.ema_tau if args.ema_tau is not None else max(1.0, total_steps / 10)
    ema = jz.ShardedEMA(args.ema_decay, tau=tau)
    try:  # a configuration ZeRO refuses stops here, with its reason and fix
        zero = jz.ZeRO(
            exp.tx,
            mesh,
            stage=args.stage,
            precision=precision,
            layers=exp.layers,
            offload=args.offload,  # "optimizer" or "optimizer,params", as ZeRO reads them
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    step = jz.make_train_step(exp.loss_fn, zero, ema=ema, accum_steps=args.accum)

    run_dir = os.path.abspath(os.path.join(args.out_dir, args.run_name))
    ckpt_dir = os.path.join(run_dir, "ckpt")
    os.makedirs(run_dir, exist_ok=True)
    config = {
        **exp.config,
        "epochs": args.epochs,
        "batch": args.batch,
        "accum": args.accum,
        "lr": args.lr,
        "ema_decay": args.ema_decay,
        "ema_tau": tau,
        "seed": args.seed,
        "precision": precision,
        "offload": args.offload,
        "smoke": args.smoke,
    }
    history = {"loss": [], "eval": []}
    start_epoch, resumed_from = 0, None
    state = None
    latest = ck.latest_step(ckpt_dir) if args.resume and os.path.isdir(ckpt_dir) else None
    if latest is not None:
        state, extra = ck.restore(ckpt_dir, zero, exp.params, ema=ema, with_extra=True)
        user = ck.load_metadata(ckpt_dir, latest)["user"]
        saved_cfg = user["config"]
        diff = {
            k: (saved_cfg.get(k), v)
            for k, v in config.items()
            if k != "stage" and saved_cfg.get(k) != v
        }
        if diff:
            print(
                f"warning: resuming with a different configuration (saved, now): {diff}; "
                f"the run will not equal an uninterrupted one",
                file=sys.stderr,
            )
        history = user["history"]
        start_epoch = int(np.asarray(extra["epoch"]))
        resumed_from = int(latest)
        print(
            f"resumed from {ckpt_dir} step {latest} (epoch {start_epoch}/{args.epochs}, "
            f"optimizer step {int(state.step)}, written at stage {saved_cfg.get('stage')}, "
            f"restored at stage {args.stage})",
            flush=True,
        )
    else:
        if args.resume:
            print(
                f"--resume: no complete checkpoint in {ckpt_dir}; starting from scratch", flush=True
            )
        if os.path.isdir(ckpt_dir):
            shutil.rmtree(ckpt_dir)  # a fresh run replaces an old one of the same name
        state = step.init(exp.params)
    config["stage"] = args.stage

    print(
        f"{exp.name}: {param_count(exp.params):,} params | ZeRO stage {args.stage}, {precision}"
        f"{f', offload {args.offload}' if args.offload else ''} | "
        f"{ndev} x {jax.devices()[0].platform} | global batch {args.batch} "
        f"({args.batch // ndev}/device, accum {args.accum}) | {args.epochs} epochs x "
        f"{exp.steps_per_epoch} steps | EMA decay {args.ema_decay} tau {tau:g} | {run_dir}",
        flush=True,
    )

    mngr = ck.manager(ckpt_dir, max_to_keep=2, async_save=True)
    step_times = []
    bar = tqdm(
        total=total_steps,
        initial=start_epoch * exp.steps_per_epoch,
        unit="step",
        dynamic_ncols=True,
        disable=args.no_progress,
        mininterval=0.5,
        file=sys.stderr,
    )
    stopped = False
    for epoch in range(start_epoch, args.epochs):
        bar.set_description(f"epoch {epoch + 1}/{args.epochs}")
        for batch in exp.batches(epoch):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)  # metrics: loss, grad_norm, step, skipped
            loss = float(metrics["loss"])  # waits for the step
            dt = time.perf_counter() - t0
            step_times.append(dt)
            history["loss"].append(loss)
            bar.update(1)
            bar.set_postfix(
                {"loss": f"{loss:.4f}", f"{exp.unit}/s": f"{exp.samples_per_step / dt:,.0f}"},
                refresh=False,
            )
        raw = exp.evaluate(jz.gather(state.params))
        avg = exp.evaluate(jz.gather(state.ema))  # the EMA is gathered only here
        history["eval"].append({"epoch": epoch + 1, "raw": float(raw), "ema": float(avg)})
        bar.write(
            f"epoch {epoch + 1:3d}/{args.epochs}  mean loss "
            f"{np.mean(history['loss'][-exp.steps_per_epoch :]):.4f}  "
            f"{exp.metric}: raw {raw:.4f}  EMA {avg:.4f}"
        )
        gstep = (epoch + 1) * exp.steps_per_epoch
        ck.save(
            mngr,
            gstep,
            state,
            zero=zero,
            extra={"epoch": np.int64(epoch + 1)},
            metadata={"config": config, "history": history},
        )
        if (
            args.stop_after_epoch is not None
            and epoch + 1 >= args.stop_after_epoch
            and epoch + 1 < args.epochs
        ):
            stopped = True
            break
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    if stopped:
        print(
            f"stopped after epoch {args.stop_after_epoch} (checkpoint step "
            f"{args.stop_after_epoch * exp.steps_per_epoch} in {ckpt_dir}); rerun with --resume",
            flush=True,
        )
        return None

    # ---- final numbers
    final = history["eval"][-1]
    example = exp.example_batch
    meas = jm.measure(step, state, example)  # compiles the step once more, for its HLO
    collectives = {
        k: {"count": v["count"], "bytes": v["bytes"]} for k, v in meas["collectives"].items()
    }
    by_stage = memory_by_stage(exp, mesh, precision, ema, allocate=not args.smoke)
    fields = _field_bytes(state)
    if by_stage[args.stage]["measured"] != fields:  # the chart's numbers are the real ones
        print(
            f"warning: stage {args.stage} state holds {fields} per device but the by-stage "
            f"figures say {by_stage[args.stage]['measured']}",
            file=sys.stderr,
        )
    est = by_stage[args.stage]["estimate"]
    timed = step_times[1:] if len(step_times) > 1 else step_times  # first step compiles
    med = float(np.median(timed)) if timed else None
    summary = {
        "name": exp.name,
        "run_dir": run_dir,
        "stage": args.stage,
        "precision": precision,
        "devices": ndev,
        "platform": jax.devices()[0].platform,
        "num_params": param_count(exp.params),
        "accum": args.accum,
        "epochs": args.epochs,
        "steps": len(history["loss"]),
        "optimizer_steps": int(state.step),
        "skipped_steps": int(state.skipped),
        "ema_updates": int(state.ema.updates),
        "ema_decay": args.ema_decay,
        "ema_tau": tau,
        "metric": exp.metric,
        "higher_is_better": exp.higher_is_better,
        "final": {"raw": final["raw"], "ema": final["ema"]},
        "final_loss": history["loss"][-1],
        "eval": history["eval"],
        "loss_history": history["loss"],
        "memory": {"measured": fields, "estimate": est},
        "memory_by_stage": by_stage,
        "collectives": collectives,
        "median_step_ms": None if med is None else med * 1e3,
        "samples_per_s": None if med is None else exp.samples_per_step / med,
        "unit": exp.unit,
        "timed_steps": len(timed),
        "resumed_from_step": resumed_from,
        "params_sha256": tree_sha256(state.params),
        "ema_sha256": tree_sha256(state.ema),
        "config": config,
    }
    if exp.after is not None:
        exp.after(state, summary)
    summary["wall_s"] = time.perf_counter() - t_start
    text = summary_table(summary)
    print("\n" + text, flush=True)
    plot_report(os.path.join(run_dir, "report.png"), summary, history, by_stage)
    summary["table"] = text
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(_jsonable(summary), f, indent=1)
    print(f"\nwrote {os.path.join(run_dir, 'report.png')} and summary.json", flush=True)
    return summary


# ============================================================================ digits


class CNN(nn.Module):
    """conv 3x3 x32 -> conv 3x3 x64 -> 2x2 avg pool -> dense 128 -> dense 10."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3), name="conv1")(x))
        x = nn.relu(nn.Conv(64, (3, 3), name="conv2")(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(128, name="fc1")(x))
        return nn.Dense(10, name="head")(x)


def load_data(seed: int, test_fraction: float = 0.2):
    """scikit-learn's bundled digits (no download), as NHWC float32 in [0, 1], split by seed."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[..., None]
    y = d.target.astype(np.int32)
    perm = np.random.default_rng([seed, 12345]).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def make_experiment(args) -> Experiment:
    (xtr, ytr), (xte, yte) = load_data(args.seed)
    model = CNN()
    # jit: one compilation instead of one per op of an eager init
    params = jax.jit(model.init)(jax.random.PRNGKey(args.seed), jnp.zeros((1, 8, 8, 1)))["params"]
    compute = jnp.bfloat16 if args.bf16 else jnp.float32

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch["x"].astype(compute)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    steps_per_epoch = len(xtr) // args.batch  # drop the last partial batch
    if args.smoke:
        steps_per_epoch = min(steps_per_epoch, 3)
    if steps_per_epoch < 1:
        raise SystemExit(f"--batch {args.batch} exceeds the {len(xtr)} training images")
    total = steps_per_epoch * args.epochs
    sched = optax.warmup_cosine_decay_schedule(
        0.0,
        args.lr,
        warmup_steps=max(1, min(steps_per_epoch, total // 10)),
        decay_steps=total,
        end_value=args.lr * 0.01,
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=1e-4))

    def batches(epoch):
        order = np.random.default_rng([args.seed, epoch]).permutation(len(xtr))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch : (i + 1) * args.batch]
            yield {"x": xtr[idx], "y": ytr[idx]}

    mesh_rep = None

    @jax.jit
    def predict(p, x):
        return model.apply({"params": p}, x.astype(jax.tree.leaves(p)[0].dtype)).argmax(-1)

    def evaluate(p):
        nonlocal mesh_rep
        if mesh_rep is None:  # the test set, replicated once on the params' mesh
            sharding = jax.tree.leaves(p)[0].sharding
            rep = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
            mesh_rep = (jax.device_put(xte, rep), jax.device_put(yte, rep))
        x, y = mesh_rep
        return float(jnp.mean(predict(p, x) == y)) * 100.0

    return Experiment(
        name="digits CNN",
        params=params,
        loss_fn=loss_fn,
        tx=tx,
        batches=batches,
        steps_per_epoch=steps_per_epoch,
        evaluate=evaluate,
        metric="test accuracy (%)",
        higher_is_better=True,
        example_batch={"x": xtr[: args.batch], "y": ytr[: args.batch]},
        samples_per_step=args.batch,
        unit="images",
        config={"example": "digits", "n_train": len(xtr), "n_test": len(xte)},
    )


def main(argv=None) -> int:
    parser = base_parser(
        __doc__.splitlines()[0],
        stage=2,
        epochs=15,
        batch=128,
        lr=3e-3,
        ema_decay=0.98,
        run_name="digits",
    )
    args = finish_args(parser.parse_args(argv))
    exp = make_experiment(args)
    run_experiment(exp, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
