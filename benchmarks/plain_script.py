"""What a plain single-process ``python train.py`` gets with ``units=``: the
per-unit stage 3 step (FSDP's layout, prefetch) on the 16 x 2048 GPT compiled for 64 H100s
without a GPU, as such a script compiles it (no launcher, no ``jaxzero.distributed.initialize()``,
so XLA's default flags), against the recommended flags, with each unit gathered in one flat
all-gather (jaxzero's gather) and one all-gather per leaf (the gather before it).

    python benchmarks/plain_script.py
    python benchmarks/plain_script.py --quick     # 4 blocks x 256, N = 8
    python benchmarks/plain_script.py --out benchmarks/results/plain_script.md

Per row, per device per step: peak (arguments + temporaries), all-gather + reduce-scatter
payload bytes, the share of them hidden behind compute and its data-flow ceiling, the
all-gathers launched per step, and kernels (as in benchmarks/units.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import jaxlib  # noqa: E402
import optax  # noqa: E402

import jaxzero as jz  # noqa: E402
import jaxzero.zero.units.chain as unit_chain  # noqa: E402
from jaxzero import gpu  # noqa: E402
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape  # noqa: E402

KIND = "h100"
VOCAB = 15872  # benchmarks/units.py's: 839.3M params at 16 x 2048


def row(shape, mesh, options, flat: bool) -> dict:
    params, loss_fn = abstract_params(shape), make_loss(shape)
    zero = jz.ZeRO(
        optax.adam(1e-4),
        mesh,
        stage=3,
        precision=jz.Precision.create("bf16", compute_copy=False),
        units=r"block_\d+",
    )
    step = jz.make_train_step(loss_fn, zero)
    n = mesh.shape["data"]
    combined = unit_chain.COMBINED
    if not flat:  # the gather before the flat one: one all-gather per leaf at any size
        unit_chain.COMBINED = float("inf")
    try:
        rep = gpu.compile_report(step, params, batch_shapes(shape, n), compiler_options=options)
    finally:
        unit_chain.COMBINED = combined
    kinds = ("all-gather", "reduce-scatter")
    return {
        "peak": rep.argument_bytes + rep.temp_bytes,
        "bytes": sum(rep.payload(k) for k in kinds),
        "hidden": rep.hidden_share(*kinds),
        "ceiling": rep.hideable_share(*kinds),
        "gathers": sum(c.launches for c in rep.collectives if c.kind == "all-gather"),
        "kernels": rep.kernels_per_step,
    }


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 blocks x 256, 128 tokens, N = 8")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    if args.quick:
        n, shape = 8, model_shape(layers=4, hidden=256, vocab=1024, seq=128, loop="python")
    else:
        n = 64
        shape = model_shape(layers=16, hidden=2048, vocab=VOCAB, seq=512, arch="gpt", loop="python")
    mesh = gpu.compile_only_mesh(KIND, n)  # before the flags' check starts the CPU backend
    recommended = gpu.xla_options()
    lines = [
        "# What a plain `python train.py` gets with units=",
        "",
        f"Command: `{' '.join(['python', 'benchmarks/plain_script.py', *argv])}`",
        "",
        f"Date: {datetime.date.today().isoformat()}. Machine: deviceless XLA:GPU compile for "
        f"{n} x {KIND.upper()} on {platform.machine()} {platform.system()}, no GPU. Versions: "
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, Python "
        f"{platform.python_version()}.",
        "",
        f'GPT {shape.layers} x {shape.hidden} (`loop="python"`, `units=r"block_\\d+"`), '
        f"bf16 in FSDP's layout (`compute_copy=False`), prefetch, Adam, {shape.seq} tokens per "
        f"device. Recommended flags: `{' '.join(gpu.recommended_xla_flags())}`.",
        "",
        "| unit gather | XLA flags | peak (args + temp) | AG+RS bytes | hidden AG+RS | ceiling "
        "| all-gathers | kernels |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for flat in (False, True):
        for label, options in (("XLA's defaults", None), ("recommended", recommended)):
            f = row(shape, mesh, options, flat)
            gather = "one flat all-gather per unit" if flat else "one all-gather per leaf"
            line = (
                f"| {gather} | {label} | {f['peak'] / 1e6:.0f} MB | {f['bytes'] / 1e6:.0f} MB | "
                f"{f['hidden']:.2f} | {f['ceiling']:.2f} | {f['gathers']} | {f['kernels']} |"
            )
            print(line, file=sys.stderr, flush=True)
            lines.append(line)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
