"""A checkpoint directory someone else wrote: jaxzero's JSON metadata is
untrusted input. Crafted fields (wrong types, huge sizes, path-like names) give a clear error
naming the field, through every reader (load_metadata, restore, inspect, verify, the CLI), and
nothing is read or written outside the checkpoint directory."""

import json
import os
import re
import shutil

import numpy as np
import optax
import pytest

import jaxzero as jz
from jaxzero import checkpoint as ck
from jaxzero import cli
from jaxzero.gpu.models import make_problem

LEGACY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "legacy_ckpt")


def _crafted(tmp_path, edit):
    """A copy of tests/data/legacy_ckpt whose step-3 metadata went through ``edit(meta)``."""
    directory = tmp_path / "box" / "ckpt"
    shutil.copytree(LEGACY, directory)
    path = directory / "3" / "metadata" / "metadata"
    meta = json.loads(path.read_text())
    meta = edit(meta) or meta
    path.write_text(json.dumps(meta))
    return directory


def _set(field, value):
    def edit(meta):
        meta[field] = value

    return edit


def _leaf(field, value):
    def edit(meta):
        meta["leaves"][0][field] = value

    return edit


CASES = {
    "stage": (_set("stage", "3; rm -rf /"), r"field 'stage' = '3; rm -rf /'"),
    "huge_shape": (_leaf("shape", [2**40, 2**40]), r"more than 2\*\*50 elements"),
    "negative_dim": (_leaf("shape", [-1, 31]), r"leaves\[0\]\.shape"),
    "dtype": (_leaf("dtype", "object"), r"leaves\[0\]\.dtype"),
    "bytes": (_leaf("bytes", 10**18), r"leaves\[0\]\.bytes"),
    "has_master": (_set("has_master", "yes"), r"field 'has_master' = 'yes'"),
    "mesh": (_set("mesh", {"data": -8}), r"mesh\.data"),
    "checksums": (_set("checksums", {"algorithm": "x", "leaves": {"a": "zz"}}), "16 lowercase"),
    "not_an_object": (lambda meta: ["a", "list"], r"must be a JSON object"),
    "nul_name": (_leaf("path", "params\x00.fc1"), r"leaves\[0\]\.path"),
    "units": (_set("units", r"layer\d+"), r"field 'units' = 'layer\\\\d\+' \(must be a list"),
}


def _readers(directory):
    params, _, _ = make_problem("mlp", steps=1, seed=7)
    zero = jz.ZeRO(optax.adamw(1e-2, weight_decay=0.1), jz.data_parallel_mesh(8), stage=2)
    return {
        "load_metadata": lambda: ck.load_metadata(directory),
        "restore": lambda: ck.restore(directory, zero, params, ema=jz.ShardedEMA(0.9, tau=3.0)),
        "inspect": lambda: ck.inspect(directory),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_metadata_is_refused_by_every_reader(tmp_path, case):
    edit, pattern = CASES[case]
    directory = _crafted(tmp_path, edit)
    before = sorted(os.listdir(tmp_path / "box"))
    for name, read in _readers(directory).items():
        with pytest.raises(ValueError, match=pattern) as e:
            read()
        assert "step 3" in str(e.value), name
        assert "not valid" in str(e.value), name
    report = ck.verify(directory)  # verify reports damage instead of raising
    assert not report.ok and report.damaged == (3,)
    assert re.search(pattern, str(report)) and "not valid" in str(report)
    assert sorted(os.listdir(tmp_path / "box")) == before


@pytest.mark.parametrize("case", ["stage", "huge_shape"])
def test_crafted_metadata_through_the_cli_is_one_line_exit_2(tmp_path, case, capsys):
    directory = _crafted(tmp_path, CASES[case][0])
    for argv in (
        ["estimate", "--from-checkpoint", str(directory)],
        ["inspect", str(directory)],
        ["convert", "jax2torch", "--ckpt", str(directory), "--consolidated", "--dry-run"],
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "not valid" in err, (argv, err)


def test_path_like_leaf_names_are_names_only(tmp_path):
    """Leaf paths in the metadata name tree entries; nothing is opened or created by them."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("do not read")

    def edit(meta):
        meta["leaves"][0]["path"] = "../../outside/secret.txt"
        meta["leaves"][1]["path"] = str(secret)

    directory = _crafted(tmp_path, edit)
    atime = os.stat(secret).st_atime_ns
    text = ck.inspect(directory)
    assert "../../outside/secret.txt" in text  # shown as a name
    assert ck.verify(directory).ok  # the arrays are read from the step's own directory
    params, _, _ = make_problem("mlp", steps=1, seed=7)
    zero = jz.ZeRO(optax.adamw(1e-2, weight_decay=0.1), jz.data_parallel_mesh(8), stage=2)
    state = ck.restore(directory, zero, params, ema=jz.ShardedEMA(0.9, tau=3.0))
    want = np.load(os.path.join(os.path.dirname(LEGACY), "legacy_ckpt.npz"))
    np.testing.assert_array_equal(np.asarray(state.step), want["step"])
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert os.stat(secret).st_atime_ns == atime and secret.read_text() == "do not read"
