"""The user's loss as the step runs it: what ``loss_fn`` may return (a mean, or a
:class:`GlobalMean` sum and count), how it is scaled for the gradient, and what its jaxpr says
about communication across the data-parallel devices.

jaxzero's gradient is the gradient of the global loss: each device differentiates its own
loss on its rows, and the step averages those gradients over devices and micro-batches (the
all-reduce or reduce-scatter). A loss that reduces over the data axes itself, the ``pmean``
or ``psum`` a ``pmap`` program leaves behind, breaks that contract silently: under
``shard_map`` the gradient of ``pmean(loss)`` on each device is 1/N of its share, and a loss
divided by ``psum(count)`` is 1/N of the global mean. :func:`check` finds such a reduction in
the loss's jaxpr before the first step and refuses it, naming the line and the fix; a loss
normalised by a global count returns :class:`GlobalMean` instead, which the step computes
exactly. A ``batch_stats`` collection updated with no reduction over the data axes (a
BatchNorm without ``axis_name``) is warned about once: its statistics are per device.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from jaxzero.trees import check_same_structure

#: Collective primitives that REDUCE over their axes (``pmean`` is ``psum`` and a division).
#: Gathers, permutes and all-to-alls are not listed: their transposes give each device the
#: gradient of every device's loss, which the step's mean turns into the global mean's.
REDUCTIONS = frozenset(
    {"psum", "psum2", "psum_invariant", "pmax", "pmin", "reduce_scatter", "psum_scatter"}
)

_JAXZERO = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: Library code whose reductions over the data axes are right under the step's mean: Flax's
#: normalization layers with ``axis_name=`` (SyncBatchNorm: a statistic each device uses on
#: its own rows).
_FLAX_NORMALIZATION = re.compile(r"flax[/\\](linen|nnx[/\\]nn)[/\\]normalization\.py$")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GlobalMean:
    """A loss normalised by a count over the whole global batch: ``loss_fn`` returns
    ``GlobalMean(total, count)`` (or ``(GlobalMean(...), aux)``) where ``total`` is the sum of
    the per-example (or per-token) losses on this device's rows and ``count`` how many they
    are (e.g. the number of unmasked labels). The step's loss is then
    ``sum(total) / sum(count)`` over every device and micro-batch, and its gradient exactly
    the gradient of that: what a ``pmap`` program computes with
    ``loss.sum() / jax.lax.psum(num_labels, "batch")`` and Hugging Face's token-weighted
    recipes with ``num_items_in_batch``. ``count`` is not differentiated; a step whose count
    is 0 has a zero gradient.

    Use it instead of a ``psum`` of the count in the loss: jaxzero averages the devices'
    gradients itself, so a loss that divides by a global count would be 1/N of the mean.
    """

    total: Any
    count: Any


class Found(NamedTuple):
    """A reduction over the data axes in the loss: its primitive, axes and source line."""

    primitive: str
    axes: tuple
    source: str
    from_library: bool

    def __str__(self) -> str:
        psum = "psum (a pmean is a psum and a division)"
        name = {
            "psum": psum,
            "psum_invariant": psum,
            "psum2": psum,
            "reduce_scatter": "psum_scatter",
        }
        return f"{name.get(self.primitive, self.primitive)} over {self.axes} at {self.source}"


def split_out(out):
    """``(loss, aux)`` from what ``loss_fn(params, batch)`` returned."""
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError(
                f"loss_fn returned a tuple of {len(out)} items; return a scalar loss, "
                f"jz.GlobalMean(total, count), or (loss, aux)."
            )
        return out[0], out[1]
    return out, None


def _structure(out, depth: int = 0) -> str:
    """What a loss returned, by structure, never a tracer's class: ``"an array of shape ()"``,
    ``"(array (), dict)"``."""
    if isinstance(out, tuple | list) and depth < 2:
        inner = ", ".join(_structure(x, depth + 1) for x in out)
        return f"({inner},)" if len(out) == 1 else f"({inner})"
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return (
            f"an array of shape {tuple(out.shape)}" if depth == 0 else f"array {tuple(out.shape)}"
        )
    return type(out).__name__


def _call(loss_fn, stateful, params, model_state, batch, rng):
    if stateful:
        out = loss_fn(params, model_state, batch, rng)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple)):
            raise ValueError(
                "a stateful loss_fn(params, model_state, batch, rng) must return "
                f"(loss, (new_model_state, aux)); it returned {_structure(out)}. Return "
                f"(loss, (model_state, None)) for a model with no state to update and no aux."
            )
        loss, (new_state, aux) = out
        check_same_structure(model_state, new_state, "model_state")
        return loss, aux, new_state
    loss, aux = split_out(loss_fn(params, batch))
    return loss, aux, None


def _scalar(x, what: str):
    if jnp.ndim(x) != 0:
        raise ValueError(f"loss_fn must return a scalar {what}, got shape {jnp.shape(x)}.")
    return x


def scaled_loss(loss_fn, stateful: bool):
    """``(params, model_state, batch, rng, scale) -> (scale * loss, (loss, count, aux,
    state))``: the objective the step differentiates and what it reports. ``count`` is None
    for a mean loss; for a :class:`GlobalMean` the loss is its ``total`` and ``count`` its
    count (as float32, never differentiated)."""

    def scaled(params, model_state, batch, rng, scale):
        loss, aux, new_state = _call(loss_fn, stateful, params, model_state, batch, rng)
        count = None
        if isinstance(loss, GlobalMean):
            count = jax.lax.stop_gradient(_scalar(loss.count, "count")).astype(jnp.float32)
            loss = _scalar(loss.total, "total (GlobalMean)")
        _scalar(loss, "loss")
        return loss.astype(jnp.float32) * scale, (loss, count, aux, new_state)

    return scaled


def check_signature(loss_fn, rng: bool, stateful: bool) -> None:
    """Raise TypeError before anything is traced when ``loss_fn`` cannot take the arguments
    the step hands it (``rng=True``: three; ``stateful=True``: four)."""
    n, form = (
        (4, "loss_fn(params, model_state, batch, rng)")
        if stateful
        else (3, "loss_fn(params, batch, rng)")
        if rng
        else (2, "loss_fn(params, batch)")
    )
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return
    try:
        signature.bind(*range(n))
    except TypeError:
        flag = "stateful=True" if stateful else "rng=True" if rng else "the default"
        fix = (
            "add the key argument (loss_fn(params, batch, rng), e.g. for "
            "rngs={'dropout': rng}), or drop rng=True"
            if rng and not stateful
            else f"write it as {form}"
        )
        raise TypeError(
            f"make_train_step(..., {flag}) calls {form}, but loss_fn{signature} does not take "
            f"{n} positional arguments; {fix}."
        ) from None


# -- what the loss's jaxpr says ------------------------------------------------------------


def _axes(eqn) -> tuple:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, tuple | list) else (axes,)


def _source(eqn) -> tuple[str, bool]:
    """(file:line of the user frame, whether that frame is jaxzero's or a Flax normalization
    layer's: library code whose reductions are part of a correct loss)."""
    try:
        from jax.extend.source_info_util import summarize

        where = summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - the location is for the message; none is still refused
        return "an unknown line", False
    path = re.sub(r":\d+(:\d+)? \(.*\)$", "", where)
    library = os.path.abspath(path).startswith(_JAXZERO) or bool(_FLAX_NORMALIZATION.search(path))
    return re.sub(r"^.*(site|dist)-packages/", "", where), library


def _sub_jaxprs(eqn):
    for p in eqn.params.values():
        for q in p if isinstance(p, tuple | list) else (p,):
            if hasattr(q, "eqns"):
                yield q
            elif hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
                yield q.jaxpr


def reductions_reaching(jaxpr, axes, given: dict | None = None) -> dict:
    """``{var: Found}``: every variable of ``jaxpr`` whose value a reduction over any of
    ``axes`` flows into (the first such reduction); ``given``: inputs already reached. A
    sub-jaxpr (a ``jit``, ``remat``, ``custom_vjp``, a loop's body, a ``cond``'s branches) is
    followed with its inputs aligned to the equation's last inputs; where its outputs do not
    align with the equation's, or the equation is a loop (a carry goes round), every output
    of an equation inside which a reduction reaches an output counts as reached."""
    axes = set(axes)
    reached: dict = dict(given or {})
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, Literal)]
        subs = list(_sub_jaxprs(eqn))
        loop = eqn.primitive.name in ("scan", "while")
        # a call whose outputs align with its jaxpr's is followed output by output
        precise = bool(subs) and not loop and all(len(q.outvars) == len(eqn.outvars) for q in subs)
        hit = None if precise else next((reached[v] for v in ins if v in reached), None)
        if eqn.primitive.name in REDUCTIONS and axes & set(_axes(eqn)):
            hit = hit or Found(eqn.primitive.name, _axes(eqn), *_source(eqn))
        for sub in subs:
            k = min(len(sub.invars), len(eqn.invars))
            pairs = zip(
                eqn.invars[len(eqn.invars) - k :], sub.invars[len(sub.invars) - k :], strict=True
            )
            seeds = {s: reached[v] for v, s in pairs if not isinstance(v, Literal) and v in reached}
            inner = reductions_reaching(sub, axes, seeds)
            if precise:
                for o, s in zip(eqn.outvars, sub.outvars, strict=True):
                    if not isinstance(s, Literal) and s in inner:
                        reached.setdefault(o, inner[s])
            else:
                outs = [inner[o] for o in sub.outvars if not isinstance(o, Literal) and o in inner]
                hit = hit or (outs[0] if outs else None)
        if hit is not None:
            for o in eqn.outvars:
                reached.setdefault(o, hit)
    return reached


