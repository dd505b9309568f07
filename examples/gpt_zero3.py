"""A small character-level GPT (scanned decoder blocks) trained with ZeRO stage 3 + a sharded EMA.

    python examples/gpt_zero3.py                   # stage 3, fp32, all devices
    python examples/gpt_zero3.py --bf16 --accum 2 --stage 2
    python examples/gpt_zero3.py --bf16 --offload optimizer,params   # ZeRO-Offload: host memory
    python examples/gpt_zero3.py --corpus some.txt
    python examples/gpt_zero3.py --smoke           # a handful of steps (CI)

The corpus ships with Python: the interpreter's ``LICENSE.txt`` (next to the ``os`` module), or,
where a distribution leaves it out, a few standard-library sources concatenated. The last 10%
of the text is held out for validation.

The model: token + learned position embeddings, ``--layers`` pre-norm decoder blocks under
``jaxzero.scan_layers`` (one set of stacked parameters with a leading layer axis, as
``flax.linen.scan`` builds; each leaf is then sharded 1/N on its largest dimension divisible
by N, never the layer axis), a final LayerNorm and an output head tied to the token
embedding. With stage 3 every device holds 1/N of the parameters, gradients, optimizer state
and EMA; ``ZeRO(layers=("blocks",))`` makes ``scan_layers`` gather one block at a time, the
next block's all-gather in flight while this one computes (its backward reduce-scatters that
block's gradient), so the step never holds the whole model.

Progress bar, per-epoch validation loss of the raw vs the EMA weights, per-epoch Orbax
checkpoints with ``--resume``, the summary table, ``runs/<name>/summary.json`` and
``runs/<name>/report.png`` all come from the harness in ``examples/digits.py``. At the end a
short sample is generated from the EMA weights.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402  (sets XLA_FLAGS before jax starts; the shared harness)
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxzero as jz  # noqa: E402

STDLIB_FALLBACK = ("textwrap.py", "string.py", "this.py", "bisect.py", "heapq.py", "fnmatch.py")


def load_corpus(path: str | None = None) -> tuple[str, str]:
    """(text, description): ``path``, else Python's LICENSE.txt, else some stdlib sources."""
    if path is not None:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(), path
    lib = os.path.dirname(os.__file__)
    lic = os.path.join(lib, "LICENSE.txt")
    if os.path.exists(lic):
        with open(lic, encoding="utf-8", errors="replace") as f:
            return f.read(), lic
    parts = []
    for name in STDLIB_FALLBACK:
        p = os.path.join(lib, name)
        if os.path.exists(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    if not parts:
        raise SystemExit(f"no corpus found under {lib}; pass --corpus FILE")
    return "\n".join(parts), f"{lib}/{{{','.join(STDLIB_FALLBACK)}}}"


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a 4x GELU MLP, both residual."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm(name="ln1")(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False, name="attn")(
            h, h, mask=mask
        )
        x = x + h
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(4 * self.d_model, name="fc")(h)
        h = nn.Dense(self.d_model, name="proj")(nn.gelu(h))
        return x + h, None


class GPT(nn.Module):
    vocab: int
    seq: int
    d_model: int = 64
    layers: int = 4
    heads: int = 4

    @nn.compact
    def __call__(self, idx):
        wte = nn.Embed(
            self.vocab, self.d_model, name="wte", embedding_init=nn.initializers.normal(0.02)
        )
        wpe = self.param("wpe", nn.initializers.normal(0.02), (self.seq, self.d_model))
        x = wte(idx) + wpe[: idx.shape[1]].astype(wte.embedding.dtype)
        # Stage 3 gathers one block at a time: params["blocks"] stacks every block on a
        # leading axis (as nn.scan would), and jz.scan_layers runs them, each rematerialised;
        # in a per-layer stage-3 step it all-gathers block i+1 while block i computes (forward
        # and backward) and reduce-scatters each block's gradient under the next one.
        block = Block(self.d_model, self.heads, parent=None)
        stack = jz.stacked_params(self, "blocks", block, self.layers, x, None)
        x = jz.scan_layers(lambda w, h: block.apply({"params": w}, h, None)[0], stack, x)
        x = nn.LayerNorm(name="ln_f")(x)
        return wte.attend(x)  # tied output head


