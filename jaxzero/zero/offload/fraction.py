"""A fraction of the optimizer side offloaded (decision 43): ``ZeRO(offload="optimizer",
offload_fraction=f)`` keeps the leaves that make up at least ``f`` of the offloadable state's
bytes per device (the master, the optimizer state and the EMA) in pinned host memory and the
rest in device memory, updated there in the same step (DeepSpeed ZeRO-Offload++'s
``offload_optimizer.ratio``, Megatron's ``--optimizer-offload-fraction``).

Which leaves go is a function of the leaves' bytes alone, so the state's shardings and the
update agree without being told: :func:`host_leaves`.
"""

from __future__ import annotations

import math
import numbers


def check_fraction(fraction, offload, params_on_host: bool) -> float:
    """``fraction`` as a float in (0, 1], checked against ``offload`` (normalised by
    :func:`~jaxzero.zero.offload.placement.check_offload`).

    Raises:
      ValueError: not a number in (0, 1]; below 1 without the optimizer offloaded, or with
        the params offloaded too.
    """
    ok = isinstance(fraction, numbers.Real) and not isinstance(fraction, bool)
    if not ok or not math.isfinite(fraction) or not 0 < fraction <= 1:
        raise ValueError(
            f"offload_fraction={fraction!r} must be a number in (0, 1]: the share of the "
            "optimizer side's bytes per device (fp32 master, optimizer state, EMA) kept in "
            "pinned host memory, largest leaves first, e.g. offload_fraction=0.3 (DeepSpeed's "
            "offload_optimizer.ratio); 1 (the default) offloads all of it."
        )
    fraction = float(fraction)
    if fraction < 1 and not offload:
        raise ValueError(
            f"offload_fraction={fraction:g} needs offload='optimizer': it says how much of the "
            "offloaded state goes to host memory. Pass offload='optimizer', or leave "
            "offload_fraction at 1."
        )
    if fraction < 1 and params_on_host:
        raise ValueError(
            f"offload_fraction={fraction:g} is built for offload='optimizer' only (got "
            f"offload={offload!r}): with the params offloaded the whole state is on the host. "
            "Use offload='optimizer' with offload_fraction, or offload_fraction=1."
        )
    return fraction


def host_leaves(sizes, fraction: float) -> list[bool]:
    """Which of the leaves of ``sizes`` (bytes per device, in tree order) live on the host so
    that they hold at least ``fraction`` of the total: the largest first (ties in tree order),
    each taken while it does not pass the target; if the target is not reached then, the
    smallest leaf left that reaches it, and the leaves taken before it are given back, largest
    first, while the rest still reach the target (one dominant leaf then goes alone). Every
    leaf at ``fraction=1``."""
    sizes = [int(s) for s in sizes]
    if fraction >= 1:
        return [True] * len(sizes)
    target = fraction * sum(sizes)
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    host, held = [False] * len(sizes), 0
    for i in order:
        if held + sizes[i] <= target:
            host[i], held = True, held + sizes[i]
    if held < target:
        taken = [i for i in order if host[i]]
        last = min((i for i in order if not host[i]), key=lambda i: (sizes[i], i))
        host[last], held = True, held + sizes[last]
        for i in taken:  # largest first
            if held - sizes[i] >= target:
                host[i], held = False, held - sizes[i]
    return host
