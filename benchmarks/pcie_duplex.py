"""Do host -> device and device -> host transfers run at the same time under XLA? The ceiling
of optimizer offload's streamed update, on one GPU.

    python benchmarks/pcie_duplex.py                       # one GPU, 2 GiB fp32 per buffer
    python benchmarks/pcie_duplex.py --out benchmarks/results/pcie_duplex.md
    python benchmarks/pcie_duplex.py --tiny                # 8 MiB on one CPU device, seconds

The streamed update (decision 32) walks each offloaded leaf in chunks: fetch a chunk of the
pinned-host state, compute on the device, write it back in place into the same (donated)
buffer. On one H200 it moved the state at 53 GB/s counting both directions
(``benchmarks/results/offload_gpu.md``), about one PCIe direction's speed: the fetches and the
write-backs take turns. Each row here is one jitted ``fori_loop`` over ``--chunk`` elements a
chunk of ``--gib`` GiB of fp32 in pinned host memory (donated), timed as the median of
``--rounds`` calls after 2 warm-ups:

* ``fetch``: each chunk fetched and summed on the device (host -> device only);
* ``write``: each chunk computed on the device and written into the host buffer (device ->
  host only);
* ``in place``: the streamed update's pattern: each chunk fetched, ``x * 0.5 + 1`` computed,
  written back into the same buffer;
* ``two buffers, pipelined``: iteration ``j`` fetches chunk ``j + 1`` of buffer A and writes
  chunk ``j``'s result (fetched by the previous iteration) into buffer B, so a fetch and a
  write-back in flight never touch one buffer (what two host buffers per leaf, or a layout of
  two stacks, would let the update do).

With ``--torch`` (PyTorch with CUDA installed) the same bytes move by ``Tensor.copy_`` between
pinned host and device memory, each direction alone, then both at once on two CUDA streams and
on one: what the link does when the two directions overlap, which XLA's rows do not reach.

GB/s counts the bytes that cross PCIe (both directions for the last two) per second; the
ratio is against ``in place``, in the same process. Each loop's result is checked against
numpy, so a variant that moved nothing would fail.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import emit, md_table  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

DEVICE, HOST = jax.memory.Space.Device, jax.memory.Space.Host


def _slice(x, j, c):
    return jax.lax.dynamic_slice_in_dim(x, j * c, c, 0, allow_negative_indices=False)


def _write(x, y, j, c):
    return jax.lax.dynamic_update_slice_in_dim(x, y, j * c, 0, allow_negative_indices=False)


def fetch(a, c):
    def body(j, acc):
        return acc + jnp.sum(jax.device_put(_slice(a, j, c), DEVICE))

    return jax.lax.fori_loop(0, a.shape[0] // c, body, jnp.zeros((), a.dtype))


def write(a, c):
    def body(j, a):
        y = jnp.full((c,), 1.0, a.dtype) * j.astype(a.dtype)
        return _write(a, jax.device_put(y, HOST), j, c)

    return jax.lax.fori_loop(0, a.shape[0] // c, body, a)


def in_place(a, c):
    def body(j, a):
        x = jax.device_put(_slice(a, j, c), DEVICE)
        return _write(a, jax.device_put(x * 0.5 + 1.0, HOST), j, c)

    return jax.lax.fori_loop(0, a.shape[0] // c, body, a)


def two_buffers(a, b, c):
    n = a.shape[0] // c

    def body(j, carry):
        b, x = carry
        nxt = jax.device_put(_slice(a, jnp.minimum(j + 1, n - 1), c), DEVICE)
        b = _write(b, jax.device_put(x * 0.5 + 1.0, HOST), j, c)
        return b, nxt

    first = jax.device_put(_slice(a, 0, c), DEVICE)
    b, _ = jax.lax.fori_loop(0, n, body, (b, first))
    return a, b


def _timed(fn, args, rounds, donated: bool = True):
    """Median seconds of ``fn(*args)`` after 2 warm-up calls, and the last outputs; with
    ``donated`` each call's outputs (its arguments' buffers) are the next call's arguments."""
    times = []
    for i in range(2 + rounds):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        if i >= 2:
            times.append(time.perf_counter() - t)
        if donated:
            args = out if isinstance(out, tuple) else (out,)
    return statistics.median(times), out


