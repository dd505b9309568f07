"""Memory and collectives per ZeRO stage on the tests' transformer (:mod:`jaxzero.gpu.models`'
``make_problem("transformer")``), 8 simulated CPU devices, Adam, EMA on, fp32 and bf16.

    python benchmarks/stage_table.py                                        # print the table
    python benchmarks/stage_table.py --out benchmarks/results/stage_table.md  # and write it

Persistent = params + master + optimizer state per device, from ``addressable_shards``;
formula = the ZeRO paper's; payload = bytes each device contributes to a collective
(all-reduce/all-gather: output; reduce-scatter: output x N) in the compiled HLO, divided by
4 Phi; temp = ``memory_analysis().temp_size_in_bytes``. ``tests/test_stages.py`` and
``tests/test_precision.py`` assert the same figures.
"""

import argparse

import jax
import optax

import jaxzero as jz
from jaxzero.gpu.models import make_problem
from jaxzero.memory import collective_bytes, device_bytes
from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices(8)  # before any jax backend starts: 8 simulated CPU devices (inert on GPUs)

N = 8
FORMULA = {  # bytes per device with Adam, as multiples of Phi: (replicated part, sharded part)
    "fp32": {0: (12, 0), 1: (4, 8), 2: (4, 8), 3: (0, 12)},
    "bf16": {0: (14, 0), 1: (2, 12), 2: (2, 12), 3: (0, 14)},
}
HEADER = (
    "| precision | stage | persistent B/device | formula | excess | EMA B/device "
    "| all-reduce /4Φ | all-gather /4Φ | reduce-scatter /4Φ | temp B |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def per(t):
    return 0 if t is None else max(device_bytes(t).values())


def row(prec, stage, params, loss_fn, batch, phi):
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(N), stage=stage, precision=prec)
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.999))
    st = step.init(params)
    pers = per(st.params) + per(st.master) + per(st.opt_state)
    whole, sharded = FORMULA[prec][stage]
    f = whole * phi + sharded * phi / N
    c = step.lower(st, batch).compile()
    cb = collective_bytes(c.as_text())

    def pay(kind):
        return sum(o.bytes * (N if kind == "reduce-scatter" else 1) for o in cb[kind]["ops"])

    temp = c.memory_analysis().temp_size_in_bytes
    return (
        f"| {prec} | {stage} | {pers:,} | {f:,.0f} | {pers / f - 1:+.2%} | {per(st.ema.ema):,} "
        f"| {pay('all-reduce') / (4 * phi):.3f} | {pay('all-gather') / (4 * phi):.3f} "
        f"| {pay('reduce-scatter') / (4 * phi):.3f} | {temp:,} |"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    params, loss_fn, batches = make_problem("transformer", steps=1)
    phi = sum(x.size for x in jax.tree.leaves(params))
    lines = [
        f"Test transformer, Φ = {phi:,}, N = {N}, Adam, EMA on (4Φ/N = {4 * phi / N:,.0f} B), "
        f"jax {jax.__version__}",
        "",
        HEADER,
    ]
    print("\n".join(lines), flush=True)
    for prec in ("fp32", "bf16"):
        for stage in range(4):
            lines.append(row(prec, stage, params, loss_fn, batches[0], phi))
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
