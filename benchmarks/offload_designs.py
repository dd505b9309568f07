"""The two designs of optimizer offload, compiled for 8 H100s without a GPU (decision 32).

State (fp32 master, Adam's mu and nu, fp32 EMA: four 2048 x 2048 leaves, sharded 8 ways) in
pinned host memory in both; the gradient shards and the new bf16 compute shards on the device.

* ``host``: the Adam + EMA update runs where the state is, ``compute_on("device_host")``
  around a ``jax.jit`` of it (what ``ZeRO(offload="optimizer")`` does);
* ``stream``: each leaf fetched to the device, updated there, and written back.

Prints XLA:GPU's device and host bytes per device for each. Run:
``python benchmarks/offload_designs.py`` (needs jax's CUDA plugin, no GPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxzero._compat import compute_on_host  # noqa: E402
from jaxzero.gpu import compile_only_mesh  # noqa: E402
from jaxzero.zero.offload import placement as offload  # noqa: E402

SIDE, LEAVES = 2048, 4


def build(design: str, mesh):
    host = lambda spec: offload.host_sharding(mesh, spec)
    device = lambda spec: NamedSharding(mesh.abstract_mesh, spec, memory_kind="device")
    spec = lambda x: P("data") if x.ndim else P()
    tx = optax.adam(1e-2)

    def update(g, o, m, e, apply):
        u, o2 = tx.update(g, o, m)
        m2 = optax.apply_updates(m, u)
        keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(apply, x, y), a, b)
        e2 = jax.tree.map(lambda ev, mv: 0.99 * ev + 0.01 * mv, e, m2)
        m2, o2, e2 = keep(m2, m), keep(o2, o), keep(e2, e)
        return m2, o2, e2, jax.tree.map(lambda x: x.astype(jnp.bfloat16), m2)

    def step(m, o, e, g):
        apply = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in g]))
        if design == "host":
            g = jax.device_put(g, jax.tree.map(lambda x: host(spec(x)), g))
            m, o, e, p = compute_on_host(jax.jit(update))(g, o, m, e, apply)
            return m, o, e, jax.device_put(p, jax.memory.Space.Device)
        to = lambda where, t: jax.device_put(t, jax.tree.map(lambda x: where(spec(x)), t))
        m, o, e, p = update(g, to(device, o), to(device, m), to(device, e), apply)
        return to(host, m), to(host, o), to(host, e), p

    shapes = [jax.ShapeDtypeStruct((SIDE, SIDE), jnp.float32)] * LEAVES
    placed = lambda t, where: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where(spec(x))), t
    )
    args = (
        placed(shapes, host),
        placed(jax.eval_shape(tx.init, shapes), host),
        placed(shapes, host),
        placed(shapes, device),
    )
    with jax.set_mesh(mesh):
        return jax.jit(step, donate_argnums=(0, 1, 2)).lower(*args).compile()


def main() -> None:
    mesh = compile_only_mesh("h100", 8)
    state = 4 * 4 * SIDE * SIDE * LEAVES // 8
    print(f"state in host memory: {state / 1e6:.2f} MB per device (master, mu, nu, EMA)")
    for design in ("host", "stream"):
        m = build(design, mesh).memory_analysis()
        dev = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        dev += m.temp_size_in_bytes
        host = m.host_argument_size_in_bytes + m.host_output_size_in_bytes
        host += m.host_temp_size_in_bytes - m.host_alias_size_in_bytes
        print(
            f"{design:6s}  device {dev / 1e6:6.2f} MB (temp {m.temp_size_in_bytes / 1e6:6.2f})"
            f"  host {host / 1e6:6.2f} MB (temp {m.host_temp_size_in_bytes / 1e6:6.2f})"
        )


if __name__ == "__main__":
    main()