def torch_rows(nbytes: int, rounds: int):
    """``(label, seconds, bytes moved)`` of PyTorch's copies of ``nbytes`` between pinned host
    and device memory: each direction alone, both on two CUDA streams, both on one."""
    import torch

    n = nbytes // 4
    h1, h2 = (torch.empty(n, dtype=torch.float32).pin_memory() for _ in range(2))
    d1, d2 = torch.empty(n, device="cuda"), torch.ones(n, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both(streams):
        with torch.cuda.stream(streams[0]):
            d1.copy_(h1, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            h2.copy_(d2, non_blocking=True)

    cases = [
        ("torch: host -> device", lambda: d1.copy_(h1, non_blocking=True), nbytes),
        ("torch: device -> host", lambda: h2.copy_(d2, non_blocking=True), nbytes),
        ("torch: both, two streams", lambda: both((s1, s2)), 2 * nbytes),
        ("torch: both, one stream", lambda: both((s1, s1)), 2 * nbytes),
    ]
    for label, fn, moved in cases:
        times = []
        for i in range(2 + rounds):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t)
        yield label, statistics.median(times), moved


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="8 MiB buffers, 64 KiB chunks")
    ap.add_argument("--gib", type=float, default=2.0, help="GiB of fp32 per host buffer")
    ap.add_argument("--chunk", type=int, default=1 << 22, help="elements a chunk (jaxzero's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--torch", action="store_true", help="PyTorch's copies too (CUDA)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.tiny:
        args.gib, args.chunk, args.rounds = 8 / 1024, 1 << 14, 1
    device = jax.devices()[0]
    host = SingleDeviceSharding(device, memory_kind="pinned_host")
    n = int(args.gib * (1 << 30)) // 4 // args.chunk * args.chunk
    c, nbytes = args.chunk, 4 * n
    base = np.arange(n, dtype=np.float32) % 1024
    put = lambda: jax.device_put(base, host)
    rows = []

    def row(label, seconds, moved):
        rows.append((label, seconds, moved))
        print(f"{label}: {seconds * 1e3:.1f} ms, {moved / seconds / 1e9:.1f} GB/s", file=sys.stderr)

    s, total = _timed(jax.jit(lambda a: fetch(a, c)), (put(),), args.rounds, donated=False)
    np.testing.assert_allclose(float(total), base.sum(dtype=np.float64), rtol=1e-3)
    row("fetch", s, nbytes)
    s, out = _timed(jax.jit(lambda a: write(a, c), donate_argnums=0), (put(),), args.rounds)
    np.testing.assert_array_equal(np.asarray(out)[c * 3 : c * 3 + 4], 3.0)
    row("write", s, nbytes)
    step = jax.jit(lambda a: in_place(a, c), donate_argnums=0)
    s, _ = _timed(step, (put(),), args.rounds)
    np.testing.assert_array_equal(np.asarray(step(put()))[:5], base[:5] * 0.5 + 1)
    row("in place", s, 2 * nbytes)
    pair = jax.jit(lambda a, b: two_buffers(a, b, c), donate_argnums=(0, 1))
    s, _ = _timed(pair, (put(), put()), args.rounds)
    _, b = pair(put(), put())
    np.testing.assert_array_equal(np.asarray(b)[-5:], base[-5:] * 0.5 + 1)
    row("two buffers, pipelined", s, 2 * nbytes)
    if args.torch:
        for r in torch_rows(nbytes, args.rounds):
            row(*r)
    ref = rows[2][1]
    table = md_table(
        ["loop", "ms per call", "GB/s over PCIe", "vs in place"],
        [
            (label, f"{s * 1e3:.1f}", f"{m / s / 1e9:.1f}", f"{ref / s:.2f}x")
            for label, s, m in rows
        ],
    )
    head = (
        f"{nbytes / 2**30:.2f} GiB of fp32 per pinned-host buffer, chunks of {c:,} elements, one "
        f"{device.device_kind}, jax {jax.__version__}; median of {args.rounds} calls"
    )
    emit(head + "\n\n" + table, args.out)


if __name__ == "__main__":
    main()
