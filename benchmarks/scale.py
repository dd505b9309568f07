"""Ahead-of-time compile (no execution) of full ZeRO train steps at GPT-2-XL and LLaMA-7B scale.

    python benchmarks/scale.py                 # N = 8 and 64, both models, stages 0-3, bf16
    python benchmarks/scale.py --devices 8 --models gpt2-xl     # a subset
    python benchmarks/scale.py --gpu h100      # XLA:GPU, no GPU needed: benchmarks/gpu_scale.py

Nothing is allocated: the state is ``zero.abstract_state(ShapeDtypeStruct params)`` and the
step is ``step.jitted.lower(abstract_state, abstract_batch).compile()`` on N simulated CPU
devices (one subprocess per device count, because ``XLA_FLAGS`` must be set before jax starts).
Models use ``nn.scan`` over ``nn.remat`` layers (one compiled layer body; activations
checkpointed per layer), a micro-batch of one sequence per device, and Adam in bf16
(``precision="bf16"``: bf16 params/grads, fp32 master and moments).

Reported per (model, N, stage):

* compiled per-device memory from ``memory_analysis()``: argument (the state + batch), temp,
  argument + temp, against ``jz.estimate_memory`` (params + grads + optimizer + activations
  with ``ckpt_every=1``) and the persistent-state formula (14Φ / 2Φ+12Φ/N / 2Φ+12Φ/N / 14Φ/N);
* collective payload per device per step (while-loop bodies x trip count) against theory.

Part 3, stage-3 parameter gathering: at GPT-2-XL width (d=1600) on N=8, 4 vs 16 scanned
layers: where the parameter all-gathers sit (entry computation or the layer loop) and how temp
memory grows with depth, for stage 3 gathering the whole model up front (``ZeRO(stage=3)``) and
one layer at a time (``ZeRO(stage=3, layers="layers")`` with ``jaxzero.gather_layer`` inside the
rematerialised scan body; its backward reduce-scatters the layer's gradient). Rows labelled
``3-per-layer`` are the latter.

Writes ``benchmarks/results/scale.json`` and ``scale.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from jaxzero.simulate import cpu_xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_NAMES = ("gpt2-xl", "llama-7b")
SEQ = {"gpt2-xl": 1024, "llama-7b": 2048}


def model_config(name: str, layers: int | None = None):
    """The :class:`jaxzero.gpu.models.ModelShape` of ``name``: scanned, rematerialised layers
    through ``jaxzero.gather_layer``, XLA's attention (it compiles for CPU)."""
    from jaxzero.gpu.models import model_shape

    common = dict(seq=SEQ[name], attention="xla", loop="gather_layer")
    if name == "gpt2-xl":
        return model_shape(
            arch="gpt", layers=layers or 48, hidden=1600, heads=25, vocab=50257, ffn=6400, **common
        )
    if name == "llama-7b":
        return model_shape(
            arch="llama",
            layers=layers or 32,
            hidden=4096,
            heads=32,
            vocab=32000,
            ffn=11008,
            **common,
        )
    raise ValueError(f"unknown model {name!r}; use one of {MODEL_NAMES}")


# --------------------------------------------------------------------------- worker side


