"""``jaxzero convert`` (jaxzero.convert): torch ZeRO(AdamW) <-> jaxzero Orbax checkpoints,
checked against the real-PyTorch fixture tests/fixtures/B_zero_trajectory/mlp_ws2.

Expected values come from the fixture files (torch), never from jaxzero.
"""

import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from conftest import fixture_case, require

import jaxzero as jz
from jaxzero import cli

pytestmark = pytest.mark.interop  # torch and DeepSpeed (tests/conftest.py)
torch = require("torch", "torch")


@pytest.fixture
def run_cli(monkeypatch):
    """``cli.main``, where jaxzero.cli registers ``convert`` itself."""
    assert "convert" in cli.COMMANDS
    return cli.main


@pytest.fixture(scope="module")
def fx(fixtures_dir, tmp_path_factory):
    d, man = fixture_case(fixtures_dir, "B_zero_trajectory", "mlp_ws2")
    names = [p["name"] for p in man["params_in_module_order"]]
    params = dict(np.load(os.path.join(d, "params.npz")))
    work = tmp_path_factory.mktemp("convert_fx")
    model = str(work / "model.pt")
    torch.save({n: torch.from_numpy(params[f"step5/{n}"]) for n in names}, model)
    ranks = work / "ranks"
    ranks.mkdir()
    for r in range(2):
        shutil.copy(os.path.join(d, f"local_opt_state_rank{r}.pt"), ranks)
    return {
        "dir": d,
        "man": man,
        "names": names,
        "params": params,
        "cons": dict(np.load(os.path.join(d, "consolidated_opt_state.npz"))),
        "model": model,
        "ranks": str(ranks),
        "cons_pt": os.path.join(d, "consolidated_opt_state.pt"),
    }


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _same_sd(got, want):
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        assert sorted(got["state"][i]) == sorted(entry)
        for k, t in entry.items():
            assert got["state"][i][k].dtype == t.dtype, (i, k)
            assert torch.equal(got["state"][i][k], t), (i, k)


def _restore(ckpt, names, shapes):
    tx = optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    z = jz.ZeRO(tx, jz.data_parallel_mesh(2), stage=1)
    abstract = {n: jax.ShapeDtypeStruct(shapes[n], np.float32) for n in names}
    return jz.checkpoint.restore(ckpt, z, abstract)


def test_roundtrip_per_rank_files(fx, tmp_path, run_cli, capsys):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "torch")
    argv = ["convert", "torch2jax", "--model", fx["model"], "--optim-dir", fx["ranks"]]
    assert run_cli([*argv, "--world-size", "2", "--out", ckpt, "--devices", "2"]) == 0
    capsys.readouterr()

    # the restored jaxzero state holds the fixture's params and AdamW moments
    names = fx["names"]
    shapes = {n: fx["params"][f"step5/{n}"].shape for n in names}
    state = _restore(ckpt, names, shapes)
    assert int(state.step) == 5
    node = state.opt_state[0]
    assert int(node.count) == 5
    for n in names:
        np.testing.assert_array_equal(np.asarray(state.params[n]), fx["params"][f"step5/{n}"])
        np.testing.assert_array_equal(np.asarray(node.mu[n]), fx["cons"][f"{n}/exp_avg"])
        np.testing.assert_array_equal(np.asarray(node.nu[n]), fx["cons"][f"{n}/exp_avg_sq"])
    meta = jz.checkpoint.load_metadata(ckpt)
    rec = meta["user"]["convert"]
    assert rec["direction"] == "torch2jax" and rec["source"]["world_size"] == 2
    assert rec["source"]["optim_dir"] == os.path.abspath(fx["ranks"])
    assert rec["hyperparams"]["lr"] == 0.01 and rec["param_names"] == names

    # and back to torch: bit-equal per-rank files, consolidated file and model
    argv = ["convert", "jax2torch", "--ckpt", ckpt, "--out", out, "--world-size", "2"]
    assert run_cli([*argv, "--consolidated"]) == 0
    assert "wrote:" in capsys.readouterr().out
    for r in range(2):
        _same_sd(
            _load(os.path.join(out, f"local_opt_state_rank{r}.pt")),
            _load(os.path.join(fx["dir"], f"local_opt_state_rank{r}.pt")),
        )
    _same_sd(_load(os.path.join(out, "consolidated_opt_state.pt")), _load(fx["cons_pt"]))
    model = _load(os.path.join(out, "model.pt"))
    assert list(model) == names
    for n in names:
        assert torch.equal(model[n], torch.from_numpy(fx["params"][f"step5/{n}"]))


