"""DeepSpeed ZeRO checkpoints in and out of jaxzero (see ``docs_deepspeed.md``).

* :func:`read_checkpoint`: a DeepSpeed 0.19.8 ZeRO 1/2/3 checkpoint -> full numpy arrays
  (fp32 master, Adam moments, compute weights, buffers, step, param groups).
* :func:`to_train_state`: that -> a jaxzero ``TrainState`` for any stage and device count.
* :func:`write_checkpoint`: a jaxzero state (or a :class:`DeepSpeedCheckpoint`) -> a
  checkpoint that DeepSpeed's ``engine.load_checkpoint`` and ``zero_to_fp32`` read.
"""

from jaxzero.interop.deepspeed._common import DeepSpeedCheckpointError
from jaxzero.interop.deepspeed.reader import DeepSpeedCheckpoint, read_checkpoint

__all__ = ["DeepSpeedCheckpoint", "DeepSpeedCheckpointError", "read_checkpoint"]
