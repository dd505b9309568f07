"""``plan``: compile the real jaxzero step of a GPT/LLaMA-shaped model for a GPU cluster (no GPU
needed, nothing allocated) and set the GPU compiler's bytes per device next to
:func:`jaxzero.estimate_memory`'s, for every stage.

Its argument checks (:func:`check_loop`, :func:`check_hpz`) are ``jaxzero plan``'s too: each refuses a combination that would not compile or would change
nothing, naming the fix."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxzero import trees
from jaxzero.ema import ShardedEMA
from jaxzero.gpu.models import PYTHON_LOOPS, ModelShape, abstract_params, batch_shapes, make_loss
from jaxzero.gpu.network import WireTime, cross_node_time, stage_quantize, wire_time
from jaxzero.gpu.offload_cost import OffloadCost, offload_cost, update_window
from jaxzero.gpu.offload_fraction import fraction_estimate, limited, or_params, smallest_fraction
from jaxzero.gpu.report import CompileReport, compile_report, steady_state
from jaxzero.gpu.targets import GPU_KINDS
from jaxzero.gpu.topology import gpu_kind_of
from jaxzero.memory import MemoryEstimate, estimate_memory, format_bytes
from jaxzero.memory.estimate import param_bytes
from jaxzero.precision import Precision, with_state_dtype
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.step import make_train_step
from jaxzero.zero.offload import check_offload, params_offloaded
from jaxzero.zero.offload.placement import remainder_master
from jaxzero.zero.wire import Wire, wire

__all__ = [
    "PlanRow",
    "WireTime",
    "cross_node_time",
    "plan",
    "plan_cases",
    "prefetch_advice",
    "row_estimate",
    "stage_quantize",
    "unit_bound",
    "wire_time",
    "zero_options",
]

UNITS = r"block_\d+"  # the unscanned decoder's blocks (jaxzero.gpu.models, loop="python")


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One stage of a plan: the compiled step's figures and the estimator's.

    ``gpu_bytes``: the compiled peak per device (``CompileReport.peak_bytes``);
    ``state_bytes``: the compiled arguments less the batch (the persistent state per device);
    ``estimate``: :func:`jaxzero.estimate_memory` for the same setup (activations with
    ``ckpt_every=1`` and the f32 logits; the per-layer working set for stage 3 per layer).
    With offload, ``report.host_bytes`` and ``estimate.host`` are the host memory's share.
    ``per``: what ``per_layer`` goes by, ``"layer"`` (a scanned stack, ``ZeRO(layers=)``) or
    ``"unit"`` (a Python loop of blocks, ``ZeRO(units=)``); ``prefetch``: a per-unit row's
    ``ZeRO(prefetch=...)`` (None on the other rows); ``hpz``: the per-layer stage-3 row's
    ``ZeRO(hpz_partition_size=...)`` (None on the other rows); ``update``: its
    ``ZeRO(offload_update=...)`` (``"deferred"`` or ``"delayed"``: compiled as a step with an
    update pending, the rows inside the forward's layer loop; ``"delayed"``: the first delayed
    step, whose gradient is taken before that update). ``cost``: with offload, the
    host <-> device bytes of the compiled step and the step time they predict
    (:func:`jaxzero.gpu.offload_cost.offload_cost`; None without offload). ``fraction``: the
    row's ``ZeRO(offload_fraction=...)``, the plan's or the one ``fit_offload`` picked (None:
    not offloaded); ``params_offloaded``: ``fit_offload`` offloaded the params too, as
    nothing less fits. ``zero_options``: the keyword arguments the row's step was compiled
    with, ``ZeRO(tx, mesh, **zero_options)`` (:func:`zero_options`).
    """

    stage: int
    per_layer: bool
    num_params: int
    report: CompileReport
    estimate: MemoryEstimate
    state_bytes: int
    per: str = "layer"
    prefetch: bool | None = None
    hpz: int | None = None
    update: str | None = None
    cost: OffloadCost | None = None
    fraction: float | None = 1.0
    tries: tuple = ()  # fit_offload: every (fraction, compiled peak bytes) it compiled
    params_offloaded: bool = False  # fit_offload: the params too (offload_fraction.or_params)
    zero_options: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        label = f"{self.stage} per {self.per}" if self.per_layer else str(self.stage)
        label += f", hpZ {self.hpz}" if self.hpz else ""
        label += f", {self.update} update" if self.update else ""
        return label + (", prefetch=False" if self.prefetch is False else "")

    @property
    def gpu_bytes(self) -> int:
        return self.report.peak_bytes

    @property
    def verdict(self) -> str:
        return self.report.verdict()


