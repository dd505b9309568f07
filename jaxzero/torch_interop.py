"""Moving weights, optimizer state and EMAs between PyTorch checkpoints and jaxzero.

torch is optional: it is imported only inside the functions that read ``.pt`` files or build
tensors (``pip install 'jaxzero[torch]'``).

* **Names.** :func:`build_name_map` pairs torch state-dict names with paths of a JAX tree
  (``"fc1.weight"`` <-> ``fc1/kernel``) by built-in rules, user overrides and shapes, and reports
  what it could not pair. Layouts: ``Linear.weight [out, in]`` <-> Dense ``kernel [in, out]``;
  ``Conv.weight [out, in, *k]`` <-> ``kernel [*k, in, out]``; norm ``weight`` <-> ``scale``;
  BatchNorm ``running_mean``/``running_var`` <-> ``batch_stats`` ``mean``/``var``. A tree keyed by
  the torch names themselves (torch layout) maps one to one.
* **Optimizer state.** Adam/AdamW (``exp_avg``, ``exp_avg_sq``, ``step``) <-> optax
  ``ScaleByAdamState`` (``mu``, ``nu``, ``count``) and SGD ``momentum_buffer`` <-> ``TraceState``
  (``trace``), found by walking ``opt_state`` for nodes with those fields, so any chain works.
  Either the consolidated state dict (global indices) or the per-rank local state dicts of
  ``ZeroRedundancyOptimizer`` (local indices, :func:`jaxzero.layouts.greedy_partition`).
* **EMA.** thb1314/distributed_modelema ``{"param": OrderedDict, "updates": n}`` and
  ultralytics/YOLOv5 ``{"ema": model_or_state_dict, "updates": n}`` <-> :class:`EmaState`.
  Non-float entries (``num_batches_tracked``) are never averaged and are left out.

Imports are pure: everything is validated before any array is placed, and the result is a new
tree whose leaves have the target leaves' dtypes and shardings (``jax.device_put``). Errors list
every offending name.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero import ema_bucket as eb
from jaxzero.ema import EmaState
from jaxzero.layouts import greedy_partition

__all__ = [
    "NameMap",
    "build_name_map",
    "torch_to_flax",
    "flax_to_torch",
    "adamw_hyperparams",
    "import_optimizer_state",
    "export_optimizer_state",
    "import_zero_optimizer_state",
    "export_zero_optimizer_state",
    "import_ema",
    "export_ema",
]

KINDS = ("identity", "linear", "conv")
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")
SGD_KEYS = ("momentum_buffer",)
_UNSET = object()


# ------------------------------------------------------------------ small helpers
def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this needs PyTorch: pip install 'jaxzero[torch]' (torch==2.13.0)") from e
    return torch


def _host(x) -> np.ndarray:
    """A numpy copy of a torch tensor, jax array (gathered) or array-like."""
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        return np.array(x)
    if type(x).__module__.startswith("torch"):
        t = x.detach().cpu()
        if t.dtype.is_floating_point and t.dtype.itemsize < 4 and str(t.dtype) != "torch.float16":
            t = t.float()  # bfloat16/float8 have no numpy dtype
        return t.numpy().copy()
    return np.array(x)


def _is_float(x) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return True
    if type(x).__module__.startswith("torch"):
        return bool(dtype.is_floating_point)
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _shape(x) -> tuple[int, ...]:
    if isinstance(x, tuple | list) and all(isinstance(d, int) for d in x):
        return tuple(x)
    return tuple(int(d) for d in x.shape)


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _table(tree) -> dict[tuple[str, ...], Any]:
    """``{path (tuple of str): leaf}`` in flatten order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(_key_str(k) for k in path): leaf for path, leaf in leaves}


def _fmt(path) -> str:
    return "/".join(path)


def _to_flax(kind: str, a: np.ndarray) -> np.ndarray:
    if kind == "linear":
        return a.T
    if kind == "conv":
        return np.transpose(a, tuple(range(2, a.ndim)) + (1, 0))
    return a


