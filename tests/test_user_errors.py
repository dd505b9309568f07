"""Mistakes a new user makes, each refused (or warned about) with the problem and the fix,
before any state is built or touched: ``layers=`` naming what is
not a layer stack, simulated devices asked for after jax started, and the errors that used to
come from deep inside jax or Orbax (a donated state, a state of another mesh, a torch batch,
one step's directory as the checkpoint, a step saved twice, a directory of other files)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tolerance
from conftest import require

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero.gpu.models import make_problem


# ---------------------------------------------------------------- item 2: layers= is checked
def nnx_list_params():
    """The params of an NNX model whose layers are an ``nnx.List`` of blocks (per-layer
    subtrees, not a stack): leaves of leading sizes 4, 2, 128, 64."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.Linear(4, 2, rngs=rngs)
            self.mlp = nnx.Linear(128, 64, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Block(rngs) for _ in range(2)])

    return jz.flax_nnx.split(Model(nnx.Rngs(0)))[1]


@pytest.mark.parametrize("stage", [3, 2, 0])
def test_layers_naming_a_list_of_layers_is_refused_where_params_are_first_seen(stage):
    params = nnx_list_params()
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=stage, layers="layers")
    step = jz.make_train_step(lambda p, b: 0.0, zero)
    found = r"'layers' is not a layer stack.*leading sizes of its leaves differ"
    loop = r"ZeRO\(stage=3, units=r'layers/\\d\+'\)" if stage == 3 else f"stage {stage} without"
    fix = rf"look like a list of layers.*nn\.scan.*use {loop}"
    for first_seen in (zero.init, step.init, zero.abstract_state):
        with pytest.raises(ValueError, match=f"{found}.*{fix}") as err:
            first_seen(params)
        for leaf in ("attn/kernel: 4", "attn/bias: 2", "mlp/kernel: 128", "mlp/bias: 64"):
            assert f"layers/0/{leaf}" in str(err.value)
    if stage == 3:  # the units= it suggests is one this model takes
        jz.ZeRO(optax.sgd(0.1), zero.mesh, stage=3, units=r"layers/\d+").init(params)


def test_nested_layer_names_name_a_stack_and_unknown_ones_list_nested_paths():
    inner, loss_fn, batches = make_problem("scanned", gather_layer=jz.gather_layer, steps=1)
    params = {"Transformer": inner, "bias": jnp.zeros((3,))}
    nested_loss = lambda p, b: loss_fn(p["Transformer"], b) + p["bias"].sum()
    mesh = jz.data_parallel_mesh(8)
    with pytest.raises(
        ValueError, match=r"no subtree named 'Transformer/layer'.*Transformer/layers"
    ):
        jz.ZeRO(optax.sgd(0.1), mesh, stage=3, layers="Transformer/layer").init(params)
    # The nested name runs the per-layer stage 3 step: one SGD step equals single-device optax.
    zero = jz.ZeRO(optax.sgd(0.1), mesh, stage=3, layers="Transformer/layers")
    step = jz.make_train_step(nested_loss, zero)
    state, _ = step(step.init(params), batches[0])
    want, _, atol = tolerance.reference(optax.sgd(0.1), params, nested_loss, batches[:1])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol),
        jax.device_get(jz.gather(state)),
        jax.device_get(want),
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_layers_without_gather_layer_warns_that_it_changes_nothing(stage):
    """At stages 1-2 only gather_layer reduces a layer in the backward. (Stage 0 needs none:
    autodiff all-reduces each layer where it is used, see test_layers.py.)"""
    params, loss_fn, batches = make_problem("scanned", steps=1)  # no gather_layer in the model
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=stage, layers="layers")
    step = jz.make_train_step(loss_fn, zero)
    with pytest.warns(UserWarning, match=r"never did, so the whole gradient is reduced after"):
        step.lower(step.init(params), batches[0])  # traced, not compiled


NO_EFFECT = {  # a step whose layers= reduces no layer in the backward -> why, in the warning
    "micro-batches": (dict(stage=1), 2, r"with micro-batches \(accum_steps=2\) stage 1"),
    "16-bit params": (
        dict(stage=2, precision=jz.Precision(param_dtype=jnp.bfloat16)),
        1,
        r"reduces in float32 but computes in bfloat16",
    ),
    "replica axes": (dict(stage=2, replicas=2), 1, r"replica axes \('replica',\) stage 2"),
}


