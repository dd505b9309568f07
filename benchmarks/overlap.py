"""Communication hidden behind compute in the compiled GPU step (issue 15): jaxzero stages 1-3
per layer against GSPMD-annotation FSDP and plain DP, with XLA's default flags and with
``jaxzero.gpu.recommended_xla_flags()``, compiled for H100s without a GPU.

    python benchmarks/overlap.py                  # 8-layer GPT, width 1024, bf16, N=8 and 64
    python benchmarks/overlap.py --quick          # 4 layers, width 256, N=8 (about 3 min)
    python benchmarks/overlap.py --tiny           # the tests' 4-layer width-64 decoder, N=8
    python benchmarks/overlap.py --out benchmarks/results/overlap.md
    python benchmarks/overlap.py --llama7b --out benchmarks/results/overlap_llama7b.md  # N=64

jaxzero's rows use :func:`jaxzero.scan_layers` for the layer stack (the models' default,
``ModelShape.loop="prefetch"``); one stage-3 row runs the same model as ``nn.scan`` over an
``nn.remat``'d block that calls :func:`jaxzero.gather_layer` (``loop="gather_layer"``), and one
keeps no bf16 copy of the params beside the fp32 master (``Precision(compute_copy=False)``);
on the GPT, one also keeps the tied embedding vocabulary-parallel (``ZeRO(vocab_parallel=)``,
:class:`jaxzero.VocabParallelEmbed`: the table stays sharded, activations move instead).

Per row, per device per step: collective payload bytes (loop trip counts applied), the share
of all-gather, reduce-scatter and all-reduce bytes hidden (a gemm/conv/attention kernel scheduled
between the collective's start and done: :mod:`jaxzero.gpu.overlap`; "-" when none move, or
only scalars such as the loss's mean), arguments + temporaries
(``memory_analysis``), kernels launched, and the most any schedule of the row's data flow could
hide of the all-gather and reduce-scatter bytes ("max AG / RS": a collective that every gemm of
the step depends on, or that depends on every gemm, cannot be hidden by any flag). The peer is MaxText-style: fp32 params and Adam
state sharded by ``NamedSharding`` on the same dimension rule as jaxzero, the loss computing in
bf16, plain ``optax`` under ``jax.jit`` (GSPMD inserts the collectives); plain DP replicates.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from common import emit  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxzero as jz  # noqa: E402
from jaxzero import gpu  # noqa: E402
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape  # noqa: E402
from jaxzero.zero import specs as sh  # noqa: E402

KINDS = ("all-gather", "reduce-scatter", "all-reduce")
# A kind moving less than this per step is a scalar (the loss's mean), not a gradient: "-".
SCALARS = 4096


def _figures(hlo: str, mem, n: int) -> dict:
    moved = gpu.collectives_per_step(hlo, n)
    over = gpu.overlap_per_step(hlo, n)
    share = {o.kind: o.share for o in over if o.bytes >= SCALARS}
    return {
        "bytes": sum(c.bytes for c in moved),
        **{k: share.get(k) for k in KINDS},
        "max": _ceiling(over),
        "args_temp": mem.argument_size_in_bytes + mem.temp_size_in_bytes,
        "kernels": gpu.kernels_per_step(hlo),
        **_gather_scatter(over),
    }


def _gather_scatter(over) -> dict:
    """``ag_rs_bytes``: all-gather + reduce-scatter payload per step; ``ag_rs_hidden``: the
    share of those bytes hidden behind compute, ``ag_rs_max``: the share any schedule of the
    step's data flow could hide (both None when none move)."""
    rows = [o for o in over if o.kind in KINDS[:2]]
    total = sum(o.bytes for o in rows)
    share = lambda field: sum(getattr(o, field) for o in rows) / total if total else None
    return {
        "ag_rs_bytes": total,
        "ag_rs_hidden": share("hidden_bytes"),
        "ag_rs_max": share("hideable_bytes"),
    }


