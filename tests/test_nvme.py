"""The NVMe tier's disk swapper (``jaxzero.zero.offload.nvme``): bytes round-trip exactly, a
pipelined update pass equals numpy on the whole array, the buffer window bounds the memory
held (counted by the pool, and as the peak RSS of a process with 4x the window on disk), and
every misconfiguration fails before a file is created."""

import errno
import itertools
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from jaxzero.zero.offload import nvme
from jaxzero.zero.offload.nvme import Swapper

KIB = 1 << 10


def _random_groups(seed, count, most):
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(1, most, count)]  # unaligned sizes on purpose
    return sizes, [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]


def _fill(sw, data):
    for g, d in enumerate(data):
        buf = sw.acquire(g)
        buf[:] = d
        sw.write_back(g, buf)
    sw.flush()


def test_round_trip_is_bit_exact_over_many_groups(tmp_path):
    sizes, data = _random_groups(0, 41, 200 * KIB)
    with Swapper(tmp_path, sizes, buffer_count=3, block_bytes=64 * KIB) as sw:
        _fill(sw, data)
        order = np.random.default_rng(1).permutation(len(sizes))
        for i, g in enumerate(order):  # random order, reading two ahead
            for h in order[i + 1 : i + 3]:
                sw.prefetch(int(h))
            got = sw.wait(int(g))
            np.testing.assert_array_equal(got, data[g])
            sw.release(int(g))
    # a second swapper over the same file reads what the first wrote
    with Swapper(tmp_path, sizes, buffer_count=2, queue_depth=1) as again:
        for g, buf in again.pipelined(write=False):
            np.testing.assert_array_equal(buf, data[g])


def test_pipelined_update_equals_numpy_on_the_whole_array(tmp_path):
    x = np.random.default_rng(2).standard_normal(300_001).astype(np.float32)
    cuts = [0, 1, 70_000, 70_003, 150_000, 220_000, 300_001]  # groups of unequal length
    sizes = [4 * (b - a) for a, b in itertools.pairwise(cuts)]
    with Swapper(tmp_path, sizes, buffer_count=4, block_bytes=64 * KIB) as sw:
        _fill(sw, [x[a:b].view(np.uint8) for a, b in itertools.pairwise(cuts)])
        for _ in range(2):
            for _, buf in sw.pipelined():
                v = buf.view(np.float32)
                v *= 2
                v += 1
        got = np.concatenate([buf.view(np.float32).copy() for _, buf in sw.pipelined(write=False)])
    np.testing.assert_array_equal(got, (x * 2 + 1) * 2 + 1)


def test_a_read_after_a_write_of_the_same_group_sees_the_write(tmp_path):
    sizes, data = _random_groups(3, 4, 300 * KIB)
    with Swapper(tmp_path, sizes, buffer_count=4, block_bytes=4 * KIB, queue_depth=2) as sw:
        _fill(sw, data)
        for g in range(len(sizes)):
            buf = sw.wait(g)
            buf[:] = 255 - buf
            sw.write_back(g, buf)
            np.testing.assert_array_equal(sw.wait(g), 255 - data[g])  # no flush in between
            sw.release(g)


@pytest.mark.parametrize("buffer_count", [1, 2, 3, 5])
def test_the_pool_never_holds_more_buffers_than_its_count(tmp_path, buffer_count):
    sizes, data = _random_groups(4, 23, 100 * KIB)
    with Swapper(tmp_path, sizes, buffer_count=buffer_count, block_bytes=16 * KIB) as sw:
        _fill(sw, data)
        for _, buf in sw.pipelined():
            buf += 3
        for g, buf in sw.pipelined(write=False):
            np.testing.assert_array_equal(buf, data[g] + np.uint8(3))
        assert sw.in_use == 0
        assert sw.peak_in_use == min(buffer_count, len(sizes))


def test_stopping_a_pipelined_pass_early_returns_its_buffers(tmp_path):
    sizes, data = _random_groups(5, 9, 50 * KIB)
    with Swapper(tmp_path, sizes, buffer_count=4) as sw:
        _fill(sw, data)
        for g, buf in sw.pipelined():
            if g == 3:
                break
            buf[:] = 0
        assert sw.in_use == 0
        got = [buf.copy() for _, buf in sw.pipelined(write=False)]
    for g in range(len(sizes)):
        want = np.zeros_like(data[g]) if g < 3 else data[g]
        np.testing.assert_array_equal(got[g], want)


