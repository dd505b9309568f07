"""A checkpoint's JSON metadata is input from outside (a directory someone else wrote): every
field is checked for type and range before jaxzero uses it (:func:`check_metadata`).

Nothing in the metadata is ever used as a file path: leaf paths are names of tree entries, and
Orbax reads the arrays from the step's own directory. The checks stop a crafted or damaged file
from turning into a confusing traceback deep inside a restore, an estimate built on absurd
sizes, or a tree built from names of the wrong type.
"""

from __future__ import annotations

import math
from collections.abc import Callable

MAX_DIMS = 32
MAX_ELEMENTS = 2**50  # per leaf: ~1e15 elements, far beyond any device
MAX_NAME = 4096
DTYPES = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "bfloat16": 2,
    "float16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
}
PRECISION_DTYPES = ("float32", "bfloat16", "float16")


class _Bad(ValueError):
    def __init__(self, field: str, value, why: str):
        super().__init__(f"field {field!r} = {repr(value)[:80]} ({why})")


def _int(field, v, lo=0, hi=None):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise _Bad(field, v, f"must be an int {bound}")
    return v


def _of(kind: type, field: str, v, what: str):
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise _Bad(field, v, f"must be {what}")
    return v


def _name(field, v):
    _of(str, field, v, "a string")
    if not v or len(v) > MAX_NAME or "\x00" in v:
        raise _Bad(field, v, f"must be a non-empty name of at most {MAX_NAME} characters")
    return v


def _leaf(i: int, row) -> int:
    """Check one leaf row; returns its bytes."""
    f = f"leaves[{i}]"
    _of(dict, f, row, "an object")
    _name(f"{f}.path", row.get("path"))
    shape = _of(list, f"{f}.shape", row.get("shape"), "a list of ints")
    if len(shape) > MAX_DIMS:
        raise _Bad(f"{f}.shape", shape, f"has more than {MAX_DIMS} dimensions")
    for d in shape:
        _int(f"{f}.shape", d, 0, MAX_ELEMENTS)
    if math.prod(shape) > MAX_ELEMENTS:
        raise _Bad(f"{f}.shape", shape, "holds more than 2**50 elements")
    dtype = row.get("dtype")
    if dtype not in DTYPES:
        raise _Bad(f"{f}.dtype", dtype, f"must be one of {sorted(DTYPES)}")
    nbytes = math.prod(shape) * DTYPES[dtype]
    if _int(f"{f}.bytes", row.get("bytes")) != nbytes:
        raise _Bad(f"{f}.bytes", row.get("bytes"), f"a {dtype}{tuple(shape)} leaf has {nbytes}")
    if row.get("spec") is not None:
        _of(str, f"{f}.spec", row["spec"], "a string or null")
    return nbytes


def _leaves(rows) -> int:
    _of(list, "leaves", rows, "a list")
    return sum(_leaf(i, row) for i, row in enumerate(rows))


def _mesh(v):
    _of(dict, "mesh", v, "an object of axis name -> size")
    for k, n in v.items():
        _name("mesh axis", k)
        _int(f"mesh.{k}", n, 1)


def _precision(v):
    _of(dict, "precision", v, "an object of dtype names")
    for k, d in v.items():
        if d not in PRECISION_DTYPES:
            raise _Bad(f"precision.{k}", d, f"must be one of {PRECISION_DTYPES}")


def _strings(field):
    def check(v):
        for s in _of(list, field, v, "a list of strings"):
            _name(field, s)

    return check


def _checksums(v):
    _of(dict, "checksums", v, "an object")
    _of(str, "checksums.algorithm", v.get("algorithm"), "a string")
    for k, h in _of(dict, "checksums.leaves", v.get("leaves"), "an object").items():
        _name("checksums.leaves", k)
        if not isinstance(h, str) or len(h) != 16 or any(c not in "0123456789abcdef" for c in h):
            raise _Bad(f"checksums.leaves[{k!r}]", h, "must be 16 lowercase hex digits")


_FIELDS: dict[str, Callable] = {
    "format": lambda v: _of(str, "format", v, "a string"),
    "jaxzero_version": lambda v: _of(str, "jaxzero_version", v, "a string"),
    "step": lambda v: _int("step", v),
    "checkpoint_step": lambda v: _int("checkpoint_step", v),
    "stage": lambda v: _int("stage", v, 0, 3),
    "axis": lambda v: _name("axis", v),
    "num_devices": lambda v: _int("num_devices", v, 1),
    "process_count": lambda v: _int("process_count", v, 1),
    "total_bytes": lambda v: _int("total_bytes", v),
    "loss_scale": lambda v: _of(str, "loss_scale", v, "a string"),
    "optimizer": lambda v: _of(str, "optimizer", v, "a string"),
    "has_ema": lambda v: _of(bool, "has_ema", v, "true or false"),
    "has_master": lambda v: _of(bool, "has_master", v, "true or false"),
    "has_extra": lambda v: _of(bool, "has_extra", v, "true or false"),
    "mesh": _mesh,
    "precision": _precision,
    "opt_state_types": _strings("opt_state_types"),
    "layers": _strings("layers"),
    "units": _strings("units"),
    "offload": lambda v: _name("offload", v),
    "checksums": _checksums,
    "user": lambda v: _of(dict, "user", v, "an object"),
    "ema": lambda v: _of(dict, "ema", v, "an object of EMA settings"),
}


def check_metadata(meta, where: str) -> dict:
    """``meta`` (the parsed JSON of a step's metadata item) when every field jaxzero reads has
    the right type and range; ValueError naming ``where``, the field and the value otherwise.
    Unknown fields are left alone (a newer writer may add some); null means absent."""
    try:
        _of(dict, "<metadata>", meta, "a JSON object")
        for field, check in _FIELDS.items():
            if meta.get(field) is not None:
                check(meta[field])
        if meta.get("leaves") is not None:
            total = _leaves(meta["leaves"])
            if meta.get("total_bytes") is not None and meta["total_bytes"] != total:
                raise _Bad("total_bytes", meta["total_bytes"], f"the leaves hold {total}")
    except _Bad as e:
        raise ValueError(
            f"the jaxzero metadata of {where} is not valid: {e}. The checkpoint is damaged or "
            f"was not written by jaxzero; nothing from it was used."
        ) from None
    return meta
