"""The Adam (``mu``/``nu``/``count``) and momentum (``trace``) nodes of an optax state, found
by their fields so that any chain works, read and written in torch's terms."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from jaxzero.interop.torch.common import (
    by_path,
    fmt_path,
    join,
    place,
    shape_of,
    to_flax,
    to_host,
    to_torch,
)
from jaxzero.interop.torch.names import NameMap, fits, resolve_map

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")
SGD_KEYS = ("momentum_buffer",)


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


def _replace_fields(node, **kw):
    return node._replace(**kw) if hasattr(node, "_replace") else dataclasses.replace(node, **kw)


JAX_FIELDS = {"adam": ("mu", "nu"), "sgd": ("trace",)}
TORCH_FIELDS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


class OptNodes:
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
            i: {f: by_path(getattr(self.leaves[i], f)) for f in JAX_FIELDS[k]}
            for i, k in self.kind.items()
        }
        self.node_of: dict[tuple[str, ...], int] = {}
        for i, k in self.kind.items():
            for path in self.tables[i][JAX_FIELDS[k][0]]:
                self.node_of.setdefault(path, i)

    def shapes(self) -> dict:
        return {
            p: shape_of(self.tables[i][JAX_FIELDS[self.kind[i]][0]][p])
            for p, i in self.node_of.items()
        }

    def name_map(self, name_map, torch_source) -> NameMap:
        return resolve_map(name_map, torch_source, self.shapes())

    def read(self, nm: NameMap, names) -> dict:
        """``{torch_name: {key: np.ndarray}}`` in torch layout."""
        unknown = [n for n in names if n not in nm]
        if unknown:
            raise ValueError(f"param_names with no tree leaf in the name map: {join(unknown)}")
        out = {}
        for name in names:
            path, transpose = nm.lookup(name)
            if path not in self.node_of:
                raise ValueError(f"{name}: no optimizer state at {fmt_path(path)}")
            i = self.node_of[path]
            kind, entry = self.kind[i], {}
            if kind == "adam":
                entry["step"] = float(to_host(self.leaves[i].count))
            for jf, tf in zip(JAX_FIELDS[kind], TORCH_FIELDS[kind], strict=True):
                entry[tf] = to_torch(transpose, to_host(self.tables[i][jf][path]))
            out[name] = entry
        return out

    def write(self, states: dict, nm: NameMap, strict: bool):
        """A new opt_state with ``{torch_name: {key: value}}`` written in; validates first."""
        kinds = {n: param_kind(e) for n, e in states.items()}
        bad = [f"{n}: {k}" for n, k in kinds.items() if k not in ("adam", "sgd")]
        if bad:
            raise ValueError(
                "unsupported torch optimizer state (Adam/AdamW without amsgrad, or SGD with "
                f"momentum, only): {join(bad)}"
            )
        have = set(self.kind.values())
        wrong = [f"{n} ({k})" for n, k in kinds.items() if k not in have]
        if wrong:
            raise TypeError(
                f"the torch state does not match the optax state (which has only "
                f"{'/'.join(sorted(have))} nodes): {join(wrong)}; e.g. an SGD "
                f"momentum_buffer cannot go into Adam's mu/nu"
            )
        unmapped = [n for n in states if n not in nm]
        if unmapped:
            why = [u for u in nm.unmatched_torch if u.split(" ")[0] in unmapped]
            raise ValueError(
                f"optimizer state for params with no tree leaf: {join(why or unmapped)}"
            )
        errors, values, steps, given = [], {}, {}, set()
        for name, path, transpose in nm.entries:
            if name not in states:
                continue
            i = self.node_of.get(path)
            if i is None or self.kind[i] != kinds[name]:
                errors.append(f"{name}: no {kinds[name]} state at {fmt_path(path)}")
                continue
            given.add((i, path))
            for jf, tf in zip(JAX_FIELDS[kinds[name]], TORCH_FIELDS[kinds[name]], strict=True):
                value = to_host(states[name][tf])
                target = shape_of(self.tables[i][jf][path])
                if not fits(transpose, value.shape, target):
                    errors.append(
                        f"{name}.{tf}: shape {value.shape} does not fit {fmt_path(path)} {target}"
                    )
                    continue
                values.setdefault(i, {}).setdefault(jf, {})[path] = to_flax(transpose, value)
            if kinds[name] == "adam":
                steps.setdefault(i, {})[name] = float(to_host(states[name]["step"]))
        for by_name in steps.values():
            distinct = set(by_name.values())
            if len(distinct) > 1 or not all(s >= 0 and float(s).is_integer() for s in distinct):
                errors.append(
                    "one optax count cannot hold these torch steps: "
                    + join(f"{n}={s:g}" for n, s in by_name.items())
                )
        if strict:
            for i in {i for i, _ in given}:
                field = JAX_FIELDS[self.kind[i]][0]
                missing = [fmt_path(p) for p in self.tables[i][field] if (i, p) not in given]
                if missing:
                    errors.append(f"no torch state for tree leaves {join(missing)}")
        if errors:
            raise ValueError("cannot import the optimizer state: " + "; ".join(errors))
        if not values:
            raise ValueError("the torch optimizer state is empty: nothing to import")
        leaves = list(self.leaves)
        for i, per_field in values.items():
            node, repl = leaves[i], {}
            for jf, new in per_field.items():
                table = self.tables[i][jf]
                placed = [place(new[p], leaf) if p in new else leaf for p, leaf in table.items()]
                treedef = jax.tree_util.tree_structure(getattr(node, jf))
                repl[jf] = jax.tree_util.tree_unflatten(treedef, placed)
            if i in steps:
                repl["count"] = place(np.asarray(int(next(iter(steps[i].values())))), node.count)
            leaves[i] = _replace_fields(node, **repl)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def param_kind(entry) -> str:
    if not isinstance(entry, Mapping):
        return f"not a dict ({type(entry).__name__})"
    keys = set(entry)
    if keys == set(ADAM_KEYS):
        return "adam"
    if keys == set(SGD_KEYS) and entry["momentum_buffer"] is not None:
        return "sgd"
    return f"keys {sorted(keys)}"
