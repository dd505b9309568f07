"""Small models and data shared by the tests (no jaxzero logic here)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxzero as jz


class MLP(nn.Module):
    """17 -> 31 -> 5 with tanh: leaves whose sizes do not divide by 8."""

    hidden: int = 31
    out: int = 5

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(self.hidden, name="fc1")(x))
        return nn.Dense(self.out, name="fc2")(x)


class Residual(nn.Module):
    """``x + Dense(width)(tanh(Dense(hidden)(x)))``: the small block of the Python-loop models
    in tests/test_readme.py and tests/test_units_nested.py."""

    hidden: int = 16

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(self.hidden)(x)))


class Block(nn.Module):
    d_model: int = 32
    heads: int = 4
    ff: int = 64

    @nn.compact
    def __call__(self, x):
        # No projection biases: the key bias has an exactly-zero true gradient (softmax is
        # shift-invariant), so Adam turns float noise in it into O(lr) updates that no two
        # summation orders agree on (see tests/fixtures/README.md, section B).
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False, name="attn")(x, x)
        x = nn.LayerNorm(name="norm1")(x + h)
        h = nn.Dense(self.ff, name="linear1")(x)
        h = nn.Dense(self.d_model, name="linear2")(nn.relu(h))
        return nn.LayerNorm(name="norm2")(x + h)


class Transformer(nn.Module):
    """2 post-norm encoder layers (d_model 32, 4 heads, ff 64) and a Dense(3) head."""

    layers: int = 2
    d_model: int = 32
    out: int = 3

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = Block(d_model=self.d_model, name=f"layer{i}")(x)
        return nn.Dense(self.out, name="head")(x)


class ScanBlock(nn.Module):
    """:class:`Block` with the ``(carry, x) -> (carry, y)`` signature ``nn.scan`` wants."""

    d_model: int = 32
    ff: int = 64

    @nn.compact
    def __call__(self, x, _):
        return Block(d_model=self.d_model, ff=self.ff, name="block")(x), None


class ScannedTransformer(nn.Module):
    """:class:`Transformer` with its layers stacked by ``nn.scan`` under ``params["layers"]``,
    each layer rematerialised; ``gather_layer`` (e.g. ``jaxzero.gather_layer``) is applied to
    each layer's variables inside the scanned body, as a ZeRO-3 per-layer model does."""

    layers: int = 3
    d_model: int = 32
    ff: int = 64
    out: int = 3
    gather_layer: object = None

    @nn.compact
    def __call__(self, x):
        block = ScanBlock
        if self.gather_layer is not None:
            block = nn.map_variables(block, "params", trans_in_fn=self.gather_layer, init=True)
        block = nn.remat(block)
        x, _ = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers
        )(d_model=self.d_model, ff=self.ff, name="layers")(x, None)
        return nn.Dense(self.out, name="head")(x)


class StackTransformer(nn.Module):
    """:class:`ScannedTransformer` written with ``scan_layers``/``stacked_params`` (e.g.
    ``jaxzero.scan_layers``, ``jaxzero.stacked_params``): the same ``params["layers"]``
    stack, run by a function of (layer params, carry). Each layer also multiplies its output
    by a ``gain`` parameter kept outside the stack, which the layer function closes over."""

    layers: int = 3
    d_model: int = 32
    ff: int = 64
    out: int = 3
    scan_layers: object = None
    stacked_params: object = None
    xs: str | None = None  # per-layer inputs: "index" (a scale 1 + 0.1 i) or "keys" (dropout)
    ys: bool = False  # per-layer outputs: each layer's feature mean, added to the prediction

    @nn.compact
    def __call__(self, x):
        block = ScanBlock(d_model=self.d_model, ff=self.ff, parent=None)
        stack = self.stacked_params(self, "layers", block, self.layers, x, None)
        gain = self.param("gain", nn.initializers.constant(1.1), (self.d_model,))
        layer = lambda w, h: block.apply({"params": w}, h, None)[0] * gain.astype(h.dtype)
        if self.ys:
            aux = lambda w, h: (lambda o: (o, jnp.mean(o, axis=-1)))(layer(w, h))
            x, ys = self.scan_layers(aux, stack, x, with_ys=True)  # ys: [layers, batch, seq]
            return nn.Dense(self.out, name="head")(x) + 0.5 * jnp.mean(ys, axis=0)[..., None]
        if self.xs is None:
            x = self.scan_layers(layer, stack, x)
        elif self.xs == "index":
            scaled = lambda w, h, i: layer(w, h) * (1 + 0.1 * i).astype(h.dtype)
            x = self.scan_layers(scaled, stack, x, jnp.arange(self.layers))
        else:  # a fixed dropout mask per layer over the features: the same on every device
            keys = jax.random.split(jax.random.key(7), self.layers)
            drop = lambda w, h, k: layer(w, h) * jax.random.bernoulli(k, 0.75, h.shape[-1:]) / 0.75
            x = self.scan_layers(drop, stack, x, keys)
        return nn.Dense(self.out, name="head")(x)


