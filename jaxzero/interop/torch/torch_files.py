"""The torch side of a conversion: reading and checking a model ``state_dict`` file and a
``ZeroRedundancyOptimizer(AdamW)`` state (consolidated, or per-rank files), and the params
tree built from them."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from jaxzero.interop.safe_pickle import UnsafeFileError
from jaxzero.interop.torch.common import is_tensor, to_flax, to_host
from jaxzero.interop.torch.convert_common import (
    ConvertError,
    check_world_size,
    nest,
    read_name_map,
)
from jaxzero.interop.torch.loading import load, optimizer_state_dict_problem
from jaxzero.interop.torch.names import NameMap

_BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
_RANK_RE = re.compile(r"rank[_-]?(\d+)\.pt$")


@dataclasses.dataclass(frozen=True)
class TorchCheckpoint:
    """A torch model and its AdamW state, read and checked (:func:`read_torch_checkpoint`).

    ``consolidated`` holds the consolidated optimizer state dict, or ``rank_states`` the
    per-rank ones; ``files`` are the optimizer files read; ``name_map`` is the JSON name map.
    """

    model: str
    state_dict: dict
    names: list[str]
    hyperparams: dict
    step: int
    optim: str | None
    optim_dir: str | None
    world_size: int | None
    files: list[str]
    consolidated: Mapping | None
    rank_states: list | None
    name_map: dict | None


def load_file(path: str, what: str):
    """``path`` read safely (CPU, weights only: :mod:`jaxzero.interop.safe_pickle`).

    Raises UnsafeFileError (a ValueError) for a file whose pickle asks for code, and
    ConvertError for a missing or unreadable one.
    """
    if not os.path.isfile(path):
        raise ConvertError(f"{what} {path!r}: no such file")
    try:
        return load(path, what)
    except UnsafeFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise ConvertError(f"{what} {path!r} cannot be read by torch.load: {e}") from None


def model_state_dict(path: str) -> dict:
    """The ``{name: tensor}`` state dict in the model file ``path`` (also inside a
    ``{"state_dict": ...}`` or ``{"model": ...}`` wrapper)."""
    sd = load_file(path, "model file")
    if isinstance(sd, Mapping) and not any(is_tensor(v) for v in sd.values()):
        for key in ("state_dict", "model"):  # {"model": state_dict, ...} wrappers
            if isinstance(sd.get(key), Mapping):
                sd = sd[key]
                break
    if not isinstance(sd, Mapping) or not sd or not all(is_tensor(v) for v in sd.values()):
        raise ConvertError(f"model file {path!r} is not a torch state_dict (name -> tensor)")
    return dict(sd)


def param_names_of(state_dict: Mapping) -> list[str]:
    """The trainable-parameter names of a torch state dict, in order (float entries, buffers
    such as BatchNorm ``running_mean``/``running_var``/``num_batches_tracked`` left out)."""
    return [
        n
        for n, v in state_dict.items()
        if v.dtype.is_floating_point and not n.endswith(_BUFFER_SUFFIXES)
    ]


def _plain(v):
    if is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, tuple | list):
        return type(v)(_plain(x) for x in v)
    return v


def optimizer_from_groups(groups: list[dict], what: str) -> dict:
    """The AdamW hyper-parameters (a torch param-group dict without ``params``) of ``groups``.

    Raises ConvertError for anything but one group of AdamW, or of Adam without weight decay.
    """
    if len(groups) != 1:
        raise ConvertError(
            f"{what} has {len(groups)} param groups; only a single param group is supported"
        )
    group = {k: _plain(v) for k, v in groups[0].items() if k != "params"}
    if not {"lr", "betas", "eps", "weight_decay"} <= set(group):
        raise ConvertError(
            f"unsupported optimizer in {what}: param group keys {sorted(group)}; only AdamW "
            f"(lr, betas, eps, weight_decay) is supported"
        )
    for flag in ("amsgrad", "maximize", "nesterov"):
        if group.get(flag):
            raise ConvertError(f"unsupported optimizer in {what}: {flag}=True (AdamW only)")
    decoupled = group.get("decoupled_weight_decay", True)
    if not decoupled and float(group["weight_decay"]) != 0.0:
        raise ConvertError(
            f"unsupported optimizer in {what}: Adam with L2 weight_decay="
            f"{group['weight_decay']} (only AdamW's decoupled weight decay is supported)"
        )
    group["betas"] = tuple(float(b) for b in group["betas"])
    return group


def _check_adam_state(sd: Mapping, what: str) -> float | None:
    """The common ``step`` of the Adam state entries (None if there are none)."""
    steps = set()
    for i, entry in sd["state"].items():
        keys = set(entry) if isinstance(entry, Mapping) else set()
        if keys != {"step", "exp_avg", "exp_avg_sq"}:
            raise ConvertError(
                f"unsupported optimizer state in {what}: param {i} has keys {sorted(keys)}; "
                f"only AdamW (step, exp_avg, exp_avg_sq) is supported"
            )
        steps.add(float(_plain(entry["step"])))
    if len(steps) > 1:
        raise ConvertError(f"{what}: params have different steps {sorted(steps)}")
    return steps.pop() if steps else None


def find_rank_files(directory: str, world_size: int) -> list[str]:
    """``DIR/*rank{r}.pt`` for r in ``range(world_size)``; ConvertError when the ranks found
    are not exactly ``0..world_size-1``."""
    if not os.path.isdir(directory):
        raise ConvertError(f"optimizer directory {directory!r}: no such directory")
    found: dict[int, list[str]] = {}
    for name in sorted(os.listdir(directory)):
        m = _RANK_RE.search(name)
        if m and os.path.isfile(os.path.join(directory, name)):
            found.setdefault(int(m.group(1)), []).append(name)
    if not found:
        raise ConvertError(f"optimizer directory {directory!r} has no per-rank files (*rank<r>.pt)")
    dup = {r: f for r, f in found.items() if len(f) > 1}
    if dup:
        raise ConvertError(f"optimizer directory {directory!r}: several files for one rank: {dup}")
    if sorted(found) != list(range(world_size)):
        raise ConvertError(
            f"world size mismatch: `world_size` {world_size} but {directory!r} holds files "
            f"for ranks {sorted(found)}"
        )
    return [os.path.join(directory, found[r][0]) for r in range(world_size)]


def _read_optimizer_file(path: str, label: str) -> tuple[dict, dict, float | None]:
    """(state dict, hyper-parameters, step) of one AdamW optimizer file; ``label`` names the
    file's role in messages ("optimizer file", "rank 3 file")."""
    what = f"{label} {path!r}"
    sd = load_file(path, label)
    problem = optimizer_state_dict_problem(sd, what)
    if problem:
        raise ConvertError(problem)
    hp = optimizer_from_groups(list(sd["param_groups"]), what)
    return sd, hp, _check_adam_state(sd, what)


def _read_consolidated(optim: str, names: list[str]) -> tuple[dict, dict, float | None]:
    opt_sd, hp, step = _read_optimizer_file(optim, "optimizer file")
    n_opt = sum(len(g["params"]) for g in opt_sd["param_groups"])
    if n_opt != len(names):
        raise ConvertError(
            f"optimizer file {optim!r} holds {n_opt} params but the model has "
            f"{len(names)} ({', '.join(names[:8])})"
        )
    return opt_sd, hp, step


def _read_ranks(files: list[str], names: list[str]) -> tuple[list, dict, float | None]:
    rank_sds, hps, steps = [], [], set()
    for r, f in enumerate(files):
        rsd, hp, s = _read_optimizer_file(f, f"rank {r} file")
        hps.append(hp)
        if s is not None:
            steps.add(s)
        rank_sds.append(rsd)
    if any(h != hps[0] for h in hps):
        raise ConvertError(f"the ranks' param groups disagree on hyper-parameters: {hps}")
    if len(steps) > 1:
        raise ConvertError(f"the ranks' states have different steps {sorted(steps)}")
    n_opt = sum(len(g["params"]) for r in rank_sds for g in r["param_groups"])
    if n_opt != len(names):
        raise ConvertError(
            f"the {len(files)} rank files hold {n_opt} params in all but the model has "
            f"{len(names)}; are they from another model or world size?"
        )
    return rank_sds, hps[0], (steps.pop() if steps else None)


def read_torch_checkpoint(
    model: str,
    *,
    optim: str | None = None,
    optim_dir: str | None = None,
    world_size: int | None = None,
    name_map: str | None = None,
) -> TorchCheckpoint:
    """Step 1 of torch -> jax: read and check the model, the optimizer state and the name map
    (arguments as in :func:`jaxzero.interop.torch.convert.torch_to_jax`)."""
    if (optim is None) == (optim_dir is None):
        raise ConvertError("give exactly one of `optim` (a file) or `optim_dir` (a directory)")
    if optim_dir is not None and world_size is None:
        raise ConvertError("`world_size` is required with `optim_dir`")
    check_world_size(world_size)
    sd = model_state_dict(model)
    names = param_names_of(sd)
    if not names:
        raise ConvertError(f"model file {model!r} has no float parameters")
    nm_json = read_name_map(name_map)
    consolidated = rank_states = None
    if optim is not None:
        files = [optim]
        consolidated, hp, step = _read_consolidated(optim, names)
    else:
        files = find_rank_files(optim_dir, world_size)
        rank_states, hp, step = _read_ranks(files, names)
    if step is None:
        raise ConvertError("the optimizer state is empty (no step taken): nothing to import")
    if not float(step).is_integer() or step < 0:
        raise ConvertError(f"the optimizer step {step} is not a non-negative integer")
    return TorchCheckpoint(
        model=model, state_dict=sd, names=names, hyperparams=hp, step=int(step), optim=optim,
        optim_dir=optim_dir, world_size=world_size, files=files, consolidated=consolidated,
        rank_states=rank_states, name_map=nm_json,
    )  # fmt: skip


def kind_for(path: tuple[str, ...], torch_shape) -> str:
    """How a torch tensor becomes the Flax leaf at ``path``: ``"linear"`` (a 2-D ``kernel``,
    transposed), ``"conv"`` (a ``kernel`` of 3 or more dimensions, its channels moved last) or
    ``"identity"``.

    Args:
      path: the Flax leaf's path, its last name ``"kernel"`` for a weight.
      torch_shape: the torch tensor's shape.

    Returns:
      The kind :func:`jaxzero.interop.torch.common.to_flax` converts the tensor by.
    """
    if path[-1] == "kernel" and len(torch_shape) == 2:
        return "linear"
    if path[-1] == "kernel" and len(torch_shape) >= 3:
        return "conv"
    return "identity"


def build_params(state_dict: Mapping, names: list[str], name_map: dict | None):
    """(params tree of numpy arrays, NameMap) from a torch state dict."""
    arrays = {n: to_host(state_dict[n]) for n in names}
    if name_map is None:
        entries = tuple((n, (n,), "identity") for n in names)
        return dict(arrays), NameMap(entries=entries)
    unknown = sorted(set(name_map) - set(state_dict))
    if unknown:
        raise ConvertError(f"name map names torch entries absent from the model: {unknown}")
    missing = [n for n in names if n not in name_map]
    if missing:
        raise ConvertError(
            f"name map has no entry for the params {missing} (map them, or to null to drop them)"
        )
    flat, entries = {}, []
    for n in names:
        if name_map[n] is None:
            continue
        path = tuple(name_map[n].split("/"))
        kind = kind_for(path, arrays[n].shape)
        flat[path] = to_flax(kind, arrays[n])
        entries.append((n, path, kind))
    return nest(flat), NameMap(entries=tuple(entries))
