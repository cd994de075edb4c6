"""Run every benchmark and write the results table into docs/benchmarks.md.

Each ``bench/bench_*.py`` module exposes ``run() -> list[dict]``; a row has ``name``,
``target``, ``median``, ``spread``, ``unit``, ``baseline`` and ``ratio`` (the median over the
baseline measured side by side in the same run). Each module's table replaces its own block
between the ``<!-- results -->`` markers of ``docs/benchmarks.md``; other blocks and the method
text around them are kept.

Usage: ``python -m bench.run_all [--only NAME ...] [--no-write]``.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
DOC = BENCH_DIR.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- results -->", "<!-- /results -->"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def row(
    name: str,
    unit: str,
    rounds: list[list[float]],
    baseline_rounds: list[list[float]],
    target: float | None = None,
) -> dict[str, Any]:
    """A result row from figures measured in rounds, the baseline's in the same rounds: the
    median over all figures, the spread max - min of the round medians."""
    median = statistics.median(x for r in rounds for x in r)
    baseline = statistics.median(x for r in baseline_rounds for x in r)
    per_round = [statistics.median(r) for r in rounds]
    return {
        "name": name,
        "target": target,
        "median": median,
        "spread": max(per_round) - min(per_round),
        "unit": unit,
        "baseline": baseline,
        "ratio": median / baseline if baseline else None,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of benchmark rows."""
    head = "| benchmark | target | median | spread | unit | baseline | ratio |\n"
    head += "|---|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {r['name']} | {_fmt(r.get('target'))} | {_fmt(r.get('median'))} | "
        f"{_fmt(r.get('spread'))} | {r.get('unit', '')} | {_fmt(r.get('baseline'))} | "
        f"{_fmt(r.get('ratio'))} |\n"
        for r in rows
    )
    return head + body


def merge_sections(text: str, sections: dict[str, str]) -> str:
    """Replace (or add) each benchmark's block between the results markers; keep the others.

    Running one benchmark with ``--only`` then updates its own table and leaves the figures
    of the others as they were measured.
    """
    if BEGIN not in text or END not in text:
        text = (text or "# Benchmarks\n") + f"\n{BEGIN}\n{END}\n"
    before, rest = text.split(BEGIN, 1)
    inner, after = rest.split(END, 1)
    blocks: dict[str, str] = {}
    for chunk in inner.split("\n### ")[1:]:
        title, _, body = chunk.partition("\n")
        blocks[title.strip()] = body.strip("\n") + "\n"
    blocks.update(sections)
    body = "".join(f"\n### {name}\n\n{blocks[name].strip()}\n" for name in sorted(blocks))
    return f"{before}{BEGIN}\n{body}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="module names, e.g. bench_normal")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the docs alone")
    args = parser.parse_args(argv)
    modules = sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))
    if args.only:
        unknown = set(args.only) - set(modules)
        if unknown:
            parser.error(f"--only: unknown benchmark(s) {sorted(unknown)}; known: {modules}")
        modules = [m for m in modules if m in args.only]
    sections: dict[str, str] = {}
    failed: list[str] = []
    for name in modules:
        started = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            mod = importlib.import_module(f"bench.{name}")
            got = mod.run()
        except Exception as exc:  # one broken benchmark must not hide the others' numbers
            print(f"   FAILED: {exc!r}", flush=True)
            failed.append(name)
            continue
        stamp = (
            f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
            f"Python {platform.python_version()}, {_cpu_count()} cores.\n\n"
        )
        sections[name] = stamp + table(got)
        print(table(got), end="")
        print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)
    if not args.no_write and sections:
        DOC.write_text(merge_sections(DOC.read_text() if DOC.exists() else "", sections))
        print(f"wrote {DOC}")
    return 1 if failed else 0


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
