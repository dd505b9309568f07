"""The hardware floor for the EMA speed-up on this machine: a bare, donated elementwise EMA
over ~20M floats, per-leaf (replicated vs sharded over 8 simulated devices) and as one flat
[8, L] buffer. Compare its ratios with benchmarks/ema.py (jaxzero's sharded EMA)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero as jz
from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices()  # before any jax backend starts: 8 simulated CPU devices (inert on GPUs)


def median_ms(fn, e, x, reps=20):
    e = fn(e, x)
    jax.block_until_ready(e)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        e = fn(e, x)
        jax.block_until_ready(e)
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def main():
    mesh = jz.data_parallel_mesh()
    n = mesh.size
    shapes = [(1024, 1024)] * 19 + [(1024,)] * 19 + [(8,)] * 16
    tree = {f"l{i}": jnp.ones(s, jnp.float32) for i, s in enumerate(shapes)}
    ema = jax.jit(
        lambda e, x: jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b, e, x), donate_argnums=0
    )
    results = {}
    for name, spec in (
        ("per-leaf replicated", lambda s: P()),
        ("per-leaf sharded", lambda s: P("data")),
    ):
        sh = {k: NamedSharding(mesh, spec(v.shape)) for k, v in tree.items()}
        e = jax.device_put(jax.tree.map(lambda a: a + 0, tree), sh)
        x = jax.device_put(jax.tree.map(lambda a: a * 2, tree), sh)
        results[name] = median_ms(ema, e, x)
    size = sum(int(np.prod(s)) for s in shapes) // n
    flat = jax.jit(lambda a, b: 0.999 * a + 0.001 * b, donate_argnums=0)
    for name, spec in (("flat replicated", P()), ("flat sharded [N, L]", P("data", None))):
        s = NamedSharding(mesh, spec)
        results[name] = median_ms(
            flat,
            jax.device_put(jnp.ones((n, size)), s),
            jax.device_put(jnp.full((n, size), 2.0), s),
        )
    for name, ms in results.items():
        print(f"{name:24s} {ms:8.2f} ms")
    print(
        f"per-leaf ratio {results['per-leaf replicated'] / results['per-leaf sharded']:.2f}x, "
        f"flat ratio {results['flat replicated'] / results['flat sharded [N, L]']:.2f}x"
    )


if __name__ == "__main__":
    main()
