"""Deviceless XLA:GPU compiles at LLaMA-7B scale: what the GPU compiler allocates per device.

    python benchmarks/gpu_scale.py --gpu h100                # N=64, fp32 and bf16, all parts
    python benchmarks/gpu_scale.py --gpu h100 --parts 1      # only the LLaMA-7B table

Needs jax's CUDA plugin (``pip install "jax[cuda12]==0.10.2"``), not a GPU: the steps are
compiled for a compile-only mesh (``jaxzero.gpu.compile_only_mesh``) and never run.

1. LLaMA-7B (32 layers, 4096 wide, 32 heads, 11008 MLP, vocab 32000, seq 2048, micro-batch 1
   sequence per device) at N=64: per-device compiled memory (``memory_analysis()``) of the real
   jaxzero Adam step for stages 0-3 and stage 3 one layer at a time, fp32 and bf16, against
   ``jaxzero.estimate_memory`` (params + grads + optimizer + activations with ``ckpt_every=1``
   and f32 logits, + the per-layer working set), with collective payloads per step.
2. The ZeRO paper's 7.5B / N=64 row (Figure 1: 120 / 31.4 / 16.6 / 1.9 GB of model states for
   stages 0-3, bf16 Adam): the compiled persistent state per device (arguments less the batch)
   of a 7.55B LLaMA-shaped model (36 layers of 4096), scaled to 7.5B. jaxzero's persistent
   state holds no gradients (they are temporaries of the step), so the paper's figure is also
   shown less its gradient term.
3. Kernels per EMA update of a 350-leaf YOLOv5s-shaped fp32 tree on 8 GPUs: a replicated
   ``tree.map`` EMA, jaxzero's per-leaf sharded EMA, and the bucketed one
   (``ShardedEMA(bucket_leaves_up_to=4096)``). On a GPU each kernel is a launch, so the count
   is the EMA's cost for small leaves.
4. Stage 3 per layer, bf16: the compiled bytes with cuDNN's flash attention (part 1's model)
   and with XLA's reference attention, which materialises the per-layer f32 scores.

Writes ``benchmarks/results/gpu_scale.md`` and ``gpu_scale.json`` (parts not rerun are kept
from the JSON), then copies the tables into docs/benchmarks.md (``benchmarks/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the numerical backend; the GPU is compile-only
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import gpu  # noqa: E402
from jaxzero.gpu.models import model_shape  # noqa: E402
from jaxzero.gpu.plan import plan_tx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import docs_tables  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9
PAPER = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # GB, Φ = 7.5e9, N = 64, bf16 Adam


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def md(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def persistent_formula(phi, n, stage, precision):
    """DESIGN's persistent bytes: fp32 12Φ / 4Φ+8Φ/N / 4Φ+8Φ/N / 12Φ/N; bf16 14Φ / 2Φ+12Φ/N /
    2Φ+12Φ/N / 14Φ/N."""
    p, k = (4, 8) if precision == "fp32" else (2, 12)
    return {0: (p + k) * phi, 1: p * phi + k * phi / n, 2: p * phi + k * phi / n}.get(
        stage, (p + k) * phi / n
    )


def plan_zero(kind, n, precision="bf16"):
    """The plan's ZeRO: its Adam on ``n`` compile-only GPUs of ``kind``, stage 3 over the
    decoder's layer stack (each case of the plan takes what acts at its stage)."""
    mesh = gpu.compile_only_mesh(kind, n)
    return jz.ZeRO(plan_tx(), mesh, stage=3, precision=precision, layers="layers")


def part1(kind, n):
    shape = model_shape(layers=32, hidden=4096, heads=32, vocab=32000, seq=2048, batch=1)
    out = []
    for precision in ("fp32", "bf16"):
        rows = gpu.plan(
            plan_zero(kind, n, precision),
            shape,
            cases=gpu.plan_cases(None, "both"),
            on_case=lambda label, i, t, pr=precision: log(
                f"part 1: {pr} stage {label} ({i + 1}/{t})"
            ),
        )
        for r in rows:
            rep = r.report
            out.append(
                {
                    "precision": precision,
                    "stage": r.label,
                    "phi": r.num_params,
                    "argument": rep.argument_bytes,
                    "state": r.state_bytes,
                    "formula": persistent_formula(r.num_params, n, r.stage, precision),
                    "temp": rep.temp_bytes,
                    "peak": rep.peak_bytes,
                    "estimate": r.estimate.total,
                    "verdict": rep.verdict(),
                    "collectives": rep.collective_summary(),
                    "kernels": rep.kernels_per_step,
                    "seconds": rep.compile_seconds,
                }
            )
            log(f"  -> peak {rep.peak_bytes / GB:.2f} GB, estimate {r.estimate.total / GB:.2f} GB")
    return out


