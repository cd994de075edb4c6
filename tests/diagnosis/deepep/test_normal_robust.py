"""Robust statistics: NaN-aware lane medians, median of the others, modified z-score."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rankwatch.diagnosis.deepep.normal.robust import (
    grouped_medians,
    lane_medians,
    median_excluding_self,
    median_of_scratch,
    modified_zscores,
    nan_median,
    robust_location_scale,
)

finite_or_nan = st.one_of(st.floats(-1e6, 1e6, allow_nan=False), st.just(float("nan")))


def _reference_nanmedian(a, axis):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmedian(a, axis=axis)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float64, st.tuples(st.integers(1, 9), st.integers(1, 9)), elements=finite_or_nan))
def test_lane_medians_match_nanmedian(a):
    for axis in (0, 1):
        assert np.allclose(lane_medians(a, axis), _reference_nanmedian(a, axis), equal_nan=True)


def test_lane_medians_sparse_path_matches():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 30))
    a[rng.random(a.shape) < 0.9] = np.nan  # under a quarter valid: the compacted path
    for axis in (0, 1):
        assert np.allclose(lane_medians(a, axis), _reference_nanmedian(a, axis), equal_nan=True)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float64, st.integers(0, 12), elements=finite_or_nan))
def test_median_excluding_self_matches_definition(x):
    got = median_excluding_self(x)
    for i in range(x.size):
        others = np.delete(x, i)
        others = others[np.isfinite(others)]
        if not np.isfinite(x[i]) or others.size == 0:
            assert np.isnan(got[i])
        else:
            assert got[i] == pytest.approx(np.median(others))


def test_grouped_medians():
    values = np.array([5.0, 1.0, 3.0, 2.0, 4.0])
    groups = np.array([0, 0, 0, 2, 2])
    out = grouped_medians(values, groups, 4)
    assert out[0] == 3.0 and out[2] == 3.0
    assert np.isnan(out[1]) and np.isnan(out[3])


def test_modified_zscore_definition():
    x = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
    med, mad = 3.0, 1.0
    assert modified_zscores(x)[4] == pytest.approx(0.6745 * (100.0 - med) / mad)


def test_mad_zero_makes_any_real_deviation_an_infinite_score():
    x = np.array([0.0, 0.0, 0.0, 0.0, 1.0, -0.5, 1e-9])
    med, sigma = robust_location_scale(x)
    assert (med, sigma) == (0.0, 0.0)
    z = modified_zscores(x)
    assert z[4] == np.inf and z[5] == -np.inf
    assert z[6] == 0.0  # within float rounding: no deviation


def test_all_equal_values_score_zero():
    x = np.array([2.0, 2.0, np.nan])
    z = modified_zscores(x)
    assert z[0] == 0.0 and z[1] == 0.0 and np.isnan(z[2])


def test_no_finite_value():
    assert np.isnan(modified_zscores(np.array([np.nan]))).all()
    assert np.isnan(nan_median(np.array([np.nan, np.inf])))
    assert all(np.isnan(v) for v in robust_location_scale(np.array([])))


def test_bad_input():
    with pytest.raises(ValueError, match="mat"):
        lane_medians(np.ones(3), 0)
    with pytest.raises(ValueError, match="axis"):
        lane_medians(np.ones((3, 3)), 2)


def test_lane_medians_leave_the_input_alone():
    rng = np.random.default_rng(1)
    for a in (rng.normal(size=(6, 5)), np.asfortranarray(rng.normal(size=(6, 5)))):
        before = a.copy()
        lane_medians(a, 0)
        lane_medians(a, 1)
        assert np.array_equal(a, before)


def test_transposed_copy_matches_numpy_for_any_shape():
    from rankwatch.diagnosis.deepep.normal.robust import transposed_copy

    rng = np.random.default_rng(0)
    for shape in ((1, 1), (3, 70), (70, 3), (33, 65), (64, 64)):
        x = rng.normal(size=shape).astype(np.float32)
        out = transposed_copy(x)
        assert out.flags.c_contiguous and np.array_equal(out, x.T)


@settings(max_examples=100, deadline=None)
@given(arrays(np.float64, st.integers(1, 40), elements=st.floats(-1e6, 1e6, allow_nan=False)))
def test_median_of_scratch_equals_numpy_median(x):
    # Exactly equal, ties and odd/even sizes included: the point residual scores depend on it.
    assert median_of_scratch(x.copy()) == float(np.median(x))


def test_robust_location_scale_equals_the_numpy_definition():
    rng = np.random.default_rng(3)
    x = rng.lognormal(0.0, 0.02, 100_001).astype(np.float32)
    x[::97] = np.nan
    finite = x[np.isfinite(x)].astype(np.float64)
    med = float(np.median(finite))
    assert robust_location_scale(x) == (med, float(np.median(np.abs(finite - med))) / 0.6745)
    assert np.isnan(median_of_scratch(np.empty(0)))


@settings(max_examples=100, deadline=None)
@given(arrays(np.float64, st.integers(2, 30), elements=st.integers(0, 3).map(float)))
def test_median_excluding_self_with_many_ties(x):
    # Ties everywhere: every removed value's neighbours are equal to it somewhere.
    got = median_excluding_self(x)
    for i in range(x.size):
        others = np.sort(np.delete(x, i))
        m = others.size
        assert got[i] == 0.5 * others[(m - 1) // 2] + 0.5 * others[m // 2]
