"""ZeRO++'s quantized collectives (``ZeRO(quantize=...)``): what they cost in convergence on
two real tasks, and what they save in bytes on the deviceless H100 compile.

    python benchmarks/quantize.py                  # the tables of docs/benchmarks.md
    python benchmarks/quantize.py --quick          # fewer steps, no compile (a smoke run)
    python benchmarks/quantize.py --out benchmarks/results/quantize.md

Convergence, on 8 simulated CPU devices, stage 3, Adam, the same data order and init for
every row: exact collectives; qwZ (int8 weight gathers); qwZ + qgZ int8; qwZ + qgZ int4
(:class:`jaxzero.Wire`). Two tasks:

* digits: examples/digits.py's CNN (151K params) on scikit-learn's bundled 8x8 digits (1,437
  train / 360 test images), whole-model stage 3;
* char LM: a 2-layer decoder (:class:`jaxzero.gpu.models.Decoder`, d_model 64, per-layer stage 3
  with ``layers="layers"``) predicting the next character of the docstrings of a few standard
  library modules (text that ships with Python), 90% train / 10% held out.

Per row: the held-out loss and accuracy at the end, its gap to the exact row, the training
loss of the last 10 steps, and the bytes of
one all-gather of every parameter plus one reduction of every gradient per device
(:meth:`jaxzero.ZeRO.quantized_leaves`, the payload convention of :mod:`jaxzero.gpu`). The
last row is the exact wire on another data order: the gap two exact runs show.

Bytes: the stage-3 bf16 step of a LLaMA-shaped decoder compiled for 8 H100s without a GPU,
read from the scheduled HLO per collective kind and dtype (int8 all-gathers and all-to-alls
against the bf16 all-gathers and reduce-scatters), and LLaMA-7B at N = 64 from the formula
(the per-layer step gathers every layer twice and reduces once: 3 passes). Last, stage 3 per
layer on each wire beside benchmarks/overlap.py's GSPMD-annotation FSDP peer (its ``--quick``
GPT, both flag sets): bytes, the hidden share (all-to-alls included), arguments + temporaries,
kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import jaxzero as jz  # noqa: E402

jz.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import emit, md_table  # noqa: E402

from jaxzero.gpu.models import Decoder, init_params, model_shape  # noqa: E402

N = 8
WIRES = {
    "exact": None,
    "qwZ int8": jz.Wire.create(weights=8),
    "qwZ + qgZ int8": jz.Wire.create(weights=8, grads=8),
    "qwZ + qgZ int4": jz.Wire.create(weights=8, grads=4),
}


def _digits_module():
    path = os.path.join(HERE, "..", "examples", "digits.py")
    spec = importlib.util.spec_from_file_location("digits_example", path)
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def digits_task(steps: int, batch: int = 128, seed: int = 0):
    """(params, loss_fn, metrics_fn, batches, zero kwargs) of the digits CNN."""
    mod = _digits_module()
    (x, y), (xt, yt) = mod.load_data(0)
    model = mod.CNN()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def metrics(p):
        logits = model.apply({"params": p}, xt)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yt).mean()
        return float(loss), float(jnp.mean(jnp.argmax(logits, -1) == yt))

    order = np.random.default_rng(seed).integers(0, len(x), (steps, batch))
    batches = [{"x": x[i], "y": y[i]} for i in order]
    return params, loss_fn, metrics, batches, {}


def stdlib_text() -> str:
    """The docstrings of a few standard library modules and their public members."""
    import argparse as a
    import collections
    import difflib
    import json
    import textwrap

    docs = []
    for module in (a, collections, difflib, json, textwrap):
        docs.append(inspect.getdoc(module) or "")
        for name, obj in sorted(vars(module).items()):
            if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__:
                docs.append(inspect.getdoc(obj) or "")
    return "\n\n".join(d for d in docs if d)


def char_lm_task(steps: int, batch: int = 32, seq: int = 64, seed: int = 0):
    """(params, loss_fn, metrics_fn, batches, zero kwargs) of the character-level LM."""
    text = stdlib_text()
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], np.int32)
    cut = int(len(ids) * 0.9)
    train, held = ids[:cut], ids[cut:]
    shape = model_shape(
        arch="gpt",
        layers=2,
        hidden=64,
        heads=4,
        vocab=len(chars),
        seq=seq,
        ffn=256,
        attention="xla",
        loop="gather_layer",
    )
    model = Decoder(shape)
    params = init_params(shape)

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def windows(data, starts):
        return {
            "x": data[starts[:, None] + np.arange(seq)],
            "y": data[starts[:, None] + np.arange(1, seq + 1)],
        }

    test = windows(held, np.arange(0, len(held) - seq - 1, seq))

    def metrics(p):
        logits = model.apply({"params": p}, test["x"]).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, test["y"]).mean()
        return float(loss), float(jnp.mean(jnp.argmax(logits, -1) == test["y"]))

    rng = np.random.default_rng(seed)
    batches = [windows(train, rng.integers(0, cut - seq - 1, batch)) for _ in range(steps)]
    return params, loss_fn, metrics, batches, {"layers": "layers"}


@dataclasses.dataclass(frozen=True)
class Converged:
    """A finished run: held-out loss and accuracy, the mean training loss of the last 10
    steps, and the bytes of one gather + one reduction of every leaf per device."""

    loss: float
    accuracy: float
    train_loss: float
    bytes: int


def converge(task, wire, lr: float = 3e-3) -> Converged:
    """Train ``task`` at stage 3 with ``wire`` (``ZeRO(quantize=...)``) to the end."""
    params, loss_fn, metrics, batches, kw = task
    zero = jz.ZeRO(optax.adam(lr), jz.data_parallel_mesh(N), stage=3, quantize=wire, **kw)
    step = jz.make_train_step(loss_fn, zero)
    start, state, losses = time.perf_counter(), step.init(params), []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    loss, acc = metrics(jz.gather(state.params))
    took = time.perf_counter() - start
    print(f"  {zero.quantize}: loss {loss:.4f} ({took:.0f} s)", file=sys.stderr)
    report = zero.quantized_leaves(params)
    train = float(np.mean([float(x) for x in losses[-10:]]))
    return Converged(loss, acc, train, report.gather_bytes + report.reduce_bytes)


def convergence_table(name: str, make_task) -> str:
    """One row per wire on ``make_task(seed=0)``, and the exact wire on another data order
    (``seed=1``): how far two exact runs land apart."""
    rows, base, task = [], None, make_task(seed=0)
    runs = [(label, wire, task) for label, wire in WIRES.items()]
    runs.append(("exact, another data order", None, make_task(seed=1)))
    for label, wire, task in runs:
        r = converge(task, wire)
        base = base or r
        gap = lambda a, b: f"{(a / b - 1) * 100:+.2f}%"
        rows.append(
            [
                label,
                f"{r.loss:.4f} ({gap(r.loss, base.loss)})",
                f"{r.accuracy * 100:.1f}%",
                f"{r.train_loss:.4f} ({gap(r.train_loss, base.train_loss)})",
                f"{r.bytes:,}",
                f"{r.bytes / base.bytes:.3f}",
            ]
        )
    header = ["wire", "held-out loss (gap)", "accuracy", "train loss, last 10 (gap)"]
    header += ["bytes / step", "ratio"]
    return f"### {name}\n\n" + md_table(header, rows)


def gpu_bytes_table() -> str:
    """The compiled stage-3 bf16 step's collectives per wire (8 H100s, deviceless)."""
    from jaxzero import gpu
    from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape

    shape = model_shape(layers=4, hidden=512, heads=4, vocab=4096, seq=256, batch=1)
    rows, exact = [], None
    for label, wire in WIRES.items():
        zero = jz.ZeRO(
            optax.adam(1e-3),
            gpu.compile_only_mesh("h100", N),
            stage=3,
            precision="bf16",
            quantize=wire,
        )
        step = jz.make_train_step(make_loss(shape), zero)
        rep = gpu.compile_report(step, abstract_params(shape), batch_shapes(shape, N))
        ag, rs, a2a = (rep.payload(k) for k in ("all-gather", "reduce-scatter", "all-to-all"))
        exact = exact or (ag, rs)
        dtypes = lambda k, rep=rep: "+".join(sorted(rep.dtypes(k))) or "-"
        rows.append(
            [
                label,
                f"{ag:,} ({dtypes('all-gather')})",
                f"{ag / exact[0]:.3f}",
                f"{rs + a2a:,} ({dtypes('reduce-scatter') if rs else dtypes('all-to-all') + ' all-to-all'})",
                f"{(rs + a2a) / exact[1]:.3f}",
            ]
        )
    head = ["wire", "all-gather bytes", "ratio", "gradient reduction bytes", "ratio"]
    title = (
        f"### Compiled bytes: LLaMA-shaped {shape.layers} x {shape.hidden} "
        f"({shape.num_params / 1e6:.1f}M params), stage 3 bf16, 8 H100s (deviceless)"
    )
    return title + "\n\n" + md_table(head, rows)


