"""Converting checkpoints between PyTorch (``ZeroRedundancyOptimizer`` + AdamW) and jaxzero.

Two directions, each a few named steps; ``jaxzero convert`` is their command line
(:mod:`jaxzero.cli.convert_torch`):

* :func:`torch_to_jax`: read the torch model ``state_dict`` file and its AdamW optimizer
  state (the consolidated ``zero.state_dict()`` or the per-rank ``zero.optim.state_dict()``
  files) -> build the params tree (torch names and layouts by default, or Flax paths from a
  name map) and a ``ZeRO(optax.adamw(...))`` with the hyper-parameters of the torch param
  group -> import the optimizer state (:mod:`jaxzero.interop.torch.optimizer_state`) -> write
  an Orbax checkpoint with :func:`jaxzero.checkpoint.save`. The metadata records the source
  files, the torch hyper-parameters, the torch names in optimizer order, the name map and the
  params structure, under ``metadata["user"]["convert"]``.
* :func:`jax_to_torch`: read such a checkpoint's metadata (the params structure comes from
  that record, or, for other jaxzero checkpoints, from the metadata's leaf table) -> build
  the AdamW transform and check the stored state against it -> restore -> write ``model.pt``,
  one ``local_opt_state_rank{r}.pt`` per rank (loadable by
  ``ZeroRedundancyOptimizer.optim.load_state_dict`` on rank r) and, optionally,
  ``consolidated_opt_state.pt`` (``ZeroRedundancyOptimizer.load_state_dict``).

Both return a :class:`ConversionResult`. Bad input raises :class:`ConvertError`, whose
messages name the offending arguments in backticks. Only AdamW (or Adam without weight decay)
in a single param group is supported. torch is imported only when these functions run.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from jaxzero import trees
from jaxzero.interop.torch import optimizer_state
from jaxzero.interop.torch.common import by_path, to_torch_shape
from jaxzero.interop.torch.convert_common import (
    CONSOLIDATED_FILE,
    CONVERT_KEY,
    FORMAT,
    MODEL_FILE,
    OPTIMIZER,
    RANK_FILE,
    ConvertError,
    adamw,
    bad_input,
    check_world_size,
    owner_ranks,
)
from jaxzero.interop.torch.jax_files import (
    JaxCheckpoint,
    check_adamw_state,
    hyperparams_of,
    read_jax_checkpoint,
)
from jaxzero.interop.torch.loading import torch_module
from jaxzero.interop.torch.names import NameMap, flax_to_torch
from jaxzero.interop.torch.torch_files import (
    TorchCheckpoint,
    build_params,
    find_rank_files,
    optimizer_from_groups,
    param_names_of,
    read_torch_checkpoint,
)

__all__ = [
    "CONSOLIDATED_FILE",
    "MODEL_FILE",
    "RANK_FILE",
    "ConversionResult",
    "ConvertError",
    "ParamRow",
    "find_rank_files",
    "jax_to_torch",
    "optimizer_from_groups",
    "param_names_of",
    "torch_to_jax",
]


@dataclasses.dataclass(frozen=True)
class ParamRow:
    """One converted param: torch ``name``, tree ``path`` (``"a/b"``), its ``shape`` in the
    tree, its ``torch_shape`` (torch layout) and the torch rank that owns it (None without a
    world size)."""

    name: str
    path: str
    shape: list[int]
    owner_rank: int | None
    torch_shape: list[int] | None = None


@dataclasses.dataclass(frozen=True)
class ConversionResult:
    """What a conversion did (or, with ``dry_run``, would do).

    ``direction`` is ``"torch2jax"`` or ``"jax2torch"``; ``files`` what is (or would be)
    written; ``written`` what was. torch -> jax also gives ``source`` (the recorded inputs),
    ``devices``, ``stage``, the TrainState ``state`` and its ``zero``; jax -> torch gives
    ``ckpt``.
    """

    direction: str
    out: str | None
    step: int
    hyperparams: dict
    params: list[ParamRow]
    files: list[str]
    dry_run: bool
    written: list[str] = dataclasses.field(default_factory=list)
    optimizer: str = OPTIMIZER
    source: dict | None = None
    ckpt: str | None = None
    devices: int | None = None
    stage: int | None = None
    state: Any = None
    zero: Any = None


def build_optimizer(tx, *, devices: int | None = None, stage: int = 1, precision=None):
    """A ``ZeRO(tx)`` on a data-parallel mesh of ``devices`` (default: all)."""
    import jax

    from jaxzero.mesh import data_parallel_mesh
    from jaxzero.train.optimizer import ZeRO

    n_dev = len(jax.devices())
    if devices is not None and not 1 <= devices <= n_dev:
        raise ConvertError(f"`devices` {devices}: this process sees {n_dev} devices")
    with bad_input():
        return ZeRO(tx, data_parallel_mesh(devices), stage=stage, precision=precision)


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
) -> ConversionResult:
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
      A :class:`ConversionResult` holding the TrainState (``state``) and its ``zero``.
    """
    source = read_torch_checkpoint(
        model, optim=optim, optim_dir=optim_dir, world_size=world_size, name_map=name_map
    )
    params_np, nm = build_params(source.state_dict, source.names, source.name_map)
    if any(n not in nm for n in source.names):  # names mapped to null are dropped
        raise ConvertError(
            "the name map drops params the optimizer state covers; map every parameter"
        )
    with bad_input():
        tx = adamw(source.hyperparams)
    zero = build_optimizer(tx, devices=devices, stage=stage)
    state = import_torch_state(source, zero, params_np, nm)
    record = _record(source, params_np, nm)
    result = _torch_result(source, out, dry_run, params_np, nm, record, state, zero)
    if dry_run:
        return result
    write_checkpoint(out, state, zero, record)
    return dataclasses.replace(result, written=[os.path.join(out, str(source.step))])


