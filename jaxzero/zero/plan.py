"""The per-leaf plan: what happens to every parameter leaf under one ``ZeRO``, decided once.

``ZeRO.plan(params)`` resolves, from the params' shapes alone (arrays or
``jax.ShapeDtypeStruct``s, nothing allocated), a frozen table with one :class:`Leaf` row per
params leaf: its shardings, how the loss gets it (``gather``), how its gradient leaves the
backward (``reduce``), how micro-batches accumulate it, where its optimizer side and its
params live, how the wire encodes it, how the EMA stores it, and the bytes each device holds
for it. Each feature fills its own columns (:func:`jaxzero.zero.units.patterns.leaf_columns`,
:func:`jaxzero.zero.layers.plan.leaf_columns`, :func:`jaxzero.zero.layers.vocab.leaf_columns`,
:func:`jaxzero.zero.offload.placement.leaf_columns`,
:func:`jaxzero.zero.wire.encodings.leaf_columns`); two features that decide one column of one
leaf differently are refused here, in the one place that merges them.

The table is what a user debugging memory or a slow step asks first: ``print(plan)`` shows it,
and ``plan.totals()`` sums its bytes. Optimizer-state leaves that mirror no parameter (step
counters, a schedule's state) are the :attr:`Plan.other` rows.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxzero.trees import format_bytes, path_strs
from jaxzero.zero import specs as sh
from jaxzero.zero.layers import plan as layers
from jaxzero.zero.layers import vocab
from jaxzero.zero.offload import placement as offload
from jaxzero.zero.units import patterns as units
from jaxzero.zero.wire import encodings as wire

#: The plan's decision columns, in the order they print.
DECISIONS = (
    "gather",
    "reduce",
    "accumulate",
    "memory",
    "params_memory",
    "grads_memory",
    "wire",
    "ema",
    "layout",
)
#: The per-device byte columns of a row.
BYTES = ("params", "master", "grads", "opt_state", "ema")


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One params leaf's row of the :class:`Plan`.

    Attributes:
      path: the leaf's ``/``-joined key path (``"layers/attn/kernel"``).
      shape: its global shape.
      layer_axis: whether axis 0 is a ``layers=`` stack's layer axis (never split).
      param_spec: the compute params' PartitionSpec (sharded at stage 3 only).
      state_spec: the master's, optimizer state's and EMA's PartitionSpec (stages 1-3).
      grad_spec: the reduced gradient's PartitionSpec (stages 2-3).
      gather: how the loss gets the leaf: ``"none"`` (whole on every device, stages 0-2),
        ``"invariant"`` (stage 0 per layer: whole and device-invariant, each layer marked
        varying where it runs), ``"whole"`` (all-gathered at the start of the loss),
        ``"per_layer"`` (a layer at a time by ``gather_layer`` / ``scan_layers``),
        ``"unit:NAME"`` (with its unit, ``units=``) or ``"vocab_rows"`` (stays rows).
      reduce: how its gradient is reduced: ``"all_reduce"`` or ``"reduce_scatter"`` after the
        backward (each micro-batch at stages 2/3), ``"in_backward"`` (layer by layer inside
        the backward: stage 3 per layer, and stages 0-2 with ``layers=`` where the model
        calls ``gather_layer`` / ``scan_layers``), ``"per_unit"`` (by the unit chain) or
        ``"complete"`` (a vocabulary table: summed by the collectives' transposes).
      accumulate: over micro-batches: ``"none"`` (one), ``"device_mean"`` or ``"host_sum"``
        (the params offloaded: summed into host accumulators).
      memory: where its master, optimizer state and EMA live: ``"device"``,
        ``"pinned_host"`` or ``"split"`` (``offload_fraction`` put some on each side).
      params_memory: where its compute params live.
      grads_memory: where its reduced gradient lands: ``"pinned_host"`` for a stack's or a
        unit's leaf whose params are offloaded (written into its params' host buffer, or a
        host accumulator over micro-batches), else ``"device"``.
      wire: the encoding of its all-gather and gradient reduction (``"exact"``,
        ``"int8"``, ``"int4"``, ``"int8/int4"``: gather/reduce).
      ema: how the EMA stores it: ``"none"``, ``"per_leaf"`` or ``"rows"``.
      layout: how its state is laid out in host memory: ``"leaf"`` (optax's tree, leaf by
        leaf), or ``"packed_rows"`` (one row per layer with the stack's other leaves, in two
        stacks of even and odd layers, while an update is pending: decision 51).
      bytes: per device, ``{"params", "master", "grads", "opt_state", "ema"}``.
    """

    path: str
    shape: tuple[int, ...]
    layer_axis: bool
    param_spec: P
    state_spec: P
    grad_spec: P
    gather: str
    reduce: str
    accumulate: str
    memory: str
    params_memory: str
    grads_memory: str
    wire: str
    ema: str
    layout: str
    bytes: dict
    host_state_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def host_bytes(self) -> int:
        """Of :attr:`bytes`, those in pinned host memory (the rest are on the device)."""
        params = self.bytes["params"] if self.params_memory == "pinned_host" else 0
        return params + self.host_state_bytes


