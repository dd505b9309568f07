"""On one GPU: what offload costs in tokens/s, beside what the plan predicts for it.

    python benchmarks/offload_gpu.py                   # one GPU (jax with its CUDA plugin)
    python benchmarks/offload_gpu.py --out benchmarks/results/offload_gpu.md
    python benchmarks/offload_gpu.py --tiny            # a small GPT on one CPU device, seconds
    python benchmarks/offload_gpu.py --tiny --offloads optimizer optimizer,remainder \
        optimizer+bf16state optimizer,remainder+bf16state

Results on one H200: ``benchmarks/results/offload_gpu.md``; ``--tiny`` is the smoke run of
tests/test_benchmarks.py.

The model is :mod:`jaxzero.gpu.models`' GPT decoder, scanned and rematerialised layers, 24 x
2048, vocabulary 50,304 (1.31B parameters), bf16 compute with an fp32 master, Adam. Rows, at
``--accum`` 1 and 8 micro-batches of ``--batch`` x ``--seq`` tokens:

* a plain ``jax.jit`` optax step of the same model, no jaxzero (fp32 master cast to bf16 for
  the loss; micro-batches summed in a ``lax.scan``): the first row;
* jaxzero stage 3 (one device) with ``offload`` off, ``"optimizer"`` and
  ``("optimizer", "params")`` (with micro-batches the params offload sums the stacks'
  gradients in an fp32 host accumulator: decision 42); a configuration jaxzero refuses is
  printed as refused, with the error's first line;
* named in ``--offloads`` only, the opt-in byte savers of the optimizer offload:
  ``optimizer,remainder`` (``offload=("optimizer", "remainder")``: the exact fp32 master kept
  on the host as a 16-bit remainder beside the bf16 params, decision 47),
  ``optimizer+bf16state`` (``jz.with_state_dtype(tx, jnp.bfloat16)``: Adam's moments stored in
  bfloat16) and ``optimizer,remainder+bf16state`` (both);
* named in ``--offloads`` only, ``optimizer+deferred``
  (``ZeRO(offload="optimizer", offload_update="deferred")``: each layer's update inside the
  next forward's layer loop, decision 51), predicted from a step with an update pending, and
  ``optimizer+delayed`` (``offload_update="delayed"``, ZeRO-Offload's DPU, not exact: the
  same rows, the gradient taken before them), predicted from the first delayed step; both
  with their copies' window, the first micro-batch's forward
  (``jaxzero.gpu.offload_cost.update_window``);
* with ``--fraction F``, ``offload="optimizer"`` at ``offload_fraction=F``: pass the fraction
  that ``jaxzero plan --offload auto --gpu-memory SIZE`` picks for the same model, to time
  what ``auto`` would run on a GPU of SIZE (the plan compiles deviceless, off the GPU's time).

Each row's measured step (3 warm-up steps, then the median of ``--rounds`` rounds of
``--steps`` steps, state donated) stands beside the step time predicted by
``jaxzero.gpu.offload_cost`` from ``compile_report`` of the same step compiled for this device:
8 x params x tokens FLOP at half the GPU's bf16 peak, plus the host <-> device bytes no compute
kernel overlaps at ``--pcie-gbps`` (default the GPU kind's). Off a bundled GPU kind (``--tiny``
on CPU) the prediction uses the H100's figures and means nothing.
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
from common import emit, md_table, median_step_ms, normal_params, time_train_step  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import gpu  # noqa: E402
from jaxzero.gpu.models import abstract_params, make_loss, model_shape  # noqa: E402
from jaxzero.gpu.offload_cost import offload_cost, step_flops, update_window  # noqa: E402
from jaxzero.gpu.topology import gpu_kind_of  # noqa: E402

#: ``(offload, state dtype, offload_update, label)`` of each jaxzero row; the first three run
#: by default, the opt-in byte savers (the master as a remainder, bf16 Adam moments, both) and
#: the update inside the next forward (``offload_update="deferred"`` or ``"delayed"``) when
#: named
OFFLOADS = (
    (None, None, None, "off"),
    ("optimizer", None, None, "optimizer"),
    (("optimizer", "params"), None, None, "optimizer,params"),
    (("optimizer", "remainder"), None, None, "optimizer,remainder"),
    ("optimizer", jnp.bfloat16, None, "optimizer+bf16state"),
    (("optimizer", "remainder"), jnp.bfloat16, None, "optimizer,remainder+bf16state"),
    ("optimizer", None, "deferred", "optimizer+deferred"),
    ("optimizer", None, "delayed", "optimizer+delayed"),
)
DEFAULT_OFFLOADS = ("off", "optimizer", "optimizer,params")


def plain_step(loss_fn, accum: int):
    """A jitted optax Adam step over an fp32 master, the loss in bf16, ``accum`` micro-batches
    summed by a ``lax.scan``; ``(master, opt_state), batch -> (master, opt_state), loss``."""
    tx = optax.adam(1e-4)
    bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)
    grad = jax.value_and_grad(lambda m, b: loss_fn(bf16(m), b))

    def step(carry, batch):
        master, opt = carry
        micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

        def one(acc, b):
            loss, g = grad(master, b)
            return jax.tree.map(jnp.add, acc, g), loss

        zeros = jax.tree.map(jnp.zeros_like, master)
        g, losses = jax.lax.scan(one, zeros, micro)
        g = jax.tree.map(lambda x: x / accum, g)
        updates, opt = tx.update(g, opt, master)
        return (optax.apply_updates(master, updates), opt), losses.mean()

    return jax.jit(step, donate_argnums=0), tx


def time_plain(loss_fn, abstract, batch, accum, rounds, steps) -> float:
    """Median milliseconds per step of :func:`plain_step` (:func:`common.median_step_ms`)."""
    step, tx = plain_step(loss_fn, accum)
    master = normal_params(abstract)
    return median_step_ms(step, (master, tx.init(master)), batch, rounds, steps)


def _zero(mesh, offload, fraction=1.0, state_dtype=None, update=None):
    tx = optax.adam(1e-4)
    return jz.ZeRO(
        tx if state_dtype is None else jz.with_state_dtype(tx, state_dtype),
        mesh,
        stage=3,
        precision="bf16",
        layers="layers",
        offload=offload,
        offload_fraction=fraction,
        offload_update=update,
    )


def _planned(step, loss_fn, mesh, abstract, batch, accum, *options):
    """``(step, state)`` to read the prediction from: ``step`` itself on a GPU; off one
    (``--tiny`` on a CPU, whose compiles report no host memory) the same step compiled
    deviceless for one H100 (jax's CUDA plugin, no GPU needed). ``options``: :func:`_zero`'s
    after the mesh. The state: the abstract params, or with ``offload_update`` the steady
    state, a step with an update pending (what the first step returns; delayed, what the
    steps after the first return)."""
    if gpu_kind_of(mesh) is None:
        zero = _zero(gpu.compile_only_mesh("h100", 1), *options)
        step = jz.make_train_step(loss_fn, zero, accum_steps=accum)
    return step, gpu.steady_state(step, abstract, batch)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 2 x 64 GPT at accum 2, seconds on a CPU")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--offloads",
        nargs="+",
        choices=[label for *_, label in OFFLOADS],
        default=list(DEFAULT_OFFLOADS),
        help="the jaxzero rows to time, in this order (default: %(default)s); 'remainder' keeps the fp32 "
        "master as a 16-bit remainder beside the bf16 params, '+bf16state' stores Adam's "
        "moments in bfloat16 (jz.with_state_dtype), '+deferred' runs each layer's update inside "
        "the next forward (offload_update='deferred'), '+delayed' also takes that step's "
        "gradient before the update (offload_update='delayed', not exact)",
    )
    ap.add_argument(
        "--fraction",
        type=float,
        help="also a row of ZeRO(offload='optimizer', offload_fraction=F): the fraction that "
        "`jaxzero plan --offload auto --gpu-memory SIZE` picks for this model and GPU",
    )
    ap.add_argument("--pcie-gbps", type=float, help="GB/s (default: the GPU kind's)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    vocab = 50304
    if args.tiny:
        args.layers, args.hidden, args.seq, args.batch, vocab = 2, 64, 32, 2, 256
        args.rounds, args.steps, args.accum = 1, 1, [2]
    shape = model_shape(
        layers=args.layers,
        hidden=args.hidden,
        vocab=vocab,
        seq=args.seq,
        arch="gpt",
        attention="xla" if args.tiny else "auto",  # cuDNN's flash attention on a GPU only
    )
    device = jax.devices()[0]
    mesh = jz.data_parallel_mesh(1)
    kind = gpu_kind_of(mesh) or "h100"
    abstract, loss_fn = abstract_params(shape), make_loss(shape)
    rng = np.random.default_rng(0)
    rows = []
    for accum in args.accum:
        tokens = args.batch * accum * shape.seq
        ids = rng.integers(0, shape.vocab, (args.batch * accum, shape.seq)).astype(np.int32)
        batch = {"x": jnp.asarray(ids), "y": jnp.asarray(np.roll(ids, -1, axis=1))}
        compute = step_flops(shape.num_params, tokens) / (0.5 * gpu.gpu_spec(kind).bf16_flops)
        ms = time_plain(loss_fn, abstract, batch, accum, args.rounds, args.steps)
        rows.append(("plain jax.jit optax", accum, ms, tokens, compute * 1e3, "-"))
        print(f"plain, accum {accum}: {ms:.2f} ms", file=sys.stderr, flush=True)
        named = {label: (off, sdt, upd) for off, sdt, upd, label in OFFLOADS}
        # in the order given, so a time-boxed run measures the rows it names first
        fractions = [(named[lab][0], lab, 1.0, *named[lab][1:]) for lab in args.offloads]
        if args.fraction is not None:
            label = f"optimizer, fraction {args.fraction:g}"
            fractions.append(("optimizer", label, args.fraction, None, None))
        for off, label, fraction, sdt, update in fractions:
            zero = _zero(mesh, off, fraction, sdt, update)
            try:
                step = jz.make_train_step(loss_fn, zero, accum_steps=accum)
            except ValueError as e:
                why = str(e).splitlines()[0]
                rows.append((f"jaxzero, offload {label}", accum, None, tokens, None, why))
                continue
            predicted, moved = compute, "-"  # nothing crosses PCIe without offload
            if off:
                shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
                options = (off, fraction, sdt, update)
                planned, state = _planned(step, loss_fn, mesh, abstract, shapes, accum, *options)
                report = gpu.compile_report(planned, state, shapes, kind=kind)
                window = update_window(update, accum)
                cost = offload_cost(
                    report, shape.num_params, tokens, kind=kind, gbps=args.pcie_gbps, window=window
                )
                predicted, moved = cost.step_seconds, report.transfer_summary()
            ms = time_train_step(loss_fn, zero, abstract, batch, args.rounds, args.steps, accum)
            rows.append((f"jaxzero, offload {label}", accum, ms, tokens, predicted * 1e3, moved))
            print(
                f"{label}, accum {accum}: {ms:.2f} ms, predicted {predicted * 1e3:.4g} ms, {moved}",
                file=sys.stderr,
                flush=True,
            )
    base = {accum: ms for label, accum, ms, *_ in rows if label.startswith("plain")}
    table = md_table(
        ["step", "accum", "ms per step", "tokens/s", "vs plain", "predicted ms", "PCIe per step"],
        [
            (
                label,
                accum,
                "refused" if ms is None else f"{ms:.2f}",
                "-" if ms is None else f"{tokens / ms * 1e3:,.0f}",
                "-" if ms is None else f"{base[accum] / ms:.2f}x",
                "-" if pred is None else f"{pred:.3g}",
                moved,
            )
            for label, accum, ms, tokens, pred, moved in rows
        ],
    )
    head = (
        f"GPT {shape.layers} x {shape.hidden}, vocab {shape.vocab} "
        f"({shape.num_params / 1e9:.2f}B params), {args.batch} x {shape.seq} tokens per "
        f"micro-batch, one {device.device_kind}, jax {jax.__version__}; median of "
        f"{args.rounds} rounds x {args.steps} steps; predicted: 8 x params x tokens at half "
        f"the {kind.upper()}'s bf16 peak + exposed PCIe bytes at "
        f"{args.pcie_gbps or gpu.gpu_spec(kind).pcie_bytes_per_s / 1e9:g} GB/s"
    )
    emit(head + "\n\n" + table, args.out)


if __name__ == "__main__":
    main()
