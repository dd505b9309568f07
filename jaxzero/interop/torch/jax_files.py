"""The jax side of a conversion: reading a jaxzero checkpoint's metadata, its params structure,
the torch names of its leaves and its AdamW hyper-parameters."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxzero import trees
from jaxzero.interop.torch.convert_common import (
    CONVERT_KEY,
    OPTIMIZER,
    ConvertError,
    adamw,
    bad_input,
    nest,
    read_name_map,
)
from jaxzero.interop.torch.names import NameMap, build_name_map
from jaxzero.interop.torch.optimizer_state import adamw_hyperparams


@dataclasses.dataclass(frozen=True)
class JaxCheckpoint:
    """A jaxzero checkpoint's facts needed to convert it (:func:`read_jax_checkpoint`):
    ``record`` is what :func:`~jaxzero.interop.torch.convert.torch_to_jax` recorded (or {}),
    ``abstract`` the params structure (ShapeDtypeStructs), ``names`` the torch names in
    optimizer order."""

    path: str
    meta: dict
    step: int
    record: dict
    abstract: dict
    name_map: NameMap
    names: list[str]


def _params_from_leaf_table(meta: dict):
    """Params structure ``[(path tuple, shape, dtype)]`` from a checkpoint's leaf table (keys
    split on '.', so keys that contain dots cannot be recovered this way)."""
    rows = trees.leaf_rows_under(meta.get("leaves", []), "params")
    if not rows:
        raise ConvertError("the checkpoint metadata lists no params leaves")
    return [(tuple(r["path"].split(".")[1:]), tuple(r["shape"]), r["dtype"]) for r in rows]


def _torch_names(leaves, abstract, nm_json: dict | None, rec: dict) -> tuple[NameMap, list[str]]:
    """The name map and the torch names in optimizer order: from the JSON name map, else the
    recorded one, else the reverse naming rules."""
    if nm_json is not None:
        missing = sorted("/".join(p) for p, _, _ in leaves if "/".join(p) not in nm_json.values())
        if missing:
            raise ConvertError(f"name map has no torch name for the tree leaves {missing}")
        with bad_input():
            nm = build_name_map(
                [n for n, v in nm_json.items() if v is not None],
                abstract,
                overrides={n: v for n, v in nm_json.items() if v is not None},
            )
        return nm, list(nm.torch_names)
    if rec.get("name_map"):
        nm = NameMap(entries=tuple((n, tuple(p.split("/")), k) for n, p, k in rec["name_map"]))
        return nm, list(rec.get("param_names") or nm.torch_names)
    with bad_input(ValueError):
        nm = build_name_map(None, abstract)
    return nm, list(nm.torch_names)


def read_jax_checkpoint(ckpt: str, *, step: int | None = None, name_map: str | None = None):
    """Step 1 of jax -> torch: the checkpoint's metadata, params structure and torch names
    (arguments as in :func:`jaxzero.interop.torch.convert.jax_to_torch`)."""
    import jax

    from jaxzero import checkpoint

    if not os.path.isdir(ckpt):
        raise ConvertError(f"checkpoint directory {ckpt!r}: no such directory")
    with bad_input(FileNotFoundError, ValueError):
        meta = checkpoint.load_metadata(ckpt, step)
    step = meta.get("checkpoint_step", meta.get("step"))
    rec = (meta.get("user") or {}).get(CONVERT_KEY) or {}
    if meta.get("has_ema"):
        raise ConvertError("checkpoints with an EMA are not supported by convert yet")
    if rec.get("params"):
        leaves = [(tuple(p.split("/")), tuple(s), d) for p, s, d in rec["params"]]
    else:
        leaves = _params_from_leaf_table(meta)
    abstract = nest({p: jax.ShapeDtypeStruct(s, np.dtype(d)) for p, s, d in leaves})
    nm, names = _torch_names(leaves, abstract, read_name_map(name_map), rec)
    return JaxCheckpoint(ckpt, meta, step, rec, abstract, nm, names)


def hyperparams_of(source: JaxCheckpoint, **overrides) -> dict:
    """Torch AdamW hyper-parameters: the recorded ones with ``overrides`` (``lr``, ``betas``,
    ``eps``, ``weight_decay``; None: keep) applied; ``lr`` is required without a record."""
    rec = source.record
    hp = dict(rec.get("hyperparams") or {})
    if rec and rec.get("optimizer") not in (None, OPTIMIZER):
        raise ConvertError(f"unsupported optimizer {rec.get('optimizer')!r} (AdamW only)")
    given = {k: v for k, v in overrides.items() if v is not None}
    if not hp:
        if overrides.get("lr") is None:
            raise ConvertError(
                "the checkpoint records no torch hyper-parameters (not written by convert "
                "torch2jax): give `lr` (and `betas`/`eps`/`weight_decay` if not the defaults)"
            )
        hp = adamw_hyperparams(**given)
    hp.update(given)
    hp["betas"] = tuple(float(b) for b in hp["betas"])
    return hp


def check_adamw_state(source: JaxCheckpoint, hyperparams: dict):
    """The optax transform of ``hyperparams``; ConvertError unless the checkpoint's optimizer
    state has its structure."""
    import jax

    tx = adamw(hyperparams)
    want = trees.node_types(jax.eval_shape(tx.init, source.abstract))
    got = source.meta.get("opt_state_types") or []
    if got != want:
        raise ConvertError(
            f"unsupported optimizer: the checkpoint's optimizer state is [{', '.join(got)}] "
            f"(optimizer {source.meta.get('optimizer')!r}); only optax.adamw "
            f"([{', '.join(want)}]) is supported"
        )
    return tx