class Traced(NamedTuple):
    """The loss's jaxpr (``scaled_loss``'s, traced once inside the step's ``shard_map``) and
    where its outputs are: the objective, the count, the new model state's leaves by path."""

    jaxpr: Any
    objective: Any
    count: Any
    state: dict


def trace(scaled, args) -> Traced | None:
    """:class:`Traced` of ``scaled(*args)``, or None when it fails to trace (the step's own
    trace then raises the loss's error)."""
    try:
        closed, shape = jax.make_jaxpr(scaled, return_shape=True)(*args)
    except Exception:  # noqa: BLE001 - the real trace reports the loss's errors
        return None
    outs = closed.jaxpr.outvars
    index = jax.tree.unflatten(jax.tree.structure(shape), range(len(outs)))
    _, (_, count, _, new_state) = index
    state = {
        jax.tree_util.keystr(path): outs[i]
        for path, i in jax.tree_util.tree_flatten_with_path(new_state)[0]
    }
    return Traced(closed.jaxpr, outs[index[0]], None if count is None else outs[count], state)


def _fix(found: Found, global_mean: bool) -> str:
    return (
        f"the loss reduces over the data axes itself ({found}). jaxzero's step already "
        f"averages the devices' gradients, and under shard_map the gradient of a loss reduced "
        f"over the devices is 1/N of its share: the step would train at 1/N of the gradient "
        f"without a word, so it refuses. Remove the collective from the loss: return the mean "
        f"over this device's rows (drop jax.lax.pmean(loss, ...) / jax.lax.psum(loss, ...); the "
        f"step reports metrics['loss'] averaged over devices)"
        + (
            ""
            if global_mean
            else "; for a loss normalised by a count over the whole batch "
            "(loss.sum() / jax.lax.psum(num_labels, ...)), return "
            "jz.GlobalMean(loss.sum(), num_labels): the step sums both over every device and "
            "micro-batch and divides exactly"
        )
        + ". A collective that computes a statistic each device then uses on its own rows "
        "(a hand-written synchronised BatchNorm, a contrastive loss's all_gather) is right "
        "under the step's mean: build the step with make_train_step(..., "
        "allow_loss_collectives=True) to keep it."
    )


