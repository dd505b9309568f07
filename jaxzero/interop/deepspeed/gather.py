"""Gathering the per-rank partitions of a DeepSpeed checkpoint into full arrays."""

from __future__ import annotations

import math
from collections.abc import Mapping

import jaxzero.interop.deepspeed.layout as L
from jaxzero.interop.deepspeed.errors import error, float_array, need, scalar

_ADAM_KEYS = {"step", "exp_avg", "exp_avg_sq"}


def optimizer_kind(ds_config: Mapping, groups: list[Mapping], path) -> str:
    """``"FusedAdam"`` or ``"torch.optim.AdamW"``; a clear error for anything else."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, Mapping) else None
    keys = set(groups[0]) if groups else set()
    if opt:
        kind = str(opt.get("type", "")).lower()
        if kind not in ("adam", "adamw"):
            raise error(path, f"optimizer type {opt.get('type')!r} is not supported (AdamW only)")
    elif {"momentum", "dampening"} & keys or not {"betas", "eps"} <= keys:
        raise error(path, f"a client optimizer with param-group keys {sorted(keys)} (AdamW only)")
    for g in groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise error(path, "AdamW with amsgrad/maximize is not supported")
        if g.get("bias_correction") is False:
            raise error(path, "Adam without bias correction is not supported")
    torch_keys = {"decoupled_weight_decay", "foreach"} & keys
    return "torch.optim.AdamW" if torch_keys else "FusedAdam"


def l2_weight_decay(ds_config: Mapping, groups: list[Mapping]) -> bool:
    """Whether the optimizer adds the weight decay to the gradient (L2) instead of decoupling
    it: DeepSpeed's ``"Adam"`` with ``adam_w_mode: false`` (``"AdamW"`` is AdamW whatever it
    says), or a torch Adam (``decoupled_weight_decay`` False in its groups)."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, Mapping) else None
    if opt:
        kind = str(opt.get("type", "")).lower()
        return kind == "adam" and (opt.get("params") or {}).get("adam_w_mode", True) is False
    return any(g.get("decoupled_weight_decay") is False for g in groups)


def hyper(group: Mapping, names: list[str]) -> dict:
    return {
        "names": list(names),
        "lr": float(scalar(group["lr"])),
        "betas": [float(b) for b in group["betas"]],
        "eps": float(group["eps"]),
        "weight_decay": float(group.get("weight_decay", 0.0)),
    }


def adam_entry(state: Mapping, key, path) -> dict:
    entry = state.get(key) if isinstance(state, Mapping) else None
    if not isinstance(entry, Mapping) or set(entry) != _ADAM_KEYS:
        got = sorted(entry) if isinstance(entry, Mapping) else entry
        raise error(
            path, f"optimizer state {key!r} is {got}, expected AdamW's {sorted(_ADAM_KEYS)}"
        )
    return entry


def common_step(steps: list[float], path) -> int:
    distinct = set(steps)
    if len(distinct) != 1 or not float(next(iter(distinct))).is_integer():
        raise error(
            path, f"the optimizer states have different or fractional steps {sorted(distinct)}"
        )
    return int(distinct.pop())


def _rank_group(osd, g, path, bf16_opt):
    """(fp32 partition, exp_avg, exp_avg_sq, step) of group g in one rank's ZeRO-1/2 state."""
    parts = need(osd, "single_partition_of_fp32_groups", path)
    base = need(osd, "base_optimizer_state", path)
    if g >= len(parts):
        raise error(path, f"{len(parts)} fp32 partitions but the model has param group {g}")
    if isinstance(base, list):  # elastic checkpoint: one lean state per group
        entry = adam_entry(dict(enumerate(base)), g, path)
    else:
        pid = need(base, "param_groups", path)[g]["params"][0]
        entry = adam_entry(need(base, "state", path), pid, path)
    fp32 = float_array(parts[g], path, f"fp32 partition {g}")
    return (
        fp32,
        float_array(entry["exp_avg"], path, "exp_avg"),
        float_array(entry["exp_avg_sq"], path, "exp_avg_sq"),
        scalar(entry["step"]),
    )


