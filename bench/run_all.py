"""Run every benchmark and write the results table into docs/benchmarks.md.

Each ``bench/bench_*.py`` module exposes ``run() -> list[dict]``; a row has ``name``,
``target``, ``median``, ``spread``, ``unit``, ``baseline`` and ``ratio`` (the median over the
baseline measured side by side in the same run). The table replaces the block between the
``<!-- results -->`` markers of ``docs/benchmarks.md``; the method text around it is kept.

Usage: ``python -m bench.run_all [--only NAME ...] [--no-write]``.
"""

from __future__ import annotations

import argparse
import importlib
import platform
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
    rows: list[dict[str, Any]] = []
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
        rows.extend(got)
        print(table(got), end="")
        print(f"   ({time.perf_counter() - started:.1f} s)", flush=True)
    result = table(rows)
    stamp = (
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, "
        f"Python {platform.python_version()}, {_cpu_count()} cores.\n\n"
    )
    if not args.no_write and rows:
        text = DOC.read_text() if DOC.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
        if BEGIN not in text or END not in text:
            text += f"\n{BEGIN}\n{END}\n"
        before, rest = text.split(BEGIN, 1)
        _, after = rest.split(END, 1)
        DOC.write_text(f"{before}{BEGIN}\n{stamp}{result}{END}{after}")
        print(f"wrote {DOC}")
    return 1 if failed else 0


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
