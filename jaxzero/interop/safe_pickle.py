"""Loading torch ``.pt`` files without running code from them.

:func:`load_torch_file` is ``torch.load(weights_only=True)``: tensors, containers and plain
values only. A caller that must read files which pickle a few foreign classes (DeepSpeed's
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
from collections.abc import Mapping

__all__ = ["UnsafeFileError", "load_torch_file", "save_torch_file"]


class UnsafeFileError(ValueError):
    """A file that would need code outside the allowlist to unpickle."""


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "reading .pt files needs torch; install it with pip install 'jaxzero[torch]'"
        ) from e
    return torch


def load_torch_file(path, *, stand_ins: Mapping[str, type] | None = None, what: str = "file"):
    """``torch.load(path, map_location="cpu", weights_only=True)`` with ``stand_ins``.

    Args:
      path: a ``.pt`` file.
      stand_ins: ``{"pkg.module.Class": LocalClass}``; the only extra globals allowed.
      what: how errors name the file ("DeepSpeed optimizer file", ...).

    Raises:
      FileNotFoundError: no such file.
      UnsafeFileError: the pickle asks for a global outside the allowlist (nothing executed).
      ValueError: the file is not a readable torch file (truncated, not a zip, ...).
    """
    torch = _torch()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r}: no such file")
    allowed = [(cls, name) for name, cls in (stand_ins or {}).items()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next(
            (line for line in first if "global" in line.lower()), first[0] if first else ""
        )
        raise UnsafeFileError(
            f"{what} {path!r} was refused: it asks to load code that is not on the allowlist "
            f"({detail.strip()}); nothing from it was executed. Only tensors, plain values and "
            f"{sorted(stand_ins or {}) or 'no classes'} are accepted."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ValueError(f"{what} {path!r} is damaged or not a torch file: {e}") from None


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
    torch = _torch()
    names = {cls: name for name, cls in (stand_ins or {}).items()}
    pickler = type("_Pickler", (_NamedPickler,), {"names": names})
    module = type(pickle)("_jaxzero_pickle")
    module.__dict__.update(pickle.__dict__)
    module.Pickler = pickler
    torch.save(obj, os.fspath(path), pickle_module=module)
