"""Training Flax NNX modules with jaxzero: split into pure-dict params (trained and sharded by
ZeRO) and model state, merged back inside the loss.

Example:
  >>> model_def, params, model_state = jaxzero.nnx.split(MyModule(nnx.Rngs(0)))
  >>> loss_fn = model_def.loss(lambda module, batch: ((module(batch["x"]) - batch["y"]) ** 2).mean())
  >>> step = jz.make_train_step(loss_fn, zero)
  >>> state = step.init(params)
  >>> trained = model_def.merge(jz.gather(state))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx


def _check_arrays(tree, what: str) -> None:
    bad = [
        f"{jax.tree_util.keystr(k)} ({type(v).__name__})"
        for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
        if not hasattr(v, "shape") or not hasattr(v, "dtype")
    ]
    if bad:
        raise TypeError(
            f"the NNX module's {what} holds values jaxzero cannot shard or checkpoint: "
            f"{', '.join(bad[:10])}. Keep only jax arrays in nnx.Variable attributes (store "
            f"Python config as plain attributes, not Variables)."
        )


@dataclasses.dataclass(frozen=True)
class NnxModel:
    """The static part of a split NNX module: its graph definition and state templates."""

    graphdef: Any
    params_template: Any
    state_template: Any

    def _fill(self, template, pure):
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, pure)
        return state

    def merge(self, params, model_state=None):
        """A module with ``params`` (and ``model_state``) in place of the originals."""
        rest = (
            self.state_template
            if model_state is None
            else self._fill(self.state_template, model_state)
        )
        return nnx.merge(self.graphdef, self._fill(self.params_template, params), rest)

    def loss(self, fn):
        """``fn(module, batch) -> loss | (loss, aux)`` as a jaxzero ``loss_fn(params, batch)``."""

        def loss_fn(params, batch):
            return fn(self.merge(params), batch)

        return loss_fn

    def stateful_loss(self, fn):
        """``fn(module, batch, rng) -> loss | (loss, aux)`` as a stateful jaxzero loss
        ``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, aux))``;
        the module's non-Param state after the call (e.g. BatchNorm statistics) is returned."""

        def loss_fn(params, model_state, batch, rng):
            module = self.merge(params, model_state)
            out = fn(module, batch, rng)
            loss, aux = out if isinstance(out, tuple) else (out, None)
            _, _, rest = nnx.split(module, nnx.Param, ...)
            return loss, (nnx.to_pure_dict(rest), aux)

        return loss_fn


def split(module) -> tuple[NnxModel, dict, dict | None]:
    """Split an ``nnx.Module`` into (:class:`NnxModel`, params, model_state).

    ``params`` (every ``nnx.Param``) and ``model_state`` (everything else, e.g. BatchNorm
    statistics; None when empty) are plain nested dicts of arrays, which jaxzero shards and
    checkpoints like any Linen params tree.

    Raises:
      TypeError: a module variable holds something other than an array (every path listed).
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(f"split expects an nnx.Module, got {type(module).__name__}.")
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    pure_params, pure_rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    _check_arrays(pure_params, "params")
    _check_arrays(pure_rest, "state")
    model = NnxModel(graphdef, params, rest)
    return model, pure_params, (pure_rest or None)
