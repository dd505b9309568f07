"""Offload to host memory: which state lives in pinned host memory, its shardings, and where
its update runs (decision 32).

``ZeRO(offload="optimizer")`` keeps the fp32 master (when separate from the compute params),
the optimizer state and the EMA in the host memory of each device (``memory_kind=
"pinned_host"``), in the same shards as without offload. The optax and EMA updates run on the
host (``compute_on("device_host")`` around a ``jax.jit`` of the update), so the device never
holds the state: it sends the reduced gradient shards to the host and gets the new compute
params (``param_dtype``) back.

Two traps of jax 0.10 are handled here. Compile-only devices (``jaxzero.gpu``) report no
memories, and a ``NamedSharding`` on their concrete mesh silently drops ``memory_kind``: host
shardings for them are built on ``mesh.abstract_mesh`` (lower under ``jax.set_mesh(mesh)``,
as :func:`jaxzero.gpu.compile_report` does), and every host sharding is checked to carry
``"pinned_host"`` before it is used.
"""

from __future__ import annotations

import contextlib
import math

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero._compat import compute_on_host

OFFLOADS = ("optimizer",)
HOST = "pinned_host"


def check_offload(offload, stage: int) -> str | None:
    """``offload`` checked against ``stage``: None or ``"optimizer"``."""
    if offload is None:
        return None
    if offload not in OFFLOADS:
        hint = ""
        if offload in ("params", "param", "optimizer+params"):
            hint = (
                " Parameter offload (DeepSpeed's offload_param) is not built; offload the "
                "optimizer (offload='optimizer') and use stage 3 to shard the parameters."
            )
        raise ValueError(
            f"offload={offload!r} is not supported; use None (state in device memory) or "
            f"'optimizer' (fp32 master, optimizer state and EMA in pinned host memory, "
            f"updated on the host: DeepSpeed's offload_optimizer).{hint}"
        )
    if stage == 0:
        raise ValueError(
            "offload='optimizer' needs stage 1, 2 or 3 (got stage=0): at stage 0 every device "
            "holds the whole optimizer state and would update all of it on its host. Use "
            "stage=1 (same communication as stage 0, the state sharded 1/N) with offload."
        )
    return offload


def check(offload, stage: int, mesh: Mesh) -> None:
    """:func:`check_offload`, then :func:`check_platform` when offloading."""
    if check_offload(offload, stage):
        check_platform(mesh)


def memory_kinds(mesh: Mesh) -> tuple[str, ...]:
    """The memory kinds the mesh's first device addresses (empty for compile-only devices,
    which report none)."""
    return tuple(m.kind for m in mesh.devices.flat[0].addressable_memories())


def check_platform(mesh: Mesh) -> None:
    """Refuse a mesh whose devices have memories but no pinned host memory."""
    kinds = memory_kinds(mesh)
    if kinds and HOST not in kinds:
        platform = mesh.devices.flat[0].platform
        raise ValueError(
            f"offload='optimizer' needs {HOST!r} memory, and the {platform} devices of this "
            f"mesh address only {', '.join(kinds)}; train without offload (offload=None), "
            f"or on GPUs/CPUs, which have pinned host memory."
        )


def host_sharding(mesh: Mesh, spec: P) -> NamedSharding:
    """``NamedSharding(mesh, spec, memory_kind="pinned_host")``, on ``mesh.abstract_mesh`` for
    compile-only devices (whose concrete mesh drops the memory kind).

    Raises:
      ValueError: the sharding came back without ``"pinned_host"`` (the platform dropped it).
    """
    s = NamedSharding(mesh, spec, memory_kind=HOST)
    if s.memory_kind != HOST and not memory_kinds(mesh):
        s = NamedSharding(mesh.abstract_mesh, spec, memory_kind=HOST)
    if s.memory_kind != HOST:
        raise ValueError(
            f"asked for memory_kind={HOST!r} on the {mesh.devices.flat[0].platform} mesh and "
            f"got memory_kind={s.memory_kind!r}: this jax/platform silently drops host memory "
            f"kinds, so offloaded state would stay in device memory. Train without offload "
            f"(offload=None), or report the platform and jax version."
        )
    return s


def host_shardings(mesh: Mesh, specs):
    """A tree of PartitionSpecs mapped to checked host shardings (:func:`host_sharding`)."""
    return jax.tree.map(lambda s: host_sharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def to_host(tree, shardings):
    """``tree`` moved (inside jit) to its host shardings."""
    return jax.device_put(tree, shardings)


def to_device(tree):
    """``tree`` moved (inside jit) to device memory, in the same shardings."""
    return jax.device_put(tree, jax.memory.Space.Device)


def on_host(fn):
    """``fn`` jitted to run on the devices' hosts (``compute_on("device_host")``)."""
    return compute_on_host(jax.jit(fn))


def offloaded_bytes(state) -> int:
    """Bytes per device of what ``offload="optimizer"`` keeps in host memory: the master, the
    optimizer state and the EMA of ``state`` (a TrainState of arrays or ShapeDtypeStructs
    with shardings), whatever memory kind they were given."""
    total = 0
    for x in jax.tree.leaves((state.master, state.opt_state, state.ema)):
        total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def lowering(mesh: Mesh, offload):
    """The context to lower a step in: ``jax.set_mesh(mesh)`` where it offloads and its host
    shardings live on the abstract mesh (compile-only devices), else a no-op."""
    abstract = offload and not memory_kinds(mesh)
    return jax.set_mesh(mesh) if abstract else contextlib.nullcontext()
