"""Where the PCIe bytes of ``ZeRO(offload="optimizer", offload_update="deferred")`` go, read
from the compiled 8 x H100 step (deviceless: ``jaxzero.gpu.transfers``), stage 3 per layer
(decision 51).

With an update pending, the forward's layer loop runs layer ``i + 1``'s update beside layer
``i``'s compute from the stacks' state packed one row per layer in two host stacks (even and
odd layers), each half of a trip fetching the row of the layer after next. What nothing can
hide, exactly, is restated from the leaf shapes: layer 0's rows (fetched and written back
before the first layer's compute, which needs their weights), layer 1's fetch (before the
loop) and the leaves outside the stacks (updated after the backward, as without deferral).
Everything else is hidden: on a 24-layer decoder that is at least 90% of the bytes, and the
exact step (the update after the backward) hides none of the same bytes.
"""

from __future__ import annotations

import math

import jax
import optax
import pytest

import jaxzero as jz
from jaxzero import gpu
from jaxzero.gpu.models import abstract_params, batch_shapes, make_loss, model_shape
from jaxzero.zero.offload.parts import SMALL

N = 8
SCALARS = 1024  # bytes: the scalars a step moves beside the state (its step count)


def _shape(layers):
    return model_shape(layers=layers, hidden=256, heads=2, vocab=512, seq=64, batch=1)


def _transfers(layers, deferred, accum=1):
    """The compiled step's host transfers: the exact step, or (``deferred``: True or the
    ``offload_update`` value) a step with an update pending (the state the first deferred
    step returns; ``"delayed"``: marked delayed, as the steps after the exact ones are);
    ``accum`` micro-batches of one sequence per device."""
    return _report(layers, deferred, accum).host_transfers


def _report(layers, deferred, accum=1):
    """:func:`_transfers`' compile report (its device peak too)."""
    shape = _shape(layers)
    mesh = gpu.compile_only_mesh("h100", N)
    params, batch = abstract_params(shape), batch_shapes(shape, N * accum)
    update = deferred if isinstance(deferred, str) else "deferred" if deferred else None
    kw = dict(stage=3, precision="bf16", layers="layers", offload="optimizer")
    zero = jz.ZeRO(optax.adam(1e-3), mesh, offload_update=update, **kw)
    step = jz.make_train_step(make_loss(shape), zero, accum_steps=accum)
    state = gpu.steady_state(step, params, batch)  # deferred: a step with an update pending
    return gpu.compile_report(step, state, batch)


def _state_bytes(layers):
    """``(per layer of the stack, outside it or read whole)``: the fp32 master, mu and nu
    bytes per device (12 a local element), by the sharding rule (a leaf split 8 ways on its
    largest divisible dimension, the stack's layer axis skipped). A stacked leaf of at most
    ``SMALL`` elements (a norm's scale) is read and written whole by the streamed update, as
    the leaves outside the stack are: its bytes count with theirs."""
    layer = outside = 0
    for path, x in jax.tree_util.tree_flatten_with_path(abstract_params(_shape(layers)))[0]:
        stack = path[0].key == "layers" and math.prod(x.shape) > SMALL
        dims = x.shape[1:] if path[0].key == "layers" else x.shape
        n = math.prod(dims) // (N if any(d % N == 0 for d in dims) else 1)
        if stack:
            layer += 12 * n
        else:
            outside += 12 * n * (layers if path[0].key == "layers" else 1)
    return layer, outside


