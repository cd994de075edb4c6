"""A restarted run: the attempt on events and summaries, earlier attempts kept and read back,
and the end block of a later attempt saying whether the culprit followed the host or the rank
(``publish/culprits.py``, ``publish/recorder.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rankwatch.diagnosis.untrusted_files import ArtifactError
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.culprits import (
    RunCulprits,
    earlier_attempts_lines,
    read_run_culprits,
    run_culprits,
    summary_files,
)
from rankwatch.exporter.publish.events import event_attributes, event_message
from rankwatch.exporter.publish.incidents import IncidentTracker
from rankwatch.exporter.publish.recorder import RunRecorder, end_of_run_text
from tests.publish_reports import rank_infos, step_report, window

RUN = "job-7"


def attempt_run(
    folder: Path, attempt: int, culprit: int, hosts: dict[int, str], run: str = RUN
) -> RunRecorder:
    """One attempt of ``run`` whose rank ``culprit`` straggles on its host, recorded into
    ``folder``; closed (its summary written)."""
    config = RankwatchConfig(
        metrics_enabled=False, run_id=run, attempt=attempt, incident_open_k=1, incident_open_n=1
    )
    recorder = RunRecorder(config, folder, {"run_id": run, "attempt": attempt})
    ranks = rank_infos(8, hostnames=hosts)
    for i in range(3):
        recorder.publish(
            window(i, n=8, step_time=step_report(8, culprit=culprit), ranks=ranks, run=run)
        )
    recorder.close(1.0)
    return recorder


def test_a_first_attempt_reads_as_before(tmp_path):
    recorder = attempt_run(tmp_path, 0, 2, {2: "node-c"})
    summary = recorder.summary(recorder.run)
    assert summary["run"]["attempt"] == 0
    assert "earlier_attempts" not in summary
    text = end_of_run_text(summary, recorder.written)
    assert text.startswith(f"rankwatch: run {RUN} ended\n")
    assert " attempt 0" not in text and "Earlier attempts" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "summary.txt"]


def test_later_attempts_say_whether_the_culprit_followed_the_host_or_the_rank(tmp_path):
    attempt_run(tmp_path, 0, 2, {2: "node-c"})
    # Attempt 1: another rank (5) on the same host: the host is the fault.
    second = attempt_run(tmp_path, 1, 5, {2: "node-a", 5: "node-c"})
    lines = second.summary(second.run)["earlier_attempts"]
    assert lines == [
        "attempt 1: rank 2 on node-c was the culprit (step_time_straggler) in attempt 0; "
        "another rank on the same host in this attempt: the culprit followed the host"
    ]
    text = end_of_run_text(second.summary(second.run), second.written)
    assert text.startswith(f"rankwatch: run {RUN} attempt 1 ended\n")
    assert "  Earlier attempts:\n    attempt 1: rank 2 on node-c" in text
    # The earlier summary is kept beside the new one.
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "summary-attempt-0.json",
        "summary-attempt-0.txt",
        "summary.json",
        "summary.txt",
    ]
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["attempt"] == 1
    assert "Earlier attempts of the run:" in (tmp_path / "summary.txt").read_text()
    # Attempt 2: rank 5 again, now on node-d: the job's rank is the fault, not a host.
    third = attempt_run(tmp_path, 2, 5, {5: "node-d"})
    lines = third.summary(third.run)["earlier_attempts"]
    assert lines == [
        "attempt 2: ranks 2 and 5 on node-c were the culprit (step_time_straggler) in attempts "
        "0 and 1; rank 5 on node-d in this attempt: the culprit followed the rank",
    ]
    assert [p.name for p in summary_files(tmp_path)] == [
        "summary-attempt-0.json",
        "summary-attempt-1.json",
        "summary.json",
    ]


def test_the_same_rank_on_the_same_host_again_and_attempts_in_one_line(tmp_path):
    attempt_run(tmp_path, 0, 5, {5: "node-c"})
    attempt_run(tmp_path, 1, 5, {5: "node-c"})
    third = attempt_run(tmp_path, 2, 5, {5: "node-c"})
    assert third.summary(third.run)["earlier_attempts"] == [
        "attempt 2: rank 5 on node-c was the culprit (step_time_straggler) in attempts 0 and "
        "1; the same rank on the same host again in this attempt"
    ]


def test_another_runs_summary_in_the_folder_is_not_an_earlier_attempt(tmp_path):
    attempt_run(tmp_path, 0, 2, {2: "node-c"}, run="other-run")
    second = attempt_run(tmp_path, 1, 5, {5: "node-c"})
    assert "earlier_attempts" not in second.summary(second.run)


def test_an_earlier_attempt_without_a_culprit_says_so(tmp_path):
    attempt_run(tmp_path, 0, None, {})  # type: ignore[arg-type]
    second = attempt_run(tmp_path, 1, 5, {5: "node-c"})
    assert second.summary(second.run)["earlier_attempts"] == [
        "attempt 1: no critical culprit in attempt 0"
    ]


def test_a_hostile_earlier_summary_is_skipped_with_one_warning(tmp_path, caplog):
    (tmp_path / "summary-attempt-0.json").write_text('{"run": {"run_id": "job-7", "attempt": "0"}}')
    os.mkfifo(tmp_path / "summary.json")
    second = attempt_run(tmp_path / "", 1, 5, {5: "node-c"})
    # The FIFO is refused without blocking (and replaced by this attempt's summary), the
    # malformed file is skipped: named in one warning each, nothing else fails.
    assert "earlier_attempts" not in second.summary(second.run)
    assert "run.attempt: expected an int >= 0, got '0'" in caplog.text
    assert second.written is not None


def test_incident_events_carry_the_attempt():
    tracker = IncidentTracker(1, 1, 1, group="world", run=RUN, attempt=3)
    (event,) = tracker.update(window(0, n=4, step_time=step_report(4, culprit=1), run=RUN))
    assert event.attempt == 3
    assert event_attributes(event)["rankwatch.attempt"] == 3
    assert f"run {RUN} attempt 3, group world" in event_message(event)
    first = IncidentTracker(1, 1, 1, group="world", run=RUN)
    (event,) = first.update(window(0, n=4, step_time=step_report(4, culprit=1), run=RUN))
    assert event_attributes(event)["rankwatch.attempt"] == 0
    assert f"run {RUN}, group world" in event_message(event)


@pytest.mark.parametrize(
    ("doc", "named"),
    [
        ([], "summary: expected a JSON object"),
        ({"run": []}, "run: expected an object"),
        ({"run": {"run_id": 7}}, "run.run_id: expected a string"),
        ({"run": {"attempt": -1}}, "run.attempt: expected an int >= 0"),
        ({"run": {"attempt": True}}, "run.attempt: expected an int >= 0"),
        ({"incidents": {}}, "incidents: expected a list"),
        ({"incidents": [7]}, r"incidents\[0\]: expected an object"),
        ({"incidents": [{"class": ["x"]}]}, r"incidents\[0\].class: expected a string"),
        (
            {"incidents": [{"class": "hang", "severity": "critical", "hostnames": ["a\nb"]}]},
            r"incidents\[0\].hostnames\[0\]: expected at most 256 printable",
        ),
        ({"incidents": [{"ranks": [-1]}]}, r"incidents\[0\].ranks\[0\]: expected a rank"),
        ({"incidents": [{"opened_at_s": "now"}]}, r"incidents\[0\].opened_at_s: expected a number"),
        ({"step_time": {"ranks": [{"hostname": 1}]}}, r"step_time.ranks\[0\].hostname"),
    ],
)
def test_a_malformed_summary_names_the_file_field_and_value(tmp_path, doc, named):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=named) as err:
        read_run_culprits(path)
    assert str(err.value).startswith(f"{path}: ")


def test_files_that_are_not_json_or_too_deep_are_refused(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("{" * 100)
    with pytest.raises(ArtifactError, match="nested more than"):
        read_run_culprits(path)
    path.write_text("not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_run_culprits(path)


def test_only_critical_incidents_of_culprit_classes_count():
    summary = {
        "run": {"run_id": "r", "attempt": 0},
        "incidents": [
            {
                "class": "step_time_straggler",
                "severity": "warning",
                "ranks": [1],
                "hostnames": ["node-a"],
            },
            {
                "class": "job_slowdown",
                "severity": "critical",
                "ranks": [1],
                "hostnames": ["node-a"],
            },
            {
                "class": "localized_data_path_slowdown",
                "severity": "critical",
                "ranks": [9],
                "hostnames": ["Node-B"],
                "opened_at_s": 5.0,
            },
        ],
    }
    culprits = run_culprits(summary)
    assert culprits.hosts == {"node-b": ("localized_data_path_slowdown",)}
    assert culprits.ranks == {"node-b": (9,)}
    assert culprits.last_seen_s == {"node-b": 5.0}


def test_no_earlier_attempt_no_lines():
    current = RunCulprits("r", 0, {}, {}, {}, ())
    assert earlier_attempts_lines(current, []) == []
    assert earlier_attempts_lines(current, [RunCulprits("r", 1, {}, {}, {}, ())]) == []
