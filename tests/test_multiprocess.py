"""Multi-process training: 2 processes x 4 simulated CPU devices on localhost.

The expected numbers come from a 1 process x 8 devices run in this (pytest) process; the
workers (tests/mp_worker.py, started by jaxzero.cli.launch) write what they trained with
``np.savez``. Tests that start jax processes are marked ``multiprocess``; the launcher and
single-process API checks below them are quick and unmarked.
"""

import functools
import io
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero import distributed as dist
from jaxzero.cli import launch as launch_cli
from jaxzero.distributed import launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "mp_worker.py")
STEPS, SAVE_AT, DIE_AT = 10, 5, 7
HEARTBEAT = 10  # seconds without heartbeat before jax declares a process dead
RUN_TIMEOUT = 150  # the launcher's bound on one 2-process run
TOL = 1e-6

sys.path.insert(0, HERE)
import mp_worker  # noqa: E402


def env():
    e = dict(os.environ)
    e["JAX_PLATFORMS"] = "cpu"
    e.pop("JAX_NUM_CPU_DEVICES", None)
    for k in list(e):
        if k.startswith("JAXZERO_"):
            del e[k]
    return e


def host(state):
    """Flat numpy params / EMA / optimizer state of a TrainState (keys as the worker's)."""
    out = {
        **mp_worker.flat("params", dist.gather_to_host(state.params)),
        **mp_worker.flat("ema", dist.gather_to_host(state.ema)),
    }
    out["opt"] = [np.asarray(x) for x in jax.tree.leaves(dist.gather_to_host(state.opt_state))]
    return out


@functools.cache
def reference():
    """The uninterrupted 1 process x 8 devices run: host copies at SAVE_AT and at the end."""
    params, batches, zero, ema, step = mp_worker.build(8)
    state = step.init(params)
    snaps = {}
    for i, batch in enumerate(batches, 1):
        state, _ = step(state, batch)
        if i in (SAVE_AT, STEPS):
            snaps[i] = host(state)
    return snaps


def load(out_dir):
    p0, p1 = (dict(np.load(os.path.join(out_dir, f"p{i}.npz"))) for i in range(2))
    assert sorted(p0) == sorted(p1)
    for k in p0:  # the same replicated arrays, read in both processes
        np.testing.assert_array_equal(p0[k], p1[k], err_msg=k)
    return p0


def assert_matches(got, want, tol=TOL):
    keys = [k for k in want if k != "opt"]
    assert keys and all(k in got for k in keys), (sorted(want), sorted(got))
    for k in keys:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=tol, err_msg=k)
    if "opt" in got and "opt" in want:
        for a, b in zip(got["opt"], want["opt"], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=tol)


def check_worker_output(got):
    assert int(got["step"]) == STEPS and int(got["ema_updates"]) == STEPS
    assert int(got["sharded_leaves"]) >= 3  # fc1 kernel/bias, fc2 kernel: split over processes
    assert_matches(got, reference()[STEPS])


