"""``ZeRO(units=...)``'s patterns: checked, and turned into the unit of each params leaf.

A unit is a ``/``-joined params path prefix that one of the patterns fullmatches. Each pattern
names, for a leaf, the shortest prefix of its path it fullmatches (``block_\\d+`` names
``block_0`` for every leaf under it). Where several patterns name a prefix of one leaf's path,
the deepest wins: the leaf belongs to the innermost unit, and the outer unit keeps the rest of
its leaves. That is FSDP2's ``fully_shard`` on a sub-module and then on its parent:
``units=(r"model/layers/\\d+", r"model/layers/\\d+/self_attn")`` makes each attention a unit and
each layer's norms and MLP another.
"""

from __future__ import annotations

import itertools
import re
import warnings

import jax

from jaxzero.trees import path_strs
from jaxzero.zero.specs import is_stacked, subtree_paths

_RULE = (
    "a leaf belongs to the deepest prefix of its path that a pattern names (each pattern "
    "naming the shortest prefix it fullmatches), so an outer unit keeps only the leaves its "
    "inner units leave it"
)


def patterns(units, stage: int, layers) -> tuple[str, ...]:
    """``ZeRO(units=)`` checked: a regular expression or a tuple of them, stage 3, not with
    ``layers=``."""
    if units is None or units == ():  # () : dataclasses.replace of a ZeRO without units
        return ()
    found = (units,) if isinstance(units, str) else units
    if not isinstance(found, tuple) or not found or not all(isinstance(u, str) for u in found):
        raise TypeError(
            f"units={units!r} must be a regular expression over params paths, or a tuple of "
            f"them, e.g. units=r'block_\\d+' (Linen blocks) or units=r'layers/\\d+' (an nnx.List)."
        )
    for u in found:
        try:
            re.compile(u)
        except re.error as e:
            raise ValueError(f"units={units!r}: {u!r} is not a regular expression ({e}).") from e
    if stage != 3:
        raise ValueError(
            f"units={units!r} needs stage=3 (got stage={stage}): below stage 3 every device "
            f"holds the whole params and nothing is gathered; drop units= or use stage=3."
        )
    if layers:
        raise ValueError(
            f"units={units!r} and layers={layers!r}: name scanned layer stacks with layers= "
            f"(jaxzero.gather_layer / jaxzero.scan_layers) or Python-loop blocks with units=, "
            f"not both."
        )
    return found


def prefetch_option(prefetch, units: tuple[str, ...]) -> bool | None:
    """``ZeRO(prefetch=)`` checked: True (the default with ``units=``) or False, and only with
    ``units=``, where it acts (None without)."""
    if prefetch is None:
        return True if units else None
    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch={prefetch!r} must be True or False.")
    if not units:
        raise ValueError(
            f"prefetch={prefetch!r} acts on units= only (stage 3 per module), and no units= "
            f"was given: drop prefetch=, or name the blocks with units=r'block_\\d+'."
        )
    return prefetch