def _jaxzero_row(shape, mesh, wire, options) -> dict:
    """Stage 3 per layer on ``wire``: bytes, the hidden share of the all-gather,
    reduce-scatter and all-to-all bytes, arguments + temporaries, kernels."""
    from jaxzero import gpu
    from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss

    zero = jz.ZeRO(
        optax.adam(1e-4), mesh, stage=3, precision="bf16", layers="layers", quantize=wire
    )
    step = jz.make_train_step(make_loss(shape), zero)
    rep = gpu.compile_report(
        step, abstract_params(shape), batch_shapes(shape, N), compiler_options=options
    )
    kinds = ("all-gather", "reduce-scatter", "all-to-all")
    return {
        "bytes": sum(c.bytes for c in rep.collectives),
        "hidden": rep.hidden_share(*kinds),
        "args_temp": rep.argument_bytes + rep.temp_bytes,
        "kernels": rep.kernels_per_step,
    }


def peer_table() -> str:
    """Stage 3 per layer on each wire beside the GSPMD-annotation FSDP peer of
    benchmarks/overlap.py (its ``--quick`` GPT, 4 layers x 256, N = 8, both flag sets)."""
    from overlap import peer_row

    from jaxzero import gpu
    from jaxzero.gpu.models import model_shape

    shape = model_shape(layers=4, hidden=256, heads=2, vocab=1024, seq=256, arch="gpt")
    mesh = gpu.compile_only_mesh("h100", N)
    rows = []
    for label, wire in [*WIRES.items(), ("GSPMD-annotation FSDP (peer)", "peer")]:
        for flags in ("default", "recommended"):
            options = gpu.xla_options() if flags == "recommended" else None
            if wire == "peer":
                f = peer_row(shape, mesh, True, options)
                f = {**f, "hidden": f["ag_rs_hidden"]}
            else:
                f = _jaxzero_row(shape, mesh, wire, options)
            rows.append(
                [
                    label,
                    flags,
                    f"{f['bytes'] / 1e6:.1f} MB",
                    f"{f['hidden']:.2f}",
                    f"{f['args_temp'] / 1e6:.1f} MB",
                    str(f["kernels"]),
                ]
            )
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    head = ["stage 3 per layer", "XLA flags", "collective bytes", "hidden"]
    head += ["args+temp", "kernels"]
    title = (
        f"### Beside the peer: GPT {shape.layers} x {shape.hidden} "
        f"({shape.num_params / 1e6:.1f}M params), bf16, 8 H100s (deviceless)\n\n"
        "Hidden: the share of all-gather, reduce-scatter and all-to-all bytes with a gemm "
        "scheduled between the collective's start and done (:mod:`jaxzero.gpu.overlap`)."
    )
    return title + "\n\n" + md_table(head, rows)


