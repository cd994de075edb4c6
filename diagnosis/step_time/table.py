"""Step-time windows: per-step rows in, per-rank window means out.

The collectors of every rank time six signals per training step, in milliseconds, on two
clocks (CUDA events and the CPU). One rank's steps travel as a float64 array of
``ROW_WIDTH`` columns::

    [step_id, cpu input_wait, h2d, forward, backward, optimizer, step,
              gpu input_wait, h2d, forward, backward, optimizer, step,
              cpu forward_wait, backward_wait, gpu forward_wait, backward_wait,
              async_collectives]

NaN means *absent* (the signal was not timed on that step); a measured zero is ``0.0``.
:func:`.row_dicts.rows_to_array` builds that array from row dictionaries (which carry the
twelve clock columns and, optionally, each clock's sync waits; ``async_collectives`` stays
absent).

The trailing ``EXTRA_COLUMNS`` are rankwatch's extension of the seed layout: the waits at the
synchronisation points (``SYNC_SIGNALS``), once per clock, and a flag:

* ``forward_wait``: the part of ``forward`` spent waiting at a synchronisation point (DDP's
  wrapper outside its module: the buffer broadcast; FSDP2's all-gather waits; any collective
  timed as a sync wait);
* ``backward_wait``: the waits inside ``backward`` (DDP: from the rank's last local gradient
  to the end of its end-of-backward work, the wait for the last gradient reduction; FSDP2's
  reduce-scatter waits);
* on the CPU clock they are host time; on the GPU clock the time the compute stream sat
  behind the collective (a pair of CUDA events around each wait, see
  ``exporter.step_time.gpu_events``);
* ``async_collectives``: 1 when the rank's collectives do not block the host (model on an
  accelerator: NCCL-style), so its CPU clock cannot contain a wait for another rank.

:func:`reduce_window` turns one array per rank into a :class:`WindowMeans`:

* it aligns the ranks on the step ids every present rank has, keeping the last ``window`` of
  them (the live view uses 100, the final summary 10,000);
* it picks the clock: GPU only when every present rank has GPU timing of ``step`` and
  ``input_wait`` on every aligned step, and of every phase the step ran (a phase timed on the
  CPU clock must be timed on the GPU clock too); otherwise CPU;
* it reduces each rank to means over the aligned steps. ``input_wait``, ``forward``,
  ``backward`` and ``step`` are measured only when present on every aligned step; ``h2d`` and
  ``optimizer`` are measured when present on any aligned step, and count as 0 on the others
  (not every step transfers or runs the optimizer). The residual of a step is
  ``max(0, step - h2d - forward - backward - optimizer)``; it is measured when ``step``,
  ``forward`` and ``backward`` are. The sync waits are those of the picked clock, measured
  only when present on every aligned step (the GPU waits do not decide the clock: a GPU
  window without them falls back to the seed's definitions in the rules);
* with an :class:`OutlierRule` (the diagnosis passes ``StepTimeConfig``'s), it leaves out of a
  rank's means the rank's rare outlier steps: a step whose outer step (``input_wait + step`` on
  the window's clock) exceeds ``factor`` x the rank's median outer step over the window, when
  the rank has at most ``max_fraction`` x the window's steps of them (a checkpoint save, an
  evaluation pause, a recompile). More of them are the job's normal and stay in. The window
  counts them (:attr:`WindowMeans.outlier_steps`).

Everything is vectorised over ranks and steps; the only Python loops run once per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "CLOCKS",
    "EXTRA_COLUMNS",
    "MAX_RANK_ID",
    "MEAN_KEYS",
    "ROW_WIDTH",
    "SIGNALS",
    "SYNC_SIGNALS",
    "OutlierRule",
    "WindowMeans",
    "clock_columns",
    "column",
    "rank_items",
    "reduce_window",
    "rows_after",
    "validate_outliers",
    "validate_rank_id",
    "validate_window",
    "wait_columns",
]

SIGNALS: tuple[str, ...] = ("input_wait", "h2d", "forward", "backward", "optimizer", "step")
CLOCKS: tuple[str, ...] = ("cpu", "gpu")
# Waits at the synchronisation points, timed on each clock (see the module docstring).
SYNC_SIGNALS: tuple[str, ...] = ("forward_wait", "backward_wait")
# The columns after the two clocks' signals, by field name: each clock's waits, then the flag.
EXTRA_COLUMNS: tuple[str, ...] = (
    *(f"{clock}.{signal}" for clock in CLOCKS for signal in SYNC_SIGNALS),
    "async_collectives",
)
BASE_WIDTH = 1 + len(CLOCKS) * len(SIGNALS)  # step_id and the two clocks' signals
ROW_WIDTH = BASE_WIDTH + len(EXTRA_COLUMNS)
# torch.distributed ranks are C ints; a larger id cannot be a rank and would not fit int64 math.
MAX_RANK_ID = 2**31 - 1
# Keys of a rank's window means: the six signals, the derived residual, the sync waits.
MEAN_KEYS: tuple[str, ...] = (*SIGNALS, "residual", *SYNC_SIGNALS)

IW, H2D, FWD, BWD, OPT, STEP, RES, FWW, BWW = range(9)
_ASYNC_COL = ROW_WIDTH - 1
_EVERY_STEP = np.array([True, False, True, True, False, True])  # measured only if on every step
_PHASES = [H2D, FWD, BWD, OPT]

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]


def column(clock: str, signal: str) -> int:
    """Column of ``clock``/``signal`` (one of ``SIGNALS`` or ``SYNC_SIGNALS``) in a step-time
    row array."""
    if signal in SYNC_SIGNALS:
        return BASE_WIDTH + CLOCKS.index(clock) * len(SYNC_SIGNALS) + SYNC_SIGNALS.index(signal)
    return 1 + CLOCKS.index(clock) * len(SIGNALS) + SIGNALS.index(signal)


def clock_columns(clock: str) -> slice:
    """The six ``SIGNALS`` columns of ``clock``, contiguous."""
    first = column(clock, SIGNALS[0])
    return slice(first, first + len(SIGNALS))


def wait_columns(clock: str) -> slice:
    """The ``SYNC_SIGNALS`` columns of ``clock``, contiguous."""
    first = column(clock, SYNC_SIGNALS[0])
    return slice(first, first + len(SYNC_SIGNALS))


_CPU_COLS, _GPU_COLS = clock_columns("cpu"), clock_columns("gpu")


def _field_name(col: int) -> str:
    if col == 0:
        return "step_id"
    if col >= BASE_WIDTH:
        return EXTRA_COLUMNS[col - BASE_WIDTH]
    c, s = divmod(col - 1, len(SIGNALS))
    return f"{CLOCKS[c]}.{SIGNALS[s]}"


def rows_after(rows: FloatArray, last_step: float) -> FloatArray:
    """One rank's newly received rows without those whose step id is not above every id
    before it (``last_step``, then the rows' own): resent or out-of-order rows.

    Rows in strictly ascending order after ``last_step`` (every shipment of a healthy rank)
    come back as they are, after two comparisons.
    """
    ids = rows[:, 0]
    if len(ids) == 0 or (ids[0] > last_step and bool((ids[1:] > ids[:-1]).all())):
        return rows
    return rows[ids > np.maximum.accumulate(np.concatenate(([last_step], ids[:-1])))]


def rank_items(per_rank: Mapping[Any, Any]) -> list[tuple[int, Any]]:
    """``(rank, value)`` pairs sorted by rank id, each id checked; a repeated id is an error."""
    items = sorted(((validate_rank_id(r), v) for r, v in per_rank.items()), key=lambda x: x[0])
    for (a, _), (b, _) in pairwise(items):
        if a == b:
            raise ValueError(f"rank {a}: field rank_id: value {a} is given more than once")
    return items


def validate_rank_id(rank: object) -> int:
    """A global rank id as ``int`` in 0..MAX_RANK_ID; ``ValueError`` naming the value else."""
    if type(rank) is int and 0 <= rank <= MAX_RANK_ID:  # the usual case, without the checks below
        return rank
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (int, np.integer)):
        raise ValueError(
            f"rank {rank!r}: field rank_id: value {rank!r} is not an int "
            f"(got {type(rank).__name__})"
        )
    if rank < 0:
        raise ValueError(f"rank {rank}: field rank_id: value {rank!r} is negative")
    if rank > MAX_RANK_ID:
        raise ValueError(f"rank {rank}: field rank_id: value {rank!r} is above {MAX_RANK_ID}")
    return int(rank)


# --------------------------------------------------------------------------------------------
# Validation, alignment, reduction
# --------------------------------------------------------------------------------------------


def _rank_at(index: int, lengths: Sequence[int], ranks: Sequence[int | None]) -> tuple[Any, int]:
    """(rank, row-within-rank) of a table row."""
    for rank, n in zip(ranks, lengths, strict=True):
        if index < n:
            return rank, index
        index -= n
    raise IndexError(index)


def _table_is_clean(table: FloatArray) -> bool:
    """The usual answer of :func:`_check_table`, from two NaN-skipping reductions over the
    whole table (one pass each, no temporaries the size of the table) and the id column. A
    cube of rows (``[ranks, steps, ROW_WIDTH]``) is read the same way."""
    with np.errstate(invalid="ignore"):
        lowest = np.fmin.reduce(table, axis=None)  # NaN only when every value is NaN
        highest = np.fmax.reduce(table, axis=None)
    ids = table[..., 0]
    return (
        not bool(lowest < 0)
        and not bool(np.isinf(highest))
        and not bool(np.isnan(ids).any())
        and bool((ids == np.floor(ids)).all())
    )


def _check_table(table: FloatArray, lengths: Sequence[int], ranks: Sequence[int | None]) -> None:
    """Step ids non-negative integers; times NaN (absent) or finite and >= 0."""
    if table.size and _table_is_clean(table):
        return
    ids = table[:, 0]
    bad_id = ~np.isfinite(ids) | (ids < 0) | (ids != np.floor(ids))
    times = table[:, 1:]
    bad_time = np.isinf(times) | (times < 0)
    if not (bad_id.any() or bad_time.any()):
        return
    if bad_id.any():
        at, col = int(np.flatnonzero(bad_id)[0]), 0
        what = "is not a non-negative integer"
    else:
        at, c = (int(x) for x in np.argwhere(bad_time)[0])
        col = c + 1
        what = "is not finite" if np.isinf(table[at, col]) else "is negative"
    rank, row = _rank_at(at, lengths, ranks)
    step = table[at, 0]
    step_txt = f" (step_id {int(step)})" if col and np.isfinite(step) else ""
    head = "" if rank is None else f"rank {rank}: "
    raise ValueError(
        f"{head}row {row}{step_txt}: field {_field_name(col)}: "
        f"value {float(table[at, col])!r} {what}"
    )


@dataclass(frozen=True)
class OutlierRule:
    """Which steps a rank's means leave out (see the module docstring): outer steps above
    ``factor`` x the rank's median, when at most ``max_fraction`` of the window's steps are."""

    factor: float
    max_fraction: float

    def __post_init__(self) -> None:
        for name, value, lo in (
            ("factor", self.factor, 1.0),
            ("max_fraction", self.max_fraction, 0.0),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (lo <= value < float("inf"))
            ):
                raise ValueError(f"field {name}: value {value!r} is not a finite number >= {lo:g}")

    def kept(self, outer: FloatArray) -> BoolArray | None:
        """``[ranks, steps]``: the steps kept of ``outer`` (``[ranks, steps]`` ms), or None
        when every step is kept (the usual window)."""
        steps = outer.shape[1]
        allowed = int(self.max_fraction * steps + 1e-9)
        if allowed == 0 or steps == 0:
            return None
        # A rank whose longest step is within the factor of its shortest has no outlier (its
        # median lies between them): two reductions settle the usual window without a median.
        suspect = np.flatnonzero(outer.max(axis=1) > self.factor * outer.min(axis=1))
        if suspect.size == 0:
            return None
        rows = outer[suspect]
        out_rows = rows > (self.factor * np.median(rows, axis=1))[:, None]
        count = np.count_nonzero(out_rows, axis=1)
        out_rows &= ((count > 0) & (count <= allowed))[:, None]
        if not out_rows.any():
            return None
        kept = np.ones(outer.shape, dtype=bool)
        kept[suspect] = ~out_rows
        return kept


def validate_outliers(outliers: object) -> OutlierRule | None:
    """``outliers`` when it is an :class:`OutlierRule` or None, else ``ValueError``."""
    if outliers is None or isinstance(outliers, OutlierRule):
        return outliers
    raise ValueError(
        f"field outliers: value of type {type(outliers).__name__} is not an OutlierRule or None"
    )


@dataclass(frozen=True)
class WindowMeans:
    """Per-rank window means of the selected clock, ready for the policy.

    ``ranks`` are the expected global ranks, ascending. ``means[r, k]`` follows
    ``MEAN_KEYS`` (ms; 0 where unmeasured) and ``measured[r, k]`` says whether it was
    measured. ``present[r]`` is False for a rank that sent no rows. ``step_range`` is the first
    and last aligned step id. ``async_collectives`` is True when a present rank flagged, on
    an aligned step, collectives that do not block its host (its CPU clock misses the wait).
    ``outlier_steps[r]`` is how many of the window's steps rank ``r``'s means left out (an
    :class:`OutlierRule`; empty when none were).
    """

    ranks: tuple[int, ...]
    means: FloatArray
    measured: BoolArray
    present: BoolArray
    steps: int
    clock: str
    step_range: tuple[int, int] | None = None
    async_collectives: bool = False
    outlier_steps: tuple[int, ...] = ()

    @property
    def most_outlier_steps(self) -> int:
        """The most steps left out of one rank's means (0 when none were)."""
        return max(self.outlier_steps, default=0)


def _as_rank_array(rank: int, value: object) -> FloatArray | None:
    if value is None:
        return None
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"rank {rank}: field rows: value of type {type(value).__name__} is not a numeric "
            f"[n, {ROW_WIDTH}] array ({exc})"
        ) from None
    if arr.size == 0:
        return None
    if arr.ndim != 2 or arr.shape[1] != ROW_WIDTH:
        raise ValueError(
            f"rank {rank}: field rows: value has shape {arr.shape}, expected [n, {ROW_WIDTH}] "
            f"(step_id, {len(SIGNALS)} cpu signals, {len(SIGNALS)} gpu signals, "
            f"{', '.join(EXTRA_COLUMNS)})"
        )
    return arr


