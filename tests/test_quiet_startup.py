"""A plain script that imports jaxzero on a machine without a GPU, in the environment `make test`
builds (jax's CUDA plugin installed for the deviceless GPU compiles), prints nothing on stderr:
no CUDA runtime stub lines, no plugin traceback; and the deviceless GPU compile still works in
it.

The script runs as a child process with the environment a user has: this process's
``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS`` (tests/conftest.py) are removed for it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from jaxzero.xla_flags import cuda_plugin_installed, gpu_present

# The script prints the platform, a jitted sum, and whether the deviceless H100 compile of a
# sum over two GPUs has its all-reduce.
SCRIPT = """
import jaxzero
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

print(jax.devices()[0].platform)
print(float(jax.jit(lambda x: (x * 2).sum())(jnp.arange(4.0))))
mesh = jaxzero.gpu.compile_only_mesh("h100", 2)
x = jax.ShapeDtypeStruct((2, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
hlo = jax.jit(lambda x: (x**2).sum()).lower(x).compile().as_text()
print("all-reduce" in hlo)
"""


def user_env() -> dict:
    """This process's environment less what tests/conftest.py sets for jax."""
    return {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}


def run_script(code: str, env: dict):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )


def test_plain_script_on_a_cpu_machine_prints_nothing_on_stderr_and_gpu_compiles_work():
    env = user_env()
    assert cuda_plugin_installed(), "make test installs jax's CUDA plugin (the gpu-compile extra)"
    assert not gpu_present(env), "this check is for a machine without an NVIDIA GPU"
    out = run_script(SCRIPT, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "12.0", "True"], out.stdout
    assert out.stderr == "", f"stderr of a plain CPU run:\n{out.stderr}"


def test_platforms_the_user_names_are_kept():
    """JAX_PLATFORMS set by the user is left as it is: jaxzero's CPU default only applies
    where nothing names the platforms."""
    env = dict(user_env(), JAX_PLATFORMS="cpu")
    code = "import jaxzero, jax; print(jax.config.jax_platforms)"
    out = run_script(code, env)
    assert out.returncode == 0 and out.stdout.strip() == "cpu", out.stderr
    # A platform jax does not know stays asked for: the start fails naming it.
    env = dict(user_env(), JAX_PLATFORMS="nosuchplatform")
    out = run_script("import jaxzero, jax; jax.devices()", env)
    assert out.returncode != 0 and "nosuchplatform" in out.stderr
