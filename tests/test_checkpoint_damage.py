"""Checkpoints that survive damage: a damaged step is refused with an error naming the step, the
damaged file and the leaf, never loaded silently; ``fallback=True`` takes the newest step that
verifies; ``verify`` reports the damaged steps; a save that fails (file-size limit: EFBIG)
reaches the caller, leaves no step that restore would pick, and the previous step restores
bit for bit. On the demo's model (examples/digits.py's CNN, stage 2, 8 devices, adam + EMA).

Expected numbers are gathered from the uninterrupted training run before each save (or
written by the worker process from its own run), never from the checkpoint code under test.
"""

import glob
import os
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from digits_problem import digits_problem, host

import jaxzero as jz
from jaxzero import checkpoint as ck

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = (1, 2, 3)


def ema():
    return jz.ShardedEMA(0.99)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step run saving every step; ``snaps[i]``: the state at step i, gathered in memory."""
    params, loss_fn, batches = digits_problem(steps=len(STEPS))
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=2)
    step = jz.make_train_step(loss_fn, zero, ema=ema())
    directory = tmp_path_factory.mktemp("pristine") / "ckpt"
    state, snaps = step.init(params), {}
    for i, batch in zip(STEPS, batches, strict=True):
        state, _ = step(state, batch)
        snaps[i] = host(state)
        ck.save(directory, i, state, zero=zero)
    return {"params": params, "zero": zero, "dir": directory, "snaps": snaps}


@pytest.fixture
def copy(run, tmp_path):
    """A fresh copy of the run's checkpoint directory, to damage."""
    directory = tmp_path / "ckpt"
    shutil.copytree(run["dir"], directory)
    return directory


def data_files(directory, step):
    files = glob.glob(os.path.join(directory, str(step), "state", "ocdbt.process_*", "d", "*"))
    return sorted(files, key=os.path.getsize, reverse=True)


