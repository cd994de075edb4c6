"""The aggregator's bounded state (row tails + block sums) gives the reports of the full rows."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.step_time import diagnose_arrays, diagnose_window
from rankwatch.diagnosis.step_time.artifact import example_window
from rankwatch.diagnosis.step_time.blocks import StepBlocks, every_step_keys
from rankwatch.diagnosis.step_time.table import (
    BASE_WIDTH,
    EXTRA_COLUMNS,
    MEAN_KEYS,
    ROW_WIDTH,
    SIGNALS,
    column,
    reduce_window,
    rows_after,
)
from rankwatch.exporter.aggregator.windows import GroupWindows, root_tail_rows, window_arrays
from rankwatch.exporter.aggregator.wire import Blocks, Rows
from rankwatch.exporter.config import RankwatchConfig

TAIL = 216
ASYNC_COL = BASE_WIDTH + EXTRA_COLUMNS.index("async_collectives")


def feed(
    per_rank: dict[int, np.ndarray | None], window: int, chunk: int = 37, tail: int = TAIL
) -> StepBlocks:
    blocks = StepBlocks(list(per_rank), window_steps=window, tail_rows=tail)
    for rank, rows in per_rank.items():
        if rows is None:
            continue
        for k in range(0, len(rows), chunk):
            blocks.add(rank, rows[k : k + chunk])
    return blocks


def bounded(per_rank: dict[int, np.ndarray | None], window: int, **kw: Any) -> Any:
    blocks = feed(per_rank, window, **kw)
    tail = kw.get("tail", TAIL)
    tails = {r: (None if a is None else a[-tail:]) for r, a in per_rank.items()}
    complete = [r for r, a in per_rank.items() if a is not None and len(a) <= tail]
    return blocks.reduce(tails, window, complete=complete), blocks


def same(a: Any, b: Any, path: str = "") -> None:
    """Field by field; floats to 1e-9 relative (block sums add in another order)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not isinstance(b, bool) and isinstance(b, (int, float)):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), (path, a, b)
    else:
        assert a == b, (path, a, b)


