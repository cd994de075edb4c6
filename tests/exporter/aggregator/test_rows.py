"""The aggregator's rows: each rank's ring, the batched round against the rank-by-rank one,
and the live window from one gather against the one aligned rank by rank."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.step_time import ROW_WIDTH, diagnose_arrays
from rankwatch.diagnosis.step_time.artifact import example_window
from rankwatch.exporter.aggregator.rows import GroupRows
from rankwatch.exporter.aggregator.windows import GroupWindows, root_tail_rows, window_arrays
from rankwatch.exporter.aggregator.wire import Rows
from rankwatch.exporter.config import RankwatchConfig


def rows(first: int, n: int, value: float = 1.0) -> np.ndarray:
    out = np.full((n, ROW_WIDTH), math.nan)
    out[:, 0] = np.arange(first, first + n)
    out[:, 1:7] = value
    return out


def one(capacity: int) -> GroupRows:
    return GroupRows((0,), capacity)


def test_a_ring_keeps_the_newest_rows_in_order() -> None:
    buf = one(10)
    assert buf.append(0, rows(0, 4)) == 4
    assert buf.append(0, rows(4, 4)) == 4
    assert buf.append(0, rows(8, 5)) == 5  # wraps
    assert buf.size(0) == 10 and buf.last_step[0] == 12
    assert buf.tail(0, 100)[:, 0].tolist() == list(range(3, 13))
    assert buf.tail(0, 3)[:, 0].tolist() == [10, 11, 12]
    assert buf.tail(0, 4, max_step=9)[:, 0].tolist() == [6, 7, 8, 9]
    # A batch larger than the ring keeps its newest rows.
    assert buf.append(0, rows(20, 25)) == 25
    assert buf.tail(0, 100)[:, 0].tolist() == list(range(35, 45))
    big = one(7)
    assert big.append(0, rows(0, 20)) == 20
    assert big.tail(0, 10)[:, 0].tolist() == list(range(13, 20))
    big.append(0, rows(20, 2))
    assert big.tail(0, 10)[:, 0].tolist() == list(range(15, 22))


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 12),
    batches=st.lists(st.tuples(st.integers(-3, 4), st.integers(0, 15)), max_size=12),
    n=st.integers(0, 20),
    cut=st.one_of(st.none(), st.integers(-2, 80)),
)
def test_a_rings_tail_is_the_end_of_every_row_kept(
    capacity: int, batches: list[tuple[int, int]], n: int, cut: int | None
) -> None:
    # The reference keeps every accepted row in a list; the ring must hand out the same end
    # of it, however often it wrapped and wherever the cut falls.
    buf = one(capacity)
    kept: list[float] = []
    next_id = 0
    for shift, count in batches:  # a negative shift resends steps already received
        first = max(0, next_id + shift)
        buf.append(0, rows(first, count))
        for step in range(first, first + count):
            if not kept or step > kept[-1]:
                kept.append(float(step))
        next_id = max(next_id, first + count)
    ring = kept[-capacity:]
    upto = ring if cut is None else [s for s in ring if s <= cut]
    want = upto[-n:] if n else []
    got = buf.tail(0, n, None if cut is None else float(cut))
    assert got.shape == (len(want), ROW_WIDTH)
    assert got[:, 0].tolist() == want
    got[:, 1] = -1.0  # a copy: the ring is untouched
    assert (buf.tail(0, capacity)[:, 1] != -1.0).all()


def test_a_ring_rejects_resent_and_out_of_order_rows() -> None:
    buf = one(8)
    buf.append(0, rows(0, 3))
    mixed = np.concatenate([rows(1, 2), rows(3, 1), rows(2, 1), rows(4, 1)])
    assert buf.append(0, mixed) == 2
    assert buf.rejected[0] == 3
    assert buf.tail(0, 8)[:, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="capacity"):
        GroupRows((0,), 0)


def test_progress_time_moves_only_with_new_steps() -> None:
    buf = one(4)
    buf.append(0, rows(0, 2), now=10.0)
    buf.append(0, rows(0, 2), now=20.0)  # nothing new
    assert buf.progress_at[0] == 10.0
    buf.append(0, rows(2, 1), now=30.0)
    assert buf.progress_at[0] == 30.0


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 9),
    rounds=st.lists(
        st.lists(st.tuples(st.integers(-2, 3), st.integers(0, 6)), min_size=4, max_size=4),
        max_size=8,
    ),
)
def test_a_batched_round_keeps_what_rank_by_rank_appends_keep(
    capacity: int, rounds: list[list[tuple[int, int]]]
) -> None:
    """Shipments of one count each, some resent or out of order: the batch takes those that
    follow their rank's last step and hands back the rest, and the rings end as the
    rank-by-rank appends leave them."""
    batched, single = GroupRows(range(4), capacity), GroupRows(range(4), capacity)
    nexts = [0, 0, 0, 0]
    for shipments in rounds:
        k = shipments[0][1]
        arrays = []
        for r, (shift, _) in enumerate(shipments):
            first = max(0, nexts[r] + shift)
            arrays.append(rows(first, k, value=float(r + 1)))
            nexts[r] = max(nexts[r], first + k)
        idx = np.arange(4)
        for j in batched.append_batch(idx, np.stack(arrays), now=1.0).tolist():
            batched.append(j, arrays[j], now=1.0)
        for r in range(4):
            single.append(r, arrays[r], now=1.0)
    for r in range(4):
        np.testing.assert_array_equal(batched.tail(r, capacity), single.tail(r, capacity))
        assert batched.count[r] == single.count[r]
        assert batched.last_step[r] == single.last_step[r]


def test_window_arrays_cut_at_the_slowest_rank_and_name_absent_ranks() -> None:
    buffers = GroupRows((0, 2, 5), 1000)
    buffers.append(0, rows(0, 500))
    buffers.append(1, rows(0, 300))
    buffers.append(2, rows(0, 100))
    out = window_arrays(buffers, present=[0, 2], window=50)
    assert out[5] is None
    a0, a2 = out[0], out[2]
    assert a0 is not None and a2 is not None
    assert a0[-1, 0] == 299 and a2[-1, 0] == 299  # no rank aligned past the slowest one
    assert len(a0) <= 50 * 3
    report = diagnose_arrays(out, strategy=None, window=50)
    assert report.missing_ranks == (5,)
    assert report.step_range == (250, 299)


def _shipments(per_rank: dict[int, np.ndarray], start: int, stop: int) -> list[Rows]:
    return [Rows(r, 1, 1, "ddp", 0, a[start:stop]) for r, a in per_rank.items()]


@pytest.mark.parametrize("shape", ["in_step", "apart", "gap"])
def test_the_live_window_is_the_one_aligned_rank_by_rank(shape: str) -> None:
    """Ranks in step (one gather), a few steps apart (one gather, cut at the lowest), or one
    with a missing step (aligned rank by rank): always the report of the tails aligned rank by
    rank, and the rows a window file keeps."""
    config = RankwatchConfig.from_env(env={})
    ranks = (0, 1, 2, 3)
    per_rank = {
        r: a for r, a in example_window(4, 600, slow_rank=2).per_rank.items() if a is not None
    }
    if shape == "gap":
        per_rank[1] = np.delete(per_rank[1], 580, axis=0)
    batched, single = GroupWindows(ranks, config), GroupWindows(ranks, config)
    for start in range(0, 500, 100):
        batched.take_all(_shipments(per_rank, start, start + 100), 1.0)
        for s in _shipments(per_rank, start, start + 100):
            single.take(s.rank, s, 1.0)
    last = {r: 600 - (3 * r if shape == "apart" else 0) for r in ranks}
    tail = [Rows(r, 2, 1, "ddp", 0, per_rank[r][500 : last[r]]) for r in ranks]
    batched.take_all(tail, 2.0)
    for s in tail:
        single.take(s.rank, s, 2.0)
    window = config.diagnosis.step_time.live_window_steps
    got_rows, got = batched._diagnose("live", list(ranks), window)
    want_rows = window_arrays(single.rows, list(ranks), window)
    want = diagnose_arrays(want_rows, strategy="ddp", window=window)
    assert got.to_dict() == want.to_dict()
    assert (batched._in_step(list(ranks), window) is None) == (shape == "gap")
    for r in ranks:
        kept = got_rows[r]
        assert kept is not None and kept[-1, 0] == got.step_range[1]
    for i in range(len(ranks)):
        size = single.rows.size(i)
        np.testing.assert_array_equal(batched.rows.tail(i, size), single.rows.tail(i, size))


def test_large_groups_keep_fewer_rows_per_rank_never_fewer_than_a_window_needs() -> None:
    config = RankwatchConfig.from_env(env={})
    small, large, huge = (root_tail_rows(config, n) for n in (64, 16_384, 65_536))
    assert small == 1024
    assert 216 <= huge <= large < small
    live = config.diagnosis.step_time.live_window_steps
    assert huge >= 2 * live + 16 and huge >= 216
