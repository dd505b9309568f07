"""Writing DeepSpeed 0.19.8 ZeRO checkpoints that ``engine.load_checkpoint`` and
``zero_to_fp32`` read. DeepSpeed is not needed: its three pickled classes are written from
the stand-ins of :mod:`jaxzero.interop.deepspeed.pickled`.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

import jaxzero.interop.deepspeed.layout as L
import jaxzero.interop.deepspeed.pickled as pickled
import jaxzero.interop.deepspeed.update as U
from jaxzero.interop.deepspeed.pickled import LossScaler, ZeroStageEnum, fragment_address
from jaxzero.interop.deepspeed.reader import (
    MODEL_FILE,
    OPTIM_FILE,
    ZERO3_MODEL_FILE,
    DeepSpeedCheckpoint,
)

__all__ = ["write_checkpoint", "default_ds_config"]

DS_VERSION = "0.19.8"
_TORCH_GROUP_KEYS = dict(
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=None,
    decoupled_weight_decay=True,
)


def _t(a):
    """A numpy array as a torch tensor (bfloat16 kept)."""
    import ml_dtypes
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def default_ds_config(ckpt: DeepSpeedCheckpoint, stage: int, world_size: int) -> dict:
    """A ds_config for the written checkpoint: the checkpoint's own with the stage replaced, or
    a minimal AdamW one (``torch_adam`` true, so nothing is compiled); ``gradient_clipping``
    is always written out (the checkpoint's)."""
    cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (ckpt.ds_config or {}).items()}
    cfg["gradient_clipping"] = U.effective_clipping(ckpt.ds_config, ckpt.gradient_clipping)
    if "optimizer" not in cfg:
        g = ckpt.param_groups[0]
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": g["lr"],
                "betas": list(g["betas"]),
                "eps": g["eps"],
                "weight_decay": g["weight_decay"],
                "torch_adam": True,
            },
        }
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    cfg.setdefault("gradient_accumulation_steps", 1)
    cfg.setdefault("train_batch_size", cfg["train_micro_batch_size_per_gpu"] * world_size)
    cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": stage}
    cfg.setdefault("bf16", {"enabled": ckpt.dtype == "bf16"})
    cfg.setdefault("fp16", {"enabled": ckpt.dtype == "fp16"})
    return cfg


def _torch_optimizer(cfg: dict, ckpt: DeepSpeedCheckpoint) -> bool:
    opt = cfg.get("optimizer") or {}
    return bool((opt.get("params") or {}).get("torch_adam")) or ckpt.optimizer.startswith("torch")


def _group_dict(g: dict, params: list[int], torch_opt: bool) -> dict:
    group = {
        "weight_decay": g["weight_decay"],
        "lr": g["lr"],
        "bias_correction": True,
        "betas": list(g["betas"]),
        "eps": g["eps"],
        "step": 0,
    }
    if torch_opt:
        group.update(_TORCH_GROUP_KEYS, betas=tuple(g["betas"]))
    return {**group, "params": params}


def _adam_state(step: int, m, v, torch_opt: bool) -> dict:
    import torch

    s = torch.tensor(float(step)) if torch_opt else int(step)
    return {"step": s, "exp_avg": _t(m), "exp_avg_sq": _t(v)}


def _model_states(ckpt, cfg, world_size: int, shapes, zero3: bool) -> dict:
    import torch

    module = OrderedDict()
    for n in ckpt.param_names:
        if zero3:
            module[n] = _t(np.zeros(0, ckpt.module[n].dtype))
        else:
            module[n] = _t(ckpt.module[n])
    for n, b in ckpt.buffers.items():
        module[n] = _t(np.asarray(b))
    return {
        "module": module,
        "buffer_names": list(ckpt.buffers),
        "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in g.items()) for g in shapes],
        "frozen_param_shapes": OrderedDict(),
        "shared_params": {},
        "frozen_param_fragments": OrderedDict(),
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": int(ckpt.global_steps if ckpt.global_steps is not None else ckpt.step),
        "global_samples": int(ckpt.step) * int(cfg.get("train_batch_size", world_size)),
        "dp_world_size": world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": cfg,
        "ds_version": DS_VERSION,
    }


