"""What a pmap program leaves in a port to jaxzero, named with the fix: params replicated by
``jax_utils.replicate`` (a leading axis of N copies on every leaf) and a batch split by
``shard(batch)`` (a leading device axis, ``[N, B/N, ...]``). jaxzero takes the global params
and the global batch; each check fires only where the pattern is certain (identical copies) or
where the loss has already failed on those shapes, so a legitimate leading dimension of N is
never refused."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxzero.trees import leaves_by_keystr

FIX_PARAMS = (
    "remove the pmap axis: pass the unreplicated params (jax_utils.unreplicate(params), or "
    "the params before jax_utils.replicate); jaxzero places one copy (or its shards) itself"
)
FIX_BATCH = (
    "remove the pmap axis: pass the global batch [B, ...] (not shard(batch)), e.g. "
    "batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch); jaxzero splits it "
    "over the devices itself"
)


def _lead_all(tree, n: int, min_ndim: int) -> bool:
    leaves = [x for _, x in leaves_by_keystr(tree)]
    return bool(leaves) and all(
        jnp.ndim(x) >= min_ndim and jnp.shape(x)[0] == n and n > 1 for x in leaves
    )


@jax.jit
def _all_copies(tree):
    return jnp.all(jnp.stack([jnp.all(x == x[:1]) for x in jax.tree.leaves(tree)]))


def check_not_replicated(params, n: int) -> None:
    """Raise ValueError when every params leaf is ``n`` identical copies along its first
    axis (``jax_utils.replicate(params)``): a model's own leaves are never all copies."""
    concrete = all(
        isinstance(x, jax.Array | np.ndarray) and not isinstance(x, jax.core.Tracer)
        for x in jax.tree.leaves(params)
    )
    if not concrete or not _lead_all(params, n, 1) or not bool(_all_copies(params)):
        return
    raise ValueError(
        f"every params leaf has a leading axis of {n} identical copies, as pmap's "
        f"jax_utils.replicate(params) makes; {FIX_PARAMS}."
    )


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raised_by_jaxzero(error: BaseException) -> bool:
    """Whether ``error`` was raised by jaxzero's own code (its innermost frame is in the
    package): those errors already name their fix, so no pmap leftover is read into them."""
    tb, last = error.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return last is not None and os.path.abspath(last).startswith(_PACKAGE + os.sep)


def explain(params, batch, n: int) -> str | None:
    """After the loss failed to trace: the message naming the pmap leftovers its shapes show
    (every params leaf, or every batch leaf of rank >= 2, led by an axis of ``n``), or None."""
    found = []
    if _lead_all(params, n, 1):
        found.append(
            f"every params leaf has a leading axis of {n} (the devices), as pmap's "
            f"jax_utils.replicate(params) leaves it: {FIX_PARAMS}"
        )
    if _lead_all(batch, n, 2):
        found.append(
            f"every batch leaf has a leading axis of {n} (the devices), as pmap's "
            f"shard(batch) leaves it ([N, B/N, ...] where the model takes [B, ...]): {FIX_BATCH}"
        )
    if not found:
        return None
    return f"the step failed, and {'; and '.join(found)}. The loss's error is chained above."
