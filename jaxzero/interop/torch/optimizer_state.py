"""Optimizer state: torch Adam/AdamW/SGD state dicts (consolidated, or the per-rank local
state dicts of ``ZeroRedundancyOptimizer``) <-> optax states. See :mod:`jaxzero.interop.torch`."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxzero.interop.torch.names import (
    ADAM_KEYS,
    SGD_KEYS,
    NameMap,
    _fits,
    _fmt,
    _host,
    _list,
    _place,
    _resolve_map,
    _shape,
    _table,
    _to_flax,
    _to_torch,
    _torch,
)
from jaxzero.interop.torch.partition import greedy_partition

__all__ = [
    "adamw_hyperparams",
    "import_optimizer_state",
    "export_optimizer_state",
    "import_zero_optimizer_state",
    "export_zero_optimizer_state",
]


# ------------------------------------------------------------------ optimizer state
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


def _fields(x) -> set[str]:
    if isinstance(x, type):
        return set()
    names = set(getattr(x, "_fields", ()) or ())
    if dataclasses.is_dataclass(x):
        names |= {f.name for f in dataclasses.fields(x)}
    return names


def _node_kind(x) -> str | None:
    f = _fields(x)
    if {"mu", "nu", "count"} <= f:
        return "adam"
    if "trace" in f:
        return "sgd"
    return None


def _replace(node, **kw):
    return node._replace(**kw) if hasattr(node, "_replace") else dataclasses.replace(node, **kw)


_JAX_FIELDS = {"adam": ("mu", "nu"), "sgd": ("trace",)}
_TORCH_FIELDS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class _OptNodes:
    """The Adam (mu/nu/count) and trace nodes of an optax state, found by their fields."""

    def __init__(self, opt_state):
        self.leaves, self.treedef = jax.tree_util.tree_flatten(
            opt_state, is_leaf=lambda x: _node_kind(x) is not None
        )
        self.kind = {i: k for i, x in enumerate(self.leaves) if (k := _node_kind(x))}
        if not self.kind:
            raise TypeError(
                "opt_state has no Adam-like (mu/nu/count) or momentum (trace) node; only Adam, "
                "AdamW and SGD-with-momentum states are supported"
            )
        self.tables = {
            i: {f: _table(getattr(self.leaves[i], f)) for f in _JAX_FIELDS[k]}
            for i, k in self.kind.items()
        }
        self.node_of: dict[tuple[str, ...], int] = {}
        for i, k in self.kind.items():
            for path in self.tables[i][_JAX_FIELDS[k][0]]:
                self.node_of.setdefault(path, i)

    def shapes(self) -> dict:
        return {
            p: _shape(self.tables[i][_JAX_FIELDS[self.kind[i]][0]][p])
            for p, i in self.node_of.items()
        }

    def name_map(self, name_map, torch_source) -> NameMap:
        return _resolve_map(name_map, torch_source, self.shapes())

    def read(self, nm: NameMap, names) -> dict:
        """``{torch_name: {key: np.ndarray}}`` in torch layout."""
        unknown = [n for n in names if n not in nm]
        if unknown:
            raise ValueError(f"param_names with no tree leaf in the name map: {_list(unknown)}")
        out = {}
        for name in names:
            path, layout = nm.lookup(name)
            if path not in self.node_of:
                raise ValueError(f"{name}: no optimizer state at {_fmt(path)}")
            i = self.node_of[path]
            kind, entry = self.kind[i], {}
            if kind == "adam":
                entry["step"] = float(_host(self.leaves[i].count))
            for jf, tf in zip(_JAX_FIELDS[kind], _TORCH_FIELDS[kind], strict=True):
                entry[tf] = _to_torch(layout, _host(self.tables[i][jf][path]))
            out[name] = entry
        return out

    def write(self, states: dict, nm: NameMap, strict: bool):
        """A new opt_state with ``{torch_name: {key: value}}`` written in; validates first."""
        kinds = {n: _param_kind(e) for n, e in states.items()}
        bad = [f"{n}: {k}" for n, k in kinds.items() if k not in ("adam", "sgd")]
        if bad:
            raise ValueError(
                "unsupported torch optimizer state (Adam/AdamW without amsgrad, or SGD with "
                f"momentum, only): {_list(bad)}"
            )
        have = set(self.kind.values())
        wrong = [f"{n} ({k})" for n, k in kinds.items() if k not in have]
        if wrong:
            raise TypeError(
                f"the torch state does not match the optax state (which has only "
                f"{'/'.join(sorted(have))} nodes): {_list(wrong)}; e.g. an SGD "
                f"momentum_buffer cannot go into Adam's mu/nu"
            )
        unmapped = [n for n in states if n not in nm]
        if unmapped:
            why = [u for u in nm.unmatched_torch if u.split(" ")[0] in unmapped]
            raise ValueError(
                f"optimizer state for params with no tree leaf: {_list(why or unmapped)}"
            )
        errors, values, steps, given = [], {}, {}, set()
        for name, path, layout in nm.entries:
            if name not in states:
                continue
            i = self.node_of.get(path)
            if i is None or self.kind[i] != kinds[name]:
                errors.append(f"{name}: no {kinds[name]} state at {_fmt(path)}")
                continue
            given.add((i, path))
            for jf, tf in zip(_JAX_FIELDS[kinds[name]], _TORCH_FIELDS[kinds[name]], strict=True):
                value = _host(states[name][tf])
                target = _shape(self.tables[i][jf][path])
                if not _fits(layout, value.shape, target):
                    errors.append(
                        f"{name}.{tf}: shape {value.shape} does not fit {_fmt(path)} {target}"
                    )
                    continue
                values.setdefault(i, {}).setdefault(jf, {})[path] = _to_flax(layout, value)
            if kinds[name] == "adam":
                steps.setdefault(i, {})[name] = float(_host(states[name]["step"]))
        for by_name in steps.values():
            distinct = set(by_name.values())
            if len(distinct) > 1 or not all(s >= 0 and float(s).is_integer() for s in distinct):
                errors.append(
                    "one optax count cannot hold these torch steps: "
                    + _list(f"{n}={s:g}" for n, s in by_name.items())
                )
        if strict:
            for i in {i for i, _ in given}:
                field = _JAX_FIELDS[self.kind[i]][0]
                missing = [_fmt(p) for p in self.tables[i][field] if (i, p) not in given]
                if missing:
                    errors.append(f"no torch state for tree leaves {_list(missing)}")
        if errors:
            raise ValueError("cannot import the optimizer state: " + "; ".join(errors))
        if not values:
            raise ValueError("the torch optimizer state is empty: nothing to import")
        leaves = list(self.leaves)
        for i, per_field in values.items():
            node, repl = leaves[i], {}
            for jf, new in per_field.items():
                table = self.tables[i][jf]
                placed = [_place(new[p], leaf) if p in new else leaf for p, leaf in table.items()]
                treedef = jax.tree_util.tree_structure(getattr(node, jf))
                repl[jf] = jax.tree_util.tree_unflatten(treedef, placed)
            if i in steps:
                repl["count"] = _place(np.asarray(int(next(iter(steps[i].values())))), node.count)
            leaves[i] = _replace(node, **repl)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _param_kind(entry) -> str:
    if not isinstance(entry, Mapping):
        return f"not a dict ({type(entry).__name__})"
    keys = set(entry)
    if keys == set(ADAM_KEYS):
        return "adam"
    if keys == set(SGD_KEYS) and entry["momentum_buffer"] is not None:
        return "sgd"
    return f"keys {sorted(keys)}"


def _groups(param_names) -> list[list[str]]:
    if isinstance(param_names, str) or not isinstance(param_names, Sequence):
        raise TypeError("param_names must be a list of torch names (or one list per group)")
    if all(isinstance(n, str) for n in param_names):
        return [list(param_names)]
    if all(isinstance(g, Sequence) and not isinstance(g, str) for g in param_names):
        if all(isinstance(n, str) for g in param_names for n in g):
            return [list(g) for g in param_names]
    raise TypeError("param_names must be a list of str or a list of lists of str")


def _load(source):
    if isinstance(source, str | os.PathLike):
        return _torch().load(source, map_location="cpu", weights_only=True)
    return source


def _check_sd(sd, what: str) -> None:
    if not isinstance(sd, Mapping) or not {"state", "param_groups"} <= set(sd):
        keys = list(sd) if isinstance(sd, Mapping) else type(sd).__name__
        raise ValueError(
            f"{what} is not a torch optimizer state dict (expected keys 'state' and "
            f"'param_groups', got {keys})"
        )


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
    sd = _load(torch_state)
    _check_sd(sd, "torch_state")
    groups = _groups(param_names)
    names = [n for g in groups for n in g]
    indices = [i for g in sd["param_groups"] for i in g["params"]]
    if sorted(indices) != list(range(len(names))):
        raise ValueError(
            f"the state dict's param_groups hold {len(indices)} params (indices "
            f"{_list(sorted(indices))}) but param_names lists {len(names)}: {_list(names)}"
        )
    sizes = [len(g["params"]) for g in sd["param_groups"]]
    if len(groups) > 1 and [len(g) for g in groups] != sizes:
        raise ValueError(
            f"param_names has groups of {[len(g) for g in groups]} params but the state dict's "
            f"param_groups have {sizes}"
        )
    extra = [k for k in sd["state"] if not (isinstance(k, int) and 0 <= k < len(names))]
    if extra:
        raise ValueError(f"state entries for unknown param indices: {_list(extra)}")
    missing = [names[i] for i in range(len(names)) if i not in sd["state"]]
    if missing and strict:
        raise ValueError(f"the state dict has no state for: {_list(missing)}")
    states = {names[i]: e for i, e in sd["state"].items()}
    nodes = _OptNodes(opt_state)
    return nodes.write(states, nodes.name_map(name_map, names), strict)


def _first_shape(entry):
    if isinstance(entry, Mapping):
        for key in ("exp_avg", "momentum_buffer"):
            if entry.get(key) is not None:
                return _shape(entry[key])
    return ()


def _tensors(entry: dict) -> dict:
    torch = _torch()
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
      ``{"state": {i: {"step", "exp_avg", "exp_avg_sq"} or {"momentum_buffer"}},
      "param_groups": [{**hyperparams, "params": [i, ...]}, ...]}`` with float32 ``step``.
    """
    groups = _groups(param_names)
    names = [n for g in groups for n in g]
    nodes = _OptNodes(opt_state)
    states = nodes.read(nodes.name_map(name_map, names), names)
    param_groups, start = [], 0
    for g, hp in zip(groups, _hyper(hyperparams, len(groups)), strict=True):
        param_groups.append({**hp, "params": list(range(start, start + len(g)))})
        start += len(g)
    return {
        "state": {i: _tensors(states[n]) for i, n in enumerate(names)},
        "param_groups": param_groups,
    }


