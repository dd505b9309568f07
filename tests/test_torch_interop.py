"""torch <-> jaxzero interop: weights, AdamW/SGD optimizer state (consolidated and per-rank
ZeroRedundancyOptimizer) checked against the real-PyTorch fixtures of
tests/fixtures/B_zero_trajectory/mlp_ws2 and against torch itself run in the test.

Expected numbers come from the fixture files or from torch, never from jaxzero.
"""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import fixture_case, require

import jaxzero as jz
from jaxzero.interop import torch as ti

pytestmark = pytest.mark.interop  # torch and DeepSpeed (tests/conftest.py)
torch = require("torch", "torch")

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01
_CACHE = {}


def _cached(key, build):
    if key not in _CACHE:
        _CACHE[key] = build()
    return _CACHE[key]


@pytest.fixture(scope="module")
def fx(fixtures_dir):
    """The B_zero_trajectory/mlp_ws2 fixture: manifest, npz files and .pt paths."""
    d, man = fixture_case(fixtures_dir, "B_zero_trajectory", "mlp_ws2")
    load = lambda name: dict(np.load(os.path.join(d, name)))  # noqa: E731
    return {
        "dir": d,
        "man": man,
        "names": [p["name"] for p in man["params_in_module_order"]],
        "params": load("params.npz"),
        "grads": load("grads_avg.npz"),
        "data": load("data.npz"),
        "local": load("local_opt_state.npz"),
        "cons": load("consolidated_opt_state.npz"),
        "pt": lambda name: os.path.join(d, name),
    }


def tree_at(fx, step):
    return {n: fx["params"][f"step{step}/{n}"] for n in fx["names"]}


def zero():
    """ZeRO stage 2 over 2 devices around optax AdamW with the fixture's hyper-parameters."""

    def build():
        tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
        z = jz.ZeRO(tx, jz.data_parallel_mesh(2), stage=2)
        return z, jax.jit(z.apply_gradients)

    return _cached("zero", build)


def adam_node(opt_state):
    """The ScaleByAdamState of optax.adamw's chain (test-side, by position)."""
    return opt_state[0]


