"""Any input to the DeepEP engines gives a valid report or a ValueError/TypeError naming the
field; reports, their log lines and the metric samples built from them never hold NaN.

Entry points covered: ``NormalWindow`` (and ``CounterSnapshot`` / ``from_snapshots``),
``NormalDiagnoser.diagnose``, ``diagnose_notify``, ``diagnose_completion``, ``diagnose_matrix``,
``diagnose_low_latency``, ``normal_log_lines`` / ``invalid_window_line`` / ``parse_log_line``,
and ``report_samples`` over the resulting ``WindowReport``. Inputs range from realistic
counter deltas (anything an int64 counter can hold) to arbitrary Python objects.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rankwatch.diagnosis.config import LowLatencyConfig, NormalConfig
from rankwatch.diagnosis.deepep.log_lines import (
    invalid_window_line,
    normal_log_lines,
    parse_log_line,
)
from rankwatch.diagnosis.deepep.low_latency import diagnose_low_latency, diagnose_matrix
from rankwatch.diagnosis.deepep.normal import (
    CounterSnapshot,
    NormalDiagnoser,
    NormalWindow,
    counter_length,
)
from rankwatch.diagnosis.deepep.normal.completion import diagnose_completion
from rankwatch.diagnosis.deepep.normal.notify import diagnose_notify
from rankwatch.diagnosis.deepep.normal.report import PROBE_STATUSES, SCOPES, ZERO_SPREAD
from rankwatch.diagnosis.deepep.normal.schema import COMPLETION_PROBES, NOTIFY_PROBES, PROBES
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.samples import report_samples

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
INT64_MAX = float(2**63 - 1)


# ---- checks every result must pass -----------------------------------------------------------


def walk_finite(value: Any, where: str = "report") -> None:
    """Every float anywhere in a JSON-ready structure is finite."""
    if isinstance(value, float):
        assert math.isfinite(value), f"{where}: {value!r}"
    elif isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), f"{where}: key {k!r}"
            walk_finite(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            walk_finite(v, f"{where}[{i}]")
    else:
        assert value is None or isinstance(value, (str, int, bool)), f"{where}: {value!r}"


def names_field(exc: BaseException, *fields: str) -> None:
    """The error is a ValueError/TypeError whose message names one of ``fields``."""
    assert isinstance(exc, (ValueError, TypeError)), repr(exc)
    text = str(exc)
    assert any(f in text for f in fields), f"{type(exc).__name__}: {text!r} names none of {fields}"


def check_report(report: Any, window: NormalWindow, config: RankwatchConfig) -> None:
    assert set(report.probes) == set(PROBES)
    data = report.to_dict()
    walk_finite(data)
    json.dumps(data, allow_nan=False)
    ep = window.ep_size
    for result in report.probes.values():
        assert result.status in PROBE_STATUSES
        for a in result.anomalies:
            assert a.scope in SCOPES and math.isfinite(a.factor)
            # Scores are finite; a zero spread leaves none, with the reason stated.
            assert a.score is None or math.isfinite(a.score)
            assert a.score is not None or a.score_note in ("", ZERO_SPREAD)
            assert all(0 <= r < ep for r in a.ranks)
    for incident in report.incidents:
        assert all(0 <= r < ep for r in incident.ranks)
    # The log lines of the window read back to the same payloads, with no NaN in them.
    lines = normal_log_lines(report, window, details=True, instance_id="prop")
    assert len(lines) == 1 + 2 * len(PROBES)
    for line in lines:
        assert "NaN" not in line and "Infinity" not in line
        parsed = parse_log_line("2025-01-01 " + line)
        assert (parsed.ep_size, parsed.window_index) == (ep, window.window_index)
        walk_finite(parsed.payload, parsed.record)
    # The metric samples of the report: finite values, string labels, bounded count.
    ranks = tuple(RankInfo(r, f"host-{r // window.ranks_per_node}", r) for r in range(ep))
    wr = WindowReport(
        group="g", window_index=window.window_index, created_at_s=1.7e9, ranks=ranks, normal=report
    )
    samples = report_samples(wr, config)
    for s in samples:
        assert math.isfinite(s.value), s
        assert all(isinstance(v, str) for v in s.labels), s
    cells = 3 * min(ep * ep, config.cell_budget)
    assert len(samples) <= 64 + 20 * ep + cells + 7 * len(PROBES) * ep


# ---- realistic windows: anything int64 counters can produce ----------------------------------

LAYOUTS = [(1, 1), (2, 1), (2, 2), (3, 3), (4, 2), (6, 3), (8, 4), (8, 8)]

# Values an int64 counter delta can hold, with the edge cases weighted in.
counter_values = st.one_of(
    st.just(0.0),
    st.just(1.0),
    st.integers(0, 1000).map(float),
    st.integers(0, 2**53).map(float),
    st.just(INT64_MAX),
    st.floats(0.0, INT64_MAX, allow_nan=False),
)
counts = st.one_of(st.just(0.0), st.integers(1, 64).map(float), st.integers(1, 2**53).map(float))


@st.composite
def realistic_windows(draw: Any) -> NormalWindow:
    ep, rpn = draw(st.sampled_from(LAYOUTS))

    def arr(elements: Any, shape: tuple[int, ...]) -> np.ndarray:
        return draw(hnp.arrays(np.float64, shape, elements=elements))

    present = draw(st.sets(st.sampled_from(PROBES)))
    notify = {
        p: (arr(counter_values, (ep,)), arr(counts, (ep,))) for p in NOTIFY_PROBES if p in present
    }
    completion = {
        p: (arr(counter_values, (ep, ep)), arr(counts, (ep, ep)), arr(counter_values, (ep, ep)))
        for p in COMPLETION_PROBES
        if p in present
    }
    return NormalWindow(
        ep_size=ep,
        ranks_per_node=rpn,
        notify=notify,
        completion=completion,
        window_index=draw(st.integers(0, 2**31)),
        instance_id=draw(st.text(max_size=20)),
    )


@SETTINGS
@given(st.lists(realistic_windows(), min_size=1, max_size=6))
def test_realistic_windows_always_give_a_clean_report(windows: list[NormalWindow]) -> None:
    diagnoser = NormalDiagnoser()
    config = RankwatchConfig(cell_budget=16)
    for w in windows:
        check_report(diagnoser.diagnose(w), w, config)


@SETTINGS
@given(
    realistic_windows(),
    st.builds(
        NormalConfig,
        notify_ratio=st.floats(0.01, 1.0),
        axis_slowdown=st.floats(1.001, 10.0),
        point_slowdown=st.floats(1.001, 10.0),
        global_slowdown=st.floats(1.001, 10.0),
        robust_score=st.floats(0.01, 100.0),
        history_bootstrap=st.integers(1, 3),
        history_horizon=st.integers(3, 5),
    ),
)
def test_any_valid_threshold_config_gives_a_clean_report(
    window: NormalWindow, config: NormalConfig
) -> None:
    diagnoser = NormalDiagnoser(config)
    for _ in range(config.history_bootstrap + 1):
        report = diagnoser.diagnose(window)
    check_report(report, window, RankwatchConfig())


# ---- any finite, non-negative float64: fractional counts, subnormals, 1e308 ------------------

wide_values = st.one_of(
    st.floats(0.0, 1.7e308, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 5e-324, 1e-300, 0.5, 1e300, 1.7e308]),
)


@st.composite
def wide_windows(draw: Any) -> NormalWindow:
    ep, rpn = draw(st.sampled_from(LAYOUTS[:5]))

    def arr(shape: tuple[int, ...]) -> np.ndarray:
        return draw(hnp.arrays(np.float64, shape, elements=wide_values))

    return NormalWindow(
        ep_size=ep,
        ranks_per_node=rpn,
        notify={p: (arr((ep,)), arr((ep,))) for p in NOTIFY_PROBES},
        completion={p: (arr((ep, ep)), arr((ep, ep)), arr((ep, ep))) for p in COMPLETION_PROBES},
    )


@SETTINGS
@given(st.lists(wide_windows(), min_size=1, max_size=4))
def test_any_finite_non_negative_window_gives_a_clean_report(windows: list[NormalWindow]) -> None:
    """The window's own contract is "finite and non-negative": nothing inside that range may
    make the diagnoser fail, however absurd (1e308 cycles over 1e-300 samples)."""
    diagnoser = NormalDiagnoser()
    for w in windows:
        with np.errstate(all="ignore"):
            report = diagnoser.diagnose(w)
        check_report(report, w, RankwatchConfig(cell_budget=8))


# ---- anything at all: a window or an error naming the field ----------------------------------

WINDOW_FIELDS = (
    "ep_size",
    "ranks_per_node",
    "notify",
    "completion",
    "probe",
    "window_index",
    "instance_id",
    "start_time_s",
    "end_time_s",
    "extra",
)

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(allow_nan=True),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.lists(st.floats(allow_nan=True), max_size=5),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


@st.composite
def junk_arrays(draw: Any, ep: int, ndim: int) -> Any:
    shape = (ep,) if ndim == 1 else (ep, ep)
    choice = draw(st.integers(0, 5))
    if choice == 0:
        return draw(junk)
    if choice == 1:  # right shape, any dtype
        dtype = draw(st.sampled_from(["f8", "f4", "i8", "u1", "c16", "?", "U3", "O", "M8[s]"]))
        if dtype == "O":
            # Filled cell by cell: np.array() would nest a junk element that is a sequence.
            cells = np.empty(math.prod(shape), dtype=object)
            for i in range(cells.size):
                cells[i] = draw(junk)
            return cells.reshape(shape)
        return draw(hnp.arrays(np.dtype(dtype), shape))
    if choice == 2:  # wrong shape
        return np.ones(draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=5)))
    if choice == 3:  # right shape, hostile values
        return draw(hnp.arrays(np.float64, shape, elements=st.floats(allow_nan=True)))
    return draw(hnp.arrays(np.float64, shape, elements=st.floats(0.0, 1e6)))


@st.composite
def any_window_args(draw: Any) -> dict[str, Any]:
    ep = draw(st.one_of(st.sampled_from([1, 2, 4]), junk))
    rpn = draw(st.one_of(st.sampled_from([1, 2]), junk))
    n = ep if isinstance(ep, int) and not isinstance(ep, bool) and 1 <= ep <= 4 else 2

    def probe_map(names: tuple[str, ...], arity: int, ndim: int) -> Any:
        kind = draw(st.integers(0, 4))
        if kind == 0:
            return draw(junk)
        keys = draw(st.sets(st.sampled_from([*names, "bogus"]), max_size=len(names)))
        out: dict[Any, Any] = {}
        for k in keys:
            if draw(st.integers(0, 6)) == 0:
                out[k] = draw(junk)
            else:
                size = draw(st.sampled_from([arity, arity, arity, arity - 1, arity + 1]))
                out[k] = tuple(draw(junk_arrays(n, ndim)) for _ in range(size))
        return out

    args: dict[str, Any] = {
        "ep_size": ep,
        "ranks_per_node": rpn,
        "notify": probe_map(NOTIFY_PROBES, 2, 1),
        "completion": probe_map(COMPLETION_PROBES, 3, 2),
    }
    for name in ("window_index", "instance_id", "start_time_s", "end_time_s", "extra"):
        if draw(st.booleans()):
            args[name] = draw(junk)
    return args


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_window_args())
def test_any_window_arguments_give_a_window_or_an_error_naming_the_field(
    args: dict[str, Any],
) -> None:
    try:
        with np.errstate(all="ignore"):
            window = NormalWindow(**args)
    except Exception as exc:
        names_field(exc, *WINDOW_FIELDS)
        return
    with np.errstate(all="ignore"):
        report = NormalDiagnoser().diagnose(window)
    check_report(report, window, RankwatchConfig(cell_budget=8))


@settings(max_examples=150, deadline=None)
@given(
    counters=st.one_of(
        junk,
        hnp.arrays(
            st.sampled_from([np.int64, np.float64, np.int32, np.uint64, np.bool_]),
            hnp.array_shapes(min_dims=0, max_dims=3, max_side=30),
        ),
        st.sampled_from([1, 2, 3]).flatmap(
            lambda ep: hnp.arrays(
                np.int64,
                (ep, counter_length(ep)),
                elements=st.integers(-(2**63), 2**63 - 1),
            )
        ),
    ),
    sequence=st.one_of(st.integers(-5, 5), junk),
    taken_at_s=st.one_of(st.floats(allow_nan=True), junk),
)
def test_any_counter_snapshot_is_built_or_refused_by_name(
    counters: Any, sequence: Any, taken_at_s: Any
) -> None:
    try:
        snap = CounterSnapshot(counters, sequence=sequence, taken_at_s=taken_at_s)
    except Exception as exc:
        names_field(exc, "counters", "sequence", "taken_at_s")
        return
    assert snap.counters.dtype == np.int64
    assert snap.counters.shape == (snap.ep_size, counter_length(snap.ep_size))
    try:
        window = NormalWindow.from_snapshots(None, snap, 1)
    except Exception as exc:
        names_field(exc, "counter", "rank", "Notify", "sequence")
        return
    assert window.ep_size == snap.ep_size


@settings(max_examples=80, deadline=None)
@given(prev=junk, cur=junk, rpn=st.one_of(st.integers(-2, 3), junk))
def test_from_snapshots_refuses_what_is_not_a_snapshot_by_name(prev: Any, cur: Any, rpn: Any):
    with pytest.raises((ValueError, TypeError)) as info:
        NormalWindow.from_snapshots(prev, cur, rpn)
    names_field(info.value, "prev", "cur", "ranks_per_node")


# ---- the per-probe rules called directly (numeric arrays: the diagnoser's callers) ----------


@settings(max_examples=150, deadline=None)
@given(
    durations=hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=0, max_dims=2, max_side=12),
        elements=st.floats(allow_nan=True, allow_infinity=True),
    ),
    probe=st.sampled_from(NOTIFY_PROBES),
)
def test_diagnose_notify_on_any_array(durations: Any, probe: str) -> None:
    try:
        with np.errstate(all="ignore"):
            result = diagnose_notify(durations, probe, NormalConfig())
    except Exception as exc:
        names_field(exc, "mean_duration_ns")
        return
    walk_finite(result.to_dict())
    assert result.status in PROBE_STATUSES


@settings(max_examples=100, deadline=None)
@given(
    durations=hnp.arrays(
        np.float64,
        st.integers(2, 16),
        elements=st.one_of(st.just(math.nan), st.floats(1.0, 1e6)),
    ),
    exponent=st.one_of(st.integers(-60, 1100), st.just(1100)),
)
def test_notify_verdict_does_not_depend_on_the_unit(durations: np.ndarray, exponent: int) -> None:
    """Ratios are scale-free: the same durations in any power-of-two unit (an exact scaling,
    up to float64's top) flag the same ranks with the same ratios."""
    top = np.nanmax(durations) if np.any(np.isfinite(durations)) else 1.0
    # Clamp the exponent so the largest duration stays finite: large exponents then put every
    # duration just below float64's top, where a careless average of two overflows.
    exponent = min(exponent, 1023 - math.floor(math.log2(top)))
    scaled = durations * 2.0**exponent
    assert np.all(np.isfinite(scaled) | np.isnan(durations))
    base = diagnose_notify(durations, "notify_dispatch", NormalConfig())
    other = diagnose_notify(scaled, "notify_dispatch", NormalConfig())
    assert base.status == other.status
    assert [(a.src, a.factor) for a in base.anomalies] == [
        (a.src, a.factor) for a in other.anomalies
    ]
    np.testing.assert_array_equal(base.notify_ratio, other.notify_ratio)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    n=st.integers(0, 6),
    probe=st.sampled_from(COMPLETION_PROBES),
    rpn=st.one_of(st.integers(-1, 6), junk),
)
def test_diagnose_completion_on_any_matrices(data: Any, n: int, probe: str, rpn: Any) -> None:
    elements = st.floats(allow_nan=True, allow_infinity=True)
    shape = data.draw(st.sampled_from([(n, n), (n, n), (n, n + 1), (n,)]))
    cost = data.draw(hnp.arrays(np.float64, shape, elements=elements))
    samples = data.draw(hnp.arrays(np.float64, (n, n), elements=st.floats(0, 100)))
    try:
        with np.errstate(all="ignore"):
            result = diagnose_completion(cost, samples, probe, rpn, NormalConfig())
    except Exception as exc:
        names_field(exc, probe, "cost", "samples", "ranks_per_node")
        return
    walk_finite(result.to_dict())
    assert result.status in PROBE_STATUSES


