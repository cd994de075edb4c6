"""``rankwatch diagnose`` and ``rankwatch replay`` on the ranks' hang record files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankwatch.exporter.cli.main import main
from tests.diagnosis.hang.test_classify import _stuck, _waiting, _write


def test_replay_gives_the_verdict_of_a_runs_hang_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for record in (_waiting(0), _waiting(1), _stuck()):
        _write(tmp_path, record)
    assert main(["replay", "--json", str(tmp_path)]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    hang = next(o for o in out if o.get("kind") == "hang")
    assert hang["hang_class"] == "STUCK_ALIVE" and hang["culprit_ranks"] == [2]
    assert hang["ranks_with_records"] == [0, 1, 2]


def test_diagnose_reads_one_hang_file_and_refuses_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, _stuck())
    assert main(["diagnose", str(path)]) == 0
    text = capsys.readouterr().out
    assert "rank 2" in text and "data.py:12 __getitem__" in text
    bad = tmp_path / "hang-rank5-1.json"
    bad.write_text('{"format": "rankwatch.hang_record", "version": 1, "rank": "five"}')
    assert main(["diagnose", str(bad)]) != 0
    assert "rank" in capsys.readouterr().err
    assert main(["replay", str(tmp_path)]) == 2  # the bad file refused, the others replayed
