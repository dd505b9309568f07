"""No checkpoint reader of jaxzero runs code from a file.

Each reader is fed a crafted file whose pickle would run code when unpickled: a
``__reduce__`` returning ``(open, (marker, "w"))``, which creates ``marker``. Each test shows
that the payload is live (an unsafe load in a subprocess, or plain ``pickle.loads``, creates the
marker), then that the reader refuses the file with an error naming it and saying it will not
execute code, and that the marker does not exist afterwards. The readers:

* torch ``ZeroRedundancyOptimizer`` state: consolidated (``import_optimizer_state``) and per-rank
  (``import_zero_optimizer_state``);
* EMA files: distributed ModelEMA ``{"param", "updates"}`` and ultralytics ``{"ema", ...}``
  (``import_ema``), including an ultralytics-style file that pickles the model module, refused
  with the re-save recipe, which then reads;
* DeepSpeed files (``read_checkpoint`` and ``jaxzero convert deepspeed2jax``);
* ``jaxzero convert torch2jax`` (``--model``, ``--optim``, ``--optim-dir``) through
  ``jaxzero.cli.main``.
"""

import collections
import copy
import os
import pickle
import re
import shutil
import subprocess
import sys

import numpy as np
import optax
import pytest
from conftest import fixture_case, missing, require

import jaxzero as jz
from jaxzero import cli
from jaxzero.interop import torch as ti
from jaxzero.interop.deepspeed import read_checkpoint
from jaxzero.interop.safe_pickle import UnsafeFileError, load_torch_file

pytestmark = pytest.mark.interop  # torch and DeepSpeed (tests/conftest.py)
torch = require("torch", "torch")

REFUSED = r"was refused.*not on the allowlist.*will not execute code.*nothing from it was executed"


