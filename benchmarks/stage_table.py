import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jax
import optax
from models import make_problem

import jaxzero as jz
from jaxzero.memory import collective_bytes, device_bytes
from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices(8)  # before any jax backend starts: 8 simulated CPU devices (inert on GPUs)

params, loss_fn, batches = make_problem("transformer", steps=1)
phi = sum(x.size for x in jax.tree.leaves(params))
N = 8
print("phi", phi)


def per(t):
    return 0 if t is None else max(device_bytes(t).values())


for prec in ("fp32", "bf16"):
    for stage in range(4):
        zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(N), stage=stage, precision=prec)
        step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.999))
        st = step.init(params)
        pers = per(st.params) + per(st.master) + per(st.opt_state)
        f = {
            "fp32": {
                0: 12 * phi,
                1: 4 * phi + 8 * phi / N,
                2: 4 * phi + 8 * phi / N,
                3: 12 * phi / N,
            },
            "bf16": {
                0: 14 * phi,
                1: 2 * phi + 12 * phi / N,
                2: 2 * phi + 12 * phi / N,
                3: 14 * phi / N,
            },
        }[prec][stage]
        c = step.lower(st, batches[0]).compile()
        cb = collective_bytes(c.as_text())
        pay = lambda k, cb=cb: sum(
            o.bytes * (N if k == "reduce-scatter" else 1) for o in cb[k]["ops"]
        )
        temp = c.memory_analysis().temp_size_in_bytes
        print(
            f"| {prec} | {stage} | {pers:,} | {f:,.0f} | {pers / f - 1:+.2%} | {per(st.ema.ema):,} | {pay('all-reduce') / (4 * phi):.3f} | {pay('all-gather') / (4 * phi):.3f} | {pay('reduce-scatter') / (4 * phi):.3f} | {temp:,} |"
        )
