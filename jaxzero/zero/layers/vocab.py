"""Stage 3 with a vocabulary-parallel embedding: the (tied) embedding table stays sharded over
its vocabulary rows in the loss, never gathered (Megatron's ``VocabParallelEmbedding`` and
vocab-parallel cross-entropy, run along the data axis).

With ``ZeRO(stage=3, vocab_parallel="embed")`` the train step hands the loss the table under
``params["embed"]`` as this device's block of ``V / N`` rows (ZeRO already shards a ``[V, H]``
table on its rows when ``V`` is its largest dimension divisible by ``N``) instead of gathering
it, and the model uses it only through:

    embed = jaxzero.VocabParallelEmbed(vocab, width, name="embed")   # params["embed"]["embedding"]
    x = embed(tokens)                                    # [B, S, H], as nn.Embed
    ce = embed.cross_entropy(h, labels)                  # [B, S] per-token f32 cross-entropy

or the functions :func:`vocab_parallel_embed` / :func:`vocab_parallel_cross_entropy` on a table
read with :func:`vocab_table`. Inside such a step:

* the lookup all-gathers the token ids (int32), looks up the rows this device holds for every
  device's tokens (zeros for the others) and reduce-scatters the ``[N B, S, H]`` result back
  to each device's tokens;
* the cross-entropy all-gathers the final activations (``[N B, S, H]``), computes the logits of
  every device's tokens against this device's ``V / N`` rows, and combines the softmax
  statistics across devices (the max: an all-reduce of ``N B S`` floats; the sums and the
  label's logit: reduce-scatters to each device's tokens);
* autodiff gives the transposes: the activations' gradients are reduce-scattered and
  all-gathered, and the table's gradient is complete on every device (all devices' tokens
  went through its rows), so the table is neither all-gathered nor reduce-scattered.

Trade: the table's gather and its gradient's reduction (2 x V H, independent of N) become four
activation collectives of ``N B S H`` each, which grow with N; and no full table or table
gradient is held. On the 8-layer GPT at N = 8 that is 714.8 -> 687.0 MB per device
(below GSPMD-FSDP's 701.7) for the same bytes; at N = 64 it is 531.2 -> 742.7 MB: an opt-in
for small N (BUILD_NOTES decision 26). The numbers are single-device optax's (tests/
test_vocab_parallel.py). Outside such a step (evaluation, ``init``, other stages) both are the
plain computations (``jnp.take``; logits ``h @ table.T`` in f32 and optax's softmax
cross-entropy), so one model serves everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxzero.mesh import to_varying
from jaxzero.trees import path_keys, subtree_names
from jaxzero.zero.collectives import Comm
from jaxzero.zero.hooks import CalledHook, plan_var
from jaxzero.zero.layers.scan import stored_param
from jaxzero.zero.specs import is_stacked, spec_dim, subtree_mask

__all__ = [
    "VocabParallelEmbed",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embed",
    "vocab_table",
]

_PLAN = plan_var("jaxzero_vocab_plan")  # the VocabPlan of the step being traced


_NO_VOCAB_CALL = (
    "ZeRO(stage=3, vocab_parallel={}) hands the loss each embedding table as this device's "
    "vocabulary rows, but the model never used them through jaxzero: build the table with "
    "jaxzero.VocabParallelEmbed (a drop-in for nn.Embed; its cross_entropy method is the tied "
    "head's loss) or read it with jaxzero.vocab_table and use jaxzero.vocab_parallel_embed / "
    "jaxzero.vocab_parallel_cross_entropy, or drop vocab_parallel= to gather it whole."
)


@dataclasses.dataclass
class VocabPlan(CalledHook):
    """The vocabulary-parallel step being traced: its collectives' :class:`Comm`, the local
    shapes of the tables it hands over as shards, and how often the model used them."""

    comm: Comm
    names: tuple[str, ...]
    shapes: frozenset
    calls: int = 0
    var = _PLAN

    def check(self, table, what: str) -> None:
        self.calls += 1
        if tuple(jnp.shape(table)) not in self.shapes:
            raise ValueError(
                f"{what} got a table of shape {tuple(jnp.shape(table))}; inside this "
                f"ZeRO(vocab_parallel={self.names!r}) step the tables are this device's rows, "
                f"of shapes {sorted(self.shapes)}. Pass the table read from params "
                f"(jaxzero.vocab_table or jaxzero.VocabParallelEmbed), not a copy or a slice."
            )

    # -- the CalledHook answer (jaxzero.zero.hooks) --------------------------------------------
    def not_called(self):
        return ValueError(_NO_VOCAB_CALL.format(self.names))


def names(vocab_parallel, stage: int) -> tuple[str, ...]:
    """``ZeRO(vocab_parallel=)`` as a tuple of params subtree names, checked against the
    stage (the table is only sharded at stage 3)."""
    given = subtree_names(
        vocab_parallel,
        f"vocab_parallel={vocab_parallel!r} must name the params subtree of the embedding "
        f"table, e.g. vocab_parallel='embed'.",
    )
    if given and stage != 3:
        raise ValueError(
            f"vocab_parallel={vocab_parallel!r} needs stage=3 (got stage={stage}): only stage "
            f"3 keeps the table sharded; at stages 0-2 every device holds it whole anyway."
        )
    return given


def leaf_columns(paths, vocab_names: tuple[str, ...]) -> list[dict]:
    """The per-leaf plan's columns ``vocab_parallel=`` decides (:mod:`jaxzero.zero.plan`), per
    leaf key path: a table stays rows (never gathered), and its gradient comes back summed
    over the data axis by the collectives' transposes (complete)."""
    tables = {"gather": "vocab_rows", "reduce": "complete"}
    return [dict(tables) if is_stacked(k, vocab_names) else {} for k in paths]


