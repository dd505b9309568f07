"""Where the layer stacks' gradients are summed over micro-batches with the params in host
memory (``ZeRO(offload=("optimizer", "params"))``, ``accum_steps > 1``: decision 42).

With one micro-batch, :func:`jaxzero.scan_layers`' backward writes each layer's reduced
gradient into that layer's params in host memory (decision 37). With several, the next
micro-batch's forward reads those params, so each stack's gradient is summed into a host
accumulator of its shape in ``output_dtype`` instead: the first micro-batch's backward
creates it, each later one adds into it a layer's slot at a time, and the streamed update
reads the sum and divides it. These objects tell the stack loop which accumulator belongs
to which stack leaf; nothing else in the step knows of them.
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


class NoSums:
    """No host accumulators: the stacks' gradients leave the backward as they are."""

    def wrap(self, fn):
        """The loss ``fn`` as the step differentiates it."""
        return fn

    def of(self, leaves):
        """The host accumulators of a stack's ``leaves``: None (there are none)."""
        return None


class HostSums(NoSums):
    """The host accumulators of one micro-batch's stacks: ``earlier``, the gradient tree of
    the micro-batches before it (None at the first), whose leaves under the ``layers``
    stacks are the sums so far."""

    def __init__(self, layers: tuple[str, ...], earlier=None):
        self.layers = layers
        self.earlier = None if earlier is None else self._stacked(earlier)
        self._by_id: dict = {}

    def _stacked(self, tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return [x for p, x in flat if is_stacked(p, self.layers)]

    def wrap(self, fn):
        """``fn(params, ...)`` noting which accumulator belongs to each stack leaf the loss
        is handed (:meth:`of` finds them by identity)."""

        def noted(params, *rest):
            stacks = self._stacked(params)
            sums = self.earlier or [None] * len(stacks)
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