def test_consolidated_input_with_flax_name_map(fx, tmp_path, run_cli, capsys):
    """A name map gives a Flax tree (Dense kernels transposed); the round trip is exact."""
    nm = {"fc1.weight": "fc1/kernel", "fc1.bias": "fc1/bias"}
    nm.update({"fc2.weight": "fc2/kernel", "fc2.bias": "fc2/bias"})
    nm_path = tmp_path / "map.json"
    nm_path.write_text(json.dumps(nm))
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "torch")
    argv = ["convert", "torch2jax", "--model", fx["model"], "--optim", fx["cons_pt"]]
    assert run_cli([*argv, "--out", ckpt, "--devices", "2", "--name-map", str(nm_path)]) == 0
    meta = jz.checkpoint.load_metadata(ckpt)
    shapes = {r["path"]: r["shape"] for r in meta["leaves"]}
    assert shapes["params.fc1.kernel"] == [17, 31]  # torch [31, 17] transposed
    assert shapes["opt_state.0.mu.fc1.kernel"] == [17, 31]

    argv = ["convert", "jax2torch", "--ckpt", ckpt, "--out", out, "--world-size", "2"]
    assert run_cli([*argv, "--consolidated"]) == 0
    _same_sd(_load(os.path.join(out, "consolidated_opt_state.pt")), _load(fx["cons_pt"]))
    for r in range(2):
        _same_sd(
            _load(os.path.join(out, f"local_opt_state_rank{r}.pt")),
            _load(os.path.join(fx["dir"], f"local_opt_state_rank{r}.pt")),
        )
    model = _load(os.path.join(out, "model.pt"))
    for n in fx["names"]:
        assert torch.equal(model[n], torch.from_numpy(fx["params"][f"step5/{n}"]))
    capsys.readouterr()


