"""The examples run end to end (``--smoke``, in subprocesses) and a resumed run is bit-for-bit
the uninterrupted one.

Each example runs as ``sys.executable examples/<name>.py --smoke --out-dir <tmp>`` with the
test environment (8 simulated CPU devices), without jax's persistent compilation cache: an
XLA:CPU step loaded from it can abort or hang on simulated devices (decision 52).
"""

import json
import os
import subprocess
import sys

import jaxzero as jz
from jaxzero.simulate import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TIMEOUT = 600


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = cpu_xla_flags(None, env.get("XLA_FLAGS", ""))
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(script, out_dir, *args):
    cmd = [sys.executable, os.path.join(EXAMPLES, script), "--smoke", "--out-dir", str(out_dir)]
    return subprocess.Popen(
        [*cmd, *args],
        cwd=str(out_dir),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc):
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"{proc.args} timed out:\n{out[-4000:]}") from None
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def check_outputs(run_dir):
    assert os.path.getsize(os.path.join(run_dir, "report.png")) > 10_000
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    for key in ("final", "memory", "memory_by_stage", "collectives", "median_step_ms", "table"):
        assert key in summary, key
    assert set(summary["final"]) == {"raw", "ema"}
    assert summary["devices"] == 8
    return summary


def test_gpt_zero3_offload_smoke(tmp_path):
    """``--bf16 --offload optimizer,params``: the example trains with the fp32 master, Adam,
    the EMA and the bf16 params in pinned host memory, and evaluates and samples from the
    gathered params and EMA as it does without offload."""
    args = ("--run-name", "gpt", "--bf16", "--offload", "optimizer,params", "--no-progress")
    out = finish(start("gpt_zero3.py", tmp_path, *args))
    assert "ZeRO stage 3, bf16, offload optimizer,params |" in out
    s = check_outputs(tmp_path / "gpt")
    assert s["config"]["offload"] == "optimizer,params" and s["optimizer_steps"] == 6
    assert s["final"]["raw"] < 4.6 and s["final"]["ema"] < 4.6  # below uniform over ~90 chars


def test_gpt_zero3_smoke(tmp_path):
    out = finish(start("gpt_zero3.py", tmp_path, "--run-name", "gpt"))
    s = check_outputs(tmp_path / "gpt")
    assert s["stage"] == 3 and s["steps"] == 6 and s["optimizer_steps"] == 6
    assert s["final"]["raw"] < 4.6 and s["final"]["ema"] < 4.6  # below uniform over ~90 chars
    # Stage 3 shards every persistent component: params, optimizer state and EMA ~1/8 each.
    mem = s["memory_by_stage"]
    assert mem["3"]["measured"]["params"] * 7 < mem["0"]["measured"]["params"]
    assert s["collectives"]["all-gather"]["count"] and s["collectives"]["reduce-scatter"]["count"]
    assert "validation loss" in out and "sample from the EMA weights" in out


def test_digits_smoke_and_resume(tmp_path):
    """An uninterrupted run (3 epochs x 3 steps), then one stopped after epoch 1 that resumes
    from its checkpoint (step 3) and must end bit-identical. Run one after the other (less CPU
    than running side by side)."""

    def digits(name, *extra):
        args = ("--epochs", "3", "--run-name", name, *extra)
        return finish(start("digits.py", tmp_path, *args))

    out_full = digits("full")
    out_part = digits("resumed", "--stop-after-epoch", "1")

    # The uninterrupted smoke run: outputs exist and hold the final numbers.
    s_full = check_outputs(tmp_path / "full")
    assert s_full["steps"] == 9 and s_full["optimizer_steps"] == 9
    assert s_full["resumed_from_step"] is None
    assert len(s_full["eval"]) == 3 and len(s_full["loss_history"]) == 9
    assert "test accuracy" in out_full and "median step time" in out_full
    # The estimator against the bytes measured from the demo model's arrays (N = 8, stage 2).
    from jaxzero.memory import estimate_memory

    est = estimate_memory(
        s_full["num_params"], 8, stage=s_full["stage"], precision="fp32", ema=True
    )
    m = s_full["memory"]["measured"]
    measured = m["params"] + m["master"] + m["opt_state"] + m["ema"]
    assert abs(measured / (est.params + est.optimizer + est.ema) - 1) < 0.02

    # The stopped run: a complete checkpoint at step 3, no summary yet.
    ckpt = tmp_path / "resumed" / "ckpt"
    assert "stopped after epoch 1" in out_part
    assert jz.checkpoint.latest_step(str(ckpt)) == 3
    assert not (tmp_path / "resumed" / "summary.json").exists()

    out_res = digits("resumed", "--resume")
    assert "resumed from" in out_res and "step 3" in out_res
    s_res = check_outputs(tmp_path / "resumed")
    assert s_res["resumed_from_step"] == 3
    assert jz.checkpoint.latest_step(str(ckpt)) == 9
    # Same steps, same data order, same numbers: bit-for-bit.
    for key in (
        "steps",
        "optimizer_steps",
        "ema_updates",
        "final",
        "eval",
        "loss_history",
        "params_sha256",
        "ema_sha256",
    ):
        assert s_res[key] == s_full[key], key
