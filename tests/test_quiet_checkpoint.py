"""What a plain user script sees of jaxzero's checkpoint reads on stderr: a routine save and
restore print nothing (also of a step saved without Orbax's step metadata file, whose every
read makes Orbax log a warning), and a damaged step ends the script with the one
CheckpointDamagedError traceback, naming the damaged file, and nothing of asyncio or
tensorstore around it.

Each script runs as a child process with the environment a user has (this process's
``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS`` removed); it damages the file itself and prints its
path, so the expected name does not come from jaxzero.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# jaxzero first: jax's own import prints the CUDA stub's lines when it runs before jaxzero's
# (tests/test_quiet_startup.py, jaxzero/_startup.py).
PRELUDE = """
import glob, os, sys
import jaxzero as jz
import jax, jax.numpy as jnp, optax
from jaxzero import checkpoint as ck

jz.simulate_cpu_devices(2)
directory = sys.argv[1]
keys = jax.random.split(jax.random.key(0), 2)
params = {"w": jax.random.normal(keys[0], (64, 64)), "b": jax.random.normal(keys[1], (64,))}
zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(2), stage=2)
"""

# Two steps saved; step 1 loses Orbax's step metadata file (_CHECKPOINT_METADATA, which
# Orbax reads first at every read of a step); every reading function on both steps.
ROUTINE = (
    PRELUDE
    + """
ck.save(directory, 1, zero.init(params), zero=zero)
mngr = ck.manager(directory)
ck.save(mngr, 2, zero.init(params), zero=zero)
ck.wait(mngr)
os.remove(os.path.join(directory, "1", "_CHECKPOINT_METADATA"))
for step in (1, 2):
    state = ck.restore(directory, zero, params, step=step)
    ck.restore(mngr, zero, params, step=step)
    ck.load_metadata(directory, step)
assert ck.verify(directory).ok and ck.latest_step(directory) == 2
mngr.close()
print("OK", float(jnp.abs(state.params["w"] - params["w"]).max()))
"""
)

# One step saved, its largest data file damaged (HOW), then restored without a try.
DAMAGED = (
    PRELUDE
    + """
ck.save(directory, 1, zero.init(params), zero=zero)
files = glob.glob(os.path.join(directory, "1", "state", "ocdbt.process_*", "d", "*"))
path = max(files, key=os.path.getsize)
print("DAMAGED", os.path.relpath(path, directory), flush=True)
if HOW == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
else:  # the first zstd frame's magic number zeroed: that chunk cannot be decoded
    data = bytearray(open(path, "rb").read())
    at = data.index(b"\\x28\\xb5\\x2f\\xfd")
    data[at : at + 4] = bytes(4)
    open(path, "wb").write(bytes(data))
ck.restore(directory, zero, params)
"""
)


def user_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}


def run_script(code: str, directory):
    return subprocess.run(
        [sys.executable, "-c", code, str(directory)],
        capture_output=True,
        text=True,
        env=user_env(),
        timeout=300,
    )


def test_routine_saves_and_reads_print_nothing_on_stderr(tmp_path):
    out = run_script(ROUTINE, tmp_path / "ckpt")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["OK", "0.0"], out.stdout
    assert out.stderr == "", f"stderr of routine checkpoint calls:\n{out.stderr}"


@pytest.mark.parametrize("how", ["truncate", "undecodable"])
def test_damaged_step_prints_one_error_naming_the_file(tmp_path, how):
    out = run_script(f"HOW = {how!r}\n" + DAMAGED, tmp_path / "ckpt")
    assert out.returncode == 1, out.stdout + out.stderr
    damaged = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("DAMAGED")]
    assert len(damaged) == 1, out.stdout
    lines = out.stderr.splitlines()
    assert sum("Traceback" in line for line in lines) == 1, out.stderr
    assert "asyncio" not in out.stderr and "tensorstore" not in out.stderr, out.stderr
    error = lines[-1]
    assert error.startswith("jaxzero.checkpoint.integrity.CheckpointDamagedError: "), out.stderr
    assert f"is damaged: file {damaged[0]} " in error, error
    why = "is truncated" if how == "truncate" else "could not be read"
    assert why in error, error


LATER = """
import sys, types
seen = []
sys.unraisablehook = lambda u: seen.append(u.object)
from jaxzero.checkpoint import quiet
quiet.collect_leftovers()  # what a failed read calls: Orbax's leftovers dropped from now on
ns = {}
exec(compile("async def read():\\n    pass\\n", "/site-packages/orbax/io.py", "exec"), ns)
exec(compile("async def mine():\\n    pass\\n", "/home/user/train.py", "exec"), ns)
theirs, mine = ns["read"](), ns["mine"]()
for coro in (theirs, mine):
    sys.unraisablehook(types.SimpleNamespace(object=coro, exc_value=Exception("x")))
    coro.close()
class Broken:
    def __del__(self):
        raise ValueError("the user's own")
Broken()
print([getattr(o, "__qualname__", type(o).__name__) for o in seen])
"""


def test_only_orbaxs_leftovers_are_dropped_after_a_failed_read(tmp_path):
    """A leftover of Orbax's restore still running when a failed read is reported is collected
    later (on a loaded machine, at exit); from the first failed read on its report is dropped
    whenever it comes. A coroutine of the user's and a user's ``__del__`` still reach the
    hook that was there before."""
    out = run_script(LATER, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "['mine', 'Broken.__del__']", out.stdout


# A tensorstore read still running when its asyncio loop is closed (what Orbax's restore leaves
# behind when another read fails first): when it completes, tensorstore's done callback calls
# loop.call_soon_threadsafe and reports the RuntimeError as unraisable, with no object. Then a
# user's own call on a closed loop, from a __del__ (a Python frame above call_soon_threadsafe).
CLOSED_LOOP = """
import asyncio, sys
import tensorstore as ts
from jaxzero.checkpoint import quiet
seen = []
if sys.argv[2] == "after":
    quiet.collect_leftovers()
sys.unraisablehook = (lambda previous: lambda u: (seen.append(type(u.exc_value).__name__), previous(u)))(sys.unraisablehook)

def leftover_read():
    promise, future = ts.Promise.new()
    async def read():
        await future
    loop = asyncio.new_event_loop()
    loop.create_task(read())
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()
    promise.set_result(1)  # the read completes after its loop was closed

leftover_read()
closed = asyncio.new_event_loop()
closed.close()
class Mine:
    def __del__(self):
        closed.call_soon_threadsafe(print)
Mine()
print("SEEN", seen)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_read_completing_after_its_loop_closed_is_dropped_after_a_failed_read(tmp_path, when):
    """After a failed read, tensorstore's report of a leftover read that completes on a closed
    loop is dropped; before any failed read it reaches stderr as Python prints it. The user's
    own ``call_soon_threadsafe`` on a closed loop is reported either way."""
    out = subprocess.run(
        [sys.executable, "-c", CLOSED_LOOP, str(tmp_path), when],
        capture_output=True,
        text=True,
        env=user_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "SEEN ['RuntimeError', 'RuntimeError']", out.stdout
    reported = out.stderr.count("RuntimeError: Event loop is closed")
    assert reported == (2 if when == "before" else 1), out.stderr
    assert "Mine.__del__" in out.stderr, out.stderr