def part2(kind, n):
    # LLaMA-7B's width with 36 layers: Φ = 7.55e9, the paper's 7.5B within 1%.
    shape = model_shape(layers=36, hidden=4096, heads=32, vocab=32000, seq=2048, batch=1)
    rows = gpu.plan(
        plan_zero(kind, n),
        shape,
        cases=gpu.plan_cases(None, "whole"),
        on_case=lambda label, i, t: log(f"part 2: stage {label} ({i + 1}/{t})"),
    )
    phi = shape.num_params
    out = []
    for r in rows:
        grads = 2 * phi / (n if r.stage >= 2 else 1)
        out.append(
            {
                "stage": r.stage,
                "phi": phi,
                "shape": f"{shape.layers}x{shape.hidden}",
                "paper": PAPER[r.stage],
                "paper_less_grads": PAPER[r.stage] - grads / GB * 7.5e9 / phi,
                "state": r.state_bytes,
                "formula": persistent_formula(phi, n, r.stage, "bf16"),
            }
        )
    return out


def yolov5s_tree():
    """350 fp32 leaves shaped like YOLOv5s (v6 yaml, width 0.5, depth 0.33): 57 Conv+BN modules
    (kernel, BN scale/bias/mean/var and the BN step counter as a float scalar: 6 leaves each),
    the 3 Detect convolutions (kernel, bias) and the anchors and strides."""
    convs = [(3, 32, 6), (32, 64, 3)]

    def c3(c1, c2, n):
        h = c2 // 2
        return [(c1, h, 1), (c1, h, 1), (2 * h, c2, 1)] + [(h, h, 1), (h, h, 3)] * n

    convs += c3(64, 64, 1) + [(64, 128, 3)] + c3(128, 128, 2) + [(128, 256, 3)]
    convs += c3(256, 256, 3) + [(256, 512, 3)] + c3(512, 512, 1) + [(512, 256, 1), (1024, 512, 1)]
    convs += [(512, 256, 1)] + c3(512, 256, 1) + [(256, 128, 1)] + c3(256, 128, 1)
    convs += [(128, 128, 3)] + c3(256, 256, 1) + [(256, 256, 3)] + c3(512, 512, 1)
    tree = {}
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    for i, (c1, c2, k) in enumerate(convs):
        bn = {x: f(c2) for x in ("scale", "bias", "mean", "var")}
        tree[f"conv{i:02d}"] = {"kernel": f(k, k, c1, c2), **bn, "steps": f()}
    for j, c in enumerate((128, 256, 512)):
        tree[f"detect{j}"] = {"kernel": f(1, 1, c, 255), "bias": f(255)}
    tree["anchors"], tree["stride"] = f(3, 3, 2), f(3)
    return tree


def part3(kind, n=8):
    tree = yolov5s_tree()
    leaves = len(jax.tree.leaves(tree))
    mesh = gpu.compile_only_mesh(kind, n)
    rep = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), tree
    )
    decay = 0.999
    replicated = jax.jit(
        lambda e, p: jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, e, p), donate_argnums=0
    )
    hlo = replicated.lower(rep, rep).compile().as_text()
    out = [{"case": "replicated tree.map", "leaves": leaves, "kernels": gpu.kernels_per_step(hlo)}]
    for name, bucket in (("per-leaf sharded", 0), ("bucketed (<= 4096 elements)", 4096)):
        ema = jz.ShardedEMA(decay, bucket_leaves_up_to=bucket)
        zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=2)
        state = zero.abstract_state(tree, ema=ema)
        master = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
            tree,
            zero.shard_specs(tree),
        )
        fn = jax.jit(lambda e, m, t, z=zero, em=ema: z.update_ema(em, e, m, step=t, apply=True))
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
        hlo = fn.lower(state.ema, master, step).compile().as_text()
        ops = gpu.collectives_per_step(hlo, n)
        out.append(
            {
                "case": name,
                "leaves": leaves,
                "kernels": gpu.kernels_per_step(hlo),
                "collectives": len(ops),
            }
        )
        log(f"part 3: {name}: {out[-1]['kernels']} kernels")
    return out


def part4(kind, n):
    """Stage 3 per layer, bf16: cuDNN flash attention (part 1) vs XLA's reference attention,
    which holds each layer's f32 scores, probabilities and causal mask (seq x seq x heads)."""
    out = []
    for attention in ("auto", "xla"):  # auto: cuDNN flash attention in bf16
        shape = model_shape(
            layers=32, hidden=4096, heads=32, vocab=32000, seq=2048, batch=1, attention=attention
        )
        (r,) = gpu.plan(plan_zero(kind, n), shape)
        log(f"part 4: {attention} attention: peak {r.gpu_bytes / GB:.2f} GB")
        out.append(
            {
                "attention": attention,
                "temp": r.report.temp_bytes,
                "peak": r.gpu_bytes,
                "estimate": r.estimate.total,
                "working": 2 * shape.heads * shape.seq**2,  # the estimator's 2as^2 (16-bit)
            }
        )
    return out


