"""The layer stacks' host state packed one row per layer (decision 51's fourth stage).

With ``ZeRO(offload="optimizer", offload_update="deferred")`` at stage 3 per layer, the next
forward's layer loop runs each layer's pending update (:mod:`jaxzero.zero.layers.rows`). Kept
as optax's tree, a layer's state is one host row per state leaf (the master, mu, nu and the
EMA of each stacked parameter), so every layer fetches and writes back a few dozen small
pieces, and XLA:GPU's scheduler puts each one's start beside its done (decision 44: 7% hidden
per leaf, 48% packed in its probe). :class:`PackedRows` keeps this device's shards of those
leaves as one host buffer per dtype, ``[layers, row]``, each row every leaf's shard of that
layer side by side: a layer's state is one fetch and one write-back per dtype.

The buffers are a placement detail of a :class:`~jaxzero.train.state.PendingState`: the step
that leaves an update pending packs them, the forward's loop reads and writes their rows, and
:meth:`jaxzero.TrainStep.flush` (or a step that runs the rows before its forward) unpacks them
into optax's tree. Each buffer is global ``[layers, devices x row]`` in
``PartitionSpec(None, axes)``: device ``d``'s columns are its own row, whatever the leaves'
own specs, so the rows never cross devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxzero.mesh import to_varying

__all__ = ["PackedRows"]

DEVICE, HOST = jax.memory.Space.Device, jax.memory.Space.Host


def _axes(spec: P) -> frozenset[str]:
    """The mesh axes a PartitionSpec splits over."""
    out = set()
    for entry in spec:
        out.update((entry,) if isinstance(entry, str) else (entry or ()))
    return frozenset(out)


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """How a layer stack's host state leaves sit in packed rows.

    Attributes:
      mesh: the mesh the leaves are sharded over.
      axes: the mesh axes every leaf's shards vary over (the buffers' columns' axes).
      layers: the stacks' first (layer) dimension.
      shapes: each leaf's shard of one layer (its local shape without the layer dimension).
      dtypes: each leaf's dtype.
      groups: the indices of the leaves each dtype's buffers pack (in leaf order).
      stacks: buffers per group: 2 keeps the even layers' rows and the odd layers' apart
        (decision 44: a fetch of layer ``i + 1``'s row then never waits for the write-back of
        layer ``i``'s into the same buffer), 1 keeps them in one.
    """

    mesh: Any
    axes: tuple[str, ...]
    layers: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    groups: tuple[tuple[int, ...], ...]
    stacks: int = 2

    @classmethod
    def of(cls, mesh, leaves, specs) -> PackedRows | None:
        """The packing of ``leaves`` (global arrays or ShapeDtypeStructs of one layer
        count, split by ``specs`` over ``mesh``); None when there is nothing to pack or the
        leaves' shards vary over different mesh axes (their rows would not be one device's)."""
        leaves = list(leaves)
        if not leaves:
            return None
        axes = {_axes(s) for s in specs}
        (layers,) = {x.shape[0] for x in leaves}
        if len(axes) != 1 or any(_axes(s) & _axes(P(s[0])) for s in specs if len(s)):
            return None  # mixed axes, or a stack split along its layers
        local = [
            NamedSharding(mesh, s).shard_shape(x.shape) for x, s in zip(leaves, specs, strict=True)
        ]
        dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
        groups = {}
        for k, d in enumerate(dtypes):
            groups.setdefault(d, []).append(k)
        return cls(
            mesh=mesh,
            axes=tuple(sorted(next(iter(axes)))),
            layers=layers,
            shapes=tuple(tuple(s[1:]) for s in local),
            dtypes=dtypes,
            groups=tuple(tuple(g) for g in groups.values()),
            stacks=min(2, layers),
        )

    @property
    def spec(self) -> P:
        """Each buffer's PartitionSpec: its columns split over :attr:`axes`."""
        return P(None, self.axes or None)

    def _devices(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def _width(self, group) -> int:
        return sum(math.prod(self.shapes[k]) for k in group)

    def _rows(self, parity: int) -> int:
        """The layers a buffer of ``parity`` holds (``parity``, ``parity + stacks``, ...)."""
        return (self.layers - parity + self.stacks - 1) // self.stacks

    def _buffers(self, parity: int) -> list[int]:
        """The indices, among the buffers (group by group, ``stacks`` each), of those that
        hold the layers of ``parity``."""
        return [g * self.stacks + parity for g in range(len(self.groups))]

    def avals(self, sharding) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The buffers' global shapes and dtypes, with ``sharding`` (:attr:`spec` in pinned
        host memory, as the placement builds it for this mesh)."""
        return tuple(
            jax.ShapeDtypeStruct(
                (self._rows(p), self._devices() * self._width(g)),
                self.dtypes[g[0]],
                sharding=sharding,
            )
            for g in self.groups
            for p in range(self.stacks)
        )

    def row(self, packed, i, parity: int = 0) -> list:
        """Layer ``i``'s row of every leaf, ``[1, *shape]``, fetched to the device with one
        copy per group (``packed``: this device's buffers, inside ``shard_map``; ``parity``:
        ``i % stacks``, known while tracing, which buffers hold it)."""
        out = [None] * len(self.shapes)
        for g, b in zip(self.groups, self._buffers(parity), strict=True):
            buf = packed[b]
            at = i // self.stacks
            row = jax.lax.dynamic_slice_in_dim(buf, at, 1, 0, allow_negative_indices=False)
            row = jax.device_put(row, DEVICE)
            at = 0
            for k in g:
                n = math.prod(self.shapes[k])
                out[k] = row[:, at : at + n].reshape((1, *self.shapes[k]))
                at += n
        return out

    def put(self, packed, i, layers, parity: int = 0) -> list:
        """``packed`` with the rows of layers ``i``, ``i + stacks``, ... written back, with
        one copy per group: ``layers`` holds each layer's row of every leaf (``[1, *shape]``
        on the device), consecutive rows of their buffers."""
        out = list(packed)
        for g, b in zip(self.groups, self._buffers(parity), strict=True):
            row = jnp.concatenate(
                [
                    jnp.concatenate([r[k].reshape(1, -1).astype(out[b].dtype) for k in g], 1)
                    for r in layers
                ],
                0,
            )
            row = jax.device_put(row, HOST)
            out[b] = jax.lax.dynamic_update_slice_in_dim(
                out[b], row, i // self.stacks, 0, allow_negative_indices=False
            )
        return out

    def pack(self, leaves) -> list:
        """This device's shards ``leaves`` (in host memory) as packed buffers, a layer at a
        time through the device (inside ``shard_map``)."""
        zeros = lambda g, p: jnp.zeros((self._rows(p), self._width(g)), self.dtypes[g[0]])
        bufs = [
            jax.device_put(to_varying(zeros(g, p), self.axes), HOST)
            for g in self.groups
            for p in range(self.stacks)
        ]
        for p in range(self.stacks):

            def body(r, bufs, p=p):
                i = r * self.stacks + p
                rows = [
                    jax.device_put(jax.lax.dynamic_slice_in_dim(x, i, 1, 0), DEVICE) for x in leaves
                ]
                return self.put(bufs, i, [rows], p)

            bufs = jax.lax.fori_loop(0, self._rows(p), body, bufs)
        return bufs

    def unpack(self, packed, leaves) -> list:
        """``leaves`` (this device's shards in host memory, their buffers reused) with the
        rows of ``packed`` written into them, a layer at a time (inside ``shard_map``)."""
        out = list(leaves)
        for p in range(self.stacks):

            def body(r, out, p=p):
                i = r * self.stacks + p
                rows = self.row(packed, i, p)
                return [
                    jax.lax.dynamic_update_slice_in_dim(x, jax.device_put(y, HOST), i, 0)
                    for x, y in zip(out, rows, strict=True)
                ]

            out = jax.lax.fori_loop(0, self._rows(p), body, out)
        return out

    def packed(self, leaves, specs) -> tuple:
        """:meth:`pack` of the global host arrays ``leaves`` (split by ``specs``) under
        jit's sharding."""
        spec = self.spec
        return jax.shard_map(
            lambda *xs: tuple(self.pack(list(xs))),
            mesh=self.mesh,
            in_specs=tuple(specs),
            out_specs=(spec,) * (len(self.groups) * self.stacks),
        )(*leaves)

    def unpacked(self, packed, leaves, specs) -> list:
        """:meth:`unpack` of the global ``packed`` into the global host arrays ``leaves``
        (split by ``specs``) under jit's sharding."""
        n = len(self.groups) * self.stacks
        return jax.shard_map(
            lambda *xs: tuple(self.unpack(xs[:n], xs[n:])),
            mesh=self.mesh,
            in_specs=(*(self.spec,) * n, *specs),
            out_specs=tuple(specs),
        )(*packed, *leaves)
