"""The NVMe tier's spelling: ``jz.ZeRO(tx, mesh, offload=jz.NVMe(path))`` and
``jz.make_train_step`` (decision 50), as DeepSpeed's ``offload_optimizer: {device: nvme}``
is one setting of the ZeRO config. The config stores it as ``offload="optimizer"`` beside the
disk settings; what the tier does not run is refused before any state exists, with the fix.

Expected numbers come from the host offload's step (``offload="optimizer"``), itself checked
against plain optax, and from plain optax on one device.
"""

from __future__ import annotations

import dataclasses
import os

import chex
import jax
import numpy as np
import pytest
import tolerance
from test_nvme_step import TX, _problem

import jaxzero as jz
from jaxzero.train.nvme_step import NVMeTrainStep

N = 8


def _zero(tmp_path, **kw):
    return jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload=jz.NVMe(tmp_path), **kw)


def test_offload_nvme_is_stored_as_the_optimizer_offload_with_its_disk(tmp_path):
    """``offload=jz.NVMe(path)`` is ``offload="optimizer"`` and ``nvme=NVMe(path)``, and
    ``dataclasses.replace`` round-trips it: two spellings, one config."""
    zero = _zero(tmp_path)
    assert zero.offload == "optimizer" and zero.nvme == jz.NVMe(tmp_path)
    assert dataclasses.replace(zero) == zero and hash(dataclasses.replace(zero)) == hash(zero)
    other = jz.ZeRO(
        TX, jz.data_parallel_mesh(N), stage=2, offload="optimizer", nvme=jz.NVMe(tmp_path)
    )
    assert other == zero
    assert dataclasses.replace(zero, nvme=None).nvme is None


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"offload": ("optimizer", "params")}, "nvme=.* keeps the optimizer state on disk"),
        ({"offload": None}, "nvme=.* keeps the optimizer state on disk"),
        ({"offload": ("optimizer", "remainder")}, "nvme=.* keeps the optimizer state on disk"),
        ({"offload_fraction": 0.5}, "offload_fraction 1"),
    ],
    ids=["params", "none", "remainder", "fraction"],
)
def test_what_the_disk_tier_does_not_hold_is_refused(tmp_path, kw, match):
    disk = jz.NVMe(tmp_path)
    offload = kw.pop("offload", disk)
    nvme = None if offload is disk else disk
    with pytest.raises(ValueError, match=match):
        jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload=offload, nvme=nvme, **kw)
    with pytest.raises(ValueError, match="name two NVMe settings"):
        jz.ZeRO(TX, jz.data_parallel_mesh(N), offload=disk, nvme=jz.NVMe(tmp_path / "x"))
    with pytest.raises(TypeError, match="must be a jaxzero.NVMe"):
        jz.ZeRO(TX, jz.data_parallel_mesh(N), offload="optimizer", nvme=str(tmp_path))


def test_zero_init_refuses_to_hold_the_disk_state_in_memory(tmp_path):
    params, _, _ = _problem(1)
    with pytest.raises(ValueError, match=r"make_train_step\(loss_fn, zero\).init\(params\)"):
        _zero(tmp_path).init(params)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "option",
    [
        {"stateful": True},
        {"rng": True},
        {"donate": False},
        {"allow_loss_collectives": True},
    ],
    ids=lambda o: next(iter(o)),
)
def test_options_the_disk_step_does_not_take_are_refused_before_any_file(tmp_path, option):
    _, loss_fn, _ = _problem(1)
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"does not take {name}="):
        jz.make_train_step(loss_fn, _zero(tmp_path), **option)
    assert os.listdir(tmp_path) == []


@pytest.mark.bitwise  # the host offload's and the NVMe tier's programs, bit for bit
def test_make_train_step_trains_with_the_state_on_disk_as_the_host_offload(tmp_path):
    """Three clip + AdamW steps at stage 2 through ``jz.make_train_step``: the NVMe tier's
    step, its state's file under the directory, and the params, master and optax state of the
    host offload's run (bit for bit under the suite's XLA flags: decision 50), and of plain
    optax on one device within tests/tolerance.py's rule."""
    params, loss_fn, batches = _problem(3)
    step = jz.make_train_step(loss_fn, _zero(tmp_path))
    assert isinstance(step, NVMeTrainStep)
    state = step.init(params)
    assert os.listdir(tmp_path)  # the state's file
    host = jz.make_train_step(
        loss_fn, jz.ZeRO(TX, jz.data_parallel_mesh(N), stage=2, offload="optimizer")
    )
    want = host.init(params)
    for b in batches:
        state, _ = step(state, b)
        want, _ = host(want, b)
    opt_state, master = state.optimizer_state()
    got = {"params": np.asarray(jz.gather(state.params)["w1"]), "opt_state": opt_state}
    ref = {
        "params": np.asarray(jz.gather(want.params)["w1"]),
        "opt_state": jax.tree.map(np.asarray, jz.gather(want.opt_state)),
    }
    chex.assert_trees_all_equal(got, ref)
    assert master is None  # fp32: the params are the master
    plain, _, atol = tolerance.reference(TX, params, loss_fn, batches)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, jz.gather(state.params)), plain, atol=atol)
    state.close()
