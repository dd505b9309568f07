"""DeepSpeed ZeRO checkpoints in and out of jaxzero (guide: ``docs/guide/deepspeed.md``;
running DeepSpeed itself on a CPU: ``docs/guide/deepspeed-cpu.md``).

* :func:`read_checkpoint`: a DeepSpeed 0.19.8 ZeRO 1/2/3 checkpoint -> full numpy arrays
  (fp32 master, Adam moments, compute weights, buffers, step, param groups). DeepSpeed is not
  needed and no code from the files runs.
* :func:`adamw` + :func:`to_train_state`: that -> a jaxzero ``TrainState`` for any stage and
  device count, with an optax chain reproducing the run's update: the param groups' AdamW and
  every ``ds_config`` setting that changes the update (gradient clipping, DeepSpeed's default
  1.0 when absent; lr schedulers; L2 Adam), or a :class:`DeepSpeedSettingError` naming the one
  it cannot reproduce. :func:`update_settings` lists them; :func:`loss_scale` gives an fp16
  run's loss scale for the ``ZeRO``.
* :func:`write_checkpoint`: a jaxzero state (or a :class:`DeepSpeedCheckpoint`) -> a
  checkpoint that DeepSpeed's ``engine.load_checkpoint`` and ``zero_to_fp32`` read.
* :func:`deepspeed_to_jax` / :func:`jax_to_deepspeed`: whole-checkpoint conversions (Orbax on
  the jaxzero side), also behind ``jaxzero convert deepspeed2jax`` / ``jax2deepspeed``.
"""

from jaxzero.interop.deepspeed.convert import ConversionResult, deepspeed_to_jax, jax_to_deepspeed
from jaxzero.interop.deepspeed.errors import DeepSpeedCheckpointError
from jaxzero.interop.deepspeed.fp16 import loss_scale
from jaxzero.interop.deepspeed.jax_state import adamw, from_train_state, to_train_state
from jaxzero.interop.deepspeed.reader import DeepSpeedCheckpoint, read_checkpoint
from jaxzero.interop.deepspeed.update import (
    DeepSpeedSettingError,
    UpdateSettings,
    update_settings,
)
from jaxzero.interop.deepspeed.writer import write_checkpoint

__all__ = [
    "ConversionResult",
    "DeepSpeedCheckpoint",
    "DeepSpeedCheckpointError",
    "DeepSpeedSettingError",
    "UpdateSettings",
    "adamw",
    "deepspeed_to_jax",
    "from_train_state",
    "jax_to_deepspeed",
    "loss_scale",
    "read_checkpoint",
    "to_train_state",
    "update_settings",
    "write_checkpoint",
]
