"""How ZeRO's collectives encode what they move: :class:`Wire`, asked by every stage-3
weight gather and every gradient reduce-scatter (ZeRO++'s qwZ and qgZ, opt-in).

A :class:`Wire` holds two codecs, one for the weights' all-gathers and one for the
gradients' reduce-scatters. :class:`Exact` is the plain collective in the array's own dtype;
:class:`Blockwise` moves int8 (or packed int4) blocks with one float32 scale each
(:mod:`jaxzero.zero.wire.quantize`):

* **gather** (qwZ): each device quantizes its shard, all-gathers the payload and the scales,
  and dequantizes every device's shard to the shard's dtype on arrival. The master is never
  quantized; only the gathered compute copy is.
* **reduce-scatter** (qgZ): each device cuts its gradient into the N tiles of the
  reduce-scatter, quantizes each tile, sends tile ``j`` to device ``j`` with one
  ``all_to_all``, then dequantizes the N tiles it received and sums them in float32. Each
  device's tile of the sum is off by at most ``sum_i max|g_i| / (2 qmax)`` per block (device
  ``i``'s block maximum), against a single rounding of the exact reduce-scatter.
* **all-reduce** over a hybrid mesh's replica axes (qgZ's second hop): each device's summed
  shard requantized, all-gathered over those axes, dequantized and summed in float32.

Each moves ``blocks(...).bytes`` per shard or tile (:func:`tile_bytes`) where the exact
collective moves ``size * itemsize``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxzero.trees import path_strs
from jaxzero.zero.specs import spec_dim
from jaxzero.zero.wire.quantize import BITS, MAX_BLOCK, blocks, dequantize, quantize


@dataclasses.dataclass(frozen=True)
class Exact:
    """The plain collectives, in the dtype of what they move."""

    bits = None

    def gather(self, x, axis: str, d: int):
        """``x`` all-gathered along dimension ``d`` over ``axis`` (tiled)."""
        return jax.lax.all_gather(x, axis, axis=d, tiled=True)

    def reduce_scatter(self, g, axis: str, d: int):
        """``g`` summed over ``axis``, this device's tile along ``d`` kept."""
        return jax.lax.psum_scatter(g, axis, scatter_dimension=d, tiled=True)

    def reduce_scatter_many(self, gs: list, axis: str, dims: list[int]) -> list:
        """:meth:`reduce_scatter` of each of ``gs`` (XLA's combiners merge them as they see
        fit)."""
        return [self.reduce_scatter(g, axis, d) for g, d in zip(gs, dims, strict=True)]

    def all_reduce(self, g, axes: tuple[str, ...]):
        """``g`` summed over ``axes`` (a hybrid mesh's replica axes)."""
        return jax.lax.psum(g, axes)