def check_loop(shape: ModelShape, stage2: str, stage1: str) -> None:
    """An unscanned model has no stack for stages 1-2 to reduce layer by layer."""
    if shape.loop not in PYTHON_LOOPS:
        return
    for name, v in (("stage2", stage2), ("stage1", stage1)):
        if v != "whole":
            raise ValueError(
                f"{name}={v!r} needs a scanned layer stack (ZeRO(layers=...)); the shape's "
                f"loop={shape.loop!r} is a Python loop of blocks, which stage 3 alone runs unit "
                f"by unit (ZeRO(units=...)). Pass {name}='whole', or a scanned loop."
            )


def check_hpz(hpz, shape: ModelShape, stages, stage3: str, devices: int, replicas: int) -> None:
    """``hpz`` acts on the per-layer stage-3 row of a scanned stack only; G must split the data
    axis into nodes (divide it, and be smaller)."""
    if hpz is None:
        return
    n = devices // replicas
    why = None
    if stages is not None and 3 not in stages:
        why = "it acts on stage 3 per layer only (the backward's gathers): include stage 3"
    elif stage3 == "whole":
        why = (
            "it acts on stage 3 per layer only: pass stage3='per-layer' or 'both' "
            "(jaxzero plan --stage3 per-layer)"
        )
    elif shape.loop in PYTHON_LOOPS:
        why = "it needs a scanned stack (jaxzero.scan_layers), not a Python loop of blocks"
    elif isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 2 or n % hpz or hpz >= n:
        why = f"G must be >= 2, divide the data axis of {n} devices and be smaller"
    if why:
        raise ValueError(f"hpz={hpz!r}: {why}.")


def _check_plan_args(accum, pcie_gbps=None) -> None:
    """:func:`plan`'s own scalar arguments (the ``ZeRO`` checked its own), each refused with
    what it must be."""
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise ValueError(f"accum={accum!r} must be a positive int.")
    if pcie_gbps is not None and (
        isinstance(pcie_gbps, bool) or not isinstance(pcie_gbps, int | float) or pcie_gbps <= 0
    ):
        raise ValueError(f"pcie_gbps={pcie_gbps!r} must be a positive number of GB/s.")


def plan_cases(
    stages: Sequence[int] | None, stage3: str, stage2: str = "whole", stage1: str = "whole"
) -> list[tuple[int, bool]]:
    """``[(stage, per_layer), ...]``: ``stages`` (default all four); stage 3 as ``stage3`` says:
    ``"whole"`` (gather the whole model up front), ``"per-layer"`` or ``"both"``; stage 2 as
    ``stage2`` says: ``"whole"`` (one reduce-scatter after the backward), ``"per-layer"``
    (each layer's gradient reduce-scattered in the backward loop) or ``"both"``; stage 1 as
    ``stage1`` says (per layer: as stage 2 when there are no micro-batches)."""
    for name, v in (("stage3", stage3), ("stage2", stage2), ("stage1", stage1)):
        if v not in ("whole", "per-layer", "both"):
            raise ValueError(f"{name}={v!r} must be 'whole', 'per-layer' or 'both'.")
    stages = (0, 1, 2, 3) if stages is None else tuple(stages)
    bad = [s for s in stages if isinstance(s, bool) or s not in (0, 1, 2, 3)]
    if bad or not stages:
        raise ValueError(f"stages={stages!r} must be a non-empty subset of 0, 1, 2, 3.")
    out = []
    for s in sorted(set(stages)):
        how = {1: stage1, 2: stage2, 3: stage3}.get(s, "whole")
        if how in ("whole", "both"):
            out.append((s, False))
        if how in ("per-layer", "both"):
            out.append((s, True))
    return out