def close(a, b, atol, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    err = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
    assert err <= atol, f"{what}: max abs diff {err:.3g} > {atol}"


# --------------------------------------------------------------------------- (a) optimizer only
def test_sharded_adamw_reproduces_zero_trajectory_and_state(fx):
    """grads_avg fed to jaxzero's sharded AdamW give params.npz at every step; after step 5
    the exported per-rank local states equal local_opt_state.npz (local numbering from the
    manifest) and the consolidated export equals consolidated_opt_state.npz."""
    z, apply = zero()
    state = z.init(tree_at(fx, 0))
    for s in range(1, 6):
        grads = {n: fx["grads"][f"step{s}/{n}"] for n in fx["names"]}
        state, _ = apply(state, grads)
        for n in fx["names"]:
            close(state.params[n], fx["params"][f"step{s}/{n}"], 1e-6, f"step {s} {n}")

    hp = ti.adamw_hyperparams(LR, BETAS, EPS, WD)
    local = ti.export_zero_optimizer_state(state.opt_state, fx["names"], 2, hyperparams=hp)
    assert len(local) == 2
    for r, want in enumerate(fx["man"]["local_optimizer_state"]):
        assert [g["params"] for g in local[r]["param_groups"]] == [
            g["params"] for g in want["param_groups"]
        ]
        assert {k: v for k, v in local[r]["param_groups"][0].items() if k != "params"} == {
            k: (tuple(v) if k == "betas" else v)
            for k, v in want["param_groups"][0].items()
            if k != "params"
        }
        assert sorted(local[r]["state"]) == sorted(int(k) for k in want["local_index_to_name"])
        for j, name in want["local_index_to_name"].items():
            entry = local[r]["state"][int(j)]
            assert entry["step"].dtype == torch.float32 and entry["step"].ndim == 0
            for key in ("exp_avg", "exp_avg_sq", "step"):
                close(entry[key].numpy(), fx["local"][f"rank{r}/{name}/{key}"], 1e-6, f"{r} {key}")

    cons = ti.export_optimizer_state(state.opt_state, fx["names"], hyperparams=hp)
    ref = fx["man"]["consolidated_optimizer_state"]
    assert [g["params"] for g in cons["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    for i, name in ref["global_index_to_name"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            close(cons["state"][int(i)][key].numpy(), fx["cons"][f"{name}/{key}"], 1e-6, key)


# --------------------------------------------------------------------------- (b) end to end
def mlp_loss(p, b):
    """17 -> 31 -> 5 tanh MLP in torch layout (y = x W^T + b) with F.mse_loss."""
    h = jnp.tanh(b["x"] @ p["fc1.weight"].T + p["fc1.bias"])
    y = h @ p["fc2.weight"].T + p["fc2.bias"]
    return jnp.mean((y - b["y"]) ** 2)


def test_end_to_end_train_step_matches_torch_ddp_zero(fx):
    """A JAX MLP computing its own gradients (global batch = ranks' batches concatenated,
    each device holding its rank's) reproduces the DDP + ZeRO(AdamW) params within 2e-6."""
    z, _ = zero()
    step = jz.make_train_step(mlp_loss, z)
    state = step.init(tree_at(fx, 0))
    x, y = fx["data"]["x"], fx["data"]["y"]
    for s in range(1, 6):
        batch = {"x": x[s - 1].reshape(-1, x.shape[-1]), "y": y[s - 1].reshape(-1, y.shape[-1])}
        state, metrics = step(state, batch)
        close(metrics["loss"], np.mean(fx["man"]["loss_per_step_per_rank"][s - 1]), 2e-6, "loss")
        for n in fx["names"]:
            close(state.params[n], fx["params"][f"step{s}/{n}"], 2e-6, f"step {s} {n}")


# --------------------------------------------------------------------------- (c) import / export
def torch_adamw(params_np, names):
    ps = [torch.nn.Parameter(torch.from_numpy(params_np[n].copy())) for n in names]
    return ps, torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def test_import_torch_state_then_continue_matches_torch_and_export_loads(fx):
    """Import the consolidated .pt and, separately, the per-rank .pt files after step 5;
    both give the same state with the target shardings. One more jaxzero step equals a fresh
    torch AdamW step from the same state (1e-6); the export loads into torch.optim.AdamW and
    its state equals torch's after that step."""
    z, apply = zero()
    names = fx["names"]
    base = z.init(tree_at(fx, 5))
    opt_c = ti.import_optimizer_state(base.opt_state, fx["pt"]("consolidated_opt_state.pt"), names)
    opt_r = ti.import_zero_optimizer_state(
        base.opt_state,
        [fx["pt"]("local_opt_state_rank0.pt"), fx["pt"]("local_opt_state_rank1.pt")],
        names,
    )
    for a, b, old in zip(
        jax.tree.leaves(opt_c), jax.tree.leaves(opt_r), jax.tree.leaves(base.opt_state), strict=True
    ):
        assert a.sharding == old.sharding and b.sharding == old.sharding
        assert a.dtype == old.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    node = adam_node(opt_c)
    assert int(node.count) == 5
    for n in names:
        close(node.mu[n], fx["cons"][f"{n}/exp_avg"], 0, n)
        close(node.nu[n], fx["cons"][f"{n}/exp_avg_sq"], 0, n)

    # a sixth step with a fixed gradient (step 1's averaged gradient), jaxzero vs torch
    grads = {n: fx["grads"][f"step1/{n}"] for n in names}
    state, _ = apply(base.replace(opt_state=opt_c), grads)
    ps, opt = torch_adamw(tree_at(fx, 5), names)
    opt.load_state_dict(torch.load(fx["pt"]("consolidated_opt_state.pt"), weights_only=True))
    for p, n in zip(ps, names, strict=True):
        p.grad = torch.from_numpy(grads[n].copy())
    opt.step()
    for p, n in zip(ps, names, strict=True):
        close(state.params[n], p.detach().numpy(), 1e-6, f"param {n}")
        close(adam_node(state.opt_state).mu[n], opt.state[p]["exp_avg"].numpy(), 1e-6, n)
        close(adam_node(state.opt_state).nu[n], opt.state[p]["exp_avg_sq"].numpy(), 1e-6, n)
        assert float(opt.state[p]["step"]) == 6.0

    exported = ti.export_optimizer_state(
        state.opt_state, names, hyperparams=ti.adamw_hyperparams(LR, BETAS, EPS, WD)
    )
    ps2, opt2 = torch_adamw({n: np.asarray(state.params[n]) for n in names}, names)
    opt2.load_state_dict(exported)
    want = opt.state_dict()
    got = opt2.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i in range(len(names)):
        assert got["state"][i]["step"].dtype == want["state"][i]["step"].dtype == torch.float32
        for key in ("step", "exp_avg", "exp_avg_sq"):
            close(got["state"][i][key].numpy(), want["state"][i][key].numpy(), 1e-6, key)


# --------------------------------------------------------------------------- names and layouts
def test_name_map_rules_layouts_and_roundtrip():
    """Linear/Conv/BatchNorm/LayerNorm/Embedding weights load into a Flax model that then
    computes what the torch model computes; the export restores torch's tensors and order."""
    import flax.linen as nn

    torch.manual_seed(0)
    tm = torch.nn.ModuleDict(
        {
            "emb": torch.nn.Embedding(11, 3),
            "conv": torch.nn.Conv2d(3, 4, 3, padding=1),
            "bn": torch.nn.BatchNorm2d(4),
            "ln": torch.nn.LayerNorm(4),
            "head": torch.nn.Linear(4, 2),
        }
    ).eval()
    with torch.no_grad():
        tm["bn"].running_mean.normal_()
        tm["bn"].running_var.uniform_(0.5, 2.0)
        tm["bn"].weight.normal_()
        tm["ln"].weight.normal_()

    def torch_fwd(ids):
        x = tm["emb"](ids).permute(0, 3, 1, 2)  # [B, 3, H, W]
        x = tm["bn"](tm["conv"](x)).mean((2, 3))
        return tm["head"](tm["ln"](x))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(11, 3, name="emb")(ids)  # [B, H, W, 3]
            x = nn.Conv(4, (3, 3), padding=1, name="conv")(x)
            x = nn.BatchNorm(use_running_average=True, epsilon=1e-5, name="bn")(x).mean((1, 2))
            return nn.Dense(2, name="head")(nn.LayerNorm(epsilon=1e-5, name="ln")(x))

    ids = np.random.default_rng(0).integers(0, 11, size=(2, 5, 5))
    abstract = jax.eval_shape(lambda: Net().init(jax.random.PRNGKey(0), jnp.zeros((1, 5, 5), int)))
    sd = tm.state_dict()
    nm = ti.build_name_map(sd, abstract)
    assert nm.unmatched_torch == () and nm.unmatched_flax == ()
    assert nm.ignored == ("bn.num_batches_tracked",)
    assert nm.lookup("conv.weight") == (("params", "conv", "kernel"), "conv")
    assert nm.lookup("head.weight") == (("params", "head", "kernel"), "linear")
    assert nm.lookup("bn.running_var") == (("batch_stats", "bn", "var"), "identity")
    variables = ti.torch_to_flax(sd, abstract)
    with torch.no_grad():
        want = torch_fwd(torch.from_numpy(ids)).numpy()
    close(Net().apply(variables, ids), want, 1e-5, "forward")

    back = ti.flax_to_torch(variables, sd)
    assert list(back) == [k for k in sd if not k.endswith("num_batches_tracked")]
    for k, v in back.items():
        assert torch.equal(v, sd[k]), k

    # overrides: a dict entry and a callable; None skips an entry
    flat = {"enc": {"w": np.zeros((4, 2), np.float32)}, "b": np.zeros((2,), np.float32)}
    nm2 = ti.build_name_map(
        {"head.weight": (2, 4), "head.bias": (2,), "extra": (3,)},
        flat,
        overrides={"head.weight": "enc/w", "head.bias": ("b",), "extra": None},
    )
    assert nm2.entries == (
        ("head.weight", ("enc", "w"), "linear"),
        ("head.bias", ("b",), "identity"),
    )
    assert nm2.ignored == ("extra",)
    nm3 = ti.build_name_map(
        {"a.weight": (2, 4)},
        flat,
        overrides=lambda n, s: ("enc", "w") if n == "a.weight" else NotImplemented,
    )
    assert nm3.lookup("a.weight") == (("enc", "w"), "linear") and nm3.unmatched_flax == ("b",)


def test_zero_local_states_follow_partition_for_groups_and_world_sizes(fixtures_dir, fx):
    """Per-rank export numbers each rank's params by the A fixture's partition (ws 2 and 4),
    gives empty ranks empty groups (ws 8), handles two param groups (ZeRO's running totals
    shared across groups), and imports back to the same state."""
    names = fx["names"]
    params = tree_at(fx, 5)
    tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    opt = ti.import_optimizer_state(tx.init(params), fx["pt"]("consolidated_opt_state.pt"), names)
    hp = ti.adamw_hyperparams(LR, BETAS, EPS, WD)
    for ws in (2, 4):
        path = os.path.join(fixtures_dir, "A_zero_partition", f"mlp_ws{ws}.json")
        with open(path) as f:
            part = json.load(f)
        local = ti.export_zero_optimizer_state(opt, names, ws, hyperparams=hp)
        cons = torch.load(fx["pt"]("consolidated_opt_state.pt"), weights_only=True)
        for r, groups in enumerate(part["partition_per_rank"]):
            order = [n for g in groups for n in g["params"]]
            assert [len(g["params"]) for g in local[r]["param_groups"]] == [
                len(g["params"]) for g in groups
            ]
            for j, n in enumerate(order):
                assert torch.equal(
                    local[r]["state"][j]["exp_avg"], cons["state"][names.index(n)]["exp_avg"]
                )
    two_groups = [["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]]
    hps = [hp, {**hp, "weight_decay": 0.0}]
    for ws in (1, 3, 8):
        local = ti.export_zero_optimizer_state(opt, two_groups, ws, hyperparams=hps)
        assert all(len(sd["param_groups"]) == 2 for sd in local)
        assert [g["weight_decay"] for g in local[0]["param_groups"]] == [0.01, 0.0]
        owned = sum(len(sd["state"]) for sd in local)
        assert owned == 4 and (ws < 8 or all(not sd["state"] for sd in local[4:]))
        back = ti.import_zero_optimizer_state(
            tx.init(params), [sd if sd["state"] else None for sd in local], two_groups
        )
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(opt), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cons2 = ti.export_optimizer_state(opt, two_groups, hyperparams=hps)
    assert [g["params"] for g in cons2["param_groups"]] == [[0, 1], [2, 3]]
    again = ti.import_optimizer_state(tx.init(params), cons2, two_groups)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(opt), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"groups of \[2, 2\] params .* have \[4\]"):
        ti.import_optimizer_state(
            tx.init(params), fx["pt"]("consolidated_opt_state.pt"), two_groups
        )


# --------------------------------------------------------------------------- (d) bad input
def ws4_local_files(fixtures_dir, fx):
    """Per-rank local state dicts of a world_size=4 run, laid out by hand from the A fixture's
    partition of the same MLP (values from the consolidated fixture)."""
    with open(os.path.join(fixtures_dir, "A_zero_partition", "mlp_ws4.json")) as f:
        part = json.load(f)
    cons = torch.load(fx["pt"]("consolidated_opt_state.pt"), weights_only=True)
    index = {n: i for i, n in enumerate(fx["names"])}
    files = []
    for groups in part["partition_per_rank"]:
        local, pgroups = [], []
        for g in groups:
            pgroups.append(
                {
                    **cons["param_groups"][0],
                    "params": list(range(len(local), len(local) + len(g["params"]))),
                }
            )
            local += g["params"]
        files.append(
            {
                "state": {j: cons["state"][index[n]] for j, n in enumerate(local)},
                "param_groups": pgroups,
            }
        )
    return files


def test_bad_input_errors_name_the_offenders(fixtures_dir, fx):
    z, _ = zero()
    names = fx["names"]
    opt_state = z.init(tree_at(fx, 5)).opt_state
    cons = torch.load(fx["pt"]("consolidated_opt_state.pt"), weights_only=True)
    ranks = [torch.load(fx["pt"](f"local_opt_state_rank{r}.pt"), weights_only=True) for r in (0, 1)]

    # per-rank files from another world size than the one claimed
    ws4 = ws4_local_files(fixtures_dir, fx)
    with pytest.raises(ValueError, match=r"rank 1: .*\[1\] params .*world_size=2 .*\[3\]"):
        ti.import_zero_optimizer_state(opt_state, ws4[:2], names)
    with pytest.raises(ValueError, match=r"2 per-rank state dicts given for world_size=4"):
        ti.import_zero_optimizer_state(opt_state, ranks, names, world_size=4)
    with pytest.raises(ValueError, match=r"rank 0: .*\[3\] params .*world_size=3 .*\[1\]"):
        ti.import_zero_optimizer_state(opt_state, [ranks[1], ranks[0], ranks[1]], names)
    # ... and the right world size for those files works (ranks read lazily: callable)
    read = []
    out = ti.import_zero_optimizer_state(
        opt_state, lambda r: read.append(r) or ws4[r], names, world_size=4
    )
    assert read == [0, 1, 2, 3] and int(adam_node(out).count) == 5

    def variant(edit):
        sd = {"state": {i: dict(e) for i, e in cons["state"].items()},
              "param_groups": [dict(g) for g in cons["param_groups"]]}  # fmt: skip
        edit(sd)
        return sd

    cases = [
        (lambda sd: sd["state"].pop(3), r"no state for: fc2\.bias"),
        (lambda sd: sd["state"][1].pop("exp_avg_sq"), r"fc1\.bias: keys \['exp_avg', 'step'\]"),
        (
            lambda sd: sd["state"][2].update(max_exp_avg_sq=sd["state"][2]["exp_avg_sq"]),
            r"fc2\.weight: keys \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'\]",
        ),
        (lambda sd: sd["state"].update({4: sd["state"][0]}), r"unknown param indices: 4"),
        (lambda sd: sd.pop("param_groups"), r"expected keys 'state' and 'param_groups'"),
        (
            lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].T.contiguous()),
            r"fc1\.weight\.exp_avg: shape \(17, 31\) does not fit fc1\.weight \(31, 17\)",
        ),
        (
            lambda sd: sd["state"][3].update(step=torch.tensor(4.0)),
            r"fc2\.bias=4.*|fc1\.weight=5, fc1\.bias=5, fc2\.weight=5, fc2\.bias=4",
        ),
    ]
    for edit, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            ti.import_optimizer_state(opt_state, variant(edit), names)
    with pytest.raises(ValueError, match=r"param_names lists 3"):
        ti.import_optimizer_state(opt_state, cons, names[:3])
    with pytest.raises(ValueError, match=r"optimizer state for params with no tree leaf: .*bogus"):
        ti.import_optimizer_state(opt_state, cons, names[:3] + ["bogus.weight"])

    # SGD momentum state into an Adam state, and Adam state into SGD momentum
    ps, _ = torch_adamw(tree_at(fx, 5), names)
    sgd = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    for p in ps:
        p.grad = torch.ones_like(p)
    sgd.step()
    with pytest.raises(TypeError, match=r"fc1\.weight \(sgd\), fc1\.bias \(sgd\)"):
        ti.import_optimizer_state(opt_state, sgd.state_dict(), names)
    sgd_state = optax.sgd(0.1, momentum=0.9).init(tree_at(fx, 5))
    with pytest.raises(TypeError, match=r"fc2\.bias \(adam\)"):
        ti.import_optimizer_state(sgd_state, cons, names)
    # ... and the SGD state itself round-trips through an optax momentum (trace) state
    loaded = ti.import_optimizer_state(sgd_state, sgd.state_dict(), names)
    for p, n in zip(ps, names, strict=True):
        np.testing.assert_array_equal(loaded[0].trace[n], sgd.state[p]["momentum_buffer"].numpy())
    back = ti.export_optimizer_state(loaded, names, hyperparams=sgd.param_groups[0])
    for i, p in enumerate(ps):
        assert torch.equal(back["state"][i]["momentum_buffer"], sgd.state[p]["momentum_buffer"])
    with pytest.raises(TypeError, match=r"no Adam-like .* node"):
        ti.import_optimizer_state(optax.sgd(0.1).init(tree_at(fx, 5)), cons, names)

    # weights: unmatched names on both sides, shape mismatches, all listed
    params = tree_at(fx, 0)
    sd = {n: torch.from_numpy(v) for n, v in params.items()}
    with pytest.raises(
        ValueError,
        match=r"torch entries with no tree leaf: extra\.weight .*tree leaves with no torch entry: fc2\.bias",
    ):
        ti.torch_to_flax(
            {**{k: v for k, v in sd.items() if k != "fc2.bias"}, "extra.weight": torch.zeros(2, 2)},
            params,
        )
    with pytest.raises(ValueError, match=r"fc1\.bias \(30,\) \(fc1\.bias has shape \(31,\)\)"):
        ti.torch_to_flax({**sd, "fc1.bias": torch.zeros(30)}, params)
    loaded = ti.torch_to_flax(
        {k: v for k, v in sd.items() if k != "fc2.bias"}, params, strict=False
    )
    assert loaded["fc2.bias"] is params["fc2.bias"]


# --------------------------------------------------------------------------- real ZeRO (gloo)
# Run as two plain subprocesses (torch only): spawning would re-import this module, jax and
# jaxzero in each child, which costs ~20 s on a 2-core machine.
_ZERO_WORKER = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
rank, port, inp = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
data = torch.load(os.path.join(inp, "in.pt"), weights_only=True)
ps = [torch.nn.Parameter(t) for t in data["params"]]
zero = ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, **data["hp"])
zero.load_state_dict(data["consolidated"])
torch.save(zero.optim.state_dict(), os.path.join(inp, f"rank{rank}.pt"))
dist.destroy_process_group()
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_export_loads_into_real_zero_redundancy_optimizer(fx, tmp_path):
    """The consolidated export, loaded by a real 2-process (gloo, 127.0.0.1)
    ZeroRedundancyOptimizer, gives each rank exactly the local state that
    export_zero_optimizer_state produces."""
    z, _ = zero()
    names = fx["names"]
    opt = ti.import_optimizer_state(
        z.init(tree_at(fx, 5)).opt_state, fx["pt"]("consolidated_opt_state.pt"), names
    )
    hp = ti.adamw_hyperparams(LR, BETAS, EPS, WD)
    consolidated = ti.export_optimizer_state(opt, names, hyperparams=hp)
    local = ti.export_zero_optimizer_state(opt, names, 2, hyperparams=hp)
    torch.save(
        {
            "params": [torch.from_numpy(fx["params"][f"step5/{n}"]) for n in names],
            "hp": dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
            "consolidated": consolidated,
        },
        tmp_path / "in.pt",
    )
    (tmp_path / "worker.py").write_text(_ZERO_WORKER)
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "worker.py"), str(r), port, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert got["param_groups"] == local[r]["param_groups"]
        assert sorted(got["state"]) == sorted(local[r]["state"])
        for j, entry in got["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(entry[key], local[r]["state"][j][key]), (r, j, key)