@dataclasses.dataclass(frozen=True)
class Blockwise:
    """Symmetric blockwise ``bits``-bit integers with a float32 scale per block of at most
    ``max_block`` values (:func:`jaxzero.zero.wire.quantize.quantize`)."""

    bits: int = 8
    max_block: int = MAX_BLOCK

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"Blockwise(bits={self.bits!r}): use one of {BITS}.")
        m = self.max_block
        if isinstance(m, bool) or not isinstance(m, int) or m < 2:
            raise ValueError(f"max_block={m!r} must be an int >= 2 (values per block).")

    def gather(self, x, axis: str, d: int):
        """``x`` all-gathered along ``d`` as int payload + scales, dequantized to ``x.dtype``."""
        flat = x.reshape(-1)
        q, s = quantize(flat, self.bits, self.max_block)
        q = jax.lax.all_gather(q, axis)  # [N, payload]: int8
        s = jax.lax.all_gather(s, axis)  # [N, groups]: float32
        y = dequantize(q, s, flat.size, self.bits, x.dtype).reshape((q.shape[0],) + x.shape)
        y = jnp.moveaxis(y, 0, d)  # [..., N, x.shape[d], ...]
        return y.reshape(x.shape[:d] + (-1,) + x.shape[d + 1 :])

    def reduce_scatter(self, g, axis: str, d: int):
        """``g``'s N tiles along ``d`` quantized, exchanged with one ``all_to_all`` and
        summed in float32 after dequantizing; this device's tile, in ``g.dtype``."""
        return self.reduce_scatter_many([g], axis, [d])[0]

    def reduce_scatter_many(self, gs: list, axis: str, dims: list[int]) -> list:
        """:meth:`reduce_scatter` of each of ``gs`` along its ``dims`` entry, every leaf's
        int payload and scales (bitcast to int8) sent in ONE ``all_to_all``: XLA:GPU keeps
        one all-to-all in flight at a time, so a layer's dozens of small ones would run one
        after another, each hidden by a sliver of the backward, and hold the next layer's
        gather back (DeepSpeed's qgZ buckets the same way)."""
        n = jax.lax.axis_size(axis)
        rows, plan = [], []
        for g, d in zip(gs, dims, strict=True):
            tiles = jnp.moveaxis(g.reshape(g.shape[:d] + (n, -1) + g.shape[d + 1 :]), d, 0)
            size = tiles[0].size  # tiles: [N, *tile]
            q, s = quantize(tiles.reshape(n, size), self.bits, self.max_block)
            s = jax.lax.bitcast_convert_type(s, jnp.int8).reshape(n, -1)  # [N, groups * 4]
            rows += [q, s]
            plan.append((size, q.shape[1], s.shape[1]))
        got = jax.lax.all_to_all(jnp.concatenate(rows, axis=1), axis, 0, 0, tiled=True)
        out, at = [], 0  # got row i: device i's tiles for me
        for g, d, (size, nq, ns) in zip(gs, dims, plan, strict=True):
            q = got[:, at : at + nq]
            s = jax.lax.bitcast_convert_type(
                got[:, at + nq : at + nq + ns].reshape(n, -1, 4), jnp.float32
            )
            at += nq + ns
            parts = dequantize(q, s, size, self.bits, jnp.float32)
            tile = g.shape[:d] + (g.shape[d] // n,) + g.shape[d + 1 :]
            out.append(jnp.sum(parts, axis=0).reshape(tile).astype(g.dtype))
        # the sums materialised here: else XLA fuses the dequantize-and-sum into every reader
        # (the update's norm, finite check, optax) and keeps each received int8 buffer, N
        # times a tile, alive until the update (+127 MB for 12 units of a 168M GPT at N = 8)
        return [jax.lax.optimization_barrier(x) for x in out]

    def all_reduce(self, g, axes: tuple[str, ...]):
        """``g`` summed over ``axes``, the second hop on a hybrid mesh: each device's ``g``
        quantized and all-gathered over ``axes``, then dequantized and summed in float32 in
        the axes' device order, so every device holds the same sum (replica-invariant)."""
        flat = g.reshape(-1)
        q, s = quantize(flat, self.bits, self.max_block)
        q = jax.lax.all_gather(q, axes, to="invarying")  # [R, payload]
        s = jax.lax.all_gather(s, axes, to="invarying")
        parts = dequantize(q, s, flat.size, self.bits, jnp.float32)
        return jnp.sum(parts, axis=0).reshape(g.shape).astype(g.dtype)


QUANTIZE = ("weights", "grads", "both")


@dataclasses.dataclass(frozen=True)
class Wire:
    """The encoding of ZeRO's collectives: ``weights`` for the stage-3 all-gathers,
    ``grads`` for the stage-2/3 reduce-scatters (each :class:`Exact` or :class:`Blockwise`).

    ``Wire.create(weights=8, grads=4)`` builds one from bit widths (None: exact).
    """

    weights: Exact | Blockwise = Exact()
    grads: Exact | Blockwise = Exact()
    hpz: int | None = None

    def __post_init__(self):
        g = self.hpz
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 2):
            raise ValueError(
                f"Wire(hpz={g!r}): hpz is the number of devices per node that hold the "
                f"secondary bf16 copy (DeepSpeed's zero_hpz_partition_size); use an int >= 2, "
                f"or None (1) for no secondary copy."
            )

    @classmethod
    def create(
        cls,
        weights: int | None = None,
        grads: int | None = None,
        max_block=MAX_BLOCK,
        hpz: int | None = None,
    ):
        for name, bits, allowed in (("weights", weights, (8,)), ("grads", grads, BITS)):
            if bits is not None and bits not in allowed:
                raise ValueError(
                    f"Wire.create({name}={bits!r}): {name} move as int"
                    f"{' or int'.join(map(str, allowed))} blocks; use {name}="
                    f"{' or '.join(map(str, allowed))}, or None for the exact collective."
                )
        codec = lambda bits: Exact() if bits is None else Blockwise(bits, max_block)
        return cls(codec(weights), codec(grads), None if hpz == 1 else hpz)

    def gather(self, x, axis: str, d: int):
        return self.weights.gather(x, axis, d)

    def keep(self, full, axis: str, d: int | None):
        """What a layer's forward keeps of its gathered leaf ``full`` for the backward's
        gather (hpZ): this device's 1/G slice along ``d`` of its node's G slices (device
        ``j`` keeps slice ``j mod G``); None without ``hpz`` or for a replicated leaf (the
        backward re-gathers the primary shard)."""
        if self.hpz is None or d is None:
            return None
        size = full.shape[d] // self.hpz
        start = jax.lax.axis_index(axis) % self.hpz * size
        return jax.lax.dynamic_slice_in_dim(full, start, size, axis=d)

    def regather(self, x, axis: str, d: int, kept: bool = False):
        """A layer leaf gathered along ``d``: ``x`` the primary shard, on the weights codec
        over all N; or, ``kept``, :meth:`keep`'s slice all-gathered within each node
        (replica groups of G consecutive devices along ``axis``), exact in its dtype."""
        if not kept:
            return self.gather(x, axis, d)
        n = jax.lax.axis_size(axis)
        nodes = [list(range(k, k + self.hpz)) for k in range(0, n, self.hpz)]
        return jax.lax.all_gather(x, axis, axis=d, tiled=True, axis_index_groups=nodes)

    @property
    def defers_reduce(self) -> bool:
        """Whether a layer loop must move each layer's gradient reduction into the next
        iteration itself: XLA's collective pipeliner moves a reduce-scatter, not qgZ's
        all-to-all (:func:`jaxzero.scan_layers`)."""
        return not isinstance(self.grads, Exact)

    def reduce_scatter_many(self, gs: list, axis: str, dims: list[int]) -> list:
        return self.grads.reduce_scatter_many(gs, axis, dims)

    def all_reduce(self, g, axes: tuple[str, ...]):
        return self.grads.all_reduce(g, axes)


