"""Every ```python block of the pages under docs/ runs as written: each page's blocks in
order, in one namespace, in a fresh directory, on the 8 simulated CPU devices. The namespace
starts with what the guides leave to the reader (:func:`_prelude`): the usual imports
(``jz``, ``jax``, ``jnp``, ``np``, ``optax``, ``nn``), ``tx``, ``mesh`` and a tiny model whose
``params["layers"]`` is a ``jz.scan_layers`` stack (``params``, ``loss_fn``, ``batch``,
``batches``), so ``layers="layers"`` and stage 3 per layer have a stack to act on. A name a
page uses without defining it, and that is not in that list, fails the page (NameError).
Pages are collected by glob, so a new page is run without a change here; a block that is
deliberately a fragment is fenced as ```text. README.md's blocks run in tests/test_readme.py.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compile_memo import H100, reuse_gpu_compiles

import jaxzero as jz
from jaxzero.gpu.models import make_problem

DOCS = Path(__file__).parents[1] / "docs"
PAGES = {
    str(p.relative_to(DOCS)): blocks
    for p in sorted(DOCS.rglob("*.md"))
    if "_build" not in p.parts
    and (blocks := re.findall(r"^```python\n(.*?)^```", p.read_text(), flags=re.S | re.M))
}


def _prelude() -> dict:
    params, loss_fn, batches = make_problem(
        "stack", batch=8, steps=2, scan_layers=jz.scan_layers, stacked_params=jz.stacked_params
    )
    return {
        "jz": jz,
        "jax": jax,
        "jnp": jnp,
        "np": np,
        "optax": optax,
        "nn": nn,
        "tx": optax.adamw(1e-3),
        "mesh": jz.data_parallel_mesh(8),
        "params": params,
        "loss_fn": loss_fn,
        "batch": batches[0],
        "batches": batches,
    }


def test_the_docs_have_python_blocks():
    assert len(PAGES) >= 5, sorted(PAGES)


def _one_rank(script: str) -> None:
    """Run a page's DeepSpeed rank script (``train_ds.py``) as the page says, with one rank:
    its own process, torch.distributed's environment, DeepSpeed's CPU accelerator."""
    Path("train_ds.py").write_text(script)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    env.update(OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "train_ds.py"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


# Blocks a page says to run in another way than in this process: page -> {block index: runner}.
SCRIPTS = {"guide/deepspeed-cpu.md": {0: _one_rank}}
# Names a page leaves to the reader beyond the prelude's: page -> {name: factory}.
EXTRA = {
    # hpz_partition_size=8 needs nodes of 8 on a larger mesh: 64 compile-only H100s (only the
    # ZeRO objects are built)
    "guide/quantized-collectives.md": {"mesh": lambda: jz.gpu.compile_only_mesh("h100", 64)},
}


# Pages whose GPU compiles other tests compile too, and the compile-only devices they are all
# for (tests/compile_memo.py's key): guide/gpu-planning.md plans the tiny LLaMA at stage 3 per
# layer on 8 H100s, as tests/test_cli_plan_output.py's formula-note test does.
SHARED_COMPILES = {"guide/gpu-planning.md": H100}


def _needs_torch(page: str) -> bool:
    """A page whose blocks use torch or DeepSpeed (the ``interop`` tests' dependencies)."""
    return any("torch" in block or "deepspeed" in block for block in PAGES[page])


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.interop) if _needs_torch(p) else p for p in sorted(PAGES)],
)
def test_docs_page_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if page in SHARED_COMPILES:
        # another kind or memory on the page would share a key with this one's compiles
        code = "".join(PAGES[page])
        assert not re.search(r"memory_bytes|gpu_memory|a100|h200", code, re.I), (
            f"docs/{page} compiles for other GPUs than {SHARED_COMPILES[page]}: "
            "update SHARED_COMPILES"
        )
        reuse_gpu_compiles(monkeypatch, SHARED_COMPILES[page])
    namespace = _prelude()
    namespace.update({k: make() for k, make in EXTRA.get(page, {}).items()})
    for k, block in enumerate(PAGES[page]):
        if k in SCRIPTS.get(page, {}):
            SCRIPTS[page][k](block)
            continue
        exec(compile(block, f"docs/{page} python block {k + 1}", "exec"), namespace)