@dataclasses.dataclass(frozen=True)
class Other:
    """A state leaf that mirrors no parameter (an optimizer's step counter, a schedule's
    state, the EMA's counter): its path, shape, bytes per device, where it lives and which
    part of the state it belongs to (``"opt_state"`` or ``"ema"``)."""

    path: str
    shape: tuple[int, ...]
    bytes: int
    memory: str
    part: str = "opt_state"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The per-leaf plan of one ``ZeRO`` over one params tree (:func:`build`)."""

    rows: tuple[Leaf, ...]
    other: tuple[Other, ...]
    stage: int
    devices: int
    accum_steps: int

    def __getitem__(self, path: str) -> Leaf:
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(
            f"no params leaf {path!r} in the plan; leaves: {[r.path for r in self.rows]}"
        )

    def mask(self, tree, predicate):
        """:func:`mask` over this plan's rows: ``predicate(row)`` per leaf of ``tree`` (a tree of
        the params' structure: the params, their gradients or this device's shards)."""
        return mask({r.path: r for r in self.rows}, tree, predicate)

    def column(self, name: str) -> dict[str, Any]:
        """``{path: value}`` of one column over every row."""
        return {r.path: getattr(r, name) for r in self.rows}

    def totals(self) -> dict[str, int]:
        """Bytes per device of each part, summed over the rows (and the :attr:`other` leaves
        into ``opt_state``)."""
        out = {k: sum(r.bytes[k] for r in self.rows) for k in BYTES}
        for o in self.other:
            out[o.part] += o.bytes
        return out

    def memory_totals(self) -> dict[str, int]:
        """Bytes per device by where they live: ``{"device": ..., "pinned_host": ...}``."""
        host = sum(r.host_bytes for r in self.rows)
        host += sum(o.bytes for o in self.other if o.memory == "pinned_host")
        every = sum(self.totals().values())
        return {"device": every - host, "pinned_host": host}

    def __str__(self) -> str:
        return self.table()

    def table(self, wide: bool = False) -> str:
        """The printed plan: a row per leaf. A column with the same value on every leaf is
        said once, in the line under the title, unless ``wide``."""
        shown = [c for c in DECISIONS[:-1] if wide or len({getattr(r, c) for r in self.rows}) > 1]
        same = [c for c in DECISIONS[:-1] if c not in shown]
        head = ("leaf", "shape", *shown, "per device")
        body = [
            (
                r.path,
                "x".join(map(str, r.shape)) or "()",
                *(getattr(r, c) for c in shown),
                format_bytes(r.total_bytes),
            )
            for r in self.rows
        ]
        body += [
            (o.path, "x".join(map(str, o.shape)) or "()")
            + tuple(o.memory if c == "memory" else "-" for c in shown)
            + (format_bytes(o.bytes),)
            for o in self.other
        ]
        widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
        line = lambda cells: "  ".join(
            str(c).ljust(w) for c, w in zip(cells, widths, strict=True)
        ).rstrip()
        totals = self.totals()
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in totals.items() if v)
        title = (
            f"ZeRO stage {self.stage} on {self.devices} devices, "
            f"{self.accum_steps} micro-batch{'es' if self.accum_steps > 1 else ''}: "
            f"{len(self.rows)} params leaves"
        )
        said = ", ".join(f"{c}={getattr(self.rows[0], c)}" for c in same)
        every = textwrap.wrap(f"every leaf: {said}", 100, subsequent_indent="  ")
        where = self.memory_totals()
        kept = f"{format_bytes(where['device'])} on the device"
        if where["pinned_host"]:
            kept += f", {format_bytes(where['pinned_host'])} in pinned host memory"
        return "\n".join(
            [title, *(every if same and self.rows else []), line(head), *map(line, body)]
            + textwrap.wrap(
                f"per device: {format_bytes(sum(totals.values()))} ({parts}): {kept}",
                100,
                subsequent_indent="  ",
            )
        )


def _merge(rows: list[dict], filled: Sequence[tuple[str, Sequence[dict]]]) -> None:
    """Each feature's columns into ``rows``; a column two features set differently on one
    leaf is refused, naming both."""
    owner: list[dict] = [{} for _ in rows]
    for feature, columns in filled:
        for row, mine, cols in zip(rows, owner, columns, strict=True):
            for key, value in cols.items():
                if key in mine and row[key] != value:
                    raise ValueError(
                        f"ZeRO: {mine[key]} and {feature} disagree on leaf {row['path']!r}: "
                        f"{key}={row[key]!r} against {value!r}. Give the leaf to one of them "
                        f"(e.g. leave it out of one's names or patterns)."
                    )
                row[key], mine[key] = value, feature


def _mirrors(params_paths: list[tuple[str, ...]], state) -> tuple[list[list], list]:
    """The optimizer-state leaves of each params leaf (its path ends with the param's), and
    the ones that end with no param's: ``(per param: [(path, leaf)], [(path, leaf)])``."""
    index = {keys: i for i, keys in enumerate(params_paths)}
    longest = max((len(k) for k in params_paths), default=0)
    per: list[list] = [[] for _ in params_paths]
    other = []
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = path_strs(path)
        owner = next(
            (index[keys[-k:]] for k in range(min(longest, len(keys)), 0, -1) if keys[-k:] in index),
            None,
        )
        (per[owner] if owner is not None else other).append((path, x))
    return per, other


#: The columns the features decide (:func:`decisions`): what the step's gathers and
#: reductions read. ``reduce`` is None where no feature decides it (the stage rule then does,
#: from the gradient's spec).
FEATURE_COLUMNS = ("gather", "reduce")


def decisions(zero, paths, accum_steps: int = 1) -> list[dict]:
    """Per leaf key path (a tuple of strings), the columns the features decide:
    ``{"path", "gather", "reduce"}``, ``reduce`` None where the stage rule decides it. The
    plan's rows start from these (:func:`build`); a step without a plan (one written by hand
    from ``ZeRO``'s pieces, on local shards) reads them directly."""
    rows = [
        {"path": "/".join(keys), "gather": "whole" if zero.stage == 3 else "none", "reduce": None}
        for keys in paths
    ]
    tables = zero.vocab_parallel
    _merge(
        rows,
        [
            ("layers=", layers.leaf_columns(zero, paths, accum_steps)),
            ("units=", units.leaf_columns(paths, zero.units, zero.prefetch, tables)),
            ("vocab_parallel=", vocab.leaf_columns(paths, tables)),
        ],
    )
    return rows


def mask(rows_by_path: dict, tree, predicate):
    """A tree of ``tree``'s structure (the params', their gradients' or local shards') with,
    per leaf, ``predicate(row)`` of the row its key path names in ``rows_by_path``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree.unflatten(
        treedef, [predicate(rows_by_path["/".join(path_strs(p))]) for p, _ in flat]
    )


def host_sum(row) -> bool:
    """Whether the leaf's gradient is summed over micro-batches into a host accumulator (the
    update divides it)."""
    return row.accumulate == "host_sum"


def packed_rows(row) -> bool:
    """Whether the leaf's host state is kept in packed rows while an update is pending
    (the next forward runs the rows: decision 51)."""
    return row.layout == "packed_rows"


def grads_on_host(row) -> bool:
    """Whether the leaf's reduced gradient lands in pinned host memory."""
    return row.grads_memory == "pinned_host"


