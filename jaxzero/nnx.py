"""Alias of :mod:`jaxzero.flax_nnx` (the Flax NNX adapter), kept so ``jaxzero.nnx.split``
keeps working; the module is named ``flax_nnx`` so that it does not read as ``flax.nnx``."""

from jaxzero.flax_nnx import NnxModel as NnxModel
from jaxzero.flax_nnx import split as split

__all__ = ["NnxModel", "split"]