def validate_window(window: object) -> int:
    """The window size in steps: an int >= 1, else ``ValueError``."""
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
        raise ValueError(f"field window: value {window!r} is not an int number of steps")
    if window < 1:
        raise ValueError(f"field window: value {window!r} must be >= 1 step")
    return int(window)


def reduce_window(
    per_rank: Mapping[Any, Any], *, window: int = 100, outliers: OutlierRule | None = None
) -> WindowMeans:
    """Align, pick the clock and reduce one array per rank (None or empty = missing rank);
    ``outliers`` None keeps every step."""
    window = validate_window(window)
    validate_outliers(outliers)
    if not isinstance(per_rank, Mapping):
        raise ValueError(
            f"field per_rank: value of type {type(per_rank).__name__} is not a mapping "
            "{rank: rows}"
        )
    if not per_rank:
        raise ValueError("field per_rank: value {} is empty (no rank expected)")
    items = rank_items(per_rank)
    arrays = [(r, _as_rank_array(r, v)) for r, v in items]
    present_ranks = [r for r, a in arrays if a is not None]
    blocks = [a for _, a in arrays if a is not None]
    if blocks:
        table = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        lengths = [len(b) for b in blocks]
    else:
        table, lengths = np.empty((0, ROW_WIDTH)), []
    return _reduce_table([r for r, _ in arrays], present_ranks, table, lengths, window, outliers)


