"""One publishing hub for every collector of a process: groups and engines side by side.

The step-time collector (group ``world``) and the DeepEP collector (group ``ep``) hand their
reports to the same hub; ``/metrics`` must serve both at once, each group under its own label,
with incidents tracked per group. Reports come from the real engines (``tests/publish_reports``),
scrapes go over real HTTP. The OTLP side of the same mix is in the golden test of
``tests/exporter/publish/test_otlp.py``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families as parse_text

from rankwatch.diagnosis.report import RankInfo
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import MAX_GROUPS, PublisherHub
from rankwatch.exporter.publish.samples import Sample
from tests.exporter.publish.test_otlp import OTEL_VARS
from tests.publish_reports import (
    T0,
    deepep_window,
    low_latency,
    normal_reports,
    rank_infos,
    step_report,
    step_window,
    window,
)
from tests.servers import http_get

NOW = T0 + 1000.0
STEP_FAMILIES = (
    "rankwatch_phase_seconds",
    "rankwatch_diagnosis_info",
    "rankwatch_window_steps",
    "rankwatch_step_outlier_steps",
)
DEEPEP_FAMILIES = (
    "rankwatch_deepep_notify_ratio",
    "rankwatch_deepep_probe_anomalous",
    "rankwatch_deepep_ll_row_ratio",
    "rankwatch_deepep_ll_point_ratio",
)


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def make_hub(**config) -> PublisherHub:
    config.setdefault("metrics_port", 0)
    return PublisherHub(
        RankwatchConfig(run_id="run-1", **config), otlp=False, clock=lambda: NOW, hostname="t-0"
    )


def publish(hub: PublisherHub, *reports) -> None:
    for report in reports:
        hub.publish(report)
        # one at a time: the queue may drop reports of a burst, and these tests count windows
        assert hub.flush(20)


def scrape(hub: PublisherHub) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a real HTTP scrape, duplicates kept."""
    assert hub.metrics_url is not None
    out = []
    for fam in parse_text(http_get(hub.metrics_url).decode()):
        for s in fam.samples:
            out.append((s.name, dict(s.labels), float(s.value)))
    return out


def assert_no_duplicate_series(samples: list[Sample], scraped) -> None:
    twice = [k for k, n in Counter((s.name, s.labels) for s in samples).items() if n > 1]
    assert twice == []
    lines = Counter((name, tuple(sorted(labels.items()))) for name, labels, _ in scraped)
    assert [k for k, n in lines.items() if n > 1] == []


def groups_of(scraped, name: str) -> set[str]:
    return {labels["group"] for n, labels, _ in scraped if n == name}


def values(scraped, name: str, **match: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(labels.items())): v
        for n, labels, v in scraped
        if n == name and all(labels.get(k) == want for k, want in match.items())
    }


def test_alternating_step_time_and_deepep_reports_are_served_together():
    hub = make_hub()
    normals = normal_reports(["baseline", "pre_dispatch_delay", "single_hca_pressure"])
    try:
        for i, nr in enumerate(normals):
            publish(hub, step_window(i, n=4, culprit=2))
            if i > 0:  # the step-time report is the newest: DeepEP must still be there
                got = scrape(hub)
                for name in DEEPEP_FAMILIES:
                    assert groups_of(got, name) == {"ep"}, name
            publish(hub, deepep_window(i, nr, low_latency_results=low_latency(16)))
            got = scrape(hub)  # the DeepEP report is the newest: step time must still be there
            for name in STEP_FAMILIES:
                assert groups_of(got, name) == {"world"}, name
            for name in DEEPEP_FAMILIES:
                assert groups_of(got, name) == {"ep"}, name
            assert_no_duplicate_series(hub.state.samples(), got)
        (info,) = values(got, "rankwatch_diagnosis_info", group="world")
        assert dict(info)["culprit_rank"] == "2"
        ranks = {dict(k)["rank"] for k in values(got, "rankwatch_phase_seconds")}
        assert ranks == {"0", "1", "2", "3"}
        # each group has its own window, age and size
        index = values(got, "rankwatch_window_index")
        assert sorted((dict(k)["group"], v) for k, v in index.items()) == [("ep", 2), ("world", 2)]
        sizes = {dict(k)["group"]: v for k, v in values(got, "rankwatch_group_ranks").items()}
        assert sizes == {"world": 4, "ep": 16}
        assert groups_of(got, "rankwatch_window_age_seconds") == {"world", "ep"}
        engines = {
            (dict(k)["group"], dict(k)["engine"])
            for k in values(got, "rankwatch_diagnosis_duration_seconds")
        }
        assert engines == {("world", "step_time"), ("ep", "normal"), ("ep", "low_latency")}
        assert hub.state.groups == ("ep", "world")
        assert hub.state.report is not None and hub.state.report.group == "ep"
        assert set(hub.state.reports) == {"ep", "world"}
    finally:
        hub.close(5)


