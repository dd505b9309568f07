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

from jaxzero.trees import path_strs
from jaxzero.zero import collectives
from jaxzero.zero import plan as leaf_plan
from jaxzero.zero.hooks import LossHook
from jaxzero.zero.layers import plan as layers
from jaxzero.zero.layers import vocab
from jaxzero.zero.offload.sums import HostSums, NoSums
from jaxzero.zero.units import plan as units


@dataclasses.dataclass(frozen=True)
class GradientPath:
    """The gathers, loss hooks and gradient reductions of one :class:`ZeROConfig`, reading
    each leaf's fate from the per-leaf plan (:mod:`jaxzero.zero.plan`): the step's ``plan``,
    built once from the global params, or, for a step written by hand from ``ZeRO``'s pieces
    (no plan given), the plan's feature columns of the tree at hand. A training step's path
    (:meth:`for_step`) knows its micro-batches, which decide the reduction it runs
    (:attr:`stage`): the config stays as the user gave it."""

    zero: Any  # the ZeROConfig it belongs to (which imports this module)
    plan: Any = None  # the step's jaxzero.zero.plan.Plan
    #: the micro-batches of the training step this path runs (:meth:`for_step`), which
    #: decide how its gradient is reduced; None for a step written by hand from ``ZeRO``'s
    #: pieces, which reduces as the config's stage says
    accum_steps: int | None = None

    def for_step(self, accum_steps: int) -> GradientPath:
        """The path of a training step with ``accum_steps`` micro-batches (its reduction:
        :attr:`stage`, :meth:`reduces_in_backward`)."""
        return dataclasses.replace(self, accum_steps=accum_steps)

    # -- which reductions a step runs -------------------------------------------------------
    @property
    def stage(self) -> int:
        """The stage whose gradient reduction this path runs: the config's, but for a training
        step at stage 1 with ``layers=`` and one micro-batch, which reduces like stage 2: each
        layer's gradient is reduce-scattered inside the backward, under the next layer's
        backward, instead of one all-reduce of the whole gradient after it (the same sums,
        half an all-reduce's traffic, and no full reduced gradient: the optimizer only reads
        its shard). The config keeps its stage: the state's shardings are stage 1's."""
        z = self.zero
        if z.stage == 1 and self.accum_steps == 1 and self._in_backward(2):
            return 2
        return z.stage

    def _in_backward(self, stage: int) -> bool:
        z = self.zero
        return layers.reduces_in_backward(stage, z.layers, z.precision, z.replica_axes)

    def reduces_in_backward(self) -> bool:
        """Whether the step reduces each layer's gradient inside the backward
        (:func:`jaxzero.zero.layers.plan.reduces_in_backward` at :attr:`stage`). Not stage 0
        with micro-batches: it keeps its full local accumulator and all-reduces it once (a
        reduce per micro-batch would add traffic); stage 1 with micro-batches does the same."""
        if self.zero.stage == 0 and (self.accum_steps or 1) > 1:
            return False
        return self._in_backward(self.stage)

    def reduces_each_micro_batch(self) -> bool:
        """Whether every micro-batch's gradient is reduced where it is computed (stages 2/3, and
        stage 0 when it all-reduces each layer in the backward), rather than summed locally and
        reduced once."""
        return self.stage >= 2 or self.reduces_in_backward()

    def grad_specs(self, tree):
        """Specs of the reduced gradients of ``tree`` at :attr:`stage`: sharded for stages 2/3,
        replicated for 0/1."""
        return self.zero.grad_specs(tree, stage=self.stage)

    def unused_layers(self, accum_steps: int) -> str | None:
        """Why ``layers=`` reduces no layer's gradient in the backward of a step with
        ``accum_steps`` micro-batches, as a warning's sentence; None where it does
        (:func:`jaxzero.zero.layers.plan.unused_reason`)."""
        return layers.unused_reason(self.zero, accum_steps)

    # -- inside shard_map ---------------------------------------------------------------------
    def _rows(self, tree) -> dict:
        """Each leaf path's plan row: the step's plan, or the feature columns of ``tree``."""
        if self.plan is not None:
            return {r.path: r for r in self.plan.rows}
        paths = [path_strs(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        return {r["path"]: r for r in leaf_plan.decisions(self.zero, paths)}

    def _where(self, tree, predicate):
        """``predicate`` of each leaf's row, as a tree like ``tree``; None when none holds."""
        found = leaf_plan.mask(self._rows(tree), tree, predicate)
        return found if any(jax.tree.leaves(found)) else None

    def _stacked_mask(self, tree):  # the loss gets them as shards, gathered where used
        return self._where(tree, leaf_plan.gathered_by_a_hook)

    def _whole_mask(self, tree):  # stage 0 per layer: the stacks stay device-invariant
        return self._where(tree, lambda r: _get(r, "gather") == "invariant")

    def _tables(self, tree):  # vocab_parallel=: the tables stay rows, reduced as complete
        return self._where(tree, lambda r: _get(r, "gather") == "vocab_rows")

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
        tables = self._tables(local_params)  # stay rows, like the stacks
        args = (vocab.either(self._stacked_mask(local_params), tables),)
        keep_dtype = not where.master_on_device  # the stacks are params: decision 32
        args += (self._whole_mask(local_params), keep_dtype)
        full = collectives.params_for_loss(z.comm, local_params, specs, *args)
        return vocab.varying(z.comm, tables, full)

    def accumulates_on_host(self, accum_steps: int) -> bool:
        """Whether a step with ``accum_steps`` micro-batches sums the layer stacks' or the
        units' gradients into host accumulators (the params in host memory: decision 42)."""
        return accum_steps > 1 and self.zero.placement.params_on_host

    def _layer_plan(self, local_params, specs, sums, rows=None) -> layers.LayerPlan | None:
        """The plan of a per-layer stage-3 step (gather), or of a stage 2/0 step that reduces in
        the backward (:meth:`reduces_in_backward`); None otherwise."""
        z = self.zero
        gather = z.per_layer
        if not (gather or self.reduces_in_backward()):
            return None
        specs = specs if gather else self.grad_specs(local_params)
        return layers.build_plan(
            z.comm,
            z.layers,
            local_params,
            specs,
            gather=gather,
            invariant=z.stage == 0,
            activations=z.activations,
            placement=z.placement,
            sums=sums,
            rows=rows,
        )

    def loss_hooks(
        self, local_params, specs, grad_sums=None, accumulate: bool = False, rows=None
    ) -> list[LossHook]:
        """The features that hook into this step's loss (:mod:`jaxzero.zero.hooks`):
        ``vocab_parallel=``, ``layers=`` and ``units=``, each where it acts. ``accumulate``
        (:meth:`accumulates_on_host`): the stacks' or the units' gradients are added into host
        accumulators, those of ``grad_sums`` (the earlier micro-batches' gradients; None at
        the first). ``rows``: the update the last step left pending, which the per-layer
        stage-3 forward runs (:class:`~jaxzero.zero.layers.rows.LayerRows`), or None."""
        z = self.zero
        sums = HostSums(z.layers, grad_sums) if accumulate else NoSums()
        hooks = (
            vocab.build_plan(z.comm, z.vocab_parallel, local_params, specs),
            self._layer_plan(local_params, specs, sums, rows),
            units.build_plan(
                z.comm, z.units, local_params, specs, z.prefetch, z.vocab_parallel, sums
            ),
        )
        return [h for h in hooks if h is not None]

    def reduce_gradients(self, grads, hooks=()):
        """Average local gradients over every batch axis (all-reduce or reduce-scatter);
        ``hooks``: the step's :meth:`loss_hooks` (a stage-2 layer plan names the leaves it
        reduced per layer)."""
        z = self.zero
        plan = next((h for h in hooks if isinstance(h, layers.LayerPlan)), None)
        masks = (self._stacked_mask(grads), layers.scattered_mask(plan, grads))
        masks += (self._tables(grads),)  # complete on every device
        return collectives.reduce_gradients(z.comm, grads, self.grad_specs(grads), *masks)


def _get(row, name: str):
    """A plan row's column: a :class:`~jaxzero.zero.plan.Leaf` or a decisions dict."""
    return row[name] if isinstance(row, dict) else getattr(row, name)