@pytest.mark.parametrize("case", NO_EFFECT)
def test_layers_that_cannot_reduce_per_layer_warn_when_the_step_is_built(case):
    kwargs, accum_steps, why = NO_EFFECT[case]
    mesh = jz.data_parallel_mesh(8, replicas=kwargs.pop("replicas", 1))
    zero = jz.ZeRO(optax.sgd(0.1), mesh, layers="layers", **kwargs)
    with pytest.warns(UserWarning, match=rf"reduces no layer's gradient in the backward.*{why}"):
        jz.make_train_step(lambda p, b: 0.0, zero, accum_steps=accum_steps)
    # The same ZeRO where the layers are reduced in the backward builds without the warning.
    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=2, layers="layers")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        jz.make_train_step(lambda p, b: 0.0, zero)
    assert not [w for w in seen if "reduces no layer" in str(w.message)]


# ------------------------------------------------ item 3: simulated devices after jax started
SIMULATE_LATE = """
import os, warnings
import jax
import jaxzero as jz

jax.devices()  # the backend starts with one CPU device
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    jz.data_parallel_mesh()
    jz.data_parallel_mesh()
print("WARNINGS", sum("nothing is sharded" in str(w.message) for w in seen))
try:
    jz.simulate_cpu_devices(8)
except RuntimeError as e:
    print("RAISED", e)
print("XLA_FLAGS", os.environ.get("XLA_FLAGS"))
"""


def test_simulated_devices_after_jax_started_raise_and_one_device_warns_once():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SIMULATE_LATE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "WARNINGS 1" in out.stdout, out.stdout
    assert "RAISED simulate_cpu_devices(8) was called after jax started" in out.stdout, out.stdout
    assert "with 1 device;" in out.stdout and "before the first jax call" in out.stdout
    assert "XLA_FLAGS None" in out.stdout  # refused before anything was changed


SIMULATE_ONE = """
import warnings
import jaxzero as jz

jz.simulate_cpu_devices(1)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    jz.data_parallel_mesh()
print("WARNING", *[str(w.message) for w in seen if "nothing is sharded" in str(w.message)])
"""


