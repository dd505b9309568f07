"""DeepSpeed checkpoints <-> jaxzero ``TrainState`` (names through :mod:`jaxzero.interop.torch`)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import jaxzero.interop.deepspeed.fp16 as LS
import jaxzero.interop.deepspeed.update as U
from jaxzero.interop.deepspeed.chain import (
    HYPER,
    adamw,
    check_groups,
    groups_of,
    names_only_map,
    settings_of,
)
from jaxzero.interop.deepspeed.reader import DeepSpeedCheckpoint
from jaxzero.interop.torch import names as ti_names
from jaxzero.interop.torch import optimizer_state as ti_opt
from jaxzero.precision import DynamicLossScale

__all__ = [
    "adamw",
    "name_map_for",
    "settings_of",
    "to_train_state",
    "from_train_state",
]


def name_map_for(ckpt_or_names, params_template=None, name_map=None) -> ti_names.NameMap:
    """The :class:`NameMap` from DeepSpeed's names to ``params_template``'s leaves.

    ``params_template=None`` keys the tree by the torch names in torch layout. ``name_map`` is a
    NameMap, or overrides for :func:`jaxzero.interop.torch.build_name_map` (torch name ->
    ``"a/b/kernel"``), or None (Linear ``weight`` -> transposed ``kernel``, norm ``weight`` ->
    ``scale``, ...).
    """
    if isinstance(name_map, ti_names.NameMap):
        return name_map
    if isinstance(ckpt_or_names, DeepSpeedCheckpoint):
        source = {n: ckpt_or_names.params[n] for n in ckpt_or_names.param_names}
    else:
        source = dict(ckpt_or_names)
    if params_template is None:
        if name_map is not None:
            raise ValueError("name_map needs a params_template to map into")
        return ti_names.NameMap(entries=tuple((n, (n,), "identity") for n in source))
    nm = ti_names.build_name_map(source, params_template, overrides=name_map)
    nm.check()
    return nm


def _check_tx(zero, ckpt: DeepSpeedCheckpoint, groups) -> None:
    mine = groups_of(zero.tx)
    if mine is None:
        return
    theirs = U.effective_clipping(ckpt.ds_config, ckpt.gradient_clipping)
    clip = settings_of(zero.tx).gradient_clipping
    if clip != theirs:
        raise U.DeepSpeedSettingError(
            f"zero.tx clips gradients at {clip or 'no norm'} but the checkpoint's run clips at "
            f"{theirs or 'no norm'} (gradient_clipping); build it with "
            "jaxzero.interop.deepspeed.adamw(ckpt, params_template)"
        )
    diff = [
        f"group {i}: {k}={a[k]!r} vs checkpoint {b[k]!r}"
        for i, (a, b) in enumerate(zip(mine, groups, strict=False))
        for k in ("names", *HYPER)
        if (list(a[k]) if k == "names" else a[k]) != (list(b[k]) if k == "names" else b[k])
    ]
    if len(mine) != len(groups) or diff:
        raise ValueError(
            f"zero.tx was built for other param groups than the checkpoint's: {diff[:4]}; "
            "build it with jaxzero.interop.deepspeed.adamw(ckpt, params_template)"
        )


def _model_state(buffers: dict, model_state, torch_keyed: bool):
    if model_state is None:
        return {n: jnp.asarray(b) for n, b in buffers.items()} if torch_keyed and buffers else None
    if not buffers:
        raise ValueError("model_state= was given but the checkpoint has no buffers")
    return ti_names.torch_to_flax(buffers, model_state)


def to_train_state(
    ckpt: DeepSpeedCheckpoint,
    zero,
    params_template=None,
    *,
    name_map=None,
    model_state=None,
    ema=None,
    rng=None,
):
    """A jaxzero ``TrainState`` continuing a DeepSpeed run, on ``zero``'s mesh and stage.

    Args:
      ckpt: from :func:`read_checkpoint`.
      zero: a :class:`jaxzero.ZeRO` (any stage and device count); its ``tx`` should be
        :func:`adamw` ``(ckpt, params_template)`` (checked when it is).
      params_template: the JAX params tree (arrays or ShapeDtypeStructs); None keys the tree by
        the torch names, torch layout. The master is float32 whatever the template's dtype.
      name_map: see :func:`name_map_for`.
      model_state: a template of the model's non-trainable state; the checkpoint's buffers are
        mapped into it by name. None: with a torch-keyed tree, ``{name: buffer}`` (or None when
        there are no buffers); otherwise the buffers are left out.
      ema, rng: passed to ``zero.init`` (the EMA starts at the checkpoint's weights).
    """
    from jaxzero.train.optimizer import ZeRO

    if not isinstance(ckpt, DeepSpeedCheckpoint):
        raise TypeError(f"ckpt must be a DeepSpeedCheckpoint (read_checkpoint), got {type(ckpt)}")
    if not isinstance(zero, ZeRO):
        raise TypeError(f"zero must be a jaxzero.ZeRO, got {type(zero).__name__}")
    groups = check_groups(ckpt.param_groups)
    _check_tx(zero, ckpt, groups)
    scaler = _check_loss_scale(zero, ckpt)
    names = ckpt.param_names
    nm = name_map_for(ckpt, params_template, name_map)
    template = (
        params_template if params_template is not None else {n: ckpt.params[n] for n in names}
    )
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.float32), template)
    params = ti_names.torch_to_flax(ckpt.params, target, nm)
    ms = _model_state(ckpt.buffers, model_state, params_template is None)
    state = zero.init(params, ema=ema, model_state=ms, rng=rng)
    sd = {
        "state": {
            i: {
                "step": float(ckpt.step),
                "exp_avg": ckpt.exp_avg[n],
                "exp_avg_sq": ckpt.exp_avg_sq[n],
            }
            for i, n in enumerate(names)
        },
        "param_groups": [],
    }
    start = 0
    for g in groups:
        sd["param_groups"].append(
            {
                **ti_opt.adamw_hyperparams(**{k: g[k] for k in HYPER}),
                "params": list(range(start, start + len(g["names"]))),
            }
        )
        start += len(g["names"])
    opt_state = ti_opt.import_optimizer_state(
        state.opt_state, sd, [g["names"] for g in groups], name_map=nm
    )
    step = jax.device_put(np.int32(ckpt.step), state.step.sharding)
    state = state.replace(opt_state=_with_counts(opt_state, ckpt.step), step=step)
    if scaler is not None:  # DeepSpeed's loss scaler at the checkpoint, its skipped steps
        put = lambda new, old: jax.device_put(new.astype(old.dtype), old.sharding)
        skipped = put(np.asarray(ckpt.skipped_steps or 0), state.skipped)
        state = state.replace(
            loss_scale=jax.tree.map(put, LS.loss_scale_state(scaler), state.loss_scale),
            skipped=skipped,
        )
    return state


def _with_counts(opt_state, step: int):
    """Every optax step count in ``opt_state`` (Adam's, the lr schedule's, an injected
    hyperparameter's) at ``step``: the schedules continue where the run stopped."""

    def put(path, leaf):
        last = path[-1] if path else None
        if getattr(last, "name", None) == "count":
            return jax.device_put(np.asarray(step, dtype=leaf.dtype), leaf.sharding)
        return leaf

    return jax.tree_util.tree_map_with_path(put, opt_state)


def _check_loss_scale(zero, ckpt: DeepSpeedCheckpoint):
    """The checkpoint's dynamic loss scaler state when ``zero`` continues an fp16 run; a
    :class:`DeepSpeedSettingError` when ``zero.loss_scale`` is not the run's."""
    want = LS.loss_scale(ckpt)
    if want is None:
        return None
    fix = (
        "build the ZeRO with precision='fp16', "
        "loss_scale=jaxzero.interop.deepspeed.loss_scale(ckpt)"
    )
    if zero.loss_scale != want:
        raise U.DeepSpeedSettingError(
            f"the checkpoint's run scales the loss with {want}, but zero.loss_scale is "
            f"{zero.loss_scale}: {fix}"
        )
    if isinstance(want, DynamicLossScale) and ckpt.loss_scaler is None:
        raise U.DeepSpeedSettingError(
            "the checkpoint's run scales the loss dynamically, but its optimizer files hold "
            "no DynamicLossScaler state to continue from (is it damaged?)"
        )
    return ckpt.loss_scaler if isinstance(want, DynamicLossScale) else None


def _dtype_name(tree) -> str:
    dtypes = {jnp.dtype(x.dtype) for x in jax.tree.leaves(tree)}
    for name, dt in (("bf16", jnp.bfloat16), ("fp16", jnp.float16)):
        if jnp.dtype(dt) in dtypes:
            return name
    return "fp32"


def from_train_state(
    state, zero=None, *, param_groups=None, name_map=None, buffers=None, ds_config=None
) -> DeepSpeedCheckpoint:
    """The full (gathered) arrays of a jaxzero AdamW ``state`` as a :class:`DeepSpeedCheckpoint`.

    ``param_groups`` (names, lr, betas, eps, weight_decay per group) default to those ``zero.tx``
    was built for by :func:`adamw`. ``buffers`` default to ``state.model_state`` when that is a
    flat ``{torch name: array}`` dict. The checkpoint's ``gradient_clipping`` is the chain's
    (from :func:`adamw`; a ``ds_config`` that clips otherwise is refused), or, for a chain
    built elsewhere, ``ds_config["gradient_clipping"]``, which must then be given.
    """
    groups = (
        param_groups
        if param_groups is not None
        else (groups_of(zero.tx) if zero is not None else None)
    )
    if groups is None:
        raise ValueError(
            "cannot tell the param groups: pass param_groups=[{names, lr, betas, eps, "
            "weight_decay}, ...] or a zero whose tx was built by jaxzero.interop.deepspeed.adamw"
        )
    groups = check_groups(groups)
    settings = settings_of(zero.tx) if zero is not None else None
    lost = settings.not_written() if settings is not None else []
    if lost:
        raise U.DeepSpeedSettingError(
            f"zero.tx reproduces {lost}, which a written DeepSpeed checkpoint would not carry "
            "(the writer writes no lr scheduler state, no loss scaler and AdamW only): "
            "DeepSpeed would continue with another update; continue the run in jaxzero"
        )
    clip = U.chain_clipping(settings, ds_config)
    names = [n for g in groups for n in g["names"]]
    master = state.fp32_master()  # the fp32 master whatever the placement stores
    master = master if master is not None else state.params
    nm = (
        name_map
        if isinstance(name_map, ti_names.NameMap)
        else names_only_map(names, master, name_map)
    )
    weights = {n: t.numpy() for n, t in ti_names.flax_to_torch(master, nm).items()}
    hp = [ti_opt.adamw_hyperparams(**{k: g[k] for k in HYPER}) for g in groups]
    osd = ti_opt.export_optimizer_state(
        state.opt_state, [g["names"] for g in groups], hyperparams=hp, name_map=nm
    )
    steps = {float(e["step"]) for e in osd["state"].values()}
    if len(steps) != 1:
        raise ValueError(f"the optimizer state has several steps {sorted(steps)}")
    # The module weights' dtype: the ZeRO's compute dtype (a stage-3 state without a compute
    # copy holds only the fp32 master), else what state.params holds.
    policy = [jax.ShapeDtypeStruct((), zero.precision.param_dtype)] if zero is not None else None
    dtype = _dtype_name(policy or state.params)
    import ml_dtypes

    cast = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}.get(dtype, np.float32)
    if buffers is None and isinstance(state.model_state, Mapping):
        if all(isinstance(k, str) and hasattr(v, "shape") for k, v in state.model_state.items()):
            buffers = {k: np.asarray(v) for k, v in state.model_state.items()}
    return DeepSpeedCheckpoint(
        params={n: weights[n].astype(np.float32) for n in names},
        exp_avg={n: osd["state"][i]["exp_avg"].numpy() for i, n in enumerate(names)},
        exp_avg_sq={n: osd["state"][i]["exp_avg_sq"].numpy() for i, n in enumerate(names)},
        module={n: weights[n].astype(cast) for n in names},
        buffers=dict(buffers or {}),
        step=int(steps.pop()),
        param_groups=[{**g, "betas": list(g["betas"])} for g in groups],
        zero_stage=getattr(zero, "stage", 0) if zero is not None else 0,
        world_size=getattr(zero, "num_shards", 1) if zero is not None else 1,
        ds_config=dict(ds_config or {"gradient_clipping": clip}),
        dtype=dtype,
        optimizer="FusedAdam",
        gradient_clipping=clip,
    )