def row_estimate(
    shape: ModelShape,
    n: int,
    stage: int,
    per_layer: bool,
    precision,
    ema,
    copy=True,
    offload=None,
    per: str = "layer",
    prefetch: bool = True,
    accum: int = 1,
    state_dtype: str | None = None,
    optimizer: str = "adam",
) -> MemoryEstimate:
    """The estimate column of a plan row: ``estimate_memory`` for this shape and stage, with
    activations of the whole stack, plus the whole model gathered (stage 3), one layer
    gathered with its gradient (stage 3 per layer, ``per="layer"``), or :func:`unit_bound`'s
    accounting (stage 3 per unit, ``per="unit"``: that layer and, in ``gathered``, the next
    unit's prefetched weights and, with ``prefetch``, the last unit's, kept from its forward
    for its backward). ``accum``: the micro-batches (with the params offloaded, their host
    gradient sums); ``optimizer``, ``state_dtype``: the state's (:func:`optimizer_of`)."""
    dims = {k: getattr(shape, k) for k in ("batch", "seq", "hidden", "layers", "heads", "vocab")}
    est = estimate_memory(
        shape.num_params,
        n,
        stage=stage,
        optimizer=optimizer,
        precision=precision,
        ema=ema,
        ckpt_every=1,
        layer_params=shape.layer_params if per_layer and stage == 3 else None,
        gather_model=stage == 3 and not per_layer,
        compute_copy=copy,
        offload=offload,
        accum_steps=accum,
        state_dtype=state_dtype,
        **dims,
    )
    if stage == 3 and per_layer and per == "unit":
        prefetched = (2 if prefetch else 1) * param_bytes(precision) * shape.layer_params
        est = dataclasses.replace(est, gathered=est.gathered + prefetched)
    return est


def unit_bound(
    shape: ModelShape,
    devices: int,
    *,
    precision: str = "bf16",
    compute_copy: bool = True,
    prefetch: bool = True,
) -> int:
    """Bytes per device that stage 3 one unit at a time (``ZeRO(units=...)``, one block of
    ``shape`` per unit) must stay under: :func:`jaxzero.estimate_memory` with
    ``layer_params`` (the persistent state, one unit gathered with its full gradient, the
    full gradients of the leaves outside the units, the activations with ``ckpt_every=1``
    and the f32 logits) plus a second unit gathered in the compute dtype, the next unit's
    prefetched weights, and with ``prefetch`` (``ZeRO(prefetch=True)``, the default) a third,
    the last unit's weights kept from its forward for its backward::

        state + (3p + g) * unit + g * (Φ - layers * unit) + activations

    with p = g = 2 bytes in bf16/fp16, 4 in fp32 (the "3 per unit" row's estimate); ``2p``
    without prefetch."""
    return row_estimate(
        shape,
        devices,
        stage=3,
        per_layer=True,
        precision=precision,
        ema=False,
        copy=compute_copy,
        per="unit",
        prefetch=prefetch,
    ).total


