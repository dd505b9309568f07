"""Reading torch objects: the optional torch import, ``.pt`` files and state-dict shapes.

Files are read only through :func:`jaxzero.interop.safe_pickle.load_torch_file` (weights only,
no extra classes): a file whose pickle asks for code is refused with ``UnsafeFileError``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from jaxzero.interop.safe_pickle import RESAVE_HINT, load_torch_file, torch_module
from jaxzero.interop.torch.common import join

__all__ = ["as_state_dict", "load", "optimizer_state_dict_problem", "torch_module"]


def load(source, what: str = "torch file", hint: str = RESAVE_HINT):
    """``source`` read safely (:func:`load_torch_file`: CPU, weights only) if it is a path,
    else ``source`` itself; ``what`` and ``hint`` as in :func:`load_torch_file`."""
    if isinstance(source, str | os.PathLike):
        return load_torch_file(source, what=what, hint=hint)
    return source


def as_state_dict(source):
    """The state dict of an ``nn.Module``, or ``source`` itself if it is a mapping."""
    if hasattr(source, "state_dict") and callable(source.state_dict):
        return source.state_dict()
    if not isinstance(source, Mapping):
        raise TypeError(f"expected a state dict or nn.Module, got {type(source).__name__}")
    return source


def optimizer_state_dict_problem(sd, what: str) -> str | None:
    """Why ``sd`` is not a torch optimizer state dict (keys ``state`` and ``param_groups``),
    or None when it is one; ``what`` names it in the message."""
    if isinstance(sd, Mapping) and {"state", "param_groups"} <= set(sd):
        return None
    keys = f"[{join(map(repr, sd), 8)}]" if isinstance(sd, Mapping) else type(sd).__name__
    return (
        f"{what} is not a torch optimizer state dict (expected keys 'state' and "
        f"'param_groups', got {keys})"
    )