def test_dry_run_writes_nothing_and_prints_summary(fx, tmp_path, run_cli, capsys):
    ckpt = tmp_path / "ckpt"
    argv = ["convert", "torch2jax", "--model", fx["model"], "--optim-dir", fx["ranks"]]
    assert run_cli([*argv, "--world-size", "2", "--out", str(ckpt), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not ckpt.exists()
    assert "dry run: nothing written" in out and "would write:" in out
    assert "AdamW" in out and "lr=0.01" in out and "weight_decay=0.01" in out
    for p in fx["man"]["params_in_module_order"]:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(p["name"] + " "))
        assert str(tuple(p["shape"])) in line and line.endswith(f"rank {p['owner_rank']}")

    # jax2torch --dry-run on a real checkpoint writes nothing either
    real = str(tmp_path / "real")
    assert run_cli([*argv, "--world-size", "2", "--out", real, "--devices", "2"]) == 0
    capsys.readouterr()
    dest = tmp_path / "torch"
    argv = ["convert", "jax2torch", "--ckpt", real, "--out", str(dest), "--world-size", "2"]
    assert run_cli([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not dest.exists()
    assert "local_opt_state_rank1.pt" in out and "dry run: nothing written" in out


def _expect_exit2(run_cli, capsys, argv, match):
    with pytest.raises(SystemExit) as exc:
        run_cli(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxzero convert"), err
    assert match in err, err
    return err


def test_bad_input_exits_2_with_one_line(fx, tmp_path, run_cli, capsys):
    t2j = ["convert", "torch2jax", "--model", fx["model"]]
    out = str(tmp_path / "ckpt")
    # world size mismatch with the files found
    _expect_exit2(
        run_cli, capsys,
        [*t2j, "--optim-dir", fx["ranks"], "--world-size", "4", "--out", out],
        "world size mismatch",
    )  # fmt: skip
    _expect_exit2(run_cli, capsys, [*t2j, "--optim-dir", fx["ranks"], "--out", out], "--world-size")
    # missing files
    _expect_exit2(
        run_cli, capsys,
        ["convert", "torch2jax", "--model", str(tmp_path / "nope.pt"), "--optim", fx["cons_pt"],
         "--out", out],
        "no such file",
    )  # fmt: skip
    _expect_exit2(
        run_cli, capsys, [*t2j, "--optim", str(tmp_path / "none.pt"), "--out", out], "no such file"
    )
    # unknown optimizer: an SGD-with-momentum state dict
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    sgd.param_groups[0]["params"][0].grad = torch.ones(2)
    sgd.step()
    sgd_pt = str(tmp_path / "sgd.pt")
    torch.save(sgd.state_dict(), sgd_pt)
    _expect_exit2(run_cli, capsys, [*t2j, "--optim", sgd_pt, "--out", out], "unsupported optimizer")
    # an Adam state under AdamW-looking groups but with amsgrad
    sd = _load(fx["cons_pt"])
    sd["param_groups"][0]["amsgrad"] = True
    ams = str(tmp_path / "ams.pt")
    torch.save(sd, ams)
    _expect_exit2(run_cli, capsys, [*t2j, "--optim", ams, "--out", out], "amsgrad")
    # jax2torch: missing checkpoint, no --world-size/--consolidated
    _expect_exit2(
        run_cli, capsys,
        ["convert", "jax2torch", "--ckpt", str(tmp_path / "none"), "--out", out,
         "--world-size", "2"],
        "no such directory",
    )  # fmt: skip
    _expect_exit2(
        run_cli, capsys, ["convert", "jax2torch", "--ckpt", out, "--out", out], "--world-size"
    )
    assert not os.path.exists(out)
    # no direction
    _expect_exit2(run_cli, capsys, ["convert"], "torch2jax")


def test_jax2torch_rejects_non_adamw_checkpoint(tmp_path, run_cli, capsys):
    """A jaxzero checkpoint trained with SGD is refused (AdamW only), one line, exit 2."""
    params = {"w": np.ones((3, 2), np.float32)}
    z = jz.ZeRO(optax.sgd(0.1, momentum=0.9), jz.data_parallel_mesh(2), stage=1)
    state = z.init(params)
    ckpt = str(tmp_path / "sgd_ckpt")
    jz.checkpoint.save(ckpt, 1, state, zero=z, wait=True)
    argv = ["convert", "jax2torch", "--ckpt", ckpt, "--out", str(tmp_path / "o")]
    _expect_exit2(run_cli, capsys, [*argv, "--world-size", "2", "--lr", "0.1"],
                  "unsupported optimizer")  # fmt: skip
    # without recorded hyper-parameters, --lr is required
    _expect_exit2(run_cli, capsys, [*argv, "--world-size", "2"], "--lr")


def test_jax2torch_plain_jaxzero_checkpoint_with_cli_hyperparams(tmp_path, run_cli, capsys):
    """A checkpoint saved by training (no convert record): structure from the leaf table,
    names by the reverse rules (kernel -> weight, transposed), hyper-parameters from flags."""
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": rng.normal(size=(3, 2)).astype(np.float32),
                        "bias": rng.normal(size=(2,)).astype(np.float32)}}  # fmt: skip
    tx = optax.adamw(0.5, b1=0.8, b2=0.9, eps=1e-6, weight_decay=0.0)
    z = jz.ZeRO(tx, jz.data_parallel_mesh(2), stage=2)
    state = z.init(params)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "o")
    jz.checkpoint.save(ckpt, 3, state, zero=z, wait=True)
    argv = ["convert", "jax2torch", "--ckpt", ckpt, "--out", out, "--consolidated"]
    flags = ["--lr", "0.5", "--betas", "0.8", "0.9", "--eps", "1e-6", "--weight-decay", "0"]
    assert run_cli([*argv, *flags]) == 0
    capsys.readouterr()
    model = _load(os.path.join(out, "model.pt"))
    assert sorted(model) == ["dense.bias", "dense.weight"]
    np.testing.assert_array_equal(model["dense.weight"].numpy(), params["dense"]["kernel"].T)
    cons = _load(os.path.join(out, "consolidated_opt_state.pt"))
    g = cons["param_groups"][0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.5, (0.8, 0.9), 1e-6, 0.0)
    assert g["decoupled_weight_decay"] is True and not os.path.exists(
        os.path.join(out, "local_opt_state_rank0.pt")
    )
    # the consolidated file loads into a real torch AdamW
    ps = [torch.nn.Parameter(model[n].clone()) for n in model]
    opt = torch.optim.AdamW(ps, lr=0.5)
    opt.load_state_dict(cons)
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
