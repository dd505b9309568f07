"""The row ``jaxzero plan`` suggests, and the ``jaxzero.ZeRO(...)`` line that builds it.

The pick is the row that fits with the shortest predicted step (offload's exposed PCIe time;
a row without offload has none), then the lowest stage (the least sharding that fits), then
the most all-gather + reduce-scatter bytes hidden. The line is the row's own
``ZeRO(tx, mesh, **row.zero_options)`` (:func:`jaxzero.gpu.plan.zero_options`: the keyword
arguments its step was compiled with), written as Python with ZeRO's defaults left out.
"""

from __future__ import annotations

import textwrap

__all__ = ["chosen", "paste", "pick_note"]

_DEFAULTS = {
    "layers": None,
    "units": None,
    "vocab_parallel": None,
    "offload": None,
    "offload_fraction": 1.0,
    "prefetch": None,
    "quantize": None,
    "hpz_partition_size": None,
}
_KINDS = ("all-gather", "reduce-scatter", "all-to-all")


def chosen(rows):
    """The row to use (see the module docstring), or None when none fits."""
    fit = [r for r in rows if r.report.fits is not False]
    if not fit:
        return None
    step = lambda r: 0.0 if r.cost is None else r.cost.step_seconds
    return min(fit, key=lambda r: (step(r), r.stage, -r.report.hidden_share(*_KINDS)))


def _source(value) -> str:
    """``value`` as Python source, with ``jz.`` for jaxzero's own types."""
    from jaxzero.precision import Precision
    from jaxzero.zero.wire import Blockwise, Wire

    if isinstance(value, Precision):
        import jax.numpy as jnp

        names = {jnp.dtype(jnp.float32): "fp32", jnp.dtype(jnp.bfloat16): "bf16"}
        name = names.get(jnp.dtype(value.param_dtype), "fp16")
        if value == Precision.create(name):
            return f'"{name}"'
        return f'jz.Precision.create("{name}", compute_copy={value.compute_copy})'
    if isinstance(value, Wire):
        bits = lambda c: c.bits if isinstance(c, Blockwise) else None
        hpz = f", hpz={value.hpz}" if value.hpz else ""
        return f"jz.Wire.create(weights={bits(value.weights)}, grads={bits(value.grads)}{hpz})"
    if isinstance(value, str):
        return f'r"{value}"' if "\\" in value and '"' not in value else f'"{value}"'
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_source, value)) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def paste(row, width: int = 100, indent: str = "  ") -> str:
    """``zero = jz.ZeRO(tx, mesh, stage=..., ...)`` for ``row``: its ``zero_options`` less
    ZeRO's defaults, on one line when it fits ``width``, else wrapped inside the call."""
    args = ["tx", "mesh"] + [
        f"{k}={_source(v)}"
        for k, v in row.zero_options.items()
        if k not in _DEFAULTS or v != _DEFAULTS[k]
    ]
    line = f"{indent}zero = jz.ZeRO({', '.join(args)})"
    if len(line) <= width:
        return line
    body = textwrap.fill(
        ", ".join(args),
        width,
        initial_indent=indent + "    ",
        subsequent_indent=indent + "    ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return f"{indent}zero = jz.ZeRO(\n{body}\n{indent})"


def _step_line(args, indent: str) -> str | None:
    """``step = jz.make_train_step(...)`` where the plan's step needs more than its defaults
    (``--accum``, ``--ema``: ShardedEMA(0.999), as the plan compiled)."""
    extra = [f"accum_steps={args.accum}"] * (args.accum > 1)
    extra += ["ema=jz.ShardedEMA(0.999)"] * bool(args.ema)
    if not extra:
        return None
    return f"{indent}step = jz.make_train_step(loss_fn, zero, {', '.join(extra)})"


def pick_note(rows, args, width: int = 100) -> str:
    """The pick and its lines to paste (``import jaxzero as jz``; ``tx`` your optax
    optimizer, ``mesh`` your mesh), or why there is none."""
    from jaxzero.memory import format_bytes

    row = chosen(rows)
    if row is None:
        memory = format_bytes(rows[0].report.hbm_bytes)
        return textwrap.fill(
            f"pick: none; no row fits in {memory} per GPU: add devices, offload (--offload "
            "auto, --offload optimizer,params), or shorten --batch / --seq.",
            width,
            break_on_hyphens=False,
        )
    why = "of the rows that fit, the shortest predicted step, then the lowest stage"
    if len(rows) == 1:
        why = "the one row, and it fits"
    lines = textwrap.wrap(
        f"pick: {row.label} ({why}). To build it (import jaxzero as jz; tx: your optax "
        "optimizer; mesh: your mesh, e.g. jz.data_parallel_mesh()):",
        width,
        break_on_hyphens=False,
    )
    lines.append(paste(row, width))
    step = _step_line(args, "  ")
    if step:
        lines.append(step)
    opts = row.zero_options
    names = {
        "layers": "the params subtree of your scanned layer stack",
        "units": "your model's blocks",
        "vocab_parallel": "your tied embedding",
    }
    said = [f"{k}={_source(opts[k])}: {what}" for k, what in names.items() if opts.get(k)]
    if said:
        comment = "; ".join(said) + ", as the plan's model names them"
        lines += textwrap.wrap(
            comment, width, initial_indent="  # ", subsequent_indent="  # ", break_on_hyphens=False
        )
    return "\n".join(lines)
