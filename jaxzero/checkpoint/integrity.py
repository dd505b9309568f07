"""Checksums of a checkpoint's arrays, so that a damaged step is refused, never loaded.

Tensorstore stores no checksums: a truncated or deleted file fails to read, but altered bytes
can decode into wrong numbers. :func:`checksums` therefore hashes every array leaf when it is
saved, and :func:`check` hashes it again after it is read back; the two must agree bit for bit.

The hash of a leaf is a sum over its elements, modulo 2**32, of murmur3's finaliser applied to
a combination of each element's bits and its global position (two independent 32-bit sums:
64 bits per leaf; the finaliser is a bijection, so changing any one element changes the
sum), in blocks that stay in cache (~600 MB/s on one core of the 2-core CPU machine). A sum
does not depend on how the leaf is cut into shards, so

* every process hashes only its own shards (its addressable shards with ``replica_id == 0``;
  a leaf the process holds whole, once; in numpy: no compilation), and the partial sums are added across processes (an all-gather
  of 16 bytes per leaf when there are several). Every process then holds every leaf's
  checksum, so process 0 writes them into the step's JSON ``metadata`` item: nothing else is
  gathered and there are no per-process files to commit. The metadata item is committed with
  the arrays in Orbax's atomic step commit (the step directory is renamed into place only
  when every item is written), so a step's checksums and arrays are always from the same save;
* the hash is taken before :func:`~jaxzero.checkpoint.save` returns, of the very arrays the
  asynchronous save then copies, so the state may be donated or updated afterwards;
* on restore, each process hashes the shards it read, in the restore's sharding (any device
  count, stage or mesh), and the sum is again the leaf's checksum.

Steps saved before checksums existed carry none; they restore unchecked (a read error is still
reported with the step and the leaf).

A damaged step's error names the damaged file (relative to the checkpoint directory).
:func:`step_files` reads the OCDBT index of the step's items (its manifest and B+tree nodes,
through tensorstore's ``ocdbt.dump``): which data file holds each leaf's chunks and how many
bytes of each file the index refers to. A file that is missing or shorter than that is found
before any array is read; altered bytes are traced from the key a failed read names, or from
the leaf whose checksum differs, to the file that holds them.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

ALGORITHM = "jaxzero.addhash-2x32/1"
KEY = "checksums"


class CheckpointDamagedError(ValueError):
    """A checkpoint step could not be read, or read back other numbers than were saved.

    Attributes:
      step: the step; leaf: the leaf's path (None when unknown); directory: the checkpoint
        directory; file: the damaged file, relative to ``directory`` (None when unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        leaf: str | None = None,
        directory=None,
        file: str | None = None,
    ):
        super().__init__(message)
        self.step, self.leaf, self.directory, self.file = step, leaf, directory, file


