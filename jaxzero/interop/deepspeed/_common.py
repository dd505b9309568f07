"""Errors and small conversions shared by the DeepSpeed reader and writer."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import jaxzero.interop.deepspeed._pickle as _pickle

_ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint that is damaged, partial or of an unsupported kind."""


class DeepSpeedSettingError(ValueError):
    """A ``ds_config`` setting that changes the update and that jaxzero does not reproduce."""


# ------------------------------------------------------------------ small helpers
def _err(path, msg: str) -> DeepSpeedCheckpointError:
    return DeepSpeedCheckpointError(f"{path}: {msg}")


def _need(d, key, path, what="file"):
    if not isinstance(d, Mapping) or key not in d:
        have = sorted(map(str, d))[:12] if isinstance(d, Mapping) else type(d).__name__
        raise _err(path, f"the {what} has no {key!r} entry (has {have}); is it damaged?")
    return d[key]


def _load(path, what):
    from jaxzero.interop.safe_pickle import UnsafeFileError

    try:
        return _pickle.load(path, what)
    except FileNotFoundError as e:
        raise DeepSpeedCheckpointError(f"{e} (partial checkpoint?)") from None
    except UnsafeFileError:
        raise
    except ValueError as e:
        raise DeepSpeedCheckpointError(str(e)) from None


def _np(x, path, what) -> np.ndarray:
    if not (type(x).__module__.startswith("torch") and hasattr(x, "shape")):
        raise _err(path, f"{what} is {type(x).__name__}, expected a tensor")
    t = x.detach().cpu().reshape(-1)
    return t.float().numpy().copy()


def _compute_array(x) -> np.ndarray:
    """A torch tensor as numpy, keeping bfloat16 (as ml_dtypes.bfloat16)."""
    import ml_dtypes
    import torch

    t = x.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def _scalar(x) -> float:
    if hasattr(x, "item"):
        x = x.item()
    return float(x)


def _shapes(groups, path) -> list[dict[str, tuple[int, ...]]]:
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise _err(path, f"param_shapes must be a list of name->shape dicts, got {groups!r}")
    return [{n: tuple(int(d) for d in s) for n, s in g.items()} for g in groups]
