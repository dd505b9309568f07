"""DeepSpeed checkpoint <-> jaxzero Orbax checkpoint conversion (the library side of
``jaxzero convert deepspeed2jax`` / ``jax2deepspeed``; no argparse here).

* :func:`deepspeed_to_jax` reads a DeepSpeed save dir, builds a ``ZeRO(adamw(groups))`` state
  for the chosen stage and device count and saves it with :func:`jaxzero.checkpoint.save`;
  the metadata (``user["deepspeed"]``) records the param groups, the name map, the params
  structure and the buffers' names, so that :func:`jax_to_deepspeed` can go back.
* :func:`jax_to_deepspeed` restores such a checkpoint (or one written by ``convert
  torch2jax``, one param group) and writes a DeepSpeed checkpoint for a stage and world size.

Buffers travel in ``model_state`` as ``{torch name: array}``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from jaxzero.interop.deepspeed.reader import read_checkpoint

__all__ = ["ConversionResult", "deepspeed_to_jax", "jax_to_deepspeed"]

META_KEY = "deepspeed"
FORMAT = "jaxzero.deepspeed/1"


@dataclasses.dataclass
class ConversionResult:
    """What a conversion did (``summary()`` is what the CLI prints).

    ``state``/``zero`` hold the jaxzero state and its ZeRO (deepspeed2jax, or the restored
    state for jax2deepspeed); ``written`` the files or checkpoint dirs created.
    """

    direction: str
    source: str
    out: str | None
    step: int
    ds_stage: int
    jax_stage: int
    world_size: int
    devices: int
    dtype: str
    param_groups: list[dict]
    params: list[dict]
    written: list[str] = dataclasses.field(default_factory=list)
    update: list[str] = dataclasses.field(default_factory=list)
    dry_run: bool = False
    state: Any = None
    zero: Any = None

    def summary(self) -> str:
        ds = f"DeepSpeed ZeRO-{self.ds_stage} x{self.world_size}"
        jz = f"jaxzero stage {self.jax_stage} on {self.devices} devices"
        lines = [
            f"{self.direction}: {self.source} -> {self.out}",
            f"{ds} <-> {jz}; step {self.step}; {self.dtype}",
        ]
        for i, g in enumerate(self.param_groups):
            lines.append(
                f"group {i}: {len(g['names'])} params, lr={g['lr']}, betas={tuple(g['betas'])}, "
                f"eps={g['eps']}, weight_decay={g['weight_decay']}"
            )
        lines += [f"update: {u}" for u in self.update]
        for p in self.params:
            lines.append(f"  {p['name']:<36} {str(tuple(p['shape'])):<14} {p['path']}")
        verb = "would write" if self.dry_run else "wrote"
        lines.append(f"{verb}: " + (", ".join(self.written) if self.written else "(nothing)"))
        return "\n".join(lines)


def _name_map(ckpt, name_map):
    """(params template of numpy arrays, NameMap) from a JSON file / dict name map or None."""
    from jaxzero.interop.torch.convert_common import read_name_map
    from jaxzero.interop.torch.torch_files import build_params

    nm_json = read_name_map(name_map) if isinstance(name_map, str) else name_map
    return build_params(ckpt.params, ckpt.param_names, nm_json)


def _precision(dtype: str):
    return {"bf16": "bf16", "fp16": "fp16"}.get(dtype)


def _convertible_chain(ckpt, template, nm, allow):
    """``adamw(ckpt)``, refused when its update has parts the way back cannot write."""
    from jaxzero.interop.deepspeed.jax_state import adamw, settings_of

    tx = adamw(ckpt, template, name_map=nm, allow=allow, report=None)
    lost = settings_of(tx).not_written()
    if lost:  # jax2deepspeed could not write them back
        from jaxzero.interop.deepspeed.update import DeepSpeedSettingError

        raise DeepSpeedSettingError(
            f"the run uses {lost}: deepspeed2jax converts runs whose whole update its way "
            "back (jax2deepspeed) writes, and that writes no lr scheduler state, no loss "
            "scaler and AdamW only; continue the run in Python with "
            "jaxzero.interop.deepspeed.adamw(ckpt, ...) and to_train_state (and "
            "loss_scale(ckpt) for fp16)"
        )
    return tx


def deepspeed_to_jax(
    save_dir,
    out,
    *,
    tag=None,
    stage: int = 2,
    devices: int | None = None,
    name_map=None,
    allow=(),
    dry_run: bool = False,
) -> ConversionResult:
    """Convert a DeepSpeed ZeRO checkpoint into a jaxzero Orbax checkpoint.

    Args:
      save_dir, tag: the DeepSpeed checkpoint (``tag=None``: the one in ``latest``).
      out: the Orbax directory to create (must be empty or absent).
      stage, devices: the jaxzero ZeRO stage and mesh size (default: all devices).
      name_map: a JSON file or dict ``{torch_name: "a/b/kernel"}`` (Linear weights become
        transposed kernels); default: the tree is keyed by the torch names, torch layout.
      allow: settings :func:`adamw` refuses, to convert anyway; ``update`` lists the rest.
    """
    import jax

    from jaxzero import checkpoint
    from jaxzero.interop.deepspeed.jax_state import settings_of, to_train_state
    from jaxzero.mesh import data_parallel_mesh
    from jaxzero.train.optimizer import ZeRO

    if not dry_run:
        if out is None:
            raise ValueError("out is required (or dry_run=True)")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise ValueError(f"out {out!r} already exists and is not empty")
    ckpt = read_checkpoint(save_dir, tag)
    template, nm = _name_map(ckpt, name_map)
    n_dev = len(jax.devices())
    if devices is not None and not 1 <= devices <= n_dev:
        raise ValueError(f"devices={devices}: this process sees {n_dev} devices")
    tx = _convertible_chain(ckpt, template, nm, allow)
    zero = ZeRO(tx, data_parallel_mesh(devices), stage=stage, precision=_precision(ckpt.dtype))
    state = to_train_state(ckpt, zero, template, name_map=nm, model_state=None)
    if ckpt.buffers and state.model_state is None:
        state = state.replace(
            model_state={n: jax.numpy.asarray(b) for n, b in ckpt.buffers.items()}
        )
    params = [
        {"name": n, "shape": list(np.shape(ckpt.params[n])), "path": "/".join(p), "kind": k}
        for n, p, k in nm.entries
    ]
    res = ConversionResult(
        "deepspeed2jax",
        os.fspath(save_dir),
        out,
        ckpt.step,
        ckpt.zero_stage,
        stage,
        ckpt.world_size,
        zero.num_shards,
        ckpt.dtype,
        ckpt.param_groups,
        params,
        update=settings_of(tx).lines(),
        dry_run=dry_run,
        state=state,
        zero=zero,
    )
    if dry_run:
        return res
    record = _record(save_dir, tag, ckpt, nm, template, settings_of(tx))
    checkpoint.save(
        out,
        ckpt.step,
        state,
        zero=zero,
        metadata={META_KEY: record},
        wait=True,
        optimizer=f"jaxzero.interop.deepspeed.adamw({len(ckpt.param_groups)} groups)",
    )
    res.written = [os.path.join(out, str(ckpt.step))]
    return res


def _record(save_dir, tag, ckpt, nm, template, settings) -> dict:
    """The metadata ``deepspeed2jax`` stores (``user["deepspeed"]``) for the way back."""
    return {
        "format": FORMAT,
        "source": {
            "save_dir": os.path.abspath(save_dir),
            "tag": tag,
            "ds_version": ckpt.ds_version,
            "zero_stage": ckpt.zero_stage,
            "world_size": ckpt.world_size,
            "optimizer": ckpt.optimizer,
            "ds_config": ckpt.ds_config,
        },
        "param_groups": [{**g, "betas": list(g["betas"])} for g in ckpt.param_groups],
        "name_map": [[n, "/".join(p), k] for n, p, k in nm.entries],
        "params": _params_meta(template),
        "buffers": {
            n: [list(np.shape(b)), str(np.asarray(b).dtype)] for n, b in ckpt.buffers.items()
        },
        "dtype": ckpt.dtype,
        "step": ckpt.step,
        # jax2deepspeed rebuilds the chain (the opt_state's structure depends on the clipping)
        "update": {"gradient_clipping": settings.gradient_clipping},
    }


def _params_meta(template) -> list:
    from jaxzero.interop.torch.common import by_path

    return [["/".join(p), list(np.shape(v)), "float32"] for p, v in by_path(template).items()]


def _groups_from_meta(meta: dict, ckpt_dir) -> tuple[list[dict], dict]:
    """(param groups, record) of a checkpoint written by deepspeed2jax or torch2jax."""
    user = meta.get("user") or {}
    if META_KEY in user:
        rec = user[META_KEY]
        return rec["param_groups"], rec
    if "convert" in user:  # written by `jaxzero convert torch2jax`: one AdamW group
        rec = user["convert"]
        hp = rec["hyperparams"]
        group = {
            "names": rec["param_names"],
            **{k: hp[k] for k in ("lr", "betas", "eps", "weight_decay")},
        }
        return [group], {**rec, "buffers": {}, "dtype": "fp32"}
    raise ValueError(
        f"{ckpt_dir}: the checkpoint records no param groups (it was not written by "
        "deepspeed2jax or torch2jax); use write_checkpoint(state, param_groups=...) instead"
    )


def jax_to_deepspeed(
    ckpt_dir,
    out,
    *,
    stage: int,
    world_size: int,
    step: int | None = None,
    devices: int | None = None,
    tag=None,
    ds_config=None,
    dry_run: bool = False,
) -> ConversionResult:
    """Convert a jaxzero checkpoint (from :func:`deepspeed_to_jax` or ``convert torch2jax``)
    into a DeepSpeed ZeRO ``stage`` checkpoint for ``world_size`` ranks in ``out``."""
    import jax

    from jaxzero import checkpoint
    from jaxzero.interop.deepspeed.jax_state import adamw
    from jaxzero.interop.deepspeed.writer import write_checkpoint
    from jaxzero.interop.torch.names import NameMap
    from jaxzero.mesh import data_parallel_mesh
    from jaxzero.train.optimizer import ZeRO

    if not os.path.isdir(ckpt_dir):
        raise ValueError(f"{ckpt_dir!r}: no such directory")
    meta = checkpoint.load_metadata(ckpt_dir, step)
    step = meta.get("checkpoint_step", meta.get("step"))
    groups, rec = _groups_from_meta(meta, ckpt_dir)
    leaves = {
        tuple(p.split("/")): jax.ShapeDtypeStruct(tuple(s), np.dtype(d))
        for p, s, d in rec["params"]
    }
    from jaxzero.interop.torch.convert_common import nest as _nest

    abstract = _nest(leaves)
    nm = NameMap(entries=tuple((n, tuple(p.split("/")), k) for n, p, k in rec["name_map"]))
    tx = adamw(groups, abstract, name_map=nm, ds_config=rec.get("update"), report=None)
    zero = ZeRO(
        tx,
        data_parallel_mesh(devices),
        stage=meta.get("stage") or 1,
        precision=_precision(rec.get("dtype", "fp32")) if meta.get("has_master") else None,
    )
    buffers = rec.get("buffers") or {}
    ms = {n: jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for n, (s, d) in buffers.items()} or None
    params = [
        {"name": n, "shape": list(leaves[p].shape), "path": "/".join(p)} for n, p, _ in nm.entries
    ]
    res = ConversionResult(
        "jax2deepspeed",
        os.fspath(ckpt_dir),
        out,
        step,
        stage,
        zero.stage,
        world_size,
        zero.num_shards,
        rec.get("dtype", "fp32"),
        groups,
        params,
        dry_run=dry_run,
        zero=zero,
    )
    if dry_run:
        return res
    if out is None:
        raise ValueError("out is required (or dry_run=True)")
    state = checkpoint.restore(ckpt_dir, zero, abstract, step=step, model_state=ms)
    res.state = state
    res.written = write_checkpoint(
        out,
        state,
        stage=stage,
        world_size=world_size,
        zero=zero,
        name_map=nm,
        tag=tag,
        ds_config=ds_config,
    )
    return res
