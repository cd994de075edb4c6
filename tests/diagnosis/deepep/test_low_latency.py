"""The low-latency receive-wait matrix rule: DeepXTrace-compatible results, bounds, bad input."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rankwatch.diagnosis.config import LowLatencyConfig
from rankwatch.diagnosis.deepep.low_latency import (
    DENOMINATOR_EPSILON,
    LowLatencyResult,
    diagnose_low_latency,
    diagnose_matrix,
)


def _background(seed: int = 7, n: int = 8) -> np.ndarray:
    """Healthy waits: every cell between 10 and 20 cycles."""
    return np.random.default_rng(seed).integers(10, 21, size=(n, n)).astype(np.int64)


def _sparse(n: int = 16) -> np.ndarray:
    """A hierarchical-kernel matrix: each rank waits on one peer only, 20 cycles."""
    mat = np.zeros((n, n))
    mat[np.arange(n), (np.arange(n) + n // 2) % n] = 20.0
    return mat


def _reference(mat, thres_col, thres_row, thres_point, suppress, excluding_zeros):
    """The documented rule written cell by cell, to pin the vectorised version against."""
    m = [[float(v) for v in row] for row in np.asarray(mat)]
    n = len(m)
    col_means = [sum(m[i][j] for i in range(n)) / n for j in range(n)]
    row_means = [sum(m[i]) / n for i in range(n)]
    col_base = sum(col_means) / n + 1e-8
    row_base = sum(row_means) / n + 1e-8
    cols = [j for j in range(n) if col_means[j] / col_base > thres_col]
    rows = [i for i in range(n) if row_means[i] / row_base > thres_row]
    cells = [m[i][j] for i in range(n) for j in range(n)]
    if excluding_zeros:
        nz = [v for v in cells if v != 0]
        base = (sum(nz) / len(nz) if nz else 0.0) + 1e-8
    else:
        base = sum(cells) / len(cells) + 1e-8
    points = [
        (i, j)
        for i in range(n)
        for j in range(n)
        if m[i][j] / base > thres_point and not (suppress and (i in rows or j in cols))
    ]
    return cols, rows, points


# --- the three documented scenarios -------------------------------------------------------


def test_slow_column_is_a_slow_peer() -> None:
    mat = _background()
    mat[:, 3] += 100  # every rank waits ~100 cycles longer for peer 3
    res = diagnose_matrix(mat)
    assert [c[0] for c in res["abnormal_cols"]] == [3]
    assert res["abnormal_rows"] == []
    assert res["abnormal_points"] == []
    _, mean, ratio = res["abnormal_cols"][0]
    assert mean == pytest.approx(mat[:, 3].mean())
    col_means = mat.mean(axis=0)
    assert ratio == pytest.approx(col_means[3] / (col_means.mean() + 1e-8))
    assert ratio > 3.0


def test_slow_row_is_a_waiting_rank() -> None:
    mat = _background()
    mat[6, :] += 120
    res = diagnose_matrix(mat)
    assert [r[0] for r in res["abnormal_rows"]] == [6]
    assert res["abnormal_cols"] == []
    assert res["abnormal_rows"][0][1] == pytest.approx(mat[6].mean())


def test_single_slow_path_is_a_point() -> None:
    mat = _background()
    mat[3, 4] = 125
    res = diagnose_matrix(mat)
    assert res["abnormal_cols"] == [] and res["abnormal_rows"] == []
    assert len(res["abnormal_points"]) == 1
    i, j, value, ratio = res["abnormal_points"][0]
    assert (i, j, value) == (3, 4, 125)
    assert ratio == pytest.approx(125 / (mat.mean() + 1e-8))


def test_points_inside_a_flagged_row_are_suppressed_by_default() -> None:
    mat = _background()
    mat[2, :] = 300  # a row strong enough that each of its cells also passes the point rule
    suppressed = diagnose_matrix(mat)
    assert [r[0] for r in suppressed["abnormal_rows"]] == [2]
    assert suppressed["abnormal_points"] == []
    kept = diagnose_matrix(mat, suppress_points_in_strong_rowscols=False)
    assert [(p[0], p[1]) for p in kept["abnormal_points"]] == [(2, j) for j in range(8)]
    # 0/1 works like False/True.
    assert diagnose_matrix(mat, suppress_points_in_strong_rowscols=0) == kept


def test_points_inside_a_flagged_column_are_suppressed_but_others_kept() -> None:
    mat = _background(n=16)
    mat[:, 5] = 400
    mat[9, 1] = 900  # a path outside the slow column
    res = diagnose_matrix(mat)
    assert [c[0] for c in res["abnormal_cols"]] == [5]
    assert [(p[0], p[1]) for p in res["abnormal_points"]] == [(9, 1)]


# --- boundaries ---------------------------------------------------------------------------


@pytest.mark.parametrize("axis", ["col", "row", "point"])
def test_threshold_comparison_is_strict(axis: str) -> None:
    mat = _background()
    mat[:, 2] += 60
    mat[5, :] += 60
    mat[1, 7] = 200
    probe = diagnose_matrix(
        mat, thres_col=0.0, thres_row=0.0, thres_point=0.0, suppress_points_in_strong_rowscols=0
    )
    key = {"col": "abnormal_cols", "row": "abnormal_rows", "point": "abnormal_points"}[axis]
    top = max(entry[-1] for entry in probe[key])  # the largest ratio on that axis
    kwargs = {"col": "thres_col", "row": "thres_row", "point": "thres_point"}
    at = diagnose_matrix(mat, **{kwargs[axis]: top}, suppress_points_in_strong_rowscols=False)
    below = diagnose_matrix(
        mat, **{kwargs[axis]: math.nextafter(top, 0.0)}, suppress_points_in_strong_rowscols=False
    )
    assert all(entry[-1] != top for entry in at[key])  # equal to the threshold: not flagged
    assert any(entry[-1] == top for entry in below[key])  # just below: flagged


def test_denominators_carry_the_epsilon() -> None:
    # One cell of 1e-8: the plain ratio would be 4 (= n*n); with 1e-8 added to the mean it is 0.8.
    mat = np.zeros((2, 2))
    mat[0, 0] = 1e-8
    res = diagnose_matrix(
        mat, thres_col=0.5, thres_row=0.5, thres_point=0.5, suppress_points_in_strong_rowscols=0
    )
    assert res["abnormal_points"] == [[0, 0, 1e-8, pytest.approx(0.8)]]
    # Column means (5e-9, 0): ratio 5e-9 / (2.5e-9 + 1e-8) = 0.4 < 0.5 -> not flagged.
    assert res["abnormal_cols"] == [] and res["abnormal_rows"] == []
    assert DENOMINATOR_EPSILON == 1e-8


@pytest.mark.parametrize("excluding_zeros", [False, True, 0, 1])
def test_all_zero_matrix_has_no_anomaly_and_zero_ratios(excluding_zeros: bool | int) -> None:
    mat = np.zeros((8, 8), dtype=np.int64)
    res = diagnose_matrix(mat, excluding_zeros=excluding_zeros)
    assert res == {"abnormal_cols": [], "abnormal_rows": [], "abnormal_points": []}
    out = diagnose_low_latency(
        mat, "dispatch", LowLatencyConfig(excluding_zeros=int(excluding_zeros))
    )
    assert out.row_ratios.tolist() == [0.0] * 8 and out.col_ratios.tolist() == [0.0] * 8
    assert not out.anomalous


def test_excluding_zeros_uses_the_mean_of_non_zero_cells() -> None:
    # Hierarchical kernels: each rank talks to one peer only; the rest of the matrix is zero.
    mat = _sparse()
    mat[3, 7] = 200.0
    with_zeros = diagnose_matrix(mat, thres_row=100, thres_col=100)
    # The zeros deflate the mean (about 2): every live cell looks ~10x "slow".
    assert len(with_zeros["abnormal_points"]) == 17
    without = diagnose_matrix(mat, thres_row=100, thres_col=100, excluding_zeros=1)
    nz_mean = mat[mat != 0].mean()
    assert without["abnormal_points"] == [[3, 7, 200.0, pytest.approx(200 / (nz_mean + 1e-8))]]
    # The switch touches only the point rule.
    assert with_zeros["abnormal_rows"] == without["abnormal_rows"]
    assert with_zeros["abnormal_cols"] == without["abnormal_cols"]


def test_single_rank_matrix() -> None:
    res = diagnose_matrix(np.array([[5]]))
    assert res == {"abnormal_cols": [], "abnormal_rows": [], "abnormal_points": []}


# --- output types -------------------------------------------------------------------------


def test_returns_plain_python_numbers_keeping_the_cell_type() -> None:
    mat = _background()
    mat[:, 1] += 200
    mat[4, 6] = 2000
    res = diagnose_matrix(mat, suppress_points_in_strong_rowscols=False)
    j, mean, ratio = res["abnormal_cols"][0]
    assert type(j) is int and type(mean) is float and type(ratio) is float
    i, j, value, ratio = res["abnormal_points"][0]
    assert (type(i), type(j), type(value), type(ratio)) == (int, int, int, float)
    res_f = diagnose_matrix(mat.astype(np.float32), suppress_points_in_strong_rowscols=False)
    assert type(res_f["abnormal_points"][0][2]) is float
    json.dumps(res)  # numpy scalars would fail here
    # Lists of lists are accepted too.
    assert diagnose_matrix(mat.tolist(), suppress_points_in_strong_rowscols=False) == res


@settings(max_examples=60, deadline=None)
@given(
    mat=hnp.arrays(
        np.int64,
        st.integers(1, 9).map(lambda n: (n, n)),
        elements=st.one_of(st.just(0), st.integers(0, 50), st.integers(0, 10_000)),
    ),
    thres=st.tuples(st.floats(0.5, 6.0), st.floats(0.5, 6.0), st.floats(0.5, 12.0), st.booleans()),
    excluding_zeros=st.booleans(),
)
def test_vectorised_rule_matches_the_cell_by_cell_reference(mat, thres, excluding_zeros) -> None:
    t_col, t_row, t_point, suppress = thres
    res = diagnose_matrix(mat, t_col, t_row, t_point, suppress, excluding_zeros)
    cols, rows, points = _reference(mat, t_col, t_row, t_point, suppress, excluding_zeros)
    assert [c[0] for c in res["abnormal_cols"]] == cols
    assert [r[0] for r in res["abnormal_rows"]] == rows
    assert [(p[0], p[1]) for p in res["abnormal_points"]] == points
    json.dumps(res, allow_nan=False)


# --- LowLatencyResult ---------------------------------------------------------------------


def test_result_carries_config_thresholds_and_ratios() -> None:
    mat = _background()
    mat[:, 3] += 100
    out = diagnose_low_latency(mat, "combine")
    assert isinstance(out, LowLatencyResult)
    assert out.phase == "combine" and out.ep_size == 8 and out.anomalous
    assert [c[0] for c in out.abnormal_cols] == [3]
    col_means = mat.mean(axis=0)
    np.testing.assert_allclose(out.col_ratios, col_means / (col_means.mean() + 1e-8))
    assert out.abnormal_cols[0][2] == pytest.approx(float(out.col_ratios[3]))
    # A looser column threshold from the config clears it.
    relaxed = diagnose_low_latency(mat, "combine", LowLatencyConfig(thres_col=10.0))
    assert relaxed.abnormal_cols == () and not relaxed.anomalous


def test_result_uses_the_config_excluding_zeros_switch() -> None:
    mat = _sparse()
    plain = diagnose_low_latency(mat, "dispatch", LowLatencyConfig(thres_row=100, thres_col=100))
    excl = diagnose_low_latency(
        mat, "dispatch", LowLatencyConfig(thres_row=100, thres_col=100, excluding_zeros=1)
    )
    assert len(plain.abnormal_points) == 16 and excl.abnormal_points == ()


def test_result_to_dict_is_json_ready_and_immutable() -> None:
    mat = _background()
    mat[4, 6] = 2000
    out = diagnose_low_latency(mat, "dispatch")
    d = out.to_dict()
    assert set(d) == {
        "phase",
        "abnormal_cols",
        "abnormal_rows",
        "abnormal_points",
        "row_ratios",
        "col_ratios",
    }
    assert d["abnormal_points"] == diagnose_matrix(mat)["abnormal_points"]
    assert len(d["row_ratios"]) == 8 and all(type(v) is float for v in d["col_ratios"])
    json.dumps(d, allow_nan=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.phase = "combine"  # type: ignore[misc]
    with pytest.raises(ValueError):
        out.row_ratios[0] = 1.0
    mat[0, 0] = 99999  # the result kept its own copy
    assert out.matrix[0, 0] != 99999


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mat", "exc", "needle"),
    [
        (np.zeros(4), ValueError, "mat: expected a 2-D matrix, got shape (4,)"),
        (np.zeros((2, 2, 2)), ValueError, "got shape (2, 2, 2)"),
        (np.zeros((2, 3)), ValueError, "square [EP, EP] matrix, got shape (2, 3)"),
        (np.zeros((0, 0)), ValueError, "at least one rank"),
        (np.array([[1.0, np.nan], [0, 0]]), ValueError, "mat[0, 1]: must be finite, got nan"),
        (np.array([[1.0, 0], [np.inf, 0]]), ValueError, "mat[1, 0]: must be finite, got inf"),
        (np.array([[1, 0], [0, -3]]), ValueError, "mat[1, 1]: must be >= 0"),
        (np.array([["a", "b"], ["c", "d"]]), TypeError, "mat: expected an integer or float"),
        (np.ones((2, 2), dtype=bool), TypeError, "dtype bool"),
        ([[1, 2], [3]], ValueError, "mat: expected a 2-D numeric array"),
        (None, TypeError, "dtype object"),
    ],
)
def test_bad_matrix_is_rejected_naming_it(mat: object, exc: type, needle: str) -> None:
    with pytest.raises(exc) as info:
        diagnose_matrix(mat)
    assert needle in str(info.value)
    with pytest.raises(exc):
        diagnose_low_latency(mat, "dispatch")


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"thres_col": "3"}, TypeError, "thres_col: expected a number, got '3'"),
        ({"thres_row": float("nan")}, ValueError, "thres_row: must be a finite number"),
        ({"thres_point": -1.0}, ValueError, "thres_point: must be a finite number >= 0, got -1.0"),
        ({"thres_col": True}, TypeError, "thres_col"),
        ({"excluding_zeros": 2}, ValueError, "excluding_zeros: expected 0 or 1, got 2"),
        ({"excluding_zeros": "1"}, TypeError, "excluding_zeros: expected a bool or 0/1"),
        (
            {"suppress_points_in_strong_rowscols": None},
            TypeError,
            "suppress_points_in_strong_rowscols",
        ),
    ],
)
def test_bad_options_are_rejected_naming_them(kwargs: dict, exc: type, needle: str) -> None:
    with pytest.raises(exc) as info:
        diagnose_matrix(np.ones((4, 4)), **kwargs)
    assert needle in str(info.value)


def test_bad_phase_and_config_are_rejected() -> None:
    wanted = r"phase: must be one of \['dispatch', 'combine'\], got 'x'"
    with pytest.raises(ValueError, match=wanted):
        diagnose_low_latency(np.ones((2, 2)), "x")
    with pytest.raises(TypeError, match="config: expected LowLatencyConfig or None, got dict"):
        diagnose_low_latency(np.ones((2, 2)), "dispatch", {"thres_col": 1.0})  # type: ignore[arg-type]