def zero_options(
    stage,
    per,
    precision,
    copy,
    offload,
    quantize,
    prefetch,
    hpz,
    f=1.0,
    *,
    layers="layers",
    units=UNITS,
    vocab_parallel=None,
    update=None,
) -> dict:
    """The keyword arguments of the plan's ``ZeRO(tx, mesh, ...)`` for one case; ``per``: False
    (whole), ``"layer"`` (the scanned stack, ``layers=``, with ``hpz``) or ``"unit"`` (the
    Python loop's blocks, ``units=``, with ``prefetch``); ``precision``: a name or a
    ``Precision``, with ``compute_copy=copy``; ``f``: the offload fraction (None: not
    offloaded); ``vocab_parallel``: the stage-3 cases' embedding names (None: none);
    ``update``: the case's ``ZeRO(offload_update=...)``."""
    if isinstance(precision, str):
        precision = Precision.create(precision, compute_copy=copy)
    return dict(
        stage=stage,
        precision=dataclasses.replace(precision, compute_copy=copy),
        layers=layers if per == "layer" else None,
        units=units if per == "unit" else None,
        vocab_parallel=vocab_parallel if stage == 3 else None,
        offload=offload if f is not None else None,
        offload_fraction=f if offload and f is not None else 1.0,
        prefetch=prefetch if per == "unit" else None,
        quantize=stage_quantize(quantize, stage),
        hpz_partition_size=hpz,
        offload_update=update,
    )


#: the optimizer state's storage dtypes a plan takes (``state_dtype=``; None: fp32)
STATE_DTYPES = {None: None, "bf16": "bfloat16", "fp16": "float16"}


def plan_tx(state_dtype: str | None = None) -> optax.GradientTransformation:
    """The plan's optimizer: Adam, its state stored in ``state_dtype`` (``"bf16"``,
    ``"fp16"``: :func:`jaxzero.with_state_dtype`; None: fp32)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype={state_dtype!r}: use None (fp32 optimizer state), 'bf16' or 'fp16'."
        )
    tx = optax.adam(1e-4)
    return tx if state_dtype is None else with_state_dtype(tx, STATE_DTYPES[state_dtype])


def optimizer_of(tx) -> tuple[str, str | None]:
    """The estimate's ``optimizer`` and ``state_dtype`` for ``tx``, read from its state on a
    float32 probe leaf: two moments of the leaf's shape are ``"adam"``'s bytes, one
    ``"sgd"``'s (with momentum), none ``"adafactor"``'s; their dtype float32 (None), bfloat16
    (``"bf16"``) or float16 (``"fp16"``, :func:`jaxzero.with_state_dtype`).

    Raises:
      ValueError: more than two moments, or moments of another dtype or of mixed dtypes.
    """
    probe = jax.ShapeDtypeStruct((4,), jnp.float32)
    state = jax.eval_shape(tx.init, {"w": probe})
    moments = [
        x
        for x in jax.tree.leaves(state)
        if x.shape == probe.shape and jnp.issubdtype(x.dtype, jnp.floating)
    ]
    dtypes = {jnp.dtype(x.dtype).name for x in moments}
    names = {"float32": None, "bfloat16": "bf16", "float16": "fp16"}
    if len(moments) > 2 or len(dtypes) > 1 or not dtypes <= names.keys():
        raise ValueError(
            f"tx keeps {len(moments)} moments of {sorted(dtypes)} per parameter; the plan's "
            "estimate column knows Adam's two, SGD's one or none, in float32, bfloat16 or "
            "float16 (jaxzero.gpu.plan.plan_tx builds the plan's Adam)."
        )
    optimizer = {2: "adam", 1: "sgd", 0: "adafactor"}[len(moments)]
    return optimizer, names[dtypes.pop()] if dtypes else None


def _one(names: tuple[str, ...]):
    """A ``ZeRO`` names field as its keyword argument is written: one name as itself."""
    return None if not names else names[0] if len(names) == 1 else names


def _quantize_option(quantize: Wire):
    """``ZeRO.quantize`` (its :class:`~jaxzero.Wire`, hpZ left out) as the plan's cases take
    it: ``"weights"``, ``"grads"`` or ``"both"`` where it is one of those, None where exact,
    else the ``Wire``."""
    bare = dataclasses.replace(quantize, hpz=None)
    if bare == wire(None):
        return None
    return next((q for q in ("weights", "grads", "both") if wire(q) == bare), bare)


def _zero(zero: ZeRO, case: dict, f=1.0, names: dict | None = None) -> ZeRO:
    """The ``ZeRO`` of one plan ``case`` (:func:`zero_options`'s keyword arguments but the
    fraction ``f`` and the ``names``): ``zero``'s optimizer, mesh, axis and loss scaling."""
    return ZeRO(
        zero.tx,
        zero.mesh,
        axis=zero.axis,
        loss_scale=zero.loss_scale,
        skip_nonfinite=zero.skip_nonfinite,
        **zero_options(**case, f=f, **(names or {})),
    )


