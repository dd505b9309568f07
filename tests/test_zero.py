"""Every stage x chain x N x accum reproduces plain single-device optax."""

import itertools

import chex
import pytest
from models import chains, make_problem, reference_run

import jaxzero as jz

CHAINS = list(chains())
STAGES = [0, 1, 2, 3]
NS = [1, 2, 8]
ACCUMS = [1, 4]


def run_zero(problem, chain, stage, n, accum):
    params, loss_fn, batches = make_problem(problem)
    tx = chains()[chain]
    zero = jz.ZeRO(tx, jz.data_parallel_mesh(n), stage=stage)
    step = jz.make_train_step(loss_fn, zero, accum_steps=accum)
    state = step.init(params)
    for b in batches:
        state, metrics = step(state, b)
    ref_params, _ = reference_run(tx, params, loss_fn, batches)
    return state, ref_params, metrics


def covering_cases():
    """Every chain meets every stage on both models; N and accum rotate so that every value
    of each appears with every chain."""
    cases = []
    for i, (chain, stage) in enumerate(itertools.product(CHAINS, STAGES)):
        problem = ["mlp", "transformer"][(i + i // 4) % 2]
        cases.append((problem, chain, stage, NS[i % 3], ACCUMS[(i // 3) % 2]))
    return cases


@pytest.mark.parametrize("problem,chain,stage,n,accum", covering_cases())
def test_matches_single_device_optax(problem, chain, stage, n, accum):
    state, ref, metrics = run_zero(problem, chain, stage, n, accum)
    chex.assert_trees_all_close(jz.gather(state), ref, atol=1e-5, rtol=1e-5)
    assert int(metrics["step"]) == 10


@pytest.mark.slow
@pytest.mark.parametrize(
    "problem,chain,stage,n,accum",
    [
        c
        for c in itertools.product(["mlp", "transformer"], CHAINS, STAGES, NS, ACCUMS)
        if c not in covering_cases()
    ],
)
def test_matches_single_device_optax_full_product(problem, chain, stage, n, accum):
    state, ref, _ = run_zero(problem, chain, stage, n, accum)
    chex.assert_trees_all_close(jz.gather(state), ref, atol=1e-5, rtol=1e-5)


def test_covering_subset_covers_every_value():
    cases = covering_cases()
    for chain in CHAINS:
        mine = [c for c in cases if c[1] == chain]
        assert {c[2] for c in mine} == set(STAGES)
        assert {c[3] for c in mine} == set(NS)
        assert {c[4] for c in mine} == set(ACCUMS)
        assert {c[0] for c in mine} == {"mlp", "transformer"}