def leaf_columns(wire: Wire, rows, split) -> list[dict]:
    """The per-leaf plan's ``wire`` column (:mod:`jaxzero.zero.plan`): the encoding of each
    row's all-gather (a sharded leaf gathered at stage 3) and of its gradient's reduction (a
    sharded gradient reduce-scattered), ``"gather/reduce"`` where they differ; a leaf with no
    dimension to split stays exact (its gradient is all-reduced). ``split``: per row, whether
    the sharding rule splits its compute params and its reduced gradient (the plan's
    ``param_spec`` and ``grad_spec``)."""
    name = lambda codec: "exact" if codec.bits is None else f"int{codec.bits}"
    out = []
    for row, (params_split, grad_split) in zip(rows, split, strict=True):
        gathers = row["gather"] not in ("none", "invariant", "vocab_rows")
        gathered = gathers and params_split
        scattered = row["reduce"] != "complete" and grad_split
        g = name(wire.weights) if gathered else "exact"
        r = name(wire.grads) if scattered and row["reduce"] != "all_reduce" else "exact"
        text = g if g == r else f"{g}/{r}"
        if wire.hpz is not None and row["gather"] == "per_layer" and gathered:
            text += f"+hpZ{wire.hpz}"
        out.append({} if text == "exact" else {"wire": text})
    return out


def wire(quantize, hpz: int | None = None) -> Wire:
    """The :class:`Wire` of ``ZeRO(quantize=..., hpz_partition_size=...)``: ``quantize`` None
    (exact), ``"weights"`` (int8 gathers), ``"grads"`` (int8 reduce-scatters), ``"both"``,
    or a :class:`Wire`; ``hpz`` (None or 1: off) sets its :attr:`Wire.hpz`."""
    hpz = None if hpz == 1 else hpz
    if isinstance(quantize, Wire):
        if hpz is not None and quantize.hpz not in (None, hpz):
            raise ValueError(
                f"ZeRO(hpz_partition_size={hpz}) and quantize=Wire(hpz={quantize.hpz}) "
                f"disagree; set the node size in one place."
            )
        return quantize if hpz is None else dataclasses.replace(quantize, hpz=hpz)
    return dataclasses.replace(_codecs(quantize), hpz=hpz)


def _codecs(quantize) -> Wire:
    if quantize is None:
        return Wire()
    if quantize not in QUANTIZE:
        raise ValueError(
            f"quantize={quantize!r} is not a quantized-collective option; use None (exact), "
            f"'weights' (int8 weight gathers, stage 3), 'grads' (int8 gradient reductions, "
            f"stages 2-3), 'both', or jaxzero.Wire.create(weights=8, grads=4) for int4 "
            f"gradients."
        )
    return Wire.create(
        weights=8 if quantize in ("weights", "both") else None,
        grads=8 if quantize in ("grads", "both") else None,
    )


def tile_bytes(codec: Exact | Blockwise, size: int, itemsize: int) -> int:
    """Bytes one device sends per tile of ``size`` values of ``itemsize`` bytes."""
    if codec.bits is None:
        return size * itemsize
    return blocks(size, codec.bits, codec.max_block).bytes