def _compiler(
    zero: ZeRO,
    shape: ModelShape,
    names: dict,
    *,
    accum,
    ema: bool,
    gpu,
    compiler_options,
    gpu_memory,
) -> Callable[[dict, float | None], CompileReport]:
    """``compile_case(case, fraction)``: the compile report of one plan ``case`` (as
    :func:`_zero` takes it) at ``fraction`` (None: without offload), judged against
    ``gpu_memory``; the loss, the EMA, the abstract params and the batch of ``accum``
    micro-batches are made once, for every case."""
    batch = batch_shapes(shape, shape.batch * zero.mesh.size * accum)
    sema = ShardedEMA(0.999) if ema else None
    loss_fn, params = make_loss(shape), abstract_params(shape)

    def compile_case(case, fraction):
        step = make_train_step(
            loss_fn, _zero(zero, case, fraction, names), ema=sema, accum_steps=accum
        )
        # deferred or delayed: the steady state, a step with an update pending
        state = steady_state(step, params, batch)
        report = compile_report(step, state, batch, kind=gpu, compiler_options=compiler_options)
        return limited(report, gpu_memory)

    return compile_case


def _label(stage: int, per_layer: bool, per: str, prefetch) -> str:
    """A case's progress label: ``"3 per layer"``, ``"3 per unit, prefetch=False"``, ``"2"``."""
    label = f"{stage} per {per}" if per_layer else str(stage)
    return label + ("" if prefetch is not False else ", prefetch=False")


def _params_too(zero: ZeRO, case: dict, compile_case, names: dict):
    """A function compiling ``case`` with the params offloaded too, or None where ZeRO refuses
    that offload for it (the refusal is :func:`~jaxzero.zero.offload.placement.check_params`'s,
    raised before anything is compiled)."""
    case = {**case, "offload": ("optimizer", "params")}
    try:
        _zero(zero, case, names=names)
    except ValueError:
        return None
    return lambda: compile_case(case, 1.0)


def _cost(report, shape: ModelShape, accum: int, gpu: str, gbps, update=None) -> OffloadCost:
    """The offload cost of a row's compiled step, for its tokens per GPU; ``update``: the
    row's ``offload_update`` (its copies' window, :func:`~.offload_cost.update_window`)."""
    tokens = shape.batch * shape.seq * accum
    window = update_window(update, accum)
    return offload_cost(report, shape.num_params, tokens, kind=gpu, gbps=gbps, window=window)


def plan_stages(stages, offload):
    """The stages to plan: with ``offload`` 1-3 by default (3 with the params offloaded),
    and stage 0 refused."""
    if offload and stages is None:
        return (3,) if params_offloaded(check_offload(offload, 3)) else (1, 2, 3)
    if stages is not None:
        check_offload(offload, tuple(stages))
    return stages


