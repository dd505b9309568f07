"""Shared by the conversion steps (:mod:`jaxzero.interop.torch.convert`): the error type, file
names, the metadata key, the AdamW transform and small tree helpers."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

CONVERT_KEY = "convert"
FORMAT = "jaxzero.convert/1"
OPTIMIZER = "AdamW"
RANK_FILE = "local_opt_state_rank{rank}.pt"
CONSOLIDATED_FILE = "consolidated_opt_state.pt"
MODEL_FILE = "model.pt"


class ConvertError(ValueError):
    """Bad input for a conversion.

    Messages name the offending arguments of the conversion functions in single backticks
    (`` `world_size` ``), so that a front end can show them as its own options.
    """


@contextlib.contextmanager
def bad_input(*errors: type[BaseException]):
    """Re-raise ``errors`` (default TypeError, ValueError) from the block as ConvertError."""
    errors = errors or (TypeError, ValueError)
    try:
        yield
    except errors as e:
        raise ConvertError(str(e)) from None


def check_world_size(world_size: int | None) -> None:
    if world_size is not None and world_size < 1:
        raise ConvertError(f"`world_size` must be positive, got {world_size}")


def adamw(hyperparams: dict):
    """``optax.adamw`` with torch AdamW's param-group ``hyperparams``."""
    import optax

    return optax.adamw(
        float(hyperparams["lr"]),
        b1=hyperparams["betas"][0],
        b2=hyperparams["betas"][1],
        eps=float(hyperparams["eps"]),
        weight_decay=float(hyperparams["weight_decay"]),
    )


def owner_ranks(names: list[str], numels: list[int], world_size: int | None) -> list | None:
    """The rank ``ZeroRedundancyOptimizer`` gives each param (one group), or None."""
    if world_size is None:
        return None
    from jaxzero.interop.torch.optimizer_state import zero_partition

    return list(zero_partition([names], numels, world_size).owner)


def read_name_map(path: str | None) -> dict | None:
    """A JSON name map file ``{torch_name: "a/b/kernel" or null}`` (None: no file)."""
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ConvertError(f"name map {path!r}: no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConvertError(f"name map {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in data.items()
    ):
        raise ConvertError(
            f"name map {path!r} must be a JSON object {{torch_name: 'a/b/kernel' or null}}"
        )
    return data


def nest(flat: dict[tuple[str, ...], Any]) -> dict:
    """``{path tuple: value}`` as nested dicts."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConvertError(f"path {'/'.join(path)} runs through a leaf")
        if path[-1] in node:
            raise ConvertError(f"two entries map to {'/'.join(path)}")
        node[path[-1]] = value
    return out
