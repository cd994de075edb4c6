"""Shared pytest set-up. The real-server helpers live in ``tests/servers.py``.

Tests sit in folders that mirror the code (``diagnosis/``, ``exporter/<layer>/``,
``dashboards/``, ``deploy/``), plus ``project/`` (packaging, docs, generated files) and
``e2e/`` (multi-process worlds and end-to-end suites). Each folder marks its tests with its
name, so ``-m diagnosis`` or ``-m "not e2e"`` selects by folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Gloo and torch threads: keep worlds small and quiet on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = ("diagnosis", "exporter", "dashboards", "deploy", "project", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = item.path.relative_to(TESTS).parts
        if len(parts) > 1 and parts[0] in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