_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def _fmix(h: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser, in place (every input bit affects every output bit)."""
    h ^= h >> 16
    h *= _M1
    h ^= h >> 13
    h *= _M2
    h ^= h >> 16
    return h


def _words(data: np.ndarray) -> np.ndarray:
    """A shard's bits as uint32 words: one per element, two (a trailing axis) for 8-byte
    dtypes and complex64, four for complex128."""
    data = np.ascontiguousarray(data)
    size = data.dtype.itemsize
    if data.dtype == np.bool_ or size == 1:
        return data.view(np.uint8).astype(np.uint32)
    if size == 2:
        return data.view(np.uint16).astype(np.uint32)
    if size == 4:
        return data.view(np.uint32)
    return data.view(np.uint32).reshape(*data.shape, size // 4)


_BLOCK = 1 << 15  # elements per numpy pass: the temporaries stay in cache
_C1, _C2, _C3 = np.uint32(0x9E3779B1), np.uint32(0x2545F491), np.uint32(0x7F4A7C15)


def _mixed_sums(w: np.ndarray, index) -> np.ndarray:
    """``[sum fmix(w + i*C1), sum fmix((w ^ i*C2) + C3)]`` mod 2**32 over the flat words
    ``w``; ``index(lo, hi)`` gives the global positions of ``w[lo:hi]`` (uint32)."""
    sa = sb = 0
    for lo in range(0, w.size, _BLOCK):
        hi = min(lo + _BLOCK, w.size)
        i, x = index(lo, hi), w[lo:hi]
        a = i * _C1
        a += x
        b = i * _C2
        b ^= x
        b += _C3
        sa += int(np.sum(_fmix(a), dtype=np.uint64))
        sb += int(np.sum(_fmix(b), dtype=np.uint64))
    return np.asarray([sa % 2**32, sb % 2**32], np.uint64)


def _shard_sums(data: np.ndarray, starts: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The two 32-bit sums of one shard at ``starts`` of a leaf of global ``shape``."""
    w = _words(data)
    gshape = tuple(shape) + w.shape[len(shape) :]
    if w.shape == gshape:  # the whole leaf: positions are 0, 1, 2, ...

        def whole(lo, hi):
            return (np.arange(lo, hi, dtype=np.uint64) % 2**32).astype(np.uint32)

        return _mixed_sums(w.reshape(-1), whole)
    starts = tuple(starts) + (0,) * (w.ndim - len(starts))
    index = np.zeros(w.shape, np.uint32)
    stride = 1
    for d in reversed(range(w.ndim)):
        pos = (np.arange(w.shape[d], dtype=np.uint64) + starts[d]) * np.uint64(stride)
        index += (
            (pos % 2**32).astype(np.uint32).reshape([-1 if e == d else 1 for e in range(w.ndim)])
        )
        stride *= gshape[d]
    flat = index.reshape(-1)
    return _mixed_sums(w.reshape(-1), lambda lo, hi: flat[lo:hi])


def _pieces(x) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """``(starts, data)`` of what this process hashes of ``x``: a leaf held whole by this
    process (every leaf with one process) once, on process 0; otherwise its addressable
    shards with ``replica_id == 0`` (each element once across all processes)."""
    if isinstance(x, jax.Array):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if not x.is_fully_addressable:
            return [
                (tuple(s.start or 0 for s in shard.index), np.asarray(shard.data))
                for shard in x.addressable_shards
                if shard.replica_id == 0
            ]
    if jax.process_index() != 0:
        return []
    return [((0,) * np.ndim(x), np.asarray(x))]


def _partial_sums(x) -> np.ndarray:
    total = np.zeros(2, np.uint64)
    for starts, data in _pieces(x):
        total = (total + _shard_sums(data, starts, np.shape(x))) % 2**32
    return total


def checksums(flat: dict) -> dict[str, str]:
    """``{leaf name: 16 hex digits}`` for a flat ``{name: array}`` dict (the state as saved:
    per-leaf EMA). Each process hashes its own shards; with several processes the partial
    sums (16 bytes per leaf) are all-gathered and added, so every process gets every leaf's
    checksum."""
    names = [name for name, x in flat.items() if hasattr(x, "shape") and hasattr(x, "dtype")]
    sums = np.stack([_partial_sums(flat[n]) for n in names]) if names else np.zeros((0, 2))
    if jax.process_count() > 1 and names:
        from jax.experimental import multihost_utils

        sums = np.asarray(multihost_utils.process_allgather(sums.astype(np.uint32)), np.uint64)
        sums = sums.sum(axis=0) % 2**32
    return {n: f"{int(a):08x}{int(b):08x}" for n, (a, b) in zip(names, sums, strict=True)}


def check(flat: dict, stored: dict | None, *, step: int, directory, files=None) -> int:
    """Compare the checksums of the restored arrays ``flat`` with those saved (``stored``,
    the metadata's ``checksums`` entry; None for a step saved without them); ``files`` (a
    :class:`StepFiles`) names the file that holds a leaf whose numbers differ.

    Returns:
      The number of leaves checked (0 when the step has no checksums).

    Raises:
      CheckpointDamagedError: naming the step, the first leaf whose numbers differ and the
        file holding it.
    """
    if not stored:
        return 0
    want = stored.get("leaves", {})
    if stored.get("algorithm") != ALGORITHM:
        return 0  # a newer hash this version cannot compute: nothing to compare
    got = checksums({name: x for name, x in flat.items() if name in want})
    for name, digest in got.items():
        if digest != want[name]:
            held = () if files is None else files.leaf_files.get(name, ())
            where = (
                f"its bytes in file {' or '.join(held)} were" if held else "its array files were"
            )
            raise CheckpointDamagedError(
                f"checkpoint step {step} in {directory} is damaged: leaf {name} reads back "
                f"other numbers than were saved (checksum {digest}, saved {want[name]}): "
                f"{where} altered or truncated after the save. {_ADVICE}",
                step=step,
                leaf=name,
                directory=directory,
                file=held[0] if held else None,
            )
    return len(got)


_ADVICE = "Restore another step (restore(..., fallback=True) picks the newest step that verifies)."


def any_process_failed(error: BaseException | None) -> bool:
    """Whether this process (``error`` is not None) or any other failed a read."""
    failed = error is not None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray([failed], np.int32))
        failed = bool(np.asarray(flags).any())
    return failed


