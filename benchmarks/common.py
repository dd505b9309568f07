"""Shared pieces of the benchmarks: token batches, the ZeRO formulas, HLO collective
accounting that knows about while loops, timing and markdown, and the demo's digits CNN. The
models are :mod:`jaxzero.gpu.models`'.

Import this module only after ``XLA_FLAGS`` is set (the scripts do that first).
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.gpu.models import ModelShape
from jaxzero.memory import collective_ops
from jaxzero.memory.hlo_reader import parse_hlo

# --------------------------------------------------------------------------- data


def make_batch(shape: ModelShape, batch: int, seed: int = 0):
    """``batch`` random token sequences of ``shape.seq`` as next-token ``{"x", "y"}``."""
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, shape.vocab, size=(batch, shape.seq + 1), dtype=np.int32)
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def count(tree) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


# --------------------------------------------------------------------------- ZeRO formulas


def persistent_formula(phi: int, n: int, stage: int, precision: str) -> int:
    """Persistent bytes per device (params + master + Adam state), ZeRO accounting.

    fp32 (no separate master): 12Φ / 4Φ+8Φ/N / 4Φ+8Φ/N / 12Φ/N.
    bf16 (bf16 params + fp32 master + Adam): 14Φ / 2Φ+12Φ/N / 2Φ+12Φ/N / 14Φ/N.
    """
    p, k = (4, 8) if precision == "fp32" else (2, 12)
    if stage == 0:
        return (p + k) * phi
    if stage in (1, 2):
        return p * phi + k * phi // n
    return (p + k) * phi // n


def collective_theory(phi: int, stage: int | str, precision: str = "fp32") -> dict[str, int]:
    """Theoretical payload bytes per device and step, by kind (all-reduce and all-gather:
    output bytes; reduce-scatter: input bytes). ``stage``: 0-3, "dp" or "fsdp" (ideal FSDP =
    ZeRO-3). Gradients are communicated in the reduce dtype and parameters gathered in the
    compute dtype: 4 bytes/param for fp32, 2 for bf16."""
    b = 4 if precision == "fp32" else 2
    stage = {"dp": 0, "fsdp": 3}.get(stage, stage)
    return {
        0: {"all-reduce": b * phi},
        1: {"all-reduce": b * phi, "all-gather": b * phi},
        2: {"reduce-scatter": b * phi, "all-gather": b * phi},
        3: {"all-gather": b * phi, "reduce-scatter": b * phi},
    }[stage]


# --------------------------------------------------------------------------- HLO accounting

_CALLED = ("body", "condition", "to_apply", "calls", "branch_computations", "called_computations")


def computation_multipliers(hlo: str) -> dict[str, int]:
    """How many times each computation runs per execution of the module: 1 for ENTRY, the
    known trip count for while bodies (multiplied through nesting). Computations reached only
    through non-loop calls inherit their caller's multiplier; a while with no known trip count
    counts once (flagged by a negative multiplier)."""
    module = parse_hlo(hlo)
    comps, entry = module.computations, module.entry
    mult = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for inst in comps.get(name, []):
            body = inst.called("body")[:1] if inst.opcode == "while" else []
            trip = (inst.trip_count if inst.trip_count is not None else -1) if body else None
            for callee in inst.called(*_CALLED):
                if callee not in comps:
                    continue
                k = abs(mult[name])
                if body and callee == body[0]:
                    k = k * abs(trip) * (1 if trip > 0 else -1)
                if callee not in mult or abs(k) > abs(mult[callee]):
                    mult[callee] = k
                    stack.append(callee)
    return mult


def collectives(hlo: str, n: int) -> dict:
    """Per-kind collective accounting of compiled HLO with loop trip counts applied.

    Payload per device per step: all-reduce / all-gather / all-to-all / collective-permute
    output bytes; reduce-scatter output bytes x its group size (= its input bytes). Returns
    ``{"payload": {kind: bytes}, "count": {kind: static ops}, "in_loop": {kind: static ops
    inside a while body}, "dtypes": {kind: [dtypes]}, "unknown_trip": bool}``."""
    mult = computation_multipliers(hlo)
    out = {"payload": {}, "count": {}, "in_loop": {}, "dtypes": {}, "unknown_trip": False}
    for op in collective_ops(hlo):
        m = mult.get(op.computation, 1)
        if m < 0:
            out["unknown_trip"] = True
        k = op.kind
        size = op.bytes * (n if k == "reduce-scatter" else 1) * abs(m)
        out["payload"][k] = out["payload"].get(k, 0) + size
        out["count"][k] = out["count"].get(k, 0) + 1
        out["in_loop"][k] = out["in_loop"].get(k, 0) + (abs(m) > 1)
        dts = out["dtypes"].setdefault(k, [])
        for dt in op.dtypes:
            if dt not in dts:
                dts.append(dt)
    return out


def memory_stats(compiled) -> dict:
    stats = compiled.memory_analysis()
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    return {
        f"{k}_bytes": int(getattr(stats, f"{k}_size_in_bytes", 0) or 0)
        for k in ("argument", "output", "alias", "temp")
    }


# --------------------------------------------------------------------------- misc


def timed(fn) -> float:
    """Seconds of ``jax.block_until_ready(fn())``."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def emit(text: str, out: str | None) -> None:
    """Print a benchmark's markdown, and write it to ``out`` too when given (``--out``)."""
    print(text)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")