# A process that pages 256 MiB through a 32 MiB window (4 buffers of 8 MiB): its resident
# memory grows by far less than the state. nvme.py needs only numpy, so the process loads it
# from its file and stays small (no jax).
_RSS_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys
    import numpy as np
    spec = importlib.util.spec_from_file_location("nvme", sys.argv[1])
    nvme = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nvme)

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    group, groups = 8 << 20, 32
    start = status("VmRSS")
    with nvme.Swapper(sys.argv[2], [group] * groups, buffer_count=4) as sw:
        for g in range(groups):
            buf = sw.acquire(g)
            buf[:] = g
            sw.write_back(g, buf)
        for g, buf in sw.pipelined():
            buf += 1
        for g, buf in sw.pipelined(write=False):
            assert buf[0] == buf[-1] == g + 1, g
        assert sw.peak_in_use == 4
    print(groups * group, status("VmHWM") - start)
    """
)


def test_peak_memory_is_the_window_not_the_state(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, nvme.__file__, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    on_disk, grown = map(int, proc.stdout.split())
    assert on_disk == 256 << 20
    assert grown < on_disk // 4, f"peak RSS grew {grown:,} B paging {on_disk:,} B"


def test_a_missing_directory_fails_first(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Swapper(tmp_path / "absent", [100])
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="is a file"):
        Swapper(tmp_path / "file", [100])


def test_a_directory_without_write_permission_fails_first(tmp_path, monkeypatch):
    # the check asks the kernel (os.access); tests run as root, which chmod cannot stop
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if p == str(tmp_path) else real(p, mode)
    )
    with pytest.raises(PermissionError, match="not writable"):
        Swapper(tmp_path, [100])
    assert os.listdir(tmp_path) == []


def test_a_full_disk_fails_first_naming_the_bytes(tmp_path, monkeypatch):
    class Usage:
        total, used, free = 1 << 30, (1 << 30) - 10_000, 10_000

    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(OSError, match=r"needs 12,288 more bytes .* 10,000 free") as info:
        Swapper(tmp_path, [4096, 4097])  # 4096 + 8192 on disk: each group page-aligned
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_a_group_larger_than_a_buffer_fails_first(tmp_path):
    with pytest.raises(ValueError, match=r"group 1 has 9,000 bytes, more than a buffer's 8,192"):
        Swapper(tmp_path, [100, 9000, 9000], buffer_bytes=8000)
    with pytest.raises(ValueError, match="positive byte counts"):
        Swapper(tmp_path, [100, 0])
    with pytest.raises(ValueError, match="buffer_count=0"):
        Swapper(tmp_path, [100], buffer_count=0)
    with pytest.raises(ValueError, match="block_bytes"):
        Swapper(tmp_path, [100], block_bytes=1000)
    assert os.listdir(tmp_path) == []


def test_without_o_direct_the_swapper_falls_back_or_fails_as_asked(tmp_path, monkeypatch):
    real = os.open

    def refuse_direct(path, flags, *mode):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs answered before 6.6
        return real(path, flags, *mode)

    monkeypatch.setattr(os, "open", refuse_direct)
    sizes, data = _random_groups(6, 5, 10 * KIB)
    with Swapper(tmp_path, sizes) as sw:
        assert not sw.direct
        _fill(sw, data)
        for g, buf in sw.pipelined(write=False):
            np.testing.assert_array_equal(buf, data[g])
    with pytest.raises(OSError) as info:
        Swapper(tmp_path, sizes, direct=True, name="other")
    assert info.value.errno == errno.EINVAL


def test_misuse_of_buffers_is_an_error_not_a_deadlock(tmp_path):
    with Swapper(tmp_path, [100] * 4, buffer_count=2) as sw:
        a = sw.acquire(0)
        sw.acquire(1)
        with pytest.raises(RuntimeError, match="all 2 buffers are held"):
            sw.prefetch(2)
        with pytest.raises(ValueError, match="not the one"):
            sw.write_back(1, a)
        with pytest.raises(RuntimeError, match="group 2 is not held"):
            sw.write_back(2)
        with pytest.raises(IndexError, match="out of range"):
            sw.wait(4)
        sw.write_back(0, a)
        sw.release(1)


def _mounts(tmp_path, monkeypatch, table):
    path = tmp_path / "mounts"
    path.write_text(table)
    monkeypatch.setattr(nvme, "MOUNTS", str(path))


def test_the_filesystem_is_read_from_the_mount_table(tmp_path, monkeypatch):
    # the longest mount point above the path, the last of two over one point, an escaped space
    _mounts(
        tmp_path,
        monkeypatch,
        "/dev/vda / ext4 rw 0 0\n"
        "tmpfs /mnt/ram tmpfs rw 0 0\n"
        "/dev/nvme0n1 /mnt/ram xfs rw 0 0\n"
        "tmpfs /mnt/my\\040disk tmpfs rw 0 0\n"
        "tmpfs /mnt/a tmpfs rw 0 0\n",
    )
    assert nvme.filesystem_type("/srv/x") == "ext4"
    assert nvme.filesystem_type("/mnt/ram/run") == "xfs"
    assert nvme.filesystem_type("/mnt/my disk/run") == "tmpfs"
    assert nvme.filesystem_type("/mnt/ab") == "ext4"  # /mnt/a is not above /mnt/ab
    monkeypatch.setattr(nvme, "MOUNTS", str(tmp_path / "absent"))
    assert nvme.filesystem_type("/srv/x") is None


def test_a_directory_in_host_memory_warns(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    _mounts(tmp_path, monkeypatch, f"/dev/vda / ext4 rw 0 0\ntmpfs {run} tmpfs rw 0 0\n")
    with pytest.warns(UserWarning, match=r"is on tmpfs, which keeps its files in host memory"):
        Swapper(run, [100]).close()
    other = tmp_path / "disk"
    other.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Swapper(other, [100]).close()  # ext4: no warning


def test_a_second_swapper_on_the_file_is_refused_naming_the_owner(tmp_path):
    sizes, data = _random_groups(7, 3, 10 * KIB)
    with Swapper(tmp_path, sizes) as sw:
        _fill(sw, data)
        with pytest.raises(BlockingIOError, match=f"in use by process {os.getpid()}"):
            Swapper(tmp_path, sizes)
        Swapper(tmp_path, sizes, name="other.swp").close()  # another file: its own lock
    with Swapper(tmp_path, sizes) as again:  # closed: the lock is free, the bytes kept
        for g, buf in again.pipelined(write=False):
            np.testing.assert_array_equal(buf, data[g])


# Another process holds the file (nvme.py loaded alone, as the RSS script does) until told to
# close it.
_HOLD_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("nvme", sys.argv[1])
    nvme = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nvme)
    with nvme.Swapper(sys.argv[2], [4096]):
        print("held", flush=True)
        sys.stdin.readline()
    """
)


