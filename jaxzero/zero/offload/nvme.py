"""The NVMe tier's disk swapper (decision 50): state kept in one file on disk, paged through a
bounded window of host buffers a group at a time (ZeRO-Infinity's third tier, DeepSpeed's
``offload_optimizer: {device: nvme}``).

The state is cut into fixed groups of bytes; group ``g`` lives at an aligned offset of one
preallocated file. A pool of ``buffer_count`` page-aligned host buffers of ``buffer_bytes``
each is the only host memory the swapper holds, whatever the file's size. :meth:`Swapper.prefetch`
starts reading a group into a free buffer, :meth:`Swapper.wait` hands the filled buffer to the
caller, :meth:`Swapper.write_back` writes it back asynchronously and returns the buffer to the
pool when the write lands, :meth:`Swapper.pipelined` iterates the groups reading ahead and
writing behind while the caller updates the group it holds (DeepSpeed's
``PipelinedOptimizerSwapper``: read ``g+1``, write ``g-1``, update ``g``).

I/O is plain ``os.preadv``/``os.pwritev`` of ``block_bytes`` pieces on a thread pool of
``queue_depth`` threads (the calls release the GIL), with ``O_DIRECT`` where the filesystem
allows it, so neither side of a pass goes through (or is measured from) the page cache.
Operations on one group run in the order they were asked for.

Everything a bad directory can do is checked before the file is touched
(:func:`check_directory`, then the free space and a lock): a missing or unwritable directory
raises, one in host memory (tmpfs) warns, a disk without room for the file raises naming the
bytes, and a second swapper on the same file (another run in the same directory) is refused
naming the process that holds it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import fcntl
import mmap
import os
import shutil
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

__all__ = ["ALIGN", "MEMORY_FILESYSTEMS", "Swapper", "aligned_buffer", "check_directory"]

#: alignment of offsets, lengths and buffer addresses for ``O_DIRECT`` (a page; covers the
#: 512 B and 4 KiB logical blocks of NVMe and virtio disks)
ALIGN = 4096


#: filesystems whose files live in host memory: a swap file there takes the RAM the tier is
#: meant to free
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})

#: the mount table :func:`filesystem_type` reads
MOUNTS = "/proc/mounts"


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (``/proc/mounts``' longest mount point above
    its real path), or None where the table cannot be read (not Linux)."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open(MOUNTS) as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        # the table escapes spaces, tabs, newlines and backslashes as octal
        point = fields[1].encode().decode("unicode_escape")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the last mount over a point wins
            best, kind = point, fields[2]
    return kind


def check_directory(directory: str | os.PathLike) -> str:
    """``directory`` checked as a place for a swap file, before anything is written there.

    Returns:
      The directory as a string.

    Raises:
      FileNotFoundError: it does not exist (NotADirectoryError: it is a file).
      PermissionError: it is not writable (a read-only mount too).

    Warns:
      UserWarning: it is on a filesystem held in host memory (tmpfs, ramfs).
    """
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, "the swap directory is a file", directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            errno.ENOENT, "the swap directory does not exist: create it first", directory
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, "the swap directory is not writable (or on a read-only mount)", directory
        )
    kind = filesystem_type(directory)
    if kind in MEMORY_FILESYSTEMS:
        warnings.warn(
            f"the swap directory {directory} is on {kind}, which keeps its files in host "
            "memory: the state 'on disk' takes as much RAM as offload='optimizer' would. "
            "Point the NVMe path at a disk mount.",
            UserWarning,
            stacklevel=3,
        )
    return directory


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned ``uint8`` array of ``nbytes`` (anonymous memory: pages are committed when
    first touched), usable for ``O_DIRECT`` reads and writes."""
    return np.frombuffer(mmap.mmap(-1, max(ALIGN, _round_up(nbytes))), np.uint8)[:nbytes]


def _lock(path: str) -> int:
    """A descriptor of ``path`` holding an exclusive ``flock`` and this process's pid, for as
    long as it is open (the kernel drops the lock when the process ends, so a crashed run
    leaves no stale lock). The file is never removed: unlinking a lock file lets a process
    that opened it just before lock the unlinked copy while a third locks a new one.

    Raises:
      BlockingIOError: another swapper holds it (the message names its pid).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise BlockingIOError(
            errno.EWOULDBLOCK,
            f"the swap file is in use by process {owner} (another run with the same NVMe "
            "path, or a state not closed): give each run its own directory",
            path,
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class _Op:
    """One group's read or write: ``pending`` pieces left, the first error, what runs next."""

    def __init__(self, kind: str, group: int, slot: int, pieces: int):
        self.kind, self.group, self.slot, self.pending = kind, group, slot, pieces
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.then: list = []  # operations on the same group started when this one ends


