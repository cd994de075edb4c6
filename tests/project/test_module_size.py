"""Every module of rankwatch reads in one sitting: none is over 800 lines.

A module that grows past that holds two ideas (or one that wants a folder): split it where the
seam is, rather than raise the limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT_LINES = 800
_FOLDERS = (ROOT / "diagnosis", ROOT / "exporter")


def _modules() -> list[Path]:
    return sorted(p for folder in _FOLDERS for p in folder.rglob("*.py"))


def test_the_package_has_modules_to_measure() -> None:
    assert len(_modules()) > 50


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_at_most_800_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= LIMIT_LINES, f"{path.relative_to(ROOT)}: {lines} lines (limit {LIMIT_LINES})"
