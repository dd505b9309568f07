"""The NVMe tier's disk swapper (``jaxzero.zero.offload.nvme``) against plain sequential I/O of
the same bytes, on the same disk, in the same run.

    python benchmarks/nvme.py                                   # 2 GB under /tmp
    python benchmarks/nvme.py --gb 8 --dir /mnt/nvme --out benchmarks/results/nvme.md

Two files of the same size, the plain one and the swapper's: the warm-up round creates them,
each round after overwrites them in place (no file is truncated or deleted between rounds:
on a disk mounted with ``discard`` a deletion's discards slow the passes after it). Each round
times, one after another:

* ``plain write`` / ``plain read``: one thread, one file, ``os.pwrite`` / ``os.preadv`` of
  ``--plain-mb`` blocks from start to end (``dd``'s pattern), the write ended by ``fsync``;
* ``swapper write``: each group's buffer taken from the pool and written back as it is (the
  pool's buffers hold random bytes: in a run the caller's update leaves its values there, and
  filling them is the caller's work, not the disk's), then ``flush(sync=True)``;
* ``swapper read``: :meth:`~jaxzero.zero.offload.nvme.Swapper.pipelined` without writes (each
  group read ahead, handed over, released);
* ``swapper update``: the optimizer's pattern, a pipelined pass reading ahead and writing
  behind while each group is updated in place (``+= 1``); its GB/s counts both directions
  and is set beside the plain read and write times added together.

Every file is opened with ``O_DIRECT`` (page-aligned buffers, offsets and lengths), so no
figure comes from the page cache; where the filesystem refuses ``O_DIRECT`` both sides use
buffered I/O with ``fsync`` after writing and ``posix_fadvise(DONTNEED)`` before reading, and
the header says so. One swapper serves every round, as it would a run: the warm-up round
(which also pages in the pool's buffers and plain's buffer) is printed, not counted; each row
is the median over the rounds after it. At the end the swapper's file is written from random
source bytes, updated by one pipelined pass and read back against numpy's ``source + 1``, so a
swapper that moved nothing would fail. The files are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402
from common import emit, md_table  # noqa: E402

from jaxzero.zero.offload.nvme import Swapper, aligned_buffer  # noqa: E402

MB = 1 << 20


def _open(path: str, direct: bool, create: bool) -> int:
    flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)


def _drop_cache(path: str, direct: bool) -> None:
    if not direct:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def plain_write(path, source, total, block, direct) -> float:
    fd = _open(path, direct, create=True)
    t = time.perf_counter()
    for off in range(0, total, block):
        os.pwrite(fd, source[off % len(source) :][:block], off)
    os.fsync(fd)
    t = time.perf_counter() - t
    os.close(fd)
    return t


def plain_read(path, buf, total, block, direct) -> float:
    _drop_cache(path, direct)
    fd = _open(path, direct, create=False)
    t = time.perf_counter()
    for off in range(0, total, block):
        os.preadv(fd, [buf[:block]], off)
    t = time.perf_counter() - t
    os.close(fd)
    return t


def swapper_fill(sw, source, group_bytes) -> None:
    """Each group written from the source bytes (``acquire``, copy, ``write_back``)."""
    n = len(source) // group_bytes
    for g in range(len(sw.sizes)):
        buf = sw.acquire(g)
        buf[:] = source[(g % n) * group_bytes :][:group_bytes]
        sw.write_back(g, buf)
    sw.flush(sync=True)


def swapper_write(sw) -> float:
    """Each group written from the buffer the pool hands out, as it is (the caller's update
    would have left its values there)."""
    t = time.perf_counter()
    for g in range(len(sw.sizes)):
        sw.write_back(g, sw.acquire(g))
    sw.flush(sync=True)
    return time.perf_counter() - t


def swapper_read(sw, direct) -> float:
    _drop_cache(sw.path, direct)
    t = time.perf_counter()
    for _ in sw.pipelined(write=False):
        pass
    return time.perf_counter() - t


def swapper_update(sw, direct) -> float:
    _drop_cache(sw.path, direct)
    t = time.perf_counter()
    for _, buf in sw.pipelined():
        buf += 1
    sw.flush(sync=True)
    return time.perf_counter() - t


def check(sw, source, group_bytes, updates: int, direct) -> None:
    """Every group read back equals the source bytes plus ``updates`` (numpy's uint8)."""
    n = len(source) // group_bytes
    _drop_cache(sw.path, direct)
    for g, buf in sw.pipelined(write=False):
        want = source[(g % n) * group_bytes :][:group_bytes] + np.uint8(updates)
        if not np.array_equal(buf, want):
            raise SystemExit(f"swapper: group {g} read back differs from what was written")


def _sweep_table(runs, total, main_cfg, configs) -> str:
    runs = {
        f"{main_cfg} write": runs["swapper write"],
        f"{main_cfg} read": runs["swapper read"],
        **runs,
    }
    rows = []
    for cfg in [main_cfg, *configs]:
        mib, threads = cfg.split("x")
        row = [f"{mib} MiB x {threads}" + (" (the rows above)" if cfg == main_cfg else "")]
        for way in ("write", "read"):
            med = statistics.median(runs[f"{cfg} {way}"])
            plain = statistics.median(runs[f"plain {way}"])
            row += [f"{total / med / 1e9:.2f}", f"{plain / med:.2f}x"]
        rows.append(row)
    head = ["block x threads", "write GB/s", "plain time / this", "read GB/s", "plain time / this"]
    return "## Block size and threads (the same rounds, the same file)\n\n" + md_table(head, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="bytes moved each way, in GB (1e9)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    ap.add_argument("--group-mb", type=int, default=64, help="swapper group (= buffer), MiB")
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--block-mb", type=int, default=4, help="swapper bytes per call, MiB")
    ap.add_argument("--queue-depth", type=int, default=4, help="swapper I/O threads")
    ap.add_argument(
        "--sweep",
        nargs="*",
        default=[],
        metavar="MIBxTHREADS",
        help="also time the swapper's write and read passes with these block sizes and thread "
        "counts (e.g. 1x8 4x4), each round, over the same file",
    )
    ap.add_argument("--plain-mb", type=int, default=8, help="plain I/O bytes per call, MiB")
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds after the warm-up")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)

    group_bytes = args.group_mb * MB
    groups = max(1, round(args.gb * 1e9 / group_bytes))
    total = groups * group_bytes
    free = shutil.disk_usage(args.dir).free
    if 2 * total > free - (1 << 30):
        raise SystemExit(f"--gb {args.gb}: needs {2 * total:,} bytes, {args.dir} has {free:,}")
    work = tempfile.mkdtemp(prefix="jaxzero-nvme-", dir=args.dir)
    try:
        sw = Swapper(
            work,
            [group_bytes] * groups,
            buffer_count=args.buffer_count,
            block_bytes=args.block_mb * MB,
            queue_depth=args.queue_depth,
        )
        direct = sw.direct
        source = aligned_buffer(256 * MB)
        source[:] = np.random.default_rng(0).integers(0, 256, len(source), dtype=np.uint8)
        swapper_fill(sw, source, group_bytes)  # also leaves random bytes in every buffer
        block = args.plain_mb * MB
        rbuf = aligned_buffer(block)
        plain = os.path.join(work, "plain.bin")
        runs: dict[str, list[float]] = {}
        sweep = {}
        main_cfg = f"{args.block_mb}x{args.queue_depth}"
        for cfg in dict.fromkeys(c for c in args.sweep if c != main_cfg):
            mib, threads = map(int, cfg.split("x"))
            # the same file under a name of its own (a hard link: a swapper locks its name),
            # with its own pool and threads
            name = f"sweep-{cfg}.swp"
            os.link(sw.path, os.path.join(work, name))
            other = Swapper(
                work,
                [group_bytes] * groups,
                buffer_count=args.buffer_count,
                block_bytes=mib * MB,
                queue_depth=threads,
                name=name,
            )
            swapper_fill(other, source, group_bytes)
            sweep[cfg] = other
        plain_passes = {
            "plain write": lambda: plain_write(plain, source, total, block, direct),
            "plain read": lambda: plain_read(plain, rbuf, total, block, direct),
        }
        swapper_passes = {
            "swapper write": lambda: swapper_write(sw),
            "swapper read": lambda: swapper_read(sw, direct),
            "swapper update": lambda: swapper_update(sw, direct),
        }
        for r in range(args.rounds + 1):
            # odd rounds run the swapper first: neither side always follows the other
            first, second = (
                (swapper_passes, plain_passes) if r % 2 else (plain_passes, swapper_passes)
            )
            times = {k: run() for passes in (first, second) for k, run in passes.items()}
            for cfg, other in sweep.items():
                times[f"{cfg} write"] = swapper_write(other)
                times[f"{cfg} read"] = swapper_read(other, direct)
            line = ", ".join(f"{k} {total / v / 1e9:.2f} GB/s" for k, v in times.items())
            print(f"round {r}{' (warm-up)' if r == 0 else ''}: {line}", file=sys.stderr)
            if r:
                for k, v in times.items():
                    runs.setdefault(k, []).append(v)
        for other in sweep.values():
            other.close()
        swapper_fill(sw, source, group_bytes)
        swapper_update(sw, direct)
        check(sw, source, group_bytes, 1, direct)
        sw.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    runs["plain read + plain write"] = [
        r + w for r, w in zip(runs["plain read"], runs["plain write"], strict=True)
    ]
    rows = []
    for name, base, moved in [
        ("plain write", "plain write", 1),
        ("swapper write", "plain write", 1),
        ("plain read", "plain read", 1),
        ("swapper read", "plain read", 1),
        ("plain read + plain write", "plain read + plain write", 2),
        ("swapper update (read ahead, write behind)", "plain read + plain write", 2),
    ]:
        key = name.split(" (")[0]
        med = statistics.median(runs[key])
        rates = sorted(moved * total / t / 1e9 for t in runs[key])
        rows.append(
            [
                name,
                f"{med:.2f}",
                f"{moved * total / med / 1e9:.2f}",
                f"{rates[0]:.2f}-{rates[-1]:.2f}",
                f"{statistics.median(runs[base]) / med:.2f}x",
            ]
        )
    mode = "O_DIRECT" if direct else "buffered, fsync + posix_fadvise(DONTNEED) (O_DIRECT refused)"
    head = (
        f"{total / 1e9:.2f} GB each way ({groups} groups of {args.group_mb} MiB), {mode}, "
        f"under {args.dir}; swapper: buffer_count {args.buffer_count}, {args.block_mb} MiB per "
        f"call, queue_depth {args.queue_depth}; plain: one thread, {args.plain_mb} MiB per call; "
        f"median of {args.rounds} rounds after a warm-up round; {os.cpu_count()} cores, Python "
        f"{platform.python_version()}"
    )
    table = md_table(["pass", "s", "GB/s", "GB/s, each round", "plain time / this"], rows)
    command = " ".join(["python benchmarks/nvme.py", *(argv if argv is not None else sys.argv[1:])])
    text = (
        f"# The NVMe tier's swapper against plain sequential I/O\n\n`{command}`: {head}\n\n{table}"
    )
    if sweep:
        text += "\n\n" + _sweep_table(runs, total, main_cfg, list(sweep))
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
