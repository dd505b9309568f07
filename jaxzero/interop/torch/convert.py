"""Converting checkpoints between PyTorch (``ZeroRedundancyOptimizer`` + AdamW) and jaxzero.

Two directions, both also behind ``jaxzero convert`` (see :func:`register_cli`):

* :func:`torch_to_jax` reads a torch model ``state_dict`` file and an AdamW optimizer state
  (the consolidated ``zero.state_dict()`` or the per-rank ``zero.optim.state_dict()`` files),
  builds a params tree (torch names and layouts by default, or Flax paths from a name map),
  a ``ZeRO(optax.adamw(...))`` state with the hyper-parameters of the torch param group,
  imports the optimizer state (:mod:`jaxzero.torch_interop`) and saves an Orbax checkpoint
  with :func:`jaxzero.checkpoint.save`. The metadata records the source files, the torch
  hyper-parameters, the torch names in optimizer order, the name map and the params
  structure, under ``metadata["user"]["convert"]``.
* :func:`jax_to_torch` restores such a checkpoint (the params structure comes from that
  metadata, or, for other jaxzero checkpoints, from the metadata's leaf table) and writes
  ``model.pt``, one ``local_opt_state_rank{r}.pt`` per rank (loadable by
  ``ZeroRedundancyOptimizer.optim.load_state_dict`` on rank r) and, optionally,
  ``consolidated_opt_state.pt`` (``ZeroRedundancyOptimizer.load_state_dict``).

Only AdamW (or Adam without weight decay) in a single param group is supported.
torch is imported only when these functions run.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["ConvertError", "torch_to_jax", "jax_to_torch"]

CONVERT_KEY = "convert"
FORMAT = "jaxzero.convert/1"
RANK_FILE = "local_opt_state_rank{rank}.pt"
CONSOLIDATED_FILE = "consolidated_opt_state.pt"
MODEL_FILE = "model.pt"
_BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")
_RANK_RE = re.compile(r"rank[_-]?(\d+)\.pt$")


class ConvertError(ValueError):
    """Bad input for a conversion (the CLI prints it as a one-line error, exit status 2)."""


# ------------------------------------------------------------------ torch side helpers
def _torch():
    from jaxzero.interop.torch.names import _torch as get

    return get()


def _load_pt(path: str, what: str):
    if not os.path.isfile(path):
        raise ConvertError(f"{what} {path!r}: no such file")
    try:
        return _torch().load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise ConvertError(f"{what} {path!r} cannot be read by torch.load: {e}") from None


def _model_state_dict(path: str) -> dict:
    sd = _load_pt(path, "model file")
    if isinstance(sd, Mapping) and not any(_is_tensor(v) for v in sd.values()):
        for key in ("state_dict", "model"):  # {"model": state_dict, ...} wrappers
            if isinstance(sd.get(key), Mapping):
                sd = sd[key]
                break
    if not isinstance(sd, Mapping) or not sd or not all(_is_tensor(v) for v in sd.values()):
        raise ConvertError(f"model file {path!r} is not a torch state_dict (name -> tensor)")
    return dict(sd)


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "shape")


def param_names_of(state_dict: Mapping) -> list[str]:
    """The trainable-parameter names of a torch state dict, in order (float entries, buffers
    such as BatchNorm ``running_mean``/``running_var``/``num_batches_tracked`` left out)."""
    return [
        n
        for n, v in state_dict.items()
        if v.dtype.is_floating_point and not n.endswith(_BUFFER_SUFFIXES)
    ]


def _check_opt_sd(sd, what: str) -> None:
    if not isinstance(sd, Mapping) or not {"state", "param_groups"} <= set(sd):
        keys = list(sd)[:8] if isinstance(sd, Mapping) else type(sd).__name__
        raise ConvertError(
            f"{what} is not a torch optimizer state dict (expected keys 'state' and "
            f"'param_groups', got {keys})"
        )


def _plain(v):
    if _is_tensor(v):
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
        raise ConvertError(f"--optim-dir {directory!r}: no such directory")
    found: dict[int, list[str]] = {}
    for name in sorted(os.listdir(directory)):
        m = _RANK_RE.search(name)
        if m and os.path.isfile(os.path.join(directory, name)):
            found.setdefault(int(m.group(1)), []).append(name)
    if not found:
        raise ConvertError(f"--optim-dir {directory!r} has no per-rank files (*rank<r>.pt)")
    dup = {r: f for r, f in found.items() if len(f) > 1}
    if dup:
        raise ConvertError(f"--optim-dir {directory!r}: several files for one rank: {dup}")
    if sorted(found) != list(range(world_size)):
        raise ConvertError(
            f"world size mismatch: --world-size {world_size} but {directory!r} holds files "
            f"for ranks {sorted(found)}"
        )
    return [os.path.join(directory, found[r][0]) for r in range(world_size)]


# ------------------------------------------------------------------ params trees
def _read_name_map(path: str | None) -> dict | None:
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


def _nest(flat: dict[tuple[str, ...], Any]) -> dict:
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


def _kind_for(path: tuple[str, ...], torch_shape) -> str:
    if path[-1] == "kernel" and len(torch_shape) == 2:
        return "linear"
    if path[-1] == "kernel" and len(torch_shape) >= 3:
        return "conv"
    return "identity"


def build_params(state_dict: Mapping, names: list[str], name_map: dict | None):
    """(params tree of numpy arrays, NameMap) from a torch state dict."""
    from jaxzero.interop.torch import names as tn

    arrays = {n: tn._host(state_dict[n]) for n in names}
    if name_map is None:
        entries = tuple((n, (n,), "identity") for n in names)
        return dict(arrays), tn.NameMap(entries=entries)
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
        kind = _kind_for(path, arrays[n].shape)
        flat[path] = tn._to_flax(kind, arrays[n])
        entries.append((n, path, kind))
    return _nest(flat), tn.NameMap(entries=tuple(entries))


# ------------------------------------------------------------------ torch -> jax
def torch_to_jax(
    model: str,
    out: str | None,
    *,
    optim: str | None = None,
    optim_dir: str | None = None,
    world_size: int | None = None,
    devices: int | None = None,
    stage: int = 1,
    name_map: str | None = None,
    dry_run: bool = False,
) -> dict:
    """Convert a torch model + ZeRO/AdamW optimizer state into a jaxzero Orbax checkpoint.

    Args:
      model: path of a torch ``state_dict`` file.
      out: the Orbax checkpoint directory to create (must not hold anything yet).
      optim: a consolidated optimizer state dict file (``zero.state_dict()``), or
      optim_dir: a directory of per-rank ``zero.optim.state_dict()`` files ``*rank{r}.pt``,
        with ``world_size`` (required; the ranks found must be exactly ``0..world_size-1``).
      devices, stage: the data-parallel mesh size (default: all devices) and ZeRO stage.
      name_map: a JSON file ``{torch_name: "a/b/kernel"}`` giving a Flax layout (Linear
        weights transposed to kernels, conv weights to ``[*k, in, out]``); default: the params
        tree is keyed by the torch names, in torch layout.
      dry_run: validate and import everything but write nothing.

    Returns:
      A summary dict (also what the CLI prints), with ``"state"`` (the TrainState) and
      ``"zero"``.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxzero import checkpoint
    from jaxzero.interop.torch import names as tn
    from jaxzero.interop.torch import optimizer_state as tos
    from jaxzero.mesh import data_parallel_mesh
    from jaxzero.zero.config import ZeRO

    if (optim is None) == (optim_dir is None):
        raise ConvertError("give exactly one of --optim FILE or --optim-dir DIR")
    if optim_dir is not None and world_size is None:
        raise ConvertError("--world-size is required with --optim-dir")
    if world_size is not None and world_size < 1:
        raise ConvertError(f"--world-size must be positive, got {world_size}")
    sd = _model_state_dict(model)
    names = param_names_of(sd)
    if not names:
        raise ConvertError(f"model file {model!r} has no float parameters")
    nm_json = _read_name_map(name_map)

    if optim is not None:
        opt_sd = _load_pt(optim, "optimizer file")
        _check_opt_sd(opt_sd, f"optimizer file {optim!r}")
        hp = optimizer_from_groups(list(opt_sd["param_groups"]), f"optimizer file {optim!r}")
        step = _check_adam_state(opt_sd, f"optimizer file {optim!r}")
        n_opt = sum(len(g["params"]) for g in opt_sd["param_groups"])
        if n_opt != len(names):
            raise ConvertError(
                f"optimizer file {optim!r} holds {n_opt} params but the model has "
                f"{len(names)} ({', '.join(names[:8])})"
            )
        rank_sds, files = None, [optim]
    else:
        files = find_rank_files(optim_dir, world_size)
        rank_sds, hps, steps = [], [], set()
        for r, f in enumerate(files):
            rsd = _load_pt(f, f"rank {r} file")
            _check_opt_sd(rsd, f"rank {r} file {f!r}")
            hps.append(optimizer_from_groups(list(rsd["param_groups"]), f"rank {r} file {f!r}"))
            s = _check_adam_state(rsd, f"rank {r} file {f!r}")
            if s is not None:
                steps.add(s)
            rank_sds.append(rsd)
        if any(h != hps[0] for h in hps):
            raise ConvertError(f"the ranks' param groups disagree on hyper-parameters: {hps}")
        if len(steps) > 1:
            raise ConvertError(f"the ranks' states have different steps {sorted(steps)}")
        hp, step = hps[0], (steps.pop() if steps else None)
        n_opt = sum(len(g["params"]) for r in rank_sds for g in r["param_groups"])
        if n_opt != len(names):
            raise ConvertError(
                f"the {world_size} rank files hold {n_opt} params in all but the model has "
                f"{len(names)}; are they from another model or world size?"
            )
    if step is None:
        raise ConvertError("the optimizer state is empty (no step taken): nothing to import")
    if not float(step).is_integer() or step < 0:
        raise ConvertError(f"the optimizer step {step} is not a non-negative integer")
    step = int(step)

    params_np, nm = build_params(sd, names, nm_json)
    opt_names = [n for n in names if n in nm]  # names mapped to null are dropped
    if len(opt_names) != len(names):
        raise ConvertError(
            "the name map drops params the optimizer state covers; map every parameter"
        )
    numels = [math.prod(tuple(sd[n].shape)) for n in names]
    owners = None
    if world_size is not None:
        plan = tos._zero_plan([names], numels, world_size)
        owners = list(plan.owner)

    n_dev = len(jax.devices())
    if devices is not None and not 1 <= devices <= n_dev:
        raise ConvertError(f"--devices {devices}: this process sees {n_dev} devices")
    try:
        tx = optax.adamw(
            float(hp["lr"]),
            b1=hp["betas"][0],
            b2=hp["betas"][1],
            eps=float(hp["eps"]),
            weight_decay=float(hp["weight_decay"]),
        )
        zero = ZeRO(tx, data_parallel_mesh(devices), stage=stage)
    except (TypeError, ValueError) as e:
        raise ConvertError(str(e)) from None
    params = jax.tree.map(jnp.asarray, params_np)
    state = zero.init(params)
    try:
        if rank_sds is None:
            opt_state = tos.import_optimizer_state(state.opt_state, opt_sd, names, name_map=nm)
        else:
            opt_state = tos.import_zero_optimizer_state(
                state.opt_state, rank_sds, names, world_size=world_size, name_map=nm
            )
    except (TypeError, ValueError) as e:
        raise ConvertError(str(e)) from None
    state = state.replace(
        opt_state=opt_state, step=jax.device_put(np.int32(step), state.step.sharding)
    )

    params_meta = [
        ["/".join(p), list(np.shape(v)), str(np.asarray(v).dtype)]
        for p, v in tn._table(params_np).items()
    ]
    record = {
        "format": FORMAT,
        "direction": "torch2jax",
        "source": {
            "model": os.path.abspath(model),
            "optim": os.path.abspath(optim) if optim else None,
            "optim_dir": os.path.abspath(optim_dir) if optim_dir else None,
            "optim_files": [os.path.abspath(f) for f in files],
            "world_size": world_size,
            "torch_version": _torch().__version__,
        },
        "optimizer": "AdamW",
        "hyperparams": hp,
        "param_names": names,
        "name_map": [[n, "/".join(p), k] for n, p, k in nm.entries],
        "params": params_meta,
        "step": step,
    }
    summary = {
        "direction": "torch2jax",
        "out": out,
        "step": step,
        "optimizer": "AdamW",
        "hyperparams": hp,
        "source": record["source"],
        "params": [
            {
                "name": n,
                "torch_shape": list(sd[n].shape),
                "path": "/".join(nm.lookup(n)[0]),
                "shape": list(np.shape(tn._table(params_np)[nm.lookup(n)[0]])),
                "owner_rank": None if owners is None else owners[i],
            }
            for i, n in enumerate(names)
        ],
        "devices": zero.num_shards,
        "stage": stage,
        "dry_run": dry_run,
        "state": state,
        "zero": zero,
    }
    if dry_run:
        return summary
    if out is None:
        raise ConvertError("--out is required")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConvertError(f"--out {out!r} already exists and is not empty")
    checkpoint.save(
        out,
        step,
        state,
        zero=zero,
        metadata={CONVERT_KEY: record},
        optimizer=f"optax.adamw(lr={hp['lr']}, b1={hp['betas'][0]}, b2={hp['betas'][1]}, "
        f"eps={hp['eps']}, weight_decay={hp['weight_decay']}) from torch AdamW",
        wait=True,
    )
    summary["written"] = [os.path.join(out, str(step))]
    return summary