# ---- the low-latency rule --------------------------------------------------------------------

MATRIX_FIELDS = (
    "mat",
    "thres_col",
    "thres_row",
    "thres_point",
    "suppress_points_in_strong_rowscols",
    "excluding_zeros",
    "phase",
    "config",
)


@settings(max_examples=200, deadline=None)
@given(
    mat=st.one_of(
        junk,
        st.lists(st.lists(st.integers(0, 10), max_size=4), max_size=4),
        hnp.arrays(
            st.sampled_from(
                [np.float64, np.float32, np.int64, np.uint8, np.bool_, np.complex128, np.str_]
            ),
            hnp.array_shapes(min_dims=0, max_dims=3, max_side=6),
        ),
        st.integers(1, 8).flatmap(
            lambda n: hnp.arrays(
                np.float64, (n, n), elements=st.floats(0, 1.7e308, allow_infinity=False)
            )
        ),
    ),
    thresholds=st.lists(st.one_of(st.floats(0, 20), junk), min_size=3, max_size=3),
    switches=st.lists(st.one_of(st.booleans(), st.integers(-1, 2), junk), min_size=2, max_size=2),
)
def test_diagnose_matrix_on_any_input(mat: Any, thresholds: list[Any], switches: list[Any]):
    try:
        with np.errstate(all="ignore"):
            result = diagnose_matrix(mat, *thresholds, *switches)
    except Exception as exc:
        names_field(exc, *MATRIX_FIELDS)
        return
    walk_finite(result)
    json.dumps(result, allow_nan=False)


