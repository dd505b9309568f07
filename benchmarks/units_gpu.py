"""On a real GPU: what ``units=`` with and without prefetch cost in step time against the
whole-model stage 3, on the GPUs attached to this process (one H100: no collective moves, so
the figure is the compute the designs add, e.g. recomputation).

    python benchmarks/units_gpu.py                  # needs a GPU (jax with its CUDA plugin)
    python benchmarks/units_gpu.py --out benchmarks/results/units_gpu.md

The model is :mod:`jaxzero.gpu.models`' GPT decoder as a Python loop of ``nn.remat`` blocks
(``block_0`` ...), 12 x 1024, vocabulary 15,872, bf16 (fp32 master), Adam, 8 x 512 tokens
per device per step. Each variant: 3 warm-up steps, then the median of 5 rounds of 10 steps
(state donated, ``block_until_ready`` at the end of a round); the ratio is against the
whole-model stage 3 measured in the same process.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import emit, time_train_step  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero.gpu.models import abstract_params, make_loss, model_shape  # noqa: E402

VARIANTS = (
    ("stage 3 (whole model)", {}),
    ("stage 3 units, prefetch=True", {"units": r"block_\d+", "prefetch": True}),
    ("stage 3 units, prefetch=False", {"units": r"block_\d+", "prefetch": False}),
)


def time_variant(shape, zero_kw, batch, rounds=5, steps=10) -> float:
    """Median milliseconds per step."""
    n = jax.device_count()
    zero = jz.ZeRO(optax.adam(1e-4), jz.data_parallel_mesh(n), stage=3, precision="bf16", **zero_kw)
    return time_train_step(make_loss(shape), zero, abstract_params(shape), batch, rounds, steps)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="sequences per device")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    shape = model_shape(
        layers=args.layers, hidden=args.hidden, vocab=15872, seq=512, arch="gpt", loop="python"
    )
    n = jax.device_count()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shape.vocab, (args.batch * n, shape.seq)).astype(np.int32)
    batch = {"x": jnp.asarray(tokens), "y": jnp.asarray(np.roll(tokens, -1, axis=1))}
    rows = []
    for label, kw in VARIANTS:
        ms = time_variant(shape, kw, batch)
        rows.append((label, ms))
        print(f"{label}: {ms:.2f} ms per step", file=sys.stderr, flush=True)
    base = rows[0][1]
    tokens_per_step = args.batch * n * shape.seq
    lines = [
        f"GPT {shape.layers} x {shape.hidden} (Python loop of nn.remat blocks, "
        f"{shape.num_params / 1e6:.0f}M params), {tokens_per_step} tokens per step on {n} x "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}: median of 5 rounds x 10 steps",
        "",
        "| variant | ms per step | tokens/s | vs whole model |",
        "|---|---|---|---|",
    ]
    for label, ms in rows:
        lines.append(
            f"| {label} | {ms:.2f} | {tokens_per_step / ms * 1e3:,.0f} | {base / ms:.2f}x |"
        )
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