def gather_zero12(osds, paths, shapes, bf16_opt: bool):
    """``({name: (fp32, m, v)}, [steps])`` of a ZeRO-1/2 or BF16_Optimizer checkpoint."""
    w = len(osds)
    out, steps = {}, []
    for g, group in enumerate(shapes):
        names = list(group)
        numels = [math.prod(group[n]) for n in names]
        pads = osds[0].get("param_alignment_paddings")
        pads = list(pads[g]) if pads is not None else [0] * len(names)
        if len(pads) != len(names):
            raise error(
                paths[0],
                f"group {g}: param_alignment_paddings lists {len(pads)} params "
                f"but param_shapes has {len(names)}; the files do not belong together",
            )
        offsets, used = L.zero12_offsets(numels, pads)
        size = L.zero12_partition_size(used, w)
        fl, ml, vl = [], [], []
        for r, (osd, path) in enumerate(zip(osds, paths, strict=True)):
            fp32, m, v, step = _rank_group(osd, g, path, bf16_opt)
            real = L.zero12_real_length(used, size, r)
            want = size if bf16_opt else real
            if fp32.size != want:
                raise error(
                    path,
                    f"group {g}: fp32 partition has {fp32.size} elements, expected {want} "
                    f"(partition {size} of a {used}-element group over {w} ranks); the file "
                    "does not match param_shapes",
                )
            for name, moment in (("exp_avg", m), ("exp_avg_sq", v)):
                if not real <= moment.size <= size:
                    raise error(
                        path, f"group {g}: {name} has {moment.size} elements, expected {size}"
                    )
            fl.append(fp32[:real])
            ml.append(m[:real])
            vl.append(v[:real])
            steps.append(step)
        flats = [L.zero12_join(x, size) for x in (fl, ml, vl)]
        for name, n, off in zip(names, numels, offsets, strict=True):
            out[name] = tuple(f[off : off + n].reshape(group[name]) for f in flats)
    return out, steps


def gather_zero3(osds, paths, shapes):
    """``({name: (fp32, m, v)}, [steps], {sub_group: param_group})`` of a ZeRO-3 checkpoint."""
    w = len(osds)
    per_rank = []
    for osd, path in zip(osds, paths, strict=True):
        flats = need(osd, "fp32_flat_groups", path)
        inner = need(osd, "optimizer_state_dict", path)
        state = need(inner, "state", path, "optimizer state")
        if len(flats) != len(shapes):
            raise error(path, f"{len(flats)} fp32 flat groups but param_shapes has {len(shapes)}")
        per_rank.append((flats, state))
    out, steps = {}, []
    for s, group in enumerate(shapes):
        names = list(group)
        numels = [math.prod(group[n]) for n in names]
        want = sum(L.zero3_chunk(n, w) for n in numels)
        cols = ([], [], [])
        for (flats, state), path in zip(per_rank, paths, strict=True):
            entry = adam_entry(state, s, path)
            arrays = (
                float_array(flats[s], path, f"fp32 group {s}"),
                float_array(entry["exp_avg"], path, "exp_avg"),
                float_array(entry["exp_avg_sq"], path, "exp_avg_sq"),
            )
            for a, label in zip(arrays, ("fp32 group", "exp_avg", "exp_avg_sq"), strict=True):
                if a.size != want:
                    raise error(
                        path,
                        f"sub-group {s}: {label} has {a.size} elements, expected "
                        f"{want} (chunks of ceil(numel/{w})); does not match param_shapes",
                    )
            for c, a in zip(cols, arrays, strict=True):
                c.append(a)
            steps.append(scalar(entry["step"]))
        joined = [L.zero3_join(c, numels) for c in cols]
        for i, name in enumerate(names):
            out[name] = tuple(j[i].reshape(group[name]) for j in joined)
    return out, steps