def read_error(
    error: BaseException | None, *, step: int, directory, files=None
) -> CheckpointDamagedError:
    """The :class:`CheckpointDamagedError` of a failed read (``error`` None: another process's
    read failed; that process names the leaf), naming the file that holds the key the read
    failed on (``files``: the step's :class:`StepFiles`)."""
    if error is None:
        return CheckpointDamagedError(
            f"checkpoint step {step} in {directory} is damaged: an array could not be read on "
            f"another process. {_ADVICE}",
            step=step,
            directory=directory,
        )
    failed = _failed_key(error)
    leaf = leaf_of(error)
    file = None
    if failed is not None:
        item, key, why = failed
        leaf = leaf or key.split("/")[0]
        if files is not None:
            file = files.key_files.get((item, key))
            if file is None and (held := files.leaf_files.get(_leaf_name(item, leaf))):
                file = held[0]
    else:
        why = first_line(error)
    what = f"leaf {leaf}" if leaf else "an array"
    where = (
        f"file {file} (holding {what}) could not be read" if file else f"{what} could not be read"
    )
    return CheckpointDamagedError(
        f"checkpoint step {step} in {directory} is damaged: {where} ({why}). {_ADVICE}",
        step=step,
        leaf=leaf,
        directory=directory,
        file=file,
    )


# tensorstore's message of a failed OCDBT read: the key, the database and why.
_OCDBT_READ = re.compile(
    r'Error reading "([^"]+)" in OCDBT database at local file "([^"]*)": ?(.*)', re.DOTALL
)


