"""The demo's parts without spawning it: timelines, verdicts, the run recorder, the live view."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time import StepTimeReport, diagnose_means
from rankwatch.exporter.cli.demo_plan import (
    DEEPEP_PHASES,
    DemoOptions,
    Segment,
    Timeline,
    deepep_phase_at,
    parse_timeline,
    scenario_timeline,
)
from rankwatch.exporter.cli.demo_rank import SimulatedDeepEP
from rankwatch.exporter.cli.live_table import LiveView, Progress
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.recorder import RunRecorder, summary_text, write_summary
from rankwatch.exporter.publish.verdicts import (
    describe_step,
    incident_label,
    normal_verdict,
    step_verdict,
)
from tests.e2e.test_deepep_gloo import Collect

# --- timelines -------------------------------------------------------------------------------


def test_parse_timeline_and_write_it_back() -> None:
    timeline = parse_timeline(" balanced:10, input:30 ,balanced:20")
    assert timeline.segments == (
        Segment("balanced", 10.0),
        Segment("input", 30.0),
        Segment("balanced", 20.0),
    )
    assert timeline.total_seconds == 60.0
    assert timeline.spec() == "balanced:10,input:30,balanced:20"
    assert parse_timeline(timeline.spec()) == timeline


def test_timeline_position() -> None:
    timeline = parse_timeline("balanced:10,input:30,compute:20")
    assert [timeline.index_at(t) for t in (0, 9.99, 10, 39.9, 40, 59.9, 60, 1e9)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        2,
        2,
    ]


def test_timeline_scales_to_a_duration() -> None:
    scaled = parse_timeline("balanced:10,input:30").scaled(20)
    assert scaled.spec() == "balanced:5,input:15"
    assert math.isclose(scaled.total_seconds, 20)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "expected phase:seconds, got ''"),
        ("input", "expected phase:seconds, got 'input'"),
        (":5", "expected phase:seconds, got ':5'"),
        ("input:5,,compute:5", "expected phase:seconds, got ''"),
        ("lunch:5", "unknown phase 'lunch', expected one of ['balanced', 'input', 'compute']"),
        ("input:x", "seconds of 'input' must be a number, got 'x'"),
        ("input:0", "phase 'input' needs a duration > 0 s, got 0.0"),
        ("input:inf", "phase 'input' needs a duration > 0 s, got inf"),
        ("input:nan", "phase 'input' needs a duration > 0 s, got nan"),
    ],
)
def test_bad_timelines_are_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_timeline(spec)
    assert message in str(err.value)


def test_empty_timeline_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one segment"):
        Timeline(())


def test_scenarios_fill_the_duration() -> None:
    assert scenario_timeline("full", 60).spec() == "balanced:12,input:18,compute:18,balanced:12"
    assert scenario_timeline("critical-straggler", 50).spec() == "input:30,balanced:20"
    assert scenario_timeline("balanced", 45).spec() == "balanced:45"
    with pytest.raises(ValueError, match="unknown scenario 'chaos'"):
        scenario_timeline("chaos", 10)


def test_a_45_second_run_shows_every_phase() -> None:
    timeline = scenario_timeline("full", 45)
    phases = {timeline.segments[timeline.index_at(t / 10)].phase for t in range(450)}
    assert phases == {"balanced", "input", "compute"}
    assert min(s.seconds for s in timeline.segments) >= 9  # several 1 s windows each
    deepep = {deepep_phase_at(t / 10, 45) for t in range(450)}
    assert deepep == set(range(len(DEEPEP_PHASES)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": 1}, "DemoOptions.ranks: must be in 2..8, got 1"),
        ({"ranks": 2, "straggler_rank": 2}, "straggler_rank: must be below ranks (2), got 2"),
        ({"port": 70000}, "DemoOptions.port: must be in 0..65535, got 70000"),
        ({"straggler_ms": -1.0}, "DemoOptions.straggler_ms: must be a finite number > 0"),
        ({"interval_seconds": math.nan}, "DemoOptions.interval_seconds: must be a finite"),
        ({"step_pause_ms": -5.0}, "DemoOptions.step_pause_ms: must be >= 0, got -5.0"),
        ({"device_ms": math.inf}, "DemoOptions.device_ms: must be >= 0, got inf"),
        ({"device_ms": -1.0}, "DemoOptions.device_ms: must be >= 0, got -1.0"),
    ],
)
def test_demo_options_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        DemoOptions(**kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_simulated_deepep_group_is_ep16_on_two_nodes_whatever_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two training ranks; the DeepEP group still has 16 ranks on two nodes, and its windows go
    # through the real root pipeline (cumulative blocks -> windows -> diagnosis -> publishers,
    # NPZ artifacts and log lines).
    monkeypatch.setenv("DEEPEP_DIAGNOSE_LOG_PATH", str(tmp_path / "deepep"))
    monkeypatch.setenv("DEEPEP_DIAGNOSE_EXPORT_NPZ", "1")
    phases = ["baseline"] * 4 + [p for p in DEEPEP_PHASES[1:] for _ in range(2)]
    current = iter(phases)
    sink = Collect()
    # An interval far longer than the test: only the explicit snapshots below are taken.
    options = DemoOptions(ranks=2, interval_seconds=3600.0, out=tmp_path)
    group = SimulatedDeepEP(options, [sink], lambda at: next(current), "run-1")
    group.start()
    for _ in phases:
        group.snapshot()
    group.stop(10.0)
    assert len(sink.reports) == len(phases)
    assert {len(r.ranks) for r in sink.reports} == {16}
    assert {r.ranks[9].hostname for r in sink.reports} == {"sim-node1"}
    got = [
        sorted((i.cls, i.ranks) for i in r.normal.incidents)
        for r in sink.reports
        if r.normal is not None
    ]
    # The validation run's five diagnoses, two windows per phase after four baseline ones.
    late = ("pre_stage_arrival_skew", (9,))
    expected = {
        "baseline": [],
        "pre_dispatch_delay": [late, late],
        "pre_combine_delay": [late],
        "all_hca_pressure": [("global_data_path_slowdown", ())],
        "single_hca_pressure": [("localized_data_path_slowdown", (0, 1, 8, 9))],
    }
    assert got == [expected[p] for p in phases]
    assert len(list((tmp_path / "deepep").glob("*.npz"))) == len(phases)
    assert "EPSize: 16" in (tmp_path / "deepep" / "deepep_diagnose_rank0.log").read_text()


# --- verdicts --------------------------------------------------------------------------------


def _means(
    ranks: int, slow: int | None = None, input_ms: float = 0.0, forward_ms: float = 0.0
) -> dict[int, dict[str, float]]:
    """Per-rank window means (ms) of a DDP step; ``slow`` arrives late by its extra time."""
    out = {}
    for r in range(ranks):
        extra_in = input_ms if r == slow else 0.0
        extra_fwd = forward_ms if r == slow else 0.0
        late = extra_in + extra_fwd
        forward, backward, optimizer = 10.0 + extra_fwd, 25.0 + input_ms + forward_ms - late, 1.0
        out[r] = {
            "input_wait": 0.5 + extra_in,
            "forward": forward,
            "backward": backward,
            "optimizer": optimizer,
            "step": forward + backward + optimizer + 0.5,
        }
    return out


def _step_report(slow: int | None = None, input_ms: float = 0.0, forward_ms: float = 0.0):
    return diagnose_means(_means(4, slow, input_ms, forward_ms), steps=100)


def test_input_straggler_verdict() -> None:
    v = step_verdict(_step_report(2, input_ms=20.0))
    assert (v.kind, v.severity, v.rank) == ("INPUT_STRAGGLER", "critical", 2)
    assert v.what == "rank 2 is an input-pipeline straggler"
    assert "waiting for its next batch" in v.why and "explains 100% of the gap" in v.why
    assert v.action.startswith("Look at rank 2's input pipeline")


def test_compute_straggler_verdict_names_the_host() -> None:
    report = _step_report(1, forward_ms=15.0)
    window = WindowReport(
        "world", 3, 0.0, tuple(RankInfo(r, f"node{r}", r) for r in range(4)), step_time=report
    )
    v = step_verdict(report, window)
    assert (v.kind, v.rank) == ("COMPUTE_STRAGGLER", 1)
    assert "on host node1" in v.action


def test_a_split_straggler_gets_both_actions() -> None:
    v = step_verdict(_step_report(3, input_ms=10.0, forward_ms=10.0))
    assert (v.kind, v.rank) == ("STRAGGLER", 3)
    assert "split between compute (50%) and input (50%)" in v.why
    assert "input pipeline" in v.action and "device and batches" in v.action


def test_balanced_verdicts() -> None:
    # Forward, backward and optimizer are almost the whole step: compute-bound (info).
    report = _step_report()
    v = step_verdict(report)
    assert (v.kind, v.severity, v.rank) == ("COMPUTE_BOUND", "info", None)
    assert v.what == "the job is compute-bound and balanced"
    assert describe_step(report).startswith("COMPUTE_BOUND info share=")
    # With a fifth of each step spent waiting for input everywhere it is input-bound instead.
    means = {r: {**m, "input_wait": 12.0} for r, m in _means(4).items()}
    v = step_verdict(diagnose_means(means, steps=100))
    assert (v.kind, v.severity, v.rank) == ("INPUT_BOUND", "warning", None)
    assert "waiting for input on the median rank" in v.why
    # A steady property of the job, not a fault: a warning at most, and it says it won't page.
    assert "a steady property of the job, not a fault: it does not page" in v.why


@pytest.mark.parametrize(
    ("phase", "kind", "ranks", "words"),
    [
        ("baseline", "ok", (), "healthy"),
        ("pre_dispatch_delay", "pre_stage_arrival_skew", (9,), "rank 9 arrives late at dispatch"),
        ("pre_combine_delay", "pre_stage_arrival_skew", (9,), "rank 9 arrives late at combine"),
        ("all_hca_pressure", "global_data_path_slowdown", (), "every DeepEP data path"),
        ("single_hca_pressure", "localized_data_path_slowdown", (0, 1, 8, 9), "ranks [0, 1, 8, 9]"),
    ],
)
def test_deepep_verdict_per_phase(
    phase: str, kind: str, ranks: tuple[int, ...], words: str
) -> None:
    sim, diagnoser = NormalSimulator(seed=5), NormalDiagnoser()
    for i in range(4):  # the global slowdown needs a history of normal windows
        diagnoser.diagnose(sim.window("baseline", i))
    v = normal_verdict(diagnoser.diagnose(sim.window(phase, 4)))
    assert v.kind == kind
    assert v.ranks == ranks
    assert words in v.what
    assert v.why and v.action


def test_incident_labels() -> None:
    assert incident_label("step_time_straggler", "input_straggler", "") == "input_straggler"
    assert incident_label("pre_stage_arrival_skew", "rank", "notify_dispatch") == "notify_dispatch"
    assert (
        incident_label("global_data_path_slowdown", "global", "dispatch_final,combine_logical_recv")
        == "global: dispatch_final,combine_logical_recv"
    )


# --- the run recorder and the summary files --------------------------------------------------

RANKS = tuple(RankInfo(r, "node0" if r < 2 else "node1", r % 2) for r in range(4))


def _window(index: int, report: StepTimeReport, kind: str = "live") -> WindowReport:
    return WindowReport(
        "world", index, 1000.0 + index, RANKS, run="t", window_kind=kind, step_time=report
    )


def _recorded_run() -> RunRecorder:
    """Two balanced windows, four with rank 2 straggling on input then compute, four clean."""
    recorder = RunRecorder(RankwatchConfig())
    reports = [_step_report()] * 2
    reports += [_step_report(2, input_ms=20.0)] * 2 + [_step_report(2, forward_ms=20.0)] * 2
    reports += [_step_report()] * 4
    for i, report in enumerate(reports):
        recorder.publish(_window(i, report))
    recorder.publish(_window(10, _step_report(2, 10.0, 10.0), kind="summary"))
    return recorder


def test_recorder_follows_an_incident_from_open_to_close() -> None:
    (incident,) = _recorded_run().incidents()
    assert (incident.cls, incident.ranks, incident.severity) == (
        "step_time_straggler",
        (2,),
        "critical",
    )
    assert incident.causes == ("input_straggler", "compute_straggler")
    assert incident.opened_window == 3  # 2 of the last 3 windows agree
    assert incident.closed_window == 8  # after 3 clean windows
    assert incident.hostnames == ("node1",)


def test_summary_uses_the_long_window_and_lists_incidents(tmp_path: Path) -> None:
    summary = _recorded_run().summary({"run_id": "t", "ranks": 4, "started_at_s": 1000.0})
    assert summary["step_time"]["window_kind"] == "summary"
    assert summary["step_time"]["verdict"]["rank"] == 2
    assert summary["step_time"]["live_kinds_seen"]["INPUT_STRAGGLER"] == 2
    assert summary["windows"] == {"step_time": 10}
    assert summary["deepep_normal"] is None
    assert summary["verdict"] == summary["step_time"]["verdict"]
    summary["files"] = {"summary": "x/summary.json"}
    json_path, text_path = write_summary(tmp_path / "out", summary)
    assert json.loads(json_path.read_text())["incidents"][0]["class"] == "step_time_straggler"
    text = text_path.read_text()
    assert text == summary_text(summary)
    assert "Step time (long window): rank 2 is a straggler" in text
    assert "DeepEP normal mode (last window): no window was diagnosed." in text
    assert "step_time_straggler critical ranks 2 (input_straggler then compute_straggler)" in text
    assert "opened +3 s, closed +8 s" in text
    assert "summary: x/summary.json" in text


def test_an_incident_still_open_says_so_once() -> None:
    summary = _recorded_run().summary({"run_id": "t", "started_at_s": 1000.0})
    incident = summary["incidents"][0]
    incident.update(closed_at_s=None, closed_window=None, close_reason=None)
    line = next(x for x in summary_text(summary).splitlines() if "opened +3 s" in x)
    assert line.endswith("opened +3 s, still open"), line


def test_summary_without_any_window_says_so(tmp_path: Path) -> None:
    summary = RunRecorder().summary({"interrupted": True})
    assert summary["verdict"] is None and summary["incidents"] == []
    _, text_path = write_summary(tmp_path, summary)
    assert "Step time (long window): no window was diagnosed." in text_path.read_text()
    assert "interrupted" in text_path.read_text()


# --- the live view ---------------------------------------------------------------------------


def _view(live: bool, stream: io.StringIO, recorder: RunRecorder) -> LiveView:
    return LiveView(
        header="rankwatch demo: test",
        segments=[("balanced", 5.0), ("input", 10.0)],
        deepep_phases=DEEPEP_PHASES,
        recorder=recorder,
        live=live,
        stream=stream,
    )


def test_plain_view_prints_one_line_per_event() -> None:
    stream, recorder = io.StringIO(), RunRecorder()
    with _view(False, stream, recorder) as view:
        view.progress(Progress(0.5, 0, 0, 3))
        view.progress(Progress(0.9, 0, 0, 9))  # same phases: no line
        view.progress(Progress(5.2, 1, 1, 60))
        for i in range(3):
            report = _window(i, _step_report(2, input_ms=20.0))
            recorder.publish(report)
            view.report(report)
        view.note("stopping")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[   0.0s] rankwatch demo: test"
    assert lines[1:3] == ["[   0.5s] timeline: balanced for 5 s", "[   0.5s] deepep: baseline"]
    assert lines[3:5] == [
        "[   5.2s] timeline: input for 10 s",
        "[   5.2s] deepep: pre_dispatch_delay",
    ]
    assert lines[5].startswith("[   5.2s] step w0: INPUT_STRAGGLER critical culprit=2 victim=")
    assert (
        "[   5.2s] incident opened: step_time_straggler critical ranks 2 (input_straggler)" in lines
    )
    assert lines[-1] == "[   5.2s] stopping"


def test_live_view_fits_a_small_terminal() -> None:
    recorder = RunRecorder()
    view = _view(True, io.StringIO(), recorder)
    for i in range(3):
        report = _window(i, _step_report(2, input_ms=20.0))
        recorder.publish(report)
        view.report(report)
    view.progress(Progress(7.0, 1, 1, 120))
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(view.render())
    text = console.export_text()
    rows = [ln for ln in text.splitlines() if ln.strip().startswith(("0 ", "1 ", "2 ", "3 "))]
    assert len(rows) == 4
    (culprit_row,) = [ln for ln in rows if ln.strip().startswith("2 ")]
    assert "culprit" in culprit_row and "node1" in culprit_row
    assert "step time: rank 2 is an input-pipeline straggler [critical]" in text
    assert "open incidents (1):" in text
    assert "7.0 s / 15 s" in text
    assert len(text.splitlines()) <= 24


def test_recorder_writes_the_summary_when_closed(tmp_path: Path) -> None:
    recorder = RunRecorder(RankwatchConfig(), out_dir=tmp_path / "run", run={"run_id": "r1"})
    recorder.close(1.0)  # nothing received (not the root): nothing written
    assert not (tmp_path / "run").exists()
    for i in range(3):
        recorder.publish(_window(i, _step_report(1, forward_ms=20.0)))
    recorder.publish(_window(3, _step_report(1, forward_ms=20.0), kind="summary"))
    recorder.close(1.0)
    assert recorder.written == (tmp_path / "run" / "summary.json", tmp_path / "run" / "summary.txt")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["run"] == {"run_id": "r1"}
    assert summary["verdict"]["kind"] == "COMPUTE_STRAGGLER"
    assert summary["verdict"]["rank"] == 1
    assert "rank 1 is a compute straggler" in (tmp_path / "run" / "summary.txt").read_text()
