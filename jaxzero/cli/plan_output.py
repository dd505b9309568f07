"""What ``jaxzero plan`` prints around the compiled figures: the table (compact, or every
column with ``--wide``), the network cost lines and the notes (:mod:`jaxzero.cli.plan` runs the
command; :mod:`jaxzero.cli.plan_pick` prints the row to use, :mod:`jaxzero.cli.plan_logs` the
progress and XLA's log lines)."""

from __future__ import annotations

import textwrap

WIDTH = 100  # the compact table and its notes fit a terminal this wide


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


def _format(header: list[str], body: list[list[str]], last_free: bool) -> str:
    """Columns two spaces apart, a rule under the header; ``last_free``: the last column is
    not padded (the wide table's collectives)."""
    n = len(header) - last_free
    widths = [max(len(x[i]) for x in [header, *body]) for i in range(n)]
    rule = ["-" * w for w in widths] + (["-" * 20] if last_free else [])
    fmt = lambda cells: "  ".join(
        [c.ljust(w) for c, w in zip(cells[:n], widths, strict=True)] + cells[n:]
    ).rstrip()
    return "\n".join([fmt(header), fmt(rule)] + [fmt(b) for b in body])


def short_verdict(report) -> str:
    """The compact table's verdict: ``"fits, 2.35 GB spare"``, ``"short by 17.79 MB"`` (the
    memory it is judged against is said once, in the legend)."""
    from jaxzero.memory import format_bytes

    if report.fits is None:
        return f"needs {format_bytes(report.peak_bytes)}"
    if report.fits:
        return f"fits, {format_bytes(report.headroom_bytes)} spare"
    return f"short by {format_bytes(-report.headroom_bytes)}"


def _step(cost) -> str:
    return "-" if cost is None else f"{_ms(cost.step_seconds)}, {cost.slowdown:.2f}x"


def _columns(rows, fractions: bool) -> list[tuple[str, list[str]]]:
    """The compact table's columns, ``(header, cells)``, most important first."""
    from jaxzero.memory import format_bytes

    cols = [("stage", [r.label for r in rows])]
    if fractions:
        cells = [_fraction(r.fraction) + (" + params" * r.params_offloaded) for r in rows]
        cols.append(("offloaded", cells))
    cols.append(("GPU peak", [format_bytes(r.gpu_bytes) for r in rows]))
    cols.append(("verdict", [short_verdict(r.report) for r in rows]))
    cost = [r.cost for r in rows if r.cost is not None]
    if cost:
        cols.append((f"step @{cost[0].gbps:g} GB/s", [_step(r.cost) for r in rows]))
    if any(r.report.host_bytes for r in rows):
        cols.append(("host", [format_bytes(r.report.host_bytes) for r in rows]))
    cols.append(("hidden AG+RS", [hidden(r.report) for r in rows]))
    return cols


def compact_table(rows, fractions: bool = False, width: int = WIDTH) -> str:
    """The default table: stage, offloaded share (``fractions``), the compiled peak, the
    verdict, with offload the predicted step and the host bytes, and the hidden AG+RS share;
    the last columns dropped while a line would be wider than ``width``."""
    cols = _columns(rows, fractions)
    while True:
        body = [[cells[i] for _, cells in cols] for i in range(len(rows))]
        text = _format([h for h, _ in cols], body, False)
        if len(cols) <= 3 or max(map(len, text.splitlines())) <= width:
            return text
        cols.pop()


def legend(rows, wrap: int = WIDTH) -> str:
    """What the compact table's columns are, wrapped to ``wrap`` columns."""
    from jaxzero.memory import format_bytes

    memory = rows[0].report.hbm_bytes
    judged = f"against {format_bytes(memory)} per GPU" if memory else "(no GPU memory given)"
    text = (
        f"GPU peak: the compiled step's peak bytes per GPU (XLA:GPU), which the verdict judges "
        f"{judged}."
    )
    cost = next((r.cost for r in rows if r.cost is not None), None)
    if cost is not None:
        text += (
            f" step: the compute plus the PCIe transfers left exposed at {cost.gbps:g} GB/s, and "
            "its ratio to the compute alone. host: pinned host bytes per GPU."
        )
    text += (
        " hidden AG+RS: the share of all-gather + reduce-scatter bytes the schedule hides "
        "behind compute, of the most any schedule could. --wide: every column (the formula "
        "estimate, state, kernels, PCIe bytes, collectives) and its notes."
    )
    return textwrap.fill(text, wrap, break_on_hyphens=False)


def table(rows, fractions: bool = False) -> str:
    """The ``--wide`` table, every column; ``fractions``: a column of each row's offload
    fraction (``--offload auto`` or ``--offload-fraction``)."""
    from jaxzero.memory import format_bytes

    header = ["stage", "GPU-compiled", "formula est.", "state", "verdict", "hidden AG+RS"]
    header.append("kernels")
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
    return _format(header, body, True)


def formula_note(rows) -> str | None:
    """Where the formula estimate and the verdict disagree (the formula over the GPU's memory
    on a row that fits, or under it on a row that does not), why; None where they agree."""
    from jaxzero.memory import format_bytes

    odd = [
        r
        for r in rows
        if r.report.fits is not None and (r.estimate.total <= r.report.hbm_bytes) != r.report.fits
    ]
    if not odd:
        return None
    said = "; ".join(
        f"{r.label} {'fits' if r.report.fits else 'is short'} at a compiled peak of "
        f"{format_bytes(r.gpu_bytes)} where the formula says {format_bytes(r.estimate.total)}"
        for r in odd
    )
    return (
        f"formula est. against the verdict: {said}. The verdict judges the compiled peak, never "
        "the formula: the formula adds every buffer the step holds as if all were live at once "
        "(all activations, the f32 logits, the gathered weights), where XLA frees and reuses "
        "them, and it leaves out XLA's own temporaries."
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


def tries_note(rows, wrap: int = WIDTH) -> str | None:
    """``--offload auto``'s compiles in short, each fraction tried with its peak and hidden
    share, wrapped to ``wrap`` columns (``--wide``: :func:`fraction_note`); None without."""
    from jaxzero.memory import format_bytes

    tried = [(r.label, r.tries) for r in rows if r.tries]
    if not tried:
        return None
    one = lambda t: "; ".join(f"{_fraction(f)} -> {format_bytes(p)} ({h:.0%})" for f, p, h in t)
    width = max(len(label) for label, _ in tried)
    lines = ["auto's compiles per stage: offloaded share -> GPU peak (hidden AG+RS)"]
    for label, t in tried:
        lines += textwrap.wrap(
            f"{label + ':':<{width + 1}}  {one(t)}",
            wrap,
            initial_indent="  ",
            subsequent_indent=" " * (width + 5),
        )
    return "\n".join(lines)
