"""What ``jaxzero plan`` prints around the compiled figures: the progress bar, the table, the
network cost lines and the notes (:mod:`jaxzero.cli.plan` runs the command)."""

from __future__ import annotations

import sys


def progress(total_hint: int):
    """``(on_case, close)``: a tqdm bar on stderr, or plain lines where tqdm is absent."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None:

        def on_case(label, i, total):
            print(f"[{i + 1}/{total}] compiling stage {label} ...", file=sys.stderr, flush=True)

        return on_case, lambda: None
    bar = tqdm(total=total_hint, desc="compiling", unit="stage", file=sys.stderr, leave=False)

    def on_case(label, i, total):
        bar.n = i
        bar.set_postfix_str(f"stage {label}")  # refreshes the bar

    def close():
        bar.n = bar.total
        bar.close()

    return on_case, close


def hidden(report) -> str:
    """The hidden share of all-gather + reduce-scatter bytes and its ceiling (what any schedule
    of the step's data flow could hide), or "-" when neither moves any (stage 0 only
    all-reduces)."""
    if not report.payload("all-gather") + report.payload("reduce-scatter"):
        return "-"
    kinds = ("all-gather", "reduce-scatter", "all-to-all")  # all-to-all: quantized gradients
    return f"{report.hidden_share(*kinds):.0%} of max {report.hideable_share(*kinds):.0%}"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _cost_cells(cost) -> list[str]:
    """The offload columns of one row: host->device and device->host bytes per step, their
    hidden share, the predicted step (compute + exposed transfer), its ratio to the compute
    alone, and ZeRO-Infinity's efficiency (:mod:`jaxzero.gpu.offload_cost`)."""
    from jaxzero.memory import format_bytes

    if cost is None:
        return ["-"] * 6
    return [
        format_bytes(cost.h2d_bytes),
        format_bytes(cost.d2h_bytes),
        f"{cost.hidden_share:.0%}",
        _ms(cost.step_seconds),
        f"{cost.slowdown:.2f}x",
        f"{cost.formula_efficiency:.0%}",
    ]


def offload_note(rows) -> str | None:
    """What the offload columns assume, or None without them."""
    from jaxzero.gpu.offload_cost import MFU

    cost = next((r.cost for r in rows if r.cost is not None), None)
    if cost is None:
        return None
    return (
        f"PCIe: host->device (h2d) and device->host (d2h) bytes per GPU per step read from "
        f"the compiled HLO (copy-start/done and async slices to or from host memory, loop trip "
        f"counts applied; jaxzero.gpu.transfers); hidden: the share a compute kernel overlaps "
        f"in the schedule; step: compute ({cost.flops:.3g} FLOP = 8 x params x tokens per GPU "
        f"at {MFU:.0%} of the bf16 peak: {_ms(cost.compute_seconds)}) + the exposed "
        f"bytes at {cost.gbps:g} GB/s (--pcie-gbps); x compute: step over the compute alone, "
        f"the step without offload in this model; ZI eff.: ZeRO-Infinity's "
        f"ait*bw/(ait*bw+peak), ait = FLOP per byte of the offloaded state moved twice "
        f"({cost.ait:.0f} FLOP/B), nothing overlapped."
    )


def _fraction(f) -> str:
    return "none" if f is None else f if isinstance(f, str) else f"{f:g}"


def table(rows, fractions: bool = False) -> str:
    """The plan's table; ``fractions``: a column of each row's offload fraction (``--offload
    auto`` or ``--offload-fraction``)."""
    from jaxzero.memory import format_bytes

    header = ["stage", "GPU-compiled", "estimate", "state", "verdict", "hidden AG+RS", "kernels"]
    host = any(r.report.host_bytes or r.estimate.host for r in rows)
    header[4:4] = ["host", "host est."] if host else []
    header[1:1] = ["offloaded"] if fractions else []
    cost = [r.cost for r in rows if r.cost is not None]
    if cost:
        header += [
            "PCIe h2d",
            "PCIe d2h",
            "PCIe hidden",
            f"step @{cost[0].gbps:g} GB/s",
            "x compute",
            "ZI eff.",
        ]
    header.append("collectives per step (hidden share)")
    body = [
        [
            r.label,
            *([_fraction(r.fraction) + (" + params" * r.params_offloaded)] if fractions else []),
            format_bytes(r.gpu_bytes),
            format_bytes(r.estimate.total),
            format_bytes(r.state_bytes),
            *([format_bytes(r.report.host_bytes), format_bytes(r.estimate.host)] if host else []),
            r.verdict,
            hidden(r.report),
            str(r.report.kernels_per_step),
            *(_cost_cells(r.cost) if cost else []),
            f"{r.report.collective_summary()} ({r.report.overlap_summary()})",
        ]
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(len(header) - 1)]
    fmt = lambda cells: "  ".join(
        [c.ljust(w) for c, w in zip(cells[:-1], widths, strict=True)] + [cells[-1]]
    )
    return "\n".join(
        [fmt(header), fmt(["-" * w for w in widths] + ["-" * 20])] + [fmt(b) for b in body]
    )


