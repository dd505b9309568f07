"""Benchmark: hand-written data parallelism, FSDP by annotation, and jaxzero stages 0-3.

    python benchmarks/run.py            # ~25M-parameter decoder, 8 simulated CPU devices
    python benchmarks/run.py --quick    # ~2.2M parameters (< 5 min on 2 cores)
    python benchmarks/run.py --quick --smoke --out /tmp/x.json   # CI smoke: tiny model, 1 round

Configurations, all training the same decoder-only transformer (GPT-2 style, ``nn.scan``-ed
layers) with ``optax.adam`` on the same global batch, on an 8-device ``data`` mesh:

* ``dp``: plain replicated data parallelism by hand: ``jax.jit`` with params and optimizer
  state replicated, the batch sharded over ``data``; GSPMD inserts the gradient all-reduce.
* ``fsdp``: "FSDP by annotation" (MaxText style): params and optimizer state annotated
  ``NamedSharding`` over ``data`` on their largest divisible dimension, batch sharded, plain
  ``jax.jit`` with in/out shardings; GSPMD chooses every collective.
* ``zero{0..3}-{fp32,bf16}``: ``jaxzero.make_train_step`` with ``ZeRO(stage=s,
  precision=...)``.

For each: persistent bytes per device (``device_bytes`` of params + master + optimizer state)
against the ZeRO formula, compiled temp bytes (``memory_analysis().temp_size_in_bytes``),
collective payload bytes per step by kind from the compiled HLO (while-loop bodies multiplied
by their trip count; all-reduce / all-gather: output bytes, reduce-scatter: output x N) against
theory, and the median step time, measured round-robin (every round runs every configuration,
starting at a rotating position, so drift hits all of them alike) with its ratio to ``dp``.
Then the EMA update: a replicated ``tree.map`` EMA against jaxzero's sharded EMA
(``ZeRO.update_ema``) on the model's parameter tree, interleaved the same way.

Writes ``benchmarks/results/run[_quick|_smoke].json`` and ``.md`` (or ``--out``) and prints the
markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# 8 simulated CPU devices, set before jax starts. --smoke also compiles with LLVM -O0
# (`--xla_backend_optimization_level=0`): ~2.5x faster compiles, the same HLO (collectives,
# buffer assignment, memory_analysis); only the machine code, hence step times, differ.
from jaxzero.simulate import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices()  # 8 simulated CPU devices unless XLA_FLAGS names a count
if "--smoke" in sys.argv[1:] and "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import optax  # noqa: E402
from common import (  # noqa: E402
    collective_theory,
    collectives,
    computation_multipliers,
    count,
    fmt_bytes,
    make_batch,
    md_table,
    median,
    memory_stats,
    persistent_formula,
    replicated_ema_update,
    sharded_ema_case,
)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero.gpu.models import init_params, make_loss, model_shape  # noqa: E402
from jaxzero.memory import collective_ops, device_bytes  # noqa: E402
from jaxzero.zero import specs as sh  # noqa: E402

N_DEVICES = 8
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


def gpt(vocab: int, hidden: int, layers: int, heads: int, ffn: int, seq: int):
    """A GPT-2-style decoder of jaxzero.gpu.models: XLA's attention (it compiles for CPU),
    scanned layers through ``jaxzero.gather_layer``, no rematerialisation."""
    return model_shape(
        arch="gpt",
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        seq=seq,
        ffn=ffn,
        attention="xla",
        loop="gather_layer_noremat",
    )


# GPT-2-style decoders. full: 25.2M params; quick: 2.2M; smoke: 0.13M.
MODELS = {
    "full": dict(
        cfg=gpt(vocab=12288, hidden=512, layers=6, heads=8, ffn=2048, seq=64),
        batch=16,
        rounds=5,
        steps=1,
        ema_reps=10,
    ),
    "quick": dict(
        cfg=gpt(vocab=8192, hidden=128, layers=6, heads=4, ffn=512, seq=64),
        batch=16,
        rounds=8,
        steps=1,
        ema_reps=10,
    ),
    "smoke": dict(
        cfg=gpt(vocab=512, hidden=64, layers=2, heads=2, ffn=256, seq=16),
        batch=8,
        rounds=1,
        steps=1,
        ema_reps=2,
    ),
}

# Collective tolerance: a kind with a theoretical payload must be within REL_TOL of it; a kind
# with none may carry only scalars (loss mean, finite flags): < ZERO_TOL of 4Φ bytes.
REL_TOL = 0.05
ZERO_TOL = 0.001
# Keep every configuration's state alive (step-level interleaving) when all of them together
# take at most this many bytes (summed over the simulated devices, i.e. host RAM).
KEEP_ALIVE_BYTES = 4 * 10**9


def per_device(tree) -> tuple[int, int]:
    """(max, min) bytes over devices of the arrays in ``tree``."""
    counts = device_bytes(tree)
    return max(counts.values(), default=0), min(counts.values(), default=0)


def lowered_collective_dtypes(lowered) -> dict[str, list[str]]:
    """Dtypes of the collectives in the HLO *before* XLA's optimisation passes (what the
    program asked for; XLA:CPU may widen bf16 afterwards)."""
    try:
        text = lowered.compiler_ir(dialect="hlo").as_hlo_text()
    except Exception:  # pragma: no cover - depends on jax internals
        return {}
    out: dict[str, list[str]] = {}
    for op in collective_ops(text):
        dts = out.setdefault(op.kind, [])
        dts.extend(d for d in op.dtypes if d not in dts)
    return out


def collective_op_list(hlo: str, n: int) -> list[dict]:
    """Every collective with its shape and how often it runs per step (loop trip counts)."""
    mult = computation_multipliers(hlo)
    return [
        {
            "kind": op.kind,
            "shape": op.shape,
            "runs_per_step": abs(mult.get(op.computation, 1)),
            "payload_bytes": op.bytes * (n if op.kind == "reduce-scatter" else 1),
        }
        for op in collective_ops(hlo)
    ]


def param_shapes(params_abs, n: int) -> set[tuple[int, ...]]:
    """Shapes a parameter (or its gradient) can take in the HLO: the full leaf, a scanned
    layer's slice (leading layer axis dropped), and either of them split n ways on a dim."""
    out = set()
    for path, x in jax.tree_util.tree_flatten_with_path(params_abs)[0]:
        shapes = [tuple(x.shape)]
        if sh.is_stacked(path, ("layers",)):
            shapes.append(tuple(x.shape[1:]))
        for s in shapes:
            out.add(s)
            for d, size in enumerate(s):
                if size % n == 0:
                    out.add(s[:d] + (size // n,) + s[d + 1 :])
    return out


_ELEM = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def payload_by_class(op_list: list[dict], shapes: set, n: int) -> dict:
    """Split each kind's payload into parameter-shaped tensors and everything else
    (activations, scalars)."""
    out: dict[str, dict[str, int]] = {}
    for op in op_list:
        scale = op["runs_per_step"] * (n if op["kind"] == "reduce-scatter" else 1)
        for dtype, dims in _ELEM.findall(op["shape"]):
            shape = tuple(int(d) for d in dims.split(",") if d)
            nbytes = math.prod(shape) * (2 if "16" in dtype else 1 if dtype == "pred" else 4)
            cls = "param" if shape in shapes and len(shape) else "other"
            entry = out.setdefault(op["kind"], {"param": 0, "other": 0})
            entry[cls] += nbytes * scale
    return out


def check_collectives(payload: dict, theory: dict, phi: int) -> dict:
    """Per kind: measured, theory, relative error and ok (see REL_TOL / ZERO_TOL)."""
    out = {}
    for kind in KINDS:
        m, t = int(payload.get(kind, 0)), int(theory.get(kind, 0))
        if t:
            err = (m - t) / t
            ok = abs(err) <= REL_TOL
        else:
            err = m / (4 * phi)
            ok = err <= ZERO_TOL
        out[kind] = {"measured": m, "theory": t, "rel_err": err, "ok": bool(ok)}
    return out


# --------------------------------------------------------------------------- configurations


class Config:
    """One way of training: ``init(params) -> state``, ``run(state, batch) -> (state, loss)``,
    ``persistent(state)``; ``compile(params, batch)`` builds the executable once."""

    def __init__(self, name, kind, stage, precision, label):
        self.name, self.kind, self.stage, self.precision, self.label = (
            name,
            kind,
            stage,
            precision,
            label,
        )


def baseline_config(kind, loss_fn, tx, mesh, params_abs):
    """``dp`` (everything replicated) or ``fsdp`` (params + opt state annotated on their
    largest dimension divisible by N; the same rule jaxzero uses), plain ``jax.jit``."""
    n = mesh.shape["data"]
    shard = kind == "fsdp"
    param_sh = sh.named(mesh, sh.tree_specs(params_abs, n, "data", shard=shard))
    opt_abs = jax.eval_shape(tx.init, params_abs)
    opt_sh = sh.named(mesh, sh.tree_specs(opt_abs, n, "data", shard=shard))
    batch_sh = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(
        step,
        in_shardings=(param_sh, opt_sh, {"x": batch_sh, "y": batch_sh}),
        out_shardings=(param_sh, opt_sh, rep),
        donate_argnums=(0, 1),
    )
    init = jax.jit(lambda p: (p, tx.init(p)), out_shardings=(param_sh, opt_sh))
    label = "DP by hand (jit, replicated)" if kind == "dp" else "FSDP by annotation (jit, GSPMD)"
    c = Config(kind, kind, "dp" if kind == "dp" else "fsdp", "fp32", label)
    c.init = init
    c.lower = lambda state, batch: jitted.lower(state[0], state[1], batch)
    c.call = lambda compiled, state, batch: (lambda o: ((o[0], o[1]), o[2]))(
        compiled(state[0], state[1], batch)
    )
    c.persistent = lambda state: tuple(
        a + b for a, b in zip(per_device(state[0]), per_device(state[1]), strict=True)
    )
    return c


def zero_config(stage, precision, loss_fn, tx, mesh, params_abs):
    zero = jz.ZeRO(tx, mesh, stage=stage, precision=precision)
    step = jz.make_train_step(loss_fn, zero)
    shardings = zero.state_shardings(zero.abstract_state(params_abs))
    c = Config(
        f"zero{stage}-{precision}",
        "jaxzero",
        stage,
        precision,
        f"jaxzero stage {stage}, {precision}",
    )
    c.init = jax.jit(lambda p: zero.init(p), out_shardings=shardings)
    c.lower = lambda state, batch: step.jitted.lower(state, batch)
    c.call = lambda compiled, state, batch: (lambda o: (o[0], o[1]["loss"]))(compiled(state, batch))

    def persistent(state):
        parts = [per_device(state.params), per_device(state.opt_state)]
        if state.master is not None:
            parts.append(per_device(state.master))
        return tuple(sum(p[i] for p in parts) for i in (0, 1))

    c.persistent = persistent
    c.zero = zero
    return c


# --------------------------------------------------------------------------- EMA


def ema_section(params_host, mesh, reps: int, decay: float = 0.999) -> dict:
    """Replicated ``tree.map`` EMA vs ``ZeRO.update_ema`` (stage 2 and stage 0 masters) on the
    model's parameter tree; reps interleaved round-robin."""
    rep = NamedSharding(mesh, P())
    params = jax.device_put(params_host, rep)
    ema0 = jax.device_put(params_host, rep)  # its own buffers (params_host is numpy)
    cases = {"replicated": [replicated_ema_update(decay), [ema0, params]]}
    for name, stage, ema in (
        ("sharded_stage2", 2, jz.ShardedEMA(decay)),
        ("sharded_stage0", 0, jz.ShardedEMA(decay)),
        ("bucketed_stage2", 2, jz.ShardedEMA(decay, bucket_leaves_up_to=4096)),
    ):
        cases[name] = list(sharded_ema_case(mesh, params, ema, stage))
    times = {k: [] for k in cases}
    for r in range(reps + 1):  # the first pass is warm-up (and compile)
        for k, (fn, args) in cases.items():
            t0 = time.perf_counter()
            args[0] = jax.block_until_ready(fn(*args))
            if r:
                times[k].append((time.perf_counter() - t0) * 1e3)
    out = {k: {"median_ms": median(v), "min_ms": min(v), "reps": len(v)} for k, v in times.items()}
    out["replicated"]["ema_bytes_per_device"] = per_device(cases["replicated"][1][0])[0]
    for name in ("sharded_stage2", "sharded_stage0", "bucketed_stage2"):
        out[name]["ema_bytes_per_device"] = per_device(cases[name][1][0].ema)[0]
        suffix = name.replace("sharded_", "")
        out[f"ratio_replicated_over_{suffix}"] = (
            out["replicated"]["median_ms"] / out[name]["median_ms"]
        )
    return out


# --------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~2.2M-parameter model (< 5 min)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round (CI smoke)")
    ap.add_argument("--rounds", type=int, default=None, help="round-robin rounds of timing")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per config per round")
    ap.add_argument("--out", default=None, help="JSON path (the .md goes beside it)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel XLA compiles (default 2)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    spec = MODELS[mode]
    cfg, gbatch = spec["cfg"], spec["batch"]
    seq = cfg.seq
    rounds = args.rounds or spec["rounds"]
    steps = args.steps or spec["steps"]
    suffix = {"full": "", "quick": "_quick", "smoke": "_smoke"}[mode]
    out_json = args.out or os.path.join(HERE, "results", f"run{suffix}.json")
    out_md = os.path.splitext(out_json)[0] + ".md"

    mesh = jz.data_parallel_mesh(N_DEVICES)
    n = mesh.shape["data"]
    backend = jax.devices()[0].platform
    params_host = jax.device_get(init_params(cfg))  # numpy: every init is a fresh copy
    phi = count(params_host)
    params_abs = jax.eval_shape(lambda: params_host)
    loss_fn = make_loss(cfg)
    batch = jax.device_put(make_batch(cfg, gbatch), NamedSharding(mesh, P("data")))
    tx = optax.adam(1e-3)
    print(
        f"{mode}: decoder d={cfg.hidden} L={cfg.layers} vocab={cfg.vocab} seq={seq}, "
        f"{phi / 1e6:.2f}M params, global batch {gbatch}, {n} x {backend} devices, "
        f"{os.cpu_count()} cpus, jax {jax.__version__}",
        flush=True,
    )

    pshapes = param_shapes(params_abs, n)
    configs = [
        baseline_config("dp", loss_fn, tx, mesh, params_abs),
        baseline_config("fsdp", loss_fn, tx, mesh, params_abs),
    ]
    configs += [
        zero_config(s, p, loss_fn, tx, mesh, params_abs) for p in ("fp32", "bf16") for s in range(4)
    ]

    # ---- 1. init, persistent bytes, lowering: one configuration at a time (tracing is
    # single-threaded); states stay alive for step-level interleaving when they are small.
    rows, lowered, states = {}, {}, {}
    t_phase = time.perf_counter()
    # Decide from the formulas (before allocating) whether all states fit at once.
    total_state = n * sum(
        persistent_formula(phi, n, {"dp": 0, "fsdp": 3}.get(c.stage, c.stage), c.precision)
        for c in configs
    )
    keep_alive = total_state <= KEEP_ALIVE_BYTES
    for c in configs:
        t0 = time.perf_counter()
        state = c.init(params_host)
        pers_max, pers_min = c.persistent(state)
        lowered[c.name] = c.lower(state, batch)
        zero_stage = {"dp": 0, "fsdp": 3}.get(c.stage, c.stage)
        rows[c.name] = {
            "label": c.label,
            "kind": c.kind,
            "stage": c.stage,
            "precision": c.precision,
            "persistent_bytes": pers_max,
            "persistent_bytes_min": pers_min,
            "formula_bytes": persistent_formula(phi, n, zero_stage, c.precision),
            "init_and_lower_s": time.perf_counter() - t0,
        }
        if keep_alive:
            states[c.name] = state
        del state

    # ---- 2. compile (XLA releases the GIL: `--jobs` compiles in parallel)
    def compile_one(name):
        t0 = time.perf_counter()
        exe = lowered[name].compile()
        return name, exe, time.perf_counter() - t0

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        compiled = {}
        for name, exe, secs in pool.map(compile_one, [c.name for c in configs]):
            compiled[name] = exe
            rows[name]["compile_s"] = secs
    compile_phase_s = time.perf_counter() - t_phase
    for c in configs:
        exe, row = compiled[c.name], rows[c.name]
        ops = collective_op_list(exe.as_text(), n)
        col = collectives(exe.as_text(), n)
        nominal = collective_theory(phi, c.stage, c.precision)
        # XLA:CPU widens bf16 collectives to f32 (the lowered HLO asks for bf16; the compiled
        # HLO moves f32), so on CPU the bf16 rows are compared against f32 bytes.
        widen = backend == "cpu" and c.precision == "bf16"
        backend_theory = {k: v * 2 if widen else v for k, v in nominal.items()}
        check = check_collectives(col["payload"], backend_theory, phi)
        row["persistent_excess"] = row["persistent_bytes"] / row["formula_bytes"] - 1
        row.update(memory_stats(exe))
        row.update(
            {
                "collectives": col,
                "collective_ops": ops,
                "payload_by_class": payload_by_class(ops, pshapes, n),
                "collective_dtypes_requested": lowered_collective_dtypes(lowered[c.name]),
                "theory_nominal": nominal,
                "theory_backend": backend_theory,
                "bf16_widened_on_backend": widen,
                "collective_check": check,
                "collectives_ok": all(v["ok"] for v in check.values()),
            }
        )
        print(
            f"  {c.name:<12} compile {row['compile_s']:6.1f}s  persistent "
            f"{fmt_bytes(row['persistent_bytes']):>10} (formula {fmt_bytes(row['formula_bytes'])})"
            f"  temp {fmt_bytes(row['temp_bytes']):>10}  "
            + "  ".join(
                f"{SHORT[k]} {v / (4 * phi):.3f}x4Φ" for k, v in sorted(col["payload"].items())
            ),
            flush=True,
        )
    lowered.clear()
    print(
        f"  init + lower + compile: {compile_phase_s:.0f} s ({args.jobs} compile jobs)", flush=True
    )

    # ---- 3. timing, round-robin. keep_alive: every round runs ONE step of every configuration
    # (states persist; one warm-up step each first). Otherwise each round re-initialises each
    # configuration in turn, runs a warm-up step and `steps` timed steps, and frees it. The
    # starting configuration rotates every round, so drift hits all configurations alike.
    per_round = {c.name: [] for c in configs}
    times = {c.name: [] for c in configs}
    first_loss = {}

    def one_step(c, state):
        t0 = time.perf_counter()
        state, loss = c.call(compiled[c.name], state, batch)
        jax.block_until_ready((state, loss))
        return state, loss, (time.perf_counter() - t0) * 1e3

    t_timing = time.perf_counter()
    if keep_alive:
        for c in configs:  # warm-up
            states[c.name], loss, _ = one_step(c, states[c.name])
            first_loss[c.name] = float(loss)
    for r in range(rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c in order:
            if keep_alive:
                ts = []
                for _ in range(steps):
                    states[c.name], _, ms = one_step(c, states[c.name])
                    ts.append(ms)
            else:
                state = c.init(params_host)
                state, loss, _ = one_step(c, state)
                first_loss.setdefault(c.name, float(loss))
                ts = []
                for _ in range(steps):
                    state, _, ms = one_step(c, state)
                    ts.append(ms)
                del state
            times[c.name].extend(ts)
            per_round[c.name].append(median(ts))
        print(f"  round {r + 1}/{rounds} done", flush=True)
    states.clear()
    timing_s = time.perf_counter() - t_timing
    dp_med = median(times["dp"])
    for c in configs:
        row = rows[c.name]
        row["step_ms_median"] = median(times[c.name])
        row["step_ms_all"] = times[c.name]
        row["step_ms_per_round"] = per_round[c.name]
        row["ratio_of_medians_vs_dp"] = row["step_ms_median"] / dp_med
        # The headline ratio: median over rounds of (this config / dp in the same round).
        row["ratio_vs_dp"] = median(
            [a / b for a, b in zip(per_round[c.name], per_round["dp"], strict=True)]
        )
        row["first_step_loss"] = first_loss[c.name]

    print("  EMA update timing ...", flush=True)
    ema = ema_section(params_host, mesh, spec["ema_reps"] if not args.smoke else 1)

    result = {
        "benchmark": "run",
        "mode": mode,
        "model": {
            "kind": "GPT-2-style decoder, nn.scan layers",
            "d_model": cfg.hidden,
            "layers": cfg.layers,
            "heads": cfg.heads,
            "ffn": cfg.ffn,
            "vocab": cfg.vocab,
            "seq": seq,
            "global_batch": gbatch,
            "params": phi,
        },
        "optimizer": "optax.adam(1e-3)",
        "devices": n,
        "backend": backend,
        "machine": {
            "cpu_count": os.cpu_count(),
            "host": platform.machine(),
            "python": platform.python_version(),
            "load_avg_1m_at_end": os.getloadavg()[0],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        },
        "jax_version": jax.__version__,
        "jaxzero_version": jz.__version__,
        "rounds": rounds,
        "steps_per_round": steps,
        "tolerances": {"collective_rel": REL_TOL, "collective_zero_frac_of_4phi": ZERO_TOL},
        "configs": rows,
        "ema": ema,
        "timing_s": timing_s,
        "compile_phase_s": compile_phase_s,
        "compile_jobs": args.jobs,
        "states_kept_alive": keep_alive,
        "total_s": time.perf_counter() - t_start,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    md = render(result)
    print()
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(out_md, "w") as f:
        f.write(md + "\n")
    print(f"wrote {out_json} and {out_md} ({result['total_s']:.0f} s)")
    return result


def render(result: dict) -> str:
    phi, n = result["model"]["params"], result["devices"]
    m = result["model"]
    head = [
        "config",
        "persistent / device",
        "formula",
        "Δ",
        "temp (compiled)",
        "collectives / step (measured)",
        "theory (nominal dtype)",
        "coll. ok",
        "step ms (median)",
        "vs DP",
    ]
    rows = []
    for name, r in result["configs"].items():
        pay = r["collectives"]["payload"]
        cnt = r["collectives"]["count"]
        meas = ", ".join(
            f"{SHORT[k]} {pay[k] / (4 * phi):.2f}·4Φ ({cnt[k]} ops"
            + (
                f", {r['collectives']['in_loop'][k]} in loop"
                if r["collectives"]["in_loop"].get(k)
                else ""
            )
            + ")"
            for k in KINDS
            if pay.get(k)
        )
        dts = sorted({d for v in r["collectives"]["dtypes"].values() for d in v} - {"pred"})
        meas += f" [{'/'.join(dts)}]"
        theo = " + ".join(f"{SHORT[k]} {v / phi:.0f}Φ" for k, v in r["theory_nominal"].items())
        if r["bf16_widened_on_backend"]:
            theo += " (CPU: f32, ×2)"
        if r["kind"] == "jaxzero":
            ok = "yes" if r["collectives_ok"] else "NO"
        else:
            ok = (
                "(ref)"
                if r["stage"] == "dp" and r["collectives_ok"]
                else ("yes" if r["collectives_ok"] else "differs")
            )
        rows.append(
            [
                name,
                fmt_bytes(r["persistent_bytes"]),
                fmt_bytes(r["formula_bytes"]),
                f"{100 * r['persistent_excess']:+.2f}%",
                fmt_bytes(r["temp_bytes"]),
                meas,
                theo,
                ok,
                f"{r['step_ms_median']:.1f}",
                f"{r['ratio_vs_dp']:.2f}x",
            ]
        )
    e = result["ema"]
    ema_rows = [
        [
            "replicated tree.map EMA",
            f"{e['replicated']['median_ms']:.2f}",
            fmt_bytes(e["replicated"]["ema_bytes_per_device"]),
            "1.00x",
        ],
        [
            "jaxzero sharded EMA (stage 2 master)",
            f"{e['sharded_stage2']['median_ms']:.2f}",
            fmt_bytes(e["sharded_stage2"]["ema_bytes_per_device"]),
            f"{e['ratio_replicated_over_stage2']:.2f}x",
        ],
        [
            "jaxzero sharded EMA (stage 0 master, sliced)",
            f"{e['sharded_stage0']['median_ms']:.2f}",
            fmt_bytes(e["sharded_stage0"]["ema_bytes_per_device"]),
            f"{e['ratio_replicated_over_stage0']:.2f}x",
        ],
        [
            "jaxzero bucketed EMA (stage 2, bucket_leaves_up_to=4096)",
            f"{e['bucketed_stage2']['median_ms']:.2f}",
            fmt_bytes(e["bucketed_stage2"]["ema_bytes_per_device"]),
            f"{e['ratio_replicated_over_bucketed_stage2']:.2f}x",
        ],
    ]
    losses = {k: v["first_step_loss"] for k, v in result["configs"].items()}
    fsdp = result["configs"]["fsdp"]["payload_by_class"]
    fsdp_txt = "; ".join(
        f"{SHORT[k]} {v['param'] / (4 * phi):.2f}·4Φ parameter-shaped + "
        f"{v['other'] / (4 * phi):.2f}·4Φ activation-shaped"
        for k, v in sorted(fsdp.items())
    )
    dp_ar = result["configs"]["dp"]["collectives"]["payload"].get("all-reduce", 0)
    emb = 4 * m["vocab"] * m["d_model"]
    lines = [
        f"## jaxzero benchmark ({result['mode']}): {phi / 1e6:.2f}M-parameter decoder "
        f"(d={m['d_model']}, {m['layers']} scanned layers, vocab {m['vocab']}, seq {m['seq']}, "
        f"global batch {m['global_batch']}), Adam, {n} simulated {result['backend']} devices on "
        f"{result['machine']['cpu_count']} cores, jax {result['jax_version']}",
        "",
        md_table(head, rows),
        "",
        "Notes:",
        "* persistent = params + master + Adam state per device (`device_bytes`); formula: "
        "fp32 12Φ / 4Φ+8Φ/N / 4Φ+8Φ/N / 12Φ/N, bf16 14Φ / 2Φ+12Φ/N / 2Φ+12Φ/N / 14Φ/N "
        "(DP = stage 0, FSDP = stage 3). Δ is Adam's replicated int32 step counter.",
        "* collective payload per device per step from the compiled HLO, while-loop bodies "
        "multiplied by their trip count; all-reduce / all-gather = output bytes, reduce-scatter "
        "= output bytes × N. Scalar all-reduces (loss mean, finite check) are included.",
        "* **XLA:CPU widens bf16 collectives to f32**: the lowered HLO of the bf16 rows asks for "
        "bf16 all-reduce / reduce-scatter / all-gather, the compiled CPU HLO moves f32, so the bf16 "
        "rows show f32 bytes (2× a GPU's). `coll. ok` compares against the widened bytes.",
        f"* DP by hand: AR {dp_ar / (4 * phi):.3f}·4Φ = 4Φ + {(dp_ar - 4 * phi) / emb:.2f} × "
        "the tied embedding (4·vocab·d): GSPMD all-reduces the embedding's two gradient "
        "contributions (lookup and output head) separately, inside one combined all-reduce, "
        "before adding them; the layer gradients are all-reduced inside the backward loop.",
        f"* FSDP by annotation: GSPMD compiled it to {fsdp_txt} — no reduce-scatter at all: "
        "weight gradients are all-reduced in full, and for some matmuls GSPMD keeps the weight "
        "sharded and moves global-batch activations instead (all-gathers / all-to-alls of "
        "[batch, seq, d]-shaped tensors). This confirms the DESIGN finding (the partitioner on "
        "CPU does not turn all-reduce + slice into reduce-scatter) and adds that it also mixes "
        "in activation traffic; only explicit shard_map collectives (jaxzero) reach the "
        "theoretical 2 × 4Φ.",
        "* step times: 8 simulated devices sharing the host cores, other processes running "
        f"(1-min load average at the end: {result['machine']['load_avg_1m_at_end']:.1f}); "
        f"{result['rounds']} round-robin rounds × {result['steps_per_round']} step(s) per "
        "configuration, the starting configuration rotating each round"
        + (
            " (all states alive: one step of every configuration per round)"
            if result["states_kept_alive"]
            else " (each configuration re-initialised in its slot)"
        )
        + ". `vs DP` = median over rounds of (config / DP in the same round). Collectives are "
        "memory copies here and bf16 matmuls are emulated by XLA:CPU (slower than fp32): use the "
        "fp32 ratios, never the absolute times, and never as GPU predictions.",
        f"* first-step loss (same init, same batch): DP {losses['dp']:.6f}; jaxzero fp32 rows "
        f"max |Δ| {max(abs(losses[k] - losses['dp']) for k in losses if k.endswith('fp32')):.1e}, "
        f"bf16 rows max |Δ| {max(abs(losses[k] - losses['dp']) for k in losses if k.endswith('bf16')):.1e}, "
        f"FSDP |Δ| {abs(losses['fsdp'] - losses['dp']):.1e}.",
        "",
        f"EMA update on the model's {phi / 1e6:.2f}M-float parameter tree "
        f"({e['replicated']['reps']} interleaved reps):",
        "",
        md_table(["EMA", "median ms", "EMA bytes / device", "speed-up vs replicated"], ema_rows),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