def _to_torch(kind: str, a: np.ndarray) -> np.ndarray:
    if kind == "linear":
        return a.T
    if kind == "conv":
        return np.transpose(a, (a.ndim - 1, a.ndim - 2) + tuple(range(a.ndim - 2)))
    return a


def _flax_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return _to_flax(kind, np.empty(shape, np.int8)).shape if kind != "identity" else shape


def _list(items, limit=20) -> str:
    items = list(items)
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(str(i) for i in items[:limit]) + more


# ------------------------------------------------------------------ name map
@dataclasses.dataclass(frozen=True)
class NameMap:
    """Pairs of torch state-dict names and JAX tree paths (see :func:`build_name_map`).

    Attributes:
      entries: ``(torch_name, path, kind)`` in torch order; ``path`` is a tuple of str keys and
        ``kind`` one of ``"identity"``, ``"linear"`` (transpose), ``"conv"``.
      unmatched_torch: float torch names with no path (with the reason).
      unmatched_flax: tree paths (``"a/b"``) no torch name maps to.
      ignored: torch names left out on purpose (non-float entries, ``None`` overrides).
    """

    entries: tuple[tuple[str, tuple[str, ...], str], ...]
    unmatched_torch: tuple[str, ...] = ()
    unmatched_flax: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()

    @functools.cached_property
    def _index(self) -> dict[str, tuple[tuple[str, ...], str]]:
        return {name: (path, kind) for name, path, kind in self.entries}

    @property
    def torch_names(self) -> tuple[str, ...]:
        return tuple(e[0] for e in self.entries)

    def __contains__(self, torch_name) -> bool:
        return torch_name in self._index

    def lookup(self, torch_name: str) -> tuple[tuple[str, ...], str]:
        """``(path, kind)`` of a torch name; KeyError if it is not mapped."""
        if torch_name not in self._index:
            raise KeyError(f"{torch_name!r} is not in the name map")
        return self._index[torch_name]

    def report(self) -> str:
        """A human-readable summary of the pairing."""
        lines = [f"{len(self.entries)} matched"]
        for title, items in (
            ("unmatched torch names", self.unmatched_torch),
            ("unmatched tree paths", self.unmatched_flax),
            ("ignored", self.ignored),
        ):
            if items:
                lines.append(f"{title}: {_list(items, 1000)}")
        return "\n".join(lines)

    def check(self, *, torch_side: bool = True, flax_side: bool = True) -> None:
        """Raise ValueError listing the unmatched names on the requested sides."""
        problems = []
        if torch_side and self.unmatched_torch:
            problems.append(f"torch entries with no tree leaf: {_list(self.unmatched_torch)}")
        if flax_side and self.unmatched_flax:
            problems.append(f"tree leaves with no torch entry: {_list(self.unmatched_flax)}")
        if problems:
            raise ValueError(
                "; ".join(problems) + ". Pass overrides= to build_name_map (torch name -> "
                "path, or None to skip it) or strict=False."
            )


def _torch_entries(source) -> list[tuple[str, tuple[int, ...] | None, bool]]:
    """(name, shape or None, is_float) from a state dict, module, {name: shape} or names."""
    if hasattr(source, "state_dict") and callable(source.state_dict):
        source = source.state_dict()
    if isinstance(source, Sequence) and not isinstance(source, str):
        if not all(isinstance(n, str) for n in source):
            raise TypeError("a list of torch names must hold only str")
        return [(n, None, not n.endswith("num_batches_tracked")) for n in source]
    if not isinstance(source, Mapping):
        raise TypeError(
            f"expected a torch state dict, nn.Module, {{name: shape}} mapping or list of names, "
            f"got {type(source).__name__}"
        )
    out = []
    for name, v in source.items():
        if not isinstance(name, str):
            raise TypeError(f"state-dict keys must be str, got {name!r}")
        is_float = _is_float(v) and not name.endswith("num_batches_tracked")
        out.append((name, _shape(v), is_float))
    return out


