"""Stage 3 per module for models as people write them (FSDP2's ``fully_shard``): a Python loop
of Linen blocks, an NNX list of layers.

``ZeRO(stage=3, units=r"block_\\d+")`` names the units by a pattern over the params' key paths;
each distinct path prefix the pattern matches (``block_0``, ``block_1``, ...; ``layers/0``, ...
for an ``nnx.List``) is one unit, and every leaf outside the units (embeddings, the final norm)
is gathered whole at the start of the loss as without ``units=``. The model is not changed.
Units may nest (``fully_shard`` on a sub-module, then on its parent): a leaf belongs to the
deepest unit named, and the parent's other weights, read before and after the sub-unit runs,
form two segments of the parent (:mod:`jaxzero.zero.units.patterns`: the rule, the checks).

Inside the step the loss gets each unit's leaves as shards. :func:`run` traces the loss once to
a jaxpr with a marker where each unit leaf would be gathered, and evaluates that jaxpr
equation by equation under the step's own transformations. The equations that read a unit's
weights, from the first to the last with nothing of another unit between, form one *segment*;
each segment runs as a ``jax.checkpoint`` that

* all-gathers the unit's shards first (in ``param_dtype``, device-varying; the backward of that
  gather reduce-scatters the unit's gradient in ``reduce_dtype`` as soon as the segment's
  backward is done: :func:`jaxzero.zero.layers.plan.gather_shard` / ``gather_leaf``);
* saves for the backward whatever the model saves (activations; a user's ``nn.remat`` keeps its
  own policy) except the gathered weights and copies of them (a transpose, reshape or widening
  cast of a matrix is recomputed, not saved: Hugging Face's ``FlaxConv1D`` computes
  ``kernel.T``), which its backward gathers again (FSDP's ``reshard_after_forward=True``).

With ``ZeRO(prefetch=True)`` (the default) the segments from the first unit's to the last's
run instead as one custom VJP that prefetches across units and gathers the leaves outside the
units where they are read (:mod:`jaxzero.zero.units.chain`); what follows is
``prefetch=False``.

Order (``0 * token`` added to each shard, and that token's cotangent): segment ``k + 1``'s
gather may start once segment ``k``'s weights are whole (XLA cannot fold every unit's gather
into one combined gather up front); segment ``k``'s backward starts once segment ``k + 1``'s
gradient is reduce-scattered (no two units' full gradients are held for one combined
reduce-scatter after the backward). Measured on the deviceless H100 compile
(docs/decisions/33-units.md): XLA overlaps the forward gathers with the unit's own compute, not
the previous unit's (the schedule is the same when the next gather must wait for this unit's
outputs), and the backward's gathers and the reduce-scatters are exposed, because
``jax.checkpoint``'s backward waits on every cotangent of its segment at once.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from jaxzero.zero.collectives import Comm
from jaxzero.zero.hooks import LossHook
from jaxzero.zero.jaxpr_eval import inline_calls
from jaxzero.zero.layers.plan import gather_shard
from jaxzero.zero.offload.sums import NoSums
from jaxzero.zero.specs import spec_dim, subtree_mask
from jaxzero.zero.units.chain import fetched
from jaxzero.zero.units.evaluator import MARK, Evaluator, is_jit
from jaxzero.zero.units.patterns import unit_names

__all__ = ["UnitPlan", "build_plan", "run", "unit_names"]


def build_plan(
    comm: Comm,
    units: tuple[str, ...],
    local_params,
    specs,
    prefetch: bool = True,
    tables=(),
    sums: NoSums | None = None,
) -> UnitPlan | None:
    """The :class:`UnitPlan` of a stage-3 step with ``units`` (None without), from the local
    params and their global ``specs``; with ``prefetch`` the leaves outside the units are
    gathered where they are read too (:data:`OUTSIDE`), except the ``vocab_parallel`` tables
    (``tables``: their names), which are never gathered. ``sums``: the host accumulators the
    units' gradients are added into over micro-batches (the params offloaded:
    :mod:`jaxzero.zero.offload.sums`); None: none."""
    if not units:
        return None
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    dims = [spec_dim(s) for s in flat_specs]
    names = unit_names(local_params, units, outside=prefetch)
    if tables:
        names = [
            None if t else u for u, t in zip(names, vocab_mask(local_params, tables), strict=True)
        ]
    return UnitPlan(comm, names, dims, prefetch=prefetch, sums=sums or NoSums())


@dataclasses.dataclass
class UnitPlan(LossHook):
    """Per flat params leaf: its unit (None: not in a unit) and the dimension its shard was
    split on (None: replicated); ``segments``: how many segments the last trace ran;
    ``sums``: the units' host gradient accumulators over micro-batches (decision 42). As a
    :class:`~jaxzero.zero.hooks.LossHook` it runs the loss unit by unit (:func:`run`)."""

    comm: Comm
    units: list[str | None]
    dims: list[int | None]
    segments: int = 0
    prefetch: bool = True
    sums: NoSums = dataclasses.field(default_factory=NoSums)

    def wrap(self, fn):
        return lambda params, *rest: run(self, fn, params, *rest)


def _marker(comm: Comm, d):
    def unit_gather(x):
        return gather_shard(comm, fetched(x), d)  # traced only: the evaluator gathers

    unit_gather.__name__ = MARK
    return jax.jit(unit_gather)


def run(plan: UnitPlan, fn, params, *rest):
    """``fn(params, *rest)`` with each unit's leaves (shards in ``params``) gathered segment by
    segment (see the module docstring)."""
    leaves, treedef = jax.tree.flatten(params)

    def traced(leaves, rest):
        full = [
            x if u is None else _marker(plan.comm, d)(x)
            for x, u, d in zip(leaves, plan.units, plan.dims, strict=True)
        ]
        return fn(jax.tree.unflatten(treedef, full), *rest)

    closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(leaves, rest)
    flat = list(leaves) + jax.tree.leaves(rest)
    if any(is_jit(e) for e in closed.jaxpr.eqns):  # a jitted loss (or model): inline it
        inline = lambda *a: inline_calls(closed.jaxpr, closed.consts, a, is_jit)
        closed = jax.make_jaxpr(inline)(*flat)
    accs = plan.sums.flat(len(leaves))  # each leaf's host gradient sum so far, or None
    outs = Evaluator(plan, closed.jaxpr, len(leaves)).run(closed.consts, flat, accs)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def vocab_mask(params, tables) -> list[bool]:
    """Per flat leaf: under one of the ``vocab_parallel`` tables."""
    return jax.tree.leaves(subtree_mask(params, tables))
