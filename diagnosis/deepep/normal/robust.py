"""Robust statistics the normal-mode rules share: NaN-aware medians and the modified z-score.

Everything is vectorised: medians of many lanes at once come from one sort, never from a
Python loop over cells. NaN always means "no measurement" and is skipped, never counted.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "MAD_SCALE",
    "ZERO_SPREAD_TOLERANCE",
    "grouped_medians",
    "lane_medians",
    "median_excluding_self",
    "median_of_scratch",
    "modified_zscores",
    "nan_median",
    "robust_location_scale",
    "scores_from",
    "transposed_copy",
]

# 0.6745 is the 0.75 quantile of the standard normal: MAD / 0.6745 estimates sigma.
MAD_SCALE = 0.6745
# When the MAD is 0 (more than half the values identical), a deviation larger than this (in
# log units, i.e. a relative difference of 1e-6) is a real one: the values are counter ratios
# computed in float32 after centring, whose rounding stays well below it.
ZERO_SPREAD_TOLERANCE = 1e-6

# Below this share of valid cells a lane median is computed from the valid cells only (one
# sort of the compacted values) instead of sorting whole lanes that are mostly NaN.
_SPARSE_SHARE = 0.25


def median_of_scratch(values: np.ndarray) -> float:
    """Median of a 1-D array of finite values that the caller no longer needs (reordered).

    Equal to ``np.median``, about 3x faster on a million values: one partition around the
    upper middle (``np.median`` partitions around both middles and the end, to find NaNs,
    which costs several times more); the lower middle is then the largest value before it.
    """
    n = values.size
    if n == 0:
        return float("nan")
    h = n // 2
    values.partition(h)
    upper = float(values[h])
    if n % 2:
        return upper
    return (float(values[:h].max()) + upper) / 2.0


def nan_median(values: np.ndarray) -> float:
    """Median of the finite values; NaN when there are none."""
    flat = np.asarray(values).ravel()
    return median_of_scratch(flat[np.isfinite(flat)])


def _sorted_lane_medians(mat: np.ndarray, counts: np.ndarray, in_place: bool = False) -> np.ndarray:
    """Medians along axis 1 of a 2-D array whose invalid entries are NaN (sorted last).

    ``counts`` holds each lane's number of valid entries; ``in_place`` sorts ``mat`` itself
    (for a scratch copy the caller owns).
    """
    if in_place:
        mat.sort(axis=1)
        ordered = mat
    else:
        ordered = np.sort(mat, axis=1)
    lo = np.maximum((counts - 1) // 2, 0)
    hi = np.maximum(counts // 2, 0)
    rows = np.arange(mat.shape[0])
    with np.errstate(invalid="ignore"):
        med = 0.5 * (ordered[rows, lo].astype(np.float64) + ordered[rows, hi].astype(np.float64))
    med[counts == 0] = np.nan
    return med


def grouped_medians(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of ``values`` within each integer group ``0..n_groups-1`` (NaN: empty group).

    One lexsort of the values by (group, value); cost follows the number of values.
    """
    out = np.full(n_groups, np.nan)
    if values.size == 0:
        return out
    order = np.lexsort((values, groups))
    v = values[order].astype(np.float64)
    counts = np.bincount(groups, minlength=n_groups)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    has = counts > 0
    lo = starts[has] + (counts[has] - 1) // 2
    hi = starts[has] + counts[has] // 2
    out[has] = 0.5 * (v[lo] + v[hi])
    return out


def lane_medians(mat: np.ndarray, axis: int) -> np.ndarray:
    """NaN-skipping medians of a 2-D array along ``axis`` (0: per column, 1: per row).

    An all-NaN lane gives NaN. Dense arrays are sorted lane by lane in one call; sparse ones
    (under a quarter valid) are compacted first so the cost follows the number of valid cells.
    """
    arr = np.asarray(mat)
    if arr.ndim != 2:
        raise ValueError(f"mat: expected a 2-D array, got shape {arr.shape}")
    if axis not in (0, 1):
        raise ValueError(f"axis: must be 0 or 1, got {axis!r}")
    valid = ~np.isnan(arr)
    counts = np.count_nonzero(valid, axis=axis)  # valid entries per lane
    if arr.size and int(counts.sum()) < _SPARSE_SHARE * arr.size:
        idx = np.nonzero(valid)
        return grouped_medians(arr[idx], idx[1 - axis], arr.shape[1 - axis])
    if axis == 1:
        return _sorted_lane_medians(arr, counts)
    # An explicit copy (never a view of the caller's data), so it can be sorted where it lies.
    return _sorted_lane_medians(transposed_copy(arr), counts, in_place=True)


