"""Optimizer state: torch Adam/AdamW/SGD state dicts (consolidated, or the per-rank local
state dicts of ``ZeroRedundancyOptimizer``) <-> optax states. See :mod:`jaxzero.interop.torch`."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from jaxzero.interop.torch.common import fmt_path, join, shape_of
from jaxzero.interop.torch.loading import load, optimizer_state_dict_problem, torch_module
from jaxzero.interop.torch.names import fits
from jaxzero.interop.torch.opt_nodes import TORCH_FIELDS, OptNodes
from jaxzero.interop.torch.partition import greedy_partition

__all__ = [
    "adamw_hyperparams",
    "import_optimizer_state",
    "export_optimizer_state",
    "import_zero_optimizer_state",
    "export_zero_optimizer_state",
]


def adamw_hyperparams(
    lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01, **extra
) -> dict:
    """A torch 2.x ``AdamW`` param-group dict (without ``params``) for the export functions
    (``Optimizer.load_state_dict`` takes the hyper-parameters from the loaded groups)."""
    group = dict(
        lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
        maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
        decoupled_weight_decay=True,
    )  # fmt: skip
    group.update(extra)
    return group


def _groups(param_names) -> list[list[str]]:
    if isinstance(param_names, str) or not isinstance(param_names, Sequence):
        raise TypeError("param_names must be a list of torch names (or one list per group)")
    if all(isinstance(n, str) for n in param_names):
        return [list(param_names)]
    if all(isinstance(g, Sequence) and not isinstance(g, str) for g in param_names):
        if all(isinstance(n, str) for g in param_names for n in g):
            return [list(g) for g in param_names]
    raise TypeError("param_names must be a list of str or a list of lists of str")


def import_optimizer_state(opt_state, torch_state, param_names, *, name_map=None, strict=True):
    """Load a consolidated torch optimizer state dict into a copy of ``opt_state``.

    Args:
      opt_state: the target optax state (e.g. ``TrainState.opt_state``). Its Adam nodes
        (fields ``mu``/``nu``/``count``) or trace nodes (``trace``) get the torch values, each
        leaf with the old leaf's dtype and sharding; everything else is kept.
      torch_state: ``optimizer.state_dict()`` (or ``ZeroRedundancyOptimizer.state_dict()``
        after ``consolidate_state_dict``) keyed by **global** index, or a path to one.
      param_names: the torch names of the params in the order given to the optimizer (a flat
        list, or one list per param group), e.g. ``[n for n, _ in model.named_parameters()]``.
      name_map: a :class:`NameMap` against the params tree, or a torch template; default: built
        from ``param_names`` and the state's shapes.
      strict: every param must have state, and every leaf of an imported node must get some.

    Raises:
      ValueError: index/name mismatches, missing or extra entries, shapes, differing steps.
      TypeError: the torch state kind (Adam vs SGD) has no counterpart in ``opt_state``.
    """
    sd = load(torch_state, "torch optimizer state file")
    problem = optimizer_state_dict_problem(sd, "torch_state")
    if problem:
        raise ValueError(problem)
    groups = _groups(param_names)
    names = [n for g in groups for n in g]
    indices = [i for g in sd["param_groups"] for i in g["params"]]
    if sorted(indices) != list(range(len(names))):
        raise ValueError(
            f"the state dict's param_groups hold {len(indices)} params (indices "
            f"{join(sorted(indices))}) but param_names lists {len(names)}: {join(names)}"
        )
    sizes = [len(g["params"]) for g in sd["param_groups"]]
    if len(groups) > 1 and [len(g) for g in groups] != sizes:
        raise ValueError(
            f"param_names has groups of {[len(g) for g in groups]} params but the state dict's "
            f"param_groups have {sizes}"
        )
    extra = [k for k in sd["state"] if not (isinstance(k, int) and 0 <= k < len(names))]
    if extra:
        raise ValueError(f"state entries for unknown param indices: {join(extra)}")
    missing = [names[i] for i in range(len(names)) if i not in sd["state"]]
    if missing and strict:
        raise ValueError(f"the state dict has no state for: {join(missing)}")
    states = {names[i]: e for i, e in sd["state"].items()}
    nodes = OptNodes(opt_state)
    return nodes.write(states, nodes.name_map(name_map, names), strict)


def _first_shape(entry):
    if isinstance(entry, Mapping):
        for key in ("exp_avg", "momentum_buffer"):
            if entry.get(key) is not None:
                return shape_of(entry[key])
    return ()


def _tensors(entry: dict) -> dict:
    torch = torch_module()
    return {
        k: torch.tensor(v, dtype=torch.float32)
        if k == "step"
        else torch.from_numpy(np.ascontiguousarray(v))
        for k, v in entry.items()
    }


def _hyper(hyperparams, n_groups) -> list[dict]:
    if isinstance(hyperparams, Mapping):
        hyperparams = [hyperparams] * n_groups
    hyperparams = [{k: v for k, v in h.items() if k != "params"} for h in hyperparams]
    if len(hyperparams) != n_groups:
        raise ValueError(f"{len(hyperparams)} hyperparams dicts for {n_groups} param groups")
    return hyperparams


def export_optimizer_state(opt_state, param_names, *, hyperparams, name_map=None) -> dict:
    """The consolidated torch state dict (global indices) of ``opt_state``.

    Args:
      param_names: torch names in optimizer order (flat, or one list per group).
      hyperparams: a torch param-group dict (:func:`adamw_hyperparams`) or one per group.
      name_map: :class:`NameMap`, a torch template, or None (names from the leaves' paths,
        or ``param_names`` matched against the tree by the rules).

    Returns:
      The state dict ``{"state": {i: state_i}, "param_groups": [group, ...]}``: ``state_i`` is
      ``{"step", "exp_avg", "exp_avg_sq"}`` (float32 ``step``) or ``{"momentum_buffer"}``,
      each group is ``hyperparams`` plus ``"params": [i, ...]``.
    """
    groups = _groups(param_names)
    names = [n for g in groups for n in g]
    nodes = OptNodes(opt_state)
    states = nodes.read(nodes.name_map(name_map, names), names)
    param_groups, start = [], 0
    for g, hp in zip(groups, _hyper(hyperparams, len(groups)), strict=True):
        param_groups.append({**hp, "params": list(range(start, start + len(g)))})
        start += len(g)
    return {
        "state": {i: _tensors(states[n]) for i, n in enumerate(names)},
        "param_groups": param_groups,
    }


def zero_partition(groups, numels, world_size):
    """``ZeroRedundancyOptimizer``'s partition of the params of ``groups`` (lists of names,
    one per param group) with ``numels`` elements over ``world_size`` ranks."""
    gids = [g for g, names in enumerate(groups) for _ in names]
    return greedy_partition(numels, world_size, groups=gids, sort=True)


def import_zero_optimizer_state(
    opt_state, rank_states, param_names, *, world_size=None, name_map=None, strict=True
):
    """Load ``ZeroRedundancyOptimizer``'s per-rank local state dicts (``zero.optim``).

    Rank r's local optimizer numbers its params 0..k-1 across its groups in the rank's
    assignment order (:func:`jaxzero.greedy_partition` with ``sort=True``, one running
    total over all groups). The numels come from ``opt_state``, so the partition is known
    before anything is read; a rank's file is read only if that rank owns params, and each is
    checked against the partition (group sizes, shapes) before anything is placed.

    Args:
      rank_states: one entry per rank (a path, a state dict, or None for a rank that owns
        nothing), or a callable ``rank -> state dict or path``.
      param_names: torch names in the global optimizer order (flat or one list per group).
      world_size: the number of ranks (default ``len(rank_states)``; required for a callable).
      name_map, strict: as in :func:`import_optimizer_state`.
    """
    groups = _groups(param_names)
    names = [n for g in groups for n in g]
    get, world_size = _rank_getter(rank_states, world_size)
    nodes = OptNodes(opt_state)
    nm = nodes.name_map(name_map, names)
    shapes = nodes.shapes()
    unknown = [n for n in names if n not in nm]
    if unknown:
        raise ValueError(f"param_names with no tree leaf: {join(unknown)}")
    numels = [math.prod(shapes[nm.lookup(n)[0]]) for n in names]
    partition = zero_partition(groups, numels, world_size)
    states, errors = {}, []
    for r in range(world_size):
        order = partition.per_rank[r]
        if any(order):  # a rank that owns nothing is never read
            local = [names[i] for g in order for i in g]
            errors += _read_rank(
                r, load(get(r), f"rank {r} optimizer state file"), order, local,
                world_size=world_size, nm=nm, shapes=shapes, strict=strict, states=states,
            )  # fmt: skip
    if errors:
        raise ValueError("cannot import the ZeRO state: " + "; ".join(errors))
    return nodes.write(states, nm, strict)


def _rank_getter(rank_states, world_size):
    """``(rank -> state dict or path, world_size)`` for ``rank_states``."""
    if callable(rank_states):
        if world_size is None:
            raise ValueError("world_size is required when rank_states is a callable")
        return rank_states, world_size
    if isinstance(rank_states, str | os.PathLike | Mapping):
        raise TypeError("rank_states must be a list with one entry per rank (or a callable)")
    rank_states = list(rank_states)
    world_size = len(rank_states) if world_size is None else world_size
    if len(rank_states) != world_size:
        raise ValueError(
            f"{len(rank_states)} per-rank state dicts given for world_size={world_size}"
        )
    return rank_states.__getitem__, world_size


def _read_rank(r, sd, order, local, *, world_size, nm, shapes, strict, states) -> list[str]:
    """Check rank ``r``'s local state dict ``sd`` against its share of the partition
    (``order``: its tensor indices per group; ``local``: their names) and add its entries to
    ``states``; returns the problems found."""
    problem = optimizer_state_dict_problem(sd, f"rank {r}'s state dict")
    if problem:
        return [problem]
    got = [len(g["params"]) for g in sd["param_groups"]]
    want = [len(g) for g in order]
    got_idx = [i for g in sd["param_groups"] for i in g["params"]]
    if got != want or got_idx != list(range(len(local))):
        return [
            f"rank {r}: its local param groups hold {got} params but the world_size="
            f"{world_size} partition gives rank {r} {want} ({join(local)}); are the files from "
            f"another world size, model or param-group split?"
        ]
    errors = []
    extra = [k for k in sd["state"] if not (isinstance(k, int) and 0 <= k < len(local))]
    if extra:
        errors.append(f"rank {r}: state for unknown local indices {join(extra)}")
    absent = [local[j] for j in range(len(local)) if j not in sd["state"]]
    if absent and strict:
        errors.append(f"rank {r}: no state for {join(absent)}")
    for j, entry in sd["state"].items():
        if isinstance(j, int) and 0 <= j < len(local):
            path, kind = nm.lookup(local[j])
            got_shape = _first_shape(entry)
            if got_shape != () and not fits(kind, got_shape, shapes[path]):
                errors.append(
                    f"rank {r} local {j} ({local[j]}): state shape {got_shape} does not fit "
                    f"{fmt_path(path)} {shapes[path]}"
                )
            states[local[j]] = entry
    return errors


def export_zero_optimizer_state(
    opt_state, param_names, world_size: int, *, hyperparams, name_map=None
) -> list[dict]:
    """The local state dicts the ranks' ``ZeroRedundancyOptimizer.optim`` would hold.

    Returns one ``{"state": {local_i: ...}, "param_groups": [...]}`` per rank; every rank has
    one group per global group (possibly empty), numbered in the rank's assignment order.
    """
    groups = _groups(param_names)
    names = [n for g in groups for n in g]
    nodes = OptNodes(opt_state)
    states = nodes.read(nodes.name_map(name_map, names), names)
    numels = [states[n][TORCH_FIELDS["adam" if "exp_avg" in states[n] else "sgd"][0]].size
              for n in names]  # fmt: skip
    plan = zero_partition(groups, numels, world_size)
    hps = _hyper(hyperparams, len(groups))
    out = []
    for r in range(world_size):
        local, param_groups = [], []
        for g, idxs in enumerate(plan.per_rank[r]):
            param_groups.append(
                {**hps[g], "params": list(range(len(local), len(local) + len(idxs)))}
            )
            local += idxs
        state = {j: _tensors(states[names[i]]) for j, i in enumerate(local)}
        out.append({"state": state, "param_groups": param_groups})
    return out