def check(traced: Traced | None, axes, *, allow: bool, stateful_devices: int) -> None:
    """Before the first step: raise ValueError when a reduction over the data ``axes`` written
    in the user's code (not jaxzero's, not a Flax normalization layer's) reaches the loss or a
    :class:`GlobalMean`'s count, unless ``allow``; warn once when ``batch_stats`` are updated
    with no reduction over ``axes`` on ``stateful_devices`` > 1 devices."""
    if traced is None:
        return
    reached = reductions_reaching(traced.jaxpr, axes)
    if not allow:
        for var in (traced.objective, traced.count):
            found = reached.get(var) if var is not None else None
            if found is not None and not found.from_library:
                raise ValueError(_fix(found, traced.count is not None))
    stats = [p for p, v in traced.state.items() if "batch_stats" in p and v not in reached]
    if stats and stateful_devices > 1:
        warnings.warn(
            f"the model updates batch_stats ({stats[0]}{' and more' if len(stats) > 1 else ''}) "
            f"with no reduction over the data axes {tuple(axes)}: a BatchNorm without axis_name "
            f"normalises each device's 1/{stateful_devices} of the batch by that part's own "
            f"statistics, where a single-device run uses the whole batch's, so the loss, the "
            f"gradients and the running statistics differ from it. To match a single-device "
            f"run, build the model's BatchNorm(axis_name=zero.batch_axes) under jaxzero "
            f"(keep axis_name a field of the model, None by default, so the same model still "
            f"runs in a plain script: docs/guide/from-pmap.md).",
            UserWarning,
            stacklevel=4,
        )