def _zero_plan(groups, numels, world_size):
    gids = [g for g, names in enumerate(groups) for _ in names]
    return greedy_partition(numels, world_size, groups=gids, sort=True)


def import_zero_optimizer_state(
    opt_state, rank_states, param_names, *, world_size=None, name_map=None, strict=True
):
    """Load ``ZeroRedundancyOptimizer``'s per-rank local state dicts (``zero.optim``).

    Rank r's local optimizer numbers its params 0..k-1 across its groups in the rank's
    assignment order (:func:`jaxzero.layouts.greedy_partition` with ``sort=True``, one running
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
    if callable(rank_states):
        if world_size is None:
            raise ValueError("world_size is required when rank_states is a callable")
        get = rank_states
    else:
        if isinstance(rank_states, str | os.PathLike | Mapping):
            raise TypeError("rank_states must be a list with one entry per rank (or a callable)")
        rank_states = list(rank_states)
        world_size = len(rank_states) if world_size is None else world_size
        if len(rank_states) != world_size:
            raise ValueError(
                f"{len(rank_states)} per-rank state dicts given for world_size={world_size}"
            )
        get = rank_states.__getitem__
    nodes = _OptNodes(opt_state)
    nm = nodes.name_map(name_map, names)
    shapes = nodes.shapes()
    unknown = [n for n in names if n not in nm]
    if unknown:
        raise ValueError(f"param_names with no tree leaf: {_list(unknown)}")
    numels = [math.prod(shapes[nm.lookup(n)[0]]) for n in names]
    plan = _zero_plan(groups, numels, world_size)
    states, errors = {}, []
    for r in range(world_size):
        order = plan.per_rank[r]
        if not any(order):
            continue
        sd = _load(get(r))
        try:
            _check_sd(sd, f"rank {r}'s state dict")
        except ValueError as e:
            errors.append(str(e))
            continue
        local = [i for g in order for i in g]
        got = [len(g["params"]) for g in sd["param_groups"]]
        want = [len(g) for g in order]
        got_idx = [i for g in sd["param_groups"] for i in g["params"]]
        if got != want or got_idx != list(range(len(local))):
            errors.append(
                f"rank {r}: its local param groups hold {got} params but the world_size="
                f"{world_size} partition gives rank {r} {want} ({_list(names[i] for i in local)});"
                f" are the files from another world size, model or param-group split?"
            )
            continue
        extra = [k for k in sd["state"] if not (isinstance(k, int) and 0 <= k < len(local))]
        if extra:
            errors.append(f"rank {r}: state for unknown local indices {_list(extra)}")
        absent = [names[local[j]] for j in range(len(local)) if j not in sd["state"]]
        if absent and strict:
            errors.append(f"rank {r}: no state for {_list(absent)}")
        for j, entry in sd["state"].items():
            if isinstance(j, int) and 0 <= j < len(local):
                name = names[local[j]]
                path, layout = nm.lookup(name)
                got_shape = _first_shape(entry)
                if got_shape != () and not _fits(layout, got_shape, shapes[path]):
                    errors.append(
                        f"rank {r} local {j} ({name}): state shape {got_shape} does not fit "
                        f"{_fmt(path)} {shapes[path]}"
                    )
                states[name] = entry
    if errors:
        raise ValueError("cannot import the ZeRO state: " + "; ".join(errors))
    return nodes.write(states, nm, strict)


def export_zero_optimizer_state(
    opt_state, param_names, world_size: int, *, hyperparams, name_map=None
) -> list[dict]:
    """The local state dicts the ranks' ``ZeroRedundancyOptimizer.optim`` would hold.

    Returns one ``{"state": {local_i: ...}, "param_groups": [...]}`` per rank; every rank has
    one group per global group (possibly empty), numbered in the rank's assignment order.
    """
    groups = _groups(param_names)
    names = [n for g in groups for n in g]
    nodes = _OptNodes(opt_state)
    states = nodes.read(nodes.name_map(name_map, names), names)
    numels = [states[n][_TORCH_FIELDS["adam" if "exp_avg" in states[n] else "sgd"][0]].size
              for n in names]  # fmt: skip
    plan = _zero_plan(groups, numels, world_size)
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