@settings(max_examples=100, deadline=None)
@given(
    mat=st.integers(1, 8).flatmap(
        lambda n: hnp.arrays(np.float64, (n, n), elements=st.one_of(wide_values, st.floats(0)))
    ),
    phase=st.one_of(st.sampled_from(["dispatch", "combine"]), junk),
    excluding_zeros=st.integers(0, 1),
)
@example(mat=np.full((2, 2), 1.7e308), phase="dispatch", excluding_zeros=0)
@example(mat=np.array([[1.7e308, 5e-324], [0.0, 1e-300]]), phase="combine", excluding_zeros=1)
def test_diagnose_low_latency_results_are_finite(mat: Any, phase: Any, excluding_zeros: int):
    try:
        result = diagnose_low_latency(mat, phase, LowLatencyConfig(excluding_zeros=excluding_zeros))
    except Exception as exc:
        names_field(exc, *MATRIX_FIELDS)
        return
    data = result.to_dict()
    walk_finite(data)
    json.dumps(data, allow_nan=False)
    # Every ratio is a number, however large or small the waits (means near the float maximum
    # once overflowed to inf and gave NaN ratios).
    assert np.isfinite(result.row_ratios).all() and np.isfinite(result.col_ratios).all()
    for _, mean, ratio in result.abnormal_cols + result.abnormal_rows:
        assert math.isfinite(mean) and math.isfinite(ratio)


