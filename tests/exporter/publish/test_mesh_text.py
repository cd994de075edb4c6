"""With a mesh, the verdict, the one-line description and the incident text name the culprit's
mesh position and the ranks it was compared with (or the slow pipeline replica)."""

from __future__ import annotations

from rankwatch.diagnosis.step_time import StepTimeReport, diagnose_means
from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.exporter.publish.events import event_message
from rankwatch.exporter.publish.incidents import IncidentTracker
from rankwatch.exporter.publish.verdicts import describe_step, step_verdict
from tests.diagnosis.step_time.test_step_time_mesh import sync_means
from tests.publish_reports import window

PP_DP = MeshLayout.from_sizes({"pp": 2, "dp": 2}, [0, 1, 2, 3])


def _report(work_ms: dict[int, float], mesh: MeshLayout | None = PP_DP) -> StepTimeReport:
    return diagnose_means(sync_means(work_ms), steps=100, mesh=mesh)


def test_the_verdict_names_the_position_and_the_group_compared() -> None:
    report = _report({0: 60.0, 1: 60.0, 2: 30.0, 3: 55.0})
    verdict = step_verdict(report)
    assert verdict.rank == 3 and verdict.ranks == (3,)
    assert verdict.what.startswith("rank 3 (pp 1, dp 1) is ")
    assert "compared within pipeline stage 1 (ranks 2, 3)" in verdict.why
    assert "culprit=3 victim=2 (pp 1, dp 1)" in describe_step(report)


def test_a_slow_replica_is_the_verdict_s_subject() -> None:
    report = _report({0: 60.0, 1: 80.0, 2: 30.0, 3: 50.0})
    verdict = step_verdict(report)
    assert verdict.what == "pipeline replica dp 1 (ranks 1, 3) is slow as a whole"
    assert verdict.ranks == (1, 3)
    assert "cannot be told" in verdict.why


def test_without_a_mesh_the_words_are_those_of_before() -> None:
    verdict = step_verdict(_report({0: 50.0, 1: 50.0, 2: 50.0, 3: 70.0}, mesh=None))
    assert verdict.what.startswith("rank 3 is ") and "compared within" not in verdict.why


def test_the_incident_text_names_the_position() -> None:
    tracker = IncidentTracker(2, 3, 1, group="world", run="r")
    slow = _report({0: 60.0, 1: 60.0, 2: 30.0, 3: 55.0})
    events = []
    for i in range(3):
        events += tracker.update(window(i, step_time=slow))
    opened = [e for e in events if e.action == "open"]
    assert opened, events
    text = event_message(opened[0])
    assert "rank 3" in text and "(pp 1, dp 1, within pipeline stage 1 (ranks 2, 3))" in text
    evidence = opened[0].incident.evidence
    assert evidence["culprit_position"] == "rank 3: pp 1, dp 1"