def network(rows, args) -> str:
    """Each row's collective bytes per device per step and the share of them that crosses
    nodes (:func:`jaxzero.gpu.hlo.cross_node_bytes`), with ``--network-gbps`` the time each
    takes (``wire_time``, ``cross_node_time``)."""
    from jaxzero.gpu.hlo import cross_node_bytes
    from jaxzero.gpu.network import COLLECTIVES, cross_node_time, wire_time
    from jaxzero.memory import format_bytes

    node, n, gbps = args.gpus_per_node, args.devices // args.replicas, args.network_gbps
    speeds = f", {gbps[0]:g} Gbit/s intra-node, {gbps[1]:g} Gbit/s inter-node" if gbps else ""
    lines = [
        f"network ({node} GPUs per node{speeds}): collective bytes per device per step, and "
        "the bytes of the collectives whose groups span nodes (cross-node)"
        + (
            ", each with the time it takes on the ring's slowest link, overlap not counted"
            if gbps
            else ""
        )
    ]
    width = max(len(r.label) for r in rows)
    for r in rows:
        if gbps:
            t = wire_time(r.report, args.devices, *gbps, node)
            c = cross_node_time(r.report, n, gbps[1], node)
            row = f"{format_bytes(t.bytes):>10}  {t.seconds * 1e3:9.1f} ms ({t.link})"
            row += f"  cross-node {format_bytes(c.bytes):>10}  {c.seconds * 1e3:9.1f} ms"
        else:
            total = sum(r.report.payload(kind) for kind in COLLECTIVES)
            cross = cross_node_bytes(r.report.hlo_text, node, n)
            row = f"{format_bytes(total):>10}  cross-node {format_bytes(cross):>10}"
        lines.append(f"  {r.label:<{width}} {row}")
    return "\n".join(lines)


def fallback_note(rows) -> str | None:
    """A line naming the stages compiled without Triton gemms (``CompileReport
    .triton_gemm_fallback``) and why, or None when every stage compiled as asked."""
    hit = [r for r in rows if r.report.triton_gemm_fallback]
    if not hit:
        return None
    return (
        f"without Triton gemms (stage {', '.join(r.label for r in hit)}): XLA:GPU's Triton gemm "
        f"emitter failed ({hit[0].report.triton_gemm_fallback}), so the step was compiled "
        "again with xla_gpu_enable_triton_gemm=False (gemms by cuBLAS); the figures are that "
        "compile's."
    )


def fraction_note(rows) -> str | None:
    """``--offload auto``'s compiles, each fraction tried with its peak, or None."""
    from jaxzero.memory import format_bytes

    tried = [(r.label, r.tries) for r in rows if r.tries]
    if not tried:
        return None
    one = lambda t: "; ".join(f"{_fraction(f)}: {format_bytes(p)}, {h:.0%}" for f, p, h in t)
    lines = [f"{label}: {one(t)}" for label, t in tried]
    return (
        "offloaded: the share of the master, Adam and EMA bytes per GPU in host memory "
        "(ZeRO(offload_fraction=...)), largest leaves first; auto compiled everything offloaded, "
        "then the fraction where the device takes the rest byte for byte, rounded up to 0.01, "
        "bisected towards 1 where it hides less of the AG+RS bytes, and where all of it does not "
        "fit, the params too (1 + params: ZeRO(offload=('optimizer', 'params')); "
        "jaxzero.gpu.offload_fraction; "
        "per fraction tried: compiled peak, hidden AG+RS: " + " | ".join(lines) + ")."
    )