def import_torch_state(source: TorchCheckpoint, zero, params_np, nm: NameMap):
    """Step 3 of torch -> jax: ``zero.init(params)`` with the torch optimizer state and step."""
    import jax
    import jax.numpy as jnp

    state = zero.init(jax.tree.map(jnp.asarray, params_np))
    with bad_input():
        if source.rank_states is None:
            opt_state = optimizer_state.import_optimizer_state(
                state.opt_state, source.consolidated, source.names, name_map=nm
            )
        else:
            opt_state = optimizer_state.import_zero_optimizer_state(
                state.opt_state, source.rank_states, source.names,
                world_size=source.world_size, name_map=nm,
            )  # fmt: skip
    step = jax.device_put(np.int32(source.step), state.step.sharding)
    return state.replace(opt_state=opt_state, step=step)


def _record(source: TorchCheckpoint, params_np, nm: NameMap) -> dict:
    """The ``metadata["user"]["convert"]`` record of a torch -> jax conversion."""
    optim, optim_dir = source.optim, source.optim_dir
    return {
        "format": FORMAT,
        "direction": "torch2jax",
        "source": {
            "model": os.path.abspath(source.model),
            "optim": os.path.abspath(optim) if optim else None,
            "optim_dir": os.path.abspath(optim_dir) if optim_dir else None,
            "optim_files": [os.path.abspath(f) for f in source.files],
            "world_size": source.world_size,
            "torch_version": torch_module().__version__,
        },
        "optimizer": OPTIMIZER,
        "hyperparams": source.hyperparams,
        "param_names": source.names,
        "name_map": [[n, "/".join(p), k] for n, p, k in nm.entries],
        "params": [
            ["/".join(p), list(np.shape(v)), str(np.asarray(v).dtype)]
            for p, v in by_path(params_np).items()
        ],
        "step": source.step,
    }


def _torch_result(source, out, dry_run, params_np, nm, record, state, zero) -> ConversionResult:
    sd, names = source.state_dict, source.names
    numels = [math.prod(tuple(sd[n].shape)) for n in names]
    owners = owner_ranks(names, numels, source.world_size)
    table = by_path(params_np)
    rows = [
        ParamRow(
            name=n,
            path="/".join(nm.lookup(n)[0]),
            shape=list(np.shape(table[nm.lookup(n)[0]])),
            owner_rank=None if owners is None else owners[i],
            torch_shape=list(sd[n].shape),
        )
        for i, n in enumerate(names)
    ]
    return ConversionResult(
        direction="torch2jax", out=out, step=source.step, hyperparams=source.hyperparams,
        params=rows, files=[os.path.join(out or ".", str(source.step))], dry_run=dry_run,
        source=record["source"], devices=zero.num_shards,
        stage=zero.stage, state=state, zero=zero,
    )  # fmt: skip


def write_checkpoint(out: str | None, state, zero, record: dict) -> None:
    """Step 4 of torch -> jax: save ``state`` to the new Orbax directory ``out``."""
    from jaxzero import checkpoint

    if out is None:
        raise ConvertError("`out` is required")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConvertError(f"the output directory {out!r} already exists and is not empty")
    hp = record["hyperparams"]
    checkpoint.save(
        out,
        record["step"],
        state,
        zero=zero,
        metadata={CONVERT_KEY: record},
        optimizer=f"optax.adamw(lr={hp['lr']}, b1={hp['betas'][0]}, b2={hp['betas'][1]}, "
        f"eps={hp['eps']}, weight_decay={hp['weight_decay']}) from torch AdamW",
        wait=True,
    )