def _zero12_files(ckpt, cfg, world_size: int, stage: int, torch_opt: bool, clip: float):
    """(param_shapes, [rank optimizer_state_dict]) for ZeRO 1/2."""
    zcfg = cfg.get("zero_optimization", {})
    elsize = 4 if ckpt.dtype == "fp32" else 2
    shapes, ranks = (
        [],
        [dict(fp32=[], m=[], v=[], pad=[], apad=[], maps=[]) for _ in range(world_size)],
    )
    for g in ckpt.param_groups:
        names = list(g["names"])
        if zcfg.get("round_robin_gradients"):
            names = L.round_robin_order(names, world_size)
        numels = [int(np.asarray(ckpt.params[n]).size) for n in names]
        align = L.param_alignment(elsize) if zcfg.get("parameter_alignment") else 1
        pads = L.alignment_paddings(numels, align)
        offsets, used = L.zero12_offsets(numels, pads)
        size = L.zero12_partition_size(used, world_size)
        split = {
            key: L.zero12_split(L.zero12_flatten([src[n] for n in names], pads), size, world_size)
            for key, src in (("fp32", ckpt.params), ("m", ckpt.exp_avg), ("v", ckpt.exp_avg_sq))
        }
        shapes.append({n: tuple(np.shape(ckpt.params[n])) for n in names})
        for r, rank in enumerate(ranks):
            real = L.zero12_real_length(used, size, r)
            rank["fp32"].append(split["fp32"][r][:real])
            rank["m"].append(split["m"][r])
            rank["v"].append(split["v"][r])
            rank["pad"].append(size - real)
            rank["apad"].append(pads)
            lo, hi = r * size, (r + 1) * size
            rank["maps"].append(
                OrderedDict(
                    (n, fragment_address(numel=min(hi, o + k) - max(lo, o), start=max(lo, o) - lo))
                    for n, o, k in zip(names, offsets, numels, strict=True)
                    if o < hi and o + k > lo
                )
            )
    out = []
    for rank in ranks:
        out.append(
            {
                "loss_scaler": LossScaler(1.0, False),
                "dynamic_loss_scale": False,
                "overflow": False,
                "clip_grad": clip,  # DeepSpeed's loader takes it over its config's
                "base_optimizer_state": {
                    "state": {
                        i: _adam_state(ckpt.step, m, v, torch_opt)
                        for i, (m, v) in enumerate(zip(rank["m"], rank["v"], strict=True))
                    },
                    "param_groups": [
                        _group_dict(g, [i], torch_opt) for i, g in enumerate(ckpt.param_groups)
                    ],
                },
                "single_partition_of_fp32_groups": [_t(a) for a in rank["fp32"]],
                "zero_stage": ZeroStageEnum(stage),
                "group_paddings": rank["pad"],
                "param_alignment_paddings": rank["apad"],
                "partition_count": [world_size] * len(ckpt.param_groups),
                "ds_version": DS_VERSION,
                "param_slice_mappings": rank["maps"],
            }
        )
    return shapes, out


def _sub_groups(names, numels, world_size: int, sub_group_size) -> list[list[int]]:
    """DeepSpeed's ZeRO-3 sub-groups of one param group (indices into ``names``)."""
    chunks = [L.zero3_chunk(n, world_size) for n in numels]
    if sub_group_size is None or sub_group_size >= sum(chunks):
        return [list(range(len(names)))]
    out, cur, total = [], [], 0
    for i, c in enumerate(chunks):
        cur.append(i)
        total += c
        if total >= sub_group_size or i == len(names) - 1:
            out.append(cur)
            cur, total = [], 0
    return out


