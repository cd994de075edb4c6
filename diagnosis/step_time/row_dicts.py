"""Row dictionaries -> the columnar step-time array (see :mod:`.table`).

A row is ``{"step_id": int, "cpu": {signal: ms, ...}, "gpu": {signal: ms, ...}}``; a missing
clock, a missing signal or ``None`` means absent. A clock may also carry the sync waits
(``forward_wait``, ``backward_wait``, rankwatch's extension; rows with them take the careful
reader). Reading a hundred thousand such dictionaries
is the one part of the step-time diagnosis that is bound by the Python interpreter, so the
common shapes go through lean loops (one C-level ``itemgetter`` per clock, then a single
``np.fromiter``) and only unusual rows through a careful reader that checks every value and
names the rank, row, field and value of the first bad one.

Values are converted with ``float()``: ``None`` is absent; negative, infinite and NaN values
are errors (absent is written as ``None`` or left out, never as NaN).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any, cast

import numpy as np

from rankwatch.diagnosis.step_time.table import (
    BASE_WIDTH,
    CLOCKS,
    ROW_WIDTH,
    SIGNALS,
    SYNC_SIGNALS,
    FloatArray,
    _check_table,
    _field_name,
    column,
)

__all__ = ["rows_to_array"]

_SIG = itemgetter(*SIGNALS)
_ROW_KEYS = frozenset(("step_id", *CLOCKS))
_SIGNAL_SET = frozenset(SIGNALS)
_CLOCK_KEYS = (*SIGNALS, *SYNC_SIGNALS)  # what a clock dict may hold
_CLOCK_KEY_SET = frozenset(_CLOCK_KEYS)
_ABSENT = (None,) * len(SIGNALS)
# The sync-wait columns, in the order the careful reader collects them (per clock).
_WAIT_COLS = [column(clock, s) for clock in CLOCKS for s in SYNC_SIGNALS]


def _where(rank: int | None, index: int, step_id: object = None) -> str:
    head = "" if rank is None else f"rank {rank}: "
    if step_id is None:
        return f"{head}row {index}"
    return f"{head}row {index} (step_id {step_id!r})"


def _strict_time(value: object, where: str, field: str) -> float | None:
    """One time value: None (absent) stays None; else a finite float >= 0, or ``ValueError``."""
    if value is None:
        return None
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(
            f"{where}: field {field}: value {value!r} is not a number of milliseconds"
        ) from None
    if not math.isfinite(out):
        raise ValueError(f"{where}: field {field}: value {value!r} is not finite")
    if out < 0:
        raise ValueError(f"{where}: field {field}: value {value!r} is negative")
    return out


def _is_step_id(value: object) -> bool:
    """A non-negative integral number that float64 holds exactly."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        return False
    try:
        return bool(0 <= value <= 2**53 and value == int(value))
    except (OverflowError, ValueError):  # inf, NaN
        return False


def _strict_rows(
    rows: Sequence[Mapping[str, Any]], rank: int | None, waits: list[float | None] | None = None
) -> list[float | None]:
    """The careful reading of one rank's rows: every value checked, precise errors. The sync
    waits go to ``waits`` (``len(_WAIT_COLS)`` per row) when given."""
    flat: list[float | None] = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(
                f"{_where(rank, i)}: field row: value {row!r} is not a mapping "
                '{"step_id", "cpu", "gpu"}'
            )
        step_id = row.get("step_id")
        where = _where(rank, i, step_id)
        unknown = set(row) - _ROW_KEYS
        if unknown:
            key = sorted(unknown, key=str)[0]
            raise ValueError(
                f"{where}: field {key}: unknown key (expected step_id, cpu, gpu), "
                f"value {row[key]!r}"
            )
        if "step_id" not in row:
            raise ValueError(f"{where}: field step_id: value missing")
        if not _is_step_id(step_id):
            raise ValueError(
                f"{where}: field step_id: value {step_id!r} is not a non-negative integer"
            )
        flat.append(float(cast(float, step_id)))
        for clock in CLOCKS:
            values = row.get(clock)
            if values is None:
                flat.extend(_ABSENT)
                if waits is not None:
                    waits.extend((None,) * len(SYNC_SIGNALS))
                continue
            if not isinstance(values, Mapping):
                raise ValueError(
                    f"{where}: field {clock}: value {values!r} is not a mapping of signals"
                )
            bad = set(values) - _CLOCK_KEY_SET
            if bad:
                key = sorted(bad, key=str)[0]
                raise ValueError(
                    f"{where}: field {clock}.{key}: unknown signal (expected one of "
                    f"{', '.join(_CLOCK_KEYS)}), value {values[key]!r}"
                )
            flat.extend(_strict_time(values.get(s), where, f"{clock}.{s}") for s in SIGNALS)
            if waits is not None:
                waits.extend(
                    _strict_time(values.get(s), where, f"{clock}.{s}") for s in SYNC_SIGNALS
                )
    return flat


class _Unusual(Exception):
    """A row the fast reader does not handle; the rank is read another way."""


