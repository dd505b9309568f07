"""Reading DeepSpeed 0.19.8 ZeRO checkpoints (stages 1-3, ``BF16_Optimizer``) into numpy.

Nothing here imports DeepSpeed, and the files are read with the allowlisting loader of
:mod:`jaxzero.interop.safe_pickle`: a file that asks for any other code is refused.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

import numpy as np

import jaxzero.interop.deepspeed.gather as gather
from jaxzero.interop.deepspeed.errors import (
    DeepSpeedCheckpointError,
    compute_array,
    error,
    load,
    need,
    param_shapes,
)

__all__ = ["DeepSpeedCheckpoint", "DeepSpeedCheckpointError", "read_checkpoint"]

MODEL_FILE = "mp_rank_00_model_states.pt"
ZERO3_MODEL_FILE = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
OPTIM_FILE = "{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclasses.dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint, gathered: every array is full (unpartitioned), in torch layout.

    Attributes:
      params: name -> float32 array: the fp32 master.
      exp_avg: name -> float32 array: Adam's first moment.
      exp_avg_sq: name -> float32 array: Adam's second moment.
      module: name -> compute-dtype weights (bfloat16/float16 arrays for bf16/fp16 runs).
      buffers: name -> the module's persistent buffers, as saved.
      step: the optimizer's step (Adam bias correction continues from it).
      param_groups: one dict per param group: ``names``, ``lr``, ``betas`` (a list, as
        saved), ``eps``, ``weight_decay``.
      zero_stage: the ZeRO stage DeepSpeed ran (1 for ``BF16_Optimizer``).
      world_size: the data-parallel world size DeepSpeed ran on.
      ds_config: the DeepSpeed config, as saved.
      ds_version: the DeepSpeed version, as saved.
      dtype: the compute dtype, ``"fp32"``, ``"bf16"`` or ``"fp16"``.
      optimizer: ``"FusedAdam"`` (DeepSpeed's AdamW) or ``"torch.optim.AdamW"``.
      global_steps: the engine's step counter (counts skipped fp16 steps too).
      gradient_clipping: the max gradient norm the run clips to when known apart from
        ``ds_config``: ZeRO 1/2 optimizer files record it (``clip_grad``) and a DeepSpeed run
        loaded from them continues with it; None: as ``ds_config`` says (DeepSpeed's default
        1.0 when absent).
      lr_scheduler: the saved lr scheduler state (model states' ``lr_scheduler``: the
        ``ds_config`` scheduler's ``{"last_batch_iteration": ...}``, or a client scheduler's).
      loss_scaler: fp16 runs with dynamic loss scaling: the ``DynamicLossScaler``'s attributes
        (``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``,
        ``delayed_shift``, ``scale_window``, ``min_scale``, ``scale_factor``,
        ``consecutive_hysteresis``, ``raise_error_at_min_scale``) from the optimizer files,
        which a DeepSpeed run loaded from them continues with; None otherwise.
      skipped_steps: the engine's count of skipped (fp16 overflow) steps.
      l2_weight_decay: the optimizer adds the weight decay to the gradient (Adam with
        ``adam_w_mode: false``, or a torch Adam) instead of decoupling it (AdamW).
    """

    params: dict[str, np.ndarray]
    exp_avg: dict[str, np.ndarray]
    exp_avg_sq: dict[str, np.ndarray]
    module: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]
    step: int
    param_groups: list[dict]
    zero_stage: int
    world_size: int
    ds_config: dict = dataclasses.field(default_factory=dict)
    ds_version: str = "0.19.8"
    dtype: str = "fp32"
    optimizer: str = "FusedAdam"
    global_steps: int | None = None
    gradient_clipping: float | None = None
    lr_scheduler: object = None
    loss_scaler: dict | None = None
    skipped_steps: int | None = None
    l2_weight_decay: bool = False

    @property
    def param_names(self) -> list[str]:
        """Every parameter, group by group."""
        return [n for g in self.param_groups for n in g["names"]]


# ------------------------------------------------------------------ files
def resolve_tag_dir(save_dir, tag=None) -> tuple[str, str]:
    """``(save_dir/tag, tag)``; ``tag=None`` reads ``save_dir/latest``."""
    save_dir = os.fspath(save_dir)
    if not os.path.isdir(save_dir):
        raise DeepSpeedCheckpointError(f"{save_dir}: no such directory")
    if tag is None:
        latest = os.path.join(save_dir, "latest")
        if not os.path.isfile(latest):
            raise error(latest, "no such file; pass tag= (a sub-directory of the save dir)")
        with open(latest) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(save_dir, str(tag))
    if not os.path.isdir(tag_dir):
        raise error(tag_dir, f"no such directory (tag {tag!r})")
    return tag_dir, str(tag)