def _paths(params) -> list[tuple[str, ...]]:
    return [path_strs(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _named(keys: tuple[str, ...], compiled) -> list[str | None]:
    """Per pattern: the shortest ``/``-joined prefix of ``keys`` it fullmatches, or None."""
    out = []
    for c in compiled:
        prefixes = ("/".join(keys[:depth]) for depth in range(1, len(keys) + 1))
        out.append(next((p for p in prefixes if c.fullmatch(p)), None))
    return out


def _owners(params, patterns: tuple[str, ...]) -> list[tuple[str | None, list[str | None]]]:
    """Per flat leaf: its unit (the deepest prefix a pattern names, or None) and what each
    pattern names."""
    return _owners_of(_paths(params), patterns)


def _owners_of(paths, patterns: tuple[str, ...]) -> list[tuple[str | None, list[str | None]]]:
    compiled = [re.compile(p) for p in patterns]
    out = []
    for keys in paths:
        named = _named(keys, compiled)
        found = [n for n in named if n is not None]
        out.append((max(found, key=lambda n: n.count("/")) if found else None, named))
    return out


#: The unit name of the leaves outside every unit when they are gathered where they are read
#: (``ZeRO(prefetch=True)``: :mod:`jaxzero.zero.units.chain`)
OUTSIDE = "(outside the units)"


def unit_names(params, patterns: tuple[str, ...], outside: bool = False) -> list[str | None]:
    """Per flat leaf of ``params``: the unit it belongs to (see the module docstring), or
    None (gathered whole at the start of the loss), or with ``outside`` :data:`OUTSIDE`."""
    other = OUTSIDE if outside else None
    return [other if unit is None else unit for unit, _ in _owners(params, patterns)]


def leaf_columns(paths, units: tuple[str, ...], prefetch, tables=()) -> list[dict]:
    """The per-leaf plan's columns ``units=`` decides (:mod:`jaxzero.zero.plan`), per leaf
    key path (a tuple of strings): a unit's leaves, and with ``prefetch`` those outside every
    unit but the ``vocab_parallel`` ``tables``, are gathered by the unit chain where they are
    read and their gradients reduced there."""
    if not units:
        return [{} for _ in paths]
    other = OUTSIDE if prefetch else None
    out = []
    for keys, (unit, _) in zip(paths, _owners_of(paths, units), strict=True):
        unit = other if unit is None else unit
        mine = {"gather": f"unit:{unit}", "reduce": "per_unit"}
        out.append({} if unit is None or is_stacked(keys, tables) else mine)
    return out


def mask(tree, units: tuple[str, ...], outside: bool = False):
    """True for the leaves of ``tree`` the loss gets as shards: those in a unit, and with
    ``outside`` every leaf."""
    names = unit_names(tree, units, outside)
    return jax.tree.unflatten(jax.tree.structure(tree), [u is not None for u in names])


def check(params, units: tuple[str, ...]) -> None:
    """Every pattern in ``units`` must be the unit of some leaf (raises ValueError naming the
    pattern, and the patterns that took its leaves, or the paths it could have matched)."""
    owners = _owners(params, units)
    for i, u in enumerate(units):
        if any(unit is not None and re.fullmatch(u, unit) for unit, _ in owners):
            continue
        named = [(unit, n[i]) for unit, n in owners if n[i] is not None]
        if named:
            raise ValueError(_shadowed(units, u, named))
        raise ValueError(_no_match(params, units, u))


def _shadowed(units, u, named) -> str:
    """The error for pattern ``u``, which names prefixes (``named``: (leaf's unit, what ``u``
    names) pairs) but whose every leaf a deeper unit took."""
    prefixes = list(dict.fromkeys(mine for _, mine in named))
    deeper = list(dict.fromkeys(unit for unit, _ in named))
    by = [p for p in units if p != u and any(re.fullmatch(p, d) for d in deeper)]
    return (
        f"ZeRO(units={units!r}): {u!r} names {prefixes[:4]}, but every leaf under them "
        f"belongs to a deeper unit ({deeper[:4]}) of {' and '.join(map(repr, by))}: {_RULE}. "
        f"Leave {u!r} out (its leaves are already in units), or narrow the deeper pattern so "
        f"some of its leaves stay in it."
    )


def _no_match(params, units, u) -> str:
    """The error for pattern ``u``, which fullmatches no params path prefix: with a pattern
    built from the numbered blocks the params repeat, when they do."""
    found = suggest(params)
    if found is None:
        hint = (
            "A unit is a subtree of the params: write a pattern that fullmatches the "
            "'/'-joined keys of each block's subtree"
        )
    else:
        pattern, blocks = found
        hint = (
            f"The params repeat numbered blocks ({', '.join(blocks[:4])}, ...): "
            f"try units=r'{pattern}'"
        )
    return (
        f"ZeRO(units={units!r}): {u!r} fullmatches no params path; paths begin "
        f"{subtree_paths(params)[:8]}. {hint}."
    )


def _numbered(key: str) -> str | None:
    """The pattern of a numbered key (``0`` -> ``\\d+``, ``block_3`` -> ``block_\\d+``), or None."""
    m = re.fullmatch(r"(.*?)(\d+)", key)
    return None if m is None else re.escape(m[1]) + r"\d+"


def _templates(params) -> dict[tuple[str, ...], dict[str, int]]:
    """Every path prefix ending in a numbered key, as a tuple of per-key patterns (numbered
    keys generalised), with the concrete prefixes it covers and their leaf counts."""
    out: dict[tuple[str, ...], dict[str, int]] = {}
    for keys in _paths(params):
        pieces = [_numbered(k) or re.escape(k) for k in keys]
        for i, key in enumerate(keys[:-1]):  # a unit is a subtree, not a leaf
            if _numbered(key) is not None:
                seen = out.setdefault(tuple(pieces[: i + 1]), {})
                prefix = "/".join(keys[: i + 1])
                seen[prefix] = seen.get(prefix, 0) + 1
    return out


def _merge(kept: list[tuple[str, ...]]) -> list[tuple[tuple[str, ...], ...]]:
    """Templates of one length that differ in one key become one, with alternatives there
    (``encoder/block/\\d+`` and ``decoder/block/\\d+``: ``(encoder|decoder)/block/\\d+``)."""
    merged = [tuple((p,) for p in t) for t in kept]
    differ = lambda x, y: [i for i in range(len(x)) if x[i] != y[i]] if len(x) == len(y) else []
    while True:
        pairs = itertools.combinations(range(len(merged)), 2)
        found = next(((a, b) for a, b in pairs if len(differ(merged[a], merged[b])) == 1), None)
        if found is None:
            return merged
        a, b = found
        x, y = merged[a], merged.pop(b)
        i = differ(x, y)[0]
        merged[a] = x[:i] + (x[i] + y[i],) + x[i + 1 :]


def suggest(params) -> tuple[str, list[str]] | None:
    """A ``units=`` pattern for ``params`` and the blocks it names: the outermost numbered
    path segments the params repeat (``model/layers/\\d+`` for Hugging Face's Llama,
    ``(encoder|decoder)/block/\\d+`` for its T5), the one covering most leaves; None when the
    params repeat no numbered subtree."""
    templates = {t: seen for t, seen in _templates(params).items() if len(seen) > 1}
    outer = [t for t in templates if not any(o != t and t[: len(o)] == o for o in templates)]
    if not outer:
        return None
    covers = lambda pattern: [p for t in outer for p in templates[t] if re.fullmatch(pattern, p)]
    leaves = lambda pattern: sum(
        n for t in outer for p, n in templates[t].items() if p in covers(pattern)
    )
    candidates = [
        "/".join(alts[0] if len(alts) == 1 else f"({'|'.join(alts)})" for alts in m)
        for m in _merge(outer)
    ]
    pattern = max(candidates, key=leaves)
    return pattern, covers(pattern)


def warn_units_together(eqns, labels) -> None:
    """Warn when one equation (an ``nn.remat`` / ``jax.checkpoint`` or another call around
    several blocks) reads the weights of several units: they are gathered together for it,
    whole-model stage 3 within that call."""
    for eqn, units in zip(eqns, labels, strict=True):
        names = sorted(u for u in units if u != OUTSIDE)
        if len(names) > 1:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            warnings.warn(
                f"ZeRO(units=...): the units {shown} ({len(names)}) run inside one "
                f"{eqn.primitive.name} call of the loss, so they are gathered together for it "
                f"(and for its backward), as stage 3 without units= would. Apply nn.remat / "
                f"jax.checkpoint to each block rather than around several, or name the "
                f"enclosing module as the unit.",
                UserWarning,
                stacklevel=4,
            )
            return
