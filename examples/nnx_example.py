"""A Flax NNX module trained with ZeRO stage 3 and a sharded EMA (split/merge handled by
jaxzero.flax_nnx)."""

import os

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxzero as jz
from jaxzero.simulate import simulate_cpu_devices

simulate_cpu_devices()  # before any jax backend starts: 8 simulated CPU devices (inert on GPUs)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(32, 64, rngs=rngs)
        self.fc2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.relu(self.fc1(x)))


model_def, params, _ = jz.flax_nnx.split(MLP(nnx.Rngs(0)))


def loss(module, batch):
    logits = module(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


zero = jz.ZeRO(optax.adam(3e-3), jz.data_parallel_mesh(), stage=3)
step = jz.make_train_step(model_def.loss(loss), zero, ema=jz.ShardedEMA(0.99, tau=20))
state = step.init(params)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 32)).astype(np.float32)
y = x[:, :10].argmax(1).astype(np.int32)
for i in range(int(os.environ.get("NNX_STEPS", 40))):
    idx = rng.choice(512, 64, replace=False)
    state, metrics = step(state, {"x": x[idx], "y": y[idx]})
    if i % 10 == 0:
        print(f"step {int(metrics['step']):3d} loss {float(metrics['loss']):.4f}")
ema_model = model_def.merge(jz.gather(state.ema))  # a plain nnx.Module with the EMA weights
print("EMA accuracy:", float((ema_model(jnp.asarray(x)).argmax(1) == y).mean()))
