"""The model zoo: the GPT- and LLaMA-shaped decoders that planning compiles and the benchmarks
time, and the small models of the tests' problems (:func:`make_problem`), which the benchmarks
measure too. One definition per model; the tests compare these models' training with
single-device optax at fixed seeds, so their parameter names, init order, shapes and dtypes are
part of their contract.

Decoders (:class:`Decoder` of a :class:`ModelShape`), built abstractly (``jax.eval_shape``,
:func:`abstract_params`) for planning, or concretely (:func:`init_params`) for the benchmarks
that run them.

* ``"llama"``: RMSNorm, no biases, SwiGLU MLP of width ``ffn`` (default LLaMA's
  ``256 * ceil(8h/3 / 256)``: 11008 for h=4096), no position parameters (rotary embeddings have
  none; left out, as they change no parameter or communicated byte), untied head.
  Parameters: ``L (4h^2 + 3 h ffn + 2h) + 2 V h + h``.
* ``"gpt"``: LayerNorm, biases, GELU MLP of width ``ffn`` (default 4h), learned positions,
  head tied to the embedding. Parameters: ``L (4h^2 + 2 h ffn + 9h + ffn) + (V + S) h + 2h``.

Attention (``ModelShape.attention``): ``"auto"`` uses cuDNN's fused flash attention when the
compute dtype is 16-bit (what GPU training of such models runs; it never holds the s x s
scores) and XLA's reference attention in fp32 (cuDNN's kernel has no fp32 form); ``"xla"``
always uses XLA's, which materialises the f32 scores, probabilities and causal mask per layer
(and is the one that compiles for CPU).

The layer stack is ``params["layers"]`` (for ``ZeRO(layers="layers")``). ``ModelShape.loop``:
``"prefetch"`` (default) runs it with :func:`jaxzero.scan_layers` (the next layer's all-gather
in flight while this one computes); ``"gather_layer"`` with ``nn.scan`` over an ``nn.remat``'d
block that calls :func:`jaxzero.gather_layer` (each layer gathered where it is used),
``"gather_layer_noremat"`` the same scan without ``nn.remat``. All three build the same params.

Unscanned, as most Flax code is written: ``"python"`` is a Python loop of ``nn.remat``'d blocks
named ``block_0`` ... ``block_{L-1}`` (``params["block_3"]`` is one layer's params, no layer
axis; no :func:`jaxzero.gather_layer`), ``"python_noremat"`` the same loop without
``nn.remat``. :func:`nnx_model` is the NNX twin: an ``nnx.List`` of blocks under ``layers``
(``params["layers"][3]``), split by :func:`jaxzero.flax_nnx.split`.

The tests' small models: :class:`MLP` (leaves whose sizes do not divide by 8),
:class:`Residual`, the post-norm encoder :class:`Transformer` (blocks :class:`Block` named
``layer0``, ``layer1``), and its layer stack under ``params["layers"]`` as ``nn.scan``
(:class:`ScannedTransformer`) or :func:`jaxzero.scan_layers` (:class:`StackTransformer`).

Models the project did not write, as users bring them: Hugging Face's Flax LLaMA
(:func:`hf_llama`) and T5 (:func:`hf_t5`), tiny and randomly initialised (``transformers``, the
dev extra, imported when called), with :func:`token_batches` of random token ids.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxzero.flax_nnx import split
from jaxzero.zero.layers import VocabParallelEmbed, gather_layer, scan_layers, stacked_params

__all__ = [
    "ARCHS",
    "MLP",
    "Block",
    "Decoder",
    "ModelShape",
    "Residual",
    "ScanBlock",
    "ScannedTransformer",
    "StackTransformer",
    "Transformer",
    "abstract_params",
    "batch_shapes",
    "detector_tree",
    "hf_llama",
    "hf_t5",
    "init_params",
    "make_loss",
    "make_problem",
    "model_shape",
    "nnx_model",
    "token_batches",
]

ARCHS = ("llama", "gpt")
ATTENTION = ("auto", "xla")
LOOPS = ("prefetch", "gather_layer", "gather_layer_noremat", "python", "python_noremat")
PYTHON_LOOPS = ("python", "python_noremat")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder's shape and the per-device micro-batch it trains on."""

    arch: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    batch: int = 1
    ffn: int = 0  # 0: the arch's default
    attention: str = "auto"
    loop: str = "prefetch"
    vocab_parallel: bool = False  # gpt: the tied embedding as jaxzero.VocabParallelEmbed

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is not one of {', '.join(ARCHS)}.")
        for name in ("layers", "hidden", "heads", "vocab", "seq", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int.")
        if self.loop not in LOOPS:
            raise ValueError(f"loop={self.loop!r} must be one of {', '.join(LOOPS)}.")
        if self.vocab_parallel and self.arch != "gpt":
            raise ValueError("vocab_parallel=True needs arch='gpt' (the tied embedding head).")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention={self.attention!r} must be one of {', '.join(ATTENTION)}.")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by heads={self.heads}; pick heads that "
                f"divide the width (e.g. heads={max(1, self.hidden // 128)})."
            )
        if not self.ffn:
            ffn = (
                256 * math.ceil(8 * self.hidden / 3 / 256)
                if self.arch == "llama"
                else 4 * self.hidden
            )
            object.__setattr__(self, "ffn", ffn)

    @property
    def num_params(self) -> int:
        """Φ from the formulas in the module docstring (equals the built model's count)."""
        h, f, v = self.hidden, self.ffn, self.vocab
        if self.arch == "llama":
            return self.layers * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h
        return self.layers * (4 * h * h + 2 * h * f + 9 * h + f) + (v + self.seq) * h + 2 * h

    @property
    def layer_params(self) -> int:
        """Parameters of one layer (DeepSpeed's "largest layer")."""
        h, f = self.hidden, self.ffn
        if self.arch == "llama":
            return 4 * h * h + 3 * h * f + 2 * h
        return 4 * h * h + 2 * h * f + 9 * h + f