def test_engines_of_one_group_merge_and_each_replaces_only_its_own_series():
    hub = make_hub(metrics_enabled=False)
    # DeepEP members are global ranks 16..31; the step-time collector's are 0..3
    ep_ranks = rank_infos(32)[16:]
    (nr,) = normal_reports(["pre_combine_delay"])
    try:
        publish(
            hub,
            step_window(0, n=4, culprit=3, group=""),  # no group of its own: the config's
            deepep_window(5, nr, group="world", ranks=ep_ranks, missing=(17,)),
            step_window(1, n=4, culprit=3),
        )
        (merged,) = hub.state.reports.values()
        newest = hub.state.report
        assert newest is not None and newest.step_time is not None
        assert merged.group == "world" and merged.window_index == 1
        assert merged.step_time is newest.step_time and merged.normal is nr
        assert merged.ranks == newest.ranks and merged.missing_ranks == ()
        assert merged.diagnosis_seconds == {"step_time": 0.0012, "normal": 0.0034}
        before = hub.state.samples()
        notify = {s for s in before if s.name == "rankwatch_deepep_notify_ratio"}
        # the normal-mode series keep the DeepEP report's global ranks
        assert {s.label_dict()["rank"] for s in notify} == {str(r) for r in range(16, 32)}
        # rank 3 leaves the step-time collector: its series go, DeepEP's stay as they were
        publish(
            hub,
            window(
                2,
                step_time=step_report(culprit=None, ranks=range(3)),
                ranks=rank_infos(3),
                diagnosis_seconds={"step_time": 0.002},
            ),
        )
        after = hub.state.samples()
        phases = {s.label_dict()["rank"] for s in after if s.name == "rankwatch_phase_seconds"}
        assert phases == {"0", "1", "2"}
        assert {s for s in after if s.name == "rankwatch_deepep_notify_ratio"} == notify
        (info,) = [s for s in after if s.name == "rankwatch_diagnosis_info"]
        assert info.label_dict()["culprit_rank"] == ""  # the new step-time verdict
        seconds = {
            s.label_dict()["engine"]: s.value
            for s in after
            if s.name == "rankwatch_diagnosis_duration_seconds"
        }
        assert seconds == {"step_time": 0.002, "normal": 0.0034}
        assert {s.labels[1] for s in after} == {"world"}
        # a rejected normal-mode window is the newest normal-mode outcome: its series go
        publish(hub, deepep_window(6, None, group="world", normal_invalid_reason="counter_reset"))
        gone = hub.state.samples()
        assert not any(s.name.startswith("rankwatch_deepep_notify") for s in gone)
        assert any(s.name == "rankwatch_phase_seconds" for s in gone)
        assert hub.state.reports["world"].normal_invalid_reason == "counter_reset"
    finally:
        hub.close(5)


def step_group(index: int, group: str, ranks: range, culprit: int | None):
    return window(
        index,
        step_time=step_report(culprit=culprit, ranks=ranks),
        ranks=tuple(RankInfo(r, f"node-{r // 8}", r % 8) for r in ranks),
        group=group,
        diagnosis_seconds={"step_time": 0.001},
    )