def _model_states(tag_dir) -> tuple[dict, str, bool]:
    files = sorted(os.listdir(tag_dir))
    if any(f.startswith("layer_") for f in files):
        raise error(
            tag_dir, "a pipeline-parallel checkpoint (layer_* files); only pp=1 is supported"
        )
    other_mp = [f for f in files if re.search(r"mp_rank_(?!00)\d+", f)]
    if other_mp:
        raise error(
            tag_dir, f"model-parallel files {other_mp[:3]}; only mp_world_size 1 is supported"
        )
    for name, zero3 in ((MODEL_FILE, False), (ZERO3_MODEL_FILE.format(rank=0), True)):
        path = os.path.join(tag_dir, name)
        if os.path.isfile(path):
            return load(path, "DeepSpeed model-states file"), path, zero3
    raise error(
        tag_dir, f"no {MODEL_FILE} or {ZERO3_MODEL_FILE.format(rank=0)}: not a DeepSpeed tag"
    )


def _check_parallel(ms, path) -> None:
    mp = ms.get("mp_world_size", 1)
    dims = ms.get("checkpoint_parallel_dimensions") or {}
    pp, tp = dims.get("pp_degree", 1), dims.get("tp_degree", 1)
    if mp != 1 or pp != 1 or tp != 1:
        raise error(
            path,
            f"model/pipeline parallelism (mp_world_size={mp}, pp_degree={pp}, tp_degree={tp}) "
            "is not supported; only data parallelism (ZeRO) is",
        )


def _optim_paths(tag_dir, world_size: int, bf16_first: bool) -> list[str]:
    found: dict[str, set[int]] = {"": set(), "bf16_": set()}
    for f in os.listdir(tag_dir):
        m = _OPTIM_RE.match(f)
        if m:
            found[m.group(1) or ""].add(int(m.group(2)))
    order = ("bf16_", "") if bf16_first else ("", "bf16_")
    prefix = next((p for p in order if found[p]), None)
    if prefix is None:
        want = os.path.join(tag_dir, OPTIM_FILE.format(prefix="", rank=0))
        raise error(want, "no such file: no ZeRO optimizer files (ZeRO disabled, or partial?)")
    paths = [
        os.path.join(tag_dir, OPTIM_FILE.format(prefix=prefix, rank=r)) for r in range(world_size)
    ]
    missing = [p for r, p in enumerate(paths) if r not in found[prefix]]
    if missing:
        raise error(missing[0], f"no such file: the checkpoint is partial ({world_size} ranks)")
    extra = sorted(r for r in found[prefix] if r >= world_size)
    if extra:
        raise error(tag_dir, f"optimizer files for ranks {extra} but dp_world_size is {world_size}")
    return paths


# ------------------------------------------------------------------ reading
def _groups_of(inner_groups, shapes, zero3: bool, path) -> list[list[str]]:
    """The names in each param group (ZeRO 3: the union of its sub-groups)."""
    if not zero3:
        if len(inner_groups) != len(shapes):
            raise error(
                path, f"{len(inner_groups)} param groups but param_shapes has {len(shapes)}"
            )
        return [list(s) for s in shapes]
    out = []
    for g in inner_groups:
        subs = list(g["params"])
        bad = [s for s in subs if not (isinstance(s, int) and 0 <= s < len(shapes))]
        if bad:
            raise error(path, f"param group lists sub-groups {bad} beyond param_shapes")
        out.append([n for s in subs for n in shapes[s]])
    return out


def _module(ms, path, zero3: bool, params, dtype):
    module = need(ms, "module", path)
    names = list(need(ms, "buffer_names", path))
    missing = [n for n in names if n not in module]
    if missing:
        raise error(path, f"buffers {missing} are listed in buffer_names but not in module")
    buffers = {n: compute_array(module[n]) for n in names}
    if not zero3:
        missing = [n for n in params if n not in module]
        if missing:
            raise error(path, f"module lacks the params {missing[:5]}")
        return {n: compute_array(module[n]) for n in params}, buffers
    import ml_dtypes

    cast = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}.get(dtype, np.float32)
    return {n: p.astype(cast) for n, p in params.items()}, buffers


def _dtype(cfg) -> str:
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        if isinstance(cfg.get(key), Mapping) and cfg[key].get("enabled"):
            return name
    return "fp32"