def _ceiling(over) -> str:
    """``"0.81 / 0.74"``: the hideable share (what any schedule of the step's data flow could
    hide, :mod:`jaxzero.gpu.overlap`) of all-gather and reduce-scatter bytes, "-" for a kind
    that moves only scalars."""
    by_kind = {o.kind: o for o in over}
    cells = []
    for kind in KINDS[:2]:
        o = by_kind.get(kind)
        cells.append(f"{o.bound:.2f}" if o is not None and o.bytes >= SCALARS else "-")
    return " / ".join(cells)


def _model(shape, model):
    """``model`` (abstract params, loss_fn), or by default ``shape``'s Linen decoder's."""
    return (abstract_params(shape), make_loss(shape)) if model is None else model


def jaxzero_row(shape, mesh, stage, per_layer, options, precision="bf16", model=None, **zero):
    """A jaxzero row; ``model``: (abstract params, loss_fn) in place of ``shape``'s Linen
    decoder; ``zero``: further ``jz.ZeRO`` keyword arguments."""
    params, loss_fn = _model(shape, model)
    zero = jz.ZeRO(
        optax.adam(1e-4),
        mesh,
        stage=stage,
        precision=precision,
        layers="layers" if per_layer else None,
        vocab_parallel="embed" if shape.vocab_parallel else None,
        **zero,
    )
    step = jz.make_train_step(loss_fn, zero)
    n = mesh.shape["data"]
    rep = gpu.compile_report(step, params, batch_shapes(shape, n), compiler_options=options)
    return {
        "bytes": sum(c.bytes for c in rep.collectives),
        **{k: rep.hidden_share(k) if rep.payload(k) >= SCALARS else None for k in KINDS},
        "max": _ceiling(rep.overlap),
        "args_temp": rep.argument_bytes + rep.temp_bytes,
        "kernels": rep.kernels_per_step,
        **_gather_scatter(rep.overlap),
    }


def peer_row(shape, mesh, shard: bool, options, model=None):
    """GSPMD FSDP (``shard``) or plain DP: fp32 params and Adam, bf16 compute, jit;
    ``model`` as in :func:`jaxzero_row`."""
    n = mesh.shape["data"]
    params, loss_fn = _model(shape, model)
    tx = optax.adam(1e-4)
    opt = jax.eval_shape(tx.init, params)
    place = lambda t: sh.named(mesh, sh.tree_specs(t, n, "data", shard=shard, stacked=("layers",)))
    p_sh, o_sh = place(params), place(opt)
    b_sh = NamedSharding(mesh, P("data"))

    def step(p, o, batch):
        bf16 = lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        loss, g = jax.value_and_grad(lambda p: loss_fn(bf16(p), batch))(p)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, loss

    jitted = jax.jit(
        step,
        in_shardings=(p_sh, o_sh, {"x": b_sh, "y": b_sh}),
        out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )
    batch = batch_shapes(shape, n)
    compiled = jitted.lower(params, opt, batch).compile(options or None)
    return _figures(compiled.as_text(), compiled.memory_analysis(), n)


def _vocab_parallel_row(shape, mesh, options):
    """Stage 3 per layer with the tied embedding vocabulary-parallel
    (``ZeRO(vocab_parallel="embed")``, :class:`jaxzero.VocabParallelEmbed`) and FSDP's layout;
    None for a model without a tied embedding (LLaMA)."""
    if shape.arch != "gpt":
        return None
    shape = dataclasses.replace(shape, vocab_parallel=True)
    no_copy = jz.Precision.create("bf16", compute_copy=False)
    return jaxzero_row(shape, mesh, 3, True, options, no_copy)


