"""A checkpoint written before the package was split into subpackages (commit 0992101, by
tests/data/make_legacy_checkpoint.py) restores with today's code, bit for bit, onto another
device count and stage. The expected arrays are the numpy dump written next to it by that
older code, not anything computed here."""

import os
import shutil

import jax
import numpy as np
import optax
import pytest

import jaxzero as jz
from jaxzero.gpu.models import make_problem

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.mark.parametrize("n,stage", [(8, 2), (4, 3), (2, 1)])
def test_checkpoint_from_before_the_restructuring_restores_bitwise(tmp_path, n, stage):
    src = os.path.join(DATA, "legacy_ckpt")
    directory = tmp_path / "ckpt"
    shutil.copytree(src, directory)  # restore never writes, but keep the committed copy pristine
    params, _, _ = make_problem("mlp", steps=1, seed=7)
    zero = jz.ZeRO(
        optax.adamw(1e-2, weight_decay=0.1), jz.data_parallel_mesh(n), stage=stage, precision="bf16"
    )
    state = jz.checkpoint.restore(directory, zero, params, ema=jz.ShardedEMA(0.9, tau=3.0))
    want = np.load(os.path.join(DATA, "legacy_ckpt.npz"))
    parts = {
        "params": state.params,
        "master": state.master,
        "opt_state": state.opt_state,
        "ema": state.ema.ema,
    }
    got = {
        jax.tree_util.keystr(p): np.asarray(x, np.float32 if x.dtype.name == "bfloat16" else None)
        for p, x in jax.tree_util.tree_flatten_with_path(jz.gather(parts))[0]
    }
    got["step"] = np.asarray(state.step)
    got["ema_updates"] = np.asarray(state.ema.updates)
    assert sorted(got) == sorted(want.files)
    for k in want.files:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert int(state.step) == 3


def test_a_checkpoint_without_units_or_offload_metadata_inspects_as_before():
    text = jz.checkpoint.inspect(os.path.join(DATA, "legacy_ckpt"))
    assert "ZeRO stage:" in text and "state:" in text
    assert not any(
        line.split(":")[0].strip() in ("units", "offload", "layers") for line in text.splitlines()
    )
