"""``GradientPath``: how the params reach the loss and the gradients leave it, inside the
step's ``shard_map``.

A :class:`~jaxzero.zero.config.ZeROConfig` says what is sharded where; its
:attr:`~jaxzero.zero.config.ZeROConfig.path` says what runs between the shards and the loss:
the gathers (whole at the start of the loss, per layer for ``layers=``, per unit for
``units=``), the loss hooks of those features (:mod:`jaxzero.zero.hooks`), and the gradient
reductions (all-reduce or reduce-scatter, after the backward or layer by layer inside it). The
training step (:mod:`jaxzero.train.grads`) asks it these questions and knows no feature module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxzero.zero import collectives
from jaxzero.zero import specs as sh
from jaxzero.zero.hooks import LossHook
from jaxzero.zero.layers import plan as layers
from jaxzero.zero.layers import vocab
from jaxzero.zero.offload.sums import HostSums
from jaxzero.zero.units import patterns as unit_patterns
from jaxzero.zero.units import plan as units


@dataclasses.dataclass(frozen=True)
class GradientPath:
    """The gathers, loss hooks and gradient reductions of one :class:`ZeROConfig`."""

    zero: Any  # the ZeROConfig it belongs to (which imports this module)

    # -- which reductions a step runs -------------------------------------------------------
    def reduces_in_backward(self, stage: int | None = None) -> bool:
        """Whether a step at ``stage`` (the config's by default) reduces each layer's gradient
        inside the backward (:func:`jaxzero.zero.layers.plan.reduces_in_backward`)."""
        z = self.zero
        stage = z.stage if stage is None else stage
        return layers.reduces_in_backward(stage, z.layers, z.precision, z.replica_axes)

    def reduces_each_micro_batch(self) -> bool:
        """Whether every micro-batch's gradient is reduced where it is computed (stages 2/3, and
        stage 0 when it all-reduces each layer in the backward), rather than summed locally and
        reduced once."""
        return self.zero.stage >= 2 or self.reduces_in_backward()

    def unused_layers(self, accum_steps: int) -> str | None:
        """Why ``layers=`` reduces no layer's gradient in the backward of a step with
        ``accum_steps`` micro-batches, as a warning's sentence; None where it does
        (:func:`jaxzero.zero.layers.plan.unused_reason`)."""
        return layers.unused_reason(self.zero, accum_steps)

    # -- inside shard_map ---------------------------------------------------------------------
    def _stacked_mask(self, tree, on: bool | None = None):  # the loss gets them as shards
        z = self.zero
        if not (z.per_layer or z.units if on is None else on):
            return None
        if z.units:
            # the vocabulary tables stay rows and are reduced as complete, never by the unit
            # chain, even outside the units with prefetch (unit_plan leaves them out too)
            units = unit_patterns.mask(tree, z.units, z.prefetch)
            tables = vocab.mask(z.vocab_parallel, tree)
            return (
                units if tables is None else jax.tree.map(lambda u, t: u and not t, units, tables)
            )
        return sh.subtree_mask(tree, z.layers)

    def _whole_mask(self, tree):  # stage 0 per layer: the stacks stay device-invariant
        on = self.zero.stage == 0 and self.reduces_in_backward(0)
        return self._stacked_mask(tree, on)

    def gather_params(self, local_params, specs):
        """All-gather stage-3 parameter shards (``specs``: ``param_specs(params)``)."""
        mask = self._stacked_mask(local_params)
        return collectives.gather_params(self.zero.comm, local_params, specs, mask)

    def params_for_loss(self, local_params, specs):
        """The full compute params, marked device-varying, ready to differentiate; with the
        params in host memory every leaf but the layer stacks is fetched to the device first
        (:func:`jaxzero.scan_layers` fetches each layer of those)."""
        z, where = self.zero, self.zero.placement
        if where.params_on_host:
            # the stacks (layers=) or the units' leaves (units=) are fetched where gathered
            stacks = self._stacked_mask(local_params)
            fetch = lambda stack, x: x if stack else where.fetch(x)
            local_params = jax.tree.map(fetch, stacks, local_params)
        tables = vocab.mask(z.vocab_parallel, local_params)  # stay rows, like the stacks
        args = (vocab.either(self._stacked_mask(local_params), tables),)
        keep_dtype = not where.master_on_device  # the stacks are params: decision 32
        args += (self._whole_mask(local_params), keep_dtype)
        full = collectives.params_for_loss(z.comm, local_params, specs, *args)
        return vocab.varying(z.comm, tables, full)

    def accumulates_on_host(self, accum_steps: int) -> bool:
        """Whether a step with ``accum_steps`` micro-batches sums the layer stacks' gradients
        into host accumulators (the params in host memory: decision 42)."""
        return accum_steps > 1 and self.zero.placement.params_on_host

    def _layer_plan(self, local_params, specs, grad_sums, accumulate) -> layers.LayerPlan | None:
        """The plan of a per-layer stage-3 step (gather), or of a stage 2/0 step that reduces in
        the backward (:meth:`reduces_in_backward`); None otherwise."""
        z = self.zero
        gather = z.per_layer
        if not (gather or self.reduces_in_backward()):
            return None
        specs = specs if gather else z.grad_specs(local_params)
        return layers.build_plan(
            z.comm,
            z.layers,
            local_params,
            specs,
            gather=gather,
            invariant=z.stage == 0,
            activations=z.activations,
            placement=z.placement,
            sums=HostSums(z.layers, grad_sums) if accumulate else None,
        )

    def loss_hooks(
        self, local_params, specs, grad_sums=None, accumulate: bool = False
    ) -> list[LossHook]:
        """The features that hook into this step's loss (:mod:`jaxzero.zero.hooks`):
        ``vocab_parallel=``, ``layers=`` and ``units=``, each where it acts. ``accumulate``
        (:meth:`accumulates_on_host`): the stacks' gradients are added into host accumulators,
        those of ``grad_sums`` (the earlier micro-batches' gradients; None at the first)."""
        z = self.zero
        hooks = (
            vocab.build_plan(z.comm, z.vocab_parallel, local_params, specs),
            self._layer_plan(local_params, specs, grad_sums, accumulate),
            units.build_plan(z.comm, z.units, local_params, specs, z.prefetch, z.vocab_parallel),
        )
        return [h for h in hooks if h is not None]

    def reduce_gradients(self, grads, hooks=()):
        """Average local gradients over every batch axis (all-reduce or reduce-scatter);
        ``hooks``: the step's :meth:`loss_hooks` (a stage-2 layer plan names the leaves it
        reduced per layer)."""
        z = self.zero
        plan = next((h for h in hooks if isinstance(h, layers.LayerPlan)), None)
        masks = (self._stacked_mask(grads), layers.scattered_mask(plan, grads))
        masks += (vocab.mask(z.vocab_parallel, grads),)  # complete on every device
        return collectives.reduce_gradients(z.comm, grads, z.grad_specs(grads), *masks)