def llama7b_table() -> str:
    """LLaMA-7B at N = 64 from the formula: per-layer stage 3 gathers twice, reduces once."""
    from jaxzero import gpu
    from jaxzero.gpu.models import abstract_params, model_shape

    shape = model_shape(layers=32, hidden=4096, heads=32, vocab=32000, seq=2048, batch=1)
    params = abstract_params(shape)
    mesh = gpu.compile_only_mesh("h100", 64)
    rows, base = [], None
    for label, wire in WIRES.items():
        r = jz.ZeRO(
            optax.adam(1e-3), mesh, stage=3, precision="bf16", quantize=wire
        ).quantized_leaves(params)
        total = 2 * r.gather_bytes + r.reduce_bytes
        base = base or total
        rows.append(
            [
                label,
                f"{2 * r.gather_bytes / 1e9:.2f}",
                f"{r.reduce_bytes / 1e9:.2f}",
                f"{total / base:.3f}",
            ]
        )
    head = ["wire", "all-gathers (2 passes) GB", "reduction GB", "ratio to exact"]
    return "### LLaMA-7B, N = 64, per device per step (formula)\n\n" + md_table(head, rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, no GPU compile")
    p.add_argument("--out", help="also write the markdown here")
    args = p.parse_args(argv)
    steps = (20, 30) if args.quick else (150, 200)
    parts = [
        "## Quantized collectives (ZeRO++ qwZ / qgZ)",
        f"8 simulated CPU devices, stage 3, fp32 params (the exact wire moves fp32), "
        f"Adam(3e-3); {steps[0]} steps of 128 images, {steps[1]} steps of 32 x 64 characters; "
        f"jax {jax.__version__}.",
        convergence_table(
            "digits CNN (151K params), whole-model stage 3",
            functools.partial(digits_task, steps[0]),
        ),
        convergence_table(
            "char LM on stdlib docstrings, per-layer stage 3",
            functools.partial(char_lm_task, steps[1]),
        ),
        llama7b_table(),
    ]
    if not args.quick:
        parts += [gpu_bytes_table(), peer_table()]
    emit("\n\n".join(parts), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
