"""Sphinx configuration for jaxzero's documentation (``make docs``).

The build runs with warnings as errors (``-W --keep-going``), and two checks of our own turn a
docstring that drifts from its code into a warning:

* ``check_documented_parameters``: every parameter a docstring documents (Google ``Args:`` /
  ``Keyword Args:`` sections, which napoleon turns into ``:param:`` fields) must be a
  parameter of the signature.
* ``check_reference_exists``: a cross-reference (``:func:`...```) that the reference does not
  document must at least name a Python object that exists (internal modules and other
  libraries are not in the reference; the build runs offline, without intersphinx).
* ``check_public_names_documented``: every name in ``jaxzero.__all__`` appears in the API
  reference.
* ``check_benchmark_tables``: every table in ``benchmarks.md`` equals the results file its
  command wrote (``benchmarks/docs_tables.py``).

The command-line page shows each parser's ``--help`` text, generated here at build time from
``jaxzero.cli.build_parser`` and ``jaxzero.cli.launch.build_parser`` (the ``jaxzero-help``
directive), so it is always the installed version's. The help texts are formatted for a
terminal (indented example blocks), which reST would misread, so they are literal blocks.
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import inspect
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
# Importing jaxzero must not start a GPU backend while the docs build.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["COLUMNS"] = "100"  # argparse wraps --help text to the terminal width

from docutils import nodes  # noqa: E402
from sphinx.util import logging  # noqa: E402
from sphinx.util.docutils import SphinxDirective  # noqa: E402

import jaxzero  # noqa: E402

project = "jaxzero"
author = "jaxzero authors"
release = jaxzero.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}
autoclass_content = "both"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_param = True
napoleon_use_keyword = True
napoleon_use_ivar = True  # "Attributes:" as fields: dataclass fields are documented once


html_theme = "alabaster"
html_title = f"jaxzero {release}"

_log = logging.getLogger("jaxzero.docs")
_FIELD = re.compile(r"^\s*:(?:param|keyword|type|kwtype)\s+(?:[^:]*\s)?\**(\w+)\s*:")


def _signature_names(obj) -> set[str] | None:
    """Parameter names of ``obj`` (a class: its ``__init__``), or None if it has none."""
    target = obj
    if inspect.isclass(obj):
        target = obj.__init__
        if target is object.__init__:
            return None
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    return set(sig.parameters)


def check_documented_parameters(app, what, name, obj, options, lines):
    """Warn when a docstring documents a parameter its signature does not have."""
    if what not in ("function", "method", "class"):
        return
    params = _signature_names(obj)
    if params is None:
        return
    documented = {m.group(1) for line in lines if (m := _FIELD.match(line))}
    for extra in sorted(documented - params):
        try:
            where = f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}: "
        except (TypeError, OSError):
            where = ""
        _log.warning(
            "%s%s documents parameter %r, which its signature (%s) does not have",
            where,
            name,
            extra,
            ", ".join(sorted(params)) or "no parameters",
            type="jaxzero",
            subtype="docstring-params",
        )


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names an importable module or an attribute path under one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return hasattr(builtins, dotted)


def check_reference_exists(app, env, node, contnode):
    """Warn for a Python cross-reference that names nothing: a jaxzero name that does not
    exist, or text that is not a name at all (napoleon misreading a docstring section).
    Qualified names of other libraries are left alone (no inventories offline)."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    if "." in target and not target.startswith("jaxzero."):
        return None
    module, cls = node.get("py:module"), node.get("py:class")
    scopes = [target, f"typing.{target}"]
    if module:
        scopes += [f"{module}.{target}"] + ([f"{module}.{cls}.{target}"] if cls else [])
    if "." not in target.split(".")[0] and not target.startswith("jaxzero."):
        # A relative name in a docstring: the module that defines the documented object.
        scopes += [f"{name}.{target}" for name in list(sys.modules) if name.startswith("jaxzero")]
    if not any(_resolves(name) for name in scopes):
        _log.warning(
            "reference to %r, which names no Python object",
            target,
            location=node,
            type="jaxzero",
            subtype="dangling-reference",
        )
    return None


def check_public_names_documented(app, env):
    """Warn for every name of ``jaxzero.__all__`` missing from the API reference."""
    py = env.get_domain("py")
    documented = set(py.objects) | set(py.modules)
    for public in jaxzero.__all__:
        obj = getattr(jaxzero, public)
        key = obj.__name__ if inspect.ismodule(obj) else f"jaxzero.{public}"
        if key not in documented:
            _log.warning(
                "jaxzero.%s is in jaxzero.__all__ but not in the API reference (docs/api/)",
                public,
                type="jaxzero",
                subtype="api-coverage",
            )


def _parsers(parser: argparse.ArgumentParser, path: str):
    """``(command path, parser)`` for ``parser`` and every subcommand under it, in order."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


class HelpDirective(SphinxDirective):
    """``jaxzero-help module:function prog``: one section per command of the parser that
    ``module.function()`` builds, holding that command's ``--help`` text."""

    required_arguments = 2
    final_argument_whitespace = True

    def run(self):
        module, _, function = self.arguments[0].partition(":")
        parser = getattr(importlib.import_module(module), function)()
        prog = self.arguments[1]
        sections = []
        for path, sub in _parsers(parser, prog):
            sub.prog = path
            section = nodes.section(ids=[nodes.make_id(path)])
            section += nodes.title(text=path)
            section += nodes.literal_block(text=sub.format_help())
            sections.append(section)
        return sections


def check_benchmark_tables(app):
    """Warn for each table of benchmarks.md that differs from its results file."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import docs_tables

    for problem in docs_tables.stale():
        _log.warning("benchmarks.md: %s", problem, type="jaxzero", subtype="benchmark-tables")


def setup(app):
    app.connect("builder-inited", check_benchmark_tables)
    app.add_directive("jaxzero-help", HelpDirective)
    # After napoleon (priority 500) has turned Google sections into :param: fields.
    app.connect("autodoc-process-docstring", check_documented_parameters, priority=900)
    app.connect("env-check-consistency", check_public_names_documented)
    app.connect("missing-reference", check_reference_exists)
