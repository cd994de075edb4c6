"""The root writes each step-time window to ``artifact_dir`` and keeps only the newest N."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.step_time.artifact import diagnose_file, load_window
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.step_time.artifacts import StepArtifactWriter, safe_name
from rankwatch.exporter.step_time.rank_watch import RankWatch


class Recorder:
    def __init__(self) -> None:
        self.reports: list[WindowReport] = []

    def publish(self, report: WindowReport) -> None:
        self.reports.append(report)

    def close(self, timeout_seconds: float) -> None:
        pass


def config(tmp: Path, **overrides: Any) -> RankwatchConfig:
    base: dict[str, Any] = {
        "interval_seconds": 0.2,
        "gather_timeout_seconds": 2.0,
        "async_mode": False,
        "sync_step": 3,
        "artifact_dir": str(tmp),
        "artifact_retention": 2,
        "group_name": "../../dp/0",
    }
    base.update(overrides)
    return RankwatchConfig.from_env(env={}, **base)


def test_windows_are_saved_replayable_and_pruned(tmp_path: Path) -> None:
    rec = Recorder()
    rw = RankWatch(config=config(tmp_path), publishers=[rec])
    for _ in range(15):
        with rw.step():
            with rw.phase("input_wait"):
                pass
            with rw.phase("forward"):
                time.sleep(0.001)
            with rw.phase("backward"):
                time.sleep(0.001)
        rw.collect()
    deadline = time.monotonic() + 10
    while len(rec.reports) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    rw.close(3.0)
    assert len(rec.reports) >= 3
    files = sorted(tmp_path.iterdir())
    # A hostile group name stays inside the folder; retention keeps the newest two.
    assert [f.parent for f in files] == [tmp_path] * len(files)
    assert len(files) == 2, files
    assert all(f.name.startswith("step-dp_0-") for f in files)
    summary = [f for f in files if "-summary-" in f.name]
    assert len(summary) == 1
    saved = load_window(summary[0])
    assert sorted(saved.per_rank) == [0]
    final = rec.reports[-1]
    assert final.window_kind == "summary" and final.step_time is not None
    assert diagnose_file(summary[0]).kind == final.step_time.kind


def test_no_folder_or_zero_retention_writes_nothing(tmp_path: Path) -> None:
    assert StepArtifactWriter.from_config(config(tmp_path, artifact_dir="")) is None
    assert StepArtifactWriter.from_config(config(tmp_path, artifact_retention=0)) is None


def test_an_unusable_folder_warns_by_variable_and_the_job_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file, a device or a path under a file as RANKWATCH_ARTIFACT_DIR: one warning naming
    the variable, the value and the errno, at once; the windows are not written (never raised:
    training is not stopped)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (str(a_file), "exists and is not a folder"),
        ("/dev/null", "exists and is not a folder"),
        (str(a_file / "under"), "Not a directory"),  # the system's words: mkdir under a file
    ]
    for folder, reason in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rankwatch.storage"):
            writer = StepArtifactWriter.from_config(config(tmp_path, artifact_dir=folder))
        assert writer is not None and writer.guard.failing
        assert caplog.messages == [
            f"rankwatch: step windows not written: RANKWATCH_ARTIFACT_DIR={folder!r}: "
            f"ENOTDIR ({reason}); retrying in 30 s, then at most every 600 s "
            '(counted in rankwatch_storage_errors_total{writer="step_windows"})'
        ]
    # A folder that does not exist yet is created, as before.
    made = tmp_path / "new" / "deeper"
    writer = StepArtifactWriter.from_config(config(tmp_path, artifact_dir=str(made)))
    assert writer is not None and made.is_dir()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_writer_refuses_a_bad_retention(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="retention"):
        StepArtifactWriter(tmp_path, "g", bad)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("world", "world"), ("../x", "x"), ("a/b\\c", "a_b_c"), ("..", "group"), ("", "group")],
)
def test_safe_name(name: str, expected: str) -> None:
    assert safe_name(name) == expected