def test_one_simulated_device_asked_for_is_not_told_to_simulate_devices():
    """simulate_cpu_devices(1), then a mesh of all devices: the warning says the one device is
    what the process asked for, not to call simulate_cpu_devices before jax starts."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SIMULATE_ONE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("WARNING ")]
    assert "as this process asked" in line and "simulate_cpu_devices(1)" in line, line
    assert "before the first jax call" not in line, line


# --------------------------------------------------------------- item 6: raw errors made clear
@pytest.fixture(scope="module")
def trained():
    """A stage-1 state with an EMA, one step trained, and the state the step donated."""
    params, loss_fn, batches = make_problem("wide_mlp", steps=1)
    zero = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(8), stage=1)
    ema = jz.ShardedEMA(0.9)
    step = jz.make_train_step(loss_fn, zero, ema=ema)
    donated = step.init(params)
    state, _ = step(donated, batches[0])
    return dict(params=params, zero=zero, ema=ema, step=step, state=state, donated=donated)


def test_a_donated_state_is_named_where_it_is_read(trained, tmp_path):
    fix = r"donated to a train step .* use the state the step returned"
    with pytest.raises(ValueError, match=fix):
        ck.save(tmp_path / "ckpt", 1, trained["donated"], zero=trained["zero"])
    assert not (tmp_path / "ckpt").exists()  # refused before the directory was made
    with pytest.raises(ValueError, match=fix):
        jz.ema_params(trained["donated"])
    with pytest.raises(ValueError, match=fix):
        jz.gather(trained["donated"])
    # The state the step returned is what the message says to use.
    assert jax.tree.structure(jz.ema_params(trained["state"])) == jax.tree.structure(
        trained["params"]
    )


def test_ema_params_without_an_ema_points_at_make_train_step(trained):
    with pytest.raises(ValueError, match=r"make_train_step\(\.\.\., ema=") as err:
        jz.ema_params(trained["state"].replace(ema=None))
    assert "zero.init(" not in str(err.value)


def test_a_state_of_another_mesh_names_both_meshes_and_how_to_move(trained):
    params, loss_fn, batches = make_problem("wide_mlp", steps=1)
    zero4 = jz.ZeRO(optax.adam(1e-2), jz.data_parallel_mesh(4), stage=1)
    step4 = jz.make_train_step(loss_fn, zero4, ema=trained["ema"])
    with pytest.raises(
        ValueError,
        match=r"placed on mesh \{'data': 8\}.*runs on mesh \{'data': 4\}.*checkpoint\.restore",
    ):
        step4(trained["state"], batches[0])
    assert not any(x.is_deleted() for x in jax.tree.leaves(trained["state"]))


class Tensor:
    """Stands in for ``torch.Tensor`` (told apart by its type's module, as jaxzero does)."""

    __module__ = "torch"
    shape = (32, 16)


def test_a_torch_batch_says_convert_with_numpy(trained):
    batch = {"x": Tensor(), "y": np.zeros((32, 8), np.float32)}
    with pytest.raises(TypeError, match=r"\['x'\] are torch tensors.*\.numpy\(\)"):
        trained["step"](trained["state"], batch)


@pytest.mark.interop
def test_a_real_torch_batch_says_convert_with_numpy(trained):
    torch = require("torch", "torch")
    batch = {"x": torch.zeros((32, 16)), "y": torch.zeros((32, 8))}
    with pytest.raises(TypeError, match=r"\['x'\], \['y'\] are torch tensors.*\.numpy\(\)"):
        trained["step"](trained["state"], batch)


@pytest.fixture
def saved(trained, tmp_path):
    """A checkpoint directory holding step 3 of the trained state."""
    root = tmp_path / "ckpt"
    assert ck.save(root, 3, trained["state"], zero=trained["zero"]) is True
    return root


def test_one_steps_directory_as_the_checkpoint_suggests_its_parent(trained, saved):
    with pytest.raises(FileNotFoundError, match=r"pass that directory and the step.*step=3\)"):
        ck.restore(saved / "3", trained["zero"], trained["params"], ema=trained["ema"])


def test_a_step_that_exists_or_is_older_is_refused_not_skipped(trained, saved):
    state, zero = trained["state"], trained["zero"]
    with pytest.raises(ValueError, match=r"step 3 already exists.*a new step number"):
        ck.save(saved, 3, state, zero=zero)
    with pytest.raises(ValueError, match=r"step 2 is older than the newest step 3"):
        ck.save(saved, 2, state, zero=zero)
    assert sorted(p.name for p in saved.iterdir() if p.name.isdigit()) == ["3"]


def test_a_directory_of_other_files_is_refused_and_left_as_it_was(trained, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"holds files that are not checkpoint steps \(notes"):
        ck.save(other, 1, trained["state"], zero=trained["zero"])
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_wait_given_a_directory_asks_for_the_manager(saved):
    with pytest.raises(TypeError, match=r"wait needs the CheckpointManager that saves"):
        ck.wait(str(saved))


def test_restoring_with_another_ema_decay_warns_naming_both(trained, tmp_path):
    root = tmp_path / "ckpt"
    assert ck.save(root, 3, trained["state"], zero=trained["zero"], ema=trained["ema"])
    with pytest.warns(UserWarning, match=r"decay: saved 0\.9, now 0\.99"):
        ck.restore(root, trained["zero"], trained["params"], ema=jz.ShardedEMA(0.99))
    with warnings.catch_warnings(record=True) as seen:  # the EMA it was saved with: silent
        warnings.simplefilter("always")
        ck.restore(root, trained["zero"], trained["params"], ema=trained["ema"])
    assert not [w for w in seen if "EMA settings" in str(w.message)]


def test_hpz_size_that_does_not_divide_the_devices_says_so_and_lists_the_sizes():
    with pytest.raises(ValueError) as got:
        jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=3, hpz_partition_size=3)
    message = str(got.value)
    assert "N=8 devices, which G=3 does not divide" in message
    assert "one of 2, 4" in message
    assert "at stage 3 without layers= nothing is gathered again" in message
    assert "but at without" not in message


@pytest.mark.parametrize(
    "returned,described",
    [
        (lambda loss, state: loss, r"it returned an array of shape \(\)"),
        (lambda loss, state: (loss, state), r"it returned \(array \(\), dict\)"),
    ],
)
def test_a_stateful_loss_of_the_wrong_structure_names_the_expected_one(returned, described):
    params, loss_fn, batches = make_problem("mlp", batch=8, steps=1)

    def stateful(p, model_state, batch, rng):
        return returned(loss_fn(p, batch), model_state)

    zero = jz.ZeRO(optax.sgd(0.1), jz.data_parallel_mesh(8), stage=1)
    step = jz.make_train_step(stateful, zero, stateful=True)
    state = step.init(params, model_state={"count": jnp.zeros(())}, rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"must return \(loss, \(new_model_state, aux\)\)") as e:
        step(state, batches[0])
    assert re.search(described, str(e.value)), str(e.value)
    assert "Tracer" not in str(e.value)
