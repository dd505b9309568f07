"""Shared pieces of the benchmarks: a decoder-only transformer, the ZeRO formulas, and HLO
collective accounting that knows about while loops.

Import this module only after ``XLA_FLAGS`` is set (the scripts do that first).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxzero.memory import collective_ops
from jaxzero.memory.hlo_reader import parse_hlo

# --------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: GPT-2 style (LayerNorm, biases, GELU MLP, learned positions,
    tied head) or LLaMA style (``llama=True``: RMSNorm, no biases, SwiGLU MLP, no learned
    positions, untied head). Layers are stacked under ``nn.scan`` (one compiled layer body)."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    ffn: int
    max_seq: int
    llama: bool = False
    remat: bool = True
    scan: bool = True

    def num_params(self) -> int:
        d, f, v = self.d_model, self.ffn, self.vocab
        if self.llama:
            per_layer = 4 * d * d + 3 * d * f + 2 * d
            return self.layers * per_layer + 2 * v * d + d
        per_layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        return self.layers * per_layer + v * d + self.max_seq * d + 2 * d


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, _):
        c = self.cfg
        b, s, d = x.shape
        bias = not c.llama
        norm = (
            (lambda name: nn.RMSNorm(name=name))
            if c.llama
            else (lambda name: nn.LayerNorm(name=name))
        )
        h = norm("ln1")(x)
        qkv = nn.Dense(3 * d, use_bias=bias, name="qkv")(h).reshape(b, s, 3, c.heads, d // c.heads)
        h = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
        x = x + nn.Dense(d, use_bias=bias, name="out")(h.reshape(b, s, d))
        h = norm("ln2")(x)
        if c.llama:
            g = nn.Dense(c.ffn, use_bias=False, name="gate")(h)
            u = nn.Dense(c.ffn, use_bias=False, name="up")(h)
            h = nn.Dense(d, use_bias=False, name="down")(nn.silu(g) * u)
        else:
            h = nn.Dense(c.ffn, name="fc1")(h)
            h = nn.Dense(d, name="fc2")(nn.gelu(h))
        return x + h, None


class Decoder(nn.Module):
    """``gather_layer`` (optional): a function applied to each layer's ``{"params": ...}``
    slice inside the scanned (and rematerialised) layer body: ``jaxzero.gather_layer``."""

    cfg: ModelConfig
    gather_layer: Callable | None = None

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        emb = nn.Embed(
            c.vocab, c.d_model, name="embed", embedding_init=nn.initializers.normal(0.02)
        )
        x = emb(tokens)
        if not c.llama:
            pos = self.param("pos", nn.initializers.normal(0.02), (c.max_seq, c.d_model))
            x = x + pos[: tokens.shape[1]].astype(x.dtype)
        block = Block
        if self.gather_layer is not None:
            block = nn.map_variables(Block, "params", trans_in_fn=self.gather_layer)
        block = nn.remat(block, prevent_cse=not c.scan) if c.remat else block
        if c.scan:
            x, _ = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=c.layers,
            )(c, name="layers")(x, None)
        else:
            for i in range(c.layers):
                x, _ = block(c, name=f"layer{i}")(x, None)
        x = (nn.RMSNorm if c.llama else nn.LayerNorm)(name="final_norm")(x)
        if c.llama:
            return nn.Dense(c.vocab, use_bias=False, name="head")(x)
        return emb.attend(x)


def make_loss(cfg: ModelConfig):
    """The model and its loss. Each scanned layer's variables pass through
    ``jaxzero.gather_layer``: the identity, except in a stage-3 step whose ZeRO names the
    layer stack (``layers="layers"``), where it all-gathers that layer's shards."""
    import jaxzero as jz

    model = Decoder(cfg, gather_layer=jz.gather_layer)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return model, loss_fn


def abstract_params(cfg: ModelConfig, seq: int):
    model = Decoder(cfg)
    return jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, seq), jnp.int32))["params"]
    )


def init_params(cfg: ModelConfig, seq: int, seed: int = 0):
    model = Decoder(cfg)
    init = jax.jit(model.init)
    return init(jax.random.PRNGKey(seed), jnp.zeros((1, seq), jnp.int32))["params"]


def make_batch(cfg: ModelConfig, batch: int, seq: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, cfg.vocab, size=(batch, seq + 1), dtype=np.int32)
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