def windows() -> list[tuple[str, dict[int, np.ndarray | None], int]]:
    """Synthetic recorded windows of the shapes the collectors produce."""
    out: list[tuple[str, dict[int, np.ndarray | None], int]] = []
    out.append(("straggler, fits in the window", dict(example_window(8, 700).per_rank), 10_000))
    out.append(
        (
            "balanced, window on a block edge",
            dict(example_window(6, 1500, slow_rank=None).per_rank),
            1000,
        )
    )
    out.append(
        ("straggler, long run", dict(example_window(4, 5000, slow_rank=1, seed=3).per_rank), 2000)
    )
    # Mixed clock: one step of one rank lacks GPU timing, long before the tail: CPU clock.
    mixed = dict(example_window(5, 1200, slow_rank=2, seed=1).per_rank)
    assert mixed[3] is not None
    mixed[3][40, column("gpu", "step")] = np.nan
    out.append(("gpu missing on one old step", mixed, 1200))
    # H2D and optimizer on some steps only (measured on any step), input wait lost on one.
    some = dict(example_window(4, 900, slow_rank=0, seed=2).per_rank)
    for rows in some.values():
        assert rows is not None
        for clock in ("cpu", "gpu"):
            rows[1::3, column(clock, "optimizer")] = np.nan
            rows[150:, column(clock, "optimizer")] = np.nan  # no optimizer in later blocks
            rows[::2, column(clock, "h2d")] = np.nan
    assert some[2] is not None
    some[2][100, column("cpu", "input_wait")] = np.nan
    some[2][100, column("gpu", "input_wait")] = np.nan
    out.append(("h2d/optimizer on some steps, input wait unmeasured", some, 900))
    # An absent rank, and a rank that stopped 30 steps early (shipped its final rows).
    ragged = dict(example_window(6, 1000, slow_rank=4, seed=5).per_rank)
    ragged[1] = None
    assert ragged[5] is not None
    ragged[5] = ragged[5][:-30]
    out.append(("absent rank, one rank ended early", ragged, 10_000))
    # Step ids starting mid-block and with a gap every rank shares.
    shifted = dict(example_window(3, 800, slow_rank=1, seed=7).per_rank)
    for r, rows in shifted.items():
        assert rows is not None
        rows[:, 0] += 57
        shifted[r] = np.delete(rows, np.s_[300:320], axis=0)
    out.append(("ids from 57 with a shared gap", shifted, 10_000))
    # The CPU clock with the sync waits timed on every step (a hooked DDP job on the CPU).
    waits = dict(example_window(4, 1500, slow_rank=3, seed=11).per_rank)
    for r, rows in waits.items():
        assert rows is not None
        for signal in SIGNALS:
            rows[:, column("gpu", signal)] = np.nan  # no GPU clock
        base = 0.5 if r == 3 else 6.0  # the culprit waits least
        rows[:, column("cpu", "forward_wait")] = base
        rows[:, column("cpu", "backward_wait")] = base + 0.25 * (rows[:, 0] % 3)
    out.append(("sync waits on the CPU clock", waits, 1000))
    # Collectives that do not block the host, flagged on one step the blocks hold: kept.
    flagged = {r: None if a is None else a.copy() for r, a in waits.items()}
    assert flagged[2] is not None
    flagged[2][:, ASYNC_COL] = 0.0
    flagged[2][700, ASYNC_COL] = 1.0  # in the window, older than the tail
    out.append(("async collectives flagged on an old step", flagged, 1000))
    # The GPU clock with its own sync waits (an NCCL job), the CPU waits different, one old
    # step of one rank without its GPU backward wait (that step holds the window's fallback).
    gpu_waits = dict(example_window(4, 1500, slow_rank=1, seed=13).per_rank)
    for r, rows in gpu_waits.items():
        assert rows is not None
        base = 0.5 if r == 1 else 6.0
        rows[:, column("gpu", "forward_wait")] = base
        rows[:, column("gpu", "backward_wait")] = base + 0.25 * (rows[:, 0] % 3)
        rows[:, column("cpu", "forward_wait")] = 0.01
        rows[:, column("cpu", "backward_wait")] = 0.02
        rows[:, ASYNC_COL] = 1.0
    out.append(("sync waits on the GPU clock", gpu_waits, 1000))
    lost = {r: None if a is None else a.copy() for r, a in gpu_waits.items()}
    assert lost[0] is not None
    lost[0][650, column("gpu", "backward_wait")] = np.nan
    out.append(("a GPU wait lost on an old step", lost, 1000))
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize(("name", "per_rank", "window"), windows(), ids=lambda x: str(x)[:40])
def test_bounded_state_gives_the_same_report(
    name: str, per_rank: dict[int, np.ndarray | None], window: int, strategy: str
) -> None:
    cfg = StepTimeConfig()
    want = diagnose_arrays(per_rank, strategy=strategy, window=window, config=cfg)
    means, blocks = bounded(per_rank, window)
    assert not blocks.approximate, name
    got = diagnose_window(means, strategy=strategy, config=cfg)
    same(want.to_dict(), got.to_dict())
    old = reduce_window(per_rank, window=window)
    assert (old.measured == means.measured).all() and old.clock == means.clock


def test_a_cut_window_rounds_its_start_to_a_whole_block_with_the_same_verdict() -> None:
    per_rank: dict[int, np.ndarray | None] = dict(example_window(8, 2050, slow_rank=6).per_rank)
    want = diagnose_arrays(per_rank, window=1000)
    means, blocks = bounded(per_rank, 1000)
    got = diagnose_window(means)
    assert blocks.approximate
    assert 1000 - blocks.block_steps < got.steps <= 1000 and got.step_range is not None
    assert got.step_range[1] == 2049 and got.step_range[0] % blocks.block_steps == 0
    assert (got.kind, got.severity, got.ranks) == (want.kind, want.severity, want.ranks)
    assert got.straggler is not None and want.straggler is not None
    assert got.straggler.culprit_rank == want.straggler.culprit_rank == 6


def test_every_step_rule_is_read_from_the_reduction() -> None:
    every = dict(zip(MEAN_KEYS, every_step_keys().tolist(), strict=True))
    assert every == {
        "input_wait": True,
        "h2d": False,
        "forward": True,
        "backward": True,
        "optimizer": False,
        "step": True,
        "residual": True,
        "forward_wait": True,
        "backward_wait": True,
    }


def test_state_is_bounded_by_the_window_not_the_run() -> None:
    sizes = []
    for steps in (2_000, 20_000):
        blocks = feed(dict(example_window(4, steps).per_rank), 1_000, chunk=512)
        sizes.append(blocks.nbytes())
    assert sizes[0] == sizes[1]