# Which table columns a rank's rows fill, by the clocks they carry (has_cpu, has_gpu). The
# sync waits (careful reader only) are written apart; ``async_collectives`` stays absent.
_LAYOUTS: dict[tuple[bool, bool], list[int]] = {
    (True, True): list(range(BASE_WIDTH)),
    (True, False): list(range(1 + len(SIGNALS))),
    (False, True): [0, *range(1 + len(SIGNALS), BASE_WIDTH)],
    (False, False): [0],
}


def _partial(values: Any) -> tuple[Any, ...]:
    """A clock dict with only some of the six signals; ``_Unusual`` for unknown keys."""
    if values.keys() <= _SIGNAL_SET:
        return tuple(map(values.get, SIGNALS))
    raise _Unusual


def _fast_both(rows: Sequence[Mapping[str, Any]], flat: list[Any]) -> None:
    """Rows of exactly ``step_id``, ``cpu`` and ``gpu`` (the common case, kept lean)."""
    app, ext, sig = flat.append, flat.extend, _SIG
    for row in rows:
        cpu = row["cpu"]
        gpu = row["gpu"]
        step_id = row["step_id"]
        if len(row) != 3 or step_id.__class__ is not int:
            raise _Unusual
        app(step_id)
        ext(sig(cpu) if len(cpu) == 6 else _partial(cpu))
        ext(sig(gpu) if len(gpu) == 6 else _partial(gpu))


def _fast_one(rows: Sequence[Mapping[str, Any]], flat: list[Any], clock: str) -> None:
    """Rows of ``step_id`` and one clock (the other absent or None)."""
    app, ext, sig = flat.append, flat.extend, _SIG
    other = "gpu" if clock == "cpu" else "cpu"
    for row in rows:
        values = row[clock]
        step_id = row["step_id"]
        if step_id.__class__ is not int or (
            len(row) != 2 and not (row.keys() <= _ROW_KEYS and row.get(other) is None)
        ):
            raise _Unusual
        app(step_id)
        ext(sig(values) if len(values) == 6 else _partial(values))


def _fast_fill(rows: Sequence[Mapping[str, Any]], flat: list[Any]) -> None:
    """Any mix of clocks per row, 13 wide, an absent clock written as six None."""
    app, ext, sig = flat.append, flat.extend, _SIG
    for row in rows:
        cpu = row.get("cpu")
        gpu = row.get("gpu")
        if not (len(row) == 3 and cpu is not None and gpu is not None) and not (
            row.keys() <= _ROW_KEYS
        ):
            raise _Unusual
        step_id = row["step_id"]
        if step_id.__class__ is not int:
            raise _Unusual
        app(step_id)
        ext(_ABSENT if cpu is None else sig(cpu) if len(cpu) == 6 else _partial(cpu))
        ext(_ABSENT if gpu is None else sig(gpu) if len(gpu) == 6 else _partial(gpu))


def _fast_rows(
    rows: Sequence[Mapping[str, Any]], flat: list[Any], layout: tuple[bool, bool] | None
) -> None:
    """Append one rank's rows to ``flat`` with few checks; ``_Unusual`` if it cannot.

    Handles what collectors write: dict rows of ``step_id`` and the clocks of ``layout``
    (``None``: any mix, 13 wide), each clock a dict of some or all of the six signals. Values
    are not checked here: the array they become is checked as a whole. Unknown keys and other
    types are left to :func:`_strict_rows`.
    """
    try:
        if layout is None:
            _fast_fill(rows, flat)
        elif layout == (True, True):
            _fast_both(rows, flat)
        elif layout == (True, False):
            _fast_one(rows, flat, "cpu")
        elif layout == (False, True):
            _fast_one(rows, flat, "gpu")
        else:
            for row in rows:
                step_id = row["step_id"]
                if step_id.__class__ is not int or not (
                    row.keys() <= _ROW_KEYS and row.get("cpu") is None is row.get("gpu")
                ):
                    raise _Unusual
                flat.append(step_id)
    except (_Unusual, KeyError, TypeError, AttributeError, IndexError):
        raise _Unusual from None


def _read_rank(
    rank: int | None,
    rows: Sequence[Mapping[str, Any]],
    flats: dict[tuple[bool, bool], list[Any]],
    waits: list[float | None],
) -> tuple[tuple[bool, bool], int]:
    """Append ``rows`` to the flat list of their layout; (layout, start offset). Rows the
    careful reader takes also leave their sync waits in ``waits`` (empty when none has one)."""
    try:
        first = rows[0]
        layout = (first.get("cpu") is not None, first.get("gpu") is not None)
    except (AttributeError, TypeError, IndexError, KeyError):
        layout = (True, True)
    for attempt in (layout, None):
        target = (True, True) if attempt is None else attempt
        flat = flats[target]
        start = len(flat)
        try:
            _fast_rows(rows, flat, attempt)
            return target, start
        except _Unusual:
            del flat[start:]
    flat = flats[(True, True)]
    start = len(flat)
    flat.extend(_strict_rows(rows, rank, waits))
    if all(w is None for w in waits):
        waits.clear()  # no sync wait: nothing to write
    return (True, True), start