def _zero3_files(ckpt, cfg, world_size: int, torch_opt: bool):
    """(param_shapes per sub-group, [rank optimizer_state_dict]) for ZeRO 3."""
    sgs = int(cfg.get("zero_optimization", {}).get("sub_group_size", int(1e9)))
    shapes, members = [], []
    for g in ckpt.param_groups:
        names = list(g["names"])
        numels = [int(np.asarray(ckpt.params[n]).size) for n in names]
        members.append([])
        for sub in _sub_groups(names, numels, world_size, sgs):
            members[-1].append(len(shapes))
            shapes.append({names[i]: tuple(np.shape(ckpt.params[names[i]])) for i in sub})
    per = {
        key: [L.zero3_split([src[n] for n in s], world_size) for s in shapes]
        for key, src in (("fp32", ckpt.params), ("m", ckpt.exp_avg), ("v", ckpt.exp_avg_sq))
    }
    out = []
    for r in range(world_size):
        out.append(
            {
                "zero_stage": ZeroStageEnum.weights,
                "loss_scaler": LossScaler(1.0, False),
                "dynamic_loss_scale": False,
                "overflow": False,
                "partition_count": world_size,
                "optimizer_state_dict": {
                    "state": {
                        s: _adam_state(ckpt.step, per["m"][s][r], per["v"][s][r], torch_opt)
                        for s in range(len(shapes))
                    },
                    "param_groups": [
                        _group_dict(g, members[i], torch_opt)
                        for i, g in enumerate(ckpt.param_groups)
                    ],
                },
                "fp32_flat_groups": [_t(per["fp32"][s][r]) for s in range(len(shapes))],
            }
        )
    return shapes, out


def _copy_zero_to_fp32(save_dir) -> None:
    """Copy DeepSpeed's ``zero_to_fp32.py`` next to the tag, as DeepSpeed does, if installed
    (found without importing DeepSpeed)."""
    import importlib.util
    import shutil

    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    src = os.path.join(list(spec.submodule_search_locations)[0], "utils", "zero_to_fp32.py")
    if os.path.isfile(src):
        shutil.copyfile(src, os.path.join(save_dir, "zero_to_fp32.py"))


def _check_writable(cfg: dict, ckpt: DeepSpeedCheckpoint) -> None:
    """Refuse what the written files cannot carry: a scheduler's state, L2 Adam."""
    sched = cfg.get("scheduler")
    opt = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), dict) else {}
    l2 = ckpt.l2_weight_decay or (
        str(opt.get("type", "")).lower() == "adam"
        and (opt.get("params") or {}).get("adam_w_mode", True) is False
    )
    lost = [
        k
        for k, on in (
            ("scheduler", isinstance(sched, dict) and sched.get("type")),
            ("optimizer.params.adam_w_mode", l2),
        )
        if on
    ]
    if lost:
        raise U.DeepSpeedSettingError(
            f"the ds_config sets {lost}, which the written files would not carry (the writer "
            "writes no lr scheduler state and AdamW param groups only): DeepSpeed would "
            "continue with another update; pass a ds_config without them"
        )


