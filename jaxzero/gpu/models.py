"""GPT- and LLaMA-shaped decoders for planning: scanned, rematerialised layers whose variables
pass through :func:`jaxzero.gather_layer`, built abstractly (``jax.eval_shape``) only.

* ``"llama"``: RMSNorm, no biases, SwiGLU MLP of width ``ffn`` (default LLaMA's
  ``256 * ceil(8h/3 / 256)``: 11008 for h=4096), no position parameters (rotary embeddings have
  none; left out, as they change no parameter or communicated byte), untied head.
  Parameters: ``L (4h^2 + 3 h ffn + 2h) + 2 V h + h``.
* ``"gpt"``: LayerNorm, biases, GELU MLP of width ``ffn`` (default 4h), learned positions,
  head tied to the embedding. Parameters: ``L (4h^2 + 2 h ffn + 9h + ffn) + (V + S) h + 2h``.

Attention (``ModelShape.attention``): ``"auto"`` uses cuDNN's fused flash attention when the
compute dtype is 16-bit (what GPU training of such models runs; it never holds the s x s
scores) and XLA's reference attention in fp32 (cuDNN's kernel has no fp32 form); ``"xla"``
always uses XLA's, which materialises the f32 scores, probabilities and causal mask per layer.
These models are for XLA:GPU compiles (the cuDNN call does not compile for CPU).

The layer stack is ``params["layers"]`` (for ``ZeRO(layers="layers")``). ``ModelShape.loop``:
``"prefetch"`` (default) runs it with :func:`jaxzero.scan_layers` (the next layer's all-gather
in flight while this one computes); ``"gather_layer"`` with ``nn.scan`` over an ``nn.remat``'d
block that calls :func:`jaxzero.gather_layer` (each layer gathered where it is used). Both
build the same params.

Unscanned, as most Flax code is written: ``"python"`` is a Python loop of ``nn.remat``'d blocks
named ``block_0`` ... ``block_{L-1}`` (``params["block_3"]`` is one layer's params, no layer
axis; no :func:`jaxzero.gather_layer`), ``"python_noremat"`` the same loop without
``nn.remat``. :func:`nnx_model` is the NNX twin: an ``nnx.List`` of blocks under ``layers``
(``params["layers"][3]``), split by :func:`jaxzero.flax_nnx.split`.
"""

from __future__ import annotations

import dataclasses
import math

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
    "Decoder",
    "ModelShape",
    "abstract_params",
    "batch_shapes",
    "make_loss",
    "model_shape",
    "nnx_model",
]

ARCHS = ("llama", "gpt")
ATTENTION = ("auto", "xla")
LOOPS = ("prefetch", "gather_layer", "python", "python_noremat")
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
            block = nn.remat(
                nn.map_variables(_Block, "params", trans_in_fn=gather_layer, init=True)
            )
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