def reduce_cube_window(
    ranks: Sequence[int],
    present_ranks: Sequence[int],
    cube: FloatArray,
    *,
    window: int = 100,
    outliers: OutlierRule | None = None,
) -> WindowMeans:
    """:func:`reduce_window` for rows already side by side: ``cube`` is ``[len(present_ranks),
    n, ROW_WIDTH]``, each present rank's last ``n`` rows in ascending order (``ranks``: every
    expected rank, ascending). The same means as :func:`reduce_window` on those rows, without
    copying them into one table first (a group's aggregator keeps them so)."""
    window = validate_window(window)
    validate_outliers(outliers)
    m, n = cube.shape[:2]
    if m != len(present_ranks) or cube.ndim != 3 or cube.shape[2] != ROW_WIDTH:
        raise ValueError(
            f"field cube: shape {cube.shape}, expected [{len(present_ranks)}, n, {ROW_WIDTH}]"
        )
    ids = cube[0, :, 0] if m else np.empty(0)
    same_ids = m > 0 and bool((cube[:, :, 0] == ids).all()) and bool((np.diff(ids) > 0).all())
    if not (same_ids and _table_is_clean(cube)):
        # The rows one table, as reduce_window reads them (its checks name the bad value).
        table = np.ascontiguousarray(cube).reshape(m * n, ROW_WIDTH)
        return _reduce_table(list(ranks), list(present_ranks), table, [n] * m, window, outliers)
    # The usual window: every rank the same step ids, every value clean; reduced where it lies.
    present = np.isin(np.asarray(ranks), np.asarray(present_ranks, dtype=np.int64))
    with np.errstate(over="ignore", invalid="ignore"):
        return _reduce_cube(
            list(ranks), present, cube[:, -window:], ids[-window:], outliers=outliers
        )


