"""The ``jaxzero`` command line on a machine without a GPU, in the environment ``make test``
builds (jax's CUDA plugin installed): no CUDA plugin traceback on stderr, readable checkpoint
metadata, ``--devices N`` simulated on the CPU, and ``--params-from`` writing the Flax params
structure of the target model.

The commands run as child processes with the environment a user has: this process's
``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS`` (tests/conftest.py) are removed for them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import missing, require

import jaxzero as jz
from jaxzero import cli
from jaxzero.xla_flags import cuda_plugin_installed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What jax logs when its CUDA plugin fails to initialise without a driver.
NOISE = ("Traceback", "cuInit", "CUDA", "plugin configuration error")


def user_env() -> dict:
    """This process's environment less what tests/conftest.py sets for jax."""
    return {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}


def run_cli(*argv, timeout=300):
    """``jaxzero ARGV`` (the installed console script) in a child process, from the repo."""
    script = os.path.join(os.path.dirname(sys.executable), "jaxzero")
    cmd = [script] if os.path.isfile(script) else [sys.executable, "-m", "jaxzero.cli"]
    return subprocess.run(
        [*cmd, *map(str, argv)],
        capture_output=True,
        text=True,
        env=user_env(),
        cwd=REPO,
        timeout=timeout,
    )


def assert_quiet(out, what):
    assert out.returncode == 0, f"{what}: exit {out.returncode}\n{out.stderr}"
    noisy = [line for line in out.stderr.splitlines() if any(n in line for n in NOISE)]
    assert not noisy, f"{what} printed on stderr:\n{out.stderr}"


def test_help_estimate_and_inspect_print_no_cuda_traceback(tmp_path):
    """With the CUDA plugin installed and no GPU, each command's stderr has no traceback."""
    assert cuda_plugin_installed(), "make test installs jax's CUDA plugin (the gpu-compile extra)"
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2)
    jz.checkpoint.save(str(tmp_path), 1, zero.init(params), zero=zero, wait=True)
    runs = {
        "--help": run_cli("--help"),
        "estimate": run_cli("estimate", "--params", "7e9", "--devices", "64"),
        "inspect": run_cli("inspect", tmp_path),
    }
    for what, out in runs.items():
        print(f"$ jaxzero {what}: exit {out.returncode}, stderr {out.stderr!r}")
    for what, out in runs.items():
        assert_quiet(out, what)
    assert "usage: jaxzero" in runs["--help"].stdout
    assert "7.00B params, 64 devices" in runs["estimate"].stdout
    assert "ZeRO stage: 2" in runs["inspect"].stdout
    assert "params.w" in runs["inspect"].stdout


def ds_case(fixtures_dir, name="z2_mlp_b_ws2_fp32"):
    d = os.path.join(fixtures_dir, "E_deepspeed", name)
    if not os.path.isfile(os.path.join(d, "trajectory.npz")):
        missing(f"fixture case E_deepspeed/{name}", d)
    return d


@pytest.mark.interop
def test_inspect_prints_deepspeed_metadata_readably(fixtures_dir, tmp_path, capsys):
    """A converted DeepSpeed checkpoint's metadata (groups, name map, ds_config) is shown one
    key a line, long lists cut to their first items and a count, never as one long line."""
    require("torch", "torch")
    d = ds_case(fixtures_dir)
    out = tmp_path / "jz"
    argv = ["convert", "deepspeed2jax", os.path.join(d, "ckpt"), "--out", out, "--devices", "4"]
    assert cli.main(list(map(str, argv))) == 0
    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    longest = max(text.splitlines(), key=len)
    assert len(longest) <= 120, f"a line of {len(longest)} characters: {longest[:200]}..."
    for line in (
        "  user metadata:",
        "    deepspeed:",
        "        ds_config:",
        "          train_batch_size: 12",
        "      param_groups: (2 items)",
        "        - names: ['fc1.weight', 'fc2.weight', 'fc3.weight']",
        "          weight_decay: 0.1",
        "      name_map: (8 items)",
        "        - ['fc1.weight', 'fc1.weight', 'identity']",
        "        - ... (4 more)",
    ):
        assert line in text.splitlines(), f"{line!r} not in:\n{text}"


def master_at_step3(d) -> dict:
    """DeepSpeed's own fp32 master after its 3 steps (trajectory.npz, torch layout)."""
    with np.load(os.path.join(d, "trajectory.npz")) as t:
        return {k.split("/", 2)[2]: t[k] for k in t.files if k.startswith("params/3/")}


def torch_mlp_b(p, x, in_scale):
    """tests/ds_worker.py's MlpB forward, written out in numpy on torch-layout weights."""
    gelu = lambda v: np.asarray(jax.nn.gelu(v, approximate=False))
    h = (x * in_scale) @ p["fc1.weight"].T + p["fc1.bias"]
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = gelu((h - mu) / np.sqrt(var + 1e-5) * p["ln.weight"] + p["ln.bias"])
    h = gelu(h @ p["fc2.weight"].T + p["fc2.bias"])
    return h @ p["fc3.weight"].T + p["fc3.bias"]


