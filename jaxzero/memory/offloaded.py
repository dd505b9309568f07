"""The host side of :func:`~jaxzero.memory.estimate_memory`: what ``offload=`` moves to pinned
host memory (decisions 32, 37 and 42).

``offload="optimizer"``: the optimizer state, the fp32 master (when it is not the params) and
the EMA. ``("optimizer", "params")``: the 16-bit params too, their gradients written into the
params' bytes (``14 x Φ/N`` with bf16 Adam). With micro-batches (``accum_steps > 1``) the
params must stay readable by the next micro-batch's forward, so the layer stacks' gradients
are summed into a host accumulator apart from them: 4 bytes (fp32) per parameter of the stacks
over N, ``layer_params x layers`` when given, else every parameter.
"""

from __future__ import annotations

import dataclasses

from jaxzero.zero.offload import check_offload, params_offloaded

_FP32 = 4  # the fp32 master, and the host gradient sums (output_dtype)


def sums_bytes(phi: int, n: int, layer_params, layers, accum_steps: int) -> int:
    """Bytes per device of the host gradient sums of a step with ``accum_steps`` micro-batches
    and the params offloaded: fp32 for every parameter of the stacks (``layer_params x
    layers``, else all ``phi``) over ``n`` devices; 0 with one micro-batch."""
    if accum_steps == 1:
        return 0
    stacked = phi if layer_params is None else layer_params * layers
    return _FP32 * -(-int(stacked) // n)


def offloaded(e, offload, compute_copy: bool, sums: int = 0):
    """The :class:`~jaxzero.memory.MemoryEstimate` ``e`` with the optimizer state and the EMA
    in host memory (``offload="optimizer"``), and with ``("optimizer", "params")`` the params
    too, their gradients in the same bytes, plus ``sums`` (:func:`sums_bytes`)."""
    if not offload:
        return e
    stay = 0  # FSDP's layout: the fp32 master is the device's params, 4 bytes of K
    if not compute_copy and e.precision != "fp32":
        stay = _FP32 * -(-e.num_params // e.world_size)
    host = e.optimizer - stay + e.ema
    if params_offloaded(check_offload(offload, e.stage)):  # the gradients in their bytes
        host += e.params + sums
        return dataclasses.replace(e, params=0, grads=0, optimizer=0, ema=0, host=host)
    return dataclasses.replace(e, params=e.params + stay, optimizer=0, ema=0, host=host)
