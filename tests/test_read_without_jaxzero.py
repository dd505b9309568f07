"""The way out (issue 51): a jaxzero checkpoint step, and an export, read in a process that
never imports jaxzero, with the orbax-only reader docs/guide/checkpoints.md shows; the arrays
equal the saved ones."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxzero as jz
from jaxzero import checkpoint as ck

GUIDE = Path(__file__).parents[1] / "docs" / "guide" / "checkpoints.md"


def _reader_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    found = [b for b in blocks if "def restore_without_jaxzero" in b]
    assert len(found) == 1, "docs/guide/checkpoints.md no longer shows restore_without_jaxzero"
    return found[0]


def test_a_jaxzero_step_reads_with_orbax_alone(tmp_path):
    params = {
        "embed": jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) / 100,
        "head": {"w": jnp.linspace(-1, 1, 16 * 8).reshape(16, 8), "b": jnp.ones((8,))},
    }
    # stage 3, bf16 compute params with an fp32 master: every kind of leaf sharded 1/8
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=3, precision="bf16")
    state = zero.init(params)
    state = state.replace(step=jnp.asarray(7, jnp.int32))
    with ck.manager(tmp_path / "ckpt") as mngr:
        ck.save(mngr, 7, state, zero=zero)
    export = ck.export(state, tmp_path / "export", which="master")
    saved = {
        "params": jax.tree.map(np.asarray, jz.gather(state.params)),
        "master": jax.tree.map(np.asarray, jz.gather(state.master)),
    }
    flat = {
        f"{part}/{jax.tree_util.keystr(k)}": v.astype(np.float32)
        for part, tree in saved.items()
        for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }
    np.savez(tmp_path / "saved.npz", **flat)
    script = _reader_source() + textwrap.dedent(
        f"""
        import sys
        import numpy as np

        state = restore_without_jaxzero({os.fspath(tmp_path / "ckpt")!r}, 7)
        with ocp.PyTreeCheckpointer() as ckptr:
            exported = ckptr.restore({export!r})
        saved = np.load({os.fspath(tmp_path / "saved.npz")!r})
        got = {{"params": state["params"], "master": state["master"], "export": exported}}
        for part, tree in got.items():
            for k, v in jax.tree_util.tree_leaves_with_path(tree):
                want = saved[("master" if part == "export" else part) + "/" + jax.tree_util.keystr(k)]
                np.testing.assert_array_equal(np.asarray(v, np.float32), want)
        assert len(jax.devices()) == 1 and int(state["step"]) == 7
        assert state["params"]["embed"].dtype.name == "bfloat16"
        assert "jaxzero" not in sys.modules, "the reader imported jaxzero"
        print("read", len(saved.files), "arrays")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "read 6 arrays" in out.stdout