def _rows_table(
    per_rank: Sequence[tuple[int | None, Sequence[Mapping[str, Any]]]],
) -> tuple[FloatArray, list[int]]:
    """One float64 ``[sum(n_r), ROW_WIDTH]`` table for several ranks' rows, and their lengths.

    Ranks are read into one flat list per layout (which clocks their rows carry), so that an
    absent clock costs nothing; the table is assembled from those blocks with NaN elsewhere.
    """
    flats: dict[tuple[bool, bool], list[Any]] = {layout: [] for layout in _LAYOUTS}
    segments: list[tuple[int | None, tuple[bool, bool], int, int]] = []  # rank, layout, start, n
    lengths: list[int] = []
    rank_waits: list[tuple[int, list[float | None]]] = []  # (first table row, waits) per rank
    was_enabled = gc.isenabled()
    # A hundred thousand small tuples would otherwise trigger full collections over every live
    # object (a third of the read time). Paused for this read only, restored even on error.
    gc.disable()
    try:
        for rank, rows in per_rank:
            waits: list[float | None] = []
            layout, start = _read_rank(rank, rows, flats, waits)
            if waits:
                rank_waits.append((sum(lengths), waits))
            segments.append((rank, layout, start, len(rows)))
            lengths.append(len(rows))
        blocks: dict[tuple[bool, bool], FloatArray] = {}
        for layout, flat in flats.items():
            if not flat:
                continue
            try:
                blocks[layout] = np.fromiter(flat, dtype=np.float64, count=len(flat))
            except (TypeError, ValueError, OverflowError):
                # Some value float() rejects: the careful reading names it.
                for (rank, rows), seg in zip(per_rank, segments, strict=True):
                    if seg[1] == layout:
                        _strict_rows(rows, rank)
                raise AssertionError("a value failed conversion but passed the check") from None
    finally:
        if was_enabled:
            gc.enable()
    # NaN must come from None (absent), never from an explicit NaN (the careful reading writes
    # None for absent values and rejects NaN itself).
    for layout, block in blocks.items():
        flat = flats[layout]
        nan_at = np.flatnonzero(np.isnan(block))
        explicit = [int(i) for i in nan_at if flat[i] is not None]
        if explicit:
            _explicit_nan(explicit[0], flat, layout, segments)
    total = sum(lengths)
    table = np.full((total, ROW_WIDTH), np.nan)
    for first, waits in rank_waits:  # checked by the careful reader: None is the only NaN
        values = np.array([np.nan if w is None else w for w in waits], dtype=np.float64)
        n = len(values) // len(_WAIT_COLS)
        table[first : first + n, _WAIT_COLS] = values.reshape(n, len(_WAIT_COLS))
    if len(blocks) == 1 and (True, True) in blocks:
        table[:, :BASE_WIDTH] = blocks[(True, True)].reshape(total, BASE_WIDTH)
        return table, lengths
    offsets = np.cumsum([0, *lengths[:-1]])
    for layout, block in blocks.items():
        cols = _LAYOUTS[layout]
        mine = [
            (off, seg[2] // len(cols), seg[3])
            for off, seg in zip(offsets, segments, strict=True)
            if seg[1] == layout
        ]
        dest_start = np.array([m[0] for m in mine])
        src_start = np.array([m[1] for m in mine])
        counts = np.array([m[2] for m in mine])
        dest = np.repeat(dest_start - src_start, counts) + np.arange(int(counts.sum()))
        table[np.ix_(dest, np.asarray(cols))] = block.reshape(-1, len(cols))
    return table, lengths


def _explicit_nan(
    at: int,
    flat: list[Any],
    layout: tuple[bool, bool],
    segments: list[tuple[int | None, tuple[bool, bool], int, int]],
) -> None:
    cols = _LAYOUTS[layout]
    width = len(cols)
    rank, start = next(
        (r, a) for r, lay, a, n in segments if lay == layout and a <= at < a + n * width
    )
    row, col = divmod(at - start, width)
    step_id = flat[start + row * width]
    raise ValueError(
        f"{_where(rank, row, step_id)}: field {_field_name(cols[col])}: "
        f"value {flat[at]!r} is not finite (absent signals are omitted or None)"
    )


def rows_to_array(rows: Sequence[Mapping[str, Any]], *, rank: int | None = None) -> FloatArray:
    """One rank's step rows -> float64 ``[n, ROW_WIDTH]`` (NaN = absent).

    A row is ``{"step_id": int, "cpu": {signal: ms, ...}, "gpu": {signal: ms, ...}}``; a
    missing clock, a missing signal or ``None`` means absent; a clock may also carry
    ``forward_wait`` and ``backward_wait``. Raises ``ValueError`` naming the
    row (and ``rank`` when given), the field and the value for a negative or non-finite time, a
    bad step id, an unknown key, or a value ``float()`` rejects. Step ids are checked for
    duplicates when the window is reduced.
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ValueError(
            f"{'' if rank is None else f'rank {rank}: '}field rows: value of type "
            f"{type(rows).__name__} is not a sequence of row mappings"
        )
    table, _ = _rows_table([(rank, rows)])
    _check_table(table, [len(rows)], [rank])
    return table
