"""The fast row reader and the careful one give the same table and report on any rows."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.step_time import SIGNALS, diagnose_arrays, diagnose_steps
from rankwatch.diagnosis.step_time.row_dicts import _rows_table, _strict_rows
from rankwatch.diagnosis.step_time.table import BASE_WIDTH, ROW_WIDTH, SYNC_SIGNALS, column

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values of every type a caller may pass for a time: floats, ints, numpy scalars, None.
value = st.one_of(
    st.none(),
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False),
    st.integers(min_value=0, max_value=10**6),
    st.floats(min_value=0.0, max_value=1e6).map(np.float32),
    st.integers(min_value=0, max_value=1000).map(np.int64),
)
# A clock: all six signals (the common shape, in or out of order), some of them, None, absent.
full_clock = st.permutations(SIGNALS).flatmap(
    lambda order: st.tuples(*(value for _ in order)).map(lambda v: dict(zip(order, v, strict=True)))
)
partial_clock = st.dictionaries(st.sampled_from(SIGNALS), value, max_size=5)
# A clock with some of the sync waits too (rankwatch's extension: the careful reader's).
waits = st.dictionaries(st.sampled_from(SYNC_SIGNALS), value, min_size=1, max_size=2)
waits_clock = st.tuples(st.one_of(full_clock, partial_clock), waits).map(lambda t: {**t[0], **t[1]})
clock = st.one_of(full_clock, full_clock, partial_clock, waits_clock, st.none(), st.just("absent"))
# Step ids: Python ints (fast path), integral floats and numpy ints (careful path).
step_id = st.one_of(
    st.integers(min_value=0, max_value=50),
    st.integers(min_value=0, max_value=50).map(float),
    st.integers(min_value=0, max_value=50).map(np.int32),
)


@st.composite
def rank_rows(draw: st.DrawFn) -> list[dict[str, Any]]:
    ids = draw(st.lists(step_id, min_size=1, max_size=12, unique_by=lambda s: int(s)))
    out = []
    for s in ids:
        row: dict[str, Any] = {"step_id": s}
        for name in ("cpu", "gpu"):
            c = draw(clock)
            if c != "absent":
                row[name] = c
        out.append(row)
    return out


def careful_table(rows: list[dict[str, Any]], rank: int) -> np.ndarray:
    waits: list[float | None] = []
    flat = np.array(_strict_rows(rows, rank, waits), dtype=np.float64).reshape(-1, BASE_WIDTH)
    table = np.full((len(rows), ROW_WIDTH), np.nan)
    table[:, :BASE_WIDTH] = flat
    cols = [column(c, s) for c in ("cpu", "gpu") for s in SYNC_SIGNALS]
    table[:, cols] = np.array(waits, dtype=np.float64).reshape(len(rows), len(cols))
    return table


@SETTINGS
@given(st.lists(rank_rows(), min_size=1, max_size=5))
def test_fast_reader_matches_the_careful_reader(per_rank_rows: list[list[dict[str, Any]]]) -> None:
    per_rank = dict(enumerate(per_rank_rows))
    fast, lengths = _rows_table(list(per_rank.items()))
    assert lengths == [len(r) for r in per_rank_rows]
    careful = np.concatenate([careful_table(rows, rank) for rank, rows in per_rank.items()])
    assert np.array_equal(fast, careful, equal_nan=True)
    arrays = {rank: careful_table(rows, rank) for rank, rows in per_rank.items()}
    assert (
        diagnose_steps(per_rank, window=10).to_dict()
        == diagnose_arrays(arrays, window=10).to_dict()
    )
