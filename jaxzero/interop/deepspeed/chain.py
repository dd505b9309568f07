"""The optax chain reproducing a DeepSpeed (or torch) Adam(W) update: :func:`adamw`.

The settings come from :mod:`jaxzero.interop.deepspeed.update`; the chain remembers the param
groups and settings it was built for (:func:`groups_of`, :func:`settings_of`), which
:func:`jaxzero.interop.deepspeed.to_train_state` checks and the writer records.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import jaxzero.interop.deepspeed.update as U
from jaxzero.interop.deepspeed.reader import DeepSpeedCheckpoint
from jaxzero.interop.torch import names as ti_names

__all__ = ["HYPER", "adamw", "check_groups", "groups_of", "names_only_map", "settings_of"]

# tx -> the param groups and update settings it was built for (so write_checkpoint can recover
# them from a ZeRO)
_GROUPS: dict[int, tuple[optax.GradientTransformation, list[dict], U.UpdateSettings]] = {}
#: the hyperparameters of a param group, beside its ``names``
HYPER = ("lr", "betas", "eps", "weight_decay")


def check_groups(param_groups) -> list[dict]:
    """``param_groups`` (a non-empty list of dicts with ``names`` and :data:`HYPER`) as plain
    dicts of those keys alone, ``betas`` a tuple of floats; a TypeError or ValueError for
    anything else."""
    if not isinstance(param_groups, list | tuple) or not param_groups:
        raise TypeError(f"param_groups must be a non-empty list of dicts, got {param_groups!r}")
    out = []
    for i, g in enumerate(param_groups):
        missing = [k for k in ("names", *HYPER) if k not in g]
        if missing:
            raise ValueError(
                f"param group {i} lacks {missing} (needs names, lr, betas, eps, weight_decay)"
            )
        out.append({"names": list(g["names"]), **{k: g[k] for k in HYPER}})
        out[-1]["betas"] = tuple(float(b) for b in g["betas"])
    return out


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
    """The optax chain reproducing a DeepSpeed (or torch) Adam(W) update on ``params_template``.

    From a checkpoint, every ``ds_config`` setting that changes the update is reproduced, with
    DeepSpeed 0.19.8's defaults for absent keys, or refused (:class:`DeepSpeedSettingError`
    naming it, before anything is built): gradient clipping (DeepSpeed clips at global norm 1.0
    unless ``gradient_clipping`` says otherwise; ZeRO 1/2 optimizer files' ``clip_grad`` wins),
    the gradient reduction, DeepSpeed's lr schedulers (optax schedules continuing at the
    checkpoint's scheduler iteration, :mod:`jaxzero.interop.deepspeed.schedules`), Adam's
    ``adam_w_mode: false`` (L2 decay), and the param groups. fp16 loss scaling is the ZeRO's:
    :func:`jaxzero.interop.deepspeed.loss_scale`.

    ``optax.chain([optax.clip_by_global_norm(c)], scale_by_adam, masked add_decayed_weights per
    distinct weight decay, scale_by_learning_rate)`` when the groups share lr, betas and eps
    (L2: the decays before ``scale_by_adam``); ``[optax.chain(clip,]
    optax.multi_transform(one optax.adamw per group)[)]`` otherwise. Bias correction and the
    schedules continue from the optax step counts (set from the checkpoint's step by
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
        groups = check_groups(param_groups.param_groups)
    else:
        groups = check_groups(param_groups)
        settings = U.config_settings(ds_config, allow, param_groups=groups)
    names = {n: None for g in groups for n in g["names"]}
    if params_template is None:
        params_template = {n: jax.ShapeDtypeStruct((), jnp.float32) for n in names}
        nm = ti_names.NameMap(entries=tuple((n, (n,), "identity") for n in names))
    else:
        nm = names_only_map(list(names), params_template, name_map)
    parts = [*settings.transforms(), *_adamw_groups(groups, nm, params_template, settings)]
    tx = parts[0] if len(parts) == 1 else optax.chain(*parts)
    _GROUPS[id(tx)] = (tx, groups, settings)
    if report is not None:
        report(settings.report(groups))
    return tx


def _hyper(g: dict, sched) -> tuple:
    """A group's ``(lr, b1, b2, eps, key)``: numbers, or the scheduler's optax schedules."""
    lr = g["lr"] if sched is None else sched.lr
    cycled = sched is not None and sched.b1 is not None
    b1, b2 = (sched.b1, sched.b2) if cycled else g["betas"]
    key = (g["lr"] if sched is None else sched.key, () if cycled else g["betas"], g["eps"])
    return lr, b1, b2, g["eps"], key


def _adam(b1, b2, eps) -> optax.GradientTransformation:
    if callable(b1):  # OneCycle's beta1, a schedule of the step count
        return optax.inject_hyperparams(optax.scale_by_adam)(b1=b1, b2=b2, eps=eps)
    return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)


def _adamw_groups(groups, nm, params_template, settings) -> list[optax.GradientTransformation]:
    """Adam(W) with the groups' hyperparameters (the scheduler's lr and beta1 schedules when
    there is one), as the parts of a chain: one Adam when the groups share lr, betas and eps
    (without clipping and scheduler the chain is what it was before they were read, so older
    jaxzero checkpoints of it restore), else one per group. L2 weight decay
    (``settings.l2_weight_decay``) goes before the Adam, decoupled decay after it."""
    l2 = settings.l2_weight_decay
    scheds = settings.schedule.groups if settings.schedule is not None else [None] * len(groups)
    hyper = [_hyper(g, s) for g, s in zip(groups, scheds, strict=True)]
    if len({h[-1] for h in hyper}) == 1:
        lr, b1, b2, eps, _ = hyper[0]
        decays = []
        for wd in sorted({float(g["weight_decay"]) for g in groups} - {0.0}):
            mask = _label_tree(
                groups, nm, params_template, lambda i, wd=wd: float(groups[i]["weight_decay"]) == wd
            )
            decays.append(optax.add_decayed_weights(wd, mask=mask))
        adam = _adam(b1, b2, eps)
        order = [*decays, adam] if l2 else [adam, *decays]
        return [*order, optax.scale_by_learning_rate(lr)]
    inner = {}
    for i, (g, (lr, b1, b2, eps, _)) in enumerate(zip(groups, hyper, strict=True)):
        wd = float(g["weight_decay"])
        if not (l2 or callable(b1)):
            inner[str(i)] = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
            continue
        decay = [optax.add_decayed_weights(wd)] if wd else []
        adam = _adam(b1, b2, eps)
        order = [*decay, adam] if l2 else [adam, *decay]
        inner[str(i)] = optax.chain(*order, optax.scale_by_learning_rate(lr))
    return [optax.multi_transform(inner, _label_tree(groups, nm, params_template, str))]


def names_only_map(names, params_template, name_map):
    """The checked name map pairing the torch param ``names`` with the leaves of
    ``params_template`` (``name_map``: a ready NameMap, or overrides for the built one)."""
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
