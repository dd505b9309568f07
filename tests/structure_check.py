"""The package's structure: no import cycle between its modules (module-level and deferred
imports alike) and no private name (``_x``) imported from another of its modules, which fail
the build; and a size report, which does not. A name another module uses is public: drop its
underscore (a package importing its own private submodule, ``from pkg import _startup``, is
not a name crossing a module boundary). A module holds one
concept whatever its length, so sizes are read, not capped: the report lists each module over
400 lines, class over 250 and function over 80 (docstrings included; a package's
``__init__.py`` counts as a module) as places to look at, not errors.

    python tests/structure_check.py jaxzero      # cycles and private imports (exit status 1
                                                 # if any), then sizes

tests/test_structure.py runs :func:`cycles` and :func:`private_imports` on jaxzero and every
check on small packages that break each.
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


def sizes(package, limits=None) -> list[str]:
    """The size report of ``package`` (a directory): each module, class and function over
    ``limits`` (:data:`LIMITS` by default), one line each. A report, not a failure."""
    limits = {**LIMITS, **(limits or {})}
    out = []
    for name, path in modules(pathlib.Path(package).resolve()).items():
        source = path.read_text()
        out += _too_long(
            name, ast.parse(source, filename=str(path)), len(source.splitlines()), limits
        )
    return out


def cycles(package) -> list[str]:
    """Every import cycle of ``package`` (a directory), one line each; empty when it passes."""
    files = modules(pathlib.Path(package).resolve())
    graph, out = {}, []
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = imported(name, path.name == "__init__.py", tree, files)
    while True:  # each cycle found is reported, then broken, until none is left
        try:
            graphlib.TopologicalSorter(graph).prepare()
            return out
        except graphlib.CycleError as err:
            cycle = err.args[1]  # [a, b, ..., a]: each imports the one before it
            out.append("import cycle: " + " -> ".join(reversed(cycle)))
            graph[cycle[1]].discard(cycle[0])


def private_imports(package) -> list[str]:
    """Every private name (``_x``, not a dunder) a module of ``package`` (a directory) imports
    from another module of it, one line each; empty when it passes. A private submodule
    imported by name (``from pkg import _startup``) is a module, not a name, and passes."""
    files = modules(pathlib.Path(package).resolve())
    root = next(iter(files)).split(".")[0]
    out = []
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.split(".")[0] != root:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{module}.{alias.name}" not in files:
                    out.append(f"private import: {name} imports {alias.name} from {module}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    found = cycles(argv[0])
    private = private_imports(argv[0])
    for line in found + private:
        print(line)
    print(f"structure: {len(found)} import cycles, {len(private)} private imports")
    report = sizes(argv[0])
    for line in report:
        print(f"size: {line}")
    print(f"sizes: {len(report)} over {LIMITS} (a report, not a failure)")
    return 1 if found or private else 0


if __name__ == "__main__":
    sys.exit(main())