def gathered_by_a_hook(row) -> bool:
    """Whether the loss gets the leaf as shards, gathered where it is used (a layer at a time,
    or with its unit) and its gradient reduced there."""
    gather = row["gather"] if isinstance(row, dict) else row.gather
    return gather == "per_layer" or gather.startswith("unit:")


def build(
    zero,
    params,
    *,
    accum_steps: int = 1,
    ema_storage: Sequence[str] | None = None,
    ema_itemsize: int = 4,
) -> Plan:
    """The :class:`Plan` of ``zero`` (a ``ZeROConfig``) over ``params`` (arrays, tracers or
    shape structs, global shapes; a tree ``zero.check_layers`` admits, as ``ZeRO.plan``
    checks first) for a step of ``accum_steps`` micro-batches.
    ``ema_storage``: the EMA's column (``"per_leaf"`` / ``"rows"`` per params leaf, from
    :mod:`jaxzero.ema`), None without an EMA.

    The plan's own columns (shapes, specs, bytes) come from the sharding rule; the features
    decide theirs in two passes, each merged once: how the loss gets each leaf and its
    gradient leaves the backward (:func:`decisions`), then, reading those, where its state
    and params live and how the wire encodes it."""
    # the shapes alone (tracers under jit, arrays or shape structs)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [path_strs(p) for p, _ in flat]
    n, p = zero.num_shards, zero.precision
    leaves = lambda specs: jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    param_specs, state_specs = leaves(zero.param_specs(params)), leaves(zero.shard_specs(params))
    # the step's reduction (stage 1 with one micro-batch may reduce in the backward as stage 2)
    reducing = zero.path.for_step(accum_steps)
    grad_specs = leaves(reducing.grad_specs(params))
    ema_specs = None if ema_storage is None else leaves(zero.ema_leaf_specs(params))
    opt_state = jax.eval_shape(zero.tx.init, params)
    # the optimizer side's leaves, in the order the offload placement weighs them
    state = _state_leaves(zero, params, opt_state, state_specs, ema_specs, ema_itemsize)
    # the plan's own columns: the sharding rule's
    item = lambda d: np.dtype(d).itemsize
    rows, split = [], []  # per row: whether its params and its reduced gradient are split
    for (path, x), ps, ss, gs in zip(flat, param_specs, state_specs, grad_specs, strict=True):
        shape = tuple(x.shape)
        split.append((sh.spec_dim(ps) is not None, sh.spec_dim(gs) is not None))
        rows.append(
            dict(
                shape=shape,
                layer_axis=sh.is_stacked(path, zero.layers),
                param_spec=ps,
                state_spec=ss,
                grad_spec=gs,
                accumulate="device_mean" if accum_steps > 1 else "none",
                memory="device",
                params_memory="device",
                grads_memory="device",
                wire="exact",
                ema="none",
                layout="leaf",
                bytes={
                    "params": sh.shard_bytes(shape, ps, n, item(p.param_dtype)),
                    "master": 0,
                    "grads": sh.shard_bytes(shape, gs, n, item(p.output_dtype)),
                    "opt_state": 0,
                    "ema": 0,
                },
            )
        )
    # the features' first pass: how the loss gets each leaf and its gradient leaves
    decided_by = decisions(zero, paths, accum_steps)
    for row, decided, (_, grad_split) in zip(rows, decided_by, split, strict=True):
        row.update(decided)
        # the stage rule where no feature decided
        scatters = reducing.stage >= 2 and grad_split
        row["reduce"] = decided["reduce"] or ("reduce_scatter" if scatters else "all_reduce")
    for owner, part, size in zip(state.owners, state.parts, state.sizes, strict=True):
        if owner is not None:
            rows[owner]["bytes"][part] += size
    for row, how in zip(rows, ema_storage or (), strict=ema_storage is not None):
        row["ema"] = how
    # the second pass, reading the first: where each leaf lives, how the wire encodes it
    where, other_memory = offload.leaf_columns(zero, rows, state.owners, state.sizes, accum_steps)
    encoded = wire.leaf_columns(zero.quantize, rows, split)
    _merge(rows, [("offload=", where), ("quantize=", encoded)])
    other = state.other(other_memory)
    return Plan(tuple(Leaf(**r) for r in rows), tuple(other), zero.stage, n, accum_steps)