def md_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def normal_params(abstract):
    """Params drawn N(0, 0.02) in the shapes and dtypes of ``abstract``."""
    key = jax.random.key(0)
    return jax.tree.map(lambda s: 0.02 * jax.random.normal(key, s.shape, s.dtype), abstract)


def median_step_ms(step, carry, batch, rounds: int, steps: int) -> float:
    """Median milliseconds per call of ``carry, _ = step(carry, batch)``: 3 warm-up calls, then
    ``rounds`` rounds of ``steps`` calls (``block_until_ready`` at the end of a round)."""
    for _ in range(3):
        carry, _ = step(carry, batch)
    jax.block_until_ready(carry)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            carry, _ = step(carry, batch)
        jax.block_until_ready(carry)
        times.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(times)


def time_train_step(
    loss_fn, zero, abstract, batch, rounds: int = 5, steps: int = 10, accum_steps: int = 1
) -> float:
    """Median milliseconds per step of ``jz.make_train_step(loss_fn, zero, accum_steps=)`` on
    real devices (:func:`median_step_ms`), from :func:`normal_params` (state donated)."""
    import jaxzero as jz

    step = jz.make_train_step(loss_fn, zero, accum_steps=accum_steps)
    return median_step_ms(step, step.init(normal_params(abstract)), batch, rounds, steps)


# --------------------------------------------------------------------------- EMA cases


def replicated_ema_update(decay: float):
    """The baseline: a donated, jitted ``tree.map`` EMA over replicated arrays."""
    return jax.jit(
        lambda e, p: jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, e, p),
        donate_argnums=0,
    )


def sharded_ema_case(mesh, params, ema, stage: int):
    """``(update, args)`` for jaxzero's ``ZeRO.update_ema`` at ``stage`` (SGD state, the EMA
    started from ``params``): ``update(*args)`` returns the next EMA state (donated)."""
    import jaxzero as jz

    zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=stage)
    state = zero.init(params, ema=ema)
    master = jax.jit(zero.master_view)(state)
    update = jax.jit(
        lambda e, m, t: zero.update_ema(ema, e, m, step=t, apply=True), donate_argnums=0
    )
    return update, [state.ema, master, jnp.asarray(1, jnp.int32)]


def digits_cnn():
    """The demo's CNN (``examples/digits.py``) on its digits data, computing in bf16:
    ``(train data, test data, params, loss_fn, predict)``, with ``loss_fn(params, batch)``
    the mean cross-entropy and ``predict(params, x)`` the logits."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "digits.py")
    spec = importlib.util.spec_from_file_location("digits_example", path)
    digits = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = digits  # its dataclasses look their module up
    spec.loader.exec_module(digits)
    train, test = digits.load_data(0)
    model = digits.CNN()
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"].astype(jnp.bfloat16)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    predict = jax.jit(lambda p, x: model.apply({"params": p}, x.astype(jnp.bfloat16)))
    return train, test, params, loss_fn, predict
