"""Loading torch ``.pt`` files without running code from them: the one way jaxzero unpickles.

Every checkpoint reader of jaxzero (torch model / optimizer / ZeRO per-rank files, EMA files,
``jaxzero convert torch2jax``, DeepSpeed files) reads through :func:`load_torch_file`; nothing
in jaxzero calls ``torch.load`` or ``pickle.load`` itself, and nothing ever falls back to
``weights_only=False``.

:func:`load_torch_file` is ``torch.load(weights_only=True)``: tensors, containers and plain
values only (and whatever the user's own process marked safe with
``torch.serialization.add_safe_globals``). A caller that must read files which pickle a few foreign classes (DeepSpeed's
loss scaler, for instance) passes ``stand_ins``: a mapping from the class's pickled name
(``"module.Class"``) to an inert local class. Exactly those names are allowed, each resolving
to its stand-in, for this one call; nothing is imported and nothing else is allowed. A pickle
that asks for any other global (``os.system``, ``builtins.exec``, a ``__reduce__`` payload ...)
is refused with :class:`UnsafeFileError` before anything is called.

:func:`save_torch_file` is the mirror image: ``torch.save`` where each stand-in is written
under its foreign name, so the foreign library loads its own class.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping

__all__ = ["UnsafeFileError", "load_torch_file", "save_torch_file", "torch_module"]

RESAVE_HINT = (
    "If you trust the file, re-save it as plain tensors where it was made, e.g. "
    "torch.save(module.state_dict(), path) or torch.save(optimizer.state_dict(), path), "
    "and read that file"
)


class UnsafeFileError(ValueError):
    """A file that would need code outside the allowlist to unpickle."""


def torch_module():
    """The ``torch`` module, or an ImportError saying how to install it."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this needs PyTorch: pip install 'jaxzero[torch]' (torch==2.13.0)") from e
    return torch


def load_torch_file(
    path,
    *,
    stand_ins: Mapping[str, type] | None = None,
    what: str = "file",
    hint: str = RESAVE_HINT,
):
    """``torch.load(path, map_location="cpu", weights_only=True)`` with ``stand_ins``.

    Args:
      path: a ``.pt`` file.
      stand_ins: ``{"pkg.module.Class": LocalClass}``; the only extra globals allowed.
      what: how errors name the file ("DeepSpeed optimizer file", ...).
      hint: the last sentence of a refusal: how to get a file this reader accepts.

    Raises:
      FileNotFoundError: no such file.
      UnsafeFileError: the pickle asks for a global outside the allowlist (nothing executed).
      ValueError: the file is not a readable torch file (truncated, not a zip, ...).
    """
    torch = torch_module()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r}: no such file")
    allowed = [(cls, name) for name, cls in (stand_ins or {}).items()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeFileError(
            f"{what} {path!r} was refused: its pickle needs something that is not on the "
            f"allowlist ({_refusal_detail(str(e))}); jaxzero will not execute code from a file, "
            f"and nothing from it was executed. Only tensors, plain values and "
            f"{sorted(stand_ins or {}) or 'no classes'} are accepted. {hint}."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ValueError(f"{what} {path!r} is damaged or not a torch file: {e}") from None


def _refusal_detail(message: str) -> str:
    """The gist of torch's weights-only refusal ``message``, on one line (torch's own advice,
    to allowlist the global or to load with ``weights_only=False``, left out)."""
    found = re.search(r"GLOBAL (\S+) was not an allowed global", message)
    if found:
        return found.group(1)
    _, _, rest = message.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    return lines[0] if lines else "not a weights-only pickle"


class _NamedPickler(pickle._Pickler):
    """The pure-Python pickler, writing some local classes under foreign names."""

    names: dict = {}

    def save_global(self, obj, name=None):
        foreign = self.names.get(obj)
        if foreign is None:
            return super().save_global(obj, name)
        module, _, qualname = foreign.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


def save_torch_file(obj, path, *, stand_ins: Mapping[str, type] | None = None) -> None:
    """``torch.save(obj, path)`` writing each stand-in class under its foreign name."""
    torch = torch_module()
    names = {cls: name for name, cls in (stand_ins or {}).items()}
    pickler = type("_Pickler", (_NamedPickler,), {"names": names})
    module = type(pickle)("_jaxzero_pickle")
    module.__dict__.update(pickle.__dict__)
    module.Pickler = pickler
    torch.save(obj, os.fspath(path), pickle_module=module)