def check(wire: Wire, stage: int) -> Wire:
    """``wire`` where each of its quantized codecs acts at ``stage`` on that mesh; a
    ValueError naming the fix otherwise (an option that would change nothing is refused)."""
    if wire.weights.bits is not None and stage != 3:
        raise ValueError(
            f"ZeRO(quantize=...) quantizes the weight all-gathers, but at stage {stage} the "
            f"params are replicated and never gathered; use stage=3, or quantize='grads' "
            f"(Wire.create(grads=...)) to quantize the gradient reduction only."
        )
    if wire.grads.bits is not None and stage < 2:
        raise ValueError(
            f"ZeRO(quantize=...) quantizes the gradient reduce-scatters, but stage {stage} "
            f"all-reduces whole gradients; use stage=2 or 3, or quantize='weights' at stage 3."
        )
    return wire


def check_hpz(wire: Wire, stage: int, n: int, layers, units) -> None:
    """A ValueError naming the fix where ``wire.hpz`` (G devices per node) would not act:
    only per-layer stage 3 (``layers=`` with :func:`jaxzero.scan_layers`) gathers a layer
    again in the backward; G must divide the data axis size N and be smaller than it."""
    g = wire.hpz
    if g is None:
        return
    problems = []
    if stage != 3 or not layers or units:
        where = f"stage {stage}" if stage != 3 else "units=" if units else "stage 3 without layers="
        problems.append(
            f"it keeps a secondary copy of each layer's gathered weights for the backward's "
            f"gather within a node, but at {where} nothing is gathered again in the backward "
            f"from jaxzero.scan_layers' loop: use stage=3 with layers= and jaxzero.scan_layers"
        )
    if n % g or g >= n:
        sizes = [k for k in range(2, n) if n % k == 0]
        use = f"one of {', '.join(map(str, sizes))}" if sizes else "a mesh of more devices"
        problems.append(
            f"the data axis has N={n} devices, which G={g} "
            f"{'does not divide' if n % g else 'does not split into nodes'}: G is the devices "
            f"per node, a G < N that divides N ({use}: the GPUs per node)"
        )
    if problems:
        raise ValueError(
            f"ZeRO(hpz_partition_size={g}): "
            + "; and ".join(problems)
            + ". Or drop hpz_partition_size."
        )


@dataclasses.dataclass(frozen=True)
class WireReport:
    """What one all-gather of every parameter and one reduction of every gradient move per
    device under a :class:`Wire` (:meth:`jaxzero.ZeRO.quantized_leaves`).

    Attributes:
      gathered: the leaves whose all-gather is quantized.
      reduced: the leaves whose reduce-scatter is quantized.
      fell_back: the leaves whose gradient reduction stays exact under a quantized ``grads``
        codec: no dimension splits N ways, so they are all-reduced, as without it.
      gather_bytes: each device's all-gather results (N encoded shards of every sharded
        leaf) on this wire: what :mod:`jaxzero.gpu`'s HLO reader counts as the payload.
      exact_gather_bytes: the same in ``param_dtype``.
      reduce_bytes: each device's gradient reduction inputs on this wire (quantized: the
        ``all_to_all``'s N encoded tiles of every sharded leaf), as the HLO reader counts them.
      exact_reduce_bytes: the reduce-scatter's inputs in ``reduce_dtype`` (the whole local
        gradient of every sharded leaf).
    """

    gathered: tuple[str, ...]
    reduced: tuple[str, ...]
    fell_back: tuple[str, ...]
    gather_bytes: int
    exact_gather_bytes: int
    reduce_bytes: int
    exact_reduce_bytes: int


def report(wire: Wire, params, specs, n: int, param_itemsize: int, reduce_itemsize: int):
    """The :class:`WireReport` of ``params`` (arrays or shape structs, global shapes) whose
    gradients are sharded by ``specs`` over ``n`` devices."""
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))
    gathered, reduced, fell_back, sizes = [], [], [], [0, 0, 0, 0]
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), spec in zip(leaves, flat_specs, strict=True):
        name, d = "/".join(path_strs(path)), spec_dim(spec)
        if d is None:
            fell_back += [name] if wire.grads.bits is not None else []
            continue
        tile = math.prod(x.shape) // n
        sizes[0] += n * tile_bytes(wire.weights, tile, param_itemsize)
        sizes[1] += n * tile * param_itemsize
        sizes[2] += n * tile_bytes(wire.grads, tile, reduce_itemsize)
        sizes[3] += n * tile * reduce_itemsize
        gathered += [name] if wire.weights.bits is not None else []
        reduced += [name] if wire.grads.bits is not None else []
    return WireReport(tuple(gathered), tuple(reduced), tuple(fell_back), *sizes)
