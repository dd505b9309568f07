"""``jaxzero.torch_interop``: the public PyTorch interop names, re-exported from
:mod:`jaxzero.interop.torch` (where the code and its documentation live)."""

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
