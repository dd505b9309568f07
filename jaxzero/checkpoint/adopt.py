"""Adopting a plain Flax/optax run: its params, optax state and step counter, from memory (a
dict or a Flax ``TrainState``) or from a plain orbax checkpoint, placed into a jaxzero
:class:`~jaxzero.TrainState` so the run continues exactly where it stopped."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.checkpoint.structure import ITEMS, METADATA, STATE, flat_leaves, leaf_name
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.state import TrainState, tree_mismatch
from jaxzero.train.step import TrainStep
from jaxzero.zero import specs as sh

PARAMS, OPT_STATE, STEP = "params", "opt_state", "step"  # Flax TrainState's field names
_TREE_FILE = "_METADATA"  # what orbax writes into every PyTree checkpoint (item) directory
_MANAGER_FILE = "_CHECKPOINT_METADATA"  # what a CheckpointManager step (or a Checkpointer) writes


def is_plain_tree(path) -> bool:
    """Whether ``path`` is one orbax PyTree checkpoint (``StandardCheckpointer``,
    ``PyTreeCheckpointer``, or one item of a ``CheckpointManager`` step)."""
    return (epath.Path(os.fspath(path)) / _TREE_FILE).exists()


def _steps(root: epath.Path) -> list[int]:
    return sorted(
        int(p.name)
        for p in root.iterdir()
        if p.name.isdigit() and p.is_dir() and (p / _MANAGER_FILE).exists()
    )


def _items(step_dir: epath.Path) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir() if p.is_dir() and is_plain_tree(p))


def find_tree(directory, step: int | None = None, item: str | None = None) -> tuple[str, int]:
    """``(tree_dir, manager_step)``: the orbax PyTree checkpoint in ``directory`` (itself, an
    item of a manager step, or of ``step`` / the newest step of a manager directory), and the
    manager step it belongs to (None for a lone checkpoint)."""
    root = epath.Path(os.fspath(directory))
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {os.fspath(root)} does not exist.")
    if is_plain_tree(root):
        return os.fspath(root), None
    manager_step = None
    steps = _steps(root)
    if steps:
        if step is not None and int(step) not in steps:
            raise FileNotFoundError(
                f"step {step} is not a complete step of {os.fspath(root)}; steps: {steps}."
            )
        manager_step = steps[-1] if step is None else int(step)
        root = root / str(manager_step)
    items = _items(root)
    if STATE in items and (root / METADATA).is_dir():
        raise ValueError(
            f"{os.fspath(root)} is a jaxzero checkpoint, not a plain orbax one: restore it "
            f"with jaxzero.checkpoint.restore(directory, zero, params)."
        )
    if item is None and len(items) == 1:
        item = items[0]
    if item is None or item not in items:
        raise FileNotFoundError(
            f"no orbax PyTree checkpoint in {os.fspath(root)}"
            + (f" named {item!r}" if item is not None else "")
            + (f"; its items are {items}: pass item=<one of them>." if items else ".")
        )
    return os.fspath(root / item), manager_step


def describe_plain(directory) -> str | None:
    """The sentence that names ``directory`` as a plain orbax checkpoint and points to
    :func:`adopt`; None when it is not one (or is a jaxzero checkpoint, or a manager)."""
    if isinstance(directory, ocp.CheckpointManager):
        directory = directory.directory
    if not isinstance(directory, str | os.PathLike):
        return None
    root = epath.Path(os.fspath(directory))
    if not root.is_dir():
        return None
    plain = is_plain_tree(root)
    if not plain:
        steps = _steps(root)
        step_dir = root / str(steps[-1]) if steps else root
        items = _items(step_dir) if step_dir.is_dir() else []
        plain = bool(items) and not set(items) & set(ITEMS)
    if not plain:
        return None
    return (
        f" {os.fspath(root)} is a plain orbax checkpoint (saved by ocp.StandardCheckpointer, "
        f"PyTreeCheckpointer or a CheckpointManager without jaxzero), not a jaxzero one: "
        f"continue that run with jaxzero.checkpoint.adopt({os.fspath(root)!r}, step) (a "
        f"TrainStep or ZeRO), which reads its params, opt_state and step."
    )


def _has_leaves(tree) -> bool:
    return bool(jax.tree.leaves(tree))


def _looks_like_key(name: str, tree) -> bool:
    """Whether an entry is a PRNG key (a typed key, raw ``uint32[..., 2]`` data, or named as
    one): what the refusal suggests ``ignore=`` for rather than ``collections=``."""
    if "rng" in name.lower() or "key" in name.lower():
        return True
    leaves = jax.tree.leaves(tree)
    if len(leaves) != 1:
        return False
    dtype, shape = getattr(leaves[0], "dtype", None), tuple(getattr(leaves[0], "shape", ()))
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return jnp.dtype(dtype) == jnp.uint32 and shape[-1:] == (2,)


def check_entries(
    entries: dict, collections: tuple[str, ...], ignore: tuple[str, ...], where: str
) -> None:
    """Refuse the entries of the adopted tree (a Flax ``TrainState``'s fields, a dict's keys,
    a plain checkpoint's top-level entries) other than params, opt_state and step that are
    neither read (``collections=``) nor left behind on purpose (``ignore=``), before anything
    is read or placed: a ``TrainState`` subclass's ``batch_stats`` dropped without a word
    would fail later, inside the loss. ``entries`` maps each name to its tree (arrays or
    orbax metadata); entries without arrays (None) do not count."""
    both = sorted(set(collections) & set(ignore))
    if both:
        raise ValueError(
            f"{both} are both in collections= (read as the model state) and in ignore= (left "
            f"behind): name each entry in one of them."
        )
    present = {k for k, v in entries.items() if k not in (PARAMS, OPT_STATE, STEP)}
    stray = [k for k in ignore if k not in present]
    if stray:
        raise ValueError(
            f"ignore={tuple(ignore)!r} names {stray}, which {where} does not hold (it holds "
            f"{sorted(present)} besides {PARAMS}, {OPT_STATE} and {STEP}): drop them."
        )
    unread = sorted(
        k for k in present if k not in collections and k not in ignore and _has_leaves(entries[k])
    )
    if not unread:
        return
    keys = [k for k in unread if _looks_like_key(k, entries[k])]
    state = [k for k in unread if k not in keys]
    fixes = []
    if state:
        fixes.append(
            f"collections={tuple(sorted({*collections, *state}))!r} reads "
            f"{', '.join(state)} as the model_state of a stateful=True step "
            f"(make_train_step(loss_fn, zero, stateful=True))"
        )
    if keys:
        fixes.append(
            f"ignore={tuple(sorted({*ignore, *keys}))!r} leaves {', '.join(keys)} behind "
            f"(jaxzero's dropout keys come from rng=)"
        )
    raise ValueError(
        f"{where} holds {unread} besides {PARAMS}, {OPT_STATE} and {STEP}, and adopt was not "
        f"told what to do with them: {'; '.join(fixes)}. Name every such entry in collections= "
        f"or ignore= (ignore= leaves any entry behind). Nothing was read."
    )


def _abstract(tree):
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)


def _read_plain(
    path: str, zero: ZeRO, collections: tuple[str, ...], ignore: tuple[str, ...]
) -> dict:
    """``{"params", "opt_state"[, "step"], *collections}`` of a plain orbax PyTree checkpoint
    (the entries in ``ignore`` are not read; any other refused), the optax state in
    ``zero.tx.init``'s structure, each array read straight into its ZeRO shards
    (``collections`` replicated)."""
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path).item_metadata
        stored = getattr(meta, "tree", meta)
        if not isinstance(stored, dict) or PARAMS not in stored or OPT_STATE not in stored:
            keys = sorted(stored) if isinstance(stored, dict) else type(stored).__name__
            raise ValueError(
                f"the orbax checkpoint {path} holds {keys}; adopt reads a tree with "
                f"{PARAMS!r} and {OPT_STATE!r} (and {STEP!r}), as a Flax TrainState or "
                f"{{'params': params, 'opt_state': opt_state, 'step': step}} saves. Restore "
                f"it yourself and call step.init(params, opt_state=..., step=...)."
            )
        missing = [c for c in collections if c not in stored]
        if missing:
            raise ValueError(
                f"the orbax checkpoint {path} has no {missing} to read as the model state; "
                f"it holds {sorted(stored)}."
            )
        check_entries(stored, collections, ignore, f"the orbax checkpoint {path}")
        params = _abstract(stored[PARAMS])
        opt = jax.eval_shape(zero.tx.init, params)
        shapes = lambda t: {
            leaf_name(k): tuple(v.shape) for k, v in flat_leaves(_abstract(t)).items()
        }
        bad = tree_mismatch(shapes(opt), shapes(stored[OPT_STATE]), prefix="opt_state.")
        if bad:
            raise ValueError(
                f"the optax state in {path} does not match the ZeRO's optimizer for its params "
                f"(zero.tx.init(params)): {'; '.join(bad)}. Build the jaxzero ZeRO with the "
                f"same optax transformation the run was saved with; nothing was read."
            )
        mesh = zero.mesh
        shards = lambda t: jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            t,
            sh.named(mesh, zero.shard_specs(t)),
        )
        target = {PARAMS: shards(params), OPT_STATE: shards(opt)}
        replicated = NamedSharding(mesh, P())
        if STEP in stored:
            target[STEP] = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        for c in collections:
            target[c] = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                _abstract(stored[c]),
            )
    restore = ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,  # the entries in ignore= stay unread
    )
    with ocp.PyTreeCheckpointer() as reader:
        return reader.restore(path, args=restore)


def _fields(source) -> dict:
    """A Flax ``TrainState``'s (or any dataclass's) pytree fields by name: its static ones
    (``apply_fn``, ``tx``) are not state. Another object: its params, opt_state and step."""
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        return {
            f.name: getattr(source, f.name)
            for f in dataclasses.fields(source)
            if f.metadata.get("pytree_node", True) and hasattr(source, f.name)
        }
    return {k: getattr(source, k) for k in (PARAMS, OPT_STATE, STEP) if hasattr(source, k)}


def _from_memory(source, collections: tuple[str, ...], ignore: tuple[str, ...]) -> dict:
    tree = source if isinstance(source, dict) else _fields(source)
    missing = [c for c in collections if c not in tree]
    if missing:
        raise ValueError(f"the adopted run has no {missing} to read as the model state.")
    if PARAMS not in tree or OPT_STATE not in tree:
        raise TypeError(
            f"adopt takes a directory, a flax.training.train_state.TrainState, or a dict with "
            f"{PARAMS!r} and {OPT_STATE!r} (and {STEP!r}); got {type(source).__name__}"
            + (f" with keys {sorted(tree)}" if isinstance(source, dict) else "")
            + "."
        )
    what = "the adopted dict" if isinstance(source, dict) else f"the {type(source).__name__}"
    check_entries(tree, collections, ignore, what)
    return tree


def adopt(
    source,
    step_fn: TrainStep | ZeRO,
    *,
    step: int | None = None,
    item: str | None = None,
    train_step: int | None = None,
    collections: tuple[str, ...] = (),
    ignore: tuple[str, ...] = (),
    rng=None,
) -> TrainState:
    """Continue a plain Flax/optax run under jaxzero: its params, optax state and step counter
    placed into a :class:`~jaxzero.TrainState` (``step_fn.init(params, opt_state=...,
    step=...)``), so the next jaxzero step computes what the plain run's next step would.

    Args:
      source: a Flax ``TrainState`` or a dict with ``"params"``, ``"opt_state"`` and
        ``"step"`` in memory; or a plain orbax directory holding that tree: one saved by
        ``ocp.StandardCheckpointer`` / ``PyTreeCheckpointer``, or a ``CheckpointManager``
        directory (or one of its step directories). Orbax reads each array straight into
        its ZeRO shards, the optax state into ``tx.init(params)``'s structure.
      step_fn: the :class:`~jaxzero.TrainStep` (its EMA is created at the params) or the
        ``ZeRO`` to continue with; its optax transformation must be the run's.
      step: a ``CheckpointManager`` directory's step to read (default: the newest).
      item: the manager step's item holding the tree (default: its only one).
      train_step: the step counter when the source holds none (default: the manager step
        for a manager directory), or to override it.
      collections: entries of the tree that are the model's non-trainable state, read as
        ``model_state={name: tree[name]}`` (e.g. ``("batch_stats",)`` from a ``TrainState``
        subclass with a ``batch_stats`` field, for a ``stateful=True`` step).
      ignore: entries of the tree to leave behind (e.g. ``("dropout_rng",)``: jaxzero's
        dropout keys come from ``rng=``). Every entry besides params, opt_state and step
        (a ``TrainState`` subclass's fields) must be in ``collections`` or ``ignore``.
      rng: the key of jaxzero's dropout stream, as for ``init`` (``rng=jax.random.key(0)``).

    Raises:
      ValueError: the optax state does not match the ZeRO's ``tx`` (the paths are named),
        the tree lacks ``params``/``opt_state``, holds entries named in neither
        ``collections`` nor ``ignore`` (they are named, with the argument to pass), no step
        counter is known, or the directory is a jaxzero checkpoint (use
        :func:`jaxzero.checkpoint.restore`). Nothing is read or placed.
      FileNotFoundError: no orbax checkpoint (or no such step / item) in the directory.
    """
    if not isinstance(step_fn, TrainStep | ZeRO):
        raise TypeError(
            f"step_fn must be a jaxzero TrainStep (make_train_step) or a jaxzero.ZeRO, got "
            f"{type(step_fn).__name__}."
        )
    zero = step_fn if isinstance(step_fn, ZeRO) else step_fn.zero
    manager_step = None
    collections = (collections,) if isinstance(collections, str) else tuple(collections)
    ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    if isinstance(source, str | os.PathLike | epath.Path):
        path, manager_step = find_tree(source, step, item)
        tree = _read_plain(path, zero, collections, ignore)
    else:
        tree = _from_memory(source, collections, ignore)
    counter = train_step if train_step is not None else tree.get(STEP, manager_step)
    if counter is None:
        raise ValueError(
            "the adopted run has no step counter (no 'step' in its tree): pass "
            "train_step=<optimizer steps taken> so the schedule, the EMA and the dropout keys "
            "go on from there (train_step=0 starts them afresh)."
        )
    model_state = {c: tree[c] for c in collections} or None
    return step_fn.init(
        tree[PARAMS], opt_state=tree[OPT_STATE], step=counter, model_state=model_state, rng=rng
    )