def _unit_cases(
    cases, per: str, prefetch: bool | None, both: bool = False
) -> list[tuple[int, bool, bool | None]]:
    """``cases`` with each per-unit stage-3 case at the ``ZeRO``'s ``prefetch``, or with
    ``both`` once with ``prefetch=True`` and once with False; a ``prefetch=False`` or ``both``
    without a per-unit case is refused, as it would change nothing."""
    units = [(s, pl) for s, pl in cases if s == 3 and pl and per == "unit"]
    if (both or prefetch is False) and not units:
        which = "both_prefetch=True" if both else "ZeRO(prefetch=False)"
        raise ValueError(
            f"{which} chooses ZeRO(prefetch=...) for stage 3 per unit, which this plan does "
            "not compile: it needs a Python loop of blocks (loop='python') and the case "
            "(3, True). A scanned stack always prefetches the next layer. Leave prefetch at "
            "its default."
        )
    choices = (True, False) if both else (prefetch,)
    return [(s, pl, pf) for s, pl in cases for pf in (choices if (s, pl) in units else (None,))]


def prefetch_advice(rows: Sequence[PlanRow]) -> str | None:
    """Which ``ZeRO(prefetch=...)`` to pick, from a plan's per-unit rows compiled both ways
    (None unless both are there): prefetch where it fits the GPU and hides at least as much
    (it holds up to one more unit and one unit's gradient in flight, and recomputes each
    block, which a decoder that remats every block does anyway); ``prefetch=False`` where
    only it fits."""
    by = {r.prefetch: r for r in rows if r.per == "unit" and r.prefetch is not None}
    if len(by) < 2:
        return None
    on, off = by[True].report, by[False].report
    kinds = ("all-gather", "reduce-scatter")
    hidden = f"hides {on.hidden_share(*kinds):.0%} of AG+RS against {off.hidden_share(*kinds):.0%}"
    peaks = f"peak {format_bytes(on.peak_bytes)} against {format_bytes(off.peak_bytes)}"
    fits = lambda r: r.fits is not False
    if fits(on) and on.hidden_share(*kinds) >= off.hidden_share(*kinds):
        return f"pick prefetch=True (the default): it {hidden}, {peaks}."
    if fits(off):
        why = "only prefetch=False fits" if not fits(on) else "it hides more"
        return f"pick prefetch=False: {why} ({peaks}; prefetch {hidden})."
    return f"neither fits the GPU ({peaks}): shard over more devices or offload."


def _cases(zero: ZeRO, cases, per: str, names: dict) -> list[tuple[int, bool]]:
    """The ``(stage, per_layer)`` cases to compile (default: ``zero``'s own stage, per layer
    where it names layers or units), checked: stages 0-3, a per-layer case only where
    ``zero`` names the model's stack (``layers=``, a scanned stack) or blocks (``units=``, a
    Python loop; stage 3 only), and ``zero``'s offload allowed at every stage."""
    if cases is None:
        cases = [(zero.stage, bool(zero.layers or zero.units))]
    cases = [(s, bool(pl)) for s, pl in cases]
    bad = [s for s, _ in cases if isinstance(s, bool) or s not in (0, 1, 2, 3)]
    if bad or not cases:
        raise ValueError(f"cases={cases!r} must be (stage, per_layer) pairs of stages 0-3.")
    named = names["units"] if per == "unit" else names["layers"]
    layered = [s for s, pl in cases if pl]
    if layered and named is None:
        fix = (
            'layers="layers"), its scanned stack'
            if per == "layer"
            else f'units=r"{UNITS}"), its blocks'
        )
        raise ValueError(
            f"the per-layer cases of stages {layered} need the ZeRO to name the model's "
            f"layers: ZeRO({fix}."
        )
    if per == "unit" and any(s != 3 for s in layered):
        raise ValueError(
            f"per-layer cases at stages {[s for s in layered if s != 3]} need a scanned layer "
            "stack (ZeRO(layers=...)); the shape is a Python loop of blocks, which stage 3 "
            "alone runs unit by unit (ZeRO(units=...))."
        )
    check_offload(zero.offload, tuple(sorted({s for s, _ in cases})))
    return cases