def test_rows_after_drops_resent_and_out_of_order_rows() -> None:
    def ids(*steps: float) -> np.ndarray:
        rows = np.full((len(steps), ROW_WIDTH), 1.0)
        rows[:, 0] = steps
        return rows

    fresh = ids(5, 6, 9)
    assert rows_after(fresh, 4.0) is fresh  # the usual shipment: nothing copied
    assert rows_after(ids(3, 4, 5, 6), 4.0)[:, 0].tolist() == [5, 6]  # resent head
    assert rows_after(ids(5, 8, 7, 9), 4.0)[:, 0].tolist() == [5, 8, 9]  # one out of order
    assert rows_after(ids(2, 1), 4.0).shape == (0, ROW_WIDTH)
    assert rows_after(ids(), -1.0).shape == (0, ROW_WIDTH)
    # The first step of a run (nothing received yet: last step -1) is kept.
    assert rows_after(ids(0, 1), -1.0)[:, 0].tolist() == [0, 1]


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="tail_rows"):
        StepBlocks([0], window_steps=100, tail_rows=10)
    with pytest.raises(ValueError, match="block_steps"):
        StepBlocks([0], window_steps=100, tail_rows=500, block_steps=0)


@pytest.mark.parametrize("complete", [False, True])
@pytest.mark.parametrize(("name", "per_rank", "window"), windows(), ids=lambda x: str(x)[:40])
def test_rows_side_by_side_reduce_as_the_same_rows_one_by_one(
    name: str, per_rank: dict[int, np.ndarray | None], window: int, complete: bool
) -> None:
    """The aggregator's summary hands the blocks its rows side by side (the ranks' last rows
    up to the lowest last step); the means are those of the same rows given rank by rank,
    and rows not in step (a shared gap is in step; a lone one is not) go that way too."""
    blocks = feed(per_rank, window)
    present = [r for r, a in per_rank.items() if a is not None]
    lowest = min(float(per_rank[r][-1, 0]) for r in present)  # type: ignore[index]
    cut = [a[a[:, 0] <= lowest] for r in present if (a := per_rank[r]) is not None]
    n = min(TAIL, *(len(a) for a in cut))
    cube = np.stack([a[-n:] for a in cut])
    tails: dict[int, np.ndarray | None] = dict.fromkeys(per_rank)
    for j, r in enumerate(present):
        tails[r] = cube[j]
    want = blocks.reduce(tails, window, complete=present if complete else ())
    approximate = blocks.approximate
    got = blocks.reduce_cube(present, cube, window, complete=complete)
    assert blocks.approximate == approximate, name
    np.testing.assert_allclose(got.means, want.means, rtol=1e-12)
    np.testing.assert_array_equal(got.measured, want.measured)
    np.testing.assert_array_equal(got.present, want.present)
    assert (got.steps, got.step_range, got.clock, got.async_collectives) == (
        want.steps,
        want.step_range,
        want.clock,
        want.async_collectives,
    )
    assert got.outlier_steps == want.outlier_steps


def test_rows_side_by_side_not_in_step_go_the_general_way() -> None:
    per_rank: dict[int, np.ndarray | None] = dict(example_window(3, 700, slow_rank=1).per_rank)
    blocks = feed(per_rank, 1000)
    cube = np.stack([a[-TAIL:] for a in per_rank.values() if a is not None])
    cube[1, :, 0] += 1  # rank 1's ids one step ahead of the others': not side by side
    tails = {r: cube[j] for j, r in enumerate(per_rank)}
    want = blocks.reduce(dict(tails), 1000)
    got = blocks.reduce_cube(list(per_rank), cube, 1000, complete=False)
    np.testing.assert_array_equal(got.means, want.means)
    assert got.step_range == want.step_range


def test_the_root_summary_matches_the_full_rows() -> None:
    """The aggregator keeps bounded rows, yet its summary is the full-row report."""
    ranks = (0, 1, 2, 3)
    config = RankwatchConfig.from_env(env={})
    collector = GroupWindows(ranks, config)
    per_rank: dict[int, np.ndarray | None] = dict(example_window(4, 3000, slow_rank=2).per_rank)
    # Each rank sums its own closed blocks and ships them with its rows (as RowShipper does).
    own = {r: StepBlocks((r,), window_steps=10_000, tail_rows=200, records=True) for r in ranks}
    for k in range(0, 3000, 250):
        for r in ranks:
            rows = per_rank[r]
            assert rows is not None
            own[r].add(r, rows[k : k + 250])
            own[r].flush()
            collector.take_blocks([Blocks(r, own[r].taken_records()[1])])
            collector.take(r, Rows(r, 0, 0, "ddp", 0, rows[k : k + 250]), 0.0)
    cap = root_tail_rows(config, len(ranks))
    assert all(collector.rows.size(i) == cap for i in range(len(ranks)))
    window = config.diagnosis.step_time.summary_window_steps
    assert collector._summary_in_step(list(ranks), window) is not None  # the ranks in step
    _, got = collector._diagnose("summary", list(ranks), window)
    want = diagnose_arrays(per_rank, strategy="ddp", window=window)
    same(want.to_dict(), got.to_dict())


