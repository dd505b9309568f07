"""Analytic ZeRO memory estimates (no devices needed): :func:`estimate_memory` applies the ZeRO
paper's accounting to give bytes per device for each stage; :func:`format_table` renders it.

Beyond the per-stage state (see :func:`estimate_memory`), three terms:

**Activations** (ZeRO-Infinity, Rajbhandari et al. 2021, sec. 3), added only when batch, seq,
hidden, layers and heads are given; they do not depend on the stage. With ci = ckpt_every
(default 1)::

    checkpoints = 2 * batch * seq * hidden * ceil(layers / ci)
    working     = batch * seq * ci * (16 * hidden + 2 * heads * seq)
    logits      = 3 * 4 * batch * seq * vocab     (only with vocab=)

in 16-bit precisions; fp32 doubles checkpoints and working. ``logits`` are the float32
logits, their softmax and their gradient (the cross-entropy over a vocabulary).

**Stage 3 one layer at a time** (``ZeRO(layers=...)``; ``layer_params=`` the parameters of one
scanned layer, DeepSpeed's "largest layer"; needs ``layers``) adds the gathered working set
``(p + g) * layer_params + g * (Φ - layers * layer_params)``: one layer whole with its full
gradient before its reduce-scatter, and the full gradients of the leaves outside the stacks
(embeddings, head), which are gathered for the micro-batch and reduced after the backward.

**Stage 3 whole model** (``gather_model=True``; the default ``ZeRO(stage=3)``, which gathers
every parameter once per micro-batch and keeps it for the backward) adds ``p * Φ``: the model
gathered in the compute dtype. Measured on XLA:CPU (fp32 Adam, 2.1M-parameter MLP, N = 8):
the stage-3 step's temporaries are 1.25 x 4Φ, the gathered model (the full gradient takes its
place as the backward frees it) plus Adam's update of the shards. Stage 2's 1.02 x 4Φ are its
unreduced gradient, which this estimate leaves out like the ZeRO paper does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from jaxzero.memory.offloaded import offloaded, sums_bytes
from jaxzero.trees import check_int, format_bytes
from jaxzero.zero.offload import check_offload, params_offloaded
from jaxzero.zero.offload.placement import remainder_master

OPTIMIZERS = ("adam", "sgd", "adafactor")
PRECISIONS = ("bf16", "fp16", "fp32")
#: the optimizer state's storage: fp32 (None), or 2 bytes per value (jaxzero.with_state_dtype)
STATE_DTYPES = (None, "bf16", "fp16")
# Bytes per parameter of optimizer state proper (without the fp32 master copy).
# adafactor keeps factored second moments: one fp32 value per row plus one per
# column of each matrix, i.e. 4*(rows+cols) bytes, negligible next to rows*cols;
# we approximate it as 0 bytes per parameter (no momentum, optax's default).
_OPT_STATE_BYTES = {"adam": 8, "sgd": 4, "adafactor": 0}
_MASTER_BYTES = 4  # fp32 master copy, kept only under mixed precision
#: the offloaded master kept as a 16-bit remainder and a carry bit (offload=("optimizer",
#: "remainder")): 2 bytes per param, plus one bit packed 8 to a byte
_REMAINDER_LO_BYTES, _REMAINDER_CARRY_BITS = 2, 1
_EMA_BYTES = 4  # the EMA is always fp32 and always sharded over the N devices


_whole = functools.partial(check_int, whole_floats=True)  # also takes 7.5e9


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes for one ZeRO stage (all fields are bytes unless noted).

    ``optimizer`` includes the fp32 master weights under mixed precision;
    ``activations`` is 0 when no activation shape was given; ``total`` is the sum, in device
    memory. ``host`` is what ``offload="optimizer"`` keeps in host memory instead (then
    ``optimizer`` and ``ema`` are 0); it is not part of ``total``. ``offload`` is the
    setting the estimate was made with, as :func:`~jaxzero.zero.offload.check_offload`
    normalises it (None, ``"optimizer"``, ``("optimizer", "params")`` or ``("optimizer",
    "remainder")``).

    Per parameter, what an offload setting costs (floats, bytes per parameter):

    - ``params_held``: the parameters whose state one device holds, the int the bytes per
      parameter divide by: ``ceil(num_params / world_size)`` (the padded flat shard the
      sharded state is counted in) at stages 1-3, ``num_params`` at stage 0.
    - ``host_per_param``: ``host / params_held``; 12 with bf16 Adam and ``"optimizer"`` (fp32
      master 4 + Adam's two moments 8), 16 with the EMA, 8 with moments in bf16
      (``state_dtype="bf16"``), 10.125 with the remainder master (2.125 for the master), 14
      with the params offloaded too; 0 without offload.
    - ``h2d_per_param``, ``d2h_per_param``: the bytes per parameter each step moves over PCIe
      host -> device and device -> host. With the optimizer side offloaded the streamed
      update fetches the host state once and writes it back once, so each is
      ``host_per_param``: this covers ``"optimizer"``, the remainder master, a 16-bit state
      dtype, the EMA, any ``accum_steps`` (the update runs once per step) and a fraction
      of the state offloaded (an estimate whose ``host`` is that fraction's, as
      :func:`jaxzero.gpu.offload_fraction.fraction_estimate` makes it). 0.0 without
      offload. None with the params offloaded (``("optimizer", "params")``): the layer
      fetches of the forward and the backward, the gradients and, with micro-batches, the
      host accumulator add bytes that depend on which leaves the layer stacks hold, so the
      compiled step's figures (``jaxzero plan --wide``) are the ones to read there.
    """

    stage: int
    num_params: int
    world_size: int
    optimizer_name: str
    precision: str
    params: int
    grads: int
    optimizer: int
    ema: int
    activations: int
    gathered: int = 0
    host: int = 0
    offload: str | tuple[str, str] | None = None
    total: int = dataclasses.field(init=False)

    def __post_init__(self):
        total = (
            self.params + self.grads + self.optimizer + self.ema + self.activations + self.gathered
        )
        object.__setattr__(self, "total", total)

    @property
    def params_held(self) -> int:
        """Parameters whose state one device holds (see the class docstring)."""
        if self.stage == 0:
            return self.num_params
        return -(-self.num_params // self.world_size)

    @property
    def host_per_param(self) -> float:
        """``host`` bytes per parameter the device holds the state of."""
        return self.host / self.params_held

    @property
    def h2d_per_param(self) -> float | None:
        """Bytes per parameter fetched from host memory per step; None where the estimate does
        not cover the setting."""
        return self._pcie_per_param()

    @property
    def d2h_per_param(self) -> float | None:
        """Bytes per parameter written back to host memory per step; None where the estimate does
        not cover the setting."""
        return self._pcie_per_param()

    def _pcie_per_param(self) -> float | None:
        # the streamed update reads the host state once and writes it back once per step
        if params_offloaded(self.offload):
            return None
        return self.host_per_param if self.offload else 0.0

    def fits(self, gpu_memory: int) -> bool:
        """Return True when ``total`` <= ``gpu_memory`` bytes."""
        return self.total <= gpu_memory


def gpt_param_count(layers: int, hidden: int, vocab: int = 50257, seq: int = 1024) -> int:
    """Approximate parameter count of a GPT-2/3 style decoder.

    Formula: ``12 * L * h**2 + (vocab + seq) * h``. Each layer has 4h^2 attention
    weights (Q, K, V, output) and 8h^2 MLP weights (h -> 4h -> h); the embedding
    table is vocab*h (tied with the output head) and learned positions seq*h.
    Biases and layer norms (~13h per layer) are ignored.

    Args:
        layers: number of transformer blocks L.
        hidden: model width h.
        vocab: vocabulary size (GPT-2: 50257).
        seq: maximum sequence length (number of learned position embeddings).

    Returns:
        The parameter count as an int.
    """
    layers, hidden = _whole(layers, "layers"), _whole(hidden, "hidden")
    vocab, seq = _whole(vocab, "vocab"), _whole(seq, "seq", minimum=0)
    return 12 * layers * hidden**2 + (vocab + seq) * hidden


def _activation_bytes(batch, seq, hidden, layers, heads, ckpt_every, vocab, act_bytes) -> int:
    given = {"batch": batch, "seq": seq, "hidden": hidden, "layers": layers}
    if all(v is None for v in given.values()):
        if heads is not None or ckpt_every is not None or vocab is not None:
            raise ValueError(
                "heads/ckpt_every/vocab only matter for activations; also pass "
                "batch, seq, hidden and layers"
            )
        return 0
    missing = [k for k, v in given.items() if v is None] + ([] if heads is not None else ["heads"])
    if missing:
        raise ValueError(
            f"activation estimate needs batch, seq, hidden, layers and heads; "
            f"missing {', '.join(missing)}: pass them or omit all of them"
        )
    b, s = _whole(batch, "batch"), _whole(seq, "seq")
    h, nl = _whole(hidden, "hidden"), _whole(layers, "layers")
    a = _whole(heads, "heads")
    ci = _whole(1 if ckpt_every is None else ckpt_every, "ckpt_every")
    if ci > nl:
        raise ValueError(f"ckpt_every={ci} exceeds layers={nl}; use 1 <= ckpt_every <= layers")
    checkpoints = act_bytes * b * s * h * math.ceil(nl / ci)
    working = b * s * ci * (16 * h + 2 * a * s) * act_bytes // 2
    logits = 0 if vocab is None else 3 * 4 * b * s * _whole(vocab, "vocab")
    return checkpoints + working + logits


def estimate_memory(
    num_params,
    world_size,
    *,
    stage=None,
    optimizer="adam",
    precision="bf16",
    ema=False,
    batch=None,
    seq=None,
    hidden=None,
    layers=None,
    heads=None,
    ckpt_every=None,
    vocab=None,
    layer_params=None,
    gather_model=False,
    compute_copy=True,
    offload=None,
    accum_steps=1,
    state_dtype=None,
):
    """Estimate per-device training memory under ZeRO stage 0-3.

    With Φ parameters, N devices, p bytes/param for params, g for grads and K
    for optimizer state (incl. fp32 master), the ZeRO paper gives per device::

        stage 0 (plain DP):        (p + g + K) * Φ
        stage 1 (shard opt state): p*Φ + g*Φ + K*Φ/N
        stage 2 (+ shard grads):   p*Φ + (g + K)*Φ/N
        stage 3 (+ shard params):  (p + g + K)*Φ/N

    Mixed precision (bf16/fp16): p = g = 2 and K = optimizer state + 4 (fp32 master); adam K =
    8+4 = 12, sgd-with-momentum K = 4+4 = 8, adafactor K ≈ 0+4 (its factored moments, 4 bytes
    per row + column, are approximated as 0 per parameter). fp32: p = g = 4, no separate master,
    so adam K = 8, sgd 4, adafactor ≈ 0. Sharded quantities use ceil(Φ/N) elements per device
    (the padded flat shard). The EMA (``ema=True``) is fp32 and jaxzero shards it at every
    stage, stage 0 included: 4*Φ/N.

    Activations (with batch, seq, hidden, layers and heads) and stage 3's gathered layer (with
    ``layer_params``) or whole model (``gather_model``) are added as the module docstring says.

    Example: Φ = 7.5e9, N = 64, adam, bf16: 120 / 31.4 / 16.6 / 1.9 GB at stages 0-3 (Figure 1).

    Args:
        num_params: total parameter count Φ (int, or an integral float like 7.5e9).
        world_size: number of data-parallel devices N the state is sharded over.
        stage: 0, 1, 2 or 3; None returns one estimate per stage.
        optimizer: "adam", "sgd" (with momentum) or "adafactor".
        precision: "bf16" or "fp16" (mixed, fp32 master) or "fp32".
        ema: include a sharded fp32 EMA of the parameters.
        batch, seq, hidden, heads: per-device micro-batch size (activations are not
            sharded by ZeRO), sequence length, model width, attention heads.
        layers: number of transformer layers.
        ckpt_every: layers between activation checkpoints ci (1 <= ci <= layers).
        vocab: vocabulary size, for the logits term (needs the activation arguments).
        layer_params: parameters of one scanned layer, for stage 3 with ``ZeRO(layers=...)``.
        gather_model: stage 3 without ``layer_params``: add the whole model gathered in the
            compute dtype (the step's peak under the default ``ZeRO(stage=3)``).
        compute_copy: False: stage 3 in FSDP's layout (``Precision(compute_copy=False)``,
            p = 0 in mixed precision); ``stage`` must be 3 or None.
        offload, accum_steps: None, "optimizer" (stages 1-3: the optimizer state, the fp32
            master if not the params, and the EMA go to ``host``) or ``("optimizer",
            "params")`` (stage 3: the params too, and their gradient sums with accum_steps > 1)
            or ``("optimizer", "remainder")`` (``"optimizer"`` with the host's fp32 master
            kept as a 16-bit remainder and a carry bit beside the bf16 params: 2.125 bytes per
            param instead of 4 in ``host``, and so each way over PCIe; needs
            ``precision="bf16"`` and ``compute_copy=True``). The estimate stores every param
            that way; ``ZeRO`` keeps leaves of 4096 elements or fewer, and those whose last
            axis per device is not a multiple of 8, in fp32, a few bytes more.
        state_dtype: None (the optimizer state in fp32) or "bf16" / "fp16": the state stored
            in 2 bytes per value (:func:`jaxzero.with_state_dtype`): adam K = 4+4 = 8 in mixed
            precision, sgd 2+4; the fp32 master and the EMA keep 4 bytes.

    Returns:
        A :class:`MemoryEstimate`, or a list of four (stages 0..3) when stage is None.
        Raises ValueError / TypeError naming the bad argument and the accepted values.
    """
    phi, n = _whole(num_params, "num_params"), _whole(world_size, "world_size")
    _check_choices(optimizer, precision, stage, compute_copy, offload)
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype={state_dtype!r}: use None (fp32 optimizer state) or one of "
            f"{', '.join(s for s in STATE_DTYPES if s)}"
        )
    width = param_bytes(precision)  # bytes of one param, one grad (p = g)
    shape = (batch, seq, hidden, heads, ckpt_every, vocab)
    # layers also counts layer_params' layers: with it alone, it asks for no activations
    act_layers = None if layer_params is not None and all(v is None for v in shape) else layers
    act = _activation_bytes(batch, seq, hidden, act_layers, heads, ckpt_every, vocab, width)
    gathered = _gathered_bytes(phi, layer_params, layers, width, gather_model)
    sizes = (phi, n, optimizer, precision, ema, act, gathered, compute_copy, state_dtype)
    sums = sums_bytes(phi, n, layer_params, layers, _whole(accum_steps, "accum_steps"))
    kept = _check_remainder(offload, stage, precision, compute_copy)
    host = _stored_master if kept else lambda e: e

    def one(s):
        e = host(offloaded(_one_stage(s, *sizes), offload, compute_copy, sums))
        return dataclasses.replace(e, offload=check_offload(offload, s))

    return one(stage) if stage is not None else [one(s) for s in range(4)]