def _reduce_table(
    ranks: list[int],
    present_ranks: list[int],
    table: FloatArray,
    lengths: list[int],
    window: int,
    outliers: OutlierRule | None = None,
) -> WindowMeans:
    n_all = len(ranks)
    present = np.isin(np.asarray(ranks), np.asarray(present_ranks, dtype=np.int64))
    means = np.zeros((n_all, len(MEAN_KEYS)))
    measured = np.zeros((n_all, len(MEAN_KEYS)), dtype=bool)
    if not present_ranks:
        return WindowMeans(tuple(ranks), means, measured, present, 0, "cpu")
    _check_table(table, lengths, present_ranks)
    with np.errstate(over="ignore", invalid="ignore"):  # times near the float maximum
        return _reduce_aligned(ranks, present, present_ranks, table, lengths, window, outliers)


def _reduce_aligned(
    ranks: list[int],
    present: BoolArray,
    present_ranks: list[int],
    table: FloatArray,
    lengths: list[int],
    window: int,
    outliers: OutlierRule | None,
) -> WindowMeans:
    cube, step_ids = _align(table, lengths, present_ranks, window)
    return _reduce_cube(ranks, present, cube, step_ids, outliers=outliers)


def gpu_steps(cube: FloatArray) -> BoolArray:
    """``[ranks, steps]``: the step can be read on the GPU clock (the window uses the GPU clock
    only when every aligned step of every present rank can)."""
    return _gpu_steps(cube, ~np.isnan(cube[:, :, _GPU_COLS]))


