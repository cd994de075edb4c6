"""Properties of the step-time diagnosis over arbitrary inputs (hypothesis)."""

from __future__ import annotations

import itertools
import json
import math
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.step_time import (
    KINDS,
    SIGNALS,
    STATUS_KINDS,
    StepTimeReport,
    diagnose_arrays,
    diagnose_means,
    diagnose_steps,
    rows_to_array,
)
from rankwatch.diagnosis.step_time.report import SCORE_HELD_AT_ONE

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The boundaries every property below must hold at, drawn on purpose (not left to luck): zero,
# the smallest subnormal, a subnormal input wait seen in a real failure, the smallest normal,
# tiny, ordinary and (for the extreme strategies) huge values up to the float maximum.
SMALL_BOUNDARIES = (0.0, 5e-324, 2.2e-309, sys.float_info.min, 1e-300, 1.0, 1e6)
HUGE_BOUNDARIES = (1e300, 1e308, sys.float_info.max)
times = st.one_of(
    st.sampled_from(SMALL_BOUNDARIES),
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False),
)
# Any finite non-negative float, subnormals and values near the float maximum included.
extreme_times = st.one_of(
    st.sampled_from(SMALL_BOUNDARIES + HUGE_BOUNDARIES),
    st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
)
maybe_time = st.one_of(st.none(), times)
maybe_extreme = st.one_of(st.none(), extreme_times)
strategies_ = st.sampled_from([None, "", "ddp", "fsdp", "DDP"])
mean_keys = (*SIGNALS, "residual")


def check_report(report: StepTimeReport) -> None:
    """Invariants every report keeps."""
    d = report.to_dict()
    text = json.dumps(d, allow_nan=False)  # raises on NaN or infinity
    assert json.loads(text) == d
    assert report.kind in KINDS
    assert report.findings and report.findings[0].kind == report.kind
    if report.kind in STATUS_KINDS:
        assert report.severity is None
        assert len(report.findings) == 1
    else:
        assert report.severity == report.findings[0].severity
    order = {"critical": 3, "warning": 2, "info": 1}
    sev = [order[f.severity] for f in report.findings]
    assert sev == sorted(sev, reverse=True)
    for f in report.findings:
        assert (math.isfinite(f.score) and f.score >= 0) or f.kind in STATUS_KINDS
        if f.is_straggler:
            assert f.culprit_rank in report.ranks and f.victim_rank in report.ranks
            assert set(f.component_coverage) == set(f.component_excesses_ms)
            assert all(0.0 <= c <= 1.0 for c in f.component_coverage.values())
    if report.straggler is not None:
        assert report.straggler.culprit_rank != report.straggler.victim_rank or (
            report.straggler.score == 0
        )
        assert report.straggler.score >= 0


@st.composite
def means_windows(draw: Any, values: Any = maybe_time) -> dict[int, dict[str, float | None] | None]:
    n = draw(st.integers(1, 8))
    ids = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    out: dict[int, dict[str, float | None] | None] = {}
    for rank in ids:
        if draw(st.integers(0, 9)) == 0:
            out[rank] = None
            continue
        out[rank] = {k: draw(values) for k in mean_keys}
    return out


# The window that once gave ``score=inf``: the victim's outer step is a subnormal input wait.
SUBNORMAL_OUTER = {
    0: {"input_wait": 2.2e-309, "forward": 40.0, "backward": 50.0, "step": 0.0},
    1: {"input_wait": 49.0, "forward": 40.0, "backward": 1.0, "step": 0.0},
}


@SETTINGS
@given(
    means=means_windows(),
    steps=st.integers(0, 200),
    strategy=strategies_,
    clock=st.sampled_from(["cpu", "gpu"]),
)
@example(means=SUBNORMAL_OUTER, steps=30, strategy=None, clock="cpu")
def test_any_finite_means_give_a_report(
    means: dict[int, Any], steps: int, strategy: str | None, clock: str
) -> None:
    report = diagnose_means(means, steps=steps, strategy=strategy, clock=clock)
    check_report(report)
    assert report.ranks == tuple(sorted(means))
    assert report.steps == steps