def _failed_key(error: BaseException) -> tuple[str, str, str] | None:
    """``(item, key, why)`` of the tensorstore read error in ``error``'s chain (orbax wraps
    it), if any: ``item`` is the database directory's name (``state``, ``extra``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        m = _OCDBT_READ.search(str(error))
        if m:
            key, database, why = m.groups()
            why = why.strip().splitlines()[0] if why.strip() else "unreadable"
            why = why.split(" [source locations=")[0]
            return os.path.basename(database.rstrip("/\\")), key, why
        error = error.__cause__ or error.__context__
    return None


def _leaf_name(item: str, leaf: str) -> str:
    """The jaxzero leaf name of OCDBT key prefix ``leaf`` in ``item``."""
    return f"extra.{leaf}" if item == "extra" else leaf


# ------------------------------------------------------------------- where the damage is
@dataclasses.dataclass(frozen=True)
class StepFiles:
    """Where one step's array bytes are on disk (paths relative to the checkpoint directory).

    Attributes:
      leaf_files: leaf name -> the files holding its chunks (chunks small enough to sit in
        the index itself have none).
      key_files: ``(item, OCDBT key)`` -> the file holding that chunk.
      damaged: ``(file, what is wrong)`` for each file that is missing or shorter than the
        index says, or whose index cannot be read.
    """

    leaf_files: dict[str, tuple[str, ...]]
    key_files: dict[tuple[str, str], str]
    damaged: tuple[tuple[str, str], ...]


def _ref(location: str) -> tuple[str, int, int]:
    """``(path under the item directory, offset, length)`` of an OCDBT location
    ``"<kind>:<base path>:<relative path>:<offset>:<length>"``."""
    head, offset, length = location.rsplit(":", 2)
    _kind, base, relative = head.split(":", 2)
    return base + relative, int(offset), int(length)


def _scan_item(item_dir: str):
    """``(keys, need, damaged)`` of one OCDBT item directory: key -> file, file -> bytes the
    index refers to, and the files whose index could not be read (paths under ``item_dir``)."""
    keys: dict[str, str] = {}
    need: dict[str, int] = {}
    damaged: list[tuple[str, str]] = []
    base = ts.KvStore.open({"driver": "file", "path": item_dir.rstrip("/") + "/"}).result()
    try:
        manifest = ts.ocdbt.dump(base).result()
    except Exception as e:  # noqa: BLE001 - a damaged manifest is reported, not raised
        return keys, need, [("manifest.ocdbt", f"cannot be read ({first_line(e)})")]
    versions = manifest.get("versions") or []
    root = max(versions, key=lambda v: v.get("generation_number", 0)) if versions else {}
    pending = [(root["root"]["location"], b"")] if "location" in root.get("root", {}) else []
    while pending:
        location, prefix = pending.pop()
        path, offset, length = _ref(location)
        need[path] = max(need.get(path, 0), offset + length)
        if not os.path.isfile(os.path.join(item_dir, path)):
            continue  # reported below as missing
        try:
            node = ts.ocdbt.dump(base, location).result()
        except Exception as e:  # noqa: BLE001 - reported below, or as unreadable
            damaged.append((path, f"cannot be read ({first_line(e)})"))
            continue
        for entry in node.get("entries", ()):
            key = prefix + entry.get("key", b"")
            if "location" in entry:  # an inner node: its keys are relative to its prefix
                pending.append(
                    (entry["location"], prefix + entry.get("subtree_common_prefix", b""))
                )
            elif "indirect_value" in entry:
                value_path, offset, length = _ref(entry["indirect_value"])
                need[value_path] = max(need.get(value_path, 0), offset + length)
                keys[key.decode("utf-8", "replace")] = value_path
    return keys, need, damaged


def step_files(directory, step: int, items=("state", "extra")) -> StepFiles:
    """Read the OCDBT index of ``step``'s ``items`` (those present) and check that every
    file it refers to exists and holds the bytes it refers to; no array is read."""
    directory = os.fspath(directory)
    leaf_files: dict[str, list[str]] = {}
    key_files: dict[tuple[str, str], str] = {}
    damaged: list[tuple[str, str]] = []
    for item in items:
        item_dir = os.path.join(directory, str(step), item)
        if not os.path.isfile(os.path.join(item_dir, "manifest.ocdbt")):
            continue  # absent item, or not an OCDBT item: nothing to index
        keys, need, bad = _scan_item(item_dir)

        def rel(path, item=item):
            return "/".join((str(step), item, path))

        for key, path in keys.items():
            key_files[(item, key)] = rel(path)
            held = leaf_files.setdefault(_leaf_name(item, key.split("/")[0]), [])
            if rel(path) not in held:
                held.append(rel(path))
        damaged.extend((rel(path), why) for path, why in bad)
        for path, size in sorted(need.items()):
            full = os.path.join(item_dir, path)
            if not os.path.isfile(full):
                damaged.append((rel(path), "is missing"))
            elif (have := os.path.getsize(full)) < size:
                damaged.append(
                    (rel(path), f"is truncated: {have} bytes, the step's index refers to {size}")
                )
    return StepFiles(
        {k: tuple(v) for k, v in leaf_files.items()}, key_files, tuple(dict.fromkeys(damaged))
    )


def files_error(files: StepFiles, *, step: int, directory) -> CheckpointDamagedError:
    """The :class:`CheckpointDamagedError` of a step whose files are missing or truncated
    (``files.damaged`` is not empty), naming the first such file and a leaf it holds."""
    file, why = files.damaged[0]
    held = [leaf for leaf, paths in files.leaf_files.items() if file in paths]
    holds = f"; it holds leaf {held[0]}" + (f" and {len(held) - 1} more" if len(held) > 1 else "")
    more = len(files.damaged) - 1
    others = f" ({more} more damaged file{'s' if more > 1 else ''})" if more else ""
    return CheckpointDamagedError(
        f"checkpoint step {step} in {directory} is damaged: file {file} {why}"
        f"{holds if held else ''}{others}. {_ADVICE}",
        step=step,
        leaf=held[0] if held else None,
        directory=directory,
        file=file,
    )


_TS_KEY = re.compile(r"'path': '([^'/]+)/'")
_WRITE_KEY = re.compile(r'Error (?:reading|writing) "([^"/]+)/')


def leaf_of(error: BaseException) -> str | None:
    """The leaf a tensorstore error names (its key in the OCDBT database), if any."""
    text = str(error)
    for pattern in (_TS_KEY, _WRITE_KEY):
        m = pattern.search(text)
        if m:
            return m.group(1)
    return None


_TMP_STEP = re.compile(r"[/\\](\d+)\.orbax-checkpoint-tmp")


def failed_step(error: BaseException) -> int | None:
    """The step whose temporary directory an Orbax write error names, if any."""
    m = _TMP_STEP.search(str(error))
    return int(m.group(1)) if m else None


_WRITE_ERROR = re.compile(
    r"Error writing|Failed writing|Failed to write|os_error_code|No space left|File too large"
)


def is_write_error(error: BaseException) -> bool:
    """An error from writing files (disk full, file too large, I/O error)."""
    return isinstance(error, OSError) or bool(_WRITE_ERROR.search(str(error)))


def first_line(error: BaseException, limit: int = 300) -> str:
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= limit else text[:limit] + "..."
