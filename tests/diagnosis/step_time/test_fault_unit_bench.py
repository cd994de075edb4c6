"""The fault's unit and pace benchmark runs and reports both sizes' rows (small sizes here)."""

from __future__ import annotations

import pytest

import bench.bench_fault_unit as bench


def test_the_benchmark_reports_time_beside_the_diagnosis_and_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench, "SIZES", (64,))
    monkeypatch.setattr(bench, "ROUNDS", 1)
    window, memory = bench.run()
    assert window["unit"] == "ms" and window["baseline"] > 0 and window["median"] > 0
    assert window["ratio"] == pytest.approx(window["median"] / window["baseline"])
    assert memory["unit"] == "KiB" and memory["median"] > 0
