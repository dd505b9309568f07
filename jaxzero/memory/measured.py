"""Measurements on real arrays and compiled programs: bytes per device, and a train step's
state bytes, XLA memory stats and collectives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxzero.memory.hlo import collective_bytes


def device_bytes(tree) -> dict[Any, int]:
    """Bytes held on each device by the jax.Arrays in a pytree.

    Sums ``shard.data.nbytes`` over every addressable shard of every leaf, so a
    replicated array counts fully on each device and a sharded one only its
    shard. Leaves that are not jax.Arrays (Python scalars, numpy arrays) live on
    the host and are skipped.

    Args:
        tree: any pytree.

    Returns:
        ``{device: bytes}`` ordered by device id (empty when there are no arrays).
    """
    totals: dict[Any, int] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, jax.Array):
            continue
        if leaf.is_deleted():
            raise ValueError(
                f"array at {jax.tree_util.keystr(path) or 'root'} was deleted "
                "(donated to a jitted call?); measure the state the call returned"
            )
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return dict(sorted(totals.items(), key=lambda kv: kv[0].id))


def max_device_bytes(tree) -> int:
    """Largest per-device byte count of :func:`device_bytes` (0 for no arrays)."""
    return max(device_bytes(tree).values(), default=0)


STATE_FIELDS = ("params", "master", "opt_state", "ema")


def measure(step, state, batch) -> dict[str, Any]:
    """Measure a train step: persistent state bytes, XLA memory stats, collectives.

    Args:
        step: an object with ``step.lower(state, batch)`` returning a
            ``jax.stages.Lowered`` (a jaxzero train step, or any ``jax.jit``-ed fn).
        state: the train state pytree passed to the step (its arrays are measured
            where they are placed now).
        batch: an example batch.

    Returns:
        A dict with
        ``state_bytes`` (max over devices of the whole state),
        ``state_bytes_per_device`` ({device: bytes}),
        ``fields`` ({name: max per-device bytes} for each of params, master,
        opt_state, ema present on the state as attribute or mapping key and not None),
        ``argument_bytes``, ``output_bytes``, ``temp_bytes``, ``alias_bytes``
        (from ``compiled.memory_analysis()``; None where the backend gives none),
        and ``collectives`` (:func:`collective_bytes` of the compiled HLO).
    """
    if not callable(getattr(step, "lower", None)):
        raise TypeError(
            f"measure needs a step with .lower(state, batch), got {step!r}; "
            "wrap a function with jax.jit first"
        )
    compiled = step.lower(state, batch).compile()
    fields = {}
    for name in STATE_FIELDS:
        value = state.get(name) if isinstance(state, Mapping) else getattr(state, name, None)
        if value is not None:
            fields[name] = max_device_bytes(value)
    per_device = device_bytes(state)
    stats = compiled.memory_analysis()
    if isinstance(stats, Sequence):  # some backends return one entry per device
        stats = stats[0] if stats else None
    mem = {
        f"{k}_bytes": getattr(stats, f"{k}_size_in_bytes", None)
        for k in ("argument", "output", "temp", "alias")
    }
    return {
        "state_bytes": max(per_device.values(), default=0),
        "state_bytes_per_device": per_device,
        "fields": fields,
        **mem,
        "collectives": collective_bytes(compiled.as_text()),
    }