def write_ds_checkpoint(
    ckpt: DeepSpeedCheckpoint, save_dir, *, stage: int, world_size: int, tag=None, ds_config=None
) -> list[str]:
    """Write ``ckpt`` as DeepSpeed files; returns the paths written."""
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"stage={stage!r}: DeepSpeed ZeRO checkpoints are stage 1, 2 or 3")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    clip = U.effective_clipping(ckpt.ds_config, ckpt.gradient_clipping)
    if ds_config is not None:
        U.check_config_clipping(ds_config, clip, "the checkpoint's run")
    cfg = dict(ds_config) if ds_config is not None else default_ds_config(ckpt, stage, world_size)
    _check_writable(cfg, ckpt)
    cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": stage}
    for key in ("bf16", "fp16"):
        cfg.setdefault(key, {"enabled": ckpt.dtype == key})
    tag = str(tag if tag is not None else f"global_step{ckpt.step}")
    tag_dir = os.path.join(os.fspath(save_dir), tag)
    if os.path.isdir(tag_dir) and os.listdir(tag_dir):
        raise ValueError(f"{tag_dir} already exists and is not empty; pick another tag= or dir")
    os.makedirs(tag_dir, exist_ok=True)
    torch_opt = _torch_optimizer(cfg, ckpt)
    if stage == 3:
        shapes, osds = _zero3_files(ckpt, cfg, world_size, torch_opt)
    else:
        shapes, osds = _zero12_files(ckpt, cfg, world_size, stage, torch_opt, clip)
    model = _model_states(ckpt, cfg, world_size, shapes, stage == 3)
    written = []
    model_files = (
        [ZERO3_MODEL_FILE.format(rank=r) for r in range(world_size)] if stage == 3 else [MODEL_FILE]
    )
    for name in model_files:
        written.append(os.path.join(tag_dir, name))
        pickled.save(model, written[-1])
    prefix = "bf16_" if ckpt.dtype == "bf16" else ""
    for r, osd in enumerate(osds):
        written.append(os.path.join(tag_dir, OPTIM_FILE.format(prefix=prefix, rank=r)))
        pickled.save(
            {"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": DS_VERSION}, written[-1]
        )
    with open(os.path.join(os.fspath(save_dir), "latest"), "w") as f:
        f.write(tag)
    _copy_zero_to_fp32(os.fspath(save_dir))
    return written


def write_checkpoint(
    save_dir,
    state_or_ckpt,
    *,
    stage: int,
    world_size: int,
    zero=None,
    name_map=None,
    tag=None,
    param_groups=None,
    buffers=None,
    ds_config=None,
) -> list[str]:
    """Write a DeepSpeed 0.19.8 ZeRO checkpoint of a jaxzero state or a DeepSpeedCheckpoint.

    Args:
      save_dir: the directory DeepSpeed's ``engine.load_checkpoint(save_dir)`` will read;
        ``save_dir/tag/`` must not hold anything yet. ``save_dir/latest`` names the tag.
      state_or_ckpt: a jaxzero ``TrainState`` of an AdamW run, or a :class:`DeepSpeedCheckpoint`.
      stage, world_size: the DeepSpeed job's ZeRO stage (1-3) and data-parallel size.
      zero: the state's :class:`jaxzero.ZeRO`; its tx built by :func:`adamw` gives the param
        groups (else pass ``param_groups``).
      name_map: see :func:`name_map_for`; buffers: ``{name: array}`` (default: a flat
        ``state.model_state``).
      tag: default ``global_step{step}``. ds_config: stored in the files (default: the
        checkpoint's, or a minimal AdamW one); its ``round_robin_gradients``,
        ``parameter_alignment`` and ``sub_group_size`` shape the layout, so give the config the
        DeepSpeed job will use. Its ``gradient_clipping`` (DeepSpeed's default 1.0 when
        absent) must be the chain's: the clipping ``zero.tx`` does when :func:`adamw` built it
        (recorded in the default config), else the config must set it. ZeRO 1/2 files also
        record it (``clip_grad``), and DeepSpeed continues with that value.

    Returns:
      The files written.

    Raises:
      DeepSpeedSettingError: the ds_config clips otherwise than the state's chain, or the
        chain's clipping cannot be told and the ds_config does not set it.
    """
    from jaxzero.interop.deepspeed.jax_state import from_train_state

    if isinstance(state_or_ckpt, DeepSpeedCheckpoint):
        ckpt = state_or_ckpt
    else:
        ckpt = from_train_state(
            state_or_ckpt,
            zero,
            param_groups=param_groups,
            name_map=name_map,
            buffers=buffers,
            ds_config=ds_config,
        )
    return write_ds_checkpoint(
        ckpt, save_dir, stage=stage, world_size=world_size, tag=tag, ds_config=ds_config
    )