def model_shape(
    *,
    params: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    vocab: int = 32000,
    seq: int = 2048,
    batch: int = 1,
    arch: str = "llama",
    ffn: int = 0,
    attention: str = "auto",
    loop: str = "prefetch",
    vocab_parallel: bool = False,
) -> ModelShape:
    """A :class:`ModelShape` from ``layers``/``hidden`` (heads default ``hidden // 128``), or,
    with ``params`` alone, the shape of that size with ``layers = hidden / 128`` (LLaMA's and
    GPT-3's aspect ratio; hidden a multiple of 256) nearest to ``params``."""
    if (layers is None) != (hidden is None):
        raise ValueError("give both layers and hidden (or only params to derive them).")
    if layers is None:
        if params is None:
            raise ValueError("give the model size: params, or layers and hidden.")

        def size(h):
            heads = max(1, h // 128)
            return ModelShape(
                arch, heads, h, heads, vocab, seq, batch, ffn, attention, loop, vocab_parallel
            )

        hidden = min(range(256, 65537, 256), key=lambda h: abs(size(h).num_params - params))
        return size(hidden)
    heads = heads or max(1, hidden // 128)
    return ModelShape(
        arch, layers, hidden, heads, vocab, seq, batch, ffn, attention, loop, vocab_parallel
    )


def _impl(shape: ModelShape, dtype) -> str | None:
    """cuDNN's fused (flash) attention for 16-bit compute, as GPU training runs it; XLA's
    reference attention (which materialises the s x s scores) for fp32 or when asked."""
    if shape.attention == "auto" and jnp.dtype(dtype).itemsize == 2:
        return "cudnn"
    return None


def _dense_widths(c: ModelShape) -> dict[str, tuple[int, int]]:
    """A block's dense layers: name -> (inputs, outputs)."""
    d, f = c.hidden, c.ffn
    mlp = {"gate": (d, f), "up": (d, f)} if c.arch == "llama" else {"fc": (d, f)}
    return {"qkv": (d, 3 * d), "out": (d, d), **mlp, "down": (f, d)}


def _block(c: ModelShape, x, layer):
    """One decoder block on ``x``; ``layer(name)`` is its sublayer ``name`` (a norm or a dense
    layer of :func:`_dense_widths`), whichever Flax API built it."""
    b, s, d = x.shape
    qkv = layer("qkv")(layer("norm1")(x)).reshape(b, s, 3, c.heads, d // c.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    h = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=_impl(c, q.dtype))
    x = x + layer("out")(h.reshape(b, s, d))
    h = layer("norm2")(x)
    if c.arch == "llama":
        h = nn.silu(layer("gate")(h)) * layer("up")(h)
    else:
        h = nn.gelu(layer("fc")(h))
    return x + layer("down")(h)


class _Block(nn.Module):
    shape: ModelShape

    @nn.compact
    def __call__(self, x, _):
        c = self.shape
        widths = _dense_widths(c)
        norm = nn.RMSNorm if c.arch == "llama" else nn.LayerNorm

        def layer(name):
            if name in widths:
                return nn.Dense(widths[name][1], use_bias=c.arch != "llama", name=name)
            return norm(name=name)

        return _block(c, x, layer), None


class Decoder(nn.Module):
    """The decoder of ``shape`` (see the module docstring); computes in the params' dtype."""

    shape: ModelShape

    @nn.compact
    def __call__(self, tokens, labels=None):
        c = self.shape
        table = VocabParallelEmbed if c.vocab_parallel else nn.Embed
        embed = table(c.vocab, c.hidden, name="embed")
        x = embed(tokens)
        if c.arch == "gpt":
            pos = self.param("pos", nn.initializers.normal(0.02), (c.seq, c.hidden))
            x = x + pos[: tokens.shape[1]].astype(x.dtype)
        if c.loop in PYTHON_LOOPS:
            block = nn.remat(_Block) if c.loop == "python" else _Block
            for i in range(c.layers):
                x = block(c, name=f"block_{i}")(x, None)[0]
        elif c.loop == "prefetch":
            block = _Block(c, parent=None)
            stack = stacked_params(self, "layers", block, c.layers, x, None)
            x = scan_layers(lambda w, h: block.apply({"params": w}, h, None)[0], stack, x)
        else:
            block = nn.map_variables(_Block, "params", trans_in_fn=gather_layer, init=True)
            if c.loop == "gather_layer":
                block = nn.remat(block)
            x, _ = nn.scan(
                block, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.layers
            )(c, name="layers")(x, None)
        x = (nn.RMSNorm if c.arch == "llama" else nn.LayerNorm)(name="final_norm")(x)
        if c.vocab_parallel:  # the mean cross-entropy, computed on the table's rows
            return embed.cross_entropy(x, labels).mean()
        if c.arch == "gpt":
            return embed.attend(x)
        return nn.Dense(c.vocab, use_bias=False, name="head")(x)


def abstract_params(shape: ModelShape):
    """The float32 params' ``ShapeDtypeStruct``s (``jax.eval_shape``: nothing allocated)."""
    model = Decoder(shape)
    tokens = jax.ShapeDtypeStruct((1, shape.seq), jnp.int32)
    labels = lambda t: t if shape.vocab_parallel else None
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t, labels(t))["params"], tokens)


def init_params(shape: ModelShape, seed: int = 0):
    """The float32 params of ``Decoder(shape)``, initialised from ``seed`` (jitted)."""
    model = Decoder(shape)
    tokens = jnp.zeros((1, shape.seq), jnp.int32)
    labels = tokens if shape.vocab_parallel else None
    init = jax.jit(lambda key: model.init(key, tokens, labels)["params"])
    return init(jax.random.PRNGKey(seed))


def _xent(logits, labels):
    """Mean next-token cross-entropy over f32 logits."""
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_loss(shape: ModelShape):
    """``loss_fn(params, {"x", "y"})``: mean next-token cross-entropy over f32 logits."""
    model = Decoder(shape)

    def loss_fn(params, batch):
        if shape.vocab_parallel:
            return model.apply({"params": params}, batch["x"], batch["y"])
        return _xent(model.apply({"params": params}, batch["x"]), batch["y"])

    return loss_fn


class _NnxBlock(nnx.Module):
    def __init__(self, shape: ModelShape, dtype, rngs: nnx.Rngs):
        c = self.shape = shape
        norm = nnx.RMSNorm if c.arch == "llama" else nnx.LayerNorm
        self.norm1 = norm(c.hidden, dtype=dtype, rngs=rngs)
        self.norm2 = norm(c.hidden, dtype=dtype, rngs=rngs)
        bias = c.arch != "llama"
        for name, (n_in, n_out) in _dense_widths(c).items():
            setattr(self, name, nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, rngs=rngs))

    def __call__(self, x):
        return _block(self.shape, x, lambda name: getattr(self, name))