def _module_variants(parts: list[str]) -> list[tuple[str, ...]]:
    merged: list[str] = []
    for p in parts:
        if p.isdigit() and merged:
            merged[-1] = f"{merged[-1]}_{p}"
        else:
            merged.append(f"layers_{p}" if p.isdigit() else p)
    return list(dict.fromkeys([tuple(parts), tuple(merged)]))


def _candidates(name: str, shape: tuple[int, ...] | None) -> list[tuple[tuple[str, ...], str]]:
    """Candidate (path, kind) pairs for a torch name, best first (``shape`` None: any ndim)."""
    parts = name.split(".")
    cands = [((name,), "identity"), (tuple(parts), "identity")]
    module, leaf = parts[:-1], parts[-1]
    nd = None if shape is None else len(shape)
    leaves: list[tuple[str, str, str]] = []
    if leaf == "weight":
        if nd in (None, 2):
            leaves += [("kernel", "linear", "params"), ("embedding", "identity", "params")]
        if nd is None or nd >= 3:
            leaves.append(("kernel", "conv", "params"))
        if nd in (None, 1):
            leaves.append(("scale", "identity", "params"))
    elif leaf == "bias":
        leaves.append(("bias", "identity", "params"))
    elif leaf in ("running_mean", "running_var"):
        leaves.append((leaf[len("running_") :], "identity", "batch_stats"))
    for mod in _module_variants(module) if module else [()]:
        for new_leaf, kind, collection in leaves:
            for prefix in ((), (collection,)):
                cands.append((prefix + mod + (new_leaf,), kind))
    return list(dict.fromkeys(cands))


def _fits(kind: str, torch_shape, flax_shape) -> bool:
    flax_shape = tuple(flax_shape)
    if torch_shape is None:  # names only: the layout follows from the leaf's rank
        return {"linear": len(flax_shape) == 2, "conv": len(flax_shape) >= 3}.get(kind, True)
    torch_shape = tuple(torch_shape)
    if kind == "linear" and len(torch_shape) != 2 or kind == "conv" and len(torch_shape) < 3:
        return False
    return _flax_shape(kind, torch_shape) == flax_shape


def _infer_kind(torch_shape, flax_shape) -> str | None:
    if torch_shape is None:
        return "identity"
    return next((k for k in KINDS if _fits(k, torch_shape, flax_shape)), None)


def _parse_override(value, name) -> tuple[tuple[str, ...], str | None] | None:
    if value is None:
        return None
    kind = None
    if isinstance(value, tuple) and len(value) == 2 and value[1] in KINDS:
        value, kind = value
    if isinstance(value, str):
        return tuple(value.split("/")), kind
    if isinstance(value, tuple | list) and value and all(isinstance(p, str) for p in value):
        return tuple(value), kind
    raise TypeError(
        f"override for {name!r} must be a path ('a/b' or tuple of str), (path, kind) with "
        f"kind in {KINDS}, or None; got {value!r}"
    )


def build_name_map(torch_source, tree, *, overrides: Mapping | Callable | None = None) -> NameMap:
    """Pair torch state-dict names with the leaves of ``tree``.

    Rules, first match wins (a candidate matches only if its path exists in ``tree`` and the
    torch shape in the candidate's layout equals the leaf's shape):

    1. an override: ``overrides[name]`` or ``overrides(name, shape)`` giving a path (``"a/b"``
       or a tuple of str), ``(path, kind)`` with kind in ``identity``/``linear``/``conv``, or
       None to ignore the entry; a callable returns ``NotImplemented`` to fall through;
    2. the name itself as one key (``{"fc1.weight": ...}``) or its dotted parts as nested keys,
       layout unchanged;
    3. ``weight`` -> ``kernel`` (2-D: transposed; >= 3-D: conv layout), ``embedding``, or (1-D)
       ``scale``; ``bias`` -> ``bias``; ``running_mean``/``running_var`` -> ``mean``/``var``;
       the module path as given or with numeric parts merged (``layers.0`` -> ``layers_0``),
       with or without a leading ``params`` / ``batch_stats`` collection key.

    Args:
      torch_source: a torch state dict, ``nn.Module``, ``{name: shape}`` mapping, or a list of
        names (shapes unknown: layouts follow from the leaves' ranks), in torch order; None to
        derive torch names from ``tree`` (the rules backwards; numeric parts are not split).
      tree: the JAX tree (arrays or ShapeDtypeStructs).
      overrides: a mapping or a callable, see rule 1.

    Returns:
      A :class:`NameMap`. Non-float torch entries (``num_batches_tracked``) are ``ignored``.

    Raises:
      ValueError: two torch names map to one leaf, or an override names a missing path or a
        shape that does not fit (all such problems are listed).
    """
    return _build({p: _shape(v) for p, v in _table(tree).items()}, torch_source, overrides)