def make_problem(
    name: str, *, batch: int = 32, steps: int = 10, seed: int = 0, gather_layer=None, **kw
):
    """(params, loss_fn, batches) for ``name`` in {"mlp", "wide_mlp", "transformer",
    "scanned", "stack"} ("scanned": :class:`ScannedTransformer`, ``gather_layer`` and ``kw``
    passed on; "stack": :class:`StackTransformer`, ``kw`` passed on)."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        model, x_shape, y_shape = MLP(), (17,), (5,)
    elif name == "wide_mlp":  # every leaf divisible by 8: cheap to compile, fully sharded
        model, x_shape, y_shape = MLP(hidden=32, out=8), (16,), (8,)
    elif name == "transformer":
        model, x_shape, y_shape = Transformer(), (6, 32), (6, 3)
    elif name == "scanned":
        model = ScannedTransformer(gather_layer=gather_layer, **kw)
        x_shape, y_shape = (6, model.d_model), (6, model.out)
    elif name == "stack":
        model = StackTransformer(**kw)
        x_shape, y_shape = (6, model.d_model), (6, model.out)
    else:
        raise ValueError(name)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, *x_shape)))["params"]

    def loss_fn(p, b):
        pred = model.apply({"params": p}, b["x"])
        return jnp.mean((pred.astype(jnp.float32) - b["y"]) ** 2)

    batches = [
        {
            "x": rng.normal(size=(batch, *x_shape)).astype(np.float32),
            "y": rng.normal(size=(batch, *y_shape)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return params, loss_fn, batches


def decay_mask(params):
    """Weight decay on matrices only (no decay on biases and norm scales)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def chains():
    """The optax chains every stage must reproduce."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 3, 10)
    return {
        "adamw_masked": optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask),
        "clip_adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
        "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=16),
        "lamb": optax.lamb(1e-2),
        "sgd_nesterov_cosine": optax.sgd(schedule, momentum=0.9, nesterov=True),
        "multisteps_adam": optax.MultiSteps(optax.adam(3e-3), every_k_schedule=4),
    }


def stack_problem(**kw):
    """``make_problem("stack", ...)`` with jaxzero's ``scan_layers`` and ``stacked_params``
    (``kw``: layers, steps, xs, ys)."""
    return make_problem("stack", scan_layers=jz.scan_layers, stacked_params=jz.stacked_params, **kw)


def reference_run(tx, params, loss_fn, batches):
    """Plain single-device optax on the full global batch."""

    @jax.jit
    def step(p, s, b):
        g = jax.grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    for b in batches:
        p, s = step(p, s, b)
    return p, s


def run_steps(zero, loss_fn, state, batches, ema, **step_kw):
    """``(state, losses)`` after one jaxzero train step per batch from ``state`` (``step_kw``:
    make_train_step's)."""
    step = jz.make_train_step(loss_fn, zero, ema=ema, **step_kw)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


def train(zero, loss_fn, params, batches, **kw):
    """The state after one jaxzero train step per batch (``kw``: make_train_step's)."""
    step = jz.make_train_step(loss_fn, zero, **kw)
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)
    return state


def stage3_per_layer_and_whole_bf16(params, loss_fn, batches, ema):
    """The final states of stage 3 with ``layers="layers"`` and without (bf16 compute, fp32
    master and reduce, Adam, ``ema``) on 8 devices: only where the gathers happen differs."""
    mesh = jz.data_parallel_mesh(8)
    pol = jz.Precision("bfloat16", "float32", "float32")
    tx = optax.adam(1e-2, eps=1e-6)
    return tuple(
        train(jz.ZeRO(tx, mesh, stage=3, precision=pol, **kw), loss_fn, params, batches, ema=ema)
        for kw in ({"layers": "layers"}, {})
    )