class WritesMarker:
    """Unpickles as ``open(marker, "w")``: any loader that runs pickled code creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def crafted(path, marker, wrap=lambda payload: payload, raw=False):
    """Write ``wrap(payload)`` to ``path`` with ``torch.save`` (or, ``raw``, a plain protocol-2
    pickle), the payload creating ``marker`` when unpickled; returns ``str(path)``."""
    obj = wrap(WritesMarker(marker))
    if raw:
        path.write_bytes(pickle.dumps(obj, protocol=2))
    else:
        torch.save(obj, path)
    return str(path)


def assert_live(*files_and_markers):
    """Each (file, marker): an unsafe ``torch.load`` in a fresh process creates the marker.
    Checked after the refusals, so the markers cannot have come from the readers."""
    for _, marker in files_and_markers:
        assert not os.path.exists(marker), marker
    code = "import sys, torch\nfor f in sys.argv[1:]: torch.load(f, weights_only=False)"
    files = [str(f) for f, _ in files_and_markers]
    subprocess.run([sys.executable, "-c", code, *files], check=True, capture_output=True)
    for _, marker in files_and_markers:
        assert os.path.exists(marker), f"the payload of {marker} did not run"


def refuses(call, path, match=REFUSED):
    """``call()`` raises UnsafeFileError naming ``path`` and matching ``match``."""
    with pytest.raises(UnsafeFileError, match=match) as exc:
        call()
    assert os.path.basename(str(path)) in str(exc.value)
    return str(exc.value)


# --------------------------------------------------------------------------- the helper itself
def test_load_torch_file_refuses_both_file_formats(tmp_path, monkeypatch):
    """A torch (zip) file and a raw pickle are both refused before anything runs, even with
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` set; the raw pickle's payload is live under plain
    ``pickle.loads``, the torch file's under an unsafe ``torch.load``."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    zipped, m1 = tmp_path / "zipped.pt", tmp_path / "m1"
    raw, m2 = tmp_path / "raw.pt", tmp_path / "m2"
    crafted(zipped, m1, lambda p: {"weights": torch.zeros(2), "x": p})
    crafted(raw, m2, lambda p: {"x": p}, raw=True)
    msg = refuses(lambda: load_torch_file(zipped, what="model file"), zipped)
    assert "(io.open)" in msg and msg.startswith("model file")
    refuses(lambda: load_torch_file(raw), raw)
    assert not m1.exists() and not m2.exists()
    pickle.loads(raw.read_bytes())  # the raw payload is live
    assert m2.exists()
    assert_live((zipped, m1))


def test_plain_files_still_load(tmp_path):
    """Tensors, OrderedDicts, containers and plain values load as before."""
    sd = collections.OrderedDict(w=torch.ones(2, 3), n=torch.tensor(4))
    torch.save({"param": sd, "updates": 7, "meta": {"a": [1, 2.5, "x", None]}}, tmp_path / "ok")
    got = load_torch_file(tmp_path / "ok")
    assert isinstance(got["param"], collections.OrderedDict) and got["updates"] == 7
    assert torch.equal(got["param"]["w"], sd["w"]) and got["meta"] == {"a": [1, 2.5, "x", None]}


# --------------------------------------------------------------------------- torch ZeRO state
@pytest.fixture(scope="module")
def mlp(fixtures_dir):
    """Names and an AdamW state for the B_zero_trajectory/mlp_ws2 model."""
    d, manifest = fixture_case(fixtures_dir, "B_zero_trajectory", "mlp_ws2")
    entries = manifest["params_in_module_order"]
    names = [p["name"] for p in entries]
    params = {p["name"]: np.zeros(p["shape"], np.float32) for p in entries}
    return {
        "dir": d,
        "names": names,
        "params": params,
        "opt_state": optax.adamw(1e-2).init(params),
    }


def optimizer_wrap(payload):
    """A torch optimizer state dict with the payload as one param's ``step``."""
    state = {0: {"step": payload, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}}
    return {"state": state, "param_groups": [{"lr": 0.01, "params": [0]}]}


def test_zero_optimizer_state_readers_refuse(mlp, tmp_path):
    """Consolidated (``import_optimizer_state``) and per-rank (``import_zero_optimizer_state``,
    the crafted file as rank 1 beside the real rank 0)."""
    cons, m1 = tmp_path / "consolidated_opt_state.pt", tmp_path / "m1"
    rank1, m2 = tmp_path / "local_opt_state_rank1.pt", tmp_path / "m2"
    crafted(cons, m1, optimizer_wrap)
    crafted(rank1, m2, optimizer_wrap, raw=True)
    msg = refuses(lambda: ti.import_optimizer_state(mlp["opt_state"], cons, mlp["names"]), cons)
    assert msg.startswith("torch optimizer state file") and "optimizer.state_dict()" in msg
    rank0 = os.path.join(mlp["dir"], "local_opt_state_rank0.pt")
    msg = refuses(
        lambda: ti.import_zero_optimizer_state(mlp["opt_state"], [rank0, rank1], mlp["names"]),
        rank1,
    )
    assert msg.startswith("rank 1 optimizer state file")
    assert not m1.exists() and not m2.exists()
    pickle.loads(rank1.read_bytes())
    assert m2.exists()
    assert_live((cons, m1))


# --------------------------------------------------------------------------- EMA files
def ema_target():
    tree = {"fc1.weight": np.zeros((31, 17), np.float32), "fc1.bias": np.zeros(31, np.float32)}
    return jz.ShardedEMA(0.9).init(tree)


def test_ema_readers_refuse(tmp_path):
    """A distributed ModelEMA ``{"param", "updates"}`` file and an ultralytics
    ``{"ema", "updates", ...}`` file, each with the payload inside."""
    modelema, m1 = tmp_path / "ema_state_dict_default_rank0.pt", tmp_path / "m1"
    ultra, m2 = tmp_path / "last.pt", tmp_path / "m2"
    crafted(
        modelema,
        m1,
        lambda p: {"param": collections.OrderedDict({"fc1.weight": p}), "updates": 5},
    )
    crafted(ultra, m2, lambda p: {"epoch": 3, "model": None, "ema": p, "updates": 30})
    for path in (modelema, ultra):
        msg = refuses(lambda path=path: ti.import_ema(ema_target(), path), path)
        assert msg.startswith("EMA checkpoint file") and "state_dict()" in msg
    assert not m1.exists() and not m2.exists()
    assert_live((modelema, m1), (ultra, m2))


def test_ultralytics_file_with_pickled_model_is_refused_with_a_recipe(tmp_path):
    """ultralytics' ``last.pt`` pickles the EMA model module: the reader refuses it (the
    module's classes are code) and says how to re-save it; the re-saved file reads."""
    model = torch.nn.Module()
    model.fc1 = torch.nn.Linear(17, 31)
    path = tmp_path / "last.pt"
    ckpt = {"epoch": 3, "model": None, "ema": copy.deepcopy(model).half(), "updates": 30}
    torch.save({**ckpt, "train_args": {"imgsz": 640}}, path)
    msg = refuses(lambda: ti.import_ema(ema_target(), path), path)
    assert "torch.nn.modules.module.Module" in msg and "ultralytics" in msg
    # the recipe from the message, run where the file is trusted (this test wrote it)
    trusted = torch.load(path, weights_only=False)
    resaved = tmp_path / "ema_state_dict.pt"
    torch.save({"ema": trusted["ema"].state_dict(), "updates": trusted["updates"]}, resaved)
    assert "ckpt['ema'].state_dict(), 'updates': ckpt['updates']}" in msg
    state = ti.import_ema(ema_target(), resaved)
    assert int(state.updates) == 30
    np.testing.assert_array_equal(
        state.ema["fc1.weight"], model.fc1.weight.detach().half().float().numpy()
    )


# --------------------------------------------------------------------------- DeepSpeed files
@pytest.fixture
def ds_copy(fixtures_dir, tmp_path):
    d = os.path.join(fixtures_dir, "E_deepspeed", "z2_mlp_a_ws2_fp32", "ckpt")
    if not os.path.isdir(d):
        missing("fixture case E_deepspeed/z2_mlp_a_ws2_fp32", d)
    save = tmp_path / "ds"
    shutil.copytree(d, save)
    return save


def test_deepspeed_files_refused(ds_copy, tmp_path, capsys):
    """The model-states file through ``read_checkpoint`` (the optimizer files are also covered
    in test_deepspeed.py), and an optimizer file through ``jaxzero convert deepspeed2jax``."""
    step = ds_copy / "step3"
    states = step / "mp_rank_00_model_states.pt"
    original = states.read_bytes()
    evil_states, m1 = tmp_path / "evil_states.pt", tmp_path / "m1"
    crafted(evil_states, m1, lambda p: {"module": {"fc1.weight": p}, "ds_version": "0.19.8"})
    shutil.copyfile(evil_states, states)
    msg = refuses(lambda: read_checkpoint(ds_copy), states)
    assert "engine.save_checkpoint" in msg and "LossScaler" in msg

    states.write_bytes(original)
    optim, m2 = step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tmp_path / "m2"
    crafted(optim, m2, lambda p: {"optimizer_state_dict": p}, raw=True)
    argv = ["convert", "deepspeed2jax", str(ds_copy), "--out", str(tmp_path / "out")]
    err = cli_refuses(argv, optim, capsys)
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in err
    assert not m1.exists() and not m2.exists() and not (tmp_path / "out").exists()
    pickle.loads(optim.read_bytes())
    assert m2.exists()
    assert_live((evil_states, m1))


# --------------------------------------------------------------------------- jaxzero convert
def cli_refuses(argv, path, capsys):
    """``jaxzero.cli.main(argv)`` exits 2 with one stderr line refusing ``path``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxzero convert"), err
    assert re.search(REFUSED, err) and os.path.basename(str(path)) in err, err
    return err


def test_convert_torch2jax_refuses(mlp, tmp_path, capsys):
    """``--model``, ``--optim`` and a rank file of ``--optim-dir``, each crafted in turn
    beside real files; nothing is written."""
    model, m1 = tmp_path / "model.pt", tmp_path / "m1"
    cons, m2 = tmp_path / "opt.pt", tmp_path / "m2"
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    shutil.copy(os.path.join(mlp["dir"], "local_opt_state_rank0.pt"), ranks)
    rank1, m3 = ranks / "local_opt_state_rank1.pt", tmp_path / "m3"
    crafted(model, m1, lambda p: {"fc1.weight": torch.zeros(31, 17), "fc1.bias": p})
    crafted(cons, m2, optimizer_wrap)
    crafted(rank1, m3, optimizer_wrap)
    good_model = tmp_path / "good_model.pt"
    torch.save({n: torch.from_numpy(v) for n, v in mlp["params"].items()}, good_model)
    good_cons = os.path.join(mlp["dir"], "consolidated_opt_state.pt")
    out = str(tmp_path / "out")
    t2j = ["convert", "torch2jax", "--out", out]
    cli_refuses([*t2j, "--model", str(model), "--optim", good_cons], model, capsys)
    cli_refuses([*t2j, "--model", str(good_model), "--optim", str(cons)], cons, capsys)
    argv = [*t2j, "--model", str(good_model), "--optim-dir", str(ranks), "--world-size", "2"]
    cli_refuses(argv, rank1, capsys)
    assert not any(m.exists() for m in (m1, m2, m3)) and not os.path.exists(out)
    assert_live((model, m1), (cons, m2), (rank1, m3))