VARIANTS = (
    (
        "jaxzero stage 0 (all-reduce after the backward)",
        lambda s, m, o: jaxzero_row(s, m, 0, False, o),
    ),
    ("jaxzero stage 0 per layer", lambda s, m, o: jaxzero_row(s, m, 0, True, o)),
    (
        "jaxzero stage 1 (all-reduce after the backward)",
        lambda s, m, o: jaxzero_row(s, m, 1, False, o),
    ),
    ("jaxzero stage 1 per layer", lambda s, m, o: jaxzero_row(s, m, 1, True, o)),
    ("jaxzero stage 2 (whole-gradient reduction)", lambda s, m, o: jaxzero_row(s, m, 2, False, o)),
    ("jaxzero stage 2 per layer", lambda s, m, o: jaxzero_row(s, m, 2, True, o)),
    (
        "jaxzero stage 3 per layer (scan_layers: prefetch)",
        lambda s, m, o: jaxzero_row(s, m, 3, True, o),
    ),
    (
        "jaxzero stage 3 per layer, no compute copy (FSDP layout)",
        lambda s, m, o: jaxzero_row(
            s, m, 3, True, o, jz.Precision.create("bf16", compute_copy=False)
        ),
    ),
    (
        "jaxzero stage 3 per layer (gather_layer in nn.scan)",
        lambda s, m, o: jaxzero_row(dataclasses.replace(s, loop="gather_layer"), m, 3, True, o),
    ),
    (
        "jaxzero stage 3 per layer, vocabulary-parallel embedding, no compute copy",
        lambda s, m, o: _vocab_parallel_row(s, m, o),
    ),
    ("GSPMD-annotation FSDP (peer)", lambda s, m, o: peer_row(s, m, True, o)),
    ("plain DP (jit, replicated)", lambda s, m, o: peer_row(s, m, False, o)),
)


def table(shape, n: int, variants=None) -> list[str]:
    """The markdown table of ``variants`` (default: every one of :data:`VARIANTS`) at N = n."""
    mesh = gpu.compile_only_mesh("h100", n)
    lines = [
        f"N = {n} H100, {shape.arch} {shape.layers} layers x width {shape.hidden}, "
        f"{shape.num_params:,} params, bf16, Adam, {shape.seq} tokens per device",
        "",
        "| variant | XLA flags | collective bytes | hidden AG | hidden RS | hidden AR | args+temp "
        "| kernels | max AG / RS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, row in VARIANTS if variants is None else variants:
        for flags in ("default", "recommended"):
            options = gpu.xla_options() if flags == "recommended" else None
            f = row(shape, mesh, options)
            if f is None:  # the variant does not apply to this model
                continue
            ag, rs, ar = ("-" if f[k] is None else f"{f[k]:.2f}" for k in KINDS)
            lines.append(
                f"| {label} | {flags} | {f['bytes'] / 1e6:.1f} MB | {ag} | {rs} | {ar} | "
                f"{f['args_temp'] / 1e6:.1f} MB | {f['kernels']} | {f['max']} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


# The tests' small decoder (tests/test_benchmarks.py checks this table against the formulas).
TINY = model_shape(layers=4, hidden=64, heads=2, vocab=128, seq=16, arch="gpt")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, width 256, N=8 only")
    ap.add_argument("--tiny", action="store_true", help="4 layers, width 64, N=8 only")
    ap.add_argument("--llama7b", action="store_true", help="LLaMA-7B (32 x 4096), N=64 only")
    ap.add_argument("--devices", type=int, action="append", help="default: 8 and 64")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    if args.tiny:
        shape = TINY
    elif args.llama7b:
        shape = model_shape(layers=32, hidden=4096, heads=32, vocab=32000, seq=2048)
    elif args.quick:
        shape = model_shape(layers=4, hidden=256, heads=2, vocab=1024, seq=256, arch="gpt")
    else:
        shape = model_shape(layers=8, hidden=1024, heads=8, vocab=32000, seq=2048, arch="gpt")
    devices = args.devices or (
        [8] if args.quick or args.tiny else [64] if args.llama7b else [8, 64]
    )
    flags = " ".join(gpu.recommended_xla_flags())
    out = [f"Recommended flags: `{flags}`", ""]
    for n in devices:
        out += [*table(shape, n), ""]
    emit("\n".join(out), args.out)


if __name__ == "__main__":
    main()
