"""XLA:GPU's Triton gemm emitter finds no tiling for some small dots ("Couldn't find output tile
sizes that satisfy hlo: %dot = f32[68,64]"): jax 0.10.2's XLA fails so on a ViT's attention
output projection at batch 32 and 128 (64 compiles), and on a GPT of 4 x 5 tokens per device.
``compile_report`` and ``jaxzero plan`` then compile again without Triton gemms, say so, and
keep the figures. jax 0.12's XLA compiles both steps as they are (measured), and the report
then compiles once.

Deviceless compiles for 8 H100s, as tests/test_gpu.py (jax's CUDA plugin, no GPU).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding

import jaxzero as jz
from jaxzero import cli, gpu

# The XLA of jax < 0.11 cannot tile these dots with Triton; newer ones can (see the docstring).
TILING_BUG = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)
TILING_ERROR = "Couldn't find output tile sizes"
TRITON_GEMM_OFF = {"xla_gpu_enable_triton_gemm": False}  # XLA's option: cuBLAS for the gemms


class EncoderBlock(nn.Module):
    """google-research/vision_transformer models_vit.py's Encoder1DBlock, without dropout."""

    mlp_dim: int
    heads: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y)
        y = nn.LayerNorm()(x)
        y = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.mlp_dim)(y)))
        return x + y


class TinyViT(nn.Module):
    """Patch embedding (a strided conv), a class token, learned positions, one encoder block,
    a head on the class token: 8 x 8 images in 4 x 4 patches, 5 tokens, width 16."""

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(16, (4, 4), strides=(4, 4), padding="VALID", name="embedding")(images)
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, (n, 1, 1)), x], axis=1)
        x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], c))
        x = nn.LayerNorm()(EncoderBlock(32, 2, name="encoderblock_0")(x))
        return nn.Dense(10, name="head")(x[:, 0])


def vit_step(batch):
    """The stage-0 Adam step of TinyViT on 8 compile-only H100s, its params' and the global
    batch's shapes."""
    model = TinyViT()
    images = jax.ShapeDtypeStruct((batch, 8, 8, 3), jnp.float32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3))))
    params = params["params"]

    def loss(p, b):
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    zero = jz.ZeRO(optax.adam(1e-3), gpu.compile_only_mesh("h100", 8), stage=0)
    step = jz.make_train_step(loss, zero)
    return step, params, {"x": images, "y": jax.ShapeDtypeStruct((batch,), jnp.int32)}


def memory_of(compiled) -> tuple[int, int, int, int]:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
    )


def test_vit_report_retries_without_triton_gemms_and_keeps_the_figures():
    step, params, batch = vit_step(32)  # 4 images x 5 tokens per device: a f32[20,16] dot
    zero = step.zero
    sharded = NamedSharding(zero.mesh, zero.batch_spec())
    abstract_batch = jax.tree.map(lambda x: x.update(sharding=sharded), batch)
    lowered = step.jitted.lower(zero.abstract_state(params), abstract_batch)
    if TILING_BUG:
        with pytest.raises(Exception, match=TILING_ERROR):
            lowered.compile()
        expected = memory_of(lowered.compile(dict(TRITON_GEMM_OFF)))
    else:
        expected = memory_of(lowered.compile())
    rep = gpu.compile_report(step, params, batch)
    got = (rep.argument_bytes, rep.output_bytes, rep.alias_bytes, rep.temp_bytes)
    assert got == expected
    assert rep.peak_bytes > 0 and rep.fits and rep.kernels_per_step > 0
    assert rep.payload("all-reduce") > 0  # stage 0 reduces the gradient
    if TILING_BUG:
        assert rep.triton_gemm_fallback.startswith(TILING_ERROR)
        assert "f32[20,16]" in rep.triton_gemm_fallback
        assert ("xla_gpu_enable_triton_gemm", "False") in rep.compiler_options
        assert rep.verdict().endswith("to spare (without Triton gemms)")
    else:
        assert rep.triton_gemm_fallback is None and rep.compiler_options == ()
        assert rep.verdict().endswith("to spare")


class FakeLowered:
    """A lowered step whose compile fails with ``errors`` in turn, then compiles."""

    def __init__(self, *errors):
        self.errors, self.options = list(errors), []

    def compile(self, options=None):
        self.options.append(options)
        if self.errors:
            raise self.errors.pop(0)
        return "compiled"


def test_only_the_tiling_error_is_retried_and_only_once():
    from jaxzero.gpu.report import _compile

    tiling = RuntimeError(
        f"INTERNAL: {TILING_ERROR} that satisfy hlo: %dot.7 = f32[68,64]{{1,0}} dot("
    )
    fake = FakeLowered(tiling)
    assert _compile(fake, {"a": 1}) == (
        "compiled",
        {"a": 1, "xla_gpu_enable_triton_gemm": False},
        f"{TILING_ERROR} that satisfy hlo: %dot.7 = f32[68,64]{{1,0}}",
    )
    assert fake.options == [{"a": 1}, {"a": 1, "xla_gpu_enable_triton_gemm": False}]
    for fake in (
        FakeLowered(RuntimeError("RESOURCE_EXHAUSTED: out of memory")),  # another error
        FakeLowered(tiling, tiling),  # fails without Triton gemms too
    ):
        with pytest.raises(RuntimeError):
            _compile(fake, {})
    fake = FakeLowered(tiling)  # the caller turned Triton gemms off already: nothing to retry
    with pytest.raises(RuntimeError, match=TILING_ERROR):
        _compile(fake, dict(TRITON_GEMM_OFF))
    assert len(fake.options) == 1


def test_plan_cli_says_which_stages_compiled_without_triton_gemms(capsys):
    """A GPT of 4 x 5 tokens per device, fp32: the attention output projection is a f32[20,16]
    dot per device. The wide table's verdict names the fallback; both tables print the note."""
    argv = "plan --model gpt --layers 1 --hidden 16 --heads 2 --vocab 128 --seq 5 --batch 4"
    argv += " --precision fp32 --devices 8 --stage 0 --wide"
    assert cli.main(argv.split()) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("0 "))
    note = [line for line in out.splitlines() if line.startswith("without Triton gemms")]
    if TILING_BUG:
        assert "to spare (without Triton gemms)" in row
        assert len(note) == 1 and "f32[20,16]" in note[0]
        assert note[0].startswith(
            "without Triton gemms (stage 0): XLA:GPU's Triton gemm emitter failed (Couldn't "
            "find output tile sizes that satisfy hlo: %dot"
        )
        assert note[0].endswith(
            "so the step was compiled again with xla_gpu_enable_triton_gemm=False (gemms by "
            "cuBLAS); the figures are that compile's."
        )
    else:
        assert "Triton" not in out
