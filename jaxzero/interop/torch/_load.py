"""Reading torch objects: the optional torch import, ``.pt`` files and state-dict shapes."""

from __future__ import annotations

import os
from collections.abc import Mapping

from jaxzero.interop.torch._common import join


def torch_module():
    """The ``torch`` module, or an ImportError saying how to install it."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this needs PyTorch: pip install 'jaxzero[torch]' (torch==2.13.0)") from e
    return torch


def load(source):
    """``source`` read with ``torch.load`` (CPU, weights only) if it is a path, else itself."""
    if isinstance(source, str | os.PathLike):
        return torch_module().load(source, map_location="cpu", weights_only=True)
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
