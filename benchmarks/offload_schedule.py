"""What XLA:GPU's scheduler hides of offload's PCIe transfers, and what it would hide if it
knew their cost (decision 44). Deviceless: compiled for 8 H100s, nothing runs.

    python benchmarks/offload_schedule.py --out benchmarks/results/offload_schedule.md
    python benchmarks/offload_schedule.py --tiny      # a 2-layer GPT, seconds

LLaMA-7B, stage 3 per layer, 8 x 2048 tokens per GPU, ``offload=("optimizer", "params")``
(the per-layer fetches of the params in the forward and backward loops, each layer's gradient
written into its host slot, then the streamed update) and ``offload="optimizer"`` (the
streamed update alone), each compiled four ways:

* ``default``: XLA's flags as a plain script gets them;
* ``async limit``: ``xla_gpu_experimental_parallel_async_compute_limit=16`` (XLA's default
  lets two async computations, which the host slices are, be in flight at once);
* ``latency profile``: a profile in the format of XLA's profile-guided latency estimator
  (``xla_gpu_pgle_profile_file_or_directory_path``, what jax's PGLE writes from a GPU run)
  with each host transfer's cost at the link's rate (55 GB/s) and each gemm's and cuDNN
  attention's at its FLOPs over half the bf16 peak, written from the default compile's HLO:
  without one, XLA's estimator takes a host transfer for a cheap operation and does not stretch
  it across compute;
* both.

Each row: the PCIe bytes each way, the share of them a compute kernel overlaps
(``jaxzero.gpu.transfers``), and the all-gathers' and reduce-scatters' hidden shares
(``jaxzero.gpu.overlap``). The profile's costs are a model, not a measurement: on a GPU, jax's
PGLE (``jax_enable_pgle``) measures them.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import optax  # noqa: E402
from common import emit, md_table  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import gpu  # noqa: E402
from jaxzero.gpu.hlo import _ARRAY, _CALLS, _dtype_bytes, parse_computations  # noqa: E402
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape  # noqa: E402
from jaxzero.gpu.offload_cost import MFU  # noqa: E402
from jaxzero.gpu.targets import gpu_spec  # noqa: E402

ASYNC_LIMIT = {"xla_gpu_experimental_parallel_async_compute_limit": 16}
_START = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) (fusion-start|copy-start)\(")
_KERNEL = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? (fusion|custom-call)\(")
_DOT = re.compile(r"= \S+ dot\(%([\w.\-]+), %([\w.\-]+)\).*?lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _dot_flops(body: list[tuple[str, str, str]]) -> float:
    """``2 x output x contracted`` summed over the dots of a fused computation."""
    types = {n: _ARRAY.search(line.split("=", 1)[1]) for n, _, line in body}
    flops = 0.0
    for name, op, line in body:
        m = _DOT.search(line) if op == "dot" else None
        if m is None or types.get(m.group(1)) is None:
            continue
        lhs = _dims(types[m.group(1)].group(2))
        out = _dims(types[name].group(2))
        flops += 2.0 * math.prod(out) * math.prod(lhs[d] for d in _dims(m.group(3)))
    return flops


def _attention_flops(line: str) -> float:
    """cuDNN attention's ``4 x b x h x s^2 x d`` (forward; 2.5x for the backward), from its
    first operand, the query, in its (batch, seq, heads, head_dim) layout."""
    q = _dims(_ARRAY.findall(line.split("custom-call(", 1)[1])[0][1])
    if len(q) != 4:
        return 0.0
    b, s, h, d = q
    return 4.0 * b * h * s * s * d * (2.5 if "Backward" in line else 1.0)


def latency_profile(hlo: str, kind: str = "h100") -> str:
    """A profile for XLA's profile-guided latency estimator (text ``ProfiledInstructionsProto``)
    of ``hlo``: host transfers at the link's rate, gemms and attention at their FLOPs over
    :data:`MFU` of the bf16 peak (module docstring)."""
    spec = gpu_spec(kind)
    flops_per_us = MFU * spec.bf16_flops / 1e6
    comps, _ = parse_computations(hlo)
    lines = []
    for ops in comps.values():
        for _, _, line in ops:
            m = _START.match(line)
            if m and "S(5)" in m.group(2):
                device = [t for t in re.findall(r"\w+\[[\d,]*\]\{[^}]*\}", m.group(2))]
                moved = max(
                    (sum(_dtype_bytes(t).values()) for t in device if "S(5)" not in t), default=0
                )
                us = moved / (spec.pcie_bytes_per_s / 1e6)
                lines.append(f'costs {{ name: "{m.group(1)}" cost_us: {us:.3f} }}')
                continue
            m = _KERNEL.match(line)
            if m is None:
                continue
            if m.group(2) == "custom-call" and "cudnn" in line and "fmha" in line.lower():
                flops = _attention_flops(line)
            elif m.group(2) == "fusion" and "kind=kCustom" in line:
                callee = _CALLS.search(line)
                flops = _dot_flops(comps.get(callee.group(1), [])) if callee else 0.0
            else:
                continue
            if flops:
                lines.append(
                    f'costs {{ name: "{m.group(1)}" cost_us: {flops / flops_per_us:.3f} }}'
                )
    return "\n".join(lines) + "\n"


def _row(name, off, report):
    t = report.host_transfers
    gb = jz.memory.format_bytes
    return (
        name,
        off,
        gb(t.h2d_bytes),
        gb(t.d2h_bytes),
        f"{t.share:.0%}",
        f"{report.hidden_share('all-gather'):.0%}",
        f"{report.hidden_share('reduce-scatter'):.0%}",
    )


def run(shape, n: int, offloads) -> list[tuple]:
    rows = []
    for off in offloads:
        mesh = gpu.compile_only_mesh("h100", n)
        zero = jz.ZeRO(
            optax.adam(1e-3),
            mesh,
            stage=3,
            precision="bf16",
            layers="layers",
            offload=off,
        )
        step = jz.make_train_step(make_loss(shape), zero)
        batch = batch_shapes(shape, shape.batch * n)
        compile_ = functools.partial(gpu.compile_report, step, abstract_params(shape), batch)
        base = compile_()
        label = off if isinstance(off, str) else ",".join(off)
        with tempfile.NamedTemporaryFile("w", suffix=".pbtxt", delete=False) as fh:
            fh.write(latency_profile(base.hlo_text))
        profile = {"xla_gpu_pgle_profile_file_or_directory_path": fh.name}
        rows.append(_row("default", label, base))
        rows.append(_row("async limit", label, compile_(compiler_options=ASYNC_LIMIT)))
        rows.append(_row("latency profile", label, compile_(compiler_options=profile)))
        rows.append(_row("both", label, compile_(compiler_options={**profile, **ASYNC_LIMIT})))
        os.unlink(fh.name)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT at N = 8")
    parser.add_argument("--out", help="also write the markdown here")
    args = parser.parse_args(argv)
    if args.tiny:
        shape = model_shape(layers=2, hidden=256, heads=2, vocab=512, seq=16, batch=1)
        title = "a 2-layer GPT, 256 wide, at N = 8"
    else:
        shape = model_shape(layers=32, hidden=4096, heads=32, vocab=32000, seq=2048, batch=8)
        title = "LLaMA-7B at N = 8 H100s, 8 x 2048 tokens per GPU"
    rows = run(shape, 8, (("optimizer", "params"), "optimizer"))
    header = ("compile", "offload", "PCIe h2d", "PCIe d2h", "PCIe hidden", "AG hidden", "RS hidden")
    emit(
        f"# What XLA:GPU hides of offload's transfers: {title}, stage 3 per layer\n\n"
        f"Command: `python benchmarks/offload_schedule.py{' --tiny' if args.tiny else ''}`. "
        f"Deviceless compiles (module docstring).\n\n" + md_table(header, rows),
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