def _gpu_steps(cube: FloatArray, gpu_has: BoolArray) -> BoolArray:
    cpu_has = ~np.isnan(cube[:, :, _CPU_COLS])
    return (
        gpu_has[:, :, STEP]
        & gpu_has[:, :, IW]
        & (gpu_has[:, :, _PHASES] | ~cpu_has[:, :, _PHASES]).all(axis=2)
    )


def _reduce_cube(
    ranks: list[int],
    present: BoolArray,
    cube: FloatArray,
    step_ids: FloatArray,
    clock: str | None = None,
    *,
    outliers: OutlierRule | None = None,
) -> WindowMeans:
    """Means of an aligned ``[present ranks, steps, ROW_WIDTH]`` cube; ``clock`` None picks
    it from the rows, else forces it (the block accumulator reduces each clock separately);
    ``outliers`` leaves each rank's rare outlier steps out of its means."""
    n_all = len(ranks)
    means = np.zeros((n_all, len(MEAN_KEYS)))
    measured = np.zeros((n_all, len(MEAN_KEYS)), dtype=bool)
    steps = cube.shape[1]
    if steps == 0:
        return WindowMeans(tuple(ranks), means, measured, present, 0, "cpu")
    if clock is None:
        # A step without its GPU time (every step of a CPU job) settles it in one column;
        # a GPU block without any absent value (the usual GPU job) in one pass.
        use_gpu = not bool(np.isnan(cube[:, :, _GPU_COLS.start + STEP]).any())
        if use_gpu:
            gpu_has = ~np.isnan(cube[:, :, _GPU_COLS])
            use_gpu = bool(gpu_has.all()) or bool(_gpu_steps(cube, gpu_has).all())
    else:
        use_gpu = clock == "gpu"
    # The clock's six columns copied once, contiguous, with absent values as 0: every pass
    # below then reads 6 values per row instead of striding over all 16 (half the time of a
    # 4,096-rank live window went to those strided passes).
    picked = "gpu" if use_gpu else "cpu"
    filled = cube[:, :, clock_columns(picked)].copy()
    absent = np.isnan(filled)
    filled[absent] = 0.0
    kept = None if outliers is None else outliers.kept(filled[:, :, IW] + filled[:, :, STEP])
    # Steps per rank the means divide by: the window's, or the steps each rank kept.
    counts: FloatArray | int = steps
    if kept is not None:
        # A step left out counts as neither measured nor absent, and adds nothing to the sums.
        dropped = ~kept
        filled[dropped] = 0.0
        absent[dropped] = False
        counts = np.count_nonzero(kept, axis=1).astype(np.float64)[:, None]
    n_absent = np.count_nonzero(absent, axis=1)  # [ranks, signals]
    sums = filled.sum(axis=1)
    sig_measured = np.where(_EVERY_STEP, n_absent == 0, n_absent < counts)
    residual = filled[:, :, STEP] - filled[:, :, H2D]
    residual -= filled[:, :, FWD]
    residual -= filled[:, :, BWD]
    residual -= filled[:, :, OPT]
    residual = np.maximum(residual, 0.0, out=residual)
    residual = residual.mean(axis=1) if kept is None else residual.sum(axis=1) / kept.sum(axis=1)
    res_measured = sig_measured[:, STEP] & sig_measured[:, FWD] & sig_measured[:, BWD]
    # The picked clock's sync waits, measured only where timed on every aligned step: a sum
    # over the steps is NaN exactly when one is absent (the table's times are finite).
    waits_measured = np.zeros((cube.shape[0], len(SYNC_SIGNALS)), dtype=bool)
    wait_means = np.zeros((cube.shape[0], len(SYNC_SIGNALS)))
    waits = cube[:, :, wait_columns(picked)]
    if kept is not None:
        waits = np.where(kept[:, :, None], waits, 0.0)
    wait_sums = waits.sum(axis=1)
    np.logical_not(np.isnan(wait_sums), out=waits_measured)
    np.copyto(wait_means, wait_sums / counts, where=waits_measured)
    sub_means = np.concatenate([sums / counts, residual[:, None], wait_means], axis=1)
    sub_measured = np.concatenate([sig_measured, res_measured[:, None], waits_measured], axis=1)
    sub_means[~sub_measured] = 0.0
    means[present] = sub_means
    measured[present] = sub_measured
    return WindowMeans(
        tuple(ranks),
        means,
        measured,
        present,
        steps,
        picked,
        (int(step_ids[0]), int(step_ids[-1])),
        bool((np.abs(cube[:, :, _ASYNC_COL]) > 0).any()),  # NaN (absent) compares False
        _rank_outliers(present, kept),
    )