# ------------------------------------------------------------------------ multi-process
@pytest.mark.multiprocess
def test_two_processes_equal_one_and_checkpoint_restores_on_one(tmp_path):
    """2 x 4 devices == 1 x 8 (params and EMA), through the launcher CLI; the 2-process
    checkpoint restores on 1 process with 8 and with 4 devices and continues identically."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "jaxzero.cli.launch"]
    cmd += f"--processes 2 --devices-per-process 4 --timeout {RUN_TIMEOUT}".split()
    cmd += [WORKER, "--out", str(out), "--ckpt", str(ckpt), "--save-at", str(SAVE_AT)]
    cmd += ["--check-mismatch"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT + 30
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for i in range(2):
        assert f"[p{i}] process {i}/2: 4 local of 8 devices, distributed=True" in proc.stdout
        assert f"[p{i}] process {i}: step {STEPS} loss" in proc.stdout
    assert "[launch]" in proc.stderr and "all 2 processes exited 0" in proc.stderr
    # process-dependent host params are caught (the 1-d leaves: the biases), named by path
    for i in range(2):
        assert re.search(
            rf"\[p{i}\] process {i}: mismatch detected: params differs between processes at "
            r"\['fc1'\]\['bias'\], \['fc2'\]\['bias'\]:",
            proc.stdout,
        ), proc.stdout[-3000:]

    check_worker_output(load(out))

    assert ck.latest_step(ckpt) == SAVE_AT
    assert ck.load_metadata(ckpt)["process_count"] == 2
    for n in (8, 4):
        params, batches, zero, ema, step = mp_worker.build(n)
        state = ck.restore(ckpt, zero, params, ema=ema)
        assert int(state.step) == SAVE_AT
        assert_matches(host(state), reference()[SAVE_AT])
        for batch in batches[SAVE_AT:]:
            state, _ = step(state, batch)
        assert_matches(host(state), reference()[STEPS])


@pytest.mark.multiprocess
def test_dead_process_stops_the_others_then_restart_resumes(tmp_path):
    """Process 1 is SIGKILLed in step 7: process 0, blocked in the step's collectives, is
    stopped by jax's heartbeat check (not by the launcher, which is told to wait 60 s) within
    a bounded time; restarting both from the step-5 checkpoint reproduces the full run."""
    ckpt = tmp_path / "ckpt"
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    rc = launch.launch(
        [WORKER, "--out", str(tmp_path / "dead"), "--ckpt", str(ckpt)]
        + f"--save-at {SAVE_AT} --die-at {DIE_AT}".split(),
        processes=2,
        devices_per_process=4,
        heartbeat_timeout=HEARTBEAT,
        grace=60,
        timeout=RUN_TIMEOUT,
        env=env(),
        stdout=out,
        stderr=err,
    )
    elapsed = time.monotonic() - t0
    log = out.getvalue() + err.getvalue()
    assert rc == 128 + signal.SIGKILL, log[-4000:]
    assert f"[p1] process 1: dying in step {DIE_AT}" in out.getvalue()
    died = re.search(r"\[launch\] \+([\d.]+)s process 1 was killed by SIGKILL", log)
    stopped = re.search(r"\[launch\] \+([\d.]+)s process 0 (.*) on its own", log)
    assert died and stopped, log[-4000:]
    assert float(stopped.group(1)) - float(died.group(1)) < HEARTBEAT + 30, log[-4000:]
    p0_err = "\n".join(line for line in err.getvalue().splitlines() if line.startswith("[p0]"))
    # jax's heartbeat check ("tasks are unhealthy (stopped sending heartbeats)... another task
    # died"), or gloo noticing the closed connection first: either way an error that says why.
    clues = ("stopped sending heartbeats", "another task died", "Connection closed", "gloo")
    assert any(c in p0_err for c in clues), p0_err[-4000:]
    assert elapsed < RUN_TIMEOUT
    assert ck.latest_step(ckpt) == SAVE_AT
    assert not (tmp_path / "dead" / "p0.npz").exists()

    out, err = io.StringIO(), io.StringIO()
    rc = launch.launch(
        [WORKER, "--out", str(tmp_path / "restart"), "--ckpt", str(ckpt), "--resume"],
        processes=2,
        devices_per_process=4,
        heartbeat_timeout=HEARTBEAT,
        timeout=RUN_TIMEOUT,
        env=env(),
        stdout=out,
        stderr=err,
    )
    assert rc == 0, (out.getvalue() + err.getvalue())[-4000:]
    assert f"[p0] process 0: resumed at step {SAVE_AT}" in out.getvalue()
    check_worker_output(load(tmp_path / "restart"))


# ------------------------------------------------------------------------ launcher (no jax)
def _launch_code(code, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    rc = launch.launch(["-c", code], env=env(), stdout=out, stderr=err, **kwargs)
    return rc, out.getvalue(), err.getvalue(), time.monotonic() - t0


def test_launch_sets_the_environment_and_prefixes_output():
    code = (
        "import os, sys\n"
        "for k in ('JAXZERO_COORDINATOR', 'JAXZERO_NUM_PROCESSES', 'JAXZERO_PROCESS_ID',"
        " 'JAXZERO_LOCAL_DEVICE_IDS', 'JAXZERO_HEARTBEAT_TIMEOUT', 'XLA_FLAGS'):\n"
        "    print(k + '=' + os.environ.get(k, '<unset>'))\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    rc, out, err, _ = _launch_code(code, processes=2, devices_per_process=4, heartbeat_timeout=7)
    assert rc == 0, out + err
    lines = out.splitlines()
    coords = {line.split("=", 1)[1] for line in lines if "JAXZERO_COORDINATOR=" in line}
    assert len(coords) == 1 and re.fullmatch(r"127\.0\.0\.1:\d+", coords.pop())
    for i, ids in ((0, "0,1,2,3"), (1, "4,5,6,7")):
        assert f"[p{i}] JAXZERO_PROCESS_ID={i}" in lines
        assert f"[p{i}] JAXZERO_NUM_PROCESSES=2" in lines
        assert f"[p{i}] JAXZERO_LOCAL_DEVICE_IDS={ids}" in lines
        assert f"[p{i}] JAXZERO_HEARTBEAT_TIMEOUT=7" in lines
        flags = next(x for x in lines if x.startswith(f"[p{i}] XLA_FLAGS="))
        # the parent's (conftest's) device count is replaced, not duplicated
        assert re.findall(r"--xla_force_host_platform_device_count=\d+", flags) == [
            "--xla_force_host_platform_device_count=4"
        ]
        assert f"[p{i}] to stderr" in err.splitlines()


def test_launch_stops_the_others_when_one_fails():
    code = (
        "import os, sys, time\n"
        "i = int(os.environ['JAXZERO_PROCESS_ID'])\n"
        "print('hello from', i, flush=True)\n"
        "sys.exit(3) if i == 1 else time.sleep(120)\n"
    )
    rc, out, err, elapsed = _launch_code(code, processes=3)
    assert rc == 3, out + err
    assert elapsed < 30
    assert "[p1] hello from 1" in out
    assert re.search(r"process 1 exited with code 3; stopping the other 2 process\(es\)", err)
    assert re.search(r"terminating process\(es\) \[0, 2\]", err)


def test_launch_timeout():
    rc, out, err, elapsed = _launch_code("import time; time.sleep(120)", processes=2, timeout=1)
    assert rc == 124, out + err
    assert elapsed < 30
    assert "timeout after 1 s" in err


def test_launch_command_line():
    a = launch_cli.parse_args(
        "--processes 2 --devices-per-process 4 --timeout 60 train.py --lr 1e-3 -m x".split()
    )
    assert (a.processes, a.devices_per_process, a.timeout, a.module) == (2, 4, 60.0, False)
    assert (a.script, a.args) == ("train.py", ["--lr", "1e-3", "-m", "x"])
    a = launch_cli.parse_args(["-n", "2", "-m", "pkg.train", "--steps", "3"])
    assert (a.module, a.script, a.args) == (True, "pkg.train", ["--steps", "3"])
    with pytest.raises(ValueError, match="processes"):
        launch.launch(["x.py"], processes=0)


# ------------------------------------------------------------------------ API, one process
def test_initialize_is_a_no_op_without_a_cluster(monkeypatch):
    for k in list(os.environ):
        if k.startswith("JAXZERO_"):
            monkeypatch.delenv(k)
    if dist.cluster_detected() or jax.distributed.is_initialized():
        pytest.skip("running inside a detected cluster environment")
    assert dist.initialize() is False


def test_initialize_refuses_an_incomplete_launch_environment(monkeypatch):
    if jax.distributed.is_initialized():
        pytest.skip("jax.distributed already initialised")
    monkeypatch.setenv("JAXZERO_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.delenv("JAXZERO_NUM_PROCESSES", raising=False)
    monkeypatch.delenv("JAXZERO_PROCESS_ID", raising=False)
    with pytest.raises(ValueError, match="JAXZERO_NUM_PROCESSES, JAXZERO_PROCESS_ID"):
        dist.initialize()
    monkeypatch.setenv("JAXZERO_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAXZERO_NUM_PROCESSES='two'"):
        dist.initialize()


def test_global_batch_and_gather_to_host_on_one_process():
    params, batches, zero, ema, step = mp_worker.build(8)
    assert dist.process_batch_slice(zero, 32) == slice(0, 32)
    with pytest.raises(ValueError, match="not divisible by the mesh's 8 devices"):
        dist.process_batch_slice(zero, 12)
    gb = dist.global_batch(batches[0], zero)
    want = jax.sharding.NamedSharding(zero.mesh, zero.batch_spec())
    for k in ("x", "y"):
        assert gb[k].sharding == want
        np.testing.assert_array_equal(np.asarray(gb[k]), batches[0][k])
    assert dist.global_batch(gb, zero)["x"] is gb["x"]
    with pytest.raises(ValueError, match="disagree"):
        dist.global_batch({"x": batches[0]["x"], "y": batches[0]["y"][:8]}, zero)
    with pytest.raises(ValueError, match="6 rows, not divisible by its 8 devices"):
        dist.global_batch(jax.tree.map(lambda x: x[:6], batches[0]), zero)
    dist.check_same_on_all_processes(params)  # a no-op on one process
    state = step.init(params)  # the EMA's 32-wide leaves are sharded over the 8 devices
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.ema.ema))
    got = dist.gather_to_host(state.ema)
    want = jax.tree.map(np.asarray, jz.gather(state.ema))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert isinstance(a, np.ndarray)
        np.testing.assert_array_equal(a, b)