def mask(vocab_names: tuple[str, ...], tree):
    """True for the leaves under one of ``vocab_names`` (None when there are none)."""
    return subtree_mask(tree, vocab_names)


def build_plan(comm: Comm, vocab_names: tuple[str, ...], local_params, specs) -> VocabPlan | None:
    """The :class:`VocabPlan` of a step, or None without ``vocab_parallel``. Raises ValueError
    when a named leaf is not a ``[V, H]`` table sharded on its rows."""
    if not vocab_names:
        return None
    flat_specs = dict(jax.tree_util.tree_flatten_with_path(specs)[0])
    every = jax.tree_util.tree_flatten_with_path(local_params)[0]
    found = [(p, x) for p, x in every if is_stacked(p, vocab_names)]
    if not found:
        raise ValueError(
            f"ZeRO(vocab_parallel={vocab_names!r}): params has no leaf under those names; "
            f"its paths look like {[jax.tree_util.keystr(p) for p, _ in every[:4]]}."
        )
    n = jax.lax.axis_size(comm.axis)
    for path, x in found:
        d = spec_dim(flat_specs.get(path))
        if jnp.ndim(x) != 2 or d != 0:
            raise ValueError(
                f"ZeRO(vocab_parallel=...): {'/'.join(map(str, path_keys(path)))} must be a "
                f"[vocab, width] table sharded on its vocabulary rows over the {n} devices of "
                f"the data axis; its local shape is {tuple(x.shape)}, sharded on dimension "
                f"{d}. Pad the vocabulary to a multiple of {n} larger than the width (as "
                f"Megatron's make-vocab-size-divisible-by does)."
            )
    return VocabPlan(comm, vocab_names, frozenset(tuple(x.shape) for _, x in found))


def _offset(comm: Comm, rows: int):
    """This device's first vocabulary row."""
    return jax.lax.axis_index(comm.axis) * rows


def _local_ids(comm: Comm, ids, rows: int):
    """Every device's ``ids`` (all-gathered on the batch dimension) as indices into this
    device's ``rows`` rows, clipped, and whether each falls in them."""
    ids = jax.lax.all_gather(ids, comm.axis, axis=0, tiled=True) - _offset(comm, rows)
    return jnp.clip(ids, 0, rows - 1), (ids >= 0) & (ids < rows)


def vocab_parallel_embed(table, tokens):
    """``jnp.take(table, tokens, axis=0)``: the rows of ``tokens`` (``[B, ...]`` int), computed
    on this device's rows of the table inside a ``ZeRO(vocab_parallel=...)`` step (module
    docstring)."""
    plan = _PLAN.get()
    if plan is None:
        return jnp.take(table, tokens, axis=0)
    plan.check(table, "vocab_parallel_embed")
    comm = plan.comm
    table = table.astype(comm.param_dtype)
    ids, mine = _local_ids(comm, tokens, table.shape[0])
    x = jnp.take(table, ids, axis=0)
    x = jnp.where(mine[..., None], x, jnp.zeros((), x.dtype))
    return jax.lax.psum_scatter(x, comm.axis, scatter_dimension=0, tiled=True)