class _NnxDecoder(nnx.Module):
    """:class:`Decoder` with ``loop="python"``/``"python_noremat"`` as an NNX module: the
    blocks in an ``nnx.List`` under ``layers``, the same params (``layers/i`` for
    ``block_i``); every module computes in ``dtype``."""

    def __init__(self, shape: ModelShape, dtype, rngs: nnx.Rngs):
        c = self.shape = shape
        self.embed = nnx.Embed(c.vocab, c.hidden, dtype=dtype, rngs=rngs)
        if c.arch == "gpt":
            self.pos = nnx.Param(nn.initializers.normal(0.02)(rngs.params(), (c.seq, c.hidden)))
        self.layers = nnx.List([_NnxBlock(c, dtype, rngs) for _ in range(c.layers)])
        norm = nnx.RMSNorm if c.arch == "llama" else nnx.LayerNorm
        self.final_norm = norm(c.hidden, dtype=dtype, rngs=rngs)
        if c.arch == "llama":
            self.head = nnx.Linear(c.hidden, c.vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        c = self.shape
        x = self.embed(tokens)
        if c.arch == "gpt":
            x = x + self.pos[: tokens.shape[1]].astype(x.dtype)
        run = lambda block, x: block(x)
        if c.loop == "python":
            run = nnx.remat(run)
        for block in self.layers:
            x = run(block, x)
        x = self.final_norm(x)
        return self.embed.attend(x) if c.arch == "gpt" else self.head(x)


def nnx_model(shape: ModelShape, dtype=jnp.bfloat16):
    """The NNX twin of ``Decoder(shape)`` for ``loop="python"`` (``nnx.remat`` per block) or
    ``"python_noremat"``: ``(params, loss_fn)``, the float32 params' ``ShapeDtypeStruct``s
    (``nnx.eval_shape``: nothing allocated; ``params["layers"][i]`` is block i) and
    ``loss_fn(params, {"x", "y"})`` through ``jaxzero.flax_nnx.split``'s ``model_def.loss``.

    Every module is built with ``dtype=dtype``, the compute dtype, as NNX models for bf16
    training are written (an ``nnx.Embed`` without ``dtype=`` computes in its float32 param
    dtype whatever the params it is given); ``Decoder`` computes in the params' dtype instead.
    """
    if shape.loop not in PYTHON_LOOPS:
        raise ValueError(
            f"nnx_model needs loop='python' or 'python_noremat' (a list of blocks), got "
            f"loop={shape.loop!r}; use dataclasses.replace(shape, loop='python')."
        )
    if shape.vocab_parallel:
        raise ValueError("nnx_model has no vocab_parallel form; use vocab_parallel=False.")
    module = nnx.eval_shape(lambda: _NnxDecoder(shape, dtype, nnx.Rngs(0)))
    model_def, params, _ = split(module)
    return params, model_def.loss(lambda module, batch: _xent(module(batch["x"]), batch["y"]))


def batch_shapes(shape: ModelShape, global_batch: int):
    """The global token batch ``{"x", "y"}`` as int32 ``ShapeDtypeStruct``s."""
    s = jax.ShapeDtypeStruct((global_batch, shape.seq), jnp.int32)
    return {"x": s, "y": s}


def detector_tree(convs: int = 116, seed: int = 0):
    """A YOLOv5s-shaped float32 parameter tree as ShapeDtypeStructs: ``convs`` conv kernels
    ``(k, k, cin, cout)`` (k 1 or 3, channels 32..512) each with a BatchNorm scale and bias,
    and a detection head: 350 leaves, 31.6M floats with the defaults."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    tree = {}
    for i in range(convs):
        cin, cout = (int(c) for c in rng.choice([32, 64, 128, 256, 512], 2))
        k = int(rng.choice([1, 3]))
        tree[f"conv{i:03d}"] = {
            "kernel": f32(k, k, cin, cout),
            "scale": f32(cout),
            "bias": f32(cout),
        }
    tree["head"] = {"kernel": f32(255, 512), "bias": f32(255)}
    return tree


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
    """A post-norm encoder layer: attention without projection biases, a ReLU MLP of ``ff``."""

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


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(model: nn.Module, key, x_shape: tuple):
    """``model``'s params for a batch of one ``x_shape`` input, compiled once per model
    configuration in a process (a Linen module hashes by its fields): an eager ``init`` of a
    layer stack runs its ``lax.scan`` as a program of its own, traced and compiled again at
    every call (0.9 s for ``"stack"``, 3 s for ``"scanned"`` on one CPU device)."""
    return model.init(key, jnp.zeros((1, *x_shape)))["params"]


def make_problem(
    name: str, *, batch: int = 32, steps: int = 10, seed: int = 0, gather_layer=None, **kw
):
    """A small regression problem of the tests (and of the benchmarks that measure them).

    Args:
        name: "mlp" (:class:`MLP`), "wide_mlp" (an MLP whose leaves all divide by 8),
            "transformer" (:class:`Transformer`), "scanned" (:class:`ScannedTransformer`,
            ``gather_layer`` and ``kw`` passed on) or "stack" (:class:`StackTransformer`,
            ``kw`` passed on).
        batch: the global batch of each step.
        steps: how many batches.
        seed: the params' ``PRNGKey`` and the batches' numpy seed.

    Returns:
        ``(params, loss_fn, batches)``: float32 params, the mean squared error
        ``loss_fn(params, {"x", "y"})`` and ``steps`` batches of normal noise.
    """
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
    params = _init_params(model, jax.random.PRNGKey(seed), x_shape)

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


# Tiny Hugging Face Flax models (``transformers``, imported when called; random init, no
# download): models jaxzero's authors did not write, as users bring them.


def _transformers():
    """``transformers`` (the dev extra), imported quietly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import transformers
        from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return transformers


def _params(init, abstract):
    """The params ``init()`` builds, or their shapes when ``abstract``."""
    return (jax.eval_shape(init) if abstract else init())["params"]


def _token_loss(logits, labels):
    """Mean next-token cross-entropy over f32 logits."""
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def hf_llama(
    layers=2, hidden=32, ffn=48, vocab=64, seq=8, dtype=jnp.float32, abstract=False, heads=2
):
    """(params, loss_fn) of FlaxLlamaForCausalLM: blocks ``model/layers/0`` ... in a Python
    loop; its attention softmax runs in float32 whatever ``dtype`` is."""
    t = _transformers()
    config = t.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        # FlaxLlama keeps num_pos of its sin/cos columns: at least 2 x head_dim
        max_position_embeddings=max(seq, hidden),
    )
    model = t.FlaxLlamaForCausalLM(config, dtype=dtype, _do_init=False)
    ids = jnp.zeros((1, seq), jnp.int32)
    params = _params(lambda: model.module.init(jax.random.key(0), ids, ids, ids), abstract)

    def loss_fn(p, b):
        x = b["x"]
        pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        logits = model.module.apply({"params": p}, x, jnp.ones_like(x), pos)[0]
        return _token_loss(logits, b["y"])

    return params, loss_fn


