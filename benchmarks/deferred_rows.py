"""Where the offloaded update's PCIe bytes go with ``offload_update="deferred"``, compiled
deviceless for 8 x H100 (no GPU needed): the exact step (the update after the backward), the
deferred path's first step (nothing pending yet) and a step with an update pending, whose
layer rows run inside the forward's layer loop at stage 3 (decision 51), for decoders of
``--layers`` layers each.

    python benchmarks/deferred_rows.py [--out benchmarks/results/deferred_rows.md]

Each row: the host->device and device->host bytes per GPU per step read from the compiled HLO
(``jaxzero.gpu.transfers``) and the share a compute kernel overlaps. The pending step is
compiled from the abstract state the first step returns (``jax.eval_shape``). Exactly, layer
0's rows (both ways) and layer 1's fetch run before any layer's compute, and the leaves
outside the stack after the backward: the hidden share grows with the layer count.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import optax

import jaxzero as jz
from jaxzero import gpu
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="sequences per GPU")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument(
        "--async-limit",
        type=int,
        help="also the pending step under this XLA:GPU async compute limit (default: none)",
    )
    ap.add_argument("--out", help="also write the table to this .md file")
    args = ap.parse_args(argv)
    mesh = gpu.compile_only_mesh("h100", args.devices)
    rows = []
    for layers in args.layers:
        shape = model_shape(
            layers=layers,
            hidden=args.hidden,
            heads=max(1, args.hidden // 128),
            vocab=1024,
            seq=args.seq,
            batch=args.batch,
        )
        params, batch = abstract_params(shape), batch_shapes(shape, args.devices)

        def step(shape=shape, **kw):
            zero = jz.ZeRO(
                optax.adam(1e-3),
                mesh,
                stage=3,
                precision="bf16",
                layers="layers",
                offload="optimizer",
                **kw,
            )
            return zero, jz.make_train_step(make_loss(shape), zero)

        n = f"{layers} layers ({shape.num_params / 1e6:.1f}M params)"
        _, exact = step()
        rows.append((n, "exact (the update after the backward)", exact, params, batch, None))
        _, deferred = step(offload_update="deferred")
        rows.append((n, "deferred, first step (nothing pending)", deferred, params, batch, None))
        pending = gpu.steady_state(deferred, params, batch)
        rows.append(
            (n, "deferred, an update pending (rows in the forward)", deferred, pending, batch, None)
        )
        if args.async_limit:
            # XLA:GPU counts host copies against this limit (default 2)
            limit = {"xla_gpu_experimental_parallel_async_compute_limit": args.async_limit}
            label = f"the same, `--xla_gpu_experimental_parallel_async_compute_limit={args.async_limit}`"
            rows.append((n, label, deferred, pending, batch, limit))
    rows = [
        (n, label, gpu.compile_report(s, state, b, compiler_options=opts))
        for n, label, s, state, b, opts in rows
    ]

    lines = [
        "`" + " ".join(["python benchmarks/deferred_rows.py", *(argv or sys.argv[1:])]) + "`",
        "",
        f"Decoders of width {args.hidden}, sequence {args.seq}, {args.batch} per GPU, "
        f"{args.devices} x H100 deviceless, stage 3 per layer, bf16, Adam, "
        f'`offload="optimizer"`; jax {jax.__version__}; {datetime.date.today()}.',
        "",
        "| model | step | PCIe per GPU per step | peak per GPU |",
        "|---|---|---|---|",
    ]
    for n, name, rep in rows:
        lines.append(
            f"| {n} | {name} | {rep.transfer_summary()} | {jz.memory.format_bytes(rep.peak_bytes)} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