def _rank_outliers(present: BoolArray, kept: BoolArray | None) -> tuple[int, ...]:
    """Steps left out per expected rank (``()`` when none were)."""
    if kept is None:
        return ()
    out = np.zeros(len(present), dtype=np.int64)
    out[present] = np.count_nonzero(~kept, axis=1)
    return tuple(int(n) for n in out)


def _align(
    table: FloatArray, lengths: list[int], ranks: list[int], window: int
) -> tuple[FloatArray, FloatArray]:
    """``[ranks, steps, ROW_WIDTH]`` over the last ``window`` step ids common to all ranks."""
    n = len(ranks)
    if len(set(lengths)) == 1:
        # Fast path: every rank sent the same strictly increasing step ids.
        length = lengths[0]
        cube = table.reshape(n, length, ROW_WIDTH)
        ids = cube[0, :, 0]
        if bool((cube[:, :, 0] == ids).all()) and bool((np.diff(ids) > 0).all()):
            return cube[:, -window:, :], ids[-window:]
    ids = table[:, 0]
    owner = np.repeat(np.arange(n), lengths)
    order = np.lexsort((ids, owner))
    ids_sorted, owner_sorted = ids[order], owner[order]
    dup = (owner_sorted[1:] == owner_sorted[:-1]) & (ids_sorted[1:] == ids_sorted[:-1])
    if dup.any():
        at = int(np.flatnonzero(dup)[0]) + 1
        raise ValueError(
            f"rank {ranks[owner_sorted[at]]}: field step_id: value {int(ids_sorted[at])} "
            "appears more than once"
        )
    unique, counts = np.unique(ids, return_counts=True)
    common = unique[counts == n][-window:]
    if common.size == 0:
        return np.empty((n, 0, ROW_WIDTH)), common
    keep = order[np.isin(ids_sorted, common)]
    return table[keep].reshape(n, common.size, ROW_WIDTH), common