def vocab_parallel_cross_entropy(h, table, labels):
    """Per-position softmax cross-entropy (float32, ``labels.shape``) of the logits
    ``h @ table.T`` (a tied head: ``h`` is ``[B, ..., H]``, ``table`` ``[V, H]``), as
    ``optax.softmax_cross_entropy_with_integer_labels((h @ table.T).astype(f32), labels)``;
    inside a ``ZeRO(vocab_parallel=...)`` step computed on this device's rows without ever
    forming a device's full logits over the vocabulary (module docstring)."""
    plan = _PLAN.get()
    if plan is None:
        logits = (h @ table.T.astype(h.dtype)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    plan.check(table, "vocab_parallel_cross_entropy")
    comm = plan.comm
    table = table.astype(comm.param_dtype)
    rows, batch = table.shape[0], h.shape[0]
    everyone = jax.lax.all_gather(h, comm.axis, axis=0, tiled=True)
    logits = (everyone @ table.T.astype(everyone.dtype)).astype(jnp.float32)
    # The max only keeps exp() in range; the loss's gradient does not depend on it.
    top = jax.lax.pmax(jax.lax.stop_gradient(logits.max(-1)), comm.axis)
    sums = jnp.exp(logits - top[..., None]).sum(-1)
    ids, mine = _local_ids(comm, labels, rows)
    picked = jnp.take_along_axis(logits, ids[..., None], -1)[..., 0]
    picked = jnp.where(mine, picked, 0.0)
    own = lambda x: jax.lax.psum_scatter(x, comm.axis, scatter_dimension=0, tiled=True)
    top = jax.lax.dynamic_slice_in_dim(top, jax.lax.axis_index(comm.axis) * batch, batch, 0)
    return jnp.log(own(sums)) + top - own(picked)


def vocab_table(module: nn.Module, name: str, shape: tuple[int, int], init):
    """A flax linen ``module``'s ``[V, H]`` table ``params[name]``: created with ``init`` by
    ``init``, read as it is otherwise (``self.param`` would check the stored shape against
    ``shape``, which this device's rows in a vocabulary-parallel step do not match)."""
    return stored_param(module, name, init, tuple(shape))


class VocabParallelEmbed(nn.Module):
    """``nn.Embed`` (same params: ``{"embedding": [num_embeddings, features]}``) whose lookup
    and tied-head cross-entropy run vocabulary-parallel inside a ``ZeRO(stage=3,
    vocab_parallel=<this module's name>)`` step, and plainly everywhere else."""

    num_embeddings: int
    features: int
    dtype: Any = None  # the computation's dtype (as nn.Embed's); None: the table's
    param_dtype: Any = jnp.float32
    embedding_init: nn.initializers.Initializer = nn.linear.default_embed_init

    def setup(self):
        shape = (self.num_embeddings, self.features)
        init = lambda key, shape: self.embedding_init(key, shape, self.param_dtype)
        self.embedding = vocab_table(self, "embedding", shape, init)

    def __call__(self, tokens):
        x = vocab_parallel_embed(self.embedding, tokens)
        return x if self.dtype is None else x.astype(self.dtype)

    def cross_entropy(self, h, labels):
        """Per-position cross-entropy of the tied logits ``h @ embedding.T`` (float32)."""
        h = h if self.dtype is None else h.astype(self.dtype)
        return vocab_parallel_cross_entropy(h, self.embedding, labels)


def either(a, b):
    """The leafwise OR of two boolean masks of one tree (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    return jax.tree.map(lambda x, y: x or y, a, b)


def varying(comm: Comm, tables, full):
    """``full`` with the leaves where ``tables`` is True marked device-varying over every batch
    axis: autodiff then hands back each replica's own table gradient (already summed over the
    data axis by the collectives' transposes), and :func:`~jaxzero.zero.collectives.
    reduce_gradients` sums it over the replica axes in the reduce dtype."""
    if tables is None:
        return full
    return jax.tree.map(lambda t, x: to_varying(x, comm.batch_axes) if t else x, tables, full)
