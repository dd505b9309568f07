"""Generate tests/fixtures/deepspeed_configs: real DeepSpeed 0.19.8 runs with the ``ds_config``
settings that change the update beyond AdamW and clipping: each of DeepSpeed's own lr schedulers
in a ``scheduler`` block, fp16 with dynamic loss scaling, and Adam with ``adam_w_mode: false``.

    .venv/bin/python tests/make_ds_configs_fixture.py [OUT_DIR] [CASE ...]

The runs are tests/make_ds_fixture.py's (two gloo ranks on CPU through tests/ds_worker.py,
model ``mlp_c``, the same data, torch Adam(W) inside ZeRO, weight decay 0.1 on the weights and
0.0 on the biases, 4 examples per rank per step, 5 steps, a checkpoint after step 3, the run
trained on to step 5 in the same process), one per case below. ``trajectory.npz`` holds
DeepSpeed's own full fp32 params after steps 4 and 5; ``losses.json`` the losses, gradient
norms, and each step's lr, betas and loss scale as DeepSpeed used them, its skipped steps and
loss scaler state. The fp16 case trains on its own targets (``data_fp16_dynamic.npz``).
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "fixtures", "deepspeed_configs")
WORLD, MICRO, STEPS, SAVE_AT = 2, 4, 5, 3
GROUPS = [
    {"names": ["fc1.weight", "fc2.weight"], "weight_decay": 0.1},
    {"names": ["fc1.bias", "fc2.bias"], "weight_decay": 0.0},
]
ADAMW = {
    "type": "AdamW",
    "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "torch_adam": True},
}

# case -> (ZeRO stage, the ds_config keys added to the base config)
CASES = {
    # log warm-up from warmup_min_lr 0 (lr 0 on steps 1 and 2), warmup_max_lr absent (the
    # group's lr); step 4 warms up, step 5 is past warmup_num_steps
    "warmup_lr": (
        2,
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}},
    ),
    # linear warm-up from 1e-3 to 2e-2 over 2 steps, then linear decay to 0 at step 6
    "warmup_decay_lr": (
        2,
        {
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "total_num_steps": 6,
                    "warmup_min_lr": 1e-3,
                    "warmup_max_lr": 2e-2,
                    "warmup_num_steps": 2,
                    "warmup_type": "linear",
                },
            }
        },
    ),
    # log warm-up of the ratio from 0.1 over 2 steps, then cosine to 0.05 at step 7
    "warmup_cosine_lr": (
        3,
        {
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": 6,
                    "warmup_min_ratio": 0.1,
                    "warmup_num_steps": 2,
                    "cos_min_ratio": 0.05,
                },
            }
        },
    ),
    # a 3-step cycle (up 2, down 1) of lr and, inversely, beta1 (beta2 becomes 0.99), then the
    # decay phase: step 4 ends the cycle, step 5 decays
    "one_cycle": (
        2,
        {
            "scheduler": {
                "type": "OneCycle",
                "params": {
                    "cycle_min_lr": 1e-3,
                    "cycle_max_lr": 1e-2,
                    "cycle_first_step_size": 2,
                    "cycle_second_step_size": 1,
                    "decay_step_size": 1,
                    "decay_lr_rate": 0.5,
                    "cycle_min_mom": 0.85,
                    "cycle_max_mom": 0.95,
                },
            }
        },
    ),
    # staircase range test: lr 1e-3 * (1 + 2 * floor(batch / 2)); steps 4 and 5 on two stairs
    "lr_range_test": (
        2,
        {
            "scheduler": {
                "type": "LRRangeTest",
                "params": {
                    "lr_range_test_min_lr": 1e-3,
                    "lr_range_test_step_size": 2,
                    "lr_range_test_step_rate": 2.0,
                    "lr_range_test_staircase": True,
                },
            }
        },
    ),
    # dynamic loss scaling from 2**12, window 2, hysteresis 2, on targets 1000x larger on
    # steps 1 and 4 (Y_SCALE), whose gradients overflow fp16 at any scale the run reaches;
    # the other steps' stay 8x or more below fp16's range (a 1-example jaxzero shard's are 4x
    # DeepSpeed's 4-example rank's). Step 1 overflows (skipped, hysteresis 2 -> 1), steps 2
    # and 3 are clean, step 4 overflows (skipped, hysteresis spent: the scale halves to
    # 2**11), step 5 is clean (no growth: no clean step since the overflow before it)
    "fp16_dynamic": (
        2,
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 2,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        },
    ),
    # L2-regularised Adam: the weight decay is added to the gradient before the moments
    "adam_l2": (
        1,
        {
            "optimizer": {
                "type": "Adam",
                "params": {**ADAMW["params"], "adam_w_mode": False},
            }
        },
    ),
}


# case -> the factor on each step's targets (the case's own data_CASE.npz)
Y_SCALE = {"fp16_dynamic": [1000.0, 1.0, 1.0, 1000.0, 1.0]}


def config(case: str) -> dict:
    stage, extra = CASES[case]
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "train_batch_size": MICRO * WORLD,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000000,
        "optimizer": ADAMW,
        "zero_optimization": {"stage": stage},
        **extra,
    }


def main(out: str, cases) -> None:
    sys.path.insert(0, HERE)
    import ds_worker

    taken = [c for c in cases if os.path.exists(os.path.join(out, c))]
    if taken:
        raise SystemExit(f"{out} holds the cases {taken} already; remove them first")
    rng = np.random.default_rng(2024)  # tests/make_ds_fixture.py's data
    data = {
        "x": rng.normal(size=(STEPS, WORLD, MICRO, 32)).astype(np.float32),
        "y": (3.0 * rng.normal(size=(STEPS, WORLD, MICRO, 16))).astype(np.float32),
    }
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "data.npz"), **data)
    for c in set(Y_SCALE) & set(cases):
        y = data["y"] * np.asarray(Y_SCALE[c], np.float32)[:, None, None, None]
        np.savez(os.path.join(out, f"data_{c}.npz"), x=data["x"], y=y)
    # ZeRO 3 patches torch.nn.functional.linear: its runs go last
    order = sorted(cases, key=lambda c: CASES[c][0] == 3)
    with tempfile.TemporaryDirectory() as work:
        jobs = [
            {
                "model": "mlp_c",
                "config": config(c),
                "groups": GROUPS,
                "seed": 0,
                "data": os.path.join(out, f"data_{c}.npz" if c in Y_SCALE else "data.npz"),
                "steps": STEPS,
                "saves": {str(SAVE_AT): f"step{SAVE_AT}"},
                "tag": None,
                "record": os.path.join(work, f"{c}.npz"),
                "record_steps": [4, 5],
                "out": os.path.join(work, c),
            }
            for c in order
        ]
        ds_worker.launch(jobs, work, world=WORLD, timeout=900)
        for c in order:
            dest = os.path.join(out, c)
            shutil.copytree(
                os.path.join(work, c),
                os.path.join(dest, "ckpt"),
                ignore=shutil.ignore_patterns("zero_to_*.py", "losses.json"),
            )
            shutil.copyfile(os.path.join(work, c, "losses.json"), os.path.join(dest, "losses.json"))
            shutil.copyfile(os.path.join(work, f"{c}.npz"), os.path.join(dest, "trajectory.npz"))
            with open(os.path.join(dest, "config.json"), "w") as f:
                json.dump({"groups": GROUPS, "ds_config": config(c)}, f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    out = args.pop(0) if args and args[0] not in CASES else DEFAULT_OUT
    unknown = [a for a in args if a not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {sorted(CASES)}")
    main(out, args or list(CASES))