def make_experiment(args) -> digits.Experiment:
    text, source = load_corpus(args.corpus)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.int32)
    n_val = max(len(data) // 10, 4 * (args.seq + 1))
    train, val = data[:-n_val], data[-n_val:]
    model = GPT(
        vocab=len(chars), seq=args.seq, d_model=args.d_model, layers=args.layers, heads=args.heads
    )
    init = jax.jit(model.init)  # one compilation instead of one per op of an eager init
    params = init(jax.random.PRNGKey(args.seed), jnp.zeros((1, args.seq), jnp.int32))["params"]

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    steps_per_epoch = 3 if args.smoke else args.steps_per_epoch
    total = steps_per_epoch * args.epochs
    sched = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, total // 10), decay_steps=total, end_value=args.lr * 0.05
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))

    def windows(arr, starts):
        idx = starts[:, None] + np.arange(args.seq + 1)[None]
        w = arr[idx]
        return {"x": w[:, :-1], "y": w[:, 1:]}

    def batches(epoch):
        rng = np.random.default_rng([args.seed, epoch])
        starts = rng.integers(0, len(train) - args.seq - 1, size=(steps_per_epoch, args.batch))
        for s in starts:
            yield windows(train, s)

    # Validation: non-overlapping windows covering the held-out text.
    vstarts = np.arange(0, len(val) - args.seq - 1, args.seq)[: (2 if args.smoke else 64)]
    vbatch = windows(val, vstarts)
    placed = {}

    @jax.jit
    def val_loss(p, b):
        return loss_fn(p, b)

    def evaluate(p):
        if "b" not in placed:
            sharding = jax.tree.leaves(p)[0].sharding
            rep = NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
            placed["b"] = jax.device_put(vbatch, rep)
        return float(val_loss(p, placed["b"]))

    def after(state, summary):
        """A short sample from the EMA weights (temperature 0.8, fixed seed)."""
        p = jz.gather(state.ema)
        fwd = jax.jit(lambda p, idx: model.apply({"params": p}, idx))
        prompt = text[:16]
        ctx = [stoi[c] for c in prompt]
        rng = np.random.default_rng(args.seed)
        n = 20 if args.smoke else 200
        for _ in range(n):
            window = ctx[-args.seq :]
            idx = np.zeros((1, args.seq), np.int32)
            idx[0, : len(window)] = window
            logits = np.asarray(fwd(p, idx)[0, len(window) - 1], np.float64) / 0.8
            prob = np.exp(logits - logits.max())
            ctx.append(int(rng.choice(len(chars), p=prob / prob.sum())))
        sample = "".join(chars[i] for i in ctx)
        summary["sample"] = sample
        print(f"\nsample from the EMA weights (prompt {prompt!r}):\n{sample}\n", flush=True)

    return digits.Experiment(
        name=f"char GPT ({args.layers} scanned layers, d_model {args.d_model})",
        params=params,
        loss_fn=loss_fn,
        tx=tx,
        batches=batches,
        steps_per_epoch=steps_per_epoch,
        evaluate=evaluate,
        metric="validation loss (nats/char)",
        higher_is_better=False,
        example_batch=windows(train, np.arange(args.batch) * 7),
        samples_per_step=args.batch * args.seq,
        unit="tokens",
        layers=("blocks",),
        config={
            "example": "gpt_zero3",
            "corpus": source,
            "chars": len(text),
            "vocab": len(chars),
            "seq": args.seq,
            "d_model": args.d_model,
            "layers": args.layers,
            "heads": args.heads,
            "steps_per_epoch": steps_per_epoch,
        },
        after=after,
    )


def main(argv=None) -> int:
    parser = digits.base_parser(
        __doc__.splitlines()[0],
        stage=3,
        epochs=6,
        batch=32,
        lr=1e-2,
        ema_decay=0.98,
        run_name="gpt",
    )
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--seq", type=int, default=64, help="context length (characters)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--corpus", default=None, help="a text file (default: Python's LICENSE)")
    args = digits.finish_args(parser.parse_args(argv))
    exp = make_experiment(args)
    digits.run_experiment(exp, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
