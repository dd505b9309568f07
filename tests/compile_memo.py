"""Deviceless XLA:GPU compiles shared between the tests of one process that compile the same
program for the same compile-only devices.

tests/conftest.py's persistent cache cannot serve them (a compile-only client cannot load an
executable back), so two tests planning one step would each compile it. Here the program is
its StableHLO module as lowered, so the lowering, the ZeRO layout and everything before the
compile still run in each test; only XLA's compile of a module already compiled is reused.
"""

from __future__ import annotations

import hashlib

from jaxzero.gpu import report

#: ``(devices, module digest, options) -> _compile's result``, for the process's lifetime
_COMPILED: dict = {}
#: ``devices`` of compile-only H100s at the part's own memory, of any count
H100 = "h100 at its own memory"


def reuse_gpu_compiles(monkeypatch, devices: str) -> None:
    """Within the calling test, ``jaxzero.gpu.compile_report`` compiles each module once per
    process for ``devices``, and reuses that compile when the same module comes again.

    Args:
      monkeypatch: the test's fixture (the sharing ends with the test).
      devices: the compile-only devices that every compile of the test is for, their kind
        and memory at least, e.g. ``"8 x h100, 8MB"``: part of the key, since the module's
        text names neither (XLA compiles for the kind, and its scheduler keeps the step
        under the memory).
    """
    compile_once = report._compile

    def shared(lowered, options):
        digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        key = (devices, digest, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in _COMPILED:
            _COMPILED[key] = compile_once(lowered, options)
        return _COMPILED[key]

    monkeypatch.setattr(report, "_compile", shared)
