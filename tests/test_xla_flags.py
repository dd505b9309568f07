"""jaxzero's recommended XLA GPU flags: what they are, and who applies them when (GPU runs
only, never over the user's own setting or opt-out). Their effect on the compiled GPU step is
pinned in tests/test_gpu.py."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxzero
from jaxzero import _compat, xla_flags
from jaxzero.distributed.launch import launch_base_env

# XLA renamed the two pipelining switches in jax 0.11 (an enum, xla_gpu_pipeline_*); jax 0.10.2
# has only the booleans. Pinned per version: what each end of the supported range must pick.
RENAMED = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
THRESHOLD = "--xla_gpu_all_gather_combine_threshold_bytes=1073741824"
if RENAMED:
    FLAGS = ["--xla_gpu_pipeline_all_gather=on", "--xla_gpu_pipeline_all_reduce=on", THRESHOLD]
    OPTIONS = {
        "xla_gpu_pipeline_all_gather": "COLLECTIVE_PIPELINING_MODE_ON",
        "xla_gpu_pipeline_all_reduce": "COLLECTIVE_PIPELINING_MODE_ON",
    }
else:
    FLAGS = [
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        THRESHOLD,
    ]
    OPTIONS = {
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
    }
OPTIONS["xla_gpu_all_gather_combine_threshold_bytes"] = 1 << 30


def test_recommended_flags_and_their_compile_options():
    assert xla_flags.recommended_xla_flags() == FLAGS
    assert jaxzero.gpu.recommended_xla_flags() == FLAGS
    assert xla_flags.xla_options() == OPTIONS
    # XLA takes them all at once (a CPU compile reads the GPU fields of DebugOptions too).
    f = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((), jnp.float32))
    f.compile(compiler_options=OPTIONS)
    assert xla_flags.xla_options(["--xla_gpu_foo=3", "--xla_gpu_bar=x1"]) == {
        "xla_gpu_foo": 3,
        "xla_gpu_bar": "x1",
    }


def test_flags_this_xla_does_not_know_are_left_out_with_a_warning(monkeypatch):
    """The running XLA decides: a made-up newest spelling falls back to the older real one, and
    a setting with no spelling XLA knows is left out, named in a warning (both routes)."""
    table = (
        (("--xla_gpu_jaxzero_no_such_flag=on", "ON"), (THRESHOLD, 1 << 30)),
        (("--xla_gpu_jaxzero_gone=true", True),),
    )
    monkeypatch.setattr(xla_flags, "_RECOMMENDED", table)
    with pytest.warns(RuntimeWarning, match="knows none of --xla_gpu_jaxzero_gone=true"):
        assert xla_flags.recommended_xla_flags() == [THRESHOLD]
    with pytest.warns(RuntimeWarning, match="knows none of --xla_gpu_jaxzero_gone=true"):
        assert xla_flags.xla_options() == {"xla_gpu_all_gather_combine_threshold_bytes": 1 << 30}
    assert _compat.unknown_xla_flags((THRESHOLD, "--xla_gpu_jaxzero_gone=1")) == {
        "xla_gpu_jaxzero_gone"
    }
    assert not _compat.compile_option_accepted("xla_gpu_jaxzero_gone", True)


def test_user_setting_and_opt_out_win():
    name = FLAGS[0].partition("=")[0]
    env = {"XLA_FLAGS": f"{name}=false --xla_dump_to=/tmp/d"}
    out, applied = xla_flags.with_xla_flags(env, [*FLAGS, "--xla_gpu_foo=1"])
    assert applied == [*FLAGS[1:], "--xla_gpu_foo=1"]
    assert out["XLA_FLAGS"].split() == [*env["XLA_FLAGS"].split(), *FLAGS[1:], "--xla_gpu_foo=1"]
    assert xla_flags.with_xla_flags({**env, "JAXZERO_NO_XLA_FLAGS": "1"}) == (
        env | {"JAXZERO_NO_XLA_FLAGS": "1"},
        [],
    )
    assert xla_flags.with_xla_flags({})[0]["XLA_FLAGS"] == " ".join(FLAGS)


def test_a_cpu_run_never_gets_gpu_flags(monkeypatch, capsys):
    assert not xla_flags.gpu_present({"JAX_PLATFORMS": "cpu"})
    assert not xla_flags.gpu_present({"CUDA_VISIBLE_DEVICES": ""})
    before = os.environ.get("XLA_FLAGS")
    assert xla_flags.apply_xla_flags(gpu=False) == []
    assert launch_base_env({"A": "1"}, True, gpu=False) == ({"A": "1"}, [])
    # This test process runs on CPU: initialize() adds nothing to XLA_FLAGS.
    assert jaxzero.distributed.initialize() is False
    assert os.environ.get("XLA_FLAGS") == before
    assert "XLA GPU flags" not in capsys.readouterr().err


def test_gpu_runs_get_them_from_initialize_and_the_launcher(monkeypatch, capsys):
    monkeypatch.setattr(xla_flags, "gpu_present", lambda environ=None: True)
    monkeypatch.setattr(xla_flags, "backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    assert jaxzero.distributed.initialize() is False  # a single process: flags still applied
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", *FLAGS]
    assert f"applied XLA GPU flags {FLAGS[0]}" in capsys.readouterr().err
    assert xla_flags.apply_xla_flags() == []  # already set: nothing twice
    monkeypatch.setenv("XLA_FLAGS", "")
    assert jaxzero.distributed.initialize(xla_flags=False) is False
    assert os.environ["XLA_FLAGS"] == ""
    env, applied = launch_base_env({"XLA_FLAGS": ""}, True, gpu=True)
    assert applied == FLAGS and env["XLA_FLAGS"] == " ".join(FLAGS)
    assert launch_base_env({}, False, gpu=True) == ({}, [])


@pytest.mark.parametrize("argv,expected", [([], True), (["--no-xla-flags"], False)])
def test_launch_cli_opt_out(argv, expected):
    from jaxzero.cli.launch import parse_args

    assert parse_args(["-n", "2", *argv, "train.py"]).xla_flags is expected


@pytest.mark.parametrize("gpu", [False, True])
def test_simulated_devices_pick_the_cpu_platform_by_the_same_gpu_detection(monkeypatch, gpu):
    """``simulate_cpu_devices`` selects the CPU platform exactly where the flags' detection
    (``gpu_present``) says jax would not start CUDA, and never over ``JAX_PLATFORMS``."""
    from jaxzero import simulate

    chosen = []
    monkeypatch.setattr(simulate, "gpu_present", lambda environ=None: gpu)
    monkeypatch.setattr("jax.config.update", lambda name, value: chosen.append((name, value)))
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    jax.devices()  # the backend runs, with tests/conftest.py's 8 devices: 4 come too late
    late = "called after jax started its CPU backend"
    with pytest.warns(UserWarning, match=late):
        flags = simulate.simulate_cpu_devices(4).split()
    assert "--xla_force_host_platform_device_count=4" in flags
    assert chosen == ([] if gpu else [("jax_platforms", "cpu")])
    chosen.clear()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    with pytest.warns(UserWarning, match=late):
        simulate.simulate_cpu_devices(4)
    assert chosen == []


def test_simulated_devices_turn_the_persistent_compilation_cache_off(tmp_path):
    """On several simulated CPU devices jax's persistent compilation cache is off: a program
    loaded from it can abort or hang (decision 52). ``simulate_cpu_devices`` turns it off and
    says so; a step built on a CPU mesh with it on warns, naming the fix."""
    from jaxzero import simulate

    assert not jax.config.jax_enable_compilation_cache  # tests/conftest.py turned it off
    saved = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_enable_compilation_cache", True)
        mesh = jaxzero.data_parallel_mesh(8)
        zero = jaxzero.ZeRO(optax.sgd(0.1), mesh, stage=1)
        with pytest.warns(
            UserWarning,
            match=r"persistent compilation cache is on \(.*\) for a step on 8 CPU devices.*jax_enable_compilation_cache",
        ):
            jaxzero.make_train_step(lambda p, b: jnp.sum(p["w"] * b), zero)
        with pytest.warns(UserWarning) as told:
            simulate.simulate_cpu_devices(8)
        said = [str(w.message) for w in told]
        assert any(f"turned off jax's persistent compilation cache ({tmp_path})" in m for m in said)
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", False)
        jax.config.update("jax_compilation_cache_dir", saved)


def test_quantized_gradients_add_a_second_collective_in_flight():
    """``quantized_grads=True`` adds the parallel-collective limit of 2 after the recommended
    flags, in both forms; a non-bool, or ``flags`` beside it, is refused."""
    limit = "--xla_gpu_experimental_parallel_collective_overlap_limit=2"
    assert xla_flags.recommended_xla_flags(quantized_grads=True) == [*FLAGS, limit]
    assert xla_flags.xla_options(quantized_grads=True) == {
        **OPTIONS,
        "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
    }
    with pytest.raises(TypeError, match="quantized_grads='yes' must be True or False"):
        xla_flags.recommended_xla_flags(quantized_grads="yes")
    with pytest.raises(ValueError, match="quantized_grads picks among the recommended flags"):
        xla_flags.xla_options([THRESHOLD], quantized_grads=True)
