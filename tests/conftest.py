"""Shared pytest set-up. The real-server helpers live in ``tests/servers.py``.

Tests sit in folders that mirror the code (``diagnosis/``, ``exporter/<layer>/``,
``dashboards/``, ``deploy/``), plus ``project/`` (packaging, docs, generated files) and
``e2e/`` (multi-process worlds and end-to-end suites). Each folder marks its tests with its
name, so ``-m diagnosis`` or ``-m "not e2e"`` selects by folder.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Property tests (hypothesis) are deterministic by default: derandomized (each test's examples
# follow from the test itself), no example database carried between runs, and no timing-based
# check (a deadline, "too slow") that a loaded machine could fail. So `make test` draws the same
# examples on every run and every machine; the boundaries each test must cover are in its
# strategies and explicit examples, not left to luck. `make fuzz` selects the `fuzz` profile:
# fresh randomness, FUZZ_EXAMPLES_FACTOR (default 10) times each test's examples, failures
# kept in .hypothesis/ so the next run replays them, and each failing example printed with the
# blob that reproduces it (`@reproduce_failure`).
settings.register_profile(
    "deterministic",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "fuzz", derandomize=False, deadline=None, print_blob=True, report_multiple_bugs=True
)
settings.load_profile(os.environ.get("RANKWATCH_HYPOTHESIS_PROFILE", "deterministic"))
FUZZ_EXAMPLES_FACTOR = int(os.environ.get("FUZZ_EXAMPLES_FACTOR", "10"))

# Gloo and torch threads: keep worlds small and quiet on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = ("diagnosis", "exporter", "dashboards", "deploy", "project", "e2e")
# Tests that take seconds each: the files that hold one are started first (below).
SLOW_MARKERS = ("slow", "multiproc", "servers", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    fuzz = settings.default is settings.get_profile("fuzz")
    for item in items:
        parts = item.path.relative_to(TESTS).parts
        if len(parts) > 1 and parts[0] in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
        test = getattr(item, "obj", None)
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if fuzz and own is not None:
            # A test's own max_examples wins over any profile's: scale it here for fuzzing.
            test._hypothesis_internal_use_settings = settings(  # type: ignore[union-attr]
                own, max_examples=own.max_examples * FUZZ_EXAMPLES_FACTOR
            )
    # The files that hold a slow test first, each file's tests in their order: the shared run's
    # workers take whole files in this order (`--no-loadscope-reorder`), so the run does not
    # end with one worker alone on a long file while the other has finished.
    slow = {item.path for item in items if any(map(item.get_closest_marker, SLOW_MARKERS))}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(autouse=True)
def _seeded_randomness() -> None:
    """Every test starts from the same random state: Python's, numpy's global one and torch's
    (when loaded), so a test that draws without a generator of its own is deterministic too."""
    random.seed(0)
    np.random.seed(0)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)
