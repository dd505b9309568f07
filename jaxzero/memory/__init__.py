"""Memory accounting for ZeRO sharding: analytic estimates and measurements.

Two halves:

* **Estimates** (no devices needed): :func:`estimate_memory` applies the ZeRO
  paper's accounting (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
  Toward Training Trillion Parameter Models", sec. 3.1 and 5) to give bytes per
  device for each stage; :func:`format_table` renders the result.
* **Measurements** (real arrays / compiled programs): :func:`device_bytes` sums
  the shards a pytree really holds on each device, :func:`collective_bytes`
  parses compiled HLO for the collectives XLA emitted, and :func:`measure` does
  both for a train step.

Units: every byte count is an ``int`` number of bytes. "GB" means 1e9 bytes
(as in the paper), "GiB" means 2**30.

Modules: ``estimate`` (the analytic accounting), ``hlo`` (reading collectives from compiled
HLO text), ``measured`` (bytes on devices, :func:`measure`).
"""

from jaxzero.memory.estimate import OPTIMIZERS as OPTIMIZERS
from jaxzero.memory.estimate import PRECISIONS as PRECISIONS
from jaxzero.memory.estimate import MemoryEstimate as MemoryEstimate
from jaxzero.memory.estimate import estimate_memory as estimate_memory
from jaxzero.memory.estimate import format_table as format_table
from jaxzero.memory.estimate import gpt_param_count as gpt_param_count
from jaxzero.memory.estimate import parse_bytes as parse_bytes
from jaxzero.memory.hlo import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from jaxzero.memory.hlo import CollectiveOp as CollectiveOp
from jaxzero.memory.hlo import collective_bytes as collective_bytes
from jaxzero.memory.hlo import collective_ops as collective_ops
from jaxzero.memory.hlo import replica_group_size as replica_group_size
from jaxzero.memory.hlo import replica_groups as replica_groups
from jaxzero.memory.measured import STATE_FIELDS as STATE_FIELDS
from jaxzero.memory.measured import device_bytes as device_bytes
from jaxzero.memory.measured import max_device_bytes as max_device_bytes
from jaxzero.memory.measured import measure as measure
from jaxzero.trees import format_bytes as format_bytes

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveOp",
    "MemoryEstimate",
    "collective_bytes",
    "collective_ops",
    "device_bytes",
    "estimate_memory",
    "format_bytes",
    "format_table",
    "gpt_param_count",
    "max_device_bytes",
    "measure",
    "parse_bytes",
    "replica_group_size",
    "replica_groups",
]
