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
  ``ZeroRedundancyOptimizer`` (local indices, :func:`jaxzero.layouts.greedy_partition`).
* **EMA.** thb1314/distributed_modelema ``{"param": OrderedDict, "updates": n}`` and
  ultralytics/YOLOv5 ``{"ema": model_or_state_dict, "updates": n}`` <-> :class:`EmaState`.
  Non-float entries (``num_batches_tracked``) are never averaged and are left out.

Modules: :mod:`~jaxzero.interop.torch.names` (name map, weights),
:mod:`~jaxzero.interop.torch.optimizer_state`, :mod:`~jaxzero.interop.torch.ema`,
:mod:`~jaxzero.interop.torch.partition` (torch's parameter-to-rank partitions) and
:mod:`~jaxzero.interop.torch.convert` (whole-checkpoint conversion). ``jaxzero.torch_interop``
re-exports the public names.

Imports are pure: everything is validated before any array is placed, and the result is a new
tree whose leaves have the target leaves' dtypes and shardings (``jax.device_put``). Errors list
every offending name.
"""