def test_groups_with_overlapping_ranks_never_share_or_duplicate_a_series():
    hub = make_hub()
    members = {"dp0": range(4), "dp1": range(2, 6), "world": range(8)}
    culprits = {"dp0": 2, "dp1": None, "world": 5}
    (nr,) = normal_reports(["single_hca_pressure"], ep=8, rpn=4)
    try:
        for i in range(3):
            for group, ranks in members.items():
                publish(hub, step_group(i, group, ranks, culprits[group]))
                assert_no_duplicate_series(hub.state.samples(), scrape(hub))
            # DeepEP over the same eight ranks, in a group of its own and then inside "world"
            for group in ("ep", "world"):
                publish(hub, deepep_window(i, nr, ep=8, group=group, low_latency_results=None))
                assert_no_duplicate_series(hub.state.samples(), scrape(hub))
        got = scrape(hub)
        # every per-rank sample belongs to a rank of its own group
        for name, labels, _ in got:
            if "rank" in labels and labels["group"] in members:
                assert int(labels["rank"]) in members[labels["group"]], (name, labels)
        # ranks 2 and 3 are in both DP groups, each with that group's own values
        wait = {
            (dict(k)["group"], dict(k)["rank"]): v
            for k, v in values(got, "rankwatch_phase_seconds", phase="input_wait").items()
        }
        assert wait[("dp0", "2")] == pytest.approx(0.045)  # dp0's input straggler
        assert wait[("dp1", "2")] == pytest.approx(0.005)  # balanced in dp1
        assert wait[("dp0", "3")] == wait[("dp1", "3")] == pytest.approx(0.005)
        culprit = {
            dict(k)["group"]: dict(k)["culprit_rank"]
            for k in values(got, "rankwatch_diagnosis_info")
        }
        assert culprit == {"dp0": "2", "dp1": "", "world": "5"}
        assert groups_of(got, "rankwatch_deepep_notify_ratio") == {"ep", "world"}
        # the exporter's own series exist once, under the configured identity
        (up,) = values(got, "rankwatch_exporter_up")
        assert dict(up)["group"] == "world" and dict(up)["run"] == "run-1"
        assert len(values(got, "rankwatch_exporter_start_time_seconds")) == 1
    finally:
        hub.close(5)


def incident_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "rankwatch.incidents"]


def test_incidents_of_groups_with_a_shared_rank_open_and_close_independently(caplog):
    caplog.set_level(logging.INFO, logger="rankwatch.incidents")
    hub = make_hub()  # k=2 of n=3 to open, m=3 clean windows to close
    try:
        # rank 2 straggles in dp0 (S . S: two of three dp0 windows), then recovers; dp1, which
        # also holds rank 2, stays balanced and publishes two windows for each of dp0's.
        pattern = "S.S...."
        for i, c in enumerate(pattern):
            publish(hub, step_group(i, "dp0", range(4), 2 if c == "S" else None))
            for j in range(2):
                publish(hub, step_group(2 * i + j, "dp1", range(2, 6), None))
            events = [(d["event"], d["group"], d["window.index"]) for d in incident_lines(caplog)]
            active = values(scrape(hub), "rankwatch_incident_active")
            if i == 2:  # opened by dp0's own windows, whatever dp1 said in between
                assert events == [("rankwatch.incident.open", "dp0", 2)]
                ((labels, _),) = active.items()
                assert dict(labels)["group"] == "dp0" and dict(labels)["culprit_rank"] == "2"
            if i in (3, 4):  # one or two clean dp0 windows (and four dp1 ones) do not close it
                assert len(events) == 1 and len(active) == 1
        assert [(d["event"], d["group"], d["window.index"]) for d in incident_lines(caplog)] == [
            ("rankwatch.incident.open", "dp0", 2),
            ("rankwatch.incident.close", "dp0", 5),  # the third clean dp0 window
        ]
        assert values(scrape(hub), "rankwatch_incident_active") == {}
        totals = {
            dict(k)["group"]: v
            for k, v in values(
                scrape(hub), "rankwatch_incidents_total", **{"class": "step_time_straggler"}
            ).items()
            if v
        }
        assert totals == {"dp0": 1}
        assert set(hub.trackers) == {"dp0", "dp1"} and hub.trackers["dp1"].tracked == 0
    finally:
        hub.close(5)


