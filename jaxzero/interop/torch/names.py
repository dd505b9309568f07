"""PyTorch <-> JAX names and weights: the name map and state-dict conversion.

See :mod:`jaxzero.interop.torch` for the naming rules and the transpose kinds
(the package re-exports the public names).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from jaxzero.interop.torch.common import (
    KINDS,
    by_path,
    fmt_path,
    is_float,
    join,
    place,
    shape_of,
    to_flax,
    to_flax_shape,
    to_host,
    to_torch,
)
from jaxzero.interop.torch.loading import as_state_dict, torch_module

__all__ = ["NameMap", "build_name_map", "torch_to_flax", "flax_to_torch"]

_UNSET = object()


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
                lines.append(f"{title}: {join(items, 1000)}")
        return "\n".join(lines)

    def check(self, *, torch_side: bool = True, flax_side: bool = True) -> None:
        """Raise ValueError listing the unmatched names on the requested sides."""
        problems = []
        if torch_side and self.unmatched_torch:
            problems.append(f"torch entries with no tree leaf: {join(self.unmatched_torch)}")
        if flax_side and self.unmatched_flax:
            problems.append(f"tree leaves with no torch entry: {join(self.unmatched_flax)}")
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
        floating = is_float(v) and not name.endswith("num_batches_tracked")
        out.append((name, shape_of(v), floating))
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


def fits(kind: str, torch_shape, flax_shape) -> bool:
    """Whether a torch tensor of ``torch_shape`` (None: unknown) fits a leaf of ``flax_shape``
    under the transpose ``kind``."""
    flax_shape = tuple(flax_shape)
    if torch_shape is None:  # names only: the layout follows from the leaf's rank
        return {"linear": len(flax_shape) == 2, "conv": len(flax_shape) >= 3}.get(kind, True)
    torch_shape = tuple(torch_shape)
    if kind == "linear" and len(torch_shape) != 2 or kind == "conv" and len(torch_shape) < 3:
        return False
    return to_flax_shape(kind, torch_shape) == flax_shape


def _infer_kind(torch_shape, flax_shape) -> str | None:
    if torch_shape is None:
        return "identity"
    return next((k for k in KINDS if fits(k, torch_shape, flax_shape)), None)


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
    return _build({p: shape_of(v) for p, v in by_path(tree).items()}, torch_source, overrides)


def _build(shapes: dict, torch_source, overrides=None) -> NameMap:
    if torch_source is None:
        return _reverse_map(shapes)
    entries, unmatched, ignored, errors = [], [], [], []
    owner: dict[tuple[str, ...], str] = {}
    for name, tshape, floating in _torch_entries(torch_source):
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
                errors.append(f"override {name!r} -> {fmt_path(path)!r}: no such path")
                continue
            kind = kind or _infer_kind(tshape, shapes[path])
            if kind is None or not fits(kind, tshape, shapes[path]):
                errors.append(
                    f"override {name!r} {tshape} -> {fmt_path(path)} {shapes[path]}: shapes do not fit"
                )
                continue
            match = (path, kind)
        elif not floating:
            ignored.append(name)
            continue
        else:
            match, near = None, None
            for path, kind in _candidates(name, tshape):
                if path in shapes:
                    if fits(kind, tshape, shapes[path]):
                        match = (path, kind)
                        break
                    near = near or f"{fmt_path(path)} has shape {shapes[path]}"
            if match is None:
                shown = "" if tshape is None else f" {tshape}"
                unmatched.append(f"{name}{shown}" + (f" ({near})" if near else ""))
                continue
        if match[0] in owner:
            errors.append(f"{owner[match[0]]!r} and {name!r} both map to {fmt_path(match[0])}")
            continue
        owner[match[0]] = name
        entries.append((name, match[0], match[1]))
    if errors:
        raise ValueError("cannot build the name map: " + "; ".join(errors))
    return NameMap(
        entries=tuple(entries),
        unmatched_torch=tuple(unmatched),
        unmatched_flax=tuple(fmt_path(p) for p in shapes if p not in owner),
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
                f"paths {fmt_path(seen[name])} and {fmt_path(path)} both give torch name {name!r}; "
                f"pass a torch state dict or name list (and overrides) to build the name map"
            )
        seen[name] = path
        entries.append((name, path, kind))
    return NameMap(entries=tuple(entries))


def resolve_map(name_map, torch_source, shapes: dict) -> NameMap:
    """A NameMap as given, else built from a template (``name_map``) or ``torch_source``."""
    if isinstance(name_map, NameMap):
        return name_map
    return _build(shapes, name_map if name_map is not None else torch_source)


# ------------------------------------------------------------------ weights
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
    sd = as_state_dict(state_dict)
    table = by_path(tree)
    nm = resolve_map(name_map, sd, {p: shape_of(v) for p, v in table.items()})
    if strict:
        nm.check()
    missing = [n for n in nm.torch_names if n not in sd]
    if missing:
        raise ValueError(f"state_dict lacks the mapped entries: {join(missing)}")
    new, errors = {}, []
    for name, path, kind in nm.entries:
        if path not in table:
            errors.append(f"{name} -> {fmt_path(path)}: no such leaf")
            continue
        value = to_flax(kind, to_host(sd[name]))
        if value.shape != shape_of(table[path]):
            errors.append(
                f"{name} {shape_of(sd[name])} does not fit {fmt_path(path)} {shape_of(table[path])}"
            )
        new[path] = value
    if errors:
        raise ValueError("cannot load the weights: " + "; ".join(errors))
    placed = [place(new[p], leaf) if p in new else leaf for p, leaf in table.items()]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), placed)


def flax_to_torch(tree, name_map=None) -> OrderedDict:
    """``tree``'s leaves as an ``OrderedDict`` of torch tensors, in torch layout and order.

    ``name_map``: a :class:`NameMap`, a torch template (state dict, module, ``{name: shape}``,
    list of names) fixing names and order, or None (names derived from the tree's paths).
    """
    torch = torch_module()
    table = by_path(tree)
    nm = resolve_map(name_map, None, {p: shape_of(v) for p, v in table.items()})
    return OrderedDict(
        (name, torch.from_numpy(np.ascontiguousarray(to_torch(kind, to_host(table[path])))))
        for name, path, kind in nm.entries
    )