@SETTINGS
@given(means=means_windows(maybe_extreme), steps=st.integers(0, 200), strategy=strategies_)
def test_extreme_finite_means_give_a_report_without_nan(
    means: dict[int, Any], steps: int, strategy: str | None
) -> None:
    report = diagnose_means(means, steps=steps, strategy=strategy, clock="gpu")
    check_report(report)


def test_the_subnormal_outer_step_gives_a_finite_score_and_says_why() -> None:
    report = diagnose_means(SUBNORMAL_OUTER, steps=30)
    assert report.kind == "INPUT_STRAGGLER" and report.straggler is not None
    assert report.straggler.score == 1.0 and report.findings[0].score == 1.0
    assert report.straggler.score_note == SCORE_HELD_AT_ONE
    assert report.to_dict()["straggler"]["score_note"] == SCORE_HELD_AT_ONE


BOUNDARIES = SMALL_BOUNDARIES + HUGE_BOUNDARIES


@pytest.mark.parametrize(("low", "high"), list(itertools.combinations(BOUNDARIES, 2)))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_pair_of_boundary_values_gives_finite_scores(
    low: float, high: float, strategy: str
) -> None:
    """Mixed magnitudes on purpose: each pair of boundaries fills every signal of three ranks
    in turn (one rank all ``low``, one all ``high``, one alternating), on both clocks."""
    alternating = {k: (low, high)[i % 2] for i, k in enumerate(mean_keys)}
    means = {
        0: {k: low for k in SIGNALS},
        1: {k: high for k in SIGNALS},
        2: alternating,
        3: {k: (high, low)[i % 2] for i, k in enumerate(SIGNALS)},
    }
    for clock in ("cpu", "gpu"):
        report = diagnose_means(means, steps=30, strategy=strategy, clock=clock)
        check_report(report)
        if report.straggler is not None:
            assert 0.0 <= report.straggler.score <= 1.0
            assert (report.straggler.score_note == "") or (
                report.straggler.score_note == SCORE_HELD_AT_ONE
            )


@st.composite
def distinct_visible(draw: Any) -> tuple[dict[int, dict[str, float]], list[int]]:
    n = draw(st.integers(2, 9))
    backward = draw(
        st.lists(st.integers(1, 1000), min_size=n, max_size=n, unique=True).map(
            lambda xs: [x / 10.0 for x in xs]
        )
    )
    means = {}
    for rank in range(n):
        means[rank] = {
            "input_wait": draw(st.integers(0, 500)) / 10.0,
            "h2d": draw(st.integers(0, 100)) / 10.0,
            "forward": draw(st.integers(0, 1000)) / 10.0,
            "backward": backward[rank],
            "optimizer": draw(st.integers(0, 100)) / 10.0,
            "step": backward[rank] + draw(st.integers(1, 2000)) / 10.0,
        }
    ids = draw(st.lists(st.integers(0, 4096), min_size=n, max_size=n, unique=True))
    return means, ids


@SETTINGS
@given(case=distinct_visible(), steps=st.integers(2, 60), strategy=st.sampled_from([None, "ddp"]))
def test_permuting_rank_ids_permutes_the_culprit(
    case: tuple[dict[int, dict[str, float]], list[int]], steps: int, strategy: str | None
) -> None:
    means, ids = case
    relabel = dict(zip(sorted(means), ids, strict=True))
    a = diagnose_means(means, steps=steps, strategy=strategy)
    b = diagnose_means({relabel[r]: v for r, v in means.items()}, steps=steps, strategy=strategy)
    assert a.straggler is not None and b.straggler is not None
    assert b.straggler.culprit_rank == relabel[a.straggler.culprit_rank]
    assert b.straggler.victim_rank == relabel[a.straggler.victim_rank]
    assert b.straggler.score == a.straggler.score
    assert b.straggler.component == a.straggler.component
    assert [f.kind for f in b.findings] == [f.kind for f in a.findings]
    assert [f.severity for f in b.findings] == [f.severity for f in a.findings]
    for fa, fb in zip(a.findings, b.findings, strict=True):
        assert sorted(fb.ranks) == sorted(relabel[r] for r in fa.ranks)
        if fa.culprit_rank is not None:
            assert fb.culprit_rank == relabel[fa.culprit_rank]


