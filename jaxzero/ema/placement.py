"""Where the EMA lives and how it is updated there: in the master weights' shards, by a
``shard_map`` in which each device updates only its own piece (no collective). The functions
taking a ``zero`` read the placement from its config (:class:`~jaxzero.zero.config.ZeROConfig`)."""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxzero.ema import storage
from jaxzero.ema.ema import EmaState, ShardedEMA, check_same_tree
from jaxzero.zero.config import ZeROConfig
from jaxzero.zero.specs import spec_dim


def specs(zero: ZeROConfig, ema_tree):
    """Specs of an EMA tree in its storage (per leaf, or bucketed ``[N, L_g]`` rows)."""
    return storage.specs(ema_tree, zero.ema_leaf_specs, zero.axis)


def leaf_storage(zero: ZeROConfig, ema: ShardedEMA, params) -> list[str]:
    """The per-leaf plan's ``ema`` column (:mod:`jaxzero.zero.plan`): per params leaf, whether
    ``ema`` keeps it in bucketed ``"rows"`` or ``"per_leaf"`` on ``zero``'s mesh and stage."""
    limit = storage.resolve(ema.bucket_leaves_up_to, zero.mesh, zero.stage, zero.offload)
    layout = storage.plan(params, zero.mesh, zero.axis, limit, zero.ema_leaf_specs(params))
    rows = layout.rows if layout is not None else [None] * len(jax.tree.leaves(params))
    return ["per_leaf" if r is None else "rows" for r in rows]


def bucket(zero: ZeROConfig, ema: ShardedEMA, ema_state: EmaState) -> EmaState:
    """``ema_state`` in ``ema``'s storage for ``zero``'s mesh and stage (local, no
    communication); the inverse is :func:`jaxzero.unbucket_ema`."""
    if zero.offload and ema.bucket_leaves_up_to not in (None, 0):
        raise ValueError(
            f"ShardedEMA(bucket_leaves_up_to={ema.bucket_leaves_up_to!r}) with "
            f"ZeRO(offload={zero.offload!r}): the offloaded update streams each leaf's EMA "
            f"beside its master a chunk at a time, and rows would join every leaf they hold "
            f"into one fetch. Leave bucket_leaves_up_to=None (per leaf with offload)."
        )
    limit = storage.resolve(ema.bucket_leaves_up_to, zero.mesh, zero.stage, zero.offload)
    where = (zero.mesh, zero.axis, limit, zero.stage, zero.ema_leaf_specs)
    return storage.store(ema_state, *where)


def update_on_shards(
    zero: ZeROConfig, ema: ShardedEMA, ema_state: EmaState, master, *, step, apply
):
    """:func:`update` on ``zero``'s shards: the master's (``master`` as it is placed, with
    the replicated model state when the EMA also averages it)."""
    master_specs = zero.shard_specs(master)
    if isinstance(master, dict) and set(master) == {"params", "model_state"}:
        master_specs = {
            "params": zero.shard_specs(master["params"]),
            "model_state": jax.tree.map(lambda _: P(), master["model_state"]),
        }
    return update(
        ema,
        ema_state,
        master,
        mesh=zero.mesh,
        axis=zero.axis,
        master_specs=master_specs,
        leaf_specs=zero.ema_leaf_specs(master),
        per_leaf_specs=zero.ema_leaf_specs,
        step=step,
        apply=apply,
    )


def state_specs(ema_state: EmaState, per_leaf_specs, axis: str) -> EmaState:
    """The specs of an :class:`EmaState` in its storage (``per_leaf_specs(tree)`` gives the
    per-leaf rule's specs of a tree)."""
    return EmaState(P(), storage.specs(ema_state.ema, per_leaf_specs, axis))


def update(
    ema: ShardedEMA,
    ema_state: EmaState,
    master,
    *,
    mesh: Mesh,
    axis: str,
    master_specs,
    leaf_specs,
    per_leaf_specs,
    step,
    apply,
):
    """The EMA update as a ``shard_map`` over the EMA's shards: provably local.

    Each device updates only its own EMA shard from its own master piece; where the master
    leaf is replicated (stage 0) it slices its part out of the local replica. A bucketed EMA
    concatenates the device's pieces of the small leaves into one row and updates its bucket
    row in one elementwise loop; the big leaves are updated per leaf as usual.

    Args:
      master_specs: the specs of ``master`` as it is placed (replicated leaves at stage 0).
      leaf_specs: the per-leaf rule's specs of ``master`` (where each EMA leaf is sharded).
      per_leaf_specs: the per-leaf rule as a function of a tree (for the EMA state's specs).
    """
    check_same_tree(storage.to_per_leaf(ema_state.ema, abstract=True), master)
    specs = state_specs(ema_state, per_leaf_specs, axis)
    n = mesh.shape[axis]

    def local(e_state, m_local, step, apply):
        def take(x, m_spec, e_spec):
            d = spec_dim(e_spec)
            if d is None or spec_dim(m_spec) is not None:
                return x
            # Index the device's block (no index * size arithmetic, no negative-index select):
            # XLA:GPU then fuses every block into its bucket row's kernel (decision 19).
            blocks = x.reshape(x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1 :])
            i = jax.lax.axis_index(axis)
            return jax.lax.dynamic_index_in_dim(blocks, i, d, False, allow_negative_indices=False)

        mine = jax.tree.map(take, m_local, master_specs, leaf_specs)
        mine = storage.pack_like(mine, e_state.ema)
        return ema.update(e_state, mine, step=step, apply=apply)

    with jax.named_scope("ema_update"):
        return jax.shard_map(
            local, mesh=mesh, in_specs=(specs, master_specs, P(), P()), out_specs=specs
        )(ema_state, master, step, apply)