# Rows per strip of :func:`transposed_copy`: a strip of 32 rows is written as 32-value runs,
# which keeps both sides of the copy in cache (about 4x faster than one strided copy at 1,024).
_TRANSPOSE_STRIP = 32


def transposed_copy(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``arr.T`` (2-D), copied strip by strip for cache locality."""
    out = np.empty((arr.shape[1], arr.shape[0]), dtype=arr.dtype)
    for i in range(0, arr.shape[0], _TRANSPOSE_STRIP):
        out[:, i : i + _TRANSPOSE_STRIP] = arr[i : i + _TRANSPOSE_STRIP, :].T
    return out


def median_excluding_self(values: np.ndarray) -> np.ndarray:
    """For each finite entry, the median of the *other* finite entries (NaN if none remain).

    Removing a value leaves the order statistics of the other n - 1 known from four of the
    whole: the i-th remaining one is the i-th of all when the removed value lies above it,
    else the (i + 1)-th (a tie gives the same either way). One partition, no sort.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    out = np.full(x.shape, np.nan)
    finite = np.isfinite(x)
    idx = np.flatnonzero(finite)
    n = idx.size
    if n < 2:
        return out
    vals = x[idx]
    m = n - 1  # how many values remain
    lo_i = (m - 1) // 2
    hi_i = m // 2
    v = np.partition(vals, sorted({lo_i, lo_i + 1, hi_i, hi_i + 1}))

    def remaining(i: int) -> np.ndarray:
        # i-th order statistic of the remaining values, per removed value.
        return np.where(vals > v[i], v[i], v[i + 1])

    # The lower one plus half the difference: a sum of two durations near float64's top would
    # overflow to inf, and halving the smallest subnormals first would round them to 0.
    lower = remaining(lo_i)
    out[idx] = lower + 0.5 * (remaining(hi_i) - lower)
    return out


def robust_location_scale(values: np.ndarray) -> tuple[float, float]:
    """``(median, sigma)`` of the finite values, with sigma = MAD / 0.6745.

    When the MAD is 0 (more than half the values identical) sigma is 0: as in the modified
    z-score of the specification, a value that deviates at all from a spread of zero is an
    outlier (see :func:`scores_from`). No finite value gives ``(nan, nan)``.
    """
    flat = np.asarray(values, dtype=np.float64).ravel()
    finite = flat[np.isfinite(flat)]  # a copy: free to reorder
    if finite.size == 0:
        return float("nan"), float("nan")
    med = median_of_scratch(finite)
    np.subtract(finite, med, out=finite)
    mad = median_of_scratch(np.abs(finite, out=finite))
    return med, mad / MAD_SCALE


def scores_from(values: np.ndarray, center: float, sigma: float) -> np.ndarray:
    """``(x - center) / sigma``; with ``sigma == 0`` a deviation beyond ``ZERO_SPREAD_TOLERANCE``
    scores +-inf and anything closer scores 0 (float rounding is no deviation). NaN stays NaN.
    """
    x = np.asarray(values, dtype=np.float64)
    dev = x - center
    if sigma > 0:
        return dev / sigma
    with np.errstate(invalid="ignore"):
        out = np.where(np.abs(dev) > ZERO_SPREAD_TOLERANCE, np.sign(dev) * np.inf, 0.0)
    out[np.isnan(x)] = np.nan
    return out


def modified_zscores(values: np.ndarray) -> np.ndarray:
    """Modified z-score ``0.6745 * (x - median) / MAD`` of each entry; NaN stays NaN.

    With a MAD of 0, any real deviation is an infinite score (see :func:`scores_from`).
    """
    x = np.asarray(values, dtype=np.float64)
    med, sigma = robust_location_scale(x)
    if not np.isfinite(med):
        return np.full(x.shape, np.nan)
    return scores_from(x, med, sigma)
