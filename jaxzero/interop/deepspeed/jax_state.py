"""DeepSpeed checkpoints <-> jaxzero ``TrainState`` (names through :mod:`jaxzero.torch_interop`)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxzero.interop.deepspeed.update as U
from jaxzero.interop.deepspeed.reader import DeepSpeedCheckpoint
from jaxzero.interop.torch import names as ti_names
from jaxzero.interop.torch import optimizer_state as ti_opt

__all__ = [
    "adamw",
    "name_map_for",
    "settings_of",
    "to_train_state",
    "from_train_state",
]

# tx -> the param groups and update settings it was built for (so write_checkpoint can recover
# them from a ZeRO)
_GROUPS: dict[int, tuple[optax.GradientTransformation, list[dict], U.UpdateSettings]] = {}
_HYPER = ("lr", "betas", "eps", "weight_decay")


def _check_groups(param_groups) -> list[dict]:
    if not isinstance(param_groups, list | tuple) or not param_groups:
        raise TypeError(f"param_groups must be a non-empty list of dicts, got {param_groups!r}")
    out = []
    for i, g in enumerate(param_groups):
        missing = [k for k in ("names", *_HYPER) if k not in g]
        if missing:
            raise ValueError(
                f"param group {i} lacks {missing} (needs names, lr, betas, eps, weight_decay)"
            )
        out.append({"names": list(g["names"]), **{k: g[k] for k in _HYPER}})
        out[-1]["betas"] = tuple(float(b) for b in g["betas"])
    return out


def name_map_for(ckpt_or_names, params_template=None, name_map=None) -> ti_names.NameMap:
    """The :class:`NameMap` from DeepSpeed's names to ``params_template``'s leaves.

    ``params_template=None`` keys the tree by the torch names in torch layout. ``name_map`` is a
    NameMap, or overrides for :func:`jaxzero.torch_interop.build_name_map` (torch name ->
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


def _label_tree(param_groups, nm: ti_names.NameMap, tree, label_of):
    """A tree like ``tree`` with ``label_of(group_index)`` at each leaf."""
    where = {nm.lookup(n)[0]: label_of(i) for i, g in enumerate(param_groups) for n in g["names"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [_key(p) for p, _ in flat]
    missing = ["/".join(p) for p in paths if p not in where]
    if missing:
        raise ValueError(f"tree leaves in no param group: {missing[:8]}")
    return jax.tree_util.tree_unflatten(treedef, [where[p] for p in paths])


def _key(path) -> tuple[str, ...]:
    """A jax key path as the str tuple :class:`NameMap` paths use."""
    return tuple(
        str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k)) for k in path
    )


def adamw(
    param_groups,
    params_template,
    *,
    name_map=None,
    ds_config=None,
    allow=(),
    report=print,
) -> optax.GradientTransformation:
    """The optax chain reproducing a DeepSpeed (or torch) AdamW update on ``params_template``.

    From a checkpoint, every ``ds_config`` setting that changes the update is reproduced, with
    DeepSpeed 0.19.8's defaults for absent keys, or refused (:class:`DeepSpeedSettingError`
    naming it, before anything is built): gradient clipping (DeepSpeed clips at global norm 1.0
    unless ``gradient_clipping`` says otherwise; ZeRO 1/2 optimizer files' ``clip_grad`` wins),
    the gradient reduction, fp16 loss scaling and lr schedulers (refused), and the param groups:

    ``optax.chain([optax.clip_by_global_norm(c)], scale_by_adam, masked add_decayed_weights per
    distinct weight decay, scale_by_learning_rate)`` when the groups share lr, betas and eps;
    ``[optax.chain(clip,] optax.multi_transform(one optax.adamw per group)[)]`` otherwise. Bias
    correction continues from the optax ``count`` (set from the checkpoint's step by
    :func:`to_train_state`).

    Args:
      param_groups: a :class:`DeepSpeedCheckpoint`, or a list of torch-style groups (``names``,
        ``lr``, ``betas``, ``eps``, ``weight_decay``).
      params_template: the JAX params tree (None: keyed by the torch names).
      name_map: see :func:`name_map_for`.
      ds_config: with a list of groups only: the DeepSpeed config whose settings to reproduce
        (DeepSpeed's defaults for absent keys, so ``{}`` clips at 1.0). None: a plain torch
        AdamW, no clipping.
      allow: refused settings to continue without (see :func:`update.read_settings`).
      report: called once with the text, one line per setting (value, whether it was
        DeepSpeed's default, what the chain does); None: silent.
    """
    if isinstance(param_groups, DeepSpeedCheckpoint):
        if ds_config is not None:
            raise ValueError("ds_config= is for a list of param groups; a checkpoint's own is used")
        settings = U.update_settings(param_groups, allow)
        groups = _check_groups(param_groups.param_groups)
    else:
        groups = _check_groups(param_groups)
        settings = U.config_settings(ds_config, allow)
    names = {n: None for g in groups for n in g["names"]}
    if params_template is None:
        params_template = {n: jax.ShapeDtypeStruct((), jnp.float32) for n in names}
        nm = ti_names.NameMap(entries=tuple((n, (n,), "identity") for n in names))
    else:
        nm = _names_only_map(list(names), params_template, name_map)
    parts = [*settings.transforms(), *_adamw_groups(groups, nm, params_template)]
    tx = parts[0] if len(parts) == 1 else optax.chain(*parts)
    _GROUPS[id(tx)] = (tx, groups, settings)
    if report is not None:
        report(settings.report(groups))
    return tx


def _adamw_groups(groups, nm, params_template) -> list[optax.GradientTransformation]:
    """AdamW with the groups' hyperparameters, as the parts of a chain (one Adam when they
    share lr, betas and eps; without clipping the chain is what it was before clipping was
    read, so older jaxzero checkpoints of it restore)."""
    shared = {tuple(g[k] for k in ("lr", "betas", "eps")) for g in groups}
    if len(shared) == 1:
        lr, (b1, b2), eps = groups[0]["lr"], groups[0]["betas"], groups[0]["eps"]
        decays = []
        for wd in sorted({float(g["weight_decay"]) for g in groups} - {0.0}):
            mask = _label_tree(
                groups, nm, params_template, lambda i, wd=wd: float(groups[i]["weight_decay"]) == wd
            )
            decays.append(optax.add_decayed_weights(wd, mask=mask))
        return [
            optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
            *decays,
            optax.scale_by_learning_rate(lr),
        ]
    inner = {
        str(i): optax.adamw(
            g["lr"],
            b1=g["betas"][0],
            b2=g["betas"][1],
            eps=g["eps"],
            weight_decay=float(g["weight_decay"]),
        )
        for i, g in enumerate(groups)
    }
    return [optax.multi_transform(inner, _label_tree(groups, nm, params_template, str))]


def _names_only_map(names, params_template, name_map):
    if isinstance(name_map, ti_names.NameMap):
        return name_map
    nm = ti_names.build_name_map(list(names), params_template, overrides=name_map)
    nm.check()
    return nm


def groups_of(tx) -> list[dict] | None:
    """The param groups :func:`adamw` built ``tx`` for (None for other transformations)."""
    hit = _GROUPS.get(id(tx))
    return hit[1] if hit is not None and hit[0] is tx else None


def settings_of(tx) -> U.UpdateSettings | None:
    """The update settings :func:`adamw` built ``tx`` with (None for other transformations)."""
    hit = _GROUPS.get(id(tx))
    return hit[2] if hit is not None and hit[0] is tx else None


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
        for k in ("names", *_HYPER)
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
    groups = _check_groups(ckpt.param_groups)
    _check_tx(zero, ckpt, groups)
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
                **ti_opt.adamw_hyperparams(**{k: g[k] for k in _HYPER}),
                "params": list(range(start, start + len(g["names"]))),
            }
        )
        start += len(g["names"])
    opt_state = ti_opt.import_optimizer_state(
        state.opt_state, sd, [g["names"] for g in groups], name_map=nm
    )
    step = jax.device_put(np.int32(ckpt.step), state.step.sharding)
    return state.replace(opt_state=opt_state, step=step)


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
    groups = _check_groups(groups)
    clip = U.chain_clipping(settings_of(zero.tx) if zero is not None else None, ds_config)
    names = [n for g in groups for n in g["names"]]
    master = state.master if state.master is not None else state.params
    nm = (
        name_map
        if isinstance(name_map, ti_names.NameMap)
        else _names_only_map(names, master, name_map)
    )
    weights = {n: t.numpy() for n, t in ti_names.flax_to_torch(master, nm).items()}
    hp = [ti_opt.adamw_hyperparams(**{k: g[k] for k in _HYPER}) for g in groups]
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
