"""Generate tests/fixtures/deepspeed_default_clipping: real DeepSpeed runs whose ds_config
leaves ``gradient_clipping`` out (DeepSpeed 0.19.8's default: clip at global norm 1.0).

    .venv/bin/python tests/make_ds_fixture.py [OUT_DIR]

Two gloo ranks on CPU (tests/ds_worker.py), ZeRO 1, 2 and 3, model ``mlp_c`` (Linear(32, 64),
tanh, Linear(64, 16), MSE), torch AdamW inside ZeRO (lr 1e-2, betas (0.9, 0.95), weight decay
0.1 on the weights and 0.0 on the biases), 4 examples per rank per step, 5 steps. Each run
saves a checkpoint after step 3 (tag ``step3``) and trains on to step 5 in the same process;
``trajectory.npz`` holds DeepSpeed's own full fp32 params after every step
(``deepspeed.utils.safe_get_full_fp32_param``), and
``losses.json`` its losses and ``engine.get_global_grad_norm()`` per step. The targets are
large (std 3) so that every step's gradient norm is above 1 and the clipping acts.
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "fixtures", "deepspeed_default_clipping")
WORLD, MICRO, STEPS, SAVE_AT = 2, 4, 5, 3
GROUPS = [
    {"names": ["fc1.weight", "fc2.weight"], "weight_decay": 0.1},
    {"names": ["fc1.bias", "fc2.bias"], "weight_decay": 0.0},
]


def config(stage: int) -> dict:
    """The ds_config: no ``gradient_clipping`` key (the point of the fixture)."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "train_batch_size": MICRO * WORLD,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
    }


def main(out: str) -> None:
    sys.path.insert(0, HERE)
    import ds_worker

    if os.path.isdir(out) and set(os.listdir(out)) - {"README.md"}:
        raise SystemExit(f"{out} holds a fixture already; remove all but its README.md first")
    rng = np.random.default_rng(2024)
    data = {
        "x": rng.normal(size=(STEPS, WORLD, MICRO, 32)).astype(np.float32),
        "y": (3.0 * rng.normal(size=(STEPS, WORLD, MICRO, 16))).astype(np.float32),
    }
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "data.npz"), **data)
    with tempfile.TemporaryDirectory() as work:
        jobs = []
        for stage in (1, 2, 3):  # ZeRO 3 last: it patches torch.nn.functional.linear
            run = os.path.join(work, f"z{stage}")
            jobs.append(
                {
                    "model": "mlp_c",
                    "config": config(stage),
                    "groups": GROUPS,
                    "seed": 0,
                    "data": os.path.join(out, "data.npz"),
                    "steps": STEPS,
                    "saves": {str(SAVE_AT): f"step{SAVE_AT}"},
                    "tag": None,
                    "record": os.path.join(work, f"z{stage}.npz"),
                    "out": run,
                }
            )
        ds_worker.launch(jobs, work, world=WORLD, timeout=900)
        for stage in (1, 2, 3):
            dest = os.path.join(out, f"z{stage}")
            shutil.copytree(
                os.path.join(work, f"z{stage}"),
                os.path.join(dest, "ckpt"),
                ignore=shutil.ignore_patterns("zero_to_*.py", "losses.json"),
            )
            shutil.copyfile(
                os.path.join(work, f"z{stage}", "losses.json"), os.path.join(dest, "losses.json")
            )
            shutil.copyfile(
                os.path.join(work, f"z{stage}.npz"), os.path.join(dest, "trajectory.npz")
            )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"groups": GROUPS, "ds_config": {s: config(s) for s in (1, 2, 3)}}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT)
