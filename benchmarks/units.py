"""Stage 3 on unscanned models (issue 29): a Python loop of Linen blocks and an ``nnx.List`` of
NNX blocks, jaxzero stage 3 (whole model gathered per micro-batch; without the compute copy;
per unit, ``ZeRO(units=PATTERN)``, with and without the compute copy) against the GSPMD-FSDP
peer, compiled for 8 and 64 H100s without a GPU (``jaxzero.gpu.compile_only_mesh``), bf16,
Adam, 1 x 512 tokens per device.

    python benchmarks/units.py                    # GPT 12 x 1024, 16 x 2048, NNX 12 x 1024
    python benchmarks/units.py --quick            # 4 blocks x 256, 128 tokens, N = 8
    python benchmarks/units.py --devices 8        # one cluster size
    python benchmarks/units.py --out benchmarks/results/units.md
    python benchmarks/units.py --quantize --out benchmarks/results/units-quantized.md

The models are :mod:`jaxzero.gpu.models`' GPT decoder with ``loop="python"`` (``nn.remat`` per
block, params ``block_0`` ... ``block_{L-1}``) and its NNX twin :func:`nnx_model` (params
``layers/0`` ... ``layers/{L-1}``): LayerNorm, biases, GELU MLP of width 4h, learned
positions, head tied to the embedding. The vocabulary (15,872) is the one that makes the
issue's parameter counts with this decoder (168M for 12 x 1024, 839M for 16 x 2048).

Per row, per device per step: peak = arguments + temporaries (``memory_analysis``, as in
benchmarks/overlap.py), its ratio to the peer's, for the units rows the formula the peak must
stay under (:func:`jaxzero.gpu.plan.unit_bound`: persistent state + two units gathered + one
unit's full gradient + the full gradients of the leaves outside the units + activations),
all-gather + reduce-scatter payload bytes (loop trip counts applied), the share of those bytes
hidden behind compute (:meth:`jaxzero.gpu.CompileReport.hidden_share`) and its ceiling, the
share any schedule of the step's data flow could hide
(:meth:`~jaxzero.gpu.CompileReport.hideable_share`), and kernels launched. The peer is
benchmarks/overlap.py's :func:`peer_row`: fp32 params and Adam state sharded by
``NamedSharding`` on the same dimension rule as jaxzero, bf16 compute, plain ``optax`` under
``jax.jit``. The units column needs ``jz.ZeRO(units=)``; without it the column reads
"n/a (units= not available)".

``--quantize`` writes only the per-unit stage 3 row with ZeRO++'s int8 collectives
(``quantize="weights"``: qwZ, ``quantize="both"``: qwZ + qgZ) next to the exact per-unit row
and the peer, for the first model (GPT 12 x 1024; N = 8 by default): their bytes count the
all-to-alls that replace the reduce-scatters, and the hidden share and its ceiling are over
all-gather, reduce-scatter and all-to-all bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import optax  # noqa: E402
from overlap import jaxzero_row, peer_row  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import gpu  # noqa: E402
from jaxzero.gpu.models import (  # noqa: E402
    abstract_params,
    batch_shapes,
    hf_llama,
    make_loss,
    model_shape,
    nnx_model,
)
from jaxzero.gpu.plan import unit_bound  # noqa: E402

DEVICES = (8, 64)
KIND = "h100"
VOCAB = 15872  # 12 x 1024: 167.9M params, 16 x 2048: 839.3M (the 168M and 839M)
NA = "n/a (units= not available)"


@dataclasses.dataclass(frozen=True)
class Model:
    label: str
    shape: object  # jaxzero.gpu.models.ModelShape
    nnx: bool  # the NNX twin (nnx_model) instead of the Linen decoder
    units: str  # the ZeRO(units=) pattern naming one block's params
    hf_ffn: int = 0  # > 0: Hugging Face's FlaxLlamaForCausalLM of this MLP width instead

    def build(self):
        """(abstract params, loss_fn)."""
        if self.hf_ffn:
            s = self.shape
            return hf_llama(
                s.layers, s.hidden, self.hf_ffn, s.vocab, s.seq, jnp.bfloat16, True, heads=16
            )
        if self.nnx:
            return nnx_model(self.shape)
        return abstract_params(self.shape), make_loss(self.shape)

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.build()[0]))


def models(quick: bool) -> list[Model]:
    def gpt(layers, hidden, seq=512, vocab=VOCAB):
        return model_shape(
            layers=layers, hidden=hidden, vocab=vocab, seq=seq, arch="gpt", loop="python"
        )

    if quick:
        small = gpt(4, 256, seq=128, vocab=1024)
        return [
            Model("GPT, Python loop of nn.remat blocks, 4 x 256", small, False, r"block_\d+"),
            Model("NNX, nnx.List of 4 blocks x 256", small, True, r"layers/\d+"),
        ]
    llama = gpt(12, 1024, vocab=8192)  # 171M params with FlaxLlama's MLP of width 2816
    return [
        Model("GPT, Python loop of nn.remat blocks, 12 x 1024", gpt(12, 1024), False, r"block_\d+"),
        Model("GPT, Python loop of nn.remat blocks, 16 x 2048", gpt(16, 2048), False, r"block_\d+"),
        Model("NNX, nnx.List of 12 blocks x 1024", gpt(12, 1024), True, r"layers/\d+"),
        Model(
            "Hugging Face FlaxLlamaForCausalLM (no remat), 12 x 1024",
            llama,
            False,
            r"model/layers/\d+",
            hf_ffn=2816,
        ),
    ]


def units_available() -> bool:
    """Whether this jaxzero's ``ZeRO`` takes ``units=``."""
    return "units" in inspect.signature(jz.ZeRO).parameters


