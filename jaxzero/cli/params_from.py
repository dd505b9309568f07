"""``--params-from MODULE:FUNCTION``: the target model's params structure for a conversion.

``FUNCTION`` (no arguments) returns the Flax params tree the converted checkpoint must restore
into: arrays, or their shapes (``jax.eval_shape``, which allocates nothing), e.g.::

    # mymodel.py
    def params():
        x = jnp.zeros((1, 32))
        return jax.eval_shape(lambda: Model().init(jax.random.key(0), x)["params"])

``jaxzero convert deepspeed2jax RUN --out CKPT --params-from mymodel:params`` then pairs the
checkpoint's torch names with that tree's leaves (:func:`jaxzero.interop.torch.build_name_map`:
Linear ``weight`` -> transposed ``kernel``, LayerNorm ``weight`` -> ``scale``, ...; ``--name-map``
entries override single names) and refuses, naming them, torch params without a leaf and
leaves without a torch param. ``MODULE`` is imported from the current directory or
``PYTHONPATH``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping

import numpy as np

__all__ = ["deepspeed_name_map", "load_params_template", "template_name_map"]

_HOW = "give --params-from MODULE:FUNCTION, a function of no arguments returning the params"


def _resolve(spec: str):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"`params_from` {spec!r} is not MODULE:FUNCTION; {_HOW}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"`params_from` {spec!r}: cannot import {module_name!r} ({e}); run from the "
            "directory that holds it or add that directory to PYTHONPATH"
        ) from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"`params_from` {spec!r}: {module_name} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"`params_from` {spec!r} is a {type(target).__name__}; {_HOW}")
    return target


def load_params_template(spec: str):
    """The params tree ``spec`` (``"module:function"``) returns, as ``ShapeDtypeStruct`` leaves.

    Raises:
      ValueError: ``spec`` is malformed, does not import, is not callable, or returns no
        arrays or Flax variables (``{"params": ...}``) instead of the params.
    """
    import jax

    tree = _resolve(spec)()
    if isinstance(tree, Mapping) and "params" in tree:
        raise ValueError(
            f"`params_from` {spec!r} returned Flax variables (a 'params' collection among "
            f"{sorted(map(str, tree))}); return variables['params']"
        )
    leaves = jax.tree.leaves(tree)
    bad = [type(x).__name__ for x in leaves if not hasattr(x, "shape") or not hasattr(x, "dtype")]
    if not leaves or bad:
        what = f"leaves of type {sorted(set(bad))}" if bad else "no leaves"
        raise ValueError(f"`params_from` {spec!r} returned {what}; {_HOW} (arrays or shapes)")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _check_nested_dicts(template, spec: str) -> None:
    """The converters write nested dicts: refuse a template with other nodes (a FrozenDict,
    lists, tuples), whose structure the written checkpoint would not have."""
    import jax

    from jaxzero.interop.torch.common import by_path
    from jaxzero.interop.torch.convert_common import nest

    rebuilt = nest(dict.fromkeys(by_path(template), 0))
    if jax.tree.structure(rebuilt) != jax.tree.structure(jax.tree.map(lambda _: 0, template)):
        raise ValueError(
            f"`params_from` {spec!r} returned a tree whose nodes are not all dicts (a "
            f"{type(template).__name__}, lists or tuples); the converted checkpoint holds "
            "nested dicts: return a tree of dicts (flax.core.unfreeze for a FrozenDict)"
        )


def template_name_map(torch_shapes: Mapping, template, overrides=None, spec: str = "") -> dict:
    """``{torch_name: "a/b/kernel"}`` pairing every torch param (name -> shape, torch order)
    with a leaf of ``template`` (``overrides``: ``{torch_name: path or None}`` first).

    Raises:
      ValueError: a torch param with no leaf, a leaf with no torch param, or a pairing whose
        layout the name map cannot express (each listed).
    """
    from jaxzero.interop.torch.names import build_name_map
    from jaxzero.interop.torch.torch_files import kind_for

    _check_nested_dicts(template, spec)
    nm = build_name_map(dict(torch_shapes), template, overrides=overrides)
    problems = []
    if nm.unmatched_torch:
        problems.append(f"torch params with no leaf: {', '.join(nm.unmatched_torch)}")
    if nm.unmatched_flax:
        problems.append(f"leaves no torch param maps to: {', '.join(nm.unmatched_flax)}")
    odd = [
        f"{n} -> {'/'.join(p)} ({k})"
        for n, p, k in nm.entries
        if k != kind_for(p, tuple(torch_shapes[n]))
    ]
    if odd:
        problems.append(f"layouts a name map cannot express: {', '.join(odd)}")
    if problems:
        raise ValueError(
            f"`params_from` {spec!r} does not match the checkpoint: {'; '.join(problems)}. "
            "Pair the names with `name_map` (a JSON {torch_name: 'a/b/kernel'})"
        )
    out = {n: "/".join(p) for n, p, _ in nm.entries}
    out.update(dict.fromkeys(nm.ignored))
    return out


def deepspeed_name_map(save_dir, tag, spec: str, name_map_file: str | None) -> dict:
    """The name map that converts the DeepSpeed checkpoint ``save_dir``/``tag`` into the params
    structure ``spec`` returns (``name_map_file``: overrides)."""
    from jaxzero.interop.deepspeed import read_checkpoint
    from jaxzero.interop.torch.convert_common import read_name_map

    template = load_params_template(spec)
    ckpt = read_checkpoint(save_dir, tag)
    shapes = {n: np.shape(ckpt.params[n]) for n in ckpt.param_names}
    return template_name_map(shapes, template, read_name_map(name_map_file), spec)
