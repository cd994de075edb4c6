"""``rankwatch demo`` end to end: real ranks (Gloo), a real Prometheus, the files it leaves.

One demo run (3 ranks, rank 2 slowed first in its data loading, then in its forward pass, then
healthy again; the DeepEP group simulated at EP 16 over two nodes, whatever the number of
training ranks) is shared by the tests of this module; ``test_demo_interrupt.py`` checks Ctrl-C.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.exporter.cli.test_cli import CLI, run_cli
from tests.servers import free_port, http_get, prom_query, prometheus, victoria_metrics

pytestmark = [pytest.mark.multiproc, pytest.mark.servers]

STRAGGLER = 2
# The demo's simulated DeepEP group and its late rank (rank 9, as in the validation run).
EP, LATE = 16, 9
TIMELINE = "balanced:4,input:8,compute:8,balanced:10"


@dataclass
class DemoRun:
    returncode: int
    output: str
    out: Path
    seen: dict[tuple[str, str], float]  # (kind, culprit_rank) of critical diagnoses -> scrapes
    max_score: float
    straggler_incidents: float
    deepep_series: int  # DeepEP Notify series Prometheus scraped
    late_ranks: set[str]  # culprit ranks of pre-stage arrival skew incidents Prometheus saw
    otlp_culprits: set[str]  # culprit ranks of critical diagnoses pushed over OTLP
    otlp_deepep_series: int  # DeepEP series pushed over OTLP


def demo_env() -> dict[str, str]:
    # The demo must not pick up a developer's own rankwatch or OTLP settings.
    prefixes = ("RANKWATCH_", "DEEPEP_", "OTEL_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    port = free_port()
    config = f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: rankwatch-demo
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""
    out = tmp_path_factory.mktemp("demo") / "out"
    # Left over from an earlier run: the demo removes its own old files, nothing else.
    (out / "deepep").mkdir(parents=True)
    (out / "deepep" / "deepep-normal-old-w00000099.npz").write_bytes(b"old run")
    (out / "notes.txt").write_text("mine")
    with prometheus(config) as prom, victoria_metrics(["-opentelemetry.usePrometheusNaming"]) as vm:
        env = demo_env()
        env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = f"{vm.url}/opentelemetry/v1/metrics"
        env["RANKWATCH_OTLP_EXPORT_INTERVAL_SECONDS"] = "1"
        proc = subprocess.run(
            [
                str(CLI), "demo", "--ranks", "3", "--straggler-rank", str(STRAGGLER),
                "--timeline", TIMELINE, "--port", str(port), "--out", str(out), "--plain",
            ],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        critical = prom_query(
            prom,
            "sum by (kind, culprit_rank) (count_over_time("
            'rankwatch_diagnosis_info{job="rankwatch-demo", severity="critical"}[15m]))',
        )
        score = prom_query(prom, "max(max_over_time(rankwatch_straggler_score[15m]))")
        opened = prom_query(
            prom,
            'max(max_over_time(rankwatch_incidents_total{class="step_time_straggler"}[15m]))',
        )
        scraped_deepep = prom_query(
            prom, "count(last_over_time(rankwatch_deepep_notify_ratio[15m]))"
        )
        late = prom_query(
            prom,
            "count by (culprit_rank) (last_over_time("
            'rankwatch_incident_active{class="pre_stage_arrival_skew"}[15m]))',
        )
        http_get(f"{vm.url}/internal/force_flush")
        pushed = prom_query(
            vm, 'count by (culprit_rank) (rankwatch_diagnosis_info{severity="critical"}[15m])'
        )
        pushed_deepep = prom_query(vm, "count(last_over_time(rankwatch_deepep_notify_ratio[15m]))")
    yield DemoRun(
        returncode=proc.returncode,
        output=proc.stdout + proc.stderr,
        out=out,
        seen={
            (r["metric"]["kind"], r["metric"]["culprit_rank"]): float(r["value"][1])
            for r in critical
        },
        max_score=float(score[0]["value"][1]) if score else 0.0,
        straggler_incidents=float(opened[0]["value"][1]) if opened else 0.0,
        deepep_series=int(float(scraped_deepep[0]["value"][1])) if scraped_deepep else 0,
        late_ranks={r["metric"].get("culprit_rank", "") for r in late},
        otlp_culprits={r["metric"].get("culprit_rank", "") for r in pushed},
        otlp_deepep_series=int(float(pushed_deepep[0]["value"][1])) if pushed_deepep else 0,
    )


def test_demo_finishes_and_prints_where_the_files_are(demo_run: DemoRun) -> None:
    assert demo_run.returncode == 0, demo_run.output[-3000:]
    assert "timeline: input for 8 s" in demo_run.output
    assert "timeline: compute for 8 s" in demo_run.output
    assert "rankwatch summary" in demo_run.output
    assert f"summary: {demo_run.out / 'summary.json'}" in demo_run.output


def test_prometheus_names_the_injected_straggler(demo_run: DemoRun) -> None:
    # What a user's Prometheus saw while the demo ran: the critical diagnoses blame rank 2,
    # first for its input pipeline, then for its forward pass.
    assert demo_run.seen.get(("INPUT_STRAGGLER", str(STRAGGLER)), 0) >= 2, demo_run.seen
    assert demo_run.seen.get(("COMPUTE_STRAGGLER", str(STRAGGLER)), 0) >= 2, demo_run.seen
    assert {culprit for _, culprit in demo_run.seen} == {str(STRAGGLER)}
    assert demo_run.max_score >= 0.2
    assert demo_run.straggler_incidents >= 1


def test_prometheus_sees_the_deepep_windows_too(demo_run: DemoRun) -> None:
    # One hub, both collectors: the DeepEP series sit beside the step-time ones, and the
    # pre-stage arrival skew incidents name the rank the DeepEP simulator delays.
    assert demo_run.deepep_series == 3 * EP  # three Notify probes x the simulated EP ranks
    assert demo_run.late_ranks == {str(LATE)}


def test_otlp_push_carries_both_engines(demo_run: DemoRun) -> None:
    # The same run pushed OTLP to a real VictoriaMetrics: the step-time diagnosis names the
    # same culprit, and the DeepEP windows arrive too.
    assert demo_run.otlp_culprits == {str(STRAGGLER)}
    assert demo_run.otlp_deepep_series == 3 * EP  # three Notify probes x the EP ranks


def test_live_lines_follow_the_timeline(demo_run: DemoRun) -> None:
    lines = demo_run.output.splitlines()
    assert any(f"INPUT_STRAGGLER critical culprit={STRAGGLER}" in ln for ln in lines)
    assert any(f"COMPUTE_STRAGGLER critical culprit={STRAGGLER}" in ln for ln in lines)
    opened = [ln for ln in lines if "incident opened: step_time_straggler" in ln]
    closed = [ln for ln in lines if "incident closed: step_time_straggler" in ln]
    assert opened and closed, "the straggler incident opens, then closes once it is removed"
    assert lines.index(opened[0]) < lines.index(closed[0])


def _summary(demo_run: DemoRun) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((demo_run.out / "summary.json").read_text())
    return data


def test_summary_names_the_straggler(demo_run: DemoRun) -> None:
    summary = _summary(demo_run)
    assert summary["run"]["ranks"] == 3
    assert summary["run"]["interrupted"] is False
    assert summary["run"]["steps"] > 100
    step = summary["step_time"]
    assert step["window_kind"] == "summary"  # the long window, not the last live one
    assert step["verdict"]["rank"] == STRAGGLER
    assert step["report"]["findings"][0]["culprit_rank"] == STRAGGLER
    stragglers = [i for i in summary["incidents"] if i["class"] == "step_time_straggler"]
    assert [i["ranks"] for i in stragglers] == [[STRAGGLER]]
    (incident,) = stragglers
    assert incident["severity"] == "critical"
    assert incident["causes"][0] == "input_straggler"
    assert "compute_straggler" in incident["causes"]
    assert incident["closed_at_s"] is not None
    deepep = [i for i in summary["incidents"] if i["class"] == "pre_stage_arrival_skew"]
    assert deepep and all(i["ranks"] == [LATE] for i in deepep)
    text = (demo_run.out / "summary.txt").read_text()
    assert f"rank {STRAGGLER}" in text
    assert "What to do:" in text


def test_step_windows_diagnose_offline(demo_run: DemoRun) -> None:
    folder = demo_run.out / "step-windows"
    expected = {
        "step-window-1-balanced.json": None,
        "step-window-2-input.json": "INPUT_STRAGGLER",
        "step-window-3-compute.json": "COMPUTE_STRAGGLER",
        "step-window-4-balanced.json": None,
        "step-window-run.json": None,
    }
    assert sorted(p.name for p in folder.iterdir()) == sorted(expected)
    for name, kind in expected.items():
        if kind is None:
            continue
        result = run_cli("diagnose", "--json", str(folder / name))
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)["report"]
        assert report["kind"] == kind
        assert report["findings"][0]["culprit_rank"] == STRAGGLER


def test_deepep_artifacts_replay_and_heatmaps(demo_run: DemoRun) -> None:
    assert (demo_run.out / "notes.txt").read_text() == "mine"
    assert not (demo_run.out / "deepep" / "deepep-normal-old-w00000099.npz").exists()
    npz = sorted((demo_run.out / "deepep").glob("*.npz"))
    assert len(npz) >= 20  # about one per second of the 30 s timeline
    result = run_cli("replay", str(demo_run.out))
    assert result.returncode == 0, result.stderr
    assert f"pre_stage_arrival_skew[{LATE}]" in result.stdout
    assert "global_data_path_slowdown" in result.stdout
    assert "0 differ from the saved diagnosis; 0 refused" in result.stdout
    phases = sorted(p.name for p in (demo_run.out / "heatmaps").iterdir())
    assert phases == [
        "1-baseline",
        "2-pre_dispatch_delay",
        "3-pre_combine_delay",
        "4-all_hca_pressure",
        "5-single_hca_pressure",
    ]
    for phase in phases:
        pictures = list((demo_run.out / "heatmaps" / phase).glob("*.png"))
        assert len(pictures) == 4, phase


def test_incident_events_are_logged_as_json(demo_run: DemoRun) -> None:
    events = []
    for line in (demo_run.out / "logs" / "rank0.log").read_text().splitlines():
        if "rankwatch.incidents" in line:
            events.append(json.loads(line[line.index("{") :]))
    opened = [e for e in events if e["event"] == "rankwatch.incident.open"]
    assert any(
        e["incident.class"] == "step_time_straggler" and e["incident.culprit_ranks"] == [STRAGGLER]
        for e in opened
    )


# The DeepEP validation run's five-phase table: each phase's diagnosis at EP 16 on two nodes.
VALIDATION_DIAGNOSES: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {
    "baseline": [],
    "pre_dispatch_delay": [
        ("pre_stage_arrival_skew", "cached_notify_dispatch", (LATE,)),
        ("pre_stage_arrival_skew", "notify_dispatch", (LATE,)),
    ],
    "pre_combine_delay": [("pre_stage_arrival_skew", "cached_notify_combine", (LATE,))],
    "all_hca_pressure": [
        ("global_data_path_slowdown", "combine_logical_recv,dispatch_final,dispatch_rdma_recv", ())
    ],
    "single_hca_pressure": [
        (
            "localized_data_path_slowdown",
            "combine_logical_recv,dispatch_final,dispatch_rdma_recv",
            (0, 1, 8, 9),
        )
    ],
}


def test_deepep_phases_show_the_validation_diagnoses_at_ep16(demo_run: DemoRun) -> None:
    from rankwatch.diagnosis.deepep.artifact import load_window_artifact
    from rankwatch.exporter.cli.demo_plan import DEEPEP_PHASES

    run = _summary(demo_run)["run"]
    assert run["deepep_group"]["simulated"] is True
    assert (run["deepep_group"]["ep_size"], run["deepep_group"]["ranks_per_node"]) == (EP, 8)
    assert f"DeepEP group simulated at EP {EP} over 2 nodes" in demo_run.output
    # The five phases share the timeline equally.
    share = sum(float(p.split(":")[1]) for p in TIMELINE.split(",")) / len(DEEPEP_PHASES)
    seen: dict[str, list[list[tuple[str, str, tuple[int, ...]]]]] = {p: [] for p in DEEPEP_PHASES}
    for path in sorted((demo_run.out / "deepep").glob("*.npz")):
        window, diagnosis, meta = load_window_artifact(path)
        assert (window.ep_size, window.ranks_per_node) == (EP, 8), path.name
        assert diagnosis is not None, path.name
        start = meta.start_time_s - run["started_at_s"]
        end = meta.end_time_s - run["started_at_s"]
        index = int(start // share)
        # Windows wholly inside one phase (the one spanning the end is partly after it).
        if index >= len(DEEPEP_PHASES) or end > (index + 1) * share + 1e-3:
            continue
        seen[DEEPEP_PHASES[index]].append(
            sorted(
                (i["class"], ",".join(sorted(i["probes"])), tuple(i["ranks"]))
                for i in diagnosis["incidents"]
            )
        )
    for phase, expected in VALIDATION_DIAGNOSES.items():
        assert len(seen[phase]) >= 3, (phase, seen[phase])
        assert all(got == expected for got in seen[phase]), (phase, seen[phase])
    # The incidents of the run, as the summary keeps them, name the same classes and ranks.
    opened = {(i["class"], tuple(i["ranks"])) for i in _summary(demo_run)["incidents"]}
    assert {
        ("pre_stage_arrival_skew", (LATE,)),
        ("global_data_path_slowdown", ()),
        ("localized_data_path_slowdown", (0, 1, 8, 9)),
    } <= opened