def test_another_run_in_the_directory_is_refused_naming_its_pid(tmp_path):
    other = subprocess.Popen(
        [sys.executable, "-c", _HOLD_SCRIPT, nvme.__file__, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(BlockingIOError, match=f"in use by process {other.pid} "):
            Swapper(tmp_path, [4096])
    finally:
        other.communicate("\n", timeout=60)
    assert other.returncode == 0
    Swapper(tmp_path, [4096]).close()  # the other run ended: its lock went with it


def test_a_full_disk_in_the_middle_of_a_write_fails_cleanly(tmp_path, monkeypatch):
    """A write that hits ENOSPC (a thin-provisioned or copy-on-write disk can, despite the
    preallocation): the pass raises it naming the group and the file, every buffer is back in
    the pool, the groups written before and after it hold their new bytes, and the swapper
    goes on working."""
    sizes, data = _random_groups(8, 5, 20 * KIB)
    real = os.pwritev
    with Swapper(tmp_path, sizes, buffer_count=3, block_bytes=4 * KIB) as sw:
        _fill(sw, data)
        bad = sw.offsets[2]

        def full(fd, buffers, offset):
            if offset == bad:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, buffers, offset)

        monkeypatch.setattr(os, "pwritev", full)
        with pytest.raises(OSError, match=r"No space left on device \(write of group 2 ") as info:
            for _, buf in sw.pipelined():
                buf ^= 0xFF
        assert info.value.errno == errno.ENOSPC and sw.path in str(info.value)
        assert sw.in_use == 0
        monkeypatch.setattr(os, "pwritev", real)
        got = [buf.copy() for _, buf in sw.pipelined(write=False)]
    for g in (0, 1, 3, 4):
        np.testing.assert_array_equal(got[g], data[g] ^ 0xFF)