@st.composite
def row_windows(draw: Any, values: Any = maybe_time) -> dict[int, list[dict[str, Any]]]:
    n = draw(st.integers(1, 4))
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in range(n):
        steps = draw(st.lists(st.integers(0, 12), max_size=8, unique=True))
        rows = []
        for s in steps:
            row: dict[str, Any] = {"step_id": s}
            for clock in ("cpu", "gpu"):
                if draw(st.booleans()):
                    row[clock] = {k: v for k in SIGNALS if (v := draw(values)) is not None}
            rows.append(row)
        out[rank] = rows
    return out


@SETTINGS
@given(per_rank=row_windows(), strategy=strategies_, window=st.integers(1, 10))
def test_any_finite_rows_give_a_report(
    per_rank: dict[int, list[dict[str, Any]]], strategy: str | None, window: int
) -> None:
    report = diagnose_steps(per_rank, strategy=strategy, window=window)
    check_report(report)
    assert report.steps <= window
    arrays = {r: rows_to_array(v) for r, v in per_rank.items()}
    assert diagnose_arrays(arrays, strategy=strategy, window=window) == report


@SETTINGS
@given(per_rank=row_windows(maybe_extreme), strategy=strategies_)
def test_extreme_finite_rows_give_a_report_without_nan(
    per_rank: dict[int, list[dict[str, Any]]], strategy: str | None
) -> None:
    report = diagnose_steps(per_rank, strategy=strategy, window=5)
    check_report(report)


@SETTINGS
@given(
    means=st.dictionaries(
        st.integers(0, 64),
        st.fixed_dictionaries({k: times for k in SIGNALS}),
        min_size=1,
        max_size=6,
    ),
    steps=st.integers(1, 30),
)
# Found by `make fuzz`: the input wait equals the step, every other phase 0, so the input and
# the residual shares are both one half; from the rows the residual's came out one unit of
# rounding larger (0.5000000000000001) and the headline was RESIDUAL_HEAVY, from the means
# INPUT_BOUND.
@example(
    means={0: {**dict.fromkeys(SIGNALS, 0.0), "input_wait": 381301.118, "step": 381301.118}},
    steps=24,
)
def test_constant_rows_match_means(means: dict[int, dict[str, float]], steps: int) -> None:
    per_rank = {r: [{"step_id": s, "cpu": dict(v)} for s in range(steps)] for r, v in means.items()}
    from_rows = diagnose_steps(per_rank)
    from_means = diagnose_means(means, steps=steps)
    assert from_rows.kind == from_means.kind
    assert from_rows.severity == from_means.severity
    if from_means.straggler is None:
        assert from_rows.straggler is None
    else:
        assert from_rows.straggler is not None
        assert from_rows.straggler.culprit_rank == from_means.straggler.culprit_rank
        assert from_rows.straggler.score == pytest.approx(from_means.straggler.score)


@SETTINGS
@given(
    per_rank=row_windows(),
    value=st.one_of(
        st.floats(max_value=-1e-9, allow_nan=False),
        st.just(math.nan),
        st.just(math.inf),
    ),
    data=st.data(),
)
def test_any_bad_time_is_rejected_naming_rank_and_field(
    per_rank: dict[int, list[dict[str, Any]]], value: float, data: Any
) -> None:
    cells = [
        (rank, i, clock)
        for rank, rows in per_rank.items()
        for i, row in enumerate(rows)
        for clock in ("cpu", "gpu")
        if clock in row
    ]
    assume(cells)
    rank, i, clock = data.draw(st.sampled_from(cells))
    signal = data.draw(st.sampled_from(SIGNALS))
    per_rank[rank][i][clock][signal] = value
    with pytest.raises(ValueError) as info:
        diagnose_steps(per_rank)
    msg = str(info.value)
    assert f"rank {rank}" in msg and f"{clock}.{signal}" in msg and repr(value) in msg
    arr = np.full((1, 13), np.nan)
    arr[0, 0] = 0
    arr[0, 1 + SIGNALS.index(signal)] = value
    if not math.isnan(value):
        with pytest.raises(ValueError, match=f"rank {rank}"):
            diagnose_arrays({rank: arr})
