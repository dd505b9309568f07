"""Training Flax NNX modules with jaxzero: split into pure-dict params (trained and sharded by
ZeRO) and model state, merged back inside the loss.

RNG streams a module owns (``nnx.Dropout(0.1, rngs=rngs)``, or a kept ``nnx.Rngs``) are model
state: their keys are stored as raw ``uint32`` key data (checkpointable, like
``TrainState.rng``) and their counters as they are. Inside a jaxzero step (``stateful_loss``
with ``make_train_step(..., stateful=True)`` and ``step.init(..., rng=key)``), stream ``i``
(in the module's graph order) draws from a fresh stream seeded with ``fold_in(rng, i)``, where
``rng`` is the step's per-device key ``fold_in(fold_in(state.rng, step), device index)``:
every device draws its own numbers, every step new ones, and the result equals calling the
module with ``rngs=nnx.Rngs(<collection>=fold_in(rng, i))``. The stored key is kept and the
stored counter advances by the draws made, so it counts them across steps.

Example:
  >>> model_def, params, model_state = jz.flax_nnx.split(MyModule(nnx.Rngs(0)))
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


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _raw_keys(tree):
    """Typed PRNG keys as their raw key data; returns (tree, {path: key impl})."""
    impls = {}

    def one(path, x):
        if not _is_key(x):
            return x
        impls[path] = jax.random.key_impl(x)
        return jax.random.key_data(x)

    return jax.tree_util.tree_map_with_path(one, tree), impls


def _streams(module) -> list:
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngStream)]


@dataclasses.dataclass(frozen=True)
class NnxModel:
    """The static part of a split NNX module: its graph definition, state templates, and the
    implementations of the PRNG keys it keeps in its model state."""

    graphdef: Any
    params_template: Any
    state_template: Any
    key_impls: tuple = ()

    def _fill(self, template, pure):
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, pure)
        return state

    def _typed_keys(self, model_state):
        impls = dict(self.key_impls)
        return jax.tree_util.tree_map_with_path(
            lambda p, x: jax.random.wrap_key_data(x, impl=impls[p]) if p in impls else x,
            model_state,
        )

    def merge(self, params, model_state=None):
        """A module with ``params`` (and ``model_state``) in place of the originals."""
        rest = self.state_template
        if model_state is not None:
            rest = self._fill(self.state_template, self._typed_keys(model_state))
        return nnx.merge(self.graphdef, self._fill(self.params_template, params), rest)

    def loss(self, fn):
        """``fn(module, batch) -> loss | (loss, aux)`` as a jaxzero ``loss_fn(params, batch)``."""

        def loss_fn(params, batch):
            return fn(self.merge(params), batch)

        return loss_fn

    def _reseed(self, module, rng) -> list:
        """Seed every RNG stream of ``module`` from ``rng`` (module docstring); returns the
        streams' stored counters."""
        streams = _streams(module)
        if streams and rng is None:
            raise ValueError(
                "this NNX module owns RNG streams (e.g. nnx.Dropout(..., rngs=rngs)) but the "
                "step has no rng: create the state with step.init(params, model_state="
                "model_state, rng=jax.random.key(seed))."
            )
        if streams and not _is_key(rng):
            rng = jax.random.wrap_key_data(rng)  # jaxzero stores keys as raw key data
        counts = []
        for i, stream in enumerate(streams):
            counts.append(stream.count[...])
            stream.key[...] = jax.random.fold_in(rng, i)
            stream.count[...] = jax.numpy.zeros_like(stream.count[...])
        return counts

    def stateful_loss(self, fn):
        """``fn(module, batch, rng) -> loss | (loss, aux)`` as a stateful jaxzero loss
        ``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, aux))``;
        the module's non-Param state after the call (e.g. BatchNorm statistics, RNG stream
        counters) is returned; its RNG streams draw as the module docstring says."""

        def loss_fn(params, model_state, batch, rng):
            module = self.merge(params, model_state)
            counts = self._reseed(module, rng)
            out = fn(module, batch, rng)
            loss, aux = out if isinstance(out, tuple) else (out, None)
            streams = _streams(module)
            for stream, before in zip(streams, counts, strict=True):
                stream.count[...] = before + stream.count[...]
            _, _, rest = nnx.split(module, nnx.Param, ...)
            new_state = _raw_keys(nnx.to_pure_dict(rest))[0] or None  # None as split gives
            if self.key_impls:  # the stored keys stay (this call's draws came from rng)
                new_state = jax.tree_util.tree_map_with_path(
                    lambda p, new, old: old if p in dict(self.key_impls) else new,
                    new_state,
                    model_state,
                )
            return loss, (new_state, aux)

        return loss_fn


def split(module) -> tuple[NnxModel, dict, dict | None]:
    """Split an ``nnx.Module`` into (:class:`NnxModel`, params, model_state).

    ``params`` (every ``nnx.Param``) and ``model_state`` (everything else, e.g. BatchNorm
    statistics and RNG streams; None when empty) are plain nested dicts of arrays, which
    jaxzero shards and checkpoints like any Linen params tree. PRNG keys are stored as raw
    key data (see the module docstring).

    Raises:
      TypeError: a module variable holds something other than an array (every path listed).
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(f"split expects an nnx.Module, got {type(module).__name__}.")
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    pure_params, pure_rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    _check_arrays(pure_params, "params")
    _check_arrays(pure_rest, "state")
    pure_rest, impls = _raw_keys(pure_rest)
    model = NnxModel(graphdef, params, rest, tuple(impls.items()))
    return model, pure_params, (pure_rest or None)
