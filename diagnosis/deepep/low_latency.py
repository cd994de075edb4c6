"""DeepEP low-latency mode: the receive-wait matrix rule.

In low-latency mode every rank accumulates, per peer, the cycles it spent waiting to receive
that peer's tokens. Gathering one vector per rank gives a square matrix ``M[i, j]``: row ``i`` is
the rank whose kernel recorded the wait, column ``j`` the peer it waited for. The rule is
mean-normalised and deliberately simple:

* a column is abnormal when its mean divided by the mean of all column means is strictly greater
  than ``thres_col`` (every rank waits for peer ``j``: ``j`` is slow to send);
* a row is abnormal when its mean divided by the mean of all row means is strictly greater than
  ``thres_row`` (rank ``i`` waits for everyone);
* a cell is abnormal when its value divided by the matrix mean is strictly greater than
  ``thres_point`` (one slow path); with ``excluding_zeros`` the denominator is the mean of the
  non-zero cells only, because hierarchical (NVLink + RDMA) kernels leave most cells at zero and
  those zeros would otherwise deflate the mean and inflate every ratio;
* cells inside a flagged row or column are not reported again as points (by default).

Each denominator gets ``1e-8`` added so an all-zero matrix gives ratios of zero, never a
division by zero. :func:`diagnose_matrix` returns the same dictionary shape as DeepXTrace's
``Diagnose.diagnose_matrix`` (so existing callers keep working) with plain Python numbers;
:func:`diagnose_low_latency` wraps it into a :class:`LowLatencyResult` with the configured
thresholds.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from rankwatch.diagnosis.config import LowLatencyConfig, config_or_default
from rankwatch.diagnosis.headroom import headroom_shift

__all__ = [
    "DENOMINATOR_EPSILON",
    "PHASES",
    "LowLatencyResult",
    "diagnose_low_latency",
    "diagnose_matrix",
]

# Added to every mean used as a denominator, as DeepXTrace does.
DENOMINATOR_EPSILON = 1e-8
PHASES: tuple[str, ...] = ("dispatch", "combine")

Phase = Literal["dispatch", "combine"]


@dataclass(frozen=True)
class _Ratios:
    """Everything the rule computes for one matrix; the public results are views of it."""

    matrix: np.ndarray
    row_means: np.ndarray
    col_means: np.ndarray
    row_ratios: np.ndarray
    col_ratios: np.ndarray
    point_ratios: np.ndarray
    abnormal_rows: np.ndarray
    abnormal_cols: np.ndarray
    point_rows: np.ndarray
    point_cols: np.ndarray


def _check_matrix(mat: object) -> np.ndarray:
    """The matrix as a validated float64 array; ``ValueError``/``TypeError`` naming ``mat``."""
    if isinstance(mat, np.ndarray):
        arr = mat
    else:
        try:
            arr = np.asarray(mat)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"mat: expected a 2-D numeric array, got {type(mat).__name__} ({exc})"
            ) from None
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iuf":
        raise TypeError(f"mat: expected an integer or float array, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"mat: expected a 2-D matrix, got shape {arr.shape}")
    rows, cols = arr.shape
    if rows != cols:
        raise ValueError(f"mat: expected a square [EP, EP] matrix, got shape {arr.shape}")
    if rows == 0:
        raise ValueError(f"mat: expected at least one rank, got shape {arr.shape}")
    values = arr.astype(np.float64, copy=False)
    finite = np.isfinite(values)
    if not finite.all():
        i, j = np.argwhere(~finite)[0]
        raise ValueError(f"mat[{i}, {j}]: must be finite, got {values[i, j].item()!r}")
    negative = values < 0
    if negative.any():
        i, j = np.argwhere(negative)[0]
        raise ValueError(f"mat[{i}, {j}]: must be >= 0 (cycles waited), got {arr[i, j].item()!r}")
    return arr


def _check_threshold(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    return out


def _check_switch(name: str, value: object) -> bool:
    # DeepXTrace callers pass 0/1 (from an environment variable) as often as True/False.
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(value)
    if isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    raise TypeError(f"{name}: expected a bool or 0/1, got {value!r}")


def _compute(
    mat: object,
    thres_col: object,
    thres_row: object,
    thres_point: object,
    suppress: object,
    excluding_zeros: object,
) -> _Ratios:
    arr = _check_matrix(mat)
    t_col = _check_threshold("thres_col", thres_col)
    t_row = _check_threshold("thres_row", thres_row)
    t_point = _check_threshold("thres_point", thres_point)
    suppress_flag = _check_switch("suppress_points_in_strong_rowscols", suppress)
    exclude_flag = _check_switch("excluding_zeros", excluding_zeros)

    values = arr.astype(np.float64, copy=False)
    # Means of values near float64's maximum would overflow: ratios are formed on values
    # scaled by a power of two (see headroom), the epsilon with them; means are scaled back.
    shift = headroom_shift(values)
    scaled = np.ldexp(values, -shift) if shift else values
    epsilon = math.ldexp(DENOMINATOR_EPSILON, -shift)
    col_means = scaled.mean(axis=0)
    row_means = scaled.mean(axis=1)
    col_ratios = col_means / (col_means.mean() + epsilon)
    row_ratios = row_means / (row_means.mean() + epsilon)
    if exclude_flag:
        nonzero = scaled[values != 0]
        # No non-zero cell: every cell is 0, so any finite denominator gives ratio 0.
        point_base = float(nonzero.mean()) if nonzero.size else 0.0
    else:
        point_base = float(scaled.mean())
    point_ratios = scaled / (point_base + epsilon)
    if shift:
        col_means, row_means = np.ldexp(col_means, shift), np.ldexp(row_means, shift)

    abnormal_cols = np.flatnonzero(col_ratios > t_col)
    abnormal_rows = np.flatnonzero(row_ratios > t_row)
    flagged = point_ratios > t_point
    if suppress_flag:
        flagged[abnormal_rows, :] = False
        flagged[:, abnormal_cols] = False
    # np.nonzero walks row-major, the order DeepXTrace reports points in.
    point_rows, point_cols = np.nonzero(flagged)
    return _Ratios(
        matrix=arr,
        row_means=row_means,
        col_means=col_means,
        row_ratios=row_ratios,
        col_ratios=col_ratios,
        point_ratios=point_ratios,
        abnormal_rows=abnormal_rows,
        abnormal_cols=abnormal_cols,
        point_rows=point_rows,
        point_cols=point_cols,
    )


def _cols(r: _Ratios) -> list[list[Any]]:
    return [[int(j), float(r.col_means[j]), float(r.col_ratios[j])] for j in r.abnormal_cols]


def _rows(r: _Ratios) -> list[list[Any]]:
    return [[int(i), float(r.row_means[i]), float(r.row_ratios[i])] for i in r.abnormal_rows]


def _points(r: _Ratios) -> list[list[Any]]:
    # ``.item()`` keeps the caller's element type: an int64 matrix reports int cell values.
    return [
        [int(i), int(j), r.matrix[i, j].item(), float(r.point_ratios[i, j])]
        for i, j in zip(r.point_rows, r.point_cols, strict=True)
    ]


def diagnose_matrix(
    mat: object,
    thres_col: float = 3.0,
    thres_row: float = 3.0,
    thres_point: float = 5.0,
    suppress_points_in_strong_rowscols: bool | int = True,
    excluding_zeros: bool | int = False,
) -> dict[str, list[list[Any]]]:
    """Find abnormal columns, rows and cells of a low-latency receive-wait matrix.

    Drop-in compatible with DeepXTrace's ``Diagnose.diagnose_matrix``. ``mat[i, j]`` is the
    cumulative wait of rank ``i`` for peer ``j`` (any square, finite, non-negative integer or
    float matrix). Comparisons are strict (``ratio > threshold``); every denominator has 1e-8
    added. ``excluding_zeros`` (bool or 0/1) makes the point rule divide by the mean of the
    non-zero cells. Returns::

        {"abnormal_cols": [[j, col_mean, ratio], ...],
         "abnormal_rows": [[i, row_mean, ratio], ...],
         "abnormal_points": [[i, j, value, ratio], ...]}

    in ascending index order (points row-major), with plain Python ints and floats.
    Raises ``ValueError``/``TypeError`` naming the argument and the bad value.
    """
    r = _compute(
        mat, thres_col, thres_row, thres_point, suppress_points_in_strong_rowscols, excluding_zeros
    )
    return {"abnormal_cols": _cols(r), "abnormal_rows": _rows(r), "abnormal_points": _points(r)}


def _finite_or_none(values: np.ndarray) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in values.tolist()]


@dataclass(frozen=True)
class LowLatencyResult:
    """The low-latency rule's verdict on one phase's matrix of one window.

    ``abnormal_cols``/``abnormal_rows`` hold ``(index, mean, ratio)``, ``abnormal_points``
    ``(row, col, value, ratio)``; ``row_ratios``/``col_ratios`` are every row's and column's
    ratio (read-only float64), so publishers can export them without re-running the rule.
    """

    phase: str
    matrix: np.ndarray
    abnormal_cols: tuple[tuple[int, float, float], ...]
    abnormal_rows: tuple[tuple[int, float, float], ...]
    abnormal_points: tuple[tuple[int, int, float, float], ...]
    row_ratios: np.ndarray
    col_ratios: np.ndarray

    @property
    def ep_size(self) -> int:
        return int(self.matrix.shape[0])

    @property
    def anomalous(self) -> bool:
        """True when any column, row or point was flagged."""
        return bool(self.abnormal_cols or self.abnormal_rows or self.abnormal_points)

    def to_dict(self) -> dict[str, Any]:
        """DeepXTrace's result shape plus ``phase`` and the ratios; JSON-ready, never NaN."""
        return {
            "phase": self.phase,
            "abnormal_cols": [list(c) for c in self.abnormal_cols],
            "abnormal_rows": [list(r) for r in self.abnormal_rows],
            "abnormal_points": [list(p) for p in self.abnormal_points],
            "row_ratios": _finite_or_none(self.row_ratios),
            "col_ratios": _finite_or_none(self.col_ratios),
        }


