"""Where the activations saved for the backward live: device memory, or pinned host memory
(``ZeRO(offload=("activations", ...))``: DeepSpeed's ``cpu_checkpointing``, MaxText's
``offload`` remat policies).

Per-layer stage 3 over a layer stack (``layers=``, run by :func:`jaxzero.scan_layers`) saves
only each layer's input for its backward and recomputes the rest. With activation offload
each saved input is
copied to the host as its layer's forward starts, and copied back one layer ahead in the
backward (layer ``i - 1``'s input travels while layer ``i`` recomputes and takes its vjp), so
the device holds two layer inputs instead of all of them. The placement objects answer
``store`` and ``fetch``, and refuse a stack no ``scan_layers`` ran
(:meth:`DeviceActivations.check_scanned`); nothing else in the step knows where the inputs
are.
"""

from __future__ import annotations

import jax

#: the ``offload=`` choice that moves the saved activations (not state) to the host
ACTIVATIONS = "activations"

_NO_SCAN_TO_OFFLOAD = (
    "ZeRO(offload=('activations', ...), layers={}) moves the layer inputs that "
    "jaxzero.scan_layers saves for the backward to the host, and this model never ran its "
    "stack with jaxzero.scan_layers (an nn.scan of gather_layer saves what its remat policy "
    "says, which jaxzero does not place). Run the stack with jaxzero.scan_layers, or drop "
    "'activations' from offload=."
)


class DeviceActivations:
    """The saved layer inputs stay in device memory (the default)."""

    def check_scanned(self, scans: int, layers) -> None:
        """Refuse a traced step whose ``layers`` stacks no :func:`jaxzero.scan_layers` ran
        (``scans``: its prefetching loops) where that leaves inputs unplaced; on the device
        every step is fine.

        Args:
          scans: how many ``scan_layers`` loops the loss ran.
          layers: the config's stack names, for the message.
        """

    def store(self, x):
        """``x`` where the backward will read it."""
        return x

    def fetch(self, x):
        """``x`` (as :meth:`store` left it) back where the backward computes."""
        return x


class HostActivations(DeviceActivations):
    """The saved layer inputs in pinned host memory; fetched back to the device for their
    layer's backward."""

    def check_scanned(self, scans: int, layers) -> None:
        if not scans:
            raise ValueError(_NO_SCAN_TO_OFFLOAD.format(layers))

    def store(self, x):
        return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), x)

    def fetch(self, x):
        return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), x)


def split(offload) -> tuple[object, bool]:
    """``offload=`` as the user gave it, split into what the state's placement takes (None,
    ``"optimizer"``, or the other choices, checked there) and whether the saved activations
    go to the host: ``"activations"`` alone, or in a tuple/list with the others."""
    if isinstance(offload, tuple | list):
        bad = [x for x in offload if not isinstance(x, str)]
        if bad or len(set(offload)) != len(offload) or not offload:
            raise ValueError(
                f"offload={offload!r} must be None, a string or a tuple of distinct strings, "
                f"e.g. ('optimizer', 'activations')."
            )
        rest = tuple(x for x in offload if x != ACTIVATIONS)
        state = None if not rest else rest[0] if len(rest) == 1 else rest
        return state, ACTIVATIONS in offload
    if offload == ACTIVATIONS:
        return None, True
    return offload, False


def check(on: bool, stage: int, layers, units) -> DeviceActivations:
    """The activations' placement, refused where it would change nothing: only per-layer
    stage 3 over a stack (``layers=``, run by :func:`jaxzero.scan_layers`) saves layer inputs
    that jaxzero places. ``units=`` is refused too: its chain's saved inputs moved to the host
    left the device's peak where it was on the H100 compile (decision 32)."""
    if not on:
        return DeviceActivations()
    if units:
        raise ValueError(
            f"offload='activations' is built for layer stacks (layers=, run by "
            f"jaxzero.scan_layers), not for units={units!r}: on the GPU compile the unit "
            "chain's inputs moved to the host did not lower the device's peak. Drop "
            "'activations' from offload=, or scan the blocks with jaxzero.scan_layers."
        )
    if stage != 3 or not layers:
        raise ValueError(
            f"offload='activations' moves the layer inputs that per-layer stage 3 saves for "
            f"the backward; this configuration saves none that jaxzero places (stage={stage}, "
            f"layers={layers!r}). Use stage=3 with layers= (the stack run by "
            "jaxzero.scan_layers), or drop 'activations' from offload=."
        )
    return HostActivations()
