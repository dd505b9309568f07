"""Copy the figures the benchmark commands wrote (``benchmarks/results/``) into
``docs/benchmarks.md``, so that page never holds a hand-copied table.

    python benchmarks/docs_tables.py           # rewrite docs/benchmarks.md's marked blocks
    python benchmarks/docs_tables.py --check   # exit 1 naming each stale or missing block

Each results file has one block in the page, under the heading that names the command which
wrote it::

    <!-- results/overlap.md: begin -->
    (the file, its headings moved below the command's heading)
    <!-- results/overlap.md: end -->

A ``.md`` file is copied as it is; ``ema.json`` (``benchmarks/ema.py``) is rendered as a
table of its timings. ``make docs`` runs the check (a stale block fails the build), and
``benchmarks/gpu_scale.py`` rewrites the page after every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PAGE = os.path.join(HERE, "..", "docs", "benchmarks.md")
TOP = 4  # a results file's top heading becomes "####", below the command's "###"
_BLOCK = re.compile(r"<!-- results/(\S+): begin -->\n.*?<!-- results/\1: end -->", re.S)


def _demote(md: str) -> str:
    levels = [len(m.group(1)) for m in re.finditer(r"^(#+) ", md, re.M)]
    shift = TOP - min(levels) if levels else 0
    return re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + shift) + " ", md, flags=re.M)


def _ema_table(data: dict) -> str:
    r, machine = data["results"], data["machine"]
    base = r["a_replicated"]["median_ms"]
    tree = data["tree"]
    lines = [
        f"EMA update of {tree['floats']:,} floats in {tree['leaves']} leaves, "
        f"{machine['device_count']} simulated {machine['platform']} devices on "
        f"{machine['cpu_count']} cores, jax {data['jax_version']}; {data['rounds']} rounds x "
        f"{data['runs_per_round']} runs (load {machine['loadavg'][0]:.1f}); bucket: leaves "
        f"with <= {data['bucket']['bucket_leaves_up_to']} elements per device.",
        "",
        "| case | median ms | min ms | replicated / case (medians) |",
        "|---|---|---|---|",
    ]
    for key, value in r.items():
        ratio = f"{base / value['median_ms']:.2f}x" if key.startswith(("a_", "b_")) else "-"
        lines.append(f"| {key} | {value['median_ms']:.2f} | {value['min_ms']:.2f} | {ratio} |")
    return "\n".join(lines)


def render(name: str) -> str:
    """The block's content for ``benchmarks/results/<name>``."""
    with open(os.path.join(RESULTS, name)) as fh:
        text = fh.read()
    if name.endswith(".json"):
        return _ema_table(json.loads(text))
    return _demote(text.strip())


def expected() -> list[str]:
    """Results files the page must show: every ``.md`` and ``ema.json``."""
    names = sorted(n for n in os.listdir(RESULTS) if n.endswith(".md"))
    return names + ["ema.json"]


def _block(name: str) -> str:
    return f"<!-- results/{name}: begin -->\n{render(name)}\n<!-- results/{name}: end -->"


def stale(page: str = PAGE) -> list[str]:
    """Problems of the page against the results files (empty when it is up to date)."""
    with open(page) as fh:
        text = fh.read()
    found = {m.group(1): m.group(0) for m in _BLOCK.finditer(text)}
    problems = [f"results/{n} has no block in {page}" for n in expected() if n not in found]
    problems += [
        f"the block of results/{n} differs from the file: run python benchmarks/docs_tables.py"
        for n, block in found.items()
        if n in expected() and block != _block(n)
    ]
    problems += [f"block results/{n} has no results file" for n in found if n not in expected()]
    return problems


def sync(page: str = PAGE) -> None:
    """Rewrite every marked block of the page from its results file."""
    with open(page) as fh:
        text = fh.read()
    text = _BLOCK.sub(lambda m: _block(m.group(1)), text)
    with open(page, "w") as fh:
        fh.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="report stale blocks, change nothing")
    args = ap.parse_args(argv)
    if not args.check:
        sync()
    problems = stale()
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