def _build(shapes: dict, torch_source, overrides=None) -> NameMap:
    if torch_source is None:
        return _reverse_map(shapes)
    entries, unmatched, ignored, errors = [], [], [], []
    owner: dict[tuple[str, ...], str] = {}
    for name, tshape, is_float in _torch_entries(torch_source):
        override = _UNSET
        if callable(overrides):
            override = overrides(name, tshape)
            if override is NotImplemented:
                override = _UNSET
        elif overrides is not None and name in overrides:
            override = overrides[name]
        if override is not _UNSET:
            parsed = _parse_override(override, name)
            if parsed is None:
                ignored.append(name)
                continue
            path, kind = parsed
            if path not in shapes:
                errors.append(f"override {name!r} -> {_fmt(path)!r}: no such path")
                continue
            kind = kind or _infer_kind(tshape, shapes[path])
            if kind is None or not _fits(kind, tshape, shapes[path]):
                errors.append(
                    f"override {name!r} {tshape} -> {_fmt(path)} {shapes[path]}: shapes do not fit"
                )
                continue
            match = (path, kind)
        elif not is_float:
            ignored.append(name)
            continue
        else:
            match, near = None, None
            for path, kind in _candidates(name, tshape):
                if path in shapes:
                    if _fits(kind, tshape, shapes[path]):
                        match = (path, kind)
                        break
                    near = near or f"{_fmt(path)} has shape {shapes[path]}"
            if match is None:
                shown = "" if tshape is None else f" {tshape}"
                unmatched.append(f"{name}{shown}" + (f" ({near})" if near else ""))
                continue
        if match[0] in owner:
            errors.append(f"{owner[match[0]]!r} and {name!r} both map to {_fmt(match[0])}")
            continue
        owner[match[0]] = name
        entries.append((name, match[0], match[1]))
    if errors:
        raise ValueError("cannot build the name map: " + "; ".join(errors))
    return NameMap(
        entries=tuple(entries),
        unmatched_torch=tuple(unmatched),
        unmatched_flax=tuple(_fmt(p) for p in shapes if p not in owner),
        ignored=tuple(ignored),
    )


_REVERSE_LEAF = {"kernel": "weight", "scale": "weight", "embedding": "weight"}


def _reverse_map(shapes: dict) -> NameMap:
    entries, seen = [], {}
    for path, shape in shapes.items():
        if len(path) == 1:
            name, kind = path[0], "identity"
        else:
            collection = path[0] if path[0] in ("params", "batch_stats") else None
            core = path[1:] if collection else path
            leaf, kind = core[-1], "identity"
            if leaf == "kernel" and len(shape) >= 2:
                kind = "linear" if len(shape) == 2 else "conv"
            torch_leaf = _REVERSE_LEAF.get(leaf, leaf)
            if collection == "batch_stats" and leaf in ("mean", "var"):
                torch_leaf = f"running_{leaf}"
            name = ".".join(core[:-1] + (torch_leaf,))
        if name in seen:
            raise ValueError(
                f"paths {_fmt(seen[name])} and {_fmt(path)} both give torch name {name!r}; "
                f"pass a torch state dict or name list (and overrides) to build the name map"
            )
        seen[name] = path
        entries.append((name, path, kind))
    return NameMap(entries=tuple(entries))


