"""Bring your own step: a hand-written `jax.jit` train step built from ZeRO's public pieces.

It computes exactly what `jz.make_train_step(loss_fn, zero)` computes (the test suite checks
bit-for-bit equality for stages 0-3), so it is the template for custom steps: extra losses,
custom metrics, several models...
"""

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxzero as jz


def make_my_step(loss_fn, zero: jz.ZeRO, abstract_state):
    """``loss_fn(params, batch) -> scalar loss``; ``abstract_state = zero.abstract_state(p)``."""
    axes = zero.batch_axes
    state_shardings = zero.state_shardings(abstract_state)  # for in_/out_shardings
    batch_sharding = NamedSharding(zero.mesh, zero.batch_spec())

    def step(state, batch):
        specs = zero.param_specs(state.params)  # stage 3: sharded; else replicated

        def per_device(params, batch):
            full = zero.params_for_loss(params, specs)  # gather (stage 3) + mark varying
            loss, grads = jax.value_and_grad(loss_fn)(full, batch)
            grads = zero.reduce_gradients(grads)  # all-reduce (0/1) or reduce-scatter (2/3)
            return jax.lax.pmean(loss, axes), grads

        loss, grads = jax.shard_map(
            per_device,
            mesh=zero.mesh,
            in_specs=(specs, jax.tree.map(lambda _: zero.batch_spec(), batch)),
            out_specs=(P(), zero.grad_specs(state.params)),
        )(state.params, batch)
        # optax update on shards, master cast, all-gather of params (stages 1/2)
        state, metrics = zero.apply_gradients(state, grads)
        return state, {"loss": loss, **metrics}

    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )


if __name__ == "__main__":
    from jaxzero.simulate import simulate_cpu_devices

    simulate_cpu_devices()  # 8 simulated CPU devices on a CPU-only machine; inert on GPUs
    import jax.numpy as jnp
    import numpy as np
    import optax

    params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}
    loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(), stage=2)
    step = make_my_step(loss_fn, zero, zero.abstract_state(params))
    state = zero.init(params)
    rng = np.random.default_rng(0)
    for i in range(5):
        x = rng.normal(size=(32, 16)).astype(np.float32)
        state, m = step(state, {"x": x, "y": x[:, :4]})
        print(f"step {i} loss {float(m['loss']):.4f}")