def test_step_time_and_deepep_incidents_keep_their_groups(caplog):
    caplog.set_level(logging.INFO, logger="rankwatch.incidents")
    hub = make_hub()
    normals = normal_reports(["pre_combine_delay"] * 3 + ["baseline"] * 3)
    try:
        for i, nr in enumerate(normals):
            publish(hub, step_window(i, n=16, culprit=11), deepep_window(i, nr))
        active = {
            (dict(k)["group"], dict(k)["class"])
            for k in values(scrape(hub), "rankwatch_incident_active")
        }
        # the DeepEP incident closed after three baseline ep windows; the straggler never stopped
        assert active == {("world", "step_time_straggler")}
        lines = [(d["event"], d["group"], d["incident.class"]) for d in incident_lines(caplog)]
        assert lines == [
            ("rankwatch.incident.open", "world", "step_time_straggler"),
            ("rankwatch.incident.open", "ep", "pre_stage_arrival_skew"),
            ("rankwatch.incident.close", "ep", "pre_stage_arrival_skew"),
        ]
        by_group = hub.state.incidents_by_group
        assert [i.cls for i in by_group["world"].open] == ["step_time_straggler"]
        assert by_group["ep"].open == () and by_group["ep"].opened_total
        assert hub.state.incidents == by_group["ep"]  # the newest report's group
    finally:
        hub.close(5)


def test_a_summary_window_replaces_only_its_own_group_and_opens_nothing():
    hub = make_hub(metrics_enabled=False)
    (nr,) = normal_reports(["pre_dispatch_delay"])
    try:
        publish(hub, step_window(0, culprit=1), step_window(1, culprit=1), deepep_window(0, nr))
        assert [i.cls for i in hub.state.incidents_by_group["world"].open] == [
            "step_time_straggler"
        ]
        ep_before = [s for s in hub.state.samples() if s.labels[1] == "ep"]
        publish(hub, step_window(2, culprit=None, window_kind="summary"))
        world = hub.state.reports["world"]
        assert world.window_kind == "summary" and world.window_index == 2
        info = [s for s in hub.state.samples() if s.name == "rankwatch_diagnosis_info"]
        assert [s.label_dict()["culprit_rank"] for s in info] == [""]
        # the incident trackers ignore the summary: the straggler stays open
        assert len(hub.state.incidents_by_group["world"].open) == 1
        assert [s for s in hub.state.samples() if s.labels[1] == "ep"] == ep_before
    finally:
        hub.close(5)


def test_rejected_deepep_windows_are_counted_in_their_group():
    hub = make_hub()
    try:
        hub.count_collection_error("gather_timeout")
        publish(
            hub,
            step_window(0),
            deepep_window(0, None, normal_invalid_reason="counter_reset"),
            deepep_window(
                1, None, normal_invalid_reason="counter_reset", low_latency_invalid_reason="shape"
            ),
        )
        got = scrape(hub)
        invalid = {
            (dict(k)["group"], dict(k)["reason"]): v
            for k, v in values(got, "rankwatch_deepep_window_invalid_total").items()
        }
        assert invalid == {("ep", "counter_reset"): 2, ("ep", "shape"): 1}
        (errors,) = values(got, "rankwatch_collection_errors_total").items()
        assert dict(errors[0])["group"] == "world" and errors[1] == 1
    finally:
        hub.close(5)


def test_groups_are_bounded_and_their_trackers_go_with_them():
    hub = make_hub(metrics_enabled=False, incident_open_k=1, incident_open_n=1)
    try:
        publish(hub, step_window(0, culprit=1, group="g0"))
        for g in range(1, MAX_GROUPS):
            publish(hub, step_window(g, culprit=None, group=f"g{g}"))
        assert len(hub.state.groups) == MAX_GROUPS
        publish(hub, step_window(100, culprit=1, group="g0"))  # g0 published again: kept
        publish(hub, step_window(101, culprit=None, group="new-a"))
        publish(hub, step_window(102, culprit=None, group="new-b"))
        groups = set(hub.state.groups)
        assert len(groups) == MAX_GROUPS
        assert "g0" in groups and {"new-a", "new-b"} <= groups
        assert not {"g1", "g2"} & groups  # the two that published least recently
        assert set(hub.trackers) == groups
        assert {s.labels[1] for s in hub.state.samples()} == groups | {"world"}
        assert len(hub.state.incidents_by_group["g0"].open) == 1
    finally:
        hub.close(5)
