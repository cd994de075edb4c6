"""The storage-fault policy (:mod:`rankwatch.exporter.storage`) on real file systems.

A full disk is a small tmpfs mounted for the test (root is needed: in CI, where the suite runs
as root, a machine that refuses the mount fails the test; elsewhere it is skipped with the
system's reason). Folders that are files, devices or removed need nothing special. The
two-rank runs of every fault against every writer are ``bench/reliability_matrix.py``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.reliability_matrix import NotRunnable, fill, mount_tmpfs, umount
from rankwatch.exporter.publish.hub import HealthCounters
from rankwatch.exporter.publish.recorder import end_of_run_text
from rankwatch.exporter.storage import (
    GuardedFileHandler,
    GuardedWrites,
    atomic_write,
    storage_error_counts,
    writable_folder,
)
from tests.servers import missing_in_ci


class Clock:
    """A clock the test moves by hand (the retry schedule is minutes long)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "disk"
    folder.mkdir()
    try:
        mount_tmpfs(folder, "256k")
    except NotRunnable as exc:
        reason = f"a tmpfs cannot be mounted here (needs root): {exc}"
        missing_in_ci(reason, pytrace=False)
    try:
        yield folder
    finally:
        umount(folder)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_full_disk_is_said_once_counted_retried_on_schedule_and_recovers(
    small_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    guard = GuardedWrites("test_full", "test files", "TEST_DIR", str(small_disk), clock=clock)
    before = storage_error_counts()["test_full"]
    first = guard.run(small_disk / "a", lambda: atomic_write(small_disk / "a", b"kept"), small_disk)
    assert first == small_disk / "a"
    fill(small_disk)
    big = b"x" * 65536
    with caplog.at_level(logging.INFO, logger="rankwatch.storage"):
        assert guard.run(small_disk / "b", lambda: atomic_write(small_disk / "b", big)) is None
        assert guard.failing and not guard.ready()  # skipped until the first retry
        clock.now += 29.0
        assert not guard.ready()
        clock.now += 1.0
        assert guard.run(small_disk / "b", lambda: atomic_write(small_disk / "b", big)) is None
        clock.now += 59.0
        assert not guard.ready()  # the wait doubled: 60 s
        clock.now += 1.0
        (small_disk / "filler").unlink()  # someone frees the disk
        assert guard.run(small_disk / "b", lambda: atomic_write(small_disk / "b", big)) is not None
    warnings = _lines(caplog)
    assert warnings == [
        f"rankwatch: test files not written: TEST_DIR={str(small_disk)!r}, at {small_disk / 'b'}:"
        " ENOSPC (No space left on device); retrying in 30 s, then at most every 600 s "
        '(counted in rankwatch_storage_errors_total{writer="test_full"})'
    ]
    assert any("written again" in r.getMessage() for r in caplog.records)
    assert not guard.failing and guard.errors == 2 and guard.lost == 5
    assert storage_error_counts()["test_full"] == before + 2
    assert (small_disk / "a").read_bytes() == b"kept"  # written before the fault, intact
    assert [p.name for p in small_disk.iterdir() if p.name.startswith(".tmp-")] == []
    assert guard.not_written() is None or "written again since" in str(guard.not_written())


def test_the_retry_wait_doubles_up_to_its_bound(tmp_path: Path) -> None:
    clock = Clock()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    guard = GuardedWrites("test_bound", "t", "TEST_DIR", str(blocker), clock=clock)
    waits = []
    for _ in range(8):
        assert not guard.check_folder(blocker)
        start = clock.now
        while not guard.ready():
            clock.now += 1.0
        waits.append(clock.now - start)
    assert waits == [30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0, 600.0]
    assert guard.errors == 8


def test_a_removed_folder_is_created_again_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "out"
    guard = GuardedWrites("test_removed", "test files", "TEST_DIR", str(folder))
    assert guard.check_folder(folder)
    with caplog.at_level(logging.WARNING, logger="rankwatch.storage"):
        for i in range(4):
            path = folder / f"f{i}"
            assert guard.run(path, lambda p=path: atomic_write(p, b"x"), folder) == path
            if i in (1, 2):
                shutil.rmtree(folder)
    (line,) = _lines(caplog)
    assert "ENOENT (removed during the run; created again)" in line and "TEST_DIR=" in line
    assert sorted(p.name for p in folder.iterdir()) == ["f3"]
    assert guard.errors == 2 and guard.lost == 0 and guard.not_written() is None


@pytest.mark.parametrize("target", ["a file", "/dev/null", "under a file"])
def test_a_folder_that_is_not_one_is_refused_with_enotdir(tmp_path: Path, target: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    path = {"a file": blocker, "/dev/null": Path("/dev/null"), "under a file": blocker / "x"}
    with pytest.raises(NotADirectoryError) as err:
        writable_folder(path[target])
    assert err.value.errno == 20  # ENOTDIR
    assert blocker.read_text() == "mine"


def test_a_log_file_on_a_full_disk_prints_no_traceback_and_follows_the_guard(
    small_disk: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    guard = GuardedWrites("test_log", "test lines", "TEST_DIR", str(small_disk))
    handler = GuardedFileHandler(str(small_disk / "x.log"), guard)
    logger = logging.getLogger("rankwatch.test_storage_log")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("before the fault")
        handler.flush()
        fill(small_disk)
        with caplog.at_level(logging.WARNING, logger="rankwatch.storage"):
            for _ in range(200):  # fills the last page, then fails
                logger.info("y" * 512)
    finally:
        logger.removeHandler(handler)
        handler.close()
    (line,) = _lines(caplog)
    assert "ENOSPC" in line and f"at {small_disk / 'x.log'}" in line
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err
    assert (small_disk / "x.log").read_text().startswith("before the fault\n")


def test_a_log_file_removed_while_open_is_opened_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "logs"
    guard = GuardedWrites("test_log_removed", "test lines", "TEST_DIR", str(folder))
    handler = GuardedFileHandler(str(folder / "x.log"), guard)
    record = logging.makeLogRecord({"msg": "one", "levelno": logging.INFO})
    with caplog.at_level(logging.WARNING, logger="rankwatch.storage"):
        handler.handle(record)
        shutil.rmtree(folder)
        handler.handle(logging.makeLogRecord({"msg": "two", "levelno": logging.INFO}))
        handler.handle(logging.makeLogRecord({"msg": "three", "levelno": logging.INFO}))
    handler.close()
    (line,) = _lines(caplog)
    assert "ENOENT" in line and "x.log" in line
    assert (folder / "x.log").read_text() == "two\nthree\n"


def test_storage_errors_are_among_the_exporter_counters() -> None:
    GuardedWrites("test_counted", "t", "TEST_DIR", "/x")
    health = HealthCounters(0.0).snapshot()
    assert health.storage_errors["test_counted"] == 0


def test_the_end_block_says_what_was_not_written_instead_of_the_hint() -> None:
    summary: dict[str, object] = {"run": {"run_id": "r"}, "verdict": None, "incidents": []}
    why = "run summary (RANKWATCH_ARTIFACT_DIR='/dev/null': ENOTDIR (exists and is not a folder))"
    text = end_of_run_text(summary, None, [why])
    assert f"  Not written: {why}\n" in text
    assert "set RANKWATCH_ARTIFACT_DIR" not in text
    assert "set RANKWATCH_ARTIFACT_DIR" in end_of_run_text(summary, None)
    with pytest.raises(TypeError, match="not_written: expected a sequence of strings"):
        end_of_run_text(summary, None, "run summary")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"writer": ""}, "writer"),
        ({"what": 3}, "what"),
        ({"variable": ""}, "variable"),
        ({"first_retry_seconds": 0.0}, "first_retry_seconds"),
        ({"first_retry_seconds": 10.0, "max_retry_seconds": 5.0}, "first_retry_seconds"),
    ],
)
def test_bad_guard_settings_are_refused_by_name(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"writer": "w", "what": "t", "variable": "V", "value": "/x"}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        GuardedWrites(**args)