def compile_case(
    model_name, cfg, n, stage, *, per_layer=False, skip_nonfinite=True, precision="bf16"
):
    """Compile one step; returns the measurements (no arrays are allocated)."""
    import jax
    import jax.numpy as jnp
    import optax
    from common import collectives, count, memory_stats
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxzero as jz
    from jaxzero.gpu.models import abstract_params, make_loss
    from jaxzero.memory import collective_ops

    seq = SEQ[model_name]
    t0 = time.perf_counter()
    params_abs = abstract_params(cfg)
    phi = count(params_abs)
    mesh = jz.data_parallel_mesh(n)
    zero = jz.ZeRO(
        optax.adam(1e-4),
        mesh,
        stage=stage,
        precision=precision,
        skip_nonfinite=skip_nonfinite,
        layers="layers" if per_layer else None,
    )
    loss_fn = make_loss(cfg)
    jitted = jz.make_train_step(loss_fn, zero).jitted
    state = zero.abstract_state(params_abs)
    bs = NamedSharding(mesh, P("data"))
    tok = jax.ShapeDtypeStruct((n, seq), jnp.int32, sharding=bs)  # one sequence per device
    lowered = jitted.lower(state, {"x": tok, "y": tok})
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    hlo = compiled.as_text()
    col = collectives(hlo, n)
    ag_ops = [op for op in collective_ops(hlo) if op.kind == "all-gather"]
    from common import computation_multipliers

    mult = computation_multipliers(hlo)
    ag_big = [op for op in ag_ops if op.bytes >= 1 << 20]
    est = jz.estimate_memory(
        phi,
        n,
        stage=stage,
        optimizer="adam",
        precision=precision,
        batch=1,
        seq=seq,
        hidden=cfg.hidden,
        layers=cfg.layers,
        heads=cfg.heads,
        vocab=cfg.vocab,
        layer_params=layer_params(params_abs) if per_layer else None,
    )
    state_bytes = sum(x.size * x.dtype.itemsize // _shards(x) for x in jax.tree.leaves(state))
    mem = memory_stats(compiled)
    return {
        "model": model_name,
        "layers": cfg.layers,
        "d_model": cfg.hidden,
        "seq": seq,
        "devices": n,
        "stage": "3-per-layer" if per_layer else stage,
        "skip_nonfinite": skip_nonfinite,
        "precision": precision,
        "params": phi,
        **mem,
        "argument_plus_temp": mem["argument_bytes"] + mem["temp_bytes"],
        "state_bytes_per_device": int(state_bytes),
        "estimate": {
            "params": est.params,
            "grads": est.grads,
            "optimizer": est.optimizer,
            "activations": est.activations,
            "gathered": est.gathered,
            "total": est.total,
        },
        "collectives": col,
        "big_all_gathers": {
            "count": len(ag_big),
            "in_loop": sum(abs(mult.get(op.computation, 1)) > 1 for op in ag_big),
            "in_entry": sum(abs(mult.get(op.computation, 1)) == 1 for op in ag_big),
        },
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
    }


def layer_params(params) -> int:
    """Parameters of one scanned layer (the stack's leaves carry the layer axis first)."""
    import jax

    return sum(x.size // x.shape[0] for x in jax.tree.leaves(params["layers"]))


def _shards(x) -> int:
    """How many pieces a ShapeDtypeStruct's sharding splits it into (per device share)."""
    s = x.sharding
    shape = s.shard_shape(x.shape)
    full = 1
    for a, b in zip(x.shape, shape, strict=True):
        full *= a // b if b else 1
    return full


def worker(args) -> None:
    sys.path.insert(0, os.path.join(HERE, ".."))
    sys.path.insert(0, HERE)
    import resource

    import jax

    n = args.devices[0]
    assert jax.device_count() == n, (jax.device_count(), n)
    out = []

    def run(model_name, cfg, stage, per_layer=False, part=None, skip=True, precision="bf16"):
        label = f"{model_name} L={cfg.layers} N={n} stage {stage} {precision}" + (
            " layers='layers'" if per_layer else ""
        )
        try:
            r = compile_case(
                model_name,
                cfg,
                n,
                stage,
                per_layer=per_layer,
                skip_nonfinite=skip,
                precision=precision,
            )
            r["part"] = part
            r["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
            out.append(r)
            print(
                f"  {label}: compile {r['compile_s']:.1f}s, arg {r['argument_bytes'] / 1e9:.2f} GB,"
                f" temp {r['temp_bytes'] / 1e9:.2f} GB, estimate {r['estimate']['total'] / 1e9:.2f}"
                f" GB, AG in loop {r['big_all_gathers']['in_loop']}/{r['big_all_gathers']['count']}",
                flush=True,
            )
        except Exception as e:  # record and go on: the report says what failed
            out.append(
                {
                    "model": model_name,
                    "layers": cfg.layers,
                    "devices": n,
                    "stage": stage,
                    "part": part,
                    "error": f"{type(e).__name__}: {e}"[:2000],
                }
            )
            print(f"  {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)

    for name in args.models:
        cfg = model_config(name)
        for stage in args.stages:
            run(name, cfg, stage, part="scale")
        if 3 in args.stages and not args.no_per_layer:
            run(name, cfg, 3, per_layer=True, part="scale")
        if name == "llama-7b" and n == 64:
            # fp32: no 16-bit tensors for XLA:CPU to widen, so the compiled buffers are the
            # ones a GPU would allocate (up to layouts); the estimator's check row.
            for stage in (0, 3):
                run(name, cfg, stage, per_layer=stage == 3, part="scale", precision="fp32")
    if args.part3:
        for layers in (4, 16):
            cfg = model_config("gpt2-xl", layers)
            run("gpt2-xl", cfg, 3, part="part3")
            run("gpt2-xl", cfg, 3, per_layer=True, part="part3")
        # What skip_nonfinite's per-leaf jnp.where costs in temp memory.
        cfg = model_config("gpt2-xl", 4)
        for stage in (0, 2):
            for skip in (True, False):
                run("gpt2-xl", cfg, stage, part="skip", skip=skip)


# --------------------------------------------------------------------------- parent side


def gb(x):
    return "-" if x is None else f"{x / 1e9:.2f}"


def render(rows: list[dict], meta: dict) -> str:
    from common import md_table

    ok = [r for r in rows if "error" not in r]
    lines = [
        "## Ahead-of-time compile at scale (bf16 Adam, micro-batch 1 sequence/device, "
        "nn.scan + nn.remat layers, simulated CPU devices; GB = 1e9 bytes per device)",
        "",
    ]
    head = [
        "model",
        "N",
        "stage",
        "precision",
        "Φ",
        "argument (state+batch)",
        "persistent formula",
        "temp",
        "argument+temp",
        "estimate_memory (p+g+opt+act+gathered)",
        "ratio",
        "AR / AG / RS payload (measured, ×2Φ)",
        "theory (bf16; CPU moves f32 = ×2)",
        "compile s",
    ]
    body = []
    theory = {
        0: "AR 1",
        1: "AR 1 + AG 1",
        2: "RS 1 + AG 1",
        3: "AG 1 + RS 1",
        "3-per-layer": "AG 2 + RS 1",
    }
    for r in [r for r in ok if r["part"] == "scale"]:
        phi = r["params"]
        p = r["collectives"]["payload"]
        stage = r["stage"]
        s = 3 if stage == "3-per-layer" else stage
        fp32 = r.get("precision", "bf16") == "fp32"
        n_dev = r["devices"]
        formula = {
            0: 14 * phi,
            1: 2 * phi + 12 * phi // n_dev,
            2: 2 * phi + 12 * phi // n_dev,
            3: 14 * phi // n_dev,
        }[s]
        if fp32:  # params are the master: 4 + 8 bytes, sharded as the stage says
            formula = {0: 12 * phi, 1: 4 * phi + 8 * phi // n_dev}.get(
                s, 4 * phi + 8 * phi // n_dev if s == 2 else 12 * phi // n_dev
            )
        body.append(
            [
                r["model"],
                r["devices"],
                stage,
                r.get("precision", "bf16"),
                f"{phi / 1e9:.3f}B",
                gb(r["argument_bytes"]),
                gb(formula),
                gb(r["temp_bytes"]),
                gb(r["argument_plus_temp"]),
                gb(r["estimate"]["total"]),
                f"{r['argument_plus_temp'] / r['estimate']['total']:.2f}x",
                " / ".join(
                    f"{p.get(k, 0) / (2 * phi):.2f}"
                    for k in ("all-reduce", "all-gather", "reduce-scatter")
                ),
                theory[stage],
                f"{r['compile_s']:.0f}",
            ]
        )
    lines += [md_table(head, body), ""]
    fails = [r for r in rows if "error" in r]
    if fails:
        lines += ["Failed compiles:", ""]
        lines += [
            f"* {r['model']} L={r['layers']} N={r['devices']} stage {r['stage']}: "
            f"{r['error'][:300]}"
            for r in fails
        ]
        lines.append("")
    p3 = [r for r in ok if r["part"] == "part3"]
    if p3:
        lines += [
            "### Part 3: stage-3 parameter gathering with scanned layers (GPT-2-XL width d=1600, "
            f"seq {SEQ['gpt2-xl']}, N=8, bf16)",
            "",
        ]
        head3 = [
            "variant",
            "layers",
            "Φ",
            "big all-gathers: in loop / in entry",
            "AG payload ×2Φ",
            "RS payload ×2Φ",
            "temp",
            "argument",
        ]
        body3 = []
        for r in p3:
            phi = r["params"]
            p = r["collectives"]["payload"]
            body3.append(
                [
                    "stage 3, whole model" if r["stage"] == 3 else "stage 3, layers='layers'",
                    r["layers"],
                    f"{phi / 1e6:.0f}M",
                    f"{r['big_all_gathers']['in_loop']} / {r['big_all_gathers']['in_entry']}",
                    f"{p.get('all-gather', 0) / (2 * phi):.2f}",
                    f"{p.get('reduce-scatter', 0) / (2 * phi):.2f}",
                    gb(r["temp_bytes"]),
                    gb(r["argument_bytes"]),
                ]
            )
        lines += [md_table(head3, body3), ""]
        by = {(r["stage"], r["layers"]): r for r in p3}
        d = 1600
        layer_params = 12 * d * d + 13 * d  # qkv, out, fc1, fc2 kernels + biases + 2 norms
        for st, label in ((3, "stage 3, whole model"), ("3-per-layer", "stage 3, layers='layers'")):
            if (st, 4) in by and (st, 16) in by:
                grow = (by[(st, 16)]["temp_bytes"] - by[(st, 4)]["temp_bytes"]) / 12
                lines.append(
                    f"* {label}: temp grows {grow / 1e6:.0f} MB per added layer; one layer's "
                    f"gathered weights are {2 * layer_params / 1e6:.0f} MB in bf16 "
                    f"({4 * layer_params / 1e6:.0f} MB in f32, the dtype XLA:CPU gathers in)."
                )
        lines += [
            "* Stage 3 without `layers=` gathers every parameter at the start of the step "
            "(`ZeRO.gather_params` inside the gradient `shard_map`): all big all-gathers sit in "
            "the entry computation, none in the layer loop, and temp grows by the whole "
            "model — each added layer adds its gathered weights plus its full, unreduced "
            "gradient (reduce-scattered only after the backward loop).",
            "* With `layers='layers'` the model's `jaxzero.gather_layer` all-gathers inside the "
            "rematerialised scan body (forward, and again when the backward recomputes the "
            "layer; its backward reduce-scatters the layer's gradient inside the backward "
            "loop): temp grows by the layer's 1/N gradient shard and optimizer temporaries, "
            "while one layer's gathered weights are a constant. Cost: the layer parameters are "
            "gathered twice (FSDP reshard_after_forward=True), AG payload ≈ 2× the model.",
            "",
        ]
    sk = [r for r in ok if r["part"] == "skip"]
    if sk:
        lines += [
            "### skip_nonfinite's cost in temp memory (GPT-2-XL width, 4 layers, N=8, bf16)",
            "",
            md_table(
                ["stage", "skip_nonfinite", "Φ", "temp", "temp / Φ (bytes per parameter)"],
                [
                    [
                        r["stage"],
                        r["skip_nonfinite"],
                        f"{r['params'] / 1e6:.0f}M",
                        gb(r["temp_bytes"]),
                        f"{r['temp_bytes'] / r['params']:.2f}",
                    ]
                    for r in sk
                ],
            ),
            "",
            "* `ZeRO.apply_gradients` implements the skip with a per-leaf "
            "`jnp.where(apply, new, old)` over master and optimizer state: old and new copies "
            "are then live together, so XLA cannot update the donated buffers in place.",
            "",
        ]
    lines += [
        "Notes:",
        "* argument = per-device state (params + fp32 master + Adam moments) + the batch; it "
        "matches the persistent formula exactly (the compiled step's inputs are the sharded "
        "state). temp = everything else XLA keeps live during the step (gradients, gathered "
        "parameters, activations, optimizer temporaries).",
        "* estimate_memory counts 2Φ bytes of bf16 gradients (stage 0/1) or 2Φ/N (stage 2/3), "
        "2Φ or 2Φ/N of params, 12Φ(/N) of optimizer state, activations (checkpoints, one "
        "layer's working set, f32 logits ×3 with `vocab=`) and, for stage 3 with `layers=`, the "
        "gathered working set (p+g)·`layer_params` + g·(Φ − L·`layer_params`) (one layer whole "
        "with its gradient, and the full gradients of the embeddings/head). It does not count "
        "unreduced full gradients before a stage-2 reduce-scatter, the whole model gathered by "
        "stage 3 without `layers=`, nor XLA:CPU's f32 widening of bf16 matmul operands "
        "and collectives (f32 temp buffers here; bf16 on GPU): compare the fp32 rows, where "
        "nothing is widened.",
        "* collective payloads per device per step, in units of 2Φ bytes (the model in bf16): "
        "all-reduce / all-gather = output bytes, reduce-scatter = output × N, loop bodies × trip "
        "count. The bf16 theory is 1 per collective; XLA:CPU widens bf16 collectives to f32, so "
        "jaxzero's measured payloads read 2.00 here (they would read 1.00 on GPU).",
        f"* machine: {meta.get('cpu_count')} cores, jax {meta.get('jax')}; wall times: "
        + ", ".join(f"N={k}: {v:.0f} s" for k, v in meta.get("wall_s", {}).items()),
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--gpu" in argv or any(a.startswith("--gpu=") for a in argv):
        # Deviceless XLA:GPU compiles (jax[cuda12]): benchmarks/gpu_scale.py, whose tables also
        # go into docs/benchmarks.md.
        sys.path.insert(0, HERE)
        import gpu_scale

        gpu_scale.main(argv)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--models", nargs="+", default=list(MODEL_NAMES), choices=MODEL_NAMES)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--no-per-layer", action="store_true", help="skip stage 3 with layers='layers'")
    ap.add_argument("--no-part3", action="store_true", help="skip the 4-vs-16-layer study")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "scale.json"))
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per device count")
    # worker mode (internal)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--part3", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--render", action="store_true", help="re-render --out's JSON to markdown")
    args = ap.parse_args(argv)

    if args.render:
        sys.path.insert(0, HERE)
        with open(args.out) as f:
            result = json.load(f)
        md = render(result["rows"], result["meta"])
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(md + "\n")
        print(md)
        return
    if args.worker:
        worker(args)
        return

    rows, wall = [], {}
    for n in args.devices:
        tmp = f"{os.path.splitext(args.out)[0]}_N{n}.partial.json"
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--devices",
            str(n),
            "--json",
            tmp,
            "--models",
            *args.models,
            "--stages",
            *map(str, args.stages),
        ]
        if args.no_per_layer:
            cmd.append("--no-per-layer")
        if n == 8 and not args.no_part3:
            cmd.append("--part3")
        env = dict(os.environ)
        env["XLA_FLAGS"] = cpu_xla_flags(n, env.get("XLA_FLAGS", ""))
        env["JAX_PLATFORMS"] = "cpu"
        print(f"N={n}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        try:
            subprocess.run(cmd, env=env, check=False, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"N={n}: timed out after {args.timeout} s; keeping what finished", flush=True)
        wall[n] = time.perf_counter() - t0
        if os.path.exists(tmp):
            with open(tmp) as f:
                rows += json.load(f)
            os.remove(tmp)
    sys.path.insert(0, HERE)
    from importlib.metadata import version

    meta = {"cpu_count": os.cpu_count(), "jax": version("jax"), "wall_s": wall}
    result = {
        "benchmark": "scale",
        "meta": meta,
        "rows": rows,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    md = render(rows, meta)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print()
    print(md)


if __name__ == "__main__":
    main()
