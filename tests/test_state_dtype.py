"""``jz.with_state_dtype(tx, jnp.bfloat16)``: Adam's moments stored in bfloat16, the math in
float32 (Megatron's ``--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16``).

The expected numbers come from Adam's formula written out here: each step widens the stored
moments, updates them in float32, takes the step from the float32 moments and rounds the moments
to bfloat16 for the next step. The wide MLP (16 -> 32 -> 8, every leaf split 8 ways) holds, per
device, 64 + 4 + 32 + 1 = 101 elements of each moment: 404 bytes each in float32, 202 in
bfloat16.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
import tolerance
from compile_memo import H100, reuse_gpu_compiles

import jaxzero as jz
from jaxzero.gpu.models import make_problem

N = 8
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-6


def _adam_bf16_moments():
    """Adam by its formula with the moments kept in bfloat16 between steps."""

    def init(params):
        zeros = lambda x: jnp.zeros(x.shape, jnp.bfloat16)
        return (jnp.zeros((), jnp.int32), jax.tree.map(zeros, params), jax.tree.map(zeros, params))

    def update(grads, state, params=None):
        count, mu, nu = state
        t = count + 1
        mu32 = jax.tree.map(lambda m, g: B1 * m.astype(jnp.float32) + (1 - B1) * g, mu, grads)
        nu32 = jax.tree.map(lambda v, g: B2 * v.astype(jnp.float32) + (1 - B2) * g * g, nu, grads)
        c1, c2 = 1 - B1**t, 1 - B2**t
        step = jax.tree.map(lambda m, v: -LR * (m / c1) / (jnp.sqrt(v / c2) + EPS), mu32, nu32)
        bf16 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)
        return step, (t, bf16(mu32), bf16(nu32))

    return optax.GradientTransformation(init, update)


@pytest.fixture(scope="module")
def problem():
    params, loss_fn, batches = make_problem("wide_mlp", steps=3)
    return (
        params,
        loss_fn,
        batches,
        tolerance.reference(_adam_bf16_moments(), params, loss_fn, batches),
    )


def _local_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "stage,offload", [(0, None), (1, None), (2, None), (3, None), (2, "optimizer")]
)
def test_bf16_moments_follow_adams_formula_at_every_stage(problem, stage, offload):
    params, loss_fn, batches, (ref, (_, ref_mu, ref_nu), atol) = problem
    tx = jz.with_state_dtype(optax.adam(LR, eps=EPS), jnp.bfloat16)
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(N), stage=stage, offload=offload)
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    for b in batches:
        state, _ = step(state, b)
    chex.assert_trees_all_close(jz.gather(state.params), ref, atol=atol, rtol=0)
    adam = state.opt_state[0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert adam.count.dtype == jnp.int32 and int(adam.count) == len(batches)
    # the moments within one bfloat16 rounding of the formula's (a sum's last bit can move a
    # moment across a rounding boundary): 2**-8 of the largest moment
    for got, want in ((adam.mu, ref_mu), (adam.nu, ref_nu)):
        got, want = jax.device_get(got), jax.device_get(want)
        scale = max(float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in jax.tree.leaves(want))
        chex.assert_trees_all_close(
            jax.tree.map(lambda x: x.astype(jnp.float32), got),
            jax.tree.map(lambda x: x.astype(jnp.float32), want),
            atol=scale * 2.0**-8,
            rtol=0,
        )
    if stage >= 1:  # the moments sharded: half the float32 bytes per device
        assert _local_bytes(adam.mu) == 202 and _local_bytes(adam.nu) == 202
    if offload:
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves((adam.mu, adam.nu))}
        assert kinds == {"pinned_host"}


def test_the_plan_counts_the_stored_bytes(problem):
    params = problem[0]
    mesh = jz.data_parallel_mesh(N)
    wide = jz.ZeRO(optax.adam(LR), mesh, stage=2, offload="optimizer").plan(params)
    narrow = jz.ZeRO(
        jz.with_state_dtype(optax.adam(LR), jnp.bfloat16), mesh, stage=2, offload="optimizer"
    ).plan(params)
    # Adam's count (4 bytes, an "other" row) stays int32; mu + nu: 808 -> 404 per device
    assert wide.totals()["opt_state"] == 2 * 404 + 4
    assert narrow.totals()["opt_state"] == 2 * 202 + 4
    assert narrow.memory_totals()["pinned_host"] == 2 * 202 + 4


def test_scalars_and_narrower_leaves_keep_their_dtype():
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(())}
    inner = optax.inject_hyperparams(optax.adam, static_args=("mu_dtype",))(
        learning_rate=3e-4, mu_dtype=jnp.float16
    )
    state = jz.with_state_dtype(inner, jnp.bfloat16).init(params)
    hyper = state.hyperparams["learning_rate"]
    assert hyper.dtype == jnp.float32 and float(hyper) == pytest.approx(3e-4, rel=1e-7)
    adam = state.inner_state[0]
    assert adam.mu["w"].dtype == jnp.float16  # kept as the optimizer asked
    assert adam.nu["w"].dtype == jnp.bfloat16
    assert adam.nu["b"].dtype == jnp.float32  # a scalar leaf stays float32


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="float32 is not supported"):
        jz.with_state_dtype(optax.adam(LR), jnp.float32)
    with pytest.raises(TypeError, match="GradientTransformation"):
        jz.with_state_dtype(lambda g: g, jnp.bfloat16)


PLAN = ["plan", "--devices", "8", "--layers", "2", "--hidden", "256", "--heads", "2"]
PLAN += ["--vocab", "512", "--seq", "16", "--stage", "3", "--stage3", "per-layer"]
PLAN += ["--offload", "optimizer", "--wide"]


def test_plan_state_dtype_compiles_the_narrow_state_and_says_how_to_build_it(capsys, monkeypatch):
    """``jaxzero plan --state-dtype bf16`` (deviceless H100s, a 2-layer decoder, stage 3 per
    layer, the optimizer offloaded): the compiled step holds the fp32 master and two bf16
    moments in host memory, 8 bytes per parameter where fp32 Adam holds 12, moves that much
    each way over PCIe, and the paste line wraps the optimizer. The fp32 row's compile is
    tests/test_gpu_offload.py's, test_remainder_plan.py's and test_cli_plan_output.py's
    plan too: one process compiles it once."""
    from jaxzero import cli
    from jaxzero.memory import parse_bytes

    reuse_gpu_compiles(monkeypatch, H100)

    def row(argv):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        header = next(line for line in out.splitlines() if line.startswith("stage"))
        line = next(line for line in out.splitlines() if line.startswith("3 per layer"))
        names = [h.strip() for h in header.split("  ") if h.strip()]
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        table = dict(zip(names, cells, strict=False))
        # a PCIe cell: "2.95 MB (12.0 B/param)", the bytes before the bytes per parameter
        bytes_of = lambda cell: parse_bytes(cell.split(" (")[0].replace(" ", ""))
        return out, {k: bytes_of(table[k]) for k in ("host", "PCIe h2d")}

    _, wide = row(PLAN)
    out, narrow = row([*PLAN, "--state-dtype", "bf16"])
    assert narrow["host"] == pytest.approx(wide["host"] * 8 / 12, rel=0.02)
    assert narrow["PCIe h2d"] == pytest.approx(wide["PCIe h2d"] * 8 / 12, rel=0.02)
    assert "Adam with bf16 moments" in out
    assert "tx = jz.with_state_dtype(tx, jnp.bfloat16)" in out
