"""Activation offload (``ZeRO(offload=("activations", ...))``): what moves off the device.

    python benchmarks/activation_offload.py --out benchmarks/results/activation_offload.md
    python benchmarks/activation_offload.py --real --out benchmarks/results/activation_offload_gpu.md

Default: deviceless XLA:GPU compiles for 8 x H100 (no GPU needed) of :mod:`jaxzero.gpu.models`'
scanned decoders, per-layer stage 3 (``layers=``, :func:`jaxzero.scan_layers`), bf16 in FSDP's
layout (``compute_copy=False``), Adam: the device peak (arguments + temporaries), the host
bytes, the hidden share of the all-gather + reduce-scatter bytes, with and without activation
offload, beside the formula for what moves: (L - 1) saved layer inputs of batch x seq x hidden
x 2 bytes.

``--real``: on the GPUs attached to this process (a ``data`` mesh over all of them), a smaller
decoder timed with and without activation offload: 3 warm-up steps, then the median of 5
rounds of 10 steps (state donated); the ratio is against the run without offload in the same
process.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import optax  # noqa: E402
from common import emit, md_table, time_train_step  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape  # noqa: E402

MODELS = (  # (label, model_shape keyword arguments)
    ("GPT 12 x 1024, 4 x 2048 tokens", dict(layers=12, hidden=1024, seq=2048, batch=4, arch="gpt")),
    ("LLaMA-7B, 2 x 4096 tokens", dict(params=7e9, layers=32, hidden=4096, seq=4096, batch=2)),
)
KINDS = ("all-gather", "reduce-scatter")


def _zero(mesh, offload):
    fsdp = jz.Precision.create("bf16", compute_copy=False)
    return jz.ZeRO(
        optax.adam(1e-4), mesh, stage=3, precision=fsdp, layers="layers", offload=offload
    )


def deviceless(out):
    from jaxzero import gpu

    mesh = gpu.compile_only_mesh("h100", 8)
    rows = []
    for label, kw in MODELS:
        shape = model_shape(**kw)
        one = shape.batch * shape.seq * shape.hidden * 2
        reps = []
        for off in (None, "activations"):
            step = jz.make_train_step(make_loss(shape), _zero(mesh, off))
            params, batch = abstract_params(shape), batch_shapes(shape, 8 * shape.batch)
            reps.append(gpu.compile_report(step, params, batch))
            print(f"compiled {label}, offload={off!r}", file=sys.stderr, flush=True)
        dev, host = reps
        mb = lambda b: f"{b / 1e6:,.1f} MB"
        rows.append(
            [
                label,
                mb(dev.argument_bytes + dev.temp_bytes),
                mb(host.argument_bytes + host.temp_bytes),
                mb(dev.argument_bytes + dev.temp_bytes - host.argument_bytes - host.temp_bytes),
                mb(host.host_bytes or 0),
                mb((shape.layers - 1) * one),
                f"{dev.hidden_share(*KINDS):.2f} / {host.hidden_share(*KINDS):.2f}",
            ]
        )
    header = [
        "model (N = 8)",
        "device peak",
        "with activation offload",
        "drop",
        "host",
        "(L - 1) inputs",
        "hidden AG+RS without / with",
    ]
    text = [
        "# Activation offload on the H100 compile",
        "",
        "Command: `python benchmarks/activation_offload.py --out "
        "benchmarks/results/activation_offload.md`",
        "",
        f"Deviceless XLA:GPU compiles for 8 x H100; jax {jax.__version__}. Per-layer stage 3 "
        "(`layers=`, `jz.scan_layers`), bf16 in FSDP's layout, Adam, XLA's default flags. "
        "Peak = arguments + temporaries per device.",
        "",
        md_table(header, rows),
    ]
    emit("\n".join(text), out)


def _time(shape, offload, batch) -> float:
    zero = _zero(jz.data_parallel_mesh(jax.device_count()), offload)
    return time_train_step(make_loss(shape), zero, abstract_params(shape), batch)


def real(out):
    shape = model_shape(layers=16, hidden=2048, seq=2048, batch=8, vocab=32000, arch="gpt")
    n = jax.device_count()
    tokens = jax.random.randint(jax.random.key(1), (n * shape.batch, shape.seq), 0, shape.vocab)
    batch = {"x": tokens, "y": tokens}
    variants = (None, "activations", "optimizer", ("optimizer", "activations"))
    times = []
    for off in variants:
        times.append(_time(shape, off, batch))
        print(f"timed offload={off!r}: {times[-1]:.2f} ms", file=sys.stderr, flush=True)
    rows = [
        [repr(v), f"{t:.2f}", f"{t / times[0]:.2f}"] for v, t in zip(variants, times, strict=True)
    ]
    text = [
        "# Offload on a real GPU",
        "",
        "Command: `python benchmarks/activation_offload.py --real --out "
        "benchmarks/results/activation_offload_gpu.md`",
        "",
        f"{n} x {jax.devices()[0].device_kind}; jax {jax.__version__}. GPT 16 x 2048 "
        f"({shape.num_params / 1e6:.0f}M params), {shape.batch} x {shape.seq} tokens per device, "
        "per-layer stage 3, bf16 (FSDP's layout), Adam; median of 5 rounds of 10 steps; ratio "
        "against no offload in the same process.",
        "",
        md_table(["ZeRO(offload=...)", "ms per step", "ratio"], rows),
    ]
    emit("\n".join(text), out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--real", action="store_true", help="time on the attached GPUs")
    p.add_argument("--out", help="also write the markdown here")
    args = p.parse_args()
    (real if args.real else deviceless)(args.out)


if __name__ == "__main__":
    if "--real" not in sys.argv:
        jz.simulate_cpu_devices(8)
    main()
