"""Structured normal-mode log lines: summary, detail + values pairs, parsing, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rankwatch.diagnosis.deepep.log_lines import (
    NormalLogLine,
    invalid_window_line,
    normal_log_lines,
    parse_log_line,
)
from rankwatch.diagnosis.deepep.normal.report import NormalReport, ProbeResult
from rankwatch.diagnosis.deepep.normal.schema import COMPLETION_PROBES, NOTIFY_PROBES, PROBES
from tests.diagnosis.deepep.test_artifacts import _report, _window


def _no_nan(text: str) -> object:
    def refuse(token: str) -> None:
        raise AssertionError(f"non-JSON constant {token} in {text[:80]}")

    return json.loads(text, parse_constant=refuse)


def test_level_zero_is_one_compact_summary_line() -> None:
    window = _window()
    report = _report(window)
    lines = normal_log_lines(report, window)
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith(
        "[Diagnose] InstanceID: job-7f3a EPSize: 16 WindowIndex: 3 Normal summary: "
    )
    parsed = parse_log_line(line)
    assert (parsed.instance_id, parsed.ep_size, parsed.window_index) == ("job-7f3a", 16, 3)
    assert parsed.record == "summary" and parsed.probe is None
    payload = parsed.payload
    assert list(payload) == ["status", "probes", "anomalies", "incidents", "raw_anomalies"]
    assert payload["status"] == "anomalous"
    assert list(payload["probes"]) == list(PROBES)  # schema order, not alphabetical
    assert payload["probes"]["notify_dispatch"] == "anomalous"
    assert payload["anomalies"] == {"notify_dispatch": 1}
    assert payload["incidents"] == [
        {
            "class": "pre_stage_arrival_skew",
            "probes": ["notify_dispatch"],
            "scope": "rank",
            "ranks": [0],
            "severity": "warning",
        }
    ]
    assert len(line) < 1000  # compact: no per-rank arrays at level 0


def test_details_pair_every_probe_detail_with_its_values() -> None:
    window = _window()
    report = _report(window)
    lines = normal_log_lines(report, window, details=True)
    assert len(lines) == 1 + 2 * len(PROBES)
    parsed = [parse_log_line(x) for x in lines]
    assert all((p.instance_id, p.ep_size, p.window_index) == ("job-7f3a", 16, 3) for p in parsed)
    assert parsed[0].record == "summary"
    pairs = list(zip(parsed[1::2], parsed[2::2], strict=True))
    assert [d.probe for d, _ in pairs] == list(PROBES)
    for detail, values in pairs:
        assert detail.record == "detail" and values.record == "values"
        assert detail.probe == values.probe
    for line in lines:
        _no_nan(line.split(": ", 4)[-1].split(": ", 1)[-1])

    notify_detail = parsed[1].payload
    assert notify_detail["status"] == "anomalous"
    assert notify_detail["anomalies"][0]["scope"] == "rank"
    assert notify_detail["anomalies"][0]["src"] == 0
    assert "notify_ratio" not in notify_detail  # arrays go on the values line


def test_values_are_full_source_oriented_arrays() -> None:
    window = _window()
    report = _report(window)
    by_probe = {
        p.probe: p.payload
        for p in map(parse_log_line, normal_log_lines(report, window, details=True))
        if p.record == "values"
    }
    notify = by_probe["notify_dispatch"]
    assert notify["notify_ratio"] == pytest.approx(np.linspace(0.1, 1.9, 16).tolist(), rel=1e-5)
    assert notify["mean_duration_ns"] == pytest.approx(
        window.notify_avg_ns("notify_dispatch").tolist(), rel=1e-5
    )
    cps = by_probe["dispatch_final"]["cost_per_sample"]
    expected = window.cost_per_sample("dispatch_final")
    assert len(cps) == 16 and all(len(row) == 16 for row in cps)
    # Row = source rank, column = destination: compare an asymmetric pair of cells.
    assert cps[2][5] == pytest.approx(expected[2, 5], rel=1e-5)
    assert cps[5][2] == pytest.approx(expected[5, 2], rel=1e-5)
    assert cps[0][1] is None  # the cell without samples
    # tokens_per_sample is not in the report: it comes from the window.
    tps = by_probe["combine_logical_recv"]["tokens_per_sample"]
    assert tps[3][4] == pytest.approx(12.0)


def test_values_without_window_use_the_report_or_null() -> None:
    window = _window()
    report = _report(window)
    lines = normal_log_lines(report, details=True)
    values = {p.probe: p.payload for p in map(parse_log_line, lines) if p.record == "values"}
    assert values["dispatch_final"]["tokens_per_sample"] is None
    assert values["dispatch_final"]["cost_per_sample"][2][5] == pytest.approx(
        window.cost_per_sample("dispatch_final")[2, 5], rel=1e-5
    )


def test_missing_probe_result_gets_null_detail() -> None:
    window = _window(probes=("notify_dispatch",))
    full = _report(_window())
    report = NormalReport(
        window_index=3,
        ep_size=16,
        ranks_per_node=8,
        probes={"notify_dispatch": full.probes["notify_dispatch"]},
    )
    lines = [parse_log_line(x) for x in normal_log_lines(report, window, details=True)]
    details = {p.probe: p.payload for p in lines if p.record == "detail"}
    assert details["dispatch_final"] == {"kind": None, "status": None}
    values = {p.probe: p.payload for p in lines if p.record == "values"}
    assert values["combine_logical_recv"] == {"cost_per_sample": None, "tokens_per_sample": None}
    assert lines[0].payload["probes"] == {"notify_dispatch": "anomalous"}


def test_lines_are_deterministic_and_rounded() -> None:
    window = _window()
    report = _report(window)
    a = normal_log_lines(report, window, details=True)
    b = normal_log_lines(_report(_window()), _window(), details=True)
    assert a == b
    values = a[2]  # notify_dispatch values
    numbers = values.split('"notify_ratio":[', 1)[1].rstrip("]}").split(",")
    assert all(len(n.replace(".", "").replace("-", "").lstrip("0")) <= 6 for n in numbers)


def test_instance_id_is_one_token() -> None:
    window = _window()
    report = _report(window)
    spaced = normal_log_lines(report, window, instance_id="my job\t7")[0]
    assert parse_log_line(spaced).instance_id == "my_job_7"
    anonymous = NormalReport(window_index=0, ep_size=2, ranks_per_node=1, probes={})
    assert parse_log_line(normal_log_lines(anonymous)[0]).instance_id == "-"


def test_invalid_window_line() -> None:
    line = invalid_window_line("job 1", 16, 9, "counter_reset", "rank 3 counter[7] went down")
    parsed = parse_log_line(line)
    assert parsed == NormalLogLine(
        "job_1",
        16,
        9,
        "invalid",
        None,
        {"reason": "counter_reset", "message": "rank 3 counter[7] went down"},
    )


def test_parse_ignores_a_logger_prefix_and_rejects_foreign_lines() -> None:
    line = normal_log_lines(_report(_window()))[0]
    stamped = f"[2026-01-02T03:04:05.678] {line}\n"
    assert parse_log_line(stamped) == parse_log_line(line)
    for bad in [
        "hello",
        "[Diagnose] InstanceID: x EPSize: 16, diagnose: {'abnormal_cols': []}",
        line.replace("Normal summary", "Normal bogus"),
        line.replace("EPSize: 16", "EPSize: sixteen"),
    ]:
        with pytest.raises(ValueError, match="line: not a normal-mode diagnosis line"):
            parse_log_line(bad)
    with pytest.raises(ValueError, match="line: payload is not JSON"):
        parse_log_line(line.split(": {", 1)[0] + ": {oops}")
    deep = line.split(": {", 1)[0] + ': {"a":' + "[" * 10**6 + "]" * 10**6 + "}"
    with pytest.raises(ValueError, match=r"payload is not JSON we read \(JSON nested more than 64"):
        parse_log_line(deep)
    with pytest.raises(TypeError, match="line: expected a string, got bytes"):
        parse_log_line(line.encode())  # type: ignore[arg-type]


def test_bad_input_is_rejected_naming_the_field() -> None:
    window = _window()
    report = _report(window)
    with pytest.raises(TypeError, match="report: expected NormalReport, got dict"):
        normal_log_lines(report.to_dict())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="window: expected NormalWindow or None, got str"):
        normal_log_lines(report, "w")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"window\.ep_size: 8 does not match report\.ep_size=16"):
        normal_log_lines(report, _window(ep=8, rpn=4))
    with pytest.raises(ValueError, match=r"window\.window_index: 4 does not match"):
        normal_log_lines(report, _window(index=4))
    with pytest.raises(TypeError, match="details: expected a bool, got 1"):
        normal_log_lines(report, details=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="instance_id: expected a string or None, got 5"):
        normal_log_lines(report, instance_id=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ep_size: must be an int >= 0, got -1"):
        invalid_window_line("x", -1, 0, "counter_reset")
    with pytest.raises(ValueError, match=r"window_index: must be an int >= 0, got 1.5"):
        invalid_window_line("x", 16, 1.5, "counter_reset")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reason: must be a non-empty string, got ''"):
        invalid_window_line("x", 16, 0, "")


def test_insufficient_probe_values_are_null_not_zero() -> None:
    window = _window()
    report = _report(window)
    probes = dict(report.probes)
    probes["cached_notify_combine"] = ProbeResult(
        probe="cached_notify_combine",
        kind="notify",
        status="insufficient",
        notify_ratio=np.full(16, np.nan),
        detail="1 rank(s) launched the kernel; at least 2 are needed",
    )
    report2 = NormalReport(3, 16, 8, probes, instance_id="job-7f3a")
    lines = [parse_log_line(x) for x in normal_log_lines(report2, window, details=True)]
    detail = next(p for p in lines if p.record == "detail" and p.probe == "cached_notify_combine")
    assert detail.payload["status"] == "insufficient"
    assert "at least 2" in detail.payload["detail"]
    values = next(p for p in lines if p.record == "values" and p.probe == "cached_notify_combine")
    assert values.payload["notify_ratio"] == [None] * 16
    assert lines[0].payload["probes"]["cached_notify_combine"] == "insufficient"
    assert set(NOTIFY_PROBES) | set(COMPLETION_PROBES) == set(PROBES)


def test_non_finite_values_become_null() -> None:
    window = _window()
    report = _report(window)
    probes = dict(report.probes)
    ratio = np.linspace(0.5, 1.5, 16)
    ratio[[2, 5, 7]] = [np.inf, -np.inf, np.nan]
    probes["notify_dispatch"] = ProbeResult(
        probe="notify_dispatch", kind="notify", status="ok", notify_ratio=ratio
    )
    report2 = NormalReport(3, 16, 8, probes, instance_id="job-7f3a")
    line = normal_log_lines(report2, window, details=True)[2]
    payload = _no_nan(line.split("notify_dispatch: ", 1)[1])
    assert isinstance(payload, dict)
    got = payload["notify_ratio"]
    assert [got[2], got[5], got[7]] == [None, None, None]
    assert got[0] == 0.5 and got[15] == 1.5