def damage(directory, step, how, at=None):
    """Damage the largest array file of ``step`` (it holds most leaves' chunks); ``flip``
    inverts 16 bytes at ``at`` (default: the middle). Returns the file's path relative to
    ``directory``."""
    path = data_files(directory, step)[0]
    size = os.path.getsize(path)
    at = size // 2 if at is None else at
    if how == "truncate":
        os.truncate(path, size // 2)
    elif how == "delete":
        os.remove(path)
    else:  # where the bytes are chunk data, the zstd frame still decodes, into other numbers
        with open(path, "r+b") as f:
            f.seek(at)
            chunk = bytearray(f.read(16))
            f.seek(at)
            f.write(bytes(b ^ 0xFF for b in chunk))
    return os.path.relpath(path, directory)


def plain_orbax(directory, step):
    """Every array of ``step`` as plain Orbax reads it (no jaxzero code), or None when it
    fails to read."""
    try:
        tree = ocp.StandardCheckpointer().restore(os.path.join(directory, str(step), "state"))
    except Exception:  # noqa: BLE001 - a read error: not the silent case
        return None
    return {k: np.asarray(v) for k, v in ocp.tree.to_flat_dict(tree).items()}


def flip_silently(directory, step):
    """Flip 16 bytes of ``step``'s largest array file at the first position that plain Orbax
    reads without any error, into other numbers (a flip elsewhere can break the zstd frame
    instead: that is a read error, not the silent case). Returns the file's path relative to
    ``directory`` and the dotted names of the leaves that read back differently."""
    pristine = plain_orbax(directory, step)
    size = os.path.getsize(data_files(directory, step)[0])
    for attempt in range(24):
        at = size // 4 + attempt * (size // 48)
        file = damage(directory, step, "flip", at=at)
        got = plain_orbax(directory, step)
        if got is not None and (
            differing := {".".join(k) for k in pristine if not np.array_equal(got[k], pristine[k])}
        ):
            return file, differing
        damage(directory, step, "flip", at=at)  # inverting the bytes again puts them back
    pytest.fail("no flipped position read silently into other numbers")


def restore(run, directory, **kw):
    return ck.restore(directory, run["zero"], run["params"], ema=ema(), **kw)


def assert_bitwise(state, want):
    got = host(state)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def leaf_names(run):
    return {r["path"] for r in ck.load_metadata(run["dir"], 3)["leaves"]}


def test_every_leaf_has_a_checksum_in_the_metadata(run):
    meta = ck.load_metadata(run["dir"], 3)
    sums = meta["checksums"]
    assert sums["algorithm"].startswith("jaxzero.")
    assert set(sums["leaves"]) == leaf_names(run)
    assert all(len(v) == 16 for v in sums["leaves"].values())


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_step_fails_naming_step_file_and_leaf(run, copy, how):
    file = flip_silently(copy, 3)[0] if how == "flip" else damage(copy, 3, how)
    with pytest.raises(ck.CheckpointDamagedError, match=r"step 3 .* is damaged: ") as e:
        restore(run, copy)
    assert e.value.step == 3
    assert e.value.file == file and f"file {file}" in str(e.value)
    why = {"flip": "reads back other numbers", "truncate": "is truncated", "delete": "is missing"}
    assert why[how] in str(e.value)
    assert e.value.leaf in leaf_names(run)
    assert e.value.leaf in str(e.value)
    # The undamaged steps still restore, bit for bit.
    assert_bitwise(restore(run, copy, step=2), run["snaps"][2])


def test_silently_altered_numbers_are_caught_by_the_checksum(run, copy):
    """Altered bytes that plain Orbax reads without any error, into other numbers, are
    refused by the checksum."""
    _, differing = flip_silently(copy, 3)
    with pytest.raises(ck.CheckpointDamagedError, match="reads back other numbers than") as e:
        restore(run, copy)
    assert e.value.step == 3 and e.value.leaf in differing


def test_fallback_takes_the_newest_step_that_verifies(run, copy):
    damage(copy, 3, "flip")
    damage(copy, 2, "delete")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = restore(run, copy, fallback=True)
    assert_bitwise(state, run["snaps"][1])
    msgs = [str(w.message) for w in caught if issubclass(w.category, ck.DamagedStepWarning)]
    assert len(msgs) == 1 and "passed over damaged step(s) 3, 2; restored step 1" in msgs[0]
    with pytest.raises(ValueError, match="cannot be combined with step=2"):
        restore(run, copy, step=2, fallback=True)


def test_fallback_with_every_step_damaged_raises(run, copy):
    for s in STEPS:
        damage(copy, s, "truncate")
    with pytest.raises(ck.CheckpointDamagedError, match=r"no step of .* verifies.*3, 2, 1"):
        restore(run, copy, fallback=True)


def test_verify_reports_the_damaged_steps(run, copy):
    clean = ck.verify(run["dir"])
    assert clean.ok and clean.damaged == ()
    assert [s.step for s in clean.steps] == [3, 2, 1]
    assert all(s.checked == s.leaves == len(leaf_names(run)) for s in clean.steps)
    flipped = damage(copy, 3, "flip")
    deleted = damage(copy, 1, "delete")
    report = ck.verify(copy)
    assert not report.ok and report.damaged == (3, 1)
    assert report.steps[0].leaf in leaf_names(run)
    assert (report.steps[0].file, report.steps[2].file) == (flipped, deleted)
    assert f"file {deleted} is missing" in report.steps[2].problem
    text = str(report)
    assert "step 3: DAMAGED" in text and "step 2: ok" in text and "damaged steps: [3, 1]" in text
    assert ck.verify(copy, step=2).ok


def test_inspect_verify_cli_lists_damaged_steps_and_exits_1(run, copy, capsys):
    from jaxzero import cli

    assert cli.main(["inspect", "--verify", str(run["dir"])]) == 0
    assert "step 3: ok" in capsys.readouterr().out
    damage(copy, 2, "flip")
    assert cli.main(["inspect", "--verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "step 2: DAMAGED" in out and "damaged steps: [2]" in out


def test_verify_reads_a_checkpoint_saved_without_checksums(tmp_path):
    directory = tmp_path / "legacy"
    shutil.copytree(os.path.join(HERE, "data", "legacy_ckpt"), directory)
    report = ck.verify(directory)
    assert report.ok and report.steps[0].checked == 0 and report.steps[0].leaves > 0
    assert "saved without checksums" in str(report)


# --------------------------------------------------------------------------------- failed saves
# slow: the async failures raised by checkpoint.wait and by the next save (the sync save's stays)
@pytest.mark.parametrize(
    "mode",
    [
        "sync",
        pytest.param("async_wait", marks=pytest.mark.slow),
        pytest.param("async_next", marks=pytest.mark.slow),
    ],
)
def test_failed_save_reaches_the_caller_and_the_previous_step_restores(run, tmp_path, mode):
    directory = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "ckpt_fail_worker.py"), str(directory), mode],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    raised = [line for line in proc.stdout.splitlines() if line.startswith("RAISED")]
    assert raised, proc.stdout + proc.stderr[-3000:]
    assert raised[0].startswith("RAISED OSError: saving checkpoint step 4 in"), raised[0]
    assert "newest complete step is 2" in raised[0]
    if mode != "sync":  # the asynchronous save itself returned; the error came later
        assert "SAVE_RETURNED 4" in proc.stdout
    assert "SAVE_RETURNED 6" not in proc.stdout
    # Only step 2 is complete; the failed step is never picked, and step 2 is bit-exact.
    assert ck.latest_step(directory) == 2
    want = dict(np.load(str(directory) + ".npz"))
    assert_bitwise(restore(run, directory), want)
    assert ck.verify(directory).ok
    with pytest.raises(FileNotFoundError, match="step 4 is not a complete checkpoint"):
        restore(run, directory, step=4)


def test_damage_is_found_when_restoring_onto_another_mesh_and_stage(run, copy):
    """A leaf's checksum does not depend on the shards it is read into: restored onto 4
    devices at stage 3 the damaged step is refused and the others are bit-exact."""
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(4), stage=3)
    flip_silently(copy, 3)
    with pytest.raises(ck.CheckpointDamagedError, match=r"step 3 .* is damaged: leaf "):
        ck.restore(copy, zero, run["params"], ema=ema())
    state = ck.restore(copy, zero, run["params"], ema=ema(), step=2)
    assert_bitwise(state, run["snaps"][2])
    assert jax.tree.leaves(state.params)[0].sharding.mesh.size == 4
