"""``plan``: compile the real jaxzero step of a GPT/LLaMA-shaped model for a GPU cluster (no GPU
needed, nothing allocated) and set the GPU compiler's bytes per device next to
:func:`jaxzero.estimate_memory`'s, for every stage.

Its argument checks (:func:`check_loop`, :func:`check_hpz`, :func:`check_plan_offload`) are
``jaxzero plan``'s too: each refuses a combination that would not compile or would change
nothing, naming the fix."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import optax

from jaxzero.ema import ShardedEMA
from jaxzero.gpu.models import PYTHON_LOOPS, ModelShape, abstract_params, batch_shapes, make_loss
from jaxzero.gpu.network import WireTime, cross_node_time, stage_quantize, wire_time
from jaxzero.gpu.offload_cost import OffloadCost, offload_cost
from jaxzero.gpu.offload_fraction import fraction_estimate, limited, or_params, smallest_fraction
from jaxzero.gpu.report import CompileReport, compile_report
from jaxzero.gpu.topology import compile_only_mesh
from jaxzero.memory import MemoryEstimate, estimate_memory, format_bytes
from jaxzero.memory.estimate import param_bytes
from jaxzero.precision import Precision, with_state_dtype
from jaxzero.train.optimizer import ZeRO
from jaxzero.train.step import make_train_step
from jaxzero.zero.offload import check_offload, params_offloaded
from jaxzero.zero.offload.fraction import check_fraction
from jaxzero.zero.wire import Wire

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
PREFETCH = {"on": (True,), "off": (False,), "both": (True, False)}
PRECISIONS = ("bf16", "fp16", "fp32")


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
    ``ZeRO(hpz_partition_size=...)`` (None on the other rows). ``cost``: with offload, the
    host <-> device bytes of the compiled step and the step time they predict
    (:func:`jaxzero.gpu.offload_cost.offload_cost`; None without offload). ``fraction``: the
    row's ``ZeRO(offload_fraction=...)`` with a fraction or ``auto`` (None: not offloaded);
    ``params_offloaded``: ``auto`` offloaded the params too, as nothing less fits.
    ``zero_options``: the keyword arguments the row's step was compiled with,
    ``ZeRO(tx, mesh, **zero_options)`` (:func:`zero_options`).
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
    cost: OffloadCost | None = None
    fraction: float | None = 1.0
    tries: tuple = ()  # auto: every (fraction, compiled peak bytes) it compiled
    params_offloaded: bool = False  # auto: the params offloaded too (offload_fraction.or_params)
    zero_options: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        label = f"{self.stage} per {self.per}" if self.per_layer else str(self.stage)
        label += f", hpZ {self.hpz}" if self.hpz else ""
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


def check_plan_offload(offload, fraction) -> tuple[bool, str | None, float]:
    """``(auto, offload, fraction)``: ``offload="auto"`` is ``"optimizer"`` at a fraction
    each case picks; ``fraction`` checked against ``offload`` (it needs ``"optimizer"``)."""
    auto = offload == "auto"
    offload = "optimizer" if auto else offload
    on_host = params_offloaded(check_offload(offload, 3))
    return auto, offload, check_fraction(fraction, offload, on_host)


def _check_plan_args(precision, accum, devices, replicas, quantize=None, pcie_gbps=None):
    """:func:`plan`'s scalar arguments, each refused with what it must be."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {', '.join(PRECISIONS)}.")
    for name, v in (("accum", accum), ("devices", devices), ("replicas", replicas)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int.")
    if devices % replicas:
        raise ValueError(f"replicas={replicas} must divide devices={devices}.")
    if pcie_gbps is not None and (
        isinstance(pcie_gbps, bool) or not isinstance(pcie_gbps, int | float) or pcie_gbps <= 0
    ):
        raise ValueError(f"pcie_gbps={pcie_gbps!r} must be a positive number of GB/s.")
    if not isinstance(quantize, Wire) and quantize not in (None, "weights", "grads", "both"):
        raise ValueError(
            f"quantize={quantize!r} must be None, 'weights', 'grads', 'both' or a "
            f"jaxzero.Wire (e.g. Wire.create(weights=8, grads=4): DeepSpeed's ZeRO++ widths)."
        )


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
) -> MemoryEstimate:
    """The estimate column of a plan row: ``estimate_memory`` for this shape and stage, with
    activations of the whole stack, plus the whole model gathered (stage 3), one layer
    gathered with its gradient (stage 3 per layer, ``per="layer"``), or :func:`unit_bound`'s
    accounting (stage 3 per unit, ``per="unit"``: that layer and, in ``gathered``, the next
    unit's prefetched weights and, with ``prefetch``, the last unit's, kept from its forward
    for its backward). ``accum``: the micro-batches (with the params offloaded, their host
    gradient sums)."""
    dims = {k: getattr(shape, k) for k in ("batch", "seq", "hidden", "layers", "heads", "vocab")}
    est = estimate_memory(
        shape.num_params,
        n,
        stage=stage,
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
    shape: ModelShape, stage, per, precision, copy, offload, quantize, prefetch, hpz, f=1.0
) -> dict:
    """The keyword arguments of the plan's ``ZeRO(tx, mesh, ...)`` for one case; ``per``: False
    (whole), ``"layer"`` (the scanned stack, ``layers=``, with ``hpz``) or ``"unit"`` (the
    Python loop's blocks, ``units=``, with ``prefetch``); ``f``: the offload fraction (None:
    not offloaded)."""
    return dict(
        stage=stage,
        precision=Precision.create(precision, compute_copy=copy),
        layers="layers" if per == "layer" else None,
        units=UNITS if per == "unit" else None,
        vocab_parallel="embed" if shape.vocab_parallel and stage == 3 else None,
        offload=offload if f is not None else None,
        offload_fraction=f if offload and f is not None else 1.0,
        prefetch=prefetch if per == "unit" else None,
        quantize=stage_quantize(quantize, stage),
        hpz_partition_size=hpz,
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


def _zero(shape: ModelShape, mesh, case: dict, f=1.0, state_dtype=None):
    """The plan's ``ZeRO`` for one ``case`` (:func:`zero_options`'s keyword arguments but the
    shape and the fraction ``f``), with :func:`plan_tx`'s Adam."""
    return ZeRO(plan_tx(state_dtype), mesh, **zero_options(shape, **case, f=f))


def _compiler(
    shape: ModelShape,
    mesh,
    *,
    devices,
    accum,
    ema: bool,
    gpu,
    compiler_options,
    gpu_memory,
    state_dtype=None,
) -> Callable[[dict, float | None], CompileReport]:
    """``compile_case(case, fraction)``: the compile report of one plan ``case`` (as
    :func:`_zero` takes it) at ``fraction`` (None: without offload), judged against
    ``gpu_memory``; the loss, the EMA, the abstract params and the batch of ``accum``
    micro-batches are made once, for every case."""
    batch = batch_shapes(shape, shape.batch * devices * accum)
    sema = ShardedEMA(0.999) if ema else None
    loss_fn, params = make_loss(shape), abstract_params(shape)

    def compile_case(case, fraction):
        step = make_train_step(
            loss_fn, _zero(shape, mesh, case, fraction, state_dtype), ema=sema, accum_steps=accum
        )
        report = compile_report(step, params, batch, kind=gpu, compiler_options=compiler_options)
        return limited(report, gpu_memory)

    return compile_case


def _label(stage: int, per_layer: bool, per: str, prefetch) -> str:
    """A case's progress label: ``"3 per layer"``, ``"3 per unit, prefetch=False"``, ``"2"``."""
    label = f"{stage} per {per}" if per_layer else str(stage)
    return label + ("" if prefetch is not False else ", prefetch=False")


def _params_too(shape: ModelShape, mesh, case: dict, compile_case):
    """A function compiling ``case`` with the params offloaded too, or None where ZeRO refuses
    that offload for it (the refusal is :func:`~jaxzero.zero.offload.placement.check_params`'s,
    raised before anything is compiled)."""
    case = {**case, "offload": ("optimizer", "params")}
    try:
        _zero(shape, mesh, case)
    except ValueError:
        return None
    return lambda: compile_case(case, 1.0)


def _cost(report, shape: ModelShape, accum: int, gpu: str, gbps) -> OffloadCost:
    """The offload cost of a row's compiled step, for its tokens per GPU."""
    tokens = shape.batch * shape.seq * accum
    return offload_cost(report, shape.num_params, tokens, kind=gpu, gbps=gbps)


def plan_stages(stages, offload):
    """The stages to plan: with ``offload`` 1-3 by default (3 with the params offloaded),
    and stage 0 refused."""
    if offload and stages is None:
        return (3,) if params_offloaded(check_offload(offload, 3)) else (1, 2, 3)
    if stages is not None:
        check_offload(offload, tuple(stages))
    return stages


def _unit_cases(cases, per: str, prefetch: str) -> list[tuple[int, bool, bool | None]]:
    """``cases`` with each per-unit stage-3 case once per ``prefetch`` choice (``"on"``,
    ``"off"`` or ``"both"``); refused where no per-unit case exists, as it would change
    nothing."""
    if prefetch not in PREFETCH:
        raise ValueError(f"prefetch={prefetch!r} must be one of {', '.join(PREFETCH)}.")
    units = [(s, pl) for s, pl in cases if s == 3 and pl and per == "unit"]
    if prefetch != "on" and not units:
        raise ValueError(
            f"prefetch={prefetch!r} chooses ZeRO(prefetch=...) for stage 3 per unit, which "
            "this plan does not compile: it needs a Python loop of blocks (loop='python') and "
            "stage3='per-layer' or 'both'. A scanned stack always prefetches the next layer. "
            "Leave prefetch='on'."
        )
    return [
        (s, pl, pf)
        for s, pl in cases
        for pf in (PREFETCH[prefetch] if (s, pl) in units else (None,))
    ]


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


def plan(
    shape: ModelShape,
    *,
    gpu: str = "h100",
    devices: int = 8,
    replicas: int = 1,
    stages: Sequence[int] | None = None,
    stage3: str = "both",
    stage2: str = "whole",
    stage1: str = "whole",
    precision: str = "bf16",
    accum: int = 1,
    ema: bool = False,
    on_case: Callable[[str, int, int], None] | None = None,
    compiler_options: dict | None = None,
    compute_copy: bool = True,
    offload: str | None = None,
    prefetch: str = "on",
    quantize: str | Wire | None = None,
    hpz: int | None = None,
    pcie_gbps: float | None = None,
    offload_fraction: float = 1.0,
    gpu_memory: int | None = None,
    state_dtype: str | None = None,
) -> list[PlanRow]:
    """Compile the Adam train step of ``shape`` at each stage for ``devices`` GPUs of ``gpu``.

    The model is :class:`jaxzero.gpu.models.Decoder` (scanned, rematerialised layers; params
    from ``jax.eval_shape``), the global batch ``shape.batch x devices x accum`` sequences, the
    optimizer ``optax.adam`` with ZeRO's ``precision`` policy, plus an fp32 ``ShardedEMA`` with
    ``ema=True``. ``on_case(label, i, total)`` is called before each compile (progress).
    ``compiler_options``: XLA options for every compile (e.g. ``jaxzero.gpu.xla_options()``,
    the recommended GPU flags). ``compute_copy=False``: stage 3 in FSDP's layout
    (``Precision(compute_copy=False)``: no 16-bit params copy beside the fp32 master). A
    ``shape`` with ``vocab_parallel=True`` runs its stage-3 cases with
    ``ZeRO(vocab_parallel="embed")`` (the estimate column still gathers the table).
    ``offload="optimizer"``: ``ZeRO(offload=...)``, the master, Adam and the EMA in host
    memory (stages 1-3; the default stages are then 1, 2 and 3). A ``shape`` with a Python
    loop (``loop="python"``: blocks ``block_0`` ... unscanned, as most Flax code is written)
    runs stage 3 "per layer" one block at a time, ``ZeRO(units=r"block_\\d+")``, and its rows
    read "3 per unit"; stages 1-2 then reduce the whole gradient. ``prefetch``: that row with
    ``ZeRO(prefetch=True)`` (``"on"``), ``prefetch=False`` (``"off"``) or both rows
    (``"both"``; :func:`prefetch_advice` then says which to pick). ``quantize`` (``"weights"``,
    ``"grads"``, ``"both"``: int8; or a ``Wire``, e.g. ``Wire.create(weights=8, grads=4)``):
    ZeRO++'s collectives where each acts (:func:`stage_quantize`); ``hpz``: its hpZ. With
    ``offload``, each row's ``cost``: the host <-> device bytes and the step time at
    ``pcie_gbps`` GB/s (default: the GPU kind's) for ``batch x seq x accum`` tokens per GPU.
    ``offload_fraction``: ``ZeRO(offload_fraction=...)``; ``offload="auto"``: the smallest
    that fits ``gpu_memory`` bytes per device (compiled for, instead of the kind's; decision 43),
    and the params offloaded too where all of it does not fit (stage 3 per layer or unit).
    ``state_dtype``: Adam's state stored in ``"bf16"`` or ``"fp16"`` (:func:`plan_tx`, the
    estimate's ``state_dtype``); None: fp32.

    Returns:
      One :class:`PlanRow` per case of :func:`plan_cases`.

    Raises:
      ValueError: a bad argument. PluginMissingError: jax's CUDA plugin is not installed.
    """
    _check_plan_args(precision, accum, devices, replicas, quantize, pcie_gbps)
    plan_tx(state_dtype)  # refuses an unknown storage dtype before anything compiles
    check_loop(shape, stage2, stage1)
    check_hpz(hpz, shape, stages, stage3, devices, replicas)
    per = "unit" if shape.loop in PYTHON_LOOPS else "layer"
    auto, offload, fraction = check_plan_offload(offload, offload_fraction)
    cases = plan_cases(plan_stages(stages, offload), stage3, stage2, stage1)
    cases = _unit_cases(cases, per, prefetch)
    mesh = compile_only_mesh(gpu, devices, replicas=replicas, memory_bytes=gpu_memory)
    compile_case = _compiler(
        shape,
        mesh,
        devices=devices,
        accum=accum,
        ema=ema,
        gpu=gpu,
        compiler_options=compiler_options,
        gpu_memory=gpu_memory,
        state_dtype=state_dtype,
    )
    batch_bytes = 2 * shape.batch * accum * shape.seq * 4
    rows = []
    for i, (stage, per_layer, pf) in enumerate(cases):
        if on_case is not None:
            on_case(_label(stage, per_layer, per, pf), i, len(cases))
        # compute_copy=False: a layout of stage 3 only; hpZ: the per-layer stage-3 row only
        copy = compute_copy or stage != 3
        g = hpz if stage == 3 and per_layer else None
        case = dict(
            stage=stage,
            per=per_layer and per,
            precision=precision,
            copy=copy,
            offload=offload,
            quantize=quantize,
            prefetch=pf,
            hpz=g,
        )
        # the case compiled at the fraction asked (None: without offload), or with auto at the
        # smallest that fits, the params too where nothing less fits and the case is stage 3
        # a layer or a unit at a time
        compile_at = functools.partial(compile_case, case)
        if auto:
            more = (
                _params_too(shape, mesh, case, compile_case) if stage == 3 and per_layer else None
            )
            f, report, tries, params = or_params(smallest_fraction(compile_at), more)
            tries = tuple(tries)
        else:
            f, report, tries, params = fraction, compile_at(fraction), (), False
        off = ("optimizer", "params") if params else offload if f is not None else None
        est = row_estimate(
            shape,
            devices // replicas,
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
                cost=off and _cost(report, shape, accum, gpu, pcie_gbps),
                fraction=f,
                tries=tries,
                params_offloaded=params,
                zero_options=zero_options(shape, **{**case, "offload": off}, f=f),
            )
        )
    return rows
