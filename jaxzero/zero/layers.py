"""Stage 3, per layer: gather each scanned layer's parameter shards where the layer runs.

With ``ZeRO(..., stage=3, layers=("layers",))`` the train step hands the loss the layer stack
``params["layers"]`` as this device's shards. The model gathers one layer at a time inside its
scanned, rematerialised block::

    block = nn.map_variables(Block, "params", trans_in_fn=jaxzero.gather_layer)
    block = nn.remat(block)
    x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=n_layers)(cfg, name="layers")(x, None)

so at any moment one layer's weights are whole (FSDP's ``reshard_after_forward=True``): the
forward all-gathers layer ``i``, ``nn.remat`` all-gathers it again for the backward, and the
backward of that all-gather reduce-scatters layer ``i``'s gradient as soon as it exists (in
``precision.reduce_dtype``), so no full gradient of the stack is ever held either.

Outside such a step (evaluation on gathered params, ``model.init``, stages 0-2)
:func:`gather_layer` is the identity, so one model definition serves everywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxzero._tree import path_keys
from jaxzero.zero.collectives import Comm, reduce_leaf, to_varying
from jaxzero.zero.specs import is_stacked, spec_dim

_PLAN: contextvars.ContextVar[LayerPlan | None] = contextvars.ContextVar(
    "jaxzero_layer_plan", default=None
)


@dataclasses.dataclass
class LayerPlan:
    """Which dimension each layer leaf was sharded on, keyed by its path inside one layer and
    its local (per-layer, per-device) shape; built by :func:`build_plan`."""

    comm: Comm
    layers: tuple[str, ...]
    dims: dict[tuple, int | None]
    calls: int = 0

    def lookup(self, path, x):
        keys = path_keys(path)
        # nn.map_variables hands over {"params": {...}}: the collection name is dropped.
        for start in range(len(keys)):
            if (keys[start:], tuple(x.shape)) in self.dims:
                return self.dims[(keys[start:], tuple(x.shape))]
        known = sorted("/".join(map(str, p)) + str(s) for p, s in self.dims)
        raise ValueError(
            f"gather_layer got a leaf at {jax.tree_util.keystr(tuple(path))} with local shape "
            f"{tuple(x.shape)} that is not a layer of the stacks {self.layers}; per layer "
            f"it knows {known[:8]}. Apply gather_layer to one scanned layer's variables "
            f"(nn.map_variables(Block, 'params', trans_in_fn=jaxzero.gather_layer))."
        )


def build_plan(comm: Comm, layers: tuple[str, ...], local_params, specs) -> LayerPlan:
    """The :class:`LayerPlan` of a per-layer stage-3 step: for each leaf of one layer (a leaf
    of a ``layers`` stack without its layer axis), the dimension it is sharded on."""
    flat_specs = dict(
        jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]
    )
    dims = {}
    for path, x in jax.tree_util.tree_flatten_with_path(local_params)[0]:
        if not is_stacked(path, layers):
            continue
        keys = path_keys(path)
        start = next(i for i, k in enumerate(keys) if k in layers) + 1
        d = spec_dim(flat_specs[path])
        dims[(keys[start:], tuple(x.shape[1:]))] = None if d is None else d - 1
    return LayerPlan(comm, layers, dims)


def check_layers(params, layers: tuple[str, ...]) -> None:
    """Every name in ``layers`` must be a params subtree of arrays with a layer axis."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for name in layers:
        leaves = [(p, x) for p, x in flat if is_stacked(p, (name,))]
        if not leaves:
            top = list(params) if isinstance(params, dict) else type(params).__name__
            raise ValueError(
                f"ZeRO(layers={layers!r}): params has no subtree named {name!r} "
                f"(top-level keys: {top}); name the nn.scan'd module's params key."
            )
        scalars = [jax.tree_util.keystr(p) for p, x in leaves if not jnp.ndim(x)]
        if scalars:
            raise ValueError(
                f"ZeRO(layers=...): {scalars[:5]} under {name!r} are scalars, not stacked "
                f"per layer; a layer stack's leaves carry the layer index on axis 0."
            )


@contextlib.contextmanager
def layer_plan(plan: LayerPlan | None):
    """Make :func:`gather_layer` gather with ``plan`` while the loss is traced."""
    token = _PLAN.set(plan)
    try:
        yield plan
    finally:
        _PLAN.reset(token)


def _gather_leaf(comm: Comm, x, d):
    """All-gather one shard in the compute dtype; its backward reduces the gradient with
    :func:`~jaxzero.zero.collectives.reduce_leaf` (reduce-scatter over the data axis, or
    all-reduce when the leaf is replicated) and returns it in ``x``'s dtype."""
    dtype = x.dtype

    def forward(x):
        y = x.astype(comm.param_dtype)
        if d is not None:
            y = jax.lax.all_gather(y, comm.axis, axis=d, tiled=True)
        return to_varying(y, comm.batch_axes)

    @jax.custom_vjp
    def gather(x):
        return forward(x)

    def fwd(x):
        return forward(x), None

    def bwd(_, ct):
        return (reduce_leaf(comm, ct, d).astype(dtype),)

    gather.defvjp(fwd, bwd)
    return gather(x)


def gather_layer(variables):
    """Gather one scanned layer's variables (use as ``nn.map_variables(trans_in_fn=...)``).

    Inside a stage-3 train step built with ``ZeRO(layers=...)`` every leaf is all-gathered
    along the dimension ZeRO sharded it on; anywhere else the tree is returned unchanged.
    """
    plan = _PLAN.get()
    if plan is None:
        return variables
    plan.calls += 1
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _gather_leaf(plan.comm, x, plan.lookup(path, x)), variables
    )