def _no_copy():
    return jz.Precision.create("bf16", compute_copy=False)


def _units_row(m: Model, mesh, options, precision, prefetch=True):
    if not units_available():
        return None
    zero = {"units": m.units, "prefetch": prefetch}
    return jaxzero_row(m.shape, mesh, 3, False, options, precision, model=m.build(), **zero)


# (label, row(model, mesh, options) -> figures or None when the variant is not available)
VARIANTS = (
    (
        "jaxzero stage 3 (whole model)",
        lambda m, mesh, o: jaxzero_row(m.shape, mesh, 3, False, o, model=m.build()),
    ),
    (
        "jaxzero stage 3, compute_copy=False",
        lambda m, mesh, o: jaxzero_row(m.shape, mesh, 3, False, o, _no_copy(), model=m.build()),
    ),
    ("GSPMD-FSDP peer", lambda m, mesh, o: peer_row(m.shape, mesh, True, o, model=m.build())),
    (
        "jaxzero stage 3 units",
        lambda m, mesh, o: _units_row(m, mesh, o, "bf16"),
    ),
    (
        "jaxzero stage 3 units, compute_copy=False",
        lambda m, mesh, o: _units_row(m, mesh, o, _no_copy()),
    ),
    (
        "jaxzero stage 3 units, prefetch=False",
        lambda m, mesh, o: _units_row(m, mesh, o, "bf16", prefetch=False),
    ),
    (
        "jaxzero stage 3 units, prefetch=False, compute_copy=False",
        lambda m, mesh, o: _units_row(m, mesh, o, _no_copy(), prefetch=False),
    ),
)
WIRES = (None, "weights", "both")  # --quantize: the per-unit row exact, qwZ, qwZ + qgZ
WIRE_KINDS = ("all-gather", "reduce-scatter", "all-to-all")
PEER = "GSPMD-FSDP peer"
UNITS = "jaxzero stage 3 units"
NO_COPY = "compute_copy=False"


def _mb(b: int) -> str:
    return f"{b / 1e6:.0f} MB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


def measure(model: Model, mesh, options) -> dict:
    """{variant label: figures or None}, printed as they come."""
    out = {}
    for label, row in VARIANTS:
        out[label] = f = row(model, mesh, options)
        got = NA if f is None else f"{_mb(f['args_temp'])}, {f['kernels']} kernels"
        print(f"  {model.label} | {label}: {got}", file=sys.stderr, flush=True)
    return out


