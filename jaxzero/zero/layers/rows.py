"""The optimizer update a step left pending, run a layer at a time inside the next forward
(``ZeRO(offload="optimizer", offload_update="deferred")`` at stage 3 per layer, decision 51's
third stage).

The step hands the loss's :class:`~jaxzero.zero.layers.plan.LayerPlan` a :class:`LayerRows`:
this device's shards of the host state leaves the rows rewrite and what the last update left
for them. :func:`jaxzero.scan_layers` runs layer ``i + 1``'s rows beside layer ``i``'s compute,
writes the new compute row into the stack it gathers from, and hands back the new stacks and
host state, which leave the differentiated loss in its aux (:meth:`LayerRows.emitted`).
"""

from __future__ import annotations

import jax


class RowsNotRun(ValueError):
    """The forward did not run the pending rows exactly once (the step then runs them before
    the forward instead)."""


_NOT_ONCE = (
    "ZeRO(offload_update='deferred') at stage 3 with layers={} runs the update the last step "
    "left pending inside jaxzero.scan_layers' forward, a layer at a time, and this model ran "
    "the stacks {} times through jaxzero.scan_layers with them (it must be exactly once, "
    "with the stack the step hands the loss). Run the stack once with jaxzero.scan_layers, or "
    "drop offload_update='deferred'."
)


class LayerRows:
    """The pending rows of one trace of the loss (inside the step's ``shard_map``).

    Args:
      forward: the placement's :class:`~jaxzero.zero.offload.placement.DeferredRows`.
      held: this device's shards of the host state leaves the rows rewrite.
      pending: this device's shards of what the last update left for them.
      layers: the config's ``layers=`` (for the error).
      delayed: the forward computes on the stacks as they came in (``offload_update=
        "delayed"``): the rows' new stacks are only emitted, for the state after the last
        micro-batch, and no gather waits for them.
    """

    def __init__(self, forward, held, pending, layers, delayed: bool = False):
        self.forward = forward
        self.delayed = delayed
        self.held = list(held)
        self.pending = tuple(pending)
        self.layers = layers
        self._row_of: dict = {}
        self._emitted = None
        self.runs = 0

    def wrap(self, fn):
        """The loss ``fn(params, ...)`` noting which flat params leaf each leaf the loss is
        handed is (:meth:`owners` finds them by identity)."""

        def noted(params, *rest):
            flat = jax.tree.leaves(params)
            self._row_of = {id(x): j for j, x in enumerate(flat) if j in self.forward.rows}
            self._emitted, self.runs = None, 0
            return fn(params, *rest)

        return noted

    def owners(self, leaves) -> list | None:
        """Each of a stack's ``leaves``' flat params index when its rows are pending (None
        where not); None when none of them is."""
        owners = [self._row_of.get(id(x)) for x in leaves]
        return owners if any(j is not None for j in owners) else None

    @property
    def stacks(self) -> int:
        """How many stacks the state's rows are packed in: with 2, layer ``i``'s rows are in
        the buffers of parity ``i % 2``, and :meth:`at` must be told it while tracing."""
        return self.forward.stacks

    def fetch(self, held, i, parity: int):
        """Layer ``i``'s packed state rows, fetched to the device (for :meth:`at`'s
        ``fetched``: the loop fetches a layer ahead)."""
        return self.forward.fetch(held, i, parity)

    def at(self, i, leaves, held, pending, owners, parity: int = 0, fetched=None):
        """Layer ``i``'s rows: ``(leaves, held)`` with the new compute row written into each
        owned stack leaf and the new state rows into the host state (``pending``: what the
        update left, as the loop has it; ``parity``: ``i % stacks``; ``fetched``: its state
        rows as :meth:`fetch` gave them, else fetched here)."""
        held, new, _ = self.forward.run(i, held, pending, parity=parity, fetched=fetched)
        return _with_row(leaves, owners, new, i), held

    def at_together(self, layers, leaves, held, pending, owners, parity: int, fetched):
        """:meth:`at` for ``layers`` of one ``parity`` whose packed rows are consecutive in
        their buffers (``i``, ``i + stacks``, ...; ``fetched``: each one's rows as
        :meth:`fetch` gave them), their new rows written back together: one copy per
        buffer."""
        written = []
        for i, rows in zip(layers, fetched, strict=True):
            held, new, packed = self.forward.run(
                i, held, pending, parity=parity, fetched=rows, write=False
            )
            leaves = _with_row(leaves, owners, new, i)
            written.append(packed)
        return leaves, self.forward.put(held, layers[0], written, parity)

    def record(self, leaves, held, owners) -> None:
        """What one forward loop left: the new stacks and host state leaves."""
        self.runs += 1
        self._emitted = (held, {j: x for x, j in zip(leaves, owners, strict=True) if j is not None})

    def emitted(self):
        """``(held, stacks)``: the host state leaves and the new stacks (in the order of
        ``forward.rows``) the forward wrote; :class:`RowsNotRun` unless exactly one loop ran
        them all."""
        if self.runs != 1 or set(self._emitted[1]) != set(self.forward.rows):
            raise RowsNotRun(_NOT_ONCE.format(self.layers, self.runs))
        held, stacks = self._emitted
        return held, [stacks[j] for j in self.forward.rows]


def _with_row(leaves, owners, new, i):
    """The stack ``leaves`` with layer ``i``'s new compute row written into each owned one
    (``new``: ``{flat params index: row}``)."""
    return [
        x if j is None else jax.lax.dynamic_update_slice_in_dim(x, new[j].astype(x.dtype), i, 0)
        for x, j in zip(leaves, owners, strict=True)
    ]


def with_stacks(params, stacks: dict):
    """``params`` with the stacks a forward's layer loop wrote (``stacks``: ``{flat params
    index: stack}``) put in, each in its params leaf's dtype (the loop's stack may be the
    loss's wider copy)."""
    flat, tree = jax.tree.flatten(params)
    for j, x in stacks.items():
        flat[j] = x.astype(flat[j].dtype)
    return jax.tree.unflatten(tree, flat)
