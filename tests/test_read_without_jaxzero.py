"""The way out: a jaxzero checkpoint step, and an export, read in a process that never imports
jaxzero, with the orbax-only readers docs/guide/checkpoints.md shows; the arrays equal the saved
ones, and a run read into the user's own Flax ``TrainState`` goes on there with plain optax as
it goes on under jaxzero."""

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
import plain_flax
import tolerance

import jaxzero as jz
from jaxzero import checkpoint as ck

TESTS = Path(__file__).parent
GUIDE = TESTS.parent / "docs" / "guide" / "checkpoints.md"
K = 3  # jaxzero steps before the checkpoint, and steps after it


def _reader_source(name: str = "restore_without_jaxzero") -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    found = [b for b in blocks if f"def {name}(" in b]
    assert len(found) == 1, f"docs/guide/checkpoints.md no longer shows {name}"
    return found[0]


def _run_without_jaxzero(script: str, cwd) -> str:
    """Run ``script`` in a fresh one-device process that must never import jaxzero (the tests
    directory on its path for plain_flax); its stdout."""
    script = (
        f"import sys\nsys.path.insert(0, {os.fspath(TESTS)!r})\n"
        + script
        + '\nassert "jaxzero" not in sys.modules, "the reader imported jaxzero"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env={**env, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


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
        print("read", len(saved.files), "arrays")
        """
    )
    assert "read 6 arrays" in _run_without_jaxzero(script, tmp_path)


# The child: the user's own TrainState from their own tx.init, the jaxzero step read into it
# with the guide's reader, compared leaf by leaf (by path) with jaxzero's gathered state, then
# trained on with plain optax.
CHILD = """
import chex
import jax
import numpy as np
import plain_flax
from flax.training import train_state


def goes_on(chain, ckpt, want, out):
    model, params = plain_flax.model_and_params()
    tx = plain_flax.chain(chain)
    ts = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    ts = restore_into_train_state(ckpt, {k}, ts)
    ema = read_jaxzero_step(ckpt, {k}, {{"ema": {{"ema": params}}}})["ema"]["ema"]
    got = {{"params": ts.params, "opt_state": ts.opt_state, "step": ts.step, "ema": ema}}
    want = np.load(want)
    assert sorted(plain_flax.by_path(got)) == sorted(want.files), want.files
    expected = jax.tree_util.tree_map_with_path(lambda k, _: want[jax.tree_util.keystr(k)], got)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, expected)
    chex.assert_trees_all_equal(got, expected)
    assert type(ts.opt_state) is type(tx.init(params)) and len(jax.devices()) == 1
    loss = plain_flax.loss_fn(model)
    step = jax.jit(lambda ts, b: ts.apply_gradients(grads=jax.grad(loss)(ts.params, b)))
    for b in plain_flax.batches({n})[{k}:]:
        ts = step(ts, b)
    np.savez(out, **plain_flax.by_path({{"params": ts.params, "opt_state": ts.opt_state, "step": ts.step}}))
    print(chain, "restored", len(want.files), "arrays")
"""

# optax.MultiSteps (its fields out of alphabetical order) continued in fp32, where plain optax
# goes on as jaxzero does; clipping and AdamW with a bf16 master, read into fp32 params
CASES = {"multisteps": "fp32", "clip_adamw": "bf16"}


def test_a_jaxzero_run_goes_on_in_a_flax_train_state(tmp_path):
    model, params = plain_flax.model_and_params()
    loss = plain_flax.loss_fn(model)
    batches = plain_flax.batches(2 * K)
    weights = lambda s: s.params if s.master is None else s.master
    view = lambda s: {
        "params": jz.gather(weights(s)),
        "opt_state": jz.gather(s.opt_state),
        "step": s.step,
    }
    child, runs = _reader_source("restore_into_train_state") + CHILD.format(k=K, n=2 * K), {}
    for chain, precision in CASES.items():
        zero = jz.ZeRO(
            plain_flax.chain(chain), jz.data_parallel_mesh(8), stage=3, precision=precision
        )
        step = jz.make_train_step(loss, zero, ema=jz.ShardedEMA(0.9))
        state = step.init(params)
        for b in batches[:K]:
            state, _ = step(state, b)
        # sharded 1/8 in memory (every leaf divides by 8); orbax stores each whole
        assert not any(x.is_fully_replicated for x in jax.tree.leaves(state.opt_state) if x.ndim)
        assert (state.master is not None) == (precision == "bf16")
        ck.save(tmp_path / chain, K, state, zero=zero)
        want = plain_flax.by_path(
            jax.device_get({**view(state), "ema": jz.ema_params(state, jnp.float32)})
        )
        np.savez(tmp_path / f"{chain}.npz", **want)
        child += f"\ngoes_on({chain!r}, {os.fspath(tmp_path / chain)!r}, "
        child += f"{os.fspath(tmp_path / f'{chain}.npz')!r}, {os.fspath(tmp_path / f'{chain}_flax.npz')!r})"
        runs[chain] = step, state, len(want)
    printed = _run_without_jaxzero(child, tmp_path)
    for chain, (_, _, count) in runs.items():
        assert f"{chain} restored {count} arrays" in printed
    # jaxzero's own continuation of the fp32 run against the child's plain optax one
    step, state, _ = runs["multisteps"]
    for b in batches[K:]:
        state, _ = step(state, b)
    ours = plain_flax.by_path(jax.device_get(view(state)))
    flax_run = np.load(tmp_path / "multisteps_flax.npz")
    assert sorted(flax_run.files) == sorted(ours)
    _, _, atol = tolerance.reference(plain_flax.chain("multisteps"), params, loss, batches)
    for k, v in ours.items():
        np.testing.assert_allclose(flax_run[k], v, rtol=0, atol=atol, err_msg=k)
    moved = plain_flax.by_path({"params": params})
    assert max(np.abs(ours[k] - moved[k]).max() for k in moved) > 1000 * atol