def read_checkpoint(save_dir, tag=None) -> DeepSpeedCheckpoint:
    """Read a DeepSpeed ZeRO checkpoint written by ``engine.save_checkpoint(save_dir, tag)``.

    Reads ZeRO 1, 2 and 3 (``mp_rank_00_model_states.pt`` or per-rank ZeRO-3 model states,
    plus ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``), fp32/bf16/fp16 runs,
    FusedAdam or torch AdamW, any number of param groups and ZeRO-3 sub-groups, parameter
    alignment padding, round-robin order and ``BF16_Optimizer``. DeepSpeed is not needed and
    no code from the files is run.

    Args:
      save_dir: the directory given to ``save_checkpoint``.
      tag: the sub-directory; None reads the one named in ``save_dir/latest``.

    Raises:
      DeepSpeedCheckpointError: (a ValueError) damaged, partial (a rank file missing) or
        unsupported (model/pipeline parallel, an optimizer other than AdamW) checkpoints;
        the message names the file and what is wrong.
      UnsafeFileError: a file asks for code outside the allowlist.
    """
    tag_dir, _ = resolve_tag_dir(save_dir, tag)
    try:
        return _read(tag_dir)
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise error(
            tag_dir,
            f"unexpected file contents ({type(e).__name__}: {e}); is the "
            "checkpoint damaged or from another DeepSpeed version than 0.19.8?",
        ) from None


def _read(tag_dir) -> DeepSpeedCheckpoint:
    ms, ms_path, zero3 = _model_states(tag_dir)
    _check_parallel(ms, ms_path)
    cfg = ms.get("ds_config") or {}
    dtype = _dtype(cfg)
    world = int(need(ms, "dp_world_size", ms_path))
    shapes = param_shapes(need(ms, "param_shapes", ms_path), ms_path)
    paths = _optim_paths(tag_dir, world, dtype == "bf16")
    sds = [load(p, "DeepSpeed optimizer file") for p in paths]
    osds = [need(sd, "optimizer_state_dict", p) for sd, p in zip(sds, paths, strict=True)]
    stage_key = osds[0].get("zero_stage")
    bf16_opt = stage_key is None and "single_partition_of_fp32_groups" in osds[0]
    stage = 1 if bf16_opt else int(need(osds[0], "zero_stage", paths[0]))
    if (stage == 3) != zero3:
        raise error(paths[0], f"zero_stage {stage} does not match the model-states files")
    if zero3:
        inner = need(osds[0], "optimizer_state_dict", paths[0])
        values, steps = gather.gather_zero3(osds, paths, shapes)
    else:
        inner = need(osds[0], "base_optimizer_state", paths[0])
        values, steps = gather.gather_zero12(osds, paths, shapes, bf16_opt)
    groups_raw = need(inner, "param_groups", paths[0]) if isinstance(inner, Mapping) else None
    if groups_raw is None:  # elastic ZeRO-1/2: no torch param groups saved; use the config
        raise error(
            paths[0], "elastic checkpoints (no base optimizer param_groups) are not supported"
        )
    kind = gather.optimizer_kind(cfg, groups_raw, paths[0])
    names = _groups_of(groups_raw, shapes, zero3, paths[0])
    step = gather.common_step(steps, paths[0])
    params = {n: v[0] for n, v in values.items()}
    module, buffers = _module(ms, ms_path, zero3, params, dtype)
    return DeepSpeedCheckpoint(
        params=params,
        exp_avg={n: v[1] for n, v in values.items()},
        exp_avg_sq={n: v[2] for n, v in values.items()},
        module=module,
        buffers=buffers,
        step=step,
        param_groups=[gather.hyper(g, n) for g, n in zip(groups_raw, names, strict=True)],
        zero_stage=stage,
        world_size=world,
        ds_config=dict(cfg),
        ds_version=str(ms.get("ds_version", "")),
        dtype=dtype,
        optimizer=kind,
        global_steps=ms.get("global_steps"),
        gradient_clipping=None if zero3 else _clip_grad(osds[0], paths[0]),
        lr_scheduler=ms.get("lr_scheduler"),
        loss_scaler=_loss_scaler(osds[0], paths[0]),
        skipped_steps=ms.get("skipped_steps"),
        l2_weight_decay=gather.l2_weight_decay(cfg, groups_raw),
    )


_SCALER_KEYS = (
    "cur_scale",
    "cur_iter",
    "last_overflow_iter",
    "cur_hysteresis",
    "delayed_shift",
    "scale_window",
    "min_scale",
    "scale_factor",
    "consecutive_hysteresis",
    "raise_error_at_min_scale",
)


def _loss_scaler(osd, path) -> dict | None:
    """The dynamic loss scaler's state (None without one)."""
    scaler = osd.get("loss_scaler")
    if scaler is None or not getattr(scaler, "dynamic", False):
        return None
    state = getattr(scaler, "__dict__", {})
    missing = [k for k in _SCALER_KEYS if k not in state]
    if missing:
        raise error(path, f"the dynamic loss scaler lacks {missing}")
    return {k: state[k] for k in _SCALER_KEYS}


def _clip_grad(osd, path) -> float | None:
    value = osd.get("clip_grad")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error(path, f"clip_grad is {value!r}, expected a number")
    return float(value)
