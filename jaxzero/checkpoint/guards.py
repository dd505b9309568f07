"""Checks that keep a checkpoint directory one run's steps: a save refuses a directory that
holds other files and a step it would not write (Orbax returns False for a step that exists or
is older than the newest), a read names the checkpoint when it is given one step's directory,
and a restore warns when its EMA settings differ from those saved."""

from __future__ import annotations

import os
import re
import warnings

import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from jaxzero.checkpoint.structure import ITEMS

# What Orbax itself keeps in a checkpoint root besides the steps: its root metadata directory.
_ORBAX_ROOT = ("metadata",)
_TMP = ".orbax-checkpoint-tmp"
_STEP = re.compile(r"(?:.+_)?(\d+)")  # "<step>", or "<step_prefix>_<step>"


def _step_name(name: str) -> int | None:
    """The step a checkpoint root entry is named for (a finished or interrupted save)."""
    match = _STEP.fullmatch(name.split(_TMP)[0])
    return None if match is None else int(match.group(1))


def check_only_steps(mngr: ocp.CheckpointManager) -> None:
    """Raise ValueError when the manager's directory holds anything but checkpoint steps
    (hidden files aside): a save there would mix this run's steps with other data."""
    root = epath.Path(os.fspath(mngr.directory))
    if not root.is_dir():
        return
    others = sorted(
        p.name
        for p in root.iterdir()
        if not p.name.startswith(".") and p.name not in _ORBAX_ROOT and _step_name(p.name) is None
    )
    if others:
        raise ValueError(
            f"checkpoint directory {os.fspath(root)} holds files that are not checkpoint steps "
            f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); a save there "
            f"would mix them with this run's steps. Save into an empty directory (or one "
            f"holding only this run's steps), e.g. a 'checkpoints' subdirectory."
        )


def check_new_step(mngr: ocp.CheckpointManager, step: int) -> None:
    """Raise ValueError for a ``step`` Orbax would not write (it returns False): one that
    exists, or one older than the newest step."""
    steps = sorted(mngr.all_steps())
    where = os.fspath(mngr.directory)
    if step in steps:
        raise ValueError(
            f"checkpoint step {step} already exists in {where}; nothing was saved. Save under "
            f"a new step number (a larger one than {steps[-1]}), or delete the old step first "
            f"(mngr.delete({step})) to replace it."
        )
    if steps and step < steps[-1]:
        raise ValueError(
            f"checkpoint step {step} is older than the newest step {steps[-1]} in {where}, "
            f"and a checkpoint only takes newer steps; nothing was saved. After going back to "
            f"an earlier step, save into a new directory, or delete the newer steps "
            f"({[s for s in steps if s > step][:5]}, with mngr.delete(step)) first."
        )


def step_directory_hint(directory) -> str:
    """When ``directory`` is one step of a checkpoint (``ckpt/3``), the sentence that says to
    pass the checkpoint and the step instead; otherwise ``""``."""
    path = epath.Path(os.fspath(directory))
    step = _step_name(path.name)
    if step is None or not any((path / item).exists() for item in ITEMS):
        return ""
    return (
        f" {os.fspath(path)} is step {step} of the checkpoint {os.fspath(path.parent)}: pass "
        f"that directory and the step, e.g. restore({os.fspath(path.parent)!r}, zero, params, "
        f"step={step})."
    )


def warn_ema_changed(meta: dict | None, ema, step: int, directory: str) -> None:
    """Warn, naming both values, for each EMA setting of ``ema`` (a ShardedEMA, or None) that
    differs from those saved with the step (``save(..., ema=)`` records them)."""
    saved = (meta or {}).get("ema")
    if ema is None or not saved:
        return
    now = ema_settings(ema)
    changed = [
        f"{k}: saved {repr(saved[k])[:40]}, now {now[k]!r}"
        for k in now
        if k in saved and saved[k] != now[k]
    ]
    if changed:
        warnings.warn(
            f"restoring step {step} of {directory} with other EMA settings than it was saved "
            f"with ({'; '.join(changed)}); the EMA goes on with the new ones. Pass the "
            f"ShardedEMA the run was saved with to continue it unchanged.",
            UserWarning,
            stacklevel=5,
        )


def ema_settings(ema) -> dict | None:
    """The settings of a ShardedEMA that change its update (not its storage), as JSON."""
    if ema is None:
        return None
    return {
        "decay": float(ema.decay),
        "tau": None if ema.tau is None else float(ema.tau),
        "schedule": ema.schedule,
        "every": int(ema.every),
        "start_step": int(ema.start_step),
        "dtype": jnp.dtype(ema.dtype).name,
        "torch_compatible": bool(ema.torch_compatible),
    }