def write(results, kind, n, path):
    g = lambda b: f"{b / GB:.2f}"
    lines = [f"## Deviceless XLA:GPU compiles ({kind}, GB = 1e9 bytes per device)", ""]
    if "part1" in results:
        lines += [f"### LLaMA-7B, N={n}, Adam, micro-batch 1 x 2048 tokens per device", ""]
        rows = [
            [
                r["precision"],
                r["stage"],
                g(r["state"]),
                g(r["formula"]),
                g(r["temp"]),
                g(r["peak"]),
                g(r["estimate"]),
                f"{r['peak'] / r['estimate']:.2f}x",
                r["verdict"],
                r["collectives"],
                r["kernels"],
                f"{r['seconds']:.0f}",
            ]
            for r in results["part1"]
        ]
        header = [
            "precision",
            "stage",
            "state (args - batch)",
            "persistent formula",
            "temp",
            "peak (arg+out-alias+temp)",
            "estimate_memory",
            "peak/estimate",
            "verdict",
            "collectives per step",
            "kernels/step",
            "compile s",
        ]
        lines += [md(header, rows), ""]
    if "part2" in results:
        r0 = results["part2"][0]
        lines += [
            f"### ZeRO paper, 7.5B / N={n}, bf16 Adam ({r0['shape']} LLaMA shape, Φ = "
            f"{r0['phi'] / 1e9:.3f}B)",
            "",
        ]
        rows = [
            [
                r["stage"],
                r["paper"],
                f"{r['paper_less_grads']:.2f}",
                g(r["state"] * 7.5e9 / r["phi"]),
                g(r["state"]),
                g(r["formula"]),
            ]
            for r in results["part2"]
        ]
        header = [
            "stage",
            "paper (p+g+opt)",
            "paper less grads",
            "compiled state, scaled to 7.5B",
            "compiled state",
            "formula (no grads)",
        ]
        lines += [md(header, rows), ""]
    if "part3" in results:
        lines += ["### Kernels per EMA update, 350-leaf YOLOv5s-shaped fp32 tree, 8 GPUs", ""]
        rows = [
            [r["case"], r["leaves"], r["kernels"], r.get("collectives", 0)]
            for r in results["part3"]
        ]
        lines += [md(["EMA", "leaves", "kernels per update", "collectives"], rows), ""]
    if "part4" in results:
        lines += [f"### Stage 3 per layer, bf16, LLaMA-7B, N={n}: attention kernel", ""]
        rows = [
            [
                r["attention"],
                g(r["temp"]),
                g(r["peak"]),
                g(r["estimate"]),
                f"{r['peak'] / r['estimate']:.2f}x",
                g(r["working"]),
            ]
            for r in results["part4"]
        ]
        header = [
            "attention",
            "temp",
            "peak",
            "estimate_memory",
            "peak/estimate",
            "estimator's attention working set (2 a s^2)",
        ]
        lines += [md(header, rows), ""]
        flash, ref = results["part4"]
        lines += [
            f"XLA's reference attention needs {g(ref['temp'] - flash['temp'])} GB more "
            f"temporaries than cuDNN's flash attention: it materialises each layer's f32 "
            f"scores, their gradient, the bf16 probabilities and the causal mask (heads x seq "
            f"x seq), where the estimator assumes one 16-bit copy ({g(flash['working'])} GB).",
            "",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100", choices=list(gpu.GPU_KINDS))
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4], choices=[1, 2, 3, 4])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_scale.md"))
    args = ap.parse_args(argv)
    path = os.path.splitext(args.out)[0] + ".json"
    results = {}
    if os.path.exists(path):  # keep the parts not rerun
        with open(path) as f:
            results = json.load(f)
    for part, fn in ((1, part1), (2, part2), (3, part3), (4, part4)):
        if part in args.parts:
            results[f"part{part}"] = fn(args.gpu) if part == 3 else fn(args.gpu, args.devices)
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
            print(write(results, args.gpu, args.devices, args.out), flush=True)
    if os.path.abspath(args.out) == os.path.join(HERE, "results", "gpu_scale.md"):
        docs_tables.sync()  # docs/benchmarks.md shows the last run's tables
    return 0


if __name__ == "__main__":
    sys.exit(main())