@pytest.mark.parametrize("gap", [False, True])
def test_the_live_window_from_short_tails_is_the_full_tail_window(gap: bool) -> None:
    """Ranks in step align on their last rows alone; a rank that skipped steps makes the root
    align the longer tails, as before."""
    ranks = (0, 1, 2)
    config = RankwatchConfig.from_env(env={})
    collector = GroupWindows(ranks, config)
    per_rank: dict[int, np.ndarray | None] = dict(example_window(3, 400, slow_rank=1).per_rank)
    if gap:
        rows = per_rank[1]
        assert rows is not None
        per_rank[1] = np.delete(rows, np.s_[350:360], axis=0)
    for r in ranks:
        rows = per_rank[r]
        assert rows is not None
        collector.take(r, Rows(r, 0, 0, "ddp", 0, rows), 0.0)
    window = config.diagnosis.step_time.live_window_steps
    _, got = collector._diagnose("live", list(ranks), window)
    full = window_arrays(collector.rows, list(ranks), window)
    want = diagnose_arrays(full, strategy="ddp", window=window)
    same(want.to_dict(), got.to_dict())
    assert got.steps == window and got.step_range == ((290, 399) if gap else (300, 399))


def test_one_shipment_longer_than_the_ring_keeps_the_newest_blocks() -> None:
    """A rank that ships more steps at once than the summary window keeps the newest blocks
    (fast steps, long interval), so the summary is still the last ``window`` steps."""
    per_rank: dict[int, np.ndarray | None] = dict(example_window(2, 2600, slow_rank=1).per_rank)
    for r, rows in per_rank.items():  # an old block with a gap: shorter than the others
        assert rows is not None
        per_rank[r] = np.delete(rows, np.s_[1200:1210], axis=0)
    means, blocks = bounded(per_rank, 1000, chunk=2600)
    want = reduce_window(per_rank, window=1000)
    assert not blocks.approximate
    assert means.step_range == want.step_range == (1600, 2599)
    assert np.allclose(means.means, want.means, rtol=1e-9)


def test_blocks_summed_by_each_rank_are_the_blocks_summed_in_one_place() -> None:
    """A rank's own closed blocks, shipped as records and kept elsewhere, give the window the
    blocks summed from the rows in one place give: records carry every field."""
    per_rank: dict[int, np.ndarray | None] = dict(example_window(3, 2600, slow_rank=1).per_rank)
    rows1 = per_rank[1]
    assert rows1 is not None
    per_rank[1] = np.delete(rows1, np.s_[1200:1210], axis=0)  # a ragged old block
    central = feed(per_rank, 1000, chunk=130)
    kept = StepBlocks(list(per_rank), window_steps=1000, tail_rows=TAIL)
    for rank, rows in per_rank.items():
        assert rows is not None
        own = StepBlocks([rank], window_steps=1000, tail_rows=TAIL, records=True)
        for k in range(0, len(rows), 130):
            own.add(rank, rows[k : k + 130])
            own.flush()
            ranks, records = own.taken_records()
            assert set(ranks) <= {rank}
            kept.put_records(ranks, records)
    tails = {r: (a[-TAIL:] if a is not None else None) for r, a in per_rank.items()}
    a, b = central.reduce(tails, 1000), kept.reduce(tails, 1000)
    np.testing.assert_array_equal(a.means, b.means)
    np.testing.assert_array_equal(a.measured, b.measured)
    assert (a.steps, a.step_range, a.clock) == (b.steps, b.step_range, b.clock)
    assert central.approximate == kept.approximate


def test_block_records_bad_input_is_named() -> None:
    blocks = StepBlocks([0], window_steps=1000, tail_rows=TAIL)
    with pytest.raises(ValueError, match="records=True"):
        blocks.taken_records()
    with pytest.raises(ValueError, match="field records: dtype"):
        blocks.put_records([0], np.zeros(1, dtype=[("index", "<i8")]))
    bad = np.zeros(1, dtype=blocks.record_dtype)
    bad["index"] = -3
    with pytest.raises(ValueError, match="block index -3 is negative"):
        blocks.put_records([0], bad)