@pytest.mark.interop
def test_convert_simulates_devices_and_writes_the_flax_structure(fixtures_dir, tmp_path):
    """``convert deepspeed2jax --devices 8 --params-from tests.flax_targets:mlp_b_params`` on a
    CPU machine runs on 8 simulated devices, quietly, and writes the Flax params of
    tests/flax_targets.MlpB: restored into that structure, they are DeepSpeed's master
    (transposed kernels, LayerNorm scale) and the Flax model computes the torch model's
    logits."""
    require("torch", "torch")
    from flax_targets import MlpB, mlp_b_params

    from jaxzero.interop.deepspeed import adamw, read_checkpoint

    d = ds_case(fixtures_dir)
    out = tmp_path / "jz"
    spec = "tests.flax_targets:mlp_b_params"
    conv = run_cli(
        *("convert", "deepspeed2jax", os.path.join(d, "ckpt"), "--out", out),
        *("--stage", "2", "--devices", "8", "--params-from", spec),
    )
    assert_quiet(conv, "convert")
    assert "jaxzero stage 2 on 8 devices" in conv.stdout
    assert "fc1.weight" in conv.stdout and "fc1/kernel" in conv.stdout

    template = mlp_b_params()
    zero = jz.ZeRO(
        adamw(read_checkpoint(os.path.join(d, "ckpt")), template), jz.data_parallel_mesh(8), stage=2
    )
    scale = {"in_scale": jax.ShapeDtypeStruct((32,), jnp.float32)}
    state = jz.checkpoint.restore(str(out), zero, template, model_state=scale)
    params = jax.device_get(state.params)
    want = master_at_step3(d)
    got = {
        "fc1.weight": params["fc1"]["kernel"].T,
        "fc1.bias": params["fc1"]["bias"],
        "ln.weight": params["ln"]["scale"],
        "ln.bias": params["ln"]["bias"],
        "fc2.weight": params["fc2"]["kernel"].T,
        "fc2.bias": params["fc2"]["bias"],
        "fc3.weight": params["fc3"]["kernel"].T,
        "fc3.bias": params["fc3"]["bias"],
    }
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    x = np.random.default_rng(0).normal(size=(6, 32)).astype(np.float32)
    in_scale = np.asarray(state.model_state["in_scale"])
    # the fixture's float32 rounding of its linspace: under 2 ulps of 1.5
    np.testing.assert_allclose(in_scale, np.linspace(0.5, 1.5, 32), rtol=0, atol=2e-7)
    logits = MlpB().apply({"params": state.params}, x, in_scale)
    # the torch model's float32 forward written in numpy: another matmul kernel's rounding
    np.testing.assert_allclose(logits, torch_mlp_b(want, x, in_scale), rtol=1e-5, atol=1e-5)


@pytest.mark.interop
@pytest.mark.parametrize(
    "spec, message",
    [
        ("flax_targets", "is not MODULE:FUNCTION"),
        ("no_such_module_here:f", "cannot import 'no_such_module_here'"),
        ("flax_targets:nope", "flax_targets has no 'nope'"),
        ("flax_targets:__doc__", "is a str"),
        ("flax_targets:mlp_b_variables", "returned Flax variables"),
        ("flax_targets:jnp", "is a module"),
    ],
)
def test_params_from_bad_input_is_one_line_naming_the_flag(fixtures_dir, spec, message, capsys):
    require("torch", "torch")
    d = ds_case(fixtures_dir)
    argv = ["convert", "deepspeed2jax", os.path.join(d, "ckpt"), "--dry-run", "--params-from", spec]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert f"--params-from {spec!r}" in err and message in err, err


@pytest.mark.interop
def test_params_from_names_what_does_not_match(fixtures_dir, tmp_path, capsys):
    """A structure that is not the checkpoint's model is refused, naming the torch params and
    the leaves left unpaired; ``--name-map`` entries override single names."""
    require("torch", "torch")
    d = ds_case(fixtures_dir, "z2_mlp_a_ws2_fp32")  # a 17 -> 31 -> 5 MLP, not MlpB
    argv = ["convert", "deepspeed2jax", os.path.join(d, "ckpt"), "--dry-run"]
    with pytest.raises(SystemExit):
        cli.main([*argv, "--params-from", "flax_targets:mlp_b_params"])
    err = capsys.readouterr().err
    assert "torch params with no leaf: fc1.weight (31, 17)" in err
    assert "leaves no torch param maps to: fc1/bias, fc1/kernel" in err
    assert "--name-map" in err
    d = ds_case(fixtures_dir)
    swap = tmp_path / "swap.json"  # fc2 and fc3's kernels have different shapes: refused
    swap.write_text(json.dumps({"fc2.weight": "fc3/kernel"}))
    with pytest.raises(SystemExit):
        cli.main(
            ["convert", "deepspeed2jax", os.path.join(d, "ckpt"), "--dry-run"]
            + ["--params-from", "flax_targets:mlp_b_params", "--name-map", str(swap)]
        )
    assert (
        "'fc2.weight' (64, 64) -> fc3/kernel (64, 10): shapes do not fit" in capsys.readouterr().err
    )
