"""``units=`` with prefetch gathers each unit larger than XLA's default all-gather combine
threshold (30 MiB) in one flat all-gather (FSDP2's copy-in,
:func:`jaxzero.zero.units.chain.gather_flat`), so a plain single-process script, which runs
with XLA's default flags, hides the gathers as the recommended flags do
(docs/decisions/39-flags-for-a-plain-script.md): that threshold would otherwise split each
100 MB unit of a width-2048 GPT into several gathers. Smaller units keep one gather per leaf,
which XLA combines itself."""

from __future__ import annotations

import chex
import jax
import optax
import pytest
import tolerance

import jaxzero as jz
import jaxzero.zero.units.chain as unit_chain
from jaxzero import gpu
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, make_problem, model_shape


def test_flat_unit_gathers_train_like_single_device_optax(monkeypatch):
    """The flat gather only moves and copies values: a few Adam steps on the 8 simulated
    devices equal plain single-device optax on the global batch (every unit gathered flat:
    the threshold set to 0; it is 30 MiB, larger than this model)."""
    monkeypatch.setattr(unit_chain, "COMBINED", 0)
    calls = []
    real = unit_chain.gather_flat
    monkeypatch.setattr(unit_chain, "gather_flat", lambda *a: calls.append(1) or real(*a))
    params, loss_fn, batches = make_problem("transformer", batch=16, steps=3)
    tx = optax.adam(1e-2)
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(8), stage=3, units=r"layer\d+")
    step = jz.make_train_step(loss_fn, zero)
    state = step.init(params)
    for batch in batches:
        state, _ = step(state, batch)
    ref, _, atol = tolerance.reference(tx, params, loss_fn, batches)
    chex.assert_trees_all_close(jz.gather(state.params), ref, atol=atol, rtol=1e-5)
    assert calls  # the flat gather ran


# jax >= 0.11's XLA schedules the same program differently (docs/decisions/39): there the flat
# gather under XLA's defaults hides what one gather per leaf hides under the recommended flags
# (0.66 of the 16 x 2048 GPT's bytes at N = 64 on jax 0.12), not its data flow's ceiling.
NEWER_XLA = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def test_gpu_units_gather_once_per_unit_and_hide_it_with_xlas_default_flags(monkeypatch):
    """XLA:GPU for 64 H100s (deviceless), XLA's default flags (no compiler options: what a
    plain `python train.py` compiles with), a Python loop of 4 nn.remat'd GPT blocks of width
    2048 (each block's bf16 weights 12 x 2048^2 x 2 bytes = 100 MB, over the 30 MiB default
    threshold), bf16 in FSDP's layout: one all-gather per unit gathering (4 in the forward,
    3 again for the backward, the last unit's kept) plus the forward's and the backward's
    gather of the leaves outside the units: 9 launches (one a leaf, it was 30), and the
    schedule hides the share its data flow allows (0.51 of a ceiling of 0.88 one a leaf)."""
    shape = model_shape(
        layers=4, hidden=2048, heads=16, vocab=1024, seq=512, arch="gpt", loop="python"
    )
    mesh = gpu.compile_only_mesh("h100", 64)
    precision = jz.Precision.create("bf16", compute_copy=False)
    zero = jz.ZeRO(optax.adam(1e-4), mesh, stage=3, precision=precision, units=r"block_\d+")
    step = jz.make_train_step(make_loss(shape), zero)
    report = gpu.compile_report(step, abstract_params(shape), batch_shapes(shape, 64))
    launches = sum(c.launches for c in report.collectives if c.kind == "all-gather")
    assert launches == 2 * shape.layers - 1 + 2
    kinds = ("all-gather", "reduce-scatter")
    hidden, ceiling = report.hidden_share(*kinds), report.hideable_share(*kinds)
    if not NEWER_XLA:
        assert hidden >= 0.8 and hidden == pytest.approx(ceiling, abs=0.01), (hidden, ceiling)
        return
    monkeypatch.setattr(unit_chain, "COMBINED", float("inf"))  # one all-gather per leaf
    step = jz.make_train_step(make_loss(shape), zero)  # a new function: traced anew
    per_leaf = gpu.compile_report(
        step, abstract_params(shape), batch_shapes(shape, 64), compiler_options=gpu.xla_options()
    )
    assert hidden >= per_leaf.hidden_share(*kinds) - 0.02, (hidden, per_leaf.hidden_share(*kinds))
