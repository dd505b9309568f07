"""Checks shared by the offload tests (no jaxzero logic here): the stage-3 bf16 ZeRO of the
deviceless H100 compiles, and a run with the params in host memory against the same run with
them on the device."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tolerance

import jaxzero as jz
from jaxzero import gpu


def h100_stage3(n: int, **kw) -> jz.ZeRO:
    """``jz.ZeRO`` for ``n`` compile-only H100s: Adam, stage 3 per layer, bf16, plus ``kw``."""
    mesh = gpu.compile_only_mesh("h100", n)
    return jz.ZeRO(optax.adam(1e-3), mesh, stage=3, precision="bf16", layers="layers", **kw)


def gathered(tree):
    """``tree`` gathered to host numpy arrays."""
    return jax.tree.map(np.asarray, jz.gather(tree))


def assert_host_params_run_equals_device_run(host, losses, device, device_losses) -> None:
    """The run with the params offloaded (``host``) holds them, the master and the optimizer
    state in pinned host memory, the other run (``device``) its params on the device, and
    both have the same losses, params, master and optimizer state."""
    kinds = lambda t: {x.sharding.memory_kind for x in jax.tree.leaves(t)}
    assert kinds((host.params, host.master, host.opt_state)) == {"pinned_host"}
    assert kinds(device.params) == {"device"}
    # the same sums on host and device: a few ulps, under tests/tolerance.py's 16-ulp floor
    np.testing.assert_allclose(losses, device_losses, rtol=1e-6)
    for part in ("params", "master", "opt_state"):
        chex.assert_trees_all_close(
            gathered(getattr(host, part)), gathered(getattr(device, part)), rtol=1e-6, atol=1e-8
        )


def assert_master_is_bf16_optax(run, tx, problem, moved: float) -> None:
    """``run(tx).master`` (a ``TrainState`` after ``problem``'s batches) is single-device
    optax's fp32 master on the whole batch, within the spread of that reference rerun in other
    summation orders with its loss on the bf16 cast (``tolerance.reference_cast``), and the
    reference moved the params more than ``moved`` times that tolerance."""
    params, loss_fn, batches = problem
    ref, _, atol = tolerance.reference_cast(tx, params, loss_fn, batches, jnp.bfloat16)
    assert tolerance.max_distance(ref, params) > moved * atol
    chex.assert_trees_all_close(gathered(run(tx).master), ref, atol=atol, rtol=0)