def plan(
    zero: ZeRO,
    shape: ModelShape,
    *,
    cases: Sequence[tuple[int, bool]] | None = None,
    both_prefetch: bool = False,
    fit_offload: bool = False,
    accum: int = 1,
    ema: bool = False,
    gpu_memory: int | None = None,
    pcie_gbps: float | None = None,
    compiler_options: dict | None = None,
    on_case: Callable[[str, int, int], None] | None = None,
) -> list[PlanRow]:
    """Compile the train step of ``shape`` under ``zero`` for the GPUs of ``zero.mesh``, at
    each of ``cases``, and set each compile next to :func:`jaxzero.estimate_memory`.

    ``zero`` is the configuration planned: its optimizer, its mesh (a compile-only mesh of a
    GPU kind, :func:`jaxzero.gpu.compile_only_mesh`: the kind, the devices and the replica
    axis), its precision, offload and ``offload_fraction``, ``quantize`` (ZeRO++'s
    collectives, each where it acts: :func:`stage_quantize`), hpZ, ``vocab_parallel``,
    ``prefetch``, and the names of the model's layer stack (``layers="layers"``) or blocks
    (``units=r"block_\\d+"``, a ``shape`` with ``loop="python"``: its rows read "3 per
    unit"). ``cases``: the ``(stage, per_layer)`` pairs to compile (:func:`plan_cases`;
    default ``zero``'s own), each with ``zero``'s settings where they act: the layers or
    units on per-layer cases, ``Precision(compute_copy=False)``, ``vocab_parallel`` and
    weight quantization at stage 3, hpZ on stage 3 per layer.

    The model is :class:`jaxzero.gpu.models.Decoder` (params from ``jax.eval_shape``), the
    global batch ``shape.batch x devices x accum`` sequences, plus an fp32 ``ShardedEMA``
    with ``ema=True``. ``both_prefetch``: the per-unit row with ``ZeRO(prefetch=True)`` and
    with False (:func:`prefetch_advice` then says which to pick). ``fit_offload`` (``zero``
    with ``offload="optimizer"``): each row at the smallest ``offload_fraction`` that fits
    ``gpu_memory`` (decision 43), the params offloaded too where all of the optimizer does
    not fit (stage 3 per layer or unit). ``gpu_memory``: the bytes per device the verdicts
    judge by (the mesh compiled for that memory, ``compile_only_mesh(memory_bytes=)``;
    default the kind's). With offload, each row's ``cost``: the host <-> device bytes and
    the step time at ``pcie_gbps`` GB/s (default: the GPU kind's) for ``batch x seq x accum``
    tokens per GPU. ``compiler_options``: XLA options for every compile (e.g.
    ``jaxzero.gpu.xla_options()``, the recommended GPU flags). ``on_case(label, i, total)``
    is called before each compile (progress).

    Returns:
      One :class:`PlanRow` per case (two for a per-unit case with ``both_prefetch``).

    Raises:
      ValueError: a bad argument, or a case ``zero``'s settings do not reach.
    """
    _check_plan_args(accum, pcie_gbps)
    gpu = gpu_kind_of(zero.mesh)
    if gpu is None:
        raise ValueError(
            "zero's mesh must be of a GPU kind the plan knows: jaxzero.gpu.compile_only_mesh("
            f"kind, devices), kind one of {', '.join(GPU_KINDS)}."
        )
    if zero.offload_activations:
        raise ValueError(
            "the plan compiles the state's offload only: drop 'activations' from offload=."
        )
    per = "unit" if shape.loop in PYTHON_LOOPS else "layer"
    names = {
        "layers": _one(zero.layers),
        "units": _one(zero.units),
        "vocab_parallel": _one(zero.vocab_parallel),
    }
    cases = _cases(zero, cases, per, names)
    update = zero.offload_update
    if update and ((3, True) not in cases or per != "layer" or fit_offload):
        raise ValueError(
            f"offload_update={update!r} runs the update inside the next forward's layer loop "
            "at stage 3 per layer of a scanned stack, which the plan compiles in the case "
            "(3, True) with layers= (loop='scan'), without fit_offload (it needs the whole "
            "optimizer offloaded): include that case, or plan the exact update."
        )
    hpz = zero.hpz_partition_size
    if hpz and (3, True) not in cases:
        raise ValueError(
            f"hpz_partition_size={hpz}: it acts on stage 3 per layer only (the backward's "
            "gathers): include the case (3, True)."
        )
    # the params offload as jaxzero plan's --offload writes it (the paste line's spelling);
    # the remainder master as ZeRO spells it, offload=("optimizer", "remainder")
    offload = zero.offload
    if isinstance(offload, tuple) and not remainder_master(offload):
        offload = ",".join(offload)
    fraction = zero.offload_fraction
    if fit_offload and (offload != "optimizer" or fraction != 1):
        raise ValueError(
            f"fit_offload=True picks the fraction of offload='optimizer' (got offload="
            f"{offload!r}, offload_fraction={fraction:g}): pass ZeRO(offload='optimizer')."
        )
    cases = _unit_cases(cases, per, zero.prefetch, both_prefetch)
    optimizer, state_dtype = optimizer_of(zero.tx)
    precision = trees.PRECISION_NAMES[jnp.dtype(zero.precision.param_dtype).name]
    quantize = _quantize_option(zero.quantize)
    compile_case = _compiler(
        zero,
        shape,
        names,
        accum=accum,
        ema=ema,
        gpu=gpu,
        compiler_options=compiler_options,
        gpu_memory=gpu_memory,
    )
    batch_bytes = 2 * shape.batch * accum * shape.seq * 4
    rows = []
    for i, (stage, per_layer, pf) in enumerate(cases):
        if on_case is not None:
            on_case(_label(stage, per_layer, per, pf), i, len(cases))
        # compute_copy=False: a layout of stage 3 only; hpZ: the per-layer stage-3 row only
        copy = zero.precision.compute_copy or stage != 3
        g = hpz if stage == 3 and per_layer else None
        case = dict(
            stage=stage,
            per=per_layer and per,
            precision=zero.precision,
            copy=copy,
            offload=offload,
            quantize=quantize,
            prefetch=pf,
            hpz=g,
            # deferred or delayed: the stage-3 per-layer row (the other rows' exact update)
            update=update if stage == 3 and per_layer else None,
        )
        # the case compiled at the ZeRO's fraction, or with fit_offload at the smallest that
        # fits (None: without offload), the params too where nothing less fits and the case
        # is stage 3 a layer or a unit at a time
        compile_at = functools.partial(compile_case, case)
        if fit_offload:
            more = (
                _params_too(zero, case, compile_case, names) if stage == 3 and per_layer else None
            )
            f, report, tries, params = or_params(smallest_fraction(compile_at), more)
            tries = tuple(tries)
        else:
            f, report, tries, params = fraction, compile_at(fraction), (), False
        off = ("optimizer", "params") if params else offload if f is not None else None
        est = row_estimate(
            shape,
            zero.num_shards,
            stage,
            per_layer,
            precision,
            ema,
            copy=copy,
            offload=off,
            per=per,
            prefetch=pf is not False,
            accum=accum,
            state_dtype=state_dtype,
            optimizer=optimizer,
        )
        rows.append(
            PlanRow(
                stage=stage,
                per_layer=per_layer,
                num_params=shape.num_params,
                report=report,
                estimate=fraction_estimate(est, f),
                state_bytes=report.argument_bytes - batch_bytes,
                per=per,
                prefetch=pf,
                hpz=g,
                update=case["update"],
                cost=off and _cost(report, shape, accum, gpu, pcie_gbps, case["update"]),
                fraction=f,
                tries=tries,
                params_offloaded=params,
                zero_options=zero_options(**{**case, "offload": off}, f=f, **names),
            )
        )
    return rows