# ------------------------------------------------------------------ jax -> torch
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
) -> ConversionResult:
    """Write a jaxzero AdamW checkpoint as torch files.

    Writes ``out/model.pt`` (the params as a torch state_dict, torch layout, float32 master
    when the checkpoint keeps one), ``out/local_opt_state_rank{r}.pt`` for r < ``world_size``
    (each rank's ``ZeroRedundancyOptimizer.optim`` state dict) and, with ``consolidated``,
    ``out/consolidated_opt_state.pt``. Hyper-parameters come from the metadata recorded by
    :func:`torch_to_jax`, overridden by ``lr``/``betas``/``eps``/``weight_decay`` (which are
    required for other checkpoints). Names and layouts come from the recorded name map, or
    from ``name_map`` (a JSON ``{torch_name: "a/b/kernel"}``), or from the tree paths.
    """
    from jaxzero import checkpoint

    if world_size is None and not consolidated:
        raise ConvertError("give `world_size` (per-rank files) and/or `consolidated`")
    check_world_size(world_size)
    source = read_jax_checkpoint(ckpt, step=step, name_map=name_map)
    hp = hyperparams_of(source, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    tx = check_adamw_state(source, hp)
    result = _jax_result(source, out, hp, world_size, consolidated, dry_run)
    if dry_run:
        return result
    if out is None:
        raise ConvertError("`out` is required")
    # restore on a mesh of our own (any device count works)
    meta = source.meta
    dtype = (meta.get("precision") or {}).get("param_dtype", "float32")
    precision = trees.PRECISION_NAMES.get(dtype) if meta.get("has_master") else None
    zero = build_optimizer(tx, devices=devices, stage=meta.get("stage") or 1, precision=precision)
    with bad_input(FileNotFoundError, ValueError):
        state = checkpoint.restore(ckpt, zero, source.abstract, step=source.step)
    write_torch_files(out, state, source, hp, world_size=world_size, consolidated=consolidated)
    return dataclasses.replace(result, written=result.files)


def _jax_result(source: JaxCheckpoint, out, hp, world_size, consolidated, dry_run):
    files = [MODEL_FILE]
    if world_size is not None:
        files += [RANK_FILE.format(rank=r) for r in range(world_size)]
    if consolidated:
        files.append(CONSOLIDATED_FILE)
    table = by_path(source.abstract)
    shapes = {n: list(table[source.name_map.lookup(n)[0]].shape) for n in source.names}
    owners = owner_ranks(source.names, [math.prod(shapes[n]) for n in source.names], world_size)
    rows = [
        ParamRow(
            name=n,
            path="/".join(source.name_map.lookup(n)[0]),
            shape=shapes[n],
            owner_rank=None if owners is None else owners[i],
            torch_shape=list(to_torch_shape(source.name_map.lookup(n)[1], shapes[n])),
        )
        for i, n in enumerate(source.names)
    ]
    return ConversionResult(
        direction="jax2torch", out=out, step=source.step, hyperparams=hp, params=rows,
        files=[os.path.join(out or ".", f) for f in files], dry_run=dry_run, ckpt=source.path,
    )  # fmt: skip


def write_torch_files(
    out: str, state, source: JaxCheckpoint, hp: dict, *, world_size, consolidated
):
    """Step 4 of jax -> torch: ``model.pt`` and the optimizer state files under ``out``."""
    torch = torch_module()
    nm, names = source.name_map, source.names
    os.makedirs(out, exist_ok=True)
    master = state.fp32_master()  # the fp32 master whatever the placement stores
    weights = master if master is not None else state.params
    torch.save(flax_to_torch(weights, nm), os.path.join(out, MODEL_FILE))
    if world_size is not None:
        local = optimizer_state.export_zero_optimizer_state(
            state.opt_state, names, world_size, hyperparams=hp, name_map=nm
        )
        for r, rsd in enumerate(local):
            torch.save(rsd, os.path.join(out, RANK_FILE.format(rank=r)))
    if consolidated:
        cons = optimizer_state.export_optimizer_state(
            state.opt_state, names, hyperparams=hp, name_map=nm
        )
        torch.save(cons, os.path.join(out, CONSOLIDATED_FILE))