def model_table(model: Model, n: int, rows: dict) -> list[str]:
    shape = model.shape
    peer = rows[PEER]["args_temp"]
    lines = [
        f"## {model.label}, N = {n}: {model.num_params:,} params, units=`{model.units}`",
        "",
        "| variant | peak (args + temp) | / peer | formula | AG+RS bytes | hidden AG+RS | ceiling "
        "| kernels |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, f in rows.items():
        if f is None:
            lines.append(f"| {label} | {NA} | | | | | | |")
            continue
        share = lambda k, f=f: "-" if f[k] is None else f"{f[k]:.2f}"
        bound = "-"
        if label.startswith(UNITS) and not model.hf_ffn:  # the formula knows the GPT decoder
            copy, prefetch = not label.endswith(NO_COPY), "prefetch=False" not in label
            bound = _mb(unit_bound(shape, n, compute_copy=copy, prefetch=prefetch))
        lines.append(
            f"| {label} | {_mb(f['args_temp'])} | {f['args_temp'] / peer:.2f} | {bound} | "
            f"{_mb(f['ag_rs_bytes'])} | {share('ag_rs_hidden')} | {share('ag_rs_max')} | "
            f"{f['kernels']} |"
        )
    return lines


def summary_table(results: list[tuple[Model, int, dict]]) -> list[str]:
    """The issue's layout: peak per device per model and cluster size, ratio to the peer in
    parentheses."""
    labels = [label for label, _ in VARIANTS]
    lines = [
        "| model | N | whole model in bf16 | " + " | ".join(labels) + " |",
        "|---|---|---|" + "---|" * len(labels),
    ]
    for model, n, rows in results:
        peer = rows[PEER]["args_temp"]
        cells = [
            NA
            if rows[k] is None
            else f"{_mb(rows[k]['args_temp'])} ({rows[k]['args_temp'] / peer:.2f})"
            for k in labels
        ]
        bf16 = _mb(2 * model.num_params)
        params = f"{model.num_params / 1e6:.0f}M params"
        lines.append(f"| {model.label} ({params}) | {n} | {bf16} | " + " | ".join(cells) + " |")
    return lines


def header(argv: list[str], flags: str, devices) -> list[str]:
    plugin = next(
        (d.version for d in _distributions() if d.metadata["Name"].startswith("jax-cuda")), "none"
    )
    command = " ".join(["python", "benchmarks/units.py", *argv])
    return [
        "# Stage 3 on unscanned models against the GSPMD-FSDP peer",
        "",
        f"Command: `{command}`",
        "",
        f"Date: {datetime.date.today().isoformat()}. Machine: deviceless XLA:GPU compiles for "
        f"{' and '.join(map(str, devices))} x {KIND.upper()} (`jz.gpu.compile_only_mesh`) on "
        f"{platform.machine()} {platform.system()}, no GPU. Versions: jax {jax.__version__}, "
        f"jaxlib {jaxlib.__version__}, CUDA plugin {plugin}, flax {flax.__version__}, optax "
        f"{optax.__version__}, Python {platform.python_version()}.",
        "",
        f"bf16 (fp32 master), Adam, batch 1 per device, XLA flags: {flags}. Peak = arguments + "
        f"temporaries per device; ratios in parentheses are against the GSPMD-FSDP peer "
        f"compiled in the same process.",
        "",
    ]


def wire_row(m: Model, mesh, options, quantize) -> dict:
    """The per-unit stage 3 row (bf16, prefetch) with ``ZeRO(quantize=quantize)``: peak,
    all-gather + reduce-scatter + all-to-all bytes, their hidden share and ceiling, kernels."""
    params, loss_fn = m.build()
    zero = jz.ZeRO(
        optax.adam(1e-4), mesh, stage=3, precision="bf16", units=m.units, quantize=quantize
    )
    step = jz.make_train_step(loss_fn, zero)
    n = mesh.shape["data"]
    rep = gpu.compile_report(step, params, batch_shapes(m.shape, n), compiler_options=options)
    return {
        "args_temp": rep.argument_bytes + rep.temp_bytes,
        "bytes": sum(rep.payload(k) for k in WIRE_KINDS),
        "hidden": rep.hidden_share(*WIRE_KINDS),
        "max": rep.hideable_share(*WIRE_KINDS),
        "kernels": rep.kernels_per_step,
    }


def quantized_table(model: Model, n: int, mesh, options) -> list[str]:
    """``--quantize``: the peer, then the per-unit row exact, with qwZ and with qwZ + qgZ."""
    peer = peer_row(model.shape, mesh, True, options, model=model.build())
    rows = {
        PEER: {
            "args_temp": peer["args_temp"],
            "bytes": peer["ag_rs_bytes"],
            "hidden": peer["ag_rs_hidden"],
            "max": peer["ag_rs_max"],
            "kernels": peer["kernels"],
        }
    }
    for q in WIRES:
        label = UNITS + ("" if q is None else f', quantize="{q}"')
        rows[label] = f = wire_row(model, mesh, options, q)
        print(f"  {model.label} | {label}: {_mb(f['args_temp'])}", file=sys.stderr, flush=True)
    exact = rows[UNITS]["bytes"]
    lines = [
        f"## {model.label}, N = {n}: {model.num_params:,} params, units=`{model.units}`",
        "",
        "| variant | peak (args + temp) | / peer | AG+RS+A2A bytes | / exact units | hidden "
        "| ceiling | kernels |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, f in rows.items():
        lines.append(
            f"| {label} | {_mb(f['args_temp'])} | {f['args_temp'] / peer['args_temp']:.2f} | "
            f"{_mb(f['bytes'])} | {f['bytes'] / exact:.2f} | {f['hidden']:.2f} | "
            f"{f['max']:.2f} | {f['kernels']} |"
        )
    return lines


def _distributions():
    from importlib import metadata

    return metadata.distributions()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 blocks x 256, 128 tokens")
    ap.add_argument(
        "--flags",
        choices=("default", "recommended"),
        default="default",
        help="XLA's default flags or jaxzero.gpu.recommended_xla_flags()",
    )
    ap.add_argument(
        "--devices",
        type=int,
        nargs="+",
        help=f"cluster sizes (default: {' and '.join(map(str, DEVICES))}; 8 with --quick)",
    )
    ap.add_argument(
        "--quantize",
        action="store_true",
        help='only the per-unit row exact, quantize="weights" and "both", first model, N = 8',
    )
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    devices = args.devices or ((8,) if args.quick or args.quantize else DEVICES)
    # the compile-only meshes first: the flags' check compiles on the CPU, which initializes
    # jax's backends without the CUDA plugin's compile-only topology
    meshes = {n: gpu.compile_only_mesh(KIND, n) for n in devices}
    options = gpu.xla_options() if args.flags == "recommended" else None
    flags = "`" + " ".join(gpu.recommended_xla_flags()) + "`" if options else "XLA's defaults"
    if args.quantize:
        return _write(args, quantized_main(argv, flags, devices, meshes, options, args.quick))
    results = []
    for n in devices:
        mesh = meshes[n]
        for model in models(args.quick):
            tokens = model.shape.seq * model.shape.batch
            print(
                f"{model.label}, N = {n}, {tokens} tokens per device", file=sys.stderr, flush=True
            )
            results.append((model, n, measure(model, mesh, options)))
    out = header(argv, flags, devices) + summary_table(results) + [""]
    for model, n, rows in results:
        out += model_table(model, n, rows) + [""]
    _write(args, out)


def quantized_main(argv, flags, devices, meshes, options, quick) -> list[str]:
    out = header(argv, flags, devices)
    out[0] += ": ZeRO++ quantized collectives on the per-unit row"
    out[-2] = out[-2].replace("ratios in parentheses are", "/ peer is")
    for n in devices:
        model = models(quick)[0]
        print(f"{model.label}, N = {n}, quantized rows", file=sys.stderr, flush=True)
        out += quantized_table(model, n, meshes[n], options) + [""]
    return out


def _write(args, out: list[str]) -> None:
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