def diagnose_low_latency(
    mat: object, phase: str, config: LowLatencyConfig | None = None
) -> LowLatencyResult:
    """Run :func:`diagnose_matrix` with ``config``'s thresholds on one phase's matrix.

    ``phase`` is ``"dispatch"`` or ``"combine"``; ``config`` defaults to ``LowLatencyConfig()``
    (DeepXTrace's defaults, overridable through ``DEEPEP_DIAGNOSE_THRESHOLD_*``). Points inside
    flagged rows or columns are always suppressed, as in DeepXTrace's runtime.
    """
    if not isinstance(phase, str) or phase not in PHASES:
        raise ValueError(f"phase: must be one of {list(PHASES)}, got {phase!r}")
    config = config_or_default(config, LowLatencyConfig)
    r = _compute(
        mat, config.thres_col, config.thres_row, config.thres_point, True, config.excluding_zeros
    )
    matrix = np.array(r.matrix, copy=True)
    row_ratios = np.array(r.row_ratios, dtype=np.float64, copy=True)
    col_ratios = np.array(r.col_ratios, dtype=np.float64, copy=True)
    for a in (matrix, row_ratios, col_ratios):
        a.setflags(write=False)
    return LowLatencyResult(
        phase=phase,
        matrix=matrix,
        abnormal_cols=tuple((c[0], c[1], c[2]) for c in _cols(r)),
        abnormal_rows=tuple((c[0], c[1], c[2]) for c in _rows(r)),
        abnormal_points=tuple((p[0], p[1], p[2], p[3]) for p in _points(r)),
        row_ratios=row_ratios,
        col_ratios=col_ratios,
    )
