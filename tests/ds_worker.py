"""One rank of a real DeepSpeed run for tests/test_deepspeed.py (launched twice, gloo, CPU).

python tests/ds_worker.py JOBS.json, with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set.
JOBS: a list of job specs, run one after the other in the same process group. A job: model
(mlp_a/mlp_b/mlp_c), config (ds_config), load (a save dir or null), seed, data (npz
with x[step, rank, micro, f], y[step, rank, micro]), steps, out (save dir), tag; optionally
saves ({"k": tag}: also save after step k), record (an npz path: DeepSpeed's own full fp32
params after every step, from deepspeed.utils.safe_get_full_fp32_param) and record_steps (the
steps to record; default all). losses.json also holds, per step, each param group's lr and betas
and the loss scale the step used, and after it the engine's skipped steps and (fp16 with dynamic
loss scaling) the loss scaler's state.
Builds the fixtures' models, optionally loads a checkpoint, trains, saves with DeepSpeed.
"""

import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class MlpA(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(17, 31)
        self.fc2 = torch.nn.Linear(31, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class MlpB(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("in_scale", torch.linspace(0.5, 1.5, 32))
        self.fc1 = torch.nn.Linear(32, 64)
        self.ln = torch.nn.LayerNorm(64)
        self.fc2 = torch.nn.Linear(64, 64)
        self.fc3 = torch.nn.Linear(64, 10)

    def forward(self, x):
        h = F.gelu(self.ln(self.fc1((x * self.in_scale).to(x.dtype))))
        return self.fc3(F.gelu(self.fc2(h)))


class MlpC(torch.nn.Module):
    """Every dimension divisible by 8 (sharded at N=8); MSE on large targets: gradient norms
    above 1, so DeepSpeed's default clipping acts."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


MODELS = {"mlp_a": MlpA, "mlp_b": MlpB, "mlp_c": MlpC}
MSE = ("mlp_a", "mlp_c")


def groups(model, name, spec=None):
    named = dict(model.named_parameters())
    if spec:
        return [
            {"params": [named[n] for n in g["names"]], "weight_decay": g["weight_decay"]}
            for g in spec
        ]
    if name == "mlp_a":
        return [{"params": list(model.parameters()), "weight_decay": 0.1}]
    w = ["fc1.weight", "fc2.weight", "fc3.weight"]
    rest = [n for n in named if n not in w]
    return [
        {"params": [named[n] for n in w], "weight_decay": 0.1},
        {"params": [named[n] for n in rest], "weight_decay": 0.0},
    ]


def run(spec, rank):
    import deepspeed

    torch.manual_seed(spec.get("seed", 0))
    model = MODELS[spec["model"]]()
    params = groups(model, spec["model"], spec.get("groups"))
    optimizer = None
    if spec.get("client_adamw"):  # a torch AdamW built by the user, not by the ds_config
        optimizer = torch.optim.AdamW(params, **spec["client_adamw"])
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=params, optimizer=optimizer, config=spec["config"]
    )
    if spec.get("load"):
        path, _ = engine.load_checkpoint(spec["load"])
        assert path is not None, "DeepSpeed did not load the checkpoint"
    data = np.load(spec["data"])
    dtype = next(engine.module.parameters()).dtype
    losses, norms, record = [], [], {}
    seen = {"lrs": [], "betas": [], "loss_scales": [], "skipped_steps": [], "loss_scaler_after": []}
    saves = spec.get("saves") or {}
    for s in range(spec["steps"]):
        x = torch.from_numpy(data["x"][s, rank]).to(dtype)
        out = engine(x).float()
        y = torch.from_numpy(data["y"][s, rank])
        loss = F.mse_loss(out, y) if spec["model"] in MSE else F.cross_entropy(out, y)
        engine.backward(loss)
        # the lr and betas this step uses, and the loss scale it multiplied the loss by
        seen["lrs"].append([float(g["lr"]) for g in engine.optimizer.param_groups])
        seen["betas"].append(
            [[float(b) for b in g["betas"]] for g in engine.optimizer.param_groups]
        )
        scale = getattr(engine.optimizer, "loss_scale", None)
        seen["loss_scales"].append(None if scale is None else float(scale))
        engine.step()
        seen["skipped_steps"].append(int(engine.skipped_steps))
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if getattr(scaler, "dynamic", False):  # the dynamic loss scaler's state after the step
            keys = ("cur_scale", "cur_hysteresis", "cur_iter", "last_overflow_iter")
            seen["loss_scaler_after"].append({k: getattr(scaler, k) for k in keys})
        losses.append(float(loss.detach()))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        if spec.get("record") and s + 1 in spec.get("record_steps", range(1, spec["steps"] + 1)):
            record.update(full_state(engine, s + 1))
        if str(s + 1) in saves:
            engine.save_checkpoint(spec["out"], tag=saves[str(s + 1)])
    if spec.get("tag", "after") is not None:  # "tag": null saves only at the `saves` steps
        engine.save_checkpoint(spec["out"], tag=spec.get("tag", "after"))
    if rank == 0:
        info = {"losses": losses, "grad_norms": norms, **seen}
        json.dump(info, open(os.path.join(spec["out"], "losses.json"), "w"))
        if spec.get("record"):
            np.savez(spec["record"], **record)


def full_state(engine, k):
    """``{"params/k/name": DeepSpeed's full fp32 master after step k}`` (a collective at ZeRO
    3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        f"params/{k}/{name}": safe_get_full_fp32_param(p).detach().cpu().numpy()
        for name, p in engine.module.named_parameters()
    }


def launch(jobs, work_dir, world=2, timeout=400):
    """Run ``jobs`` on ``world`` ranks of this worker (gloo on 127.0.0.1, DeepSpeed's CPU
    accelerator); raises AssertionError with the ranks' output tails when one fails."""
    path = os.path.join(work_dir, "jobs.json")
    with open(path, "w") as f:
        json.dump(jobs, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DS_ACCELERATOR="cpu",
            OMP_NUM_THREADS="1",
            JAX_PLATFORMS="cpu",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), path],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise AssertionError("DeepSpeed workers failed:\n" + "\n".join(o[-4000:] for o in outs))


def main():
    import deepspeed.ops

    # DeepSpeed's CPU accelerator would compile a shared-memory all-reduce op (minutes, with
    # g++) on first use; gloo's all-reduce is all these runs need.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    rank = int(os.environ["RANK"])
    for spec in json.load(open(sys.argv[1])):
        run(spec, rank)
    # Without it gloo's worker threads can outlive the interpreter and abort the exit with
    # "terminate called without an active exception" (pytorch/pytorch#190489).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # and even then, under load, a gloo thread can still abort the interpreter's teardown with
    # it: the work is done and written, so leave without a teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
