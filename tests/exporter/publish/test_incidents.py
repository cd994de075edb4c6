"""Incidents: k-of-n opening, m-clean closing, identities, events (``publish/incidents.py``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.step_time import diagnose_means
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.events import (
    event_attributes,
    event_json,
    event_log_record,
    event_message,
)
from rankwatch.exporter.publish.incidents import (
    CLOSED_RUN_ENDED,
    IncidentEvent,
    IncidentTracker,
    signals_from_report,
)
from tests.publish_reports import BALANCED_MS, normal_reports, step_report, window


def straggling(i: int, culprit: int = 2, **kw):
    return window(i, n=4, step_time=step_report(4, culprit=culprit, **kw))


def clean(i: int):
    return window(i, n=4, step_time=step_report(4, culprit=None))


def feed(tracker: IncidentTracker, pattern: str, culprit: int = 2) -> list[list[IncidentEvent]]:
    """Feed windows: 'S' straggler, '.' clean, '-' a window without a step-time report."""
    out = []
    for i, c in enumerate(pattern):
        if c == "S":
            report = straggling(i, culprit)
        elif c == ".":
            report = clean(i)
        else:
            report = window(i, n=4)
        out.append(tracker.update(report))
    return out


def actions(events: list[list[IncidentEvent]]) -> list[str]:
    return ["".join(e.action[0] for e in w) or "_" for w in events]


def test_defaults_come_from_the_config():
    t = IncidentTracker.from_config(RankwatchConfig())
    assert (t.open_k, t.open_n, t.close_m) == (2, 3, 3)


def test_a_single_noisy_window_does_not_open():
    t = IncidentTracker(2, 3, 3)
    assert actions(feed(t, "S...S...S")) == ["_"] * 9
    assert t.snapshot().open == ()


def test_opens_on_the_kth_agreeing_window_of_the_last_n():
    t = IncidentTracker(2, 3, 3)
    # S . S : 2 of the last 3 at the third window
    assert actions(feed(t, "S.S")) == ["_", "_", "o"]
    t = IncidentTracker(2, 3, 3)
    # S . . S: only 1 of the last 3 at the fourth window, 2 of 3 at the fifth
    assert actions(feed(t, "S..SS")) == ["_", "_", "_", "_", "o"]


def test_closes_after_m_clean_windows_and_a_noisy_window_does_not_flap():
    t = IncidentTracker(2, 3, 3)
    got = actions(feed(t, "SS..S...."))
    #                    0123456789
    assert got == ["_", "o", "_", "_", "_", "_", "_", "c", "_"]
    events = [e for w in feed(IncidentTracker(2, 3, 3), "SS...") for e in w]
    assert [e.action for e in events] == ["open", "close"]
    assert events[0].incident.incident_id == events[1].incident.incident_id


def test_windows_without_the_engine_are_not_clean_windows():
    t = IncidentTracker(2, 3, 3)
    got = actions(feed(t, "SS------.--..--"))
    assert got.count("c") == 1 and got.index("c") == 12
    # and they do not count towards opening either: S - - S is 2 of the last 3 step windows
    t = IncidentTracker(2, 3, 3)
    assert actions(feed(t, "S--S")) == ["_", "_", "_", "o"]


def test_summary_window_is_ignored():
    t = IncidentTracker(1, 1, 1)
    summary = window(0, n=4, step_time=step_report(4, culprit=2), window_kind="summary")
    assert t.update(summary) == []
    assert t.tracked == 0


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4).flatmap(lambda n: st.tuples(st.integers(1, n), st.just(n))),
    st.integers(1, 4),
    st.lists(st.booleans(), max_size=30),
)
def test_matches_a_reference_model(kn, m, seen):
    k, n = kn
    t = IncidentTracker(k, n, max(m, 1))
    history: list[bool] = []
    is_open, clean_run = False, 0
    for i, present in enumerate(seen):
        report = straggling(i) if present else clean(i)
        got = [e.action for e in t.update(report)]
        history.append(present)
        want: list[str] = []
        if is_open:
            clean_run = 0 if present else clean_run + 1
            if clean_run >= m:
                want, is_open, history = ["close"], False, []
        elif present and sum(history[-n:]) >= k:
            want, is_open, clean_run = ["open"], True, 0
        assert got == want, (k, n, m, seen[: i + 1])


def test_straggler_identity_is_the_culprit_and_cause_follows_the_latest_window():
    t = IncidentTracker(2, 3, 3)
    t.update(straggling(0, culprit=2))
    # same culprit, attribution changes (input 15 ms: not enough to name the input)
    (opened,) = t.update(straggling(1, culprit=2, input_ms=15.0))
    assert opened.action == "open" and opened.incident.ranks == (2,)
    assert opened.incident.cls == "step_time_straggler"
    # another culprit is another incident
    t.update(straggling(2, culprit=1))
    assert [i.ranks for i in t.snapshot().open] == [(2,)]
    (second,) = t.update(straggling(3, culprit=1))
    assert second.incident.ranks == (1,)
    assert len(t.snapshot().open) == 2


def test_severity_escalates_and_opening_is_counted_by_its_severity():
    t = IncidentTracker(2, 3, 3)
    # fewer than 20 steps caps the finding at warning
    t.update(straggling(0, steps=10))
    (opened,) = t.update(straggling(1, steps=10))
    assert opened.incident.severity == "warning"
    assert t.update(straggling(2, steps=50)) == []
    (inc,) = t.snapshot().open
    assert inc.severity == "critical"
    assert dict(t.snapshot().opened_total) == {("step_time_straggler", "warning"): 1}


def test_normal_mode_incidents_keep_class_probes_and_ranks():
    reports = normal_reports(["pre_dispatch_delay", "pre_dispatch_delay", "baseline"])
    t = IncidentTracker(2, 3, 3)
    events = []
    for i, nr in enumerate(reports):
        events += t.update(window(i, n=16, normal=nr))
    opened = [e.incident for e in events if e.action == "open"]
    assert sorted(i.probe for i in opened) == ["cached_notify_dispatch", "notify_dispatch"]
    assert all(i.cls == "pre_stage_arrival_skew" and i.ranks == (9,) for i in opened)
    assert all(i.hostnames == ("node-1",) for i in opened)
    # the score of an arrival skew is the (small) Notify ratio
    assert all(i.score is not None and i.score <= 0.25 for i in opened)


def test_global_slowdown_incident_scores_its_factor():
    reports = normal_reports(["all_hca_pressure"] * 2)
    t = IncidentTracker(2, 3, 3)
    t.update(window(0, n=16, normal=reports[0]))
    (opened,) = t.update(window(1, n=16, normal=reports[1]))
    assert opened.incident.cls == "global_data_path_slowdown"
    assert opened.incident.severity == "critical"
    assert opened.incident.score is not None and opened.incident.score >= 1.3


def test_state_is_bounded():
    t = IncidentTracker(2, 3, 3, max_tracked=16)
    for i in range(200):
        # a different culprit rank every window, on a 64-rank group
        t.update(window(i, n=64, step_time=step_report(64, culprit=i % 64)))
        assert t.tracked <= 16


# --- one fault, one incident ---------------------------------------------------------------------


def _two_ranks(i: int, culprit: int | None = 1):
    """A 2-rank window; a slow input pipeline on ``culprit`` makes it an input straggler and,
    the median of two ranks being their mean, the group input-bound with only it blamed."""
    return window(i, n=2, step_time=step_report(2, culprit=culprit))


def test_a_straggler_and_the_bottleneck_it_causes_are_one_incident():
    report = _two_ranks(0)
    kinds = [(f.kind, f.severity, f.ranks) for f in report.step_time.findings]
    assert kinds == [("INPUT_STRAGGLER", "critical", (1,)), ("INPUT_BOUND", "warning", (1,))]
    (sig,) = signals_from_report(report)
    assert sig.cls == "step_time_straggler" and sig.cause == "input_straggler"
    assert [r["kind"] for r in sig.evidence["related"]] == ["INPUT_BOUND"]
    t = IncidentTracker(2, 3, 3)
    events = [e for i in range(6) for e in t.update(_two_ranks(i))]
    opened = [e for e in events if e.action == "open"]
    assert [(e.incident.cls, e.incident.severity) for e in opened] == [
        ("step_time_straggler", "critical")
    ]
    assert dict(t.snapshot().opened_total) == {("step_time_straggler", "critical"): 1}


def _input_bound_only(i: int):
    """Rank 1 spends 60 % of its step waiting for input but arrives in time: no straggler,
    INPUT_BOUND blaming rank 1 alone."""
    slow = dict(BALANCED_MS, input_wait=60.0)
    st = diagnose_means({0: dict(BALANCED_MS), 1: slow}, steps=50, strategy="ddp")
    assert [(f.kind, f.ranks) for f in st.findings] == [("INPUT_BOUND", (1,))]
    return window(i, n=2, step_time=st)


def test_a_bottleneck_of_the_culprit_alone_keeps_its_straggler_incident_open():
    t = IncidentTracker(2, 3, 2)
    assert [e.action for i in range(2) for e in t.update(_two_ranks(i))] == ["open"]
    # the straggler finding goes, rank 1 is still input-bound: same fault, same incident
    for i in range(2, 6):
        assert t.update(_input_bound_only(i)) == []
    (inc,) = t.snapshot().open
    assert inc.cls == "step_time_straggler" and inc.cause == "input_straggler"
    assert inc.evidence["related"][0]["kind"] == "INPUT_BOUND"
    (closed,) = [e for i in range(6, 8) for e in t.update(_two_ranks(i, culprit=None))]
    assert closed.action == "close" and closed.incident.incident_id == inc.incident_id


def test_a_bottleneck_without_a_straggler_is_an_incident_of_its_own():
    t = IncidentTracker(2, 3, 3)
    (opened,) = [e for i in range(2) for e in t.update(_input_bound_only(i))]
    assert (opened.incident.cls, opened.incident.cause) == ("step_time_bottleneck", "input_bound")


def test_a_bottleneck_incident_is_a_property_that_never_pages():
    t = IncidentTracker(2, 3, 3)
    (opened,) = [e for i in range(2) for e in t.update(_input_bound_only(i))]
    inc = opened.incident
    assert (inc.severity, inc.nature, inc.pages) == ("warning", "property", False)
    assert inc.evidence["pages"] is False
    attrs = event_attributes(opened)
    assert attrs["rankwatch.incident.nature"] == "property"
    assert attrs["rankwatch.incident.pages"] is False
    assert "(a property of the job, does not page)" in event_message(opened)


def test_a_critical_bottleneck_of_an_older_report_is_held_at_warning():
    # Reports replayed from an engine that still made bottlenecks critical: the incident is
    # still a warning, so rankwatch_incident_active{severity="critical"} counts faults only.
    def older(i: int):
        report = _input_bound_only(i)
        st = report.step_time
        finding = dataclasses.replace(st.findings[0], severity="critical")
        return dataclasses.replace(
            report, step_time=dataclasses.replace(st, severity="critical", findings=(finding,))
        )

    t = IncidentTracker(2, 3, 3)
    (opened,) = [e for i in range(2) for e in t.update(older(i))]
    assert (opened.incident.severity, opened.incident.pages) == ("warning", False)
    assert dict(t.snapshot().opened_total) == {("step_time_bottleneck", "warning"): 1}


def test_a_critical_straggler_pages_and_says_so():
    t = IncidentTracker(2, 3, 3)
    (opened,) = [e for i in range(2) for e in t.update(_two_ranks(i))]
    assert (opened.incident.nature, opened.incident.pages) == ("fault", True)
    assert event_attributes(opened)["rankwatch.incident.pages"] is True
    assert "pages" not in opened.incident.evidence  # the folded INPUT_BOUND leaves no trace


def test_a_bottleneck_that_blames_other_ranks_too_stays_a_second_incident():
    means = {r: dict(BALANCED_MS, input_wait=40.0) for r in range(4)}
    means[2].update(input_wait=85.0, backward=20.0, step=60.0)
    st = diagnose_means(means, steps=50, strategy="ddp")
    assert [(f.kind, f.ranks) for f in st.findings] == [
        ("INPUT_STRAGGLER", (2,)),
        ("INPUT_BOUND", (0, 1, 2, 3)),
    ]
    sigs = signals_from_report(window(0, n=4, step_time=st))
    assert sorted(s.cls for s in sigs) == ["step_time_bottleneck", "step_time_straggler"]
    assert all("related" not in s.evidence for s in sigs)


# --- closing at the end of the run --------------------------------------------------------------


def test_close_all_closes_every_open_incident_with_its_reason():
    t = IncidentTracker(2, 3, 3, group="g0", run="r0")
    feed(t, "SS")
    t.update(straggling(2, culprit=1))  # a candidate, not open: forgotten silently
    (inc,) = t.snapshot().open
    (closed,) = t.close_all(CLOSED_RUN_ENDED, 1234.5)
    assert (closed.action, closed.reason, closed.time_s) == ("close", "run ended", 1234.5)
    assert closed.incident.incident_id == inc.incident_id
    assert (closed.window_index, closed.group, closed.run) == (2, "world", "run-1")
    assert "closed (run ended)" in event_message(closed)
    assert t.snapshot().open == () and t.tracked == 0
    assert t.close_all() == []  # nothing left: nothing closes twice


def test_close_all_rejects_bad_input():
    t = IncidentTracker()
    with pytest.raises(ValueError, match="reason"):
        t.close_all("")
    with pytest.raises(TypeError, match="time_s"):
        t.close_all(CLOSED_RUN_ENDED, "now")  # type: ignore[arg-type]


def test_signals_ignore_info_findings():
    # a balanced window diagnoses COMPUTE_BOUND at severity info: no incident signal
    assert signals_from_report(clean(0)) == []


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((0, 3, 3), ValueError, "open_k"),
        ((4, 3, 3), ValueError, "open_k"),
        ((2, 3, 0), ValueError, "close_m"),
        ((2, 3.0, 3), TypeError, "open_n"),
        ((True, 3, 3), TypeError, "open_k"),
    ],
)
def test_tracker_rejects_bad_parameters(args, exc, match):
    with pytest.raises(exc, match=match):
        IncidentTracker(*args)


def test_tracker_rejects_bad_reports_and_configs():
    t = IncidentTracker()
    with pytest.raises(TypeError, match="report"):
        t.update({"window_index": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="report"):
        signals_from_report(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        IncidentTracker.from_config({"incident_open_k": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_tracked"):
        IncidentTracker(max_tracked="many")  # type: ignore[arg-type]


# --- the two written forms of an event ---------------------------------------------------------


def _opened_and_closed() -> list[IncidentEvent]:
    t = IncidentTracker(2, 3, 1, group="g0", run="r0")
    events = []
    for i, c in enumerate("SS."):
        events += t.update(straggling(i) if c == "S" else clean(i))
    return events


def test_event_json_is_one_line_with_the_incident_fields():
    opened, closed = _opened_and_closed()
    line = event_json(opened)
    assert "\n" not in line
    doc = json.loads(line)
    # one level for the whole lifecycle; how bad it is lives in incident.severity
    assert doc["event"] == "rankwatch.incident.open" and doc["level"] == "WARN"
    assert doc["incident.class"] == "step_time_straggler"
    assert doc["incident.severity"] == "critical"
    assert doc["incident.culprit_ranks"] == [2]
    assert doc["incident.hostnames"] == ["node-0"]
    assert doc["incident.cause"] == "input_straggler"
    assert doc["incident.evidence"]["victim_rank"] == 1
    assert (doc["group"], doc["run"]) == ("world", "run-1")
    closed_doc = json.loads(event_json(closed))
    assert closed_doc["event"] == "rankwatch.incident.close" and closed_doc["level"] == "WARN"
    assert closed_doc["incident.id"] == doc["incident.id"]
    assert closed_doc["incident.close_reason"] == "clean windows"
    assert "incident.close_reason" not in doc


def test_event_log_record_carries_event_name_severity_and_attributes():
    opened, closed = _opened_and_closed()
    rec = event_log_record(opened)
    assert rec.event_name == "rankwatch.incident.open"
    assert rec.severity_text == "WARN" and rec.severity_number is not None
    assert event_log_record(closed).severity_text == "WARN"
    assert rec.attributes is not None
    assert rec.attributes["rankwatch.incident.culprit_ranks"] == [2]
    assert "rank 2" in str(rec.body) and "node-0" in str(rec.body)
    assert rec.timestamp == int(opened.time_s * 1e9)
    assert event_log_record(closed).event_name == "rankwatch.incident.close"
    # both lines name the incident, so a reader can pair them; the close says why
    incident_id = opened.incident.incident_id
    assert f"incident {incident_id} opened: critical" in event_message(opened)
    assert f"incident {incident_id} closed (clean windows): critical" in event_message(closed)
    assert "run r" in event_message(opened)


def test_event_builders_reject_bad_input():
    for fn in (event_json, event_log_record, event_attributes, event_message):
        with pytest.raises(TypeError, match="event"):
            fn({"action": "open"})  # type: ignore[arg-type]
    opened, _ = _opened_and_closed()
    bad = IncidentEvent("reopen", opened.incident, 1, 0.0, "", "")
    with pytest.raises(ValueError, match="action"):
        event_json(bad)


def _node_window(i: int, slow: dict[int, float]):
    """4 ranks, two per host (node-0: 0, 1; node-1: 2, 3); the ``slow`` ranks spend extra ms in
    forward and the others wait for them in backward. The fault's unit is named as the
    aggregator names it."""
    from rankwatch.diagnosis.step_time import name_fault_unit
    from tests.publish_reports import hostname_of, rank_infos

    most = max(slow.values(), default=0.0)
    means = {
        r: dict(
            BALANCED_MS,
            forward=30.0 + slow.get(r, 0.0),
            backward=60.0 + most - slow.get(r, 0.0),
            step=100.0 + most,
        )
        for r in range(4)
    }
    st = name_fault_unit(diagnose_means(means, steps=50), {r: hostname_of(r, 2) for r in range(4)})
    return window(i, n=4, step_time=st, ranks=rank_infos(4, 2))


def test_a_slow_node_is_one_incident_whichever_of_its_ranks_is_last():
    t = IncidentTracker(2, 3, 3)
    events = []
    for i in range(8):  # the last rank of node-1 alternates, as it does on a real node
        last, other = (2, 3) if i % 2 else (3, 2)
        events += t.update(_node_window(i, {last: 40.0, other: 38.0}))
    (opened,) = events
    inc = opened.incident
    assert (inc.cls, inc.ranks, inc.hostnames) == ("step_time_slow_node", (2, 3), ("node-1",))
    assert inc.severity == "critical" and inc.pages and inc.cause == "compute_straggler"
    assert inc.evidence["slow_host"] == "node-1"
    assert "ranks 2,3 (all of node-1)" in event_message(opened)
    # A window where only rank 3 crossed the line supports the node's incident.
    for i in range(8, 12):
        assert t.update(_node_window(i, {3: 40.0, 2: 10.0})) == []
    assert [i.incident_id for i in t.snapshot().open] == [inc.incident_id]
    (closed,) = [e for i in range(12, 15) for e in t.update(_node_window(i, {}))]
    assert closed.action == "close" and closed.incident.incident_id == inc.incident_id


def test_a_lone_slow_gpu_on_a_node_stays_a_rank_incident():
    t = IncidentTracker(2, 3, 3)
    (opened,) = [e for i in range(4) for e in t.update(_node_window(i, {3: 40.0}))]
    assert (opened.incident.cls, opened.incident.ranks) == ("step_time_straggler", (3,))


def test_a_slow_node_verdict_names_the_node_and_its_ranks():
    from rankwatch.exporter.publish.verdicts import step_verdict

    report = _node_window(0, {2: 40.0, 3: 38.0})
    verdict = step_verdict(report.step_time, report)
    assert verdict.what.startswith("node node-1 is slow: ranks 2, 3 (all of node-1)")
    assert verdict.ranks == (2, 3) and "Drain or inspect node node-1" in verdict.action