@dataclasses.dataclass(frozen=True)
class _StateLeaves:
    """The optimizer side's leaves in the order the offload placement weighs them
    (``(master, opt_state, ema)`` flattened), each with its params row (None for one that
    mirrors no parameter), its part of the state, its bytes per device, and (for those
    :attr:`Plan.other` lists) its path and shape."""

    owners: list
    parts: list
    sizes: list
    paths: list
    shapes: list

    def other(self, memory: Sequence[str]) -> list[Other]:
        """The :class:`Other` rows of the leaves that mirror no parameter (the optimizer's,
        then the EMA's counter); ``memory``: where each lives."""
        unowned = [i for i, owner in enumerate(self.owners) if owner is None]
        return [
            Other(self.paths[i], self.shapes[i], self.sizes[i], where, self.parts[i])
            for i, where in zip(unowned, memory, strict=True)
        ]


def _state_leaves(zero, params, opt_state, state_specs, ema_specs, ema_itemsize: int):
    """The :class:`_StateLeaves` of ``zero``'s state over ``params`` (shape structs):
    ``state_specs`` and ``ema_specs`` (None without an EMA) are the params' leaves' specs."""
    n = zero.num_shards
    paths = [path_strs(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    mirrors, _ = _mirrors(paths, opt_state)
    rows_of = {id(x): i for i, mine in enumerate(mirrors) for _, x in mine}
    out = _StateLeaves([], [], [], [], [])

    def add(owner, part, x, spec, itemsize, path=None):
        out.owners.append(owner)
        out.parts.append(part)
        out.sizes.append(sh.shard_bytes(x.shape, spec, n, itemsize))
        out.paths.append(path)
        out.shapes.append(tuple(x.shape))

    flat = jax.tree.leaves(params)
    if zero.precision.separate_master:
        for i, (x, s) in enumerate(zip(flat, state_specs, strict=True)):
            add(i, "master", x, s, 4)
    opt_specs = jax.tree.leaves(zero.shard_specs(opt_state), is_leaf=lambda s: isinstance(s, P))
    opt_flat = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    for (path, x), s in zip(opt_flat, opt_specs, strict=True):
        name = "opt_state/" + "/".join(path_strs(path))
        add(rows_of.get(id(x)), "opt_state", x, s, np.dtype(x.dtype).itemsize, name)
    if ema_specs is not None:
        # EmaState.updates, its counter
        add(None, "ema", jax.ShapeDtypeStruct((), np.int32), P(), 4, "ema/updates")
        for i, (x, s) in enumerate(zip(flat, ema_specs, strict=True)):
            add(i, "ema", x, s, ema_itemsize)
    return out
