"""EMA checkpoints: thb1314/distributed_modelema and ultralytics/YOLOv5 <-> :class:`EmaState`."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from jaxzero.ema.ema import EmaState, like, to_per_leaf
from jaxzero.interop.torch.common import is_float, join, place, to_host
from jaxzero.interop.torch.loading import as_state_dict, load
from jaxzero.interop.torch.names import flax_to_torch, torch_to_flax

__all__ = ["import_ema", "export_ema"]

# How to turn a checkpoint that pickles the model (ultralytics/YOLOv5 ``last.pt``) into one this
# reader accepts; printed when such a file is refused.
RESAVE_EMA_HINT = (
    "An ultralytics/YOLOv5 checkpoint pickles its model objects ('ema', 'model'); if you trust "
    "the file, re-save it as a plain state dict where ultralytics is installed: "
    "ckpt = torch.load(path, weights_only=False); torch.save({'ema': "
    "ckpt['ema'].state_dict(), 'updates': ckpt['updates']}, 'ema_state_dict.pt') "
    "(ckpt['model'] when 'ema' is None), and read 'ema_state_dict.pt'"
)


def _ema_payload(ckpt):
    ckpt = load(ckpt, "EMA checkpoint file", hint=RESAVE_EMA_HINT)
    if not isinstance(ckpt, Mapping):
        raise TypeError(f"ckpt must be a dict or a path, got {type(ckpt).__name__}")
    if "param" in ckpt and "updates" in ckpt:
        sd = ckpt["param"]
    elif "ema" in ckpt and "updates" in ckpt:
        sd = ckpt["ema"]
    else:
        raise ValueError(
            f"ckpt has keys {list(ckpt)}; expected distributed ModelEMA "
            f"{{'param', 'updates'}} or ultralytics/YOLOv5 {{'ema', 'updates', ...}}"
        )
    if sd is None:
        raise ValueError(
            "ckpt['ema'] is None: a stripped ultralytics checkpoint keeps the EMA weights in "
            "ckpt['model']; load them with torch_to_flax"
        )
    sd = as_state_dict(sd)
    updates = ckpt["updates"]
    try:
        value = float(to_host(updates))
    except (TypeError, ValueError):
        value = -1.0
    if isinstance(updates, bool) or not value.is_integer() or value < 0:
        raise ValueError(f"ckpt['updates'] must be an int >= 0, got {updates!r}")
    return sd, int(value)


def import_ema(ema_state: EmaState, ckpt, *, name_map=None, strict: bool = True) -> EmaState:
    """Load a torch EMA checkpoint into a copy of ``ema_state`` (same dtypes/shardings).

    ``ckpt`` is thb1314/distributed_modelema's ``ema.state_dict()`` (``{"param", "updates"}``),
    an ultralytics/YOLOv5 checkpoint dict (``{"ema": model or state dict, "updates", ...}``),
    or a path to a file holding one of these. A path is read safely
    (:mod:`jaxzero.interop.safe_pickle`: tensors and plain values only): a file that pickles
    model objects, as ultralytics' ``last.pt`` does, is refused with ``UnsafeFileError``,
    which says how to re-save it as a state dict. Non-float entries (``num_batches_tracked``) are ignored; fp16 weights
    are cast to the EMA's dtype. ``updates`` becomes ``EmaState.updates``, so the next
    :meth:`ShardedEMA.update` uses ``updates + 1`` as torch does. A bucketed ``ema_state``
    (``ShardedEMA(bucket_leaves_up_to=...)``) gives a result stored the same way.
    """
    if not isinstance(ema_state, EmaState):
        raise TypeError(f"ema_state must be a jaxzero.EmaState, got {type(ema_state).__name__}")
    sd, updates = _ema_payload(ckpt)
    ema = torch_to_flax(sd, to_per_leaf(ema_state.ema), name_map, strict=strict)
    out = EmaState(place(np.asarray(updates), ema_state.updates), ema)
    return like(out, ema_state)


def export_ema(ema_state: EmaState, *, format: str = "modelema", name_map=None, model=None):
    """``ema_state`` as a torch EMA checkpoint dict.

    Args:
      format: ``"modelema"`` gives distributed ModelEMA's ``{"param": OrderedDict, "updates": n}``
        (float entries only); ``"ultralytics"`` gives ``{"ema": ..., "updates": n}``.
      name_map: a :class:`NameMap` or torch template fixing names and order (default:
        ``model`` if given, else names derived from the tree).
      model: for ``"ultralytics"``: a torch module (deep-copied, weights loaded, eval mode,
        ``requires_grad=False``, as ultralytics keeps its EMA) or a state dict; its non-float
        entries are kept unchanged (ultralytics never updates them). None: a plain state dict.
    """
    if not isinstance(ema_state, EmaState):
        raise TypeError(f"ema_state must be a jaxzero.EmaState, got {type(ema_state).__name__}")
    if format not in ("modelema", "ultralytics"):
        raise ValueError(f"format={format!r} must be 'modelema' or 'ultralytics'")
    ema_state = to_per_leaf(ema_state)
    updates = int(to_host(ema_state.updates))
    template = None if model is None else as_state_dict(model)
    sd = flax_to_torch(ema_state.ema, name_map if name_map is not None else template)
    if format == "modelema":
        return {"param": sd, "updates": updates}
    if template is not None:
        missing = [k for k, v in template.items() if k not in sd and is_float(v)]
        if missing:
            raise ValueError(f"the EMA has no value for the model's float entries {join(missing)}")
        sd = OrderedDict(
            (k, sd[k].to(v.dtype) if k in sd else v.detach().clone()) for k, v in template.items()
        )
    if hasattr(model, "state_dict"):
        module = copy.deepcopy(model).eval()
        module.load_state_dict(sd, strict=True)
        for p in module.parameters():
            p.requires_grad_(False)
        return {"ema": module, "updates": updates}
    return {"ema": sd, "updates": updates}
