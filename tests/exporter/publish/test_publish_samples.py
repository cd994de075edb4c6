"""The catalogue and the samples both publishing paths read (``exporter/publish/samples.py``)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.report import RankInfo
from rankwatch.diagnosis.step_time import diagnose_means
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.identity import current_gpu, gpu_labels
from rankwatch.exporter.publish.catalogue import CATALOGUE, COMMON_LABELS, by_name
from rankwatch.exporter.publish.incidents import IncidentSnapshot, IncidentTracker
from rankwatch.exporter.publish.samples import (
    ExporterHealth,
    Sample,
    build_samples,
    clock_samples,
    report_samples,
    state_samples,
)
from tests.publish_reports import (
    BALANCED_MS,
    T0,
    full_report,
    normal_reports,
    rank_infos,
    step_report,
    window,
)

CONFIG = RankwatchConfig(run_id="run-1")
HEALTH = ExporterHealth(started_at_s=T0, export_failures={"otlp_metrics": 2})


def by_family(samples: list[Sample]) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.name, []).append(s)
    return out


def check_well_formed(samples: list[Sample]) -> None:
    seen = set()
    for s in samples:
        spec = by_name(s.name)
        assert len(s.labels) == len(spec.all_labels), s
        assert all(isinstance(v, str) for v in s.labels), s
        assert isinstance(s.value, float) and math.isfinite(s.value), s
        key = (s.name, s.labels)
        assert key not in seen, f"duplicate series {key}"
        seen.add(key)


# --- the catalogue ------------------------------------------------------------------------------


def test_catalogue_follows_the_naming_conventions():
    names = [s.name for s in CATALOGUE]
    assert len(names) == len(set(names))
    for spec in CATALOGUE:
        assert re.fullmatch(r"rankwatch_[a-z0-9_]+", spec.name), spec.name
        assert spec.type in ("gauge", "counter", "info")
        assert spec.name.endswith("_total") == (spec.type == "counter"), spec.name
        assert spec.name.endswith("_info") == (spec.type == "info"), spec.name
        # unit "1" is reserved for _ratio: OTLP->Prometheus naming appends _ratio to unit-1 gauges
        assert (spec.unit == "1") == spec.name.endswith("_ratio"), spec.name
        # A counter of seconds ends in _seconds_total (Prometheus' convention).
        assert (spec.unit == "s") == spec.name.removesuffix("_total").endswith("_seconds"), (
            spec.name
        )
        assert spec.unit in ("", "1", "s")
        labels = spec.all_labels
        assert labels[: len(COMMON_LABELS)] == COMMON_LABELS
        assert len(labels) == len(set(labels)), spec.name
        assert not {"job", "instance", "type", "le", "quantile"} & set(labels), spec.name
        assert spec.help.strip()


def _translate(otel_name: str, unit: str, counter: bool) -> str:
    """The OTLP -> Prometheus name translation as the specification states it."""
    tokens = [t for t in re.split(r"[._]", otel_name) if t]
    word = {"s": "seconds", "1": ""}.get(unit, unit)
    if word and word not in tokens:
        tokens.append(word)
    if counter:
        tokens = [t for t in tokens if t != "total"] + ["total"]
    elif unit == "1":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    return "_".join(tokens)


def test_otel_names_translate_back_to_the_prometheus_names():
    for spec in CATALOGUE:
        assert "_" not in spec.otel_name
        got = _translate(spec.otel_name, spec.otel_unit, spec.type == "counter")
        assert got == spec.name, (spec.otel_name, spec.otel_unit)


def test_by_name_unknown_raises_key_error():
    with pytest.raises(KeyError):
        by_name("rankwatch_nope")


# --- samples ------------------------------------------------------------------------------------


def test_straggler_report_samples():
    report = window(3, n=4, step_time=step_report(4, culprit=2))
    samples = build_samples(report, IncidentSnapshot(), HEALTH, CONFIG, now=report.created_at_s + 2)
    check_well_formed(samples)
    fam = by_family(samples)
    st_report = report.step_time
    assert st_report is not None and st_report.straggler is not None
    assert fam["rankwatch_straggler_score"][0].value == st_report.straggler.score
    (info,) = fam["rankwatch_diagnosis_info"]
    labels = info.label_dict()
    assert labels["culprit_rank"] == "2" and labels["kind"] == "INPUT_STRAGGLER"
    assert labels["severity"] == "critical" and labels["run"] == "run-1"
    assert fam["rankwatch_diagnosis_severity"][0].value == 3.0
    phases = {
        (s.label_dict()["rank"], s.label_dict()["phase"]): s.value
        for s in fam["rankwatch_phase_seconds"]
    }
    assert phases[("2", "input_wait")] == pytest.approx(0.045)
    assert phases[("0", "backward")] == pytest.approx(0.060)
    assert fam["rankwatch_window_age_seconds"][0].value == pytest.approx(2.0)
    assert {
        s.label_dict()["exporter"]: s.value for s in fam["rankwatch_export_failures_total"]
    } == {"otlp_metrics": 2.0}
    cov = {s.label_dict()["component"]: s.value for s in fam["rankwatch_cause_coverage_ratio"]}
    assert cov == st_report.straggler.component_coverage


def test_hostnames_are_lowercase_and_ranks_carry_identity():
    ranks = rank_infos(4, ranks_per_host=2, hostnames={1: "GPU-Node-A"})
    report = window(0, n=4, step_time=step_report(4, culprit=1), ranks=ranks)
    samples = report_samples(report, CONFIG)
    rank1 = [s.label_dict() for s in samples if s.name == "rankwatch_phase_seconds"]
    rank1 = [d for d in rank1 if d["rank"] == "1"]
    assert rank1 and all(d["hostname"] == "gpu-node-a" and d["local_rank"] == "1" for d in rank1)


def test_ranks_on_cuda_carry_dcgm_exporters_gpu_and_uuid_labels():
    ranks = tuple(
        RankInfo(r, "node-a", r, gpu=str(r + 4), gpu_uuid=f"GPU-{r:08d}-uuid")
        if r < 2
        else RankInfo(r, "node-b", r - 2)  # a CPU rank: no GPU labels
        for r in range(3)
    )
    report = window(0, n=3, step_time=step_report(3, culprit=1), ranks=ranks)
    labels = {
        s.label_dict()["rank"]: (s.label_dict()["gpu"], s.label_dict()["UUID"])
        for s in report_samples(report, CONFIG)
        if s.name == "rankwatch_phase_seconds"
    }
    assert labels == {
        "0": ("4", "GPU-00000000-uuid"),
        "1": ("5", "GPU-00000001-uuid"),
        "2": ("", ""),
    }


def test_gpu_labels_follow_dcgm_exporter():
    # the machine's index when CUDA_VISIBLE_DEVICES lists indices; the UUID as nvidia-smi prints
    assert gpu_labels(1, "5f0c-11", "6,7") == ("7", "GPU-5f0c-11")
    assert gpu_labels(0, "GPU-5f0c-11", None) == ("0", "GPU-5f0c-11")
    assert gpu_labels(0, "MIG-aa", "GPU-5f0c-11") == ("0", "MIG-aa")  # UUIDs listed: no mapping
    assert gpu_labels(3, "", "0,1") == ("3", "")
    assert current_gpu() == ("", "")  # this machine has no GPU


def test_unmeasured_phase_is_absent_not_zero():
    means = {r: dict(BALANCED_MS) for r in range(3)}
    means[1]["h2d"] = None  # type: ignore[assignment]
    means[2]["h2d"] = 0.0  # measured zero
    report = window(0, n=3, step_time=diagnose_means(means, steps=30))
    got = {
        (s.label_dict()["rank"], s.label_dict()["phase"]): s.value
        for s in report_samples(report, CONFIG)
        if s.name == "rankwatch_phase_seconds"
    }
    assert ("1", "h2d") not in got
    assert got[("2", "h2d")] == 0.0


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 7),
        st.fixed_dictionaries(
            {
                k: st.one_of(
                    st.none(),
                    st.floats(0, 500, allow_nan=False),
                )
                for k in BALANCED_MS
            }
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 200),
)
def test_samples_never_nan_and_never_duplicated(means, steps):
    report = window(1, n=8, step_time=diagnose_means(means, steps=steps))
    samples = build_samples(report, IncidentSnapshot(), HEALTH, CONFIG, now=T0)
    check_well_formed(samples)
    ranks = {s.label_dict()["rank"] for s in samples if s.name == "rankwatch_phase_seconds"}
    assert ranks <= {str(r) for r in means}


def test_full_ep16_report_publishes_every_matrix_cell_within_the_budget():
    report = full_report(ep=16)
    samples = report_samples(report, CONFIG)
    check_well_formed(samples)
    fam = by_family(samples)
    normal = report.normal
    assert normal is not None
    cells = fam["rankwatch_deepep_completion_cycles_per_sample"]
    for probe in ("dispatch_final", "combine_logical_recv", "dispatch_rdma_recv"):
        cost = normal.probes[probe].cost_per_sample
        assert cost is not None
        mine = {
            (int(s.label_dict()["src_rank"]), int(s.label_dict()["dst_rank"])): s.value
            for s in cells
            if s.label_dict()["probe"] == probe
        }
        # every finite cell, each exactly; NaN cells (no samples) absent
        assert len(mine) == int(np.isfinite(cost).sum())
        for (i, j), v in mine.items():
            assert v == cost[i, j]
    notify = fam["rankwatch_deepep_notify_ratio"]
    assert len(notify) == 3 * 16
    residual = fam["rankwatch_deepep_residual_slowdown_factor"]
    assert {s.label_dict()["scope"] for s in residual} <= {
        "row",
        "column",
        "point",
        "block",
        "src_gateway",
        "dst_gateway",
        "edge",
    }
    # low latency: slow peer 5 is a column, cell (1, 2) a point: src = peer 2, dst = waiter 1
    ll_cols = {
        (s.label_dict()["phase"], s.label_dict()["rank"]): s.value
        for s in fam["rankwatch_deepep_ll_column_ratio"]
    }
    assert ll_cols[("dispatch", "5")] > 3.0
    points = [s.label_dict() for s in fam["rankwatch_deepep_ll_point_ratio"]]
    assert {(p["phase"], p["src_rank"], p["dst_rank"]) for p in points} == {
        ("dispatch", "2", "1"),
        ("combine", "2", "1"),
    }


def test_ep64_normal_report_over_the_budget_publishes_aggregates_and_flagged_cells_only():
    (normal,) = normal_reports(["single_hca_pressure"], ep=64, rpn=8)
    report = window(5, n=64, normal=normal)
    config = RankwatchConfig(cell_budget=1024)
    samples = report_samples(report, config)
    check_well_formed(samples)
    fam = by_family(samples)
    cells = fam.get("rankwatch_deepep_completion_cycles_per_sample", [])
    for probe in ("dispatch_final", "dispatch_rdma_recv", "combine_logical_recv"):
        mine = [s for s in cells if s.label_dict()["probe"] == probe]
        mask = normal.flagged_mask(probe)
        assert len(mine) == min(int(mask.sum()), 1024)
        for s in mine:
            assert mask[int(s.label_dict()["src_rank"]), int(s.label_dict()["dst_rank"])]
        rows = [s for s in fam["rankwatch_deepep_completion_row_cycles_per_sample"]]
        assert len([s for s in rows if s.label_dict()["probe"] == probe]) <= 64
    assert len(cells) <= 3 * 1024
    # rows and columns: the median of each line's finite cells
    cost = normal.probes["dispatch_final"].cost_per_sample
    assert cost is not None
    row7 = next(
        s.value
        for s in fam["rankwatch_deepep_completion_row_cycles_per_sample"]
        if s.label_dict()["probe"] == "dispatch_final" and s.label_dict()["src_rank"] == "7"
    )
    assert row7 == pytest.approx(float(np.median(cost[7][np.isfinite(cost[7])])))
    col3 = next(
        s.value
        for s in fam["rankwatch_deepep_completion_column_cycles_per_sample"]
        if s.label_dict()["probe"] == "dispatch_final" and s.label_dict()["dst_rank"] == "3"
    )
    assert col3 == pytest.approx(float(np.median(cost[:, 3][np.isfinite(cost[:, 3])])))
    # the whole report stays far below the square of the group
    assert len(samples) < 64 * 64


def test_flagged_cells_are_capped_at_the_budget_costliest_first():
    (normal,) = normal_reports(["single_hca_pressure"], ep=16)
    report = window(5, n=16, normal=normal)
    config = RankwatchConfig(cell_budget=20)  # 256 cells per probe: over the budget
    cells = [
        s
        for s in report_samples(report, config)
        if s.name == "rankwatch_deepep_completion_cycles_per_sample"
        and s.label_dict()["probe"] == "combine_logical_recv"
    ]
    mask = normal.flagged_mask("combine_logical_recv")
    assert int(mask.sum()) > 20
    assert len(cells) == 20
    cost = normal.probes["combine_logical_recv"].cost_per_sample
    assert cost is not None
    flagged_values = np.sort(cost[mask & np.isfinite(cost)])[::-1]
    assert sorted((s.value for s in cells), reverse=True) == list(flagged_values[:20])


def test_departed_rank_and_closed_incident_have_no_samples_in_the_next_state():
    first = window(0, n=4, step_time=step_report(4, culprit=3))
    tracker = IncidentTracker(1, 1, 1)
    tracker.update(first)
    before = build_samples(first, tracker.snapshot(), HEALTH, CONFIG, now=T0)
    assert any(s.name == "rankwatch_incident_active" for s in before)
    assert any(
        s.name == "rankwatch_phase_seconds" and s.label_dict()["rank"] == "3" for s in before
    )
    second = window(1, n=3, step_time=step_report(3, culprit=None), ranks=rank_infos(3))
    tracker.update(second)
    after = build_samples(second, tracker.snapshot(), HEALTH, CONFIG, now=T0)
    assert not any(
        s.name in ("rankwatch_incident_active", "rankwatch_incident_score") for s in after
    )
    assert not any(s.label_dict().get("rank") == "3" for s in after)
    totals = {
        tuple(s.labels[len(COMMON_LABELS) :]): s.value
        for s in after
        if s.name == "rankwatch_incidents_total"
    }
    assert totals[("step_time_straggler", "critical")] == 1.0


def test_no_report_yet_publishes_the_exporter_health_only():
    samples = build_samples(None, IncidentSnapshot(), HEALTH, CONFIG, now=T0)
    check_well_formed(samples)
    names = {s.name for s in samples}
    assert "rankwatch_exporter_up" in names and "rankwatch_incidents_total" in names
    assert "rankwatch_window_index" not in names and "rankwatch_window_age_seconds" not in names
    assert all(s.labels[:2] == ("run-1", "world") for s in samples)


def test_samples_are_deterministic():
    report = full_report(ep=16)
    a = build_samples(report, IncidentSnapshot(), HEALTH, CONFIG, now=T0 + 60)
    b = build_samples(report, IncidentSnapshot(), HEALTH, CONFIG, now=T0 + 60)
    assert a == b


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"report": "window"}, TypeError, "report"),
        ({"incidents": {}}, TypeError, "incidents"),
        ({"health": None}, TypeError, "health"),
        ({"config": {"cell_budget": 3}}, TypeError, "config"),
        ({"now": float("nan")}, ValueError, "now"),
        ({"now": "later"}, ValueError, "now"),
    ],
)
def test_build_samples_rejects_bad_input(kwargs, exc, match):
    args = {
        "report": None,
        "incidents": IncidentSnapshot(),
        "health": HEALTH,
        "config": CONFIG,
        "now": T0,
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        build_samples(**args)


def test_piece_functions_reject_bad_input():
    with pytest.raises(TypeError, match="report"):
        report_samples(object(), CONFIG)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        state_samples(None, IncidentSnapshot(), HEALTH, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="now"):
        clock_samples(None, CONFIG, float("inf"))