# -- a loss that fails on an axis the mesh does not have -----------------------------------


def bad_axis_name(e: Exception) -> bool:
    """A bare AssertionError, or an unbound-axis NameError: what jax.lax collectives (and
    Flax's BatchNorm through them) raise for an axis name that is not a mesh axis."""
    return (isinstance(e, AssertionError) and not str(e)) or "axis name" in str(e)


def _failing_frame(e: Exception) -> tuple[str, bool]:
    """(file:line, whether in a Flax normalization layer) of the innermost frame of ``e``'s
    traceback outside jax and jaxzero: where the collective was called."""
    tb, where = e.__traceback__, ("an unknown line", False)
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        inside = os.sep + "jax" + os.sep in path or os.path.abspath(path).startswith(_JAXZERO)
        if not inside:
            where = (f"{path}:{tb.tb_lineno}", bool(_FLAX_NORMALIZATION.search(path)))
        tb = tb.tb_next
    return where


def axis_hint(mesh_axes, batch_axes, e: Exception) -> str:
    """The message for a loss that called a collective over an axis the mesh lacks: for a
    Flax normalization layer, name the axis as the model does; for the user's own code (a
    ``pmap`` leftover), remove the collective, never rename the axis (that would run it)."""
    detail = f": {e}" if str(e) else ""
    where, normalization = _failing_frame(e)
    head = (
        f"the loss failed inside jaxzero's shard_map, whose mesh axes are {tuple(mesh_axes)}, "
        f"with {type(e).__name__}{detail}, at {where}. That is what a collective over an axis "
        f"name the mesh does not have raises"
    )
    if normalization:
        return (
            f"{head}: a normalization layer built with axis_name= (e.g. BatchNorm(axis_name="
            f"'batch'), Flax's ResNet) on the default 'data' axis. Build the model with "
            f"axis_name=zero.batch_axes ({tuple(batch_axes)}), or name the mesh axis as the "
            f"model does: jz.data_parallel_mesh(axis='batch') with jz.ZeRO(..., axis='batch')."
        )
    return (
        f"{head}: a jax.lax.pmean / psum (or other collective) left from a pmap program. "
        f"Remove it; do not rename the mesh axis to match it: jaxzero averages the devices' "
        f"gradients itself, and a loss reduced over the devices trains at 1/N of the gradient. "
        f"Return the mean over this device's rows, or jz.GlobalMean(loss.sum(), count) for a "
        f"loss normalised by a count over the whole batch (docs/guide/from-pmap.md)."
    )