def _check_remainder(offload, stage, precision, compute_copy) -> bool:
    """Whether ``offload`` keeps the host's fp32 master as a remainder, after refusing it
    where there is no offloaded fp32 master beside bf16 params."""
    if not remainder_master(check_offload(offload, (1, 2, 3) if stage is None else stage)):
        return False
    if precision != "bf16" or not compute_copy:
        why = f"precision={precision!r}" if precision != "bf16" else "compute_copy=False"
        raise ValueError(
            f"offload={offload!r} with {why}: the remainder is the fp32 master's low half "
            "beside its bf16 compute copy, so it needs an offloaded fp32 master and bf16 "
            "params. Use precision='bf16' (with compute_copy=True), or offload='optimizer'."
        )
    return True


def _stored_master(e):
    """``e`` (offloaded) with the host's fp32 master as a 16-bit remainder and a carry bit:
    per device ``2 x shard + ceil(shard / 8)`` bytes where ``4 x shard`` were counted."""
    shard = -(-e.num_params // e.world_size)  # offload needs stage 1-3: the state sharded
    stored = _REMAINDER_LO_BYTES * shard + -(-shard * _REMAINDER_CARRY_BITS // 8)
    return dataclasses.replace(e, host=e.host - _MASTER_BYTES * shard + stored)


def _check_choices(optimizer, precision, stage, compute_copy=True, offload=None) -> None:
    offload = check_offload(offload, (0, 1, 2, 3) if stage is None else stage)  # None: all
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        raise ValueError(f"stage must be 0, 1, 2, 3 or None (all stages), got {stage!r}")
    if not isinstance(compute_copy, bool):
        raise TypeError(f"compute_copy must be a bool, got {compute_copy!r}")
    if not compute_copy and stage not in (3, None):
        raise ValueError(
            f"compute_copy=False is stage 3's layout (got stage={stage}); below stage 3 the "
            f"16-bit copy is the replicated compute params"
        )
    if not compute_copy and params_offloaded(offload):
        raise ValueError(
            f"compute_copy=False with offload={offload!r}: parameter offload writes each "
            f"layer's gradient into its 16-bit params' host buffer, so it needs the 16-bit "
            f"compute copy apart from the fp32 master (ZeRO refuses the pair too). Use "
            f"compute_copy=True, or offload='optimizer'."
        )


def param_bytes(precision: str) -> int:
    """Bytes of one compute-dtype param or gradient: 4 in fp32, 2 in bf16 and fp16."""
    return 4 if precision == "fp32" else 2


def _gathered_bytes(phi: int, layer_params, layers, width: int, gather_model=False) -> int:
    """Stage 3's gathered working set: with ``ZeRO(layers=...)`` (``layer_params``)
    ``(p + g) * layer_params + g * (phi - layers * layer_params)`` with p = g = ``width``;
    the whole model ``p * phi`` with ``gather_model``; else 0."""
    if not isinstance(gather_model, bool):
        raise TypeError(f"gather_model must be a bool, got {gather_model!r}")
    if layer_params is None:
        return width * phi if gather_model else 0
    if gather_model:
        raise ValueError(
            "gather_model=True (the whole model gathered) and layer_params= (one layer at a "
            "time) exclude each other; pass one of them"
        )
    one_layer = _whole(layer_params, "layer_params")
    if layers is None:
        raise ValueError("layer_params needs layers= (how many layers the stack holds)")
    rest = phi - one_layer * _whole(layers, "layers")
    if rest < 0:
        raise ValueError(
            f"layer_params={one_layer} x layers={layers} exceeds num_params={phi}; pass "
            f"the parameters of ONE layer"
        )
    p = g = width
    return (p + g) * one_layer + g * rest


def _one_stage(
    stage, phi, n, optimizer, precision, ema, act, gathered, compute_copy=True, state_dtype=None
):
    """The estimate of one stage from the checked sizes (see :func:`estimate_memory`)."""
    mixed = precision != "fp32"
    p = g = 2 if mixed else 4
    if stage == 3 and mixed and not compute_copy:
        p = 0  # the params are the fp32 master, counted in K
    state = _OPT_STATE_BYTES[optimizer] // (2 if state_dtype else 1)  # 2-byte values: half
    k = state + (_MASTER_BYTES if mixed else 0)
    shard = -(-phi // n)  # ceil(Φ/N): elements of the padded flat shard per device
    return MemoryEstimate(
        stage=stage,
        num_params=phi,
        world_size=n,
        optimizer_name=optimizer,
        precision=precision,
        params=p * (shard if stage >= 3 else phi),
        grads=g * (shard if stage >= 2 else phi),
        optimizer=k * (shard if stage >= 1 else phi),
        ema=_EMA_BYTES * shard if ema else 0,
        activations=act,
        gathered=gathered if stage == 3 else 0,
    )


_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """Parse a memory size such as "80GB", "79.6 GiB" or "512MB" into bytes.

    Args:
        text: number followed by a unit: B, KB, MB, GB, TB (powers of 1000) or
            KiB, MiB, GiB, TiB (powers of 1024), case-insensitive. An int is
            taken as bytes already.

    Returns:
        The size in bytes, rounded down to an int.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"memory size must be positive, got {text!r}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(
            f"cannot parse memory size {text!r}; write a number and a unit, "
            f"e.g. 80GB, 79.6GiB or 512MB"
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


def format_table(estimates, gpu_memory=None) -> str:
    """Render estimates as a text table, one row per stage.

    Args:
        estimates: a :class:`MemoryEstimate` or a sequence of them.
        gpu_memory: per-device budget in bytes (int) or a string like "80GB";
            when given, a ``fits`` column and a summary line are added.

    Returns:
        The table as a string (no trailing newline).
    """
    rows = [estimates] if isinstance(estimates, MemoryEstimate) else list(estimates)
    if not rows or not all(isinstance(e, MemoryEstimate) for e in rows):
        raise TypeError(
            f"format_table needs MemoryEstimate objects from estimate_memory(), got {estimates!r}"
        )
    budget = None if gpu_memory is None else parse_bytes(gpu_memory)
    cols = ["params", "grads", "optimizer"]
    cols += [c for c in ("ema", "activations", "gathered") if any(getattr(e, c) for e in rows)]
    header = ["stage", *cols, "total"] + (["fits"] if budget is not None else [])
    host = ["host"] if any(e.host for e in rows) else []
    header += host
    body = []
    for e in rows:
        cells = [str(e.stage)] + [format_bytes(getattr(e, c)) for c in cols]
        cells.append(format_bytes(e.total))
        if budget is not None:
            cells.append("yes" if e.fits(budget) else "NO")
        cells += [format_bytes(e.host)] if host else []
        body.append(cells)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)).rstrip()
    e0 = rows[0]
    count = next(
        (
            f"{e0.num_params / v:.2f}{u}"
            for u, v in (("T", 1e12), ("B", 1e9), ("M", 1e6))
            if e0.num_params >= v
        ),
        str(e0.num_params),
    )
    lines = [
        f"{count} params, {e0.world_size} devices, {e0.optimizer_name}, "
        f"{e0.precision} (bytes per device, GB = 1e9)",
        fmt(header),
        "  ".join("-" * w for w in widths),
    ]
    lines += [fmt(r) for r in body]
    if budget is not None:
        ok = [str(e.stage) for e in rows if e.fits(budget)]
        lines.append(
            f"fits in {format_bytes(budget)}: " + (f"stage {', '.join(ok)}" if ok else "no stage")
        )
    return "\n".join(lines)
