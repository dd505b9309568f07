"""Moving weights, optimizer state and EMAs between PyTorch checkpoints and jaxzero.

torch is optional: it is imported only inside the functions that read ``.pt`` files or build
tensors (``pip install 'jaxzero[torch]'``).

* **Names.** :func:`build_name_map` pairs torch state-dict names with paths of a JAX tree
  (``"fc1.weight"`` <-> ``fc1/kernel``) by built-in rules, user overrides and shapes, and reports
  what it could not pair. Layouts: ``Linear.weight [out, in]`` <-> Dense ``kernel [in, out]``;
  ``Conv.weight [out, in, *k]`` <-> ``kernel [*k, in, out]``; norm ``weight`` <-> ``scale``;
  BatchNorm ``running_mean``/``running_var`` <-> ``batch_stats`` ``mean``/``var``. A tree keyed by
  the torch names themselves (torch layout) maps one to one.
* **Optimizer state.** Adam/AdamW (``exp_avg``, ``exp_avg_sq``, ``step``) <-> optax
  ``ScaleByAdamState`` (``mu``, ``nu``, ``count``) and SGD ``momentum_buffer`` <-> ``TraceState``
  (``trace``), found by walking ``opt_state`` for nodes with those fields, so any chain works.
  Either the consolidated state dict (global indices) or the per-rank local state dicts of
  ``ZeroRedundancyOptimizer`` (local indices, :func:`jaxzero.greedy_partition`).
* **EMA.** thb1314/distributed_modelema ``{"param": OrderedDict, "updates": n}`` and
  ultralytics/YOLOv5 ``{"ema": model_or_state_dict, "updates": n}`` <-> :class:`EmaState`.
  Non-float entries (``num_batches_tracked``) are never averaged and are left out.

Modules: :mod:`~jaxzero.interop.torch.names` (name map, weights),
:mod:`~jaxzero.interop.torch.optimizer_state`, :mod:`~jaxzero.interop.torch.ema`,
:mod:`~jaxzero.interop.torch.partition` (torch's parameter-to-rank partitions) and
:mod:`~jaxzero.interop.torch.convert` (whole-checkpoint conversion). The public names of the
first three are this package's (``from jaxzero.interop import torch as ti``: ``ti.build_name_map``,
``ti.import_optimizer_state``, ``ti.import_ema``, ...); the partitions are
:mod:`jaxzero.interop.torch.partition`, with :func:`jaxzero.greedy_partition` at the top level.

Imports are pure: everything is validated before any array is placed, and the result is a new
tree whose leaves have the target leaves' dtypes and shardings (``jax.device_put``). Errors list
every offending name.
"""

from jaxzero.interop.torch.ema import export_ema, import_ema
from jaxzero.interop.torch.names import NameMap, build_name_map, flax_to_torch, torch_to_flax
from jaxzero.interop.torch.optimizer_state import (
    adamw_hyperparams,
    export_optimizer_state,
    export_zero_optimizer_state,
    import_optimizer_state,
    import_zero_optimizer_state,
)

__all__ = [
    "NameMap",
    "build_name_map",
    "torch_to_flax",
    "flax_to_torch",
    "adamw_hyperparams",
    "import_optimizer_state",
    "export_optimizer_state",
    "import_zero_optimizer_state",
    "export_zero_optimizer_state",
    "import_ema",
    "export_ema",
]