# ---- log lines -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(line=st.one_of(st.text(max_size=200), junk))
def test_parse_log_line_reads_a_line_or_names_it(line: Any) -> None:
    try:
        parsed = parse_log_line(line)
    except Exception as exc:
        names_field(exc, "line")
        return
    assert parsed.record in ("summary", "detail", "values", "invalid")


@settings(max_examples=150, deadline=None)
@given(
    instance_id=st.one_of(st.text(max_size=30), junk),
    ep_size=st.one_of(st.integers(-2, 2**40), junk),
    window_index=st.one_of(st.integers(-2, 2**40), junk),
    reason=st.one_of(st.text(max_size=20), junk),
    message=st.one_of(st.text(max_size=60), junk),
)
def test_invalid_window_lines_round_trip_any_text(
    instance_id: Any, ep_size: Any, window_index: Any, reason: Any, message: Any
) -> None:
    try:
        line = invalid_window_line(instance_id, ep_size, window_index, reason, message)
    except Exception as exc:
        names_field(exc, "ep_size", "window_index", "reason", "instance_id", "message")
        return
    assert "\n" not in line and "\r" not in line
    parsed = parse_log_line(line)
    assert parsed.record == "invalid"
    assert (parsed.ep_size, parsed.window_index) == (ep_size, window_index)
    assert parsed.payload["reason"] == reason
    assert parsed.payload["message"] == str(message)
    assert not re.search(r"\s", parsed.instance_id)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(realistic_windows(), st.one_of(st.none(), st.text(max_size=30)))
def test_log_lines_of_any_report_read_back_to_the_report(
    window: NormalWindow, instance_id: str | None
) -> None:
    report = NormalDiagnoser().diagnose(window)
    assume(report.ep_size == window.ep_size)
    lines = normal_log_lines(report, window, details=True, instance_id=instance_id)
    summary = parse_log_line(lines[0])
    assert summary.record == "summary"
    assert summary.payload["probes"] == {p: report.probes[p].status for p in PROBES}
    assert len(summary.payload["incidents"]) == len(report.incidents)
    for line in lines[1:]:
        parsed = parse_log_line(line)
        assert parsed.probe in PROBES
