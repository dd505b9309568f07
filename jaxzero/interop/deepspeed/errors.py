"""The DeepSpeed errors, and the checked reads of a checkpoint's files that raise them (an
entry, a tensor, a scalar, the param shapes) for the reader and its gathering."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import jaxzero.interop.deepspeed.pickled as pickled


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint that is damaged, partial or of an unsupported kind."""


class DeepSpeedSettingError(ValueError):
    """A ``ds_config`` setting that changes the update and that jaxzero does not reproduce."""


def error(path, msg: str) -> DeepSpeedCheckpointError:
    """A :class:`DeepSpeedCheckpointError` naming the file ``path``."""
    return DeepSpeedCheckpointError(f"{path}: {msg}")


def need(d, key, path, what="file"):
    """``d[key]``, or an error naming ``path`` and the keys ``d`` has (``what``: what was read)."""
    if not isinstance(d, Mapping) or key not in d:
        have = sorted(map(str, d))[:12] if isinstance(d, Mapping) else type(d).__name__
        raise error(path, f"the {what} has no {key!r} entry (has {have}); is it damaged?")
    return d[key]


def load(path, what):
    """The pickled ``what`` at ``path``, read by the allowlisting loader; a missing or unreadable
    file is a :class:`DeepSpeedCheckpointError` (an unsafe one stays an ``UnsafeFileError``)."""
    from jaxzero.interop.safe_pickle import UnsafeFileError

    try:
        return pickled.load(path, what)
    except FileNotFoundError as e:
        raise DeepSpeedCheckpointError(f"{e} (partial checkpoint?)") from None
    except UnsafeFileError:
        raise
    except ValueError as e:
        raise DeepSpeedCheckpointError(str(e)) from None


def float_array(x, path, what) -> np.ndarray:
    """The torch tensor ``x`` as a flat float32 numpy array (an error when it is not a tensor)."""
    if not (type(x).__module__.startswith("torch") and hasattr(x, "shape")):
        raise error(path, f"{what} is {type(x).__name__}, expected a tensor")
    t = x.detach().cpu().reshape(-1)
    return t.float().numpy().copy()


def compute_array(x) -> np.ndarray:
    """A torch tensor as numpy, keeping bfloat16 (as ml_dtypes.bfloat16)."""
    import ml_dtypes
    import torch

    t = x.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def scalar(x) -> float:
    """``x`` (a number or a one-element tensor) as a float."""
    if hasattr(x, "item"):
        x = x.item()
    return float(x)


def param_shapes(groups, path) -> list[dict[str, tuple[int, ...]]]:
    """A model file's ``param_shapes`` (one name -> shape dict per group), checked."""
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise error(path, f"param_shapes must be a list of name->shape dicts, got {groups!r}")
    return [{n: tuple(int(d) for d in s) for n, s in g.items()} for g in groups]
