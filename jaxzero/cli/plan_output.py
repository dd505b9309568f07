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


def table(rows) -> str:
    from jaxzero.memory import format_bytes

    header = ["stage", "GPU-compiled", "estimate", "state", "verdict", "hidden AG+RS", "kernels"]
    host = any(r.report.host_bytes or r.estimate.host for r in rows)
    header[4:4] = ["host", "host est."] if host else []
    header.append("collectives per step (hidden share)")
    body = [
        [
            r.label,
            format_bytes(r.gpu_bytes),
            format_bytes(r.estimate.total),
            format_bytes(r.state_bytes),
            *([format_bytes(r.report.host_bytes), format_bytes(r.estimate.host)] if host else []),
            r.verdict,
            hidden(r.report),
            str(r.report.kernels_per_step),
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
