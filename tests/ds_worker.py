"""One rank of a real DeepSpeed run for tests/test_deepspeed.py (launched twice, gloo, CPU).

python tests/ds_worker.py JOBS.json, with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set.
JOBS: a list of job specs, run one after the other in the same process group. A job: model
(mlp_a/mlp_b), config (ds_config), load (a save dir or null), seed, data (npz
with x[step, rank, micro, f], y[step, rank, micro]), steps, out (save dir), tag.
Builds the fixtures' models, optionally loads a checkpoint, trains, saves with DeepSpeed.
"""

import json
import os
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
    model = MlpA() if spec["model"] == "mlp_a" else MlpB()
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
    losses = []
    for s in range(spec["steps"]):
        x = torch.from_numpy(data["x"][s, rank]).to(dtype)
        out = engine(x).float()
        y = torch.from_numpy(data["y"][s, rank])
        loss = F.mse_loss(out, y) if spec["model"] == "mlp_a" else F.cross_entropy(out, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.save_checkpoint(spec["out"], tag=spec.get("tag", "after"))
    if rank == 0:
        json.dump({"losses": losses}, open(os.path.join(spec["out"], "losses.json"), "w"))


def main():
    import deepspeed.ops

    # DeepSpeed's CPU accelerator would compile a shared-memory all-reduce op (minutes, with
    # g++) on first use; gloo's all-reduce is all these runs need.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    rank = int(os.environ["RANK"])
    for spec in json.load(open(sys.argv[1])):
        run(spec, rank)


if __name__ == "__main__":
    main()