@pytest.mark.parametrize("layers", [24])
def test_the_deferred_update_hides_what_only_layer_0_and_1_leave_exposed(layers):
    """A step with an update pending moves the exact step's bytes, and hides all but layer
    0's rows both ways, layer 1's fetch and the leaves outside the stacks (and the stack's
    small ones) both ways: at 24 layers 90% or more, where the exact step hides nothing."""
    exact, deferred = _transfers(layers, False), _transfers(layers, True)
    layer, outside = _state_bytes(layers)
    state = layers * layer + outside
    for t in (exact, deferred):  # the state each way, and a few scalars (the step count)
        assert 0 <= t.h2d_bytes - state <= SCALARS and 0 <= t.d2h_bytes - state <= SCALARS
    assert exact.hidden_bytes <= SCALARS
    assert deferred.exposed_bytes <= 3 * layer + 2 * (outside + SCALARS)
    assert deferred.share >= 0.9


# slow: a third 24-layer compile; in make test the loop check of test_deferred_update.py shows
# the rows inside the first micro-batch's forward loop, and the test above that loop's share
@pytest.mark.slow
def test_with_micro_batches_the_first_forward_hides_the_same():
    """With 2 micro-batches the rows run inside the first one's forward (the second reads the
    stacks it wrote): the same bytes, and the same exposure as with one, layer 0's rows, layer
    1's fetch and the leaves outside the stacks, where the update used to run before the
    forward, exposed."""
    layers = 24
    deferred = _transfers(layers, True, accum=2)
    layer, outside = _state_bytes(layers)
    state = layers * layer + outside
    assert 0 <= deferred.h2d_bytes - state <= SCALARS
    assert 0 <= deferred.d2h_bytes - state <= SCALARS
    assert deferred.exposed_bytes <= 3 * layer + 2 * (outside + SCALARS)
    assert deferred.share >= 0.9


# in make test (two 4-layer compiles, about 20 s): issue 59's acceptance line, >= 90% hidden
def test_the_delayed_update_on_4_layers_hides_every_row():
    """``offload_update="delayed"`` with 2 micro-batches on the 4-layer decoder (the issue's
    acceptance: >= 90%): a delayed step moves the exact step's bytes, and, no gather waiting
    for a row, every layer's fetch runs beside compute (the last layer's under layer 0's)
    and every write-back too (the last two rows' in flight through the backward). Only the
    leaves outside the stacks stay exposed, both ways: 92.8% hidden (10.22 of 11.02 MB),
    against the deferred step's 46%, whose bound is 60% (decision 51). The device peak is
    no more than a layer's state rows above the deferred step's (15.57 against 15.93 MB;
    without the barrier on the new stacks after the last layer, 21.07 MB)."""
    layers = 4
    reports = _report(layers, "delayed", accum=2), _report(layers, True, accum=2)
    delayed, deferred = (r.host_transfers for r in reports)
    layer, outside = _state_bytes(layers)
    state = layers * layer + outside
    for t in (delayed, deferred):
        assert 0 <= t.h2d_bytes - state <= SCALARS and 0 <= t.d2h_bytes - state <= SCALARS
    assert delayed.exposed_bytes <= 2 * (outside + SCALARS)  # no row of the stacks
    assert delayed.share >= 0.92 and deferred.share < 0.5
    assert reports[0].peak_bytes <= reports[1].peak_bytes + layer


# slow: a 24-layer compile; make test keeps the delayed update's numbers (test_delayed_update.py)
@pytest.mark.slow
def test_the_delayed_update_on_24_layers_hides_every_row():
    """At 24 layers too, a delayed step (2 micro-batches) moves the exact step's bytes and
    exposes none of the stacks' rows: the last layer's rows are written back with layer 21's
    in one copy, so the last layer's half holds one write-back beside the update's small
    copies (with two there, one was exposed: 96.7%). 98.7% hidden."""
    layers = 24
    delayed = _transfers(layers, "delayed", accum=2)
    layer, outside = _state_bytes(layers)
    state = layers * layer + outside
    assert 0 <= delayed.h2d_bytes - state <= SCALARS
    assert 0 <= delayed.d2h_bytes - state <= SCALARS
    assert delayed.exposed_bytes <= 2 * (outside + SCALARS)  # no row of the stacks
    assert delayed.share >= 0.98