# ------------------------------------------------------------------ jax -> torch
def _params_from_leaf_table(meta: dict):
    """Params structure ``[(path tuple, shape, dtype)]`` from a checkpoint's leaf table (keys
    split on '.', so keys that contain dots cannot be recovered this way)."""
    rows = [r for r in meta.get("leaves", []) if str(r["path"]).startswith("params.")]
    if not rows:
        raise ConvertError("the checkpoint metadata lists no params leaves")
    return [(tuple(r["path"].split(".")[1:]), tuple(r["shape"]), r["dtype"]) for r in rows]


def jax_to_torch(
    ckpt: str,
    out: str | None,
    *,
    world_size: int | None = None,
    consolidated: bool = False,
    name_map: str | None = None,
    step: int | None = None,
    devices: int | None = None,
    lr: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    dry_run: bool = False,
) -> dict:
    """Write a jaxzero AdamW checkpoint as torch files.

    Writes ``out/model.pt`` (the params as a torch state_dict, torch layout, float32 master
    when the checkpoint keeps one), ``out/local_opt_state_rank{r}.pt`` for r < ``world_size``
    (each rank's ``ZeroRedundancyOptimizer.optim`` state dict) and, with ``consolidated``,
    ``out/consolidated_opt_state.pt``. Hyper-parameters come from the metadata recorded by
    :func:`torch_to_jax`, overridden by ``lr``/``betas``/``eps``/``weight_decay`` (which are
    required for other checkpoints). Names and layouts come from the recorded name map, or
    from ``name_map`` (a JSON ``{torch_name: "a/b/kernel"}``), or from the tree paths.
    """
    import jax
    import optax

    from jaxzero import checkpoint
    from jaxzero.interop.torch import names as tn
    from jaxzero.interop.torch import optimizer_state as tos
    from jaxzero.mesh import data_parallel_mesh
    from jaxzero.zero.config import ZeRO

    if world_size is None and not consolidated:
        raise ConvertError("give --world-size N (per-rank files) and/or --consolidated")
    if world_size is not None and world_size < 1:
        raise ConvertError(f"--world-size must be positive, got {world_size}")
    if not os.path.isdir(ckpt):
        raise ConvertError(f"--ckpt {ckpt!r}: no such directory")
    try:
        meta = checkpoint.load_metadata(ckpt, step)
    except (FileNotFoundError, ValueError) as e:
        raise ConvertError(str(e)) from None
    step = meta.get("checkpoint_step", meta.get("step"))
    rec = (meta.get("user") or {}).get(CONVERT_KEY) or {}
    if meta.get("has_ema"):
        raise ConvertError("checkpoints with an EMA are not supported by convert yet")

    # params structure
    if rec.get("params"):
        leaves = [(tuple(p.split("/")), tuple(s), d) for p, s, d in rec["params"]]
    else:
        leaves = _params_from_leaf_table(meta)
    abstract = _nest({p: jax.ShapeDtypeStruct(s, np.dtype(d)) for p, s, d in leaves})

    # names and layouts
    nm_json = _read_name_map(name_map)
    if nm_json is not None:
        missing = sorted("/".join(p) for p, _, _ in leaves if "/".join(p) not in nm_json.values())
        if missing:
            raise ConvertError(f"name map has no torch name for the tree leaves {missing}")
        try:
            nm = tn.build_name_map(
                [n for n, v in nm_json.items() if v is not None],
                abstract,
                overrides={n: v for n, v in nm_json.items() if v is not None},
            )
        except (TypeError, ValueError) as e:
            raise ConvertError(str(e)) from None
        names = list(nm.torch_names)
    elif rec.get("name_map"):
        nm = tn.NameMap(entries=tuple((n, tuple(p.split("/")), k) for n, p, k in rec["name_map"]))
        names = list(rec.get("param_names") or nm.torch_names)
    else:
        try:
            nm = tn.build_name_map(None, abstract)
        except ValueError as e:
            raise ConvertError(str(e)) from None
        names = list(nm.torch_names)

    # optimizer
    hp = dict(rec.get("hyperparams") or {})
    if rec and rec.get("optimizer") not in (None, "AdamW"):
        raise ConvertError(f"unsupported optimizer {rec.get('optimizer')!r} (AdamW only)")
    over = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    if not hp:
        if lr is None:
            raise ConvertError(
                "the checkpoint records no torch hyper-parameters (not written by convert "
                "torch2jax): give --lr (and --betas/--eps/--weight-decay if not the defaults)"
            )
        hp = tos.adamw_hyperparams(**{k: v for k, v in over.items() if v is not None})
    hp.update({k: v for k, v in over.items() if v is not None})
    hp["betas"] = tuple(float(b) for b in hp["betas"])
    tx = optax.adamw(
        float(hp["lr"]),
        b1=hp["betas"][0],
        b2=hp["betas"][1],
        eps=float(hp["eps"]),
        weight_decay=float(hp["weight_decay"]),
    )
    want = checkpoint._node_types(jax.eval_shape(tx.init, abstract))
    got = meta.get("opt_state_types") or []
    if got != want:
        raise ConvertError(
            f"unsupported optimizer: the checkpoint's optimizer state is [{', '.join(got)}] "
            f"(optimizer {meta.get('optimizer')!r}); only optax.adamw ([{', '.join(want)}]) "
            f"is supported"
        )

    files = [MODEL_FILE]
    if world_size is not None:
        files += [RANK_FILE.format(rank=r) for r in range(world_size)]
    if consolidated:
        files.append(CONSOLIDATED_FILE)
    shapes = {n: list(tn._table(abstract)[nm.lookup(n)[0]].shape) for n in names}
    owners = None
    if world_size is not None:
        numels = [math.prod(shapes[n]) for n in names]
        owners = list(tos._zero_plan([names], numels, world_size).owner)
    summary = {
        "direction": "jax2torch",
        "ckpt": ckpt,
        "out": out,
        "step": step,
        "optimizer": "AdamW",
        "hyperparams": hp,
        "params": [
            {
                "name": n,
                "path": "/".join(nm.lookup(n)[0]),
                "shape": shapes[n],
                "owner_rank": None if owners is None else owners[i],
            }
            for i, n in enumerate(names)
        ],
        "files": [os.path.join(out or ".", f) for f in files],
        "dry_run": dry_run,
    }
    if dry_run:
        return summary
    if out is None:
        raise ConvertError("--out is required")

    # restore on a mesh of our own (any device count works)
    prec = (meta.get("precision") or {}).get("param_dtype", "float32")
    precision = (
        {"bfloat16": "bf16", "float16": "fp16"}.get(prec) if meta.get("has_master") else None
    )
    n_dev = len(jax.devices())
    if devices is not None and not 1 <= devices <= n_dev:
        raise ConvertError(f"--devices {devices}: this process sees {n_dev} devices")
    zero = ZeRO(tx, data_parallel_mesh(devices), stage=meta.get("stage") or 1, precision=precision)
    try:
        state = checkpoint.restore(ckpt, zero, abstract, step=step)
    except (FileNotFoundError, ValueError) as e:
        raise ConvertError(str(e)) from None

    torch = _torch()
    os.makedirs(out, exist_ok=True)
    weights = state.master if state.master is not None else state.params
    torch.save(tn.flax_to_torch(weights, nm), os.path.join(out, MODEL_FILE))
    if world_size is not None:
        local = tos.export_zero_optimizer_state(
            state.opt_state, names, world_size, hyperparams=hp, name_map=nm
        )
        for r, rsd in enumerate(local):
            torch.save(rsd, os.path.join(out, RANK_FILE.format(rank=r)))
    if consolidated:
        cons = tos.export_optimizer_state(state.opt_state, names, hyperparams=hp, name_map=nm)
        torch.save(cons, os.path.join(out, CONSOLIDATED_FILE))
    summary["written"] = summary["files"]
    return summary