def _relative_position_bucket(
    relative_position, bidirectional=True, num_buckets=32, max_distance=128
):
    """FlaxT5Attention's own bucketing with ``jnp.clip(x, max=)``: transformers 4.57 calls
    ``jnp.clip(x, a_max=)``, which jax 0.10 no longer accepts."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0) * num_buckets
        relative_position = jnp.abs(relative_position)
    else:
        relative_position = -jnp.clip(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (
        jnp.log(relative_position / max_exact)
        / jnp.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    )
    large = jnp.clip(large, max=num_buckets - 1)
    buckets += jnp.where(is_small, relative_position, large)
    return buckets.astype("i4")


def hf_t5(layers=2, d_model=32, d_ff=48, vocab=64, seq=8, dtype=jnp.float32, abstract=False):
    """(params, loss_fn) of FlaxT5ForConditionalGeneration: an encoder and a decoder, blocks
    ``encoder/block/0`` ... and ``decoder/block/0`` ...; the shared embedding outside both."""
    t = _transformers()
    from transformers.models.t5 import modeling_flax_t5

    attention = modeling_flax_t5.FlaxT5Attention
    attention._relative_position_bucket = staticmethod(_relative_position_bucket)
    config = t.T5Config(
        vocab_size=vocab,
        d_model=d_model,
        d_kv=d_model // 2,
        d_ff=d_ff,
        num_layers=layers,
        num_heads=2,
        dropout_rate=0.0,
    )
    model = t.FlaxT5ForConditionalGeneration(config, dtype=dtype, _do_init=False)
    ids = jnp.zeros((1, seq), jnp.int32)
    init = lambda: model.module.init(jax.random.key(0), ids, ids, ids, ids)
    params = _params(init, abstract)

    def loss_fn(p, b):
        x = b["x"]
        ones = jnp.ones_like(x)
        logits = model.module.apply({"params": p}, x, ones, b["y"], ones, deterministic=True)[0]
        return _token_loss(logits, b["y"])

    return params, loss_fn


def token_batches(vocab, seq, steps=2, batch=24, seed=0):
    """``steps`` batches of random token ids ``{"x", "y"}``, ``[batch, seq]`` each."""
    rng = np.random.default_rng(seed)
    tokens = lambda: rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    return [{"x": tokens(), "y": tokens()} for _ in range(steps)]
