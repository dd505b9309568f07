"""The shortest complete use of jaxzero: wrap an existing optax chain with ZeRO stage 2."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxzero as jz
from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices()  # before any jax backend starts: 8 simulated CPU devices (inert on GPUs)

model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(10)])
params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32)))["params"]


def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))
zero = jz.ZeRO(tx, jz.data_parallel_mesh(), stage=2)  # shard grads + optimizer state
step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.999, tau=100), accum_steps=2)
state = step.init(params)

rng = np.random.default_rng(0)
x = rng.normal(size=(512, 32)).astype(np.float32)
y = (x[:, :10].argmax(1)).astype(np.int32)  # a learnable toy rule
for i in range(int(os.environ.get("QUICKSTART_STEPS", 50))):
    idx = rng.choice(512, 64, replace=False)
    state, metrics = step(state, {"x": x[idx], "y": y[idx]})
    if i % 10 == 0:
        print(f"step {int(metrics['step']):3d}  loss {float(metrics['loss']):.4f}")
eval_params = jz.ema_params(state)  # the full EMA weights, gathered only for evaluation
print("EMA accuracy:", float((model.apply({"params": eval_params}, x).argmax(1) == y).mean()))
