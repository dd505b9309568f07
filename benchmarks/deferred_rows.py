"""Where the offloaded update's PCIe bytes go with ``offload_update="deferred"``, compiled
deviceless for 8 x H100 (no GPU needed): the exact step (the update after the backward), the
deferred path's first step (nothing pending yet) and a step with an update pending, whose
layer rows run inside the forward's layer loop at stage 3 (decision 51).

    python benchmarks/deferred_rows.py [--out benchmarks/results/deferred_rows.md]

Each row: the host->device and device->host bytes per GPU per step read from the compiled HLO
(``jaxzero.gpu.transfers``) and the share a compute kernel overlaps. The pending step is
compiled from the abstract state the first step returns (``jax.eval_shape``).
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
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="sequences per GPU")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument(
        "--async-limit", type=int, default=16, help="the last row's XLA:GPU async compute limit"
    )
    ap.add_argument("--out", help="also write the table to this .md file")
    args = ap.parse_args(argv)
    shape = model_shape(
        layers=args.layers,
        hidden=args.hidden,
        heads=max(1, args.hidden // 128),
        vocab=1024,
        seq=args.seq,
        batch=args.batch,
    )
    mesh = gpu.compile_only_mesh("h100", args.devices)
    params, batch = abstract_params(shape), batch_shapes(shape, args.devices)

    def step(**kw):
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

    rows = []
    _, exact = step()
    rows.append(("exact (the update after the backward)", gpu.compile_report(exact, params, batch)))
    zero, deferred = step(offload_update="deferred")
    rows.append(
        ("deferred, first step (nothing pending)", gpu.compile_report(deferred, params, batch))
    )
    with jax.set_mesh(mesh):
        pending = jax.eval_shape(deferred.jitted, zero.abstract_state(params), batch)[0]
    rows.append(
        (
            "deferred, an update pending (rows in the forward)",
            gpu.compile_report(deferred, pending, batch),
        )
    )
    # XLA:GPU counts host copies against this limit (default 2): the rows' many small copies
    # wait for a slot
    limit = {"xla_gpu_experimental_parallel_async_compute_limit": args.async_limit}
    rows.append(
        (
            f"the same, `--xla_gpu_experimental_parallel_async_compute_limit={args.async_limit}`",
            gpu.compile_report(deferred, pending, batch, compiler_options=limit),
        )
    )

    lines = [
        "`" + " ".join(["python benchmarks/deferred_rows.py", *(argv or sys.argv[1:])]) + "`",
        "",
        f"{shape.num_params:,} params ({args.layers} layers x {args.hidden}, sequence "
        f"{args.seq}, {args.batch} per GPU), {args.devices} x H100 deviceless, stage 3 per layer, "
        f'bf16, Adam, `offload="optimizer"`; jax {jax.__version__}; {datetime.date.today()}.',
        "",
        "| step | PCIe per GPU per step | peak per GPU |",
        "|---|---|---|",
    ]
    for name, rep in rows:
        lines.append(
            f"| {name} | {rep.transfer_summary()} | {jz.memory.format_bytes(rep.peak_bytes)} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