def _resolve_map(name_map, torch_source, shapes: dict) -> NameMap:
    """A NameMap as given, else built from a template (``name_map``) or ``torch_source``."""
    if isinstance(name_map, NameMap):
        return name_map
    return _build(shapes, name_map if name_map is not None else torch_source)


def _place(value: np.ndarray, target):
    """``value`` with ``target``'s dtype and sharding."""
    value = np.asarray(value, dtype=target.dtype)
    sharding = getattr(target, "sharding", None)
    return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)


# ------------------------------------------------------------------ weights
def _as_state_dict(source):
    if hasattr(source, "state_dict") and callable(source.state_dict):
        return source.state_dict()
    if not isinstance(source, Mapping):
        raise TypeError(f"expected a state dict or nn.Module, got {type(source).__name__}")
    return source


def torch_to_flax(state_dict, tree, name_map=None, *, strict: bool = True):
    """Load torch weights into a copy of ``tree`` (same structure, dtypes and shardings).

    Args:
      state_dict: torch state dict (tensors or numpy arrays) or ``nn.Module``.
      tree: the target tree; its leaves give shapes, dtypes and shardings.
      name_map: a :class:`NameMap` (default: ``build_name_map(state_dict, tree)``).
      strict: every float torch entry and every tree leaf must be paired (leaves left unpaired
        with ``strict=False`` keep their value).

    Raises:
      ValueError: unpaired names (strict), mapped names absent from ``state_dict``, shapes.
    """
    sd = _as_state_dict(state_dict)
    table = _table(tree)
    nm = _resolve_map(name_map, sd, {p: _shape(v) for p, v in table.items()})
    if strict:
        nm.check()
    missing = [n for n in nm.torch_names if n not in sd]
    if missing:
        raise ValueError(f"state_dict lacks the mapped entries: {_list(missing)}")
    new, errors = {}, []
    for name, path, kind in nm.entries:
        if path not in table:
            errors.append(f"{name} -> {_fmt(path)}: no such leaf")
            continue
        value = _to_flax(kind, _host(sd[name]))
        if value.shape != _shape(table[path]):
            errors.append(
                f"{name} {_shape(sd[name])} does not fit {_fmt(path)} {_shape(table[path])}"
            )
        new[path] = value
    if errors:
        raise ValueError("cannot load the weights: " + "; ".join(errors))
    placed = [_place(new[p], leaf) if p in new else leaf for p, leaf in table.items()]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), placed)


def flax_to_torch(tree, name_map=None) -> OrderedDict:
    """``tree``'s leaves as an ``OrderedDict`` of torch tensors, in torch layout and order.

    ``name_map``: a :class:`NameMap`, a torch template (state dict, module, ``{name: shape}``,
    list of names) fixing names and order, or None (names derived from the tree's paths).
    """
    torch = _torch()
    table = _table(tree)
    nm = _resolve_map(name_map, None, {p: _shape(v) for p, v in table.items()})
    return OrderedDict(
        (name, torch.from_numpy(np.ascontiguousarray(_to_torch(kind, _host(table[path])))))
        for name, path, kind in nm.entries
    )


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


# ------------------------------------------------------------------ EMA
def _ema_payload(ckpt):
    ckpt = _load(ckpt)
    if not isinstance(ckpt, Mapping):
        raise TypeError(f"ckpt must be a dict or a path, got {type(ckpt).__name__}")
    if "param" in ckpt and "updates" in ckpt:
        sd = ckpt["param"]
    elif "ema" in ckpt and "updates" in ckpt:
        sd = ckpt["ema"]
    else:
        raise ValueError(
            f"ckpt has keys {list(ckpt)}; expected distributed ModelEMA "
            f"{{'param', 'updates'}} or ultralytics/YOLOv5 {{'ema', 'updates', ...}}"
        )
    if sd is None:
        raise ValueError(
            "ckpt['ema'] is None: a stripped ultralytics checkpoint keeps the EMA weights in "
            "ckpt['model']; load them with torch_to_flax"
        )
    sd = _as_state_dict(sd)
    updates = ckpt["updates"]
    try:
        value = float(_host(updates))
    except (TypeError, ValueError):
        value = -1.0
    if isinstance(updates, bool) or not value.is_integer() or value < 0:
        raise ValueError(f"ckpt['updates'] must be an int >= 0, got {updates!r}")
    return sd, int(value)