class Swapper:
    """Groups of bytes in one file under ``directory``, paged through a bounded buffer pool.

    Every check (the directory, its free space, the sizes, the lock) runs before the file is
    created. The file is locked (``fcntl.flock`` on ``name + ".lock"`` beside it, which holds
    the owner's pid) until :meth:`close`: a second swapper on the same file, in this process
    or another, is refused. The caller's methods are meant for one thread; the I/O runs on the
    swapper's own.

    Args:
      directory: an existing, writable directory (an NVMe mount for the tier's purpose).
      group_sizes: bytes of each group, in order.
      buffer_count: host buffers in the pool: the most the swapper ever holds (DeepSpeed's
        ``buffer_count``, 4 by default there too). :meth:`pipelined` keeps one for the caller,
        reads ahead into ``buffer_count - 2`` and writes behind from the rest.
      buffer_bytes: bytes of each buffer; by default the largest group's (rounded up to
        :data:`ALIGN`).
      block_bytes: bytes of one ``preadv``/``pwritev`` call (DeepSpeed aio's ``block_size``).
      queue_depth: I/O threads, the calls in flight at once (aio's ``queue_depth``). The
        defaults, 4 MiB x 4, measured faster than aio's 1 MiB x 8 in ``benchmarks/nvme.py``:
        each call costs a Python thread's turn, and fewer, larger calls keep the disk as busy.
      direct: ``True`` requires ``O_DIRECT``, ``False`` uses the page cache, ``None`` (the
        default) tries ``O_DIRECT`` and falls back when the filesystem refuses it
        (:attr:`direct` says which).
      name: the file's name in ``directory`` (one swapper per file).

    Raises:
      FileNotFoundError: ``directory`` does not exist (NotADirectoryError: it is a file).
      PermissionError: it is not writable.
      ValueError: a group is empty or larger than ``buffer_bytes``, or a count is below 1.
      OSError: ``ENOSPC`` when the file would not fit the disk (naming the bytes needed and
        free); ``EINVAL`` when ``direct=True`` and the filesystem refuses ``O_DIRECT``.
      BlockingIOError: another swapper holds the file (naming its process id).

    Warns:
      UserWarning: the directory is on tmpfs or ramfs (host memory).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        group_sizes: Sequence[int],
        *,
        buffer_count: int = 4,
        buffer_bytes: int | None = None,
        block_bytes: int = 4 << 20,
        queue_depth: int = 4,
        direct: bool | None = None,
        name: str = "optimizer_state.swp",
    ):
        sizes = [int(s) for s in group_sizes]
        directory = check_directory(directory)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"group_sizes must be positive byte counts, got {sizes[:8]}")
        for what, n in (("buffer_count", buffer_count), ("queue_depth", queue_depth)):
            if n < 1:
                raise ValueError(f"{what}={n} must be at least 1")
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"block_bytes={block_bytes} must be a positive multiple of {ALIGN}")
        buffer_bytes = _round_up(buffer_bytes or max(sizes))
        big = [(g, s) for g, s in enumerate(sizes) if s > buffer_bytes]
        if big:
            g, s = big[0]
            raise ValueError(
                f"group {g} has {s:,} bytes, more than a buffer's {buffer_bytes:,} "
                f"({len(big)} groups do): raise buffer_bytes or cut the state into smaller groups"
            )
        self.path = os.path.join(directory, name)
        self.sizes = sizes
        self.offsets = [0]
        for s in sizes:
            self.offsets.append(self.offsets[-1] + _round_up(s))
        self.file_bytes = self.offsets[-1]
        have = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        free = shutil.disk_usage(directory).free
        if self.file_bytes - have > free:
            raise OSError(
                errno.ENOSPC,
                f"the swap file needs {self.file_bytes - have:,} more bytes "
                f"({len(sizes)} groups, {self.file_bytes:,} in all) and the disk has "
                f"{free:,} free",
                directory,
            )
        self._lock = _lock(self.path + ".lock")
        try:
            self.direct, self._fd = self._open(direct)
        except BaseException:
            os.close(self._lock)
            raise
        try:
            if have < self.file_bytes:
                # reserve the blocks now: a full disk fails here, not in a later write
                os.posix_fallocate(self._fd, 0, self.file_bytes)
        except BaseException:
            os.close(self._fd)
            os.close(self._lock)
            raise
        self.buffer_count, self.buffer_bytes = buffer_count, buffer_bytes
        self.block_bytes = block_bytes
        self._buffers: list[np.ndarray | None] = [None] * buffer_count
        self._free = list(range(buffer_count))[::-1]
        self._ops: dict[int, _Op] = {}  # the latest operation asked for, per group
        self._held: dict[int, int] = {}  # group -> slot of a buffer the caller holds
        self._writes: set[_Op] = set()
        self._errors: list[BaseException] = []
        self._cond = threading.Condition()
        self._pool = concurrent.futures.ThreadPoolExecutor(queue_depth, "jaxzero-nvme")
        self.in_use = self.peak_in_use = 0  # buffers out of the pool: now, and the most ever
        self.closed = False  # set by close: the file and its lock are released

    def _open(self, direct):
        flags = os.O_RDWR | os.O_CREAT
        if direct is not False and hasattr(os, "O_DIRECT"):
            try:
                return True, os.open(self.path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if direct or e.errno != errno.EINVAL:
                    raise
        elif direct:
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
        return False, os.open(self.path, flags, 0o600)

    # -- the pool ------------------------------------------------------------------------

    def _take(self) -> int:
        """A free slot, waiting for a write to land when none is; an error rather than a
        deadlock when every buffer is held by the caller or being read."""
        with self._cond:
            while not self._free:
                if not self._writes:
                    raise RuntimeError(
                        f"all {self.buffer_count} buffers are held or being read: write_back or "
                        "release a group before prefetching another (or raise buffer_count)"
                    )
                self._cond.wait()
            slot = self._free.pop()
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        if self._buffers[slot] is None:
            self._buffers[slot] = aligned_buffer(self.buffer_bytes)
        return slot

    def _give(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self.in_use -= 1
            self._cond.notify_all()

    # -- I/O -----------------------------------------------------------------------------

    def _submit(self, kind: str, g: int, slot: int) -> _Op:
        length = _round_up(self.sizes[g])
        starts = range(0, length, self.block_bytes)
        op = _Op(kind, g, slot, len(starts))
        with self._cond:
            before = self._ops.get(g)
            self._ops[g] = op
            if kind == "write":
                self._writes.add(op)
            chained = before is not None and not before.done.is_set()
            if chained:
                before.then.append(op)
        if not chained:
            self._start(op)
        return op

    def _start(self, op: _Op) -> None:
        base, buf = self.offsets[op.group], self._buffers[op.slot]
        length = _round_up(self.sizes[op.group])
        for start in range(0, length, self.block_bytes):
            piece = buf[start : min(start + self.block_bytes, length)]
            self._pool.submit(self._piece, op, piece, base + start)

    def _piece(self, op: _Op, piece: np.ndarray, offset: int) -> None:
        call = os.preadv if op.kind == "read" else os.pwritev
        try:
            view, done = memoryview(piece), 0
            while done < len(view):  # a short read or write continues where it stopped
                n = call(self._fd, [view[done:]], offset + done)
                if n == 0:
                    raise OSError(errno.EIO, f"{op.kind} of group {op.group} stopped early")
                done += n
        except OSError as e:  # handed to wait() or flush(), naming what failed
            where = f"{op.kind} of group {op.group} at byte {offset:,} of {self.path}"
            op.error = op.error or OSError(e.errno, f"{e.strerror or e} ({where})")
        except BaseException as e:  # noqa: BLE001 - handed to wait() or flush()
            op.error = op.error or e
        with self._cond:
            op.pending -= 1
            if op.pending:
                return
            # everything that ends the operation happens under one lock: the operations
            # waiting on it are queued before flush() or close() can see it done, and its
            # buffer is back before _take() can see neither a free buffer nor a write in flight
            for later in op.then:
                self._start(later)
            op.done.set()
            if op.kind == "write":
                self._writes.discard(op)
                self._free.append(op.slot)
                self.in_use -= 1
                if op.error is not None:
                    self._errors.append(op.error)
            self._cond.notify_all()

    # -- the caller's side ---------------------------------------------------------------

    def _group(self, g: int) -> int:
        if not 0 <= g < len(self.sizes):
            raise IndexError(f"group {g} out of range: the swapper has {len(self.sizes)}")
        return g

    def prefetch(self, g: int) -> None:
        """Start reading group ``g`` into a free buffer (nothing when it is already being read
        or held); waits for a pending write to free a buffer if none is free."""
        self._group(g)
        op = self._ops.get(g)
        if g in self._held or (op is not None and op.kind == "read"):
            return
        self._submit("read", g, self._take())

    def wait(self, g: int) -> np.ndarray:
        """Group ``g``'s bytes, read (prefetched now if it was not): a ``uint8`` view of a pool
        buffer the caller holds until :meth:`write_back` or :meth:`release`.

        Raises:
          OSError: the read failed (the buffer goes back to the pool).
        """
        self.prefetch(g)
        if g in self._held:
            return self._view(g)
        op = self._ops[g]
        op.done.wait()
        del self._ops[g]
        if op.error is not None:
            self._give(op.slot)
            raise op.error
        self._held[g] = op.slot
        return self._view(g)

    def acquire(self, g: int) -> np.ndarray:
        """A buffer for group ``g`` without reading it (its first contents, written back
        whole): the caller holds it until :meth:`write_back` or :meth:`release`."""
        self._group(g)
        if g in self._held or (g in self._ops and self._ops[g].kind == "read"):
            raise RuntimeError(f"group {g} is already held or being read: wait() for it")
        self._held[g] = self._take()
        return self._view(g)

    def _view(self, g: int) -> np.ndarray:
        return self._buffers[self._held[g]][: self.sizes[g]]

    def write_back(self, g: int, buffer: np.ndarray | None = None) -> None:
        """Write the buffer the caller holds for group ``g`` back to disk, asynchronously; the
        buffer returns to the pool when the write lands (errors reach :meth:`flush`).

        Args:
          g: the group.
          buffer: the array :meth:`wait` or :meth:`acquire` returned for ``g`` (checked), or
            ``None`` for that one.
        """
        slot = self._held_slot(g, buffer)
        del self._held[g]
        self._submit("write", g, slot)

    def release(self, g: int) -> None:
        """Return group ``g``'s buffer to the pool unwritten (a pass that only reads)."""
        self._give(self._held_slot(g, None))
        del self._held[g]

    def _held_slot(self, g: int, buffer) -> int:
        if g not in self._held:
            raise RuntimeError(f"group {g} is not held: wait() or acquire() it first")
        if buffer is not None and not np.shares_memory(buffer, self._buffers[self._held[g]]):
            raise ValueError(f"buffer is not the one wait({g}) or acquire({g}) returned")
        return self._held[g]

    def pipelined(
        self,
        groups: Iterable[int] | None = None,
        *,
        write: bool = True,
        lookahead: int | None = None,
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(g, buffer)`` for each group in turn, read ahead and written behind: while the
        caller updates ``buffer`` in place, groups ``g+1 .. g+lookahead`` are being read and
        ``g-1`` written. Ends with :meth:`flush`; closed early (``break``), it writes nothing
        more, waits for the writes already asked for, and returns its buffers to the pool.

        Args:
          groups: the groups' order (all, in order, by default).
          write: write each group back after the caller's turn (``False``: release it).
          lookahead: reads in flight; by default ``buffer_count - 2`` (at least 1), which
            leaves one buffer for the caller and one for the write behind.
        """
        order = iter(range(len(self.sizes)) if groups is None else groups)
        ahead = max(1, self.buffer_count - 2) if lookahead is None else max(1, lookahead)
        queue: collections.deque[int] = collections.deque()

        def fill(most):
            while len(queue) < most and (g := next(order, None)) is not None:
                self.prefetch(g)
                queue.append(g)

        fill(min(ahead, self.buffer_count))
        while queue:
            g = queue.popleft()
            buffer = self.wait(g)
            fill(min(ahead, self.buffer_count - 1))  # the caller holds one
            try:
                yield g, buffer
            except GeneratorExit:  # the caller stopped early: nothing more is written
                self.release(g)
                for h in queue:
                    self.wait(h)
                    self.release(h)
                self.flush()  # the writes behind land, and their buffers are back
                raise
            if write:
                self.write_back(g)
            else:
                self.release(g)
            fill(1)  # a one-buffer pool reads the next group only now
        self.flush()

    def flush(self, sync: bool = False) -> None:
        """Wait for every write asked for so far.

        Args:
          sync: also ``fsync`` the file (the writes survive a crash; a swap pass needs only
            that they landed, a checkpoint needs this).

        Raises:
          OSError: the first failed write since the last flush.
        """
        with self._cond:
            while self._writes:
                self._cond.wait()
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
        if sync:
            os.fsync(self._fd)

    def close(self) -> None:
        """Flush, stop the I/O threads and close the file (it stays on disk)."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            self.closed = True
            self._pool.shutdown(wait=True)
            os.close(self._fd)
            os.close(self._lock)  # releases the lock; the lock file stays (see _lock)

    def __enter__(self) -> Swapper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
