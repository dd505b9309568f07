"""The package's shape, checked on every run: no import cycle and no private name imported
across modules (tests/structure_check.py, shown to catch each on a small package that breaks it; its size report is shown to list what is
over, and fails nothing), and the step's phases named in the compiled HLO."""

import os
import pathlib

import jax
import optax
import pytest
import structure_check

import jaxzero as jz
from jaxzero.gpu.models import make_problem

PACKAGE = os.path.dirname(os.path.abspath(jz.__file__))


def test_jaxzero_has_no_import_cycle():
    assert "jaxzero.zero.config" in structure_check.modules(pathlib.Path(PACKAGE))
    assert structure_check.cycles(PACKAGE) == []


def test_no_private_name_crosses_a_module_boundary_in_jaxzero():
    assert structure_check.private_imports(PACKAGE) == []


def test_the_check_reports_a_private_name_imported_from_another_module(tmp_path, capsys):
    """``from .a import _helper`` and ``from pkg.a import _other`` are reported; a private
    submodule imported by name, a dunder, a public name and another package's private name
    are not."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import _startup\n",
            "pkg/_startup.py": "",
            "pkg/a.py": "_helper = _other = 1\npublic = 2\n",
            "pkg/b.py": "from .a import _helper, public\nfrom os import _exit\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/c.py": "from pkg.a import _other\nfrom ..a import __doc__\n",
        },
    )
    assert sorted(structure_check.private_imports(tmp_path / "pkg")) == [
        "private import: pkg.b imports _helper from pkg.a",
        "private import: pkg.sub.c imports _other from pkg.a",
    ]
    assert structure_check.main([str(tmp_path / "pkg")]) == 1
    assert "0 import cycles, 2 private imports" in capsys.readouterr().out


def _write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _cycles(found):
    """Each reported cycle as its modules in import order, starting at the smallest name."""
    out = set()
    for line in found:
        if line.startswith("import cycle: "):
            names = line.removeprefix("import cycle: ").split(" -> ")
            assert names[0] == names[-1], line
            i = names.index(min(names[:-1]))
            out.add(tuple(names[i:-1] + names[:i]))
    return out


def test_the_check_reports_each_broken_limit(tmp_path, capsys):
    """A package with one module, class and function one line over each limit (and one
    function exactly at it), a cycle through a deferred absolute import and one through
    relative imports in a subpackage's __init__: each problem reported, nothing else."""
    body = lambda n: "".join(f"    v{i} = {i}\n" for i in range(n))
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/big.py": "x = 0\n" * 401,
            "pkg/cls.py": "class Wide:\n" + body(250),
            "pkg/fn.py": "import pkg\n\n\ndef at_limit():\n" + body(79) + "\n\n"
            "def over():\n" + body(80),
            "pkg/a.py": "from . import b\n",
            "pkg/b.py": "def later():\n    from pkg import a\n",
            "pkg/sub/__init__.py": "from .c import x\n",
            "pkg/sub/c.py": "from ..e import y\n\nx = 1\n",
            "pkg/e.py": "from .sub import x\n\ny = 1\n",
        },
    )
    found = structure_check.cycles(tmp_path / "pkg")
    sizes = sorted(structure_check.sizes(tmp_path / "pkg"))
    assert sizes == [
        "class pkg.cls:1 Wide: 251 lines > 250",
        "function pkg.fn:86 over: 81 lines > 80",
        "module pkg.big: 401 lines > 400",
    ], found
    assert _cycles(found) == {("pkg.a", "pkg.b"), ("pkg.e", "pkg.sub", "pkg.sub.c")}, found
    assert len(found) == 2, found
    assert structure_check.main([str(tmp_path / "pkg")]) == 1  # the cycles fail it
    out = capsys.readouterr().out
    assert "structure: 2 import cycles, 0 private imports" in out and "sizes: 3 over" in out, out
    limits = {"module": 401, "class": 251, "function": 81}
    assert structure_check.sizes(tmp_path / "pkg", limits) == []
    for rel in ("a.py", "b.py", "sub/c.py", "e.py"):  # sizes alone never fail the check
        (tmp_path / "pkg" / rel).unlink()
    assert structure_check.main([str(tmp_path / "pkg")]) == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_phases_are_named_in_the_hlo(stage):
    params, loss_fn, batches = make_problem("wide_mlp", steps=1)
    zero = jz.ZeRO(optax.adam(1e-3), jz.data_parallel_mesh(8), stage=stage)
    step = jz.make_train_step(loss_fn, zero, ema=jz.ShardedEMA(0.9))
    state = step.init(params)
    hlo = step.lower(state, batches[0]).compile().as_text()
    # Op metadata carries the jax.named_scope path of every op.
    phases = ["forward_backward", "reduce_gradients", "optimizer_update", "ema_update"]
    if stage == 3:
        phases.append("gather_params")
    else:
        phases.append("gather_updated_params")
    missing = [p for p in phases if p not in hlo]
    assert not missing, f"phases {missing} are not named in the compiled HLO"
    jax.clear_caches()
