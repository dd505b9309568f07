"""The package's structure limits: no import cycle between its modules (module-level and
deferred imports alike), no module over 400 lines, no class over 250, no function over 80
(docstrings included; a package's ``__init__.py`` counts as a module).

    python tests/structure_check.py jaxzero      # prints each problem; exit status 1 if any

tests/test_structure.py runs :func:`problems` on jaxzero and on small packages that break each
limit.
"""

from __future__ import annotations

import ast
import graphlib
import pathlib
import sys

LIMITS = {"module": 400, "class": 250, "function": 80}


def modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{dotted name: file}`` for every ``.py`` file of ``package`` (a directory)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported(name: str, is_package: bool, tree: ast.AST, known) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, anywhere in its body; an import
    of the top-level package itself (the public facade) is not an edge."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets.add(module)
            targets.update(f"{module}.{a.name}" for a in node.names)
    edges = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if "." in target and target != name:
            edges.add(target)
    return edges


def _too_long(name: str, tree: ast.Module, lines: int, limits) -> list[str]:
    out = []
    if lines > limits["module"]:
        out.append(f"module {name}: {lines} lines > {limits['module']}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            kind = "class"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "function"
        else:
            continue
        n = node.end_lineno - node.lineno + 1
        if n > limits[kind]:
            out.append(f"{kind} {name}:{node.lineno} {node.name}: {n} lines > {limits[kind]}")
    return out


def problems(package, limits=None) -> list[str]:
    """Every broken limit of ``package`` (a directory), one line each; empty when it passes."""
    limits = {**LIMITS, **(limits or {})}
    files = modules(pathlib.Path(package).resolve())
    graph, out = {}, []
    for name, path in files.items():
        source = path.read_text()
        tree = ast.parse(source, filename=str(path))
        graph[name] = imported(name, path.name == "__init__.py", tree, files)
        out += _too_long(name, tree, len(source.splitlines()), limits)
    while True:  # each cycle found is reported, then broken, until none is left
        try:
            graphlib.TopologicalSorter(graph).prepare()
            return out
        except graphlib.CycleError as err:
            cycle = err.args[1]  # [a, b, ..., a]: each imports the one before it
            out.append("import cycle: " + " -> ".join(reversed(cycle)))
            graph[cycle[1]].discard(cycle[0])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    found = problems(argv[0])
    for line in found:
        print(line)
    print(f"structure: {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