def import_ema(ema_state: EmaState, ckpt, *, name_map=None, strict: bool = True) -> EmaState:
    """Load a torch EMA checkpoint into a copy of ``ema_state`` (same dtypes/shardings).

    ``ckpt`` is thb1314/distributed_modelema's ``ema.state_dict()`` (``{"param", "updates"}``),
    an ultralytics/YOLOv5 checkpoint dict (``{"ema": model or state dict, "updates", ...}``;
    load pickled modules yourself with ``torch.load(..., weights_only=False)``), or a path to
    a weights-only file. Non-float entries (``num_batches_tracked``) are ignored; fp16 weights
    are cast to the EMA's dtype. ``updates`` becomes ``EmaState.updates``, so the next
    :meth:`ShardedEMA.update` uses ``updates + 1`` as torch does. A bucketed ``ema_state``
    (``ShardedEMA(bucket_leaves_up_to=...)``) gives a bucketed result with the same layout.
    """
    if not isinstance(ema_state, EmaState):
        raise TypeError(f"ema_state must be a jaxzero.EmaState, got {type(ema_state).__name__}")
    sd, updates = _ema_payload(ckpt)
    layout = ema_state.ema.layout if isinstance(ema_state.ema, eb.BucketedTree) else None
    ema = torch_to_flax(sd, eb.unbucket(ema_state.ema), name_map, strict=strict)
    out = EmaState(_place(np.asarray(updates), ema_state.updates), ema)
    return out if layout is None else eb.bucket(out, layout)


def export_ema(ema_state: EmaState, *, format: str = "modelema", name_map=None, model=None):
    """``ema_state`` as a torch EMA checkpoint dict.

    Args:
      format: ``"modelema"`` gives distributed ModelEMA's ``{"param": OrderedDict, "updates": n}``
        (float entries only); ``"ultralytics"`` gives ``{"ema": ..., "updates": n}``.
      name_map: a :class:`NameMap` or torch template fixing names and order (default:
        ``model`` if given, else names derived from the tree).
      model: for ``"ultralytics"``: a torch module (deep-copied, weights loaded, eval mode,
        ``requires_grad=False``, as ultralytics keeps its EMA) or a state dict; its non-float
        entries are kept unchanged (ultralytics never updates them). None: a plain state dict.
    """
    if not isinstance(ema_state, EmaState):
        raise TypeError(f"ema_state must be a jaxzero.EmaState, got {type(ema_state).__name__}")
    if format not in ("modelema", "ultralytics"):
        raise ValueError(f"format={format!r} must be 'modelema' or 'ultralytics'")
    ema_state = eb.unbucket(ema_state)
    updates = int(_host(ema_state.updates))
    template = None if model is None else _as_state_dict(model)
    sd = flax_to_torch(ema_state.ema, name_map if name_map is not None else template)
    if format == "modelema":
        return {"param": sd, "updates": updates}
    if template is not None:
        missing = [k for k, v in template.items() if k not in sd and _is_float(v)]
        if missing:
            raise ValueError(f"the EMA has no value for the model's float entries {_list(missing)}")
        sd = OrderedDict(
            (k, sd[k].to(v.dtype) if k in sd else v.detach().clone()) for k, v in template.items()
        )
    if hasattr(model, "state_dict"):
        module = copy.deepcopy(model).eval()
        module.load_state_dict(sd, strict=True)
        for p in module.parameters():
            p.requires_grad_(False)
        return {"ema": module, "updates": updates}
    return {"ema": sd, "updates": updates}
