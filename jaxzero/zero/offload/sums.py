"""Where the gradients of the leaves fetched from host memory are summed over micro-batches
(``ZeRO(offload=("optimizer", "params"))``, ``accum_steps > 1``: decision 42): the layer
stacks' (``layers=``) and the units' (``units=``).

With one micro-batch, such a leaf's reduced gradient is written into its params' host memory
(:func:`jaxzero.scan_layers`' backward, decision 37; the unit chain). With several, the next
micro-batch's forward reads those params, so each leaf's gradient is summed into a host
accumulator of its shape in ``output_dtype`` instead: the first micro-batch's backward
creates it, each later one adds into it (:func:`add_on_host`), and the streamed update reads
the sum and divides it. The objects here hand each leaf's accumulator so far to the code
that adds into it; nothing else in the step knows of them.
"""

from __future__ import annotations

import jax

from jaxzero.zero.specs import is_stacked

_NOT_THE_STACK = (
    "ZeRO(offload=('optimizer', 'params'), layers={}) with accum_steps > 1 sums each stack's "
    "gradient into a host buffer that belongs to the stack leaf the step hands the loss, and "
    "jaxzero.scan_layers got leaves of shapes {} that are not those leaves (the model changed "
    "them: a cast, a reshape, a slice). Pass the stack to jaxzero.scan_layers as "
    "jaxzero.stacked_params returns it, or use accum_steps=1."
)


def add_on_host(earlier, g, dtype):
    """The host sum of one leaf: ``g`` (a reduced gradient on the device) in ``dtype``, plus
    ``earlier`` (the sum so far, in host memory; None at the first micro-batch) fetched to the
    device once ``g`` exists, written to host memory. Without that order XLA fetches every
    leaf's sum at the start of the backward and holds the whole gradient on the device."""
    total = g.astype(dtype)
    if earlier is not None:
        earlier, _ = jax.lax.optimization_barrier((earlier, g))
        total = jax.device_put(earlier, jax.memory.Space.Device) + total
    return jax.device_put(total, jax.memory.Space.Host)


class NoSums:
    """No host accumulators: the gradients leave the backward as they are."""

    summing = False  # whether the backward adds into host accumulators

    def wrap(self, fn):
        """The loss ``fn`` as the step differentiates it."""
        return fn

    def of(self, leaves):
        """The host accumulators of a stack's ``leaves``: None (there are none)."""
        return None

    def flat(self, count: int) -> list:
        """The host accumulator of each of the loss's ``count`` params leaves, in flat
        order: None (there are none)."""
        return [None] * count


class HostSums(NoSums):
    """The host accumulators of one micro-batch: ``earlier``, the gradient tree of the
    micro-batches before it (None at the first), whose leaves fetched from host memory (under
    the ``layers`` stacks, or the units') are the sums so far."""

    summing = True

    def __init__(self, layers: tuple[str, ...] | None, earlier=None):
        self.layers = layers
        self.earlier = earlier
        self._by_id: dict = {}

    def _stacked(self, tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [x for p, x in flat if is_stacked(p, self.layers)]

    def wrap(self, fn):
        """``fn(params, ...)`` noting which accumulator belongs to each stack leaf the loss
        is handed (:meth:`of` finds them by identity)."""

        def noted(params, *rest):
            stacks = self._stacked(params)
            sums = [None] * len(stacks) if self.earlier is None else self._stacked(self.earlier)
            self._by_id = {id(x): a for x, a in zip(stacks, sums, strict=True)}
            return fn(params, *rest)

        return noted

    def of(self, leaves):
        """The accumulators of a stack's ``leaves`` (as :func:`jaxzero.scan_layers` got them:
        the loss's own), a list with None at the first micro-batch."""
        missing = [x.shape for x in leaves if id(x) not in self._by_id]
        if missing:
            raise ValueError(_NOT_THE_STACK.format(self.layers, missing[:4]))
        return [self._by_id[id(x)] for x in leaves]

    def flat(self, count: int) -> list:
        """The accumulator so far of each of the loss's ``count`` params leaves, in flat order
        (the gradient tree has the params' structure): None at the first micro-batch. Only
        the leaves the plan sums on host are read (the units' leaves)."""
        return [None] * count if self.earlier is None else jax.tree.leaves(self.earlier)
