"""Offload to pinned host memory: where the state lives and where its update runs
(:mod:`.placement`), the update streamed through the device a chunk at a time (:mod:`.stream`,
cut into parts by :mod:`.parts`), and where ``scan_layers`` keeps the layer inputs saved for
the backward (:mod:`.activations`)."""

from jaxzero.zero.offload.placement import check_offload as check_offload
from jaxzero.zero.offload.placement import host_sharding as host_sharding
from jaxzero.zero.offload.placement import offloaded_bytes as offloaded_bytes
from jaxzero.zero.offload.placement import params_offloaded as params_offloaded
