"""A group's windows: every rank's rows in, rounds, missing ranks, diagnosis, reports out.

The state the group's root used to keep inside its training process, now kept by the
aggregator (:mod:`.service`), which feeds it what its intake reads and asks it, every turn of
its loop, whether a window is due.

Rounds
------
Async mode: every rank ships every ``interval_seconds``; a round starts every
``interval_seconds``; a rank that shipped within the last interval is in at once, and the round
waits (up to ``gather_timeout_seconds``) for the others' next shipment. Sync mode: every rank
ships its round *k* at its ``sync_step``-th ``collect()``; round *k* starts when the first rank's
round *k* arrives and waits for every expected rank's.
A rank is *missing* from a window when its shipment did not come in time, or when it still
ships but its steps stopped advancing for ``gather_timeout_seconds`` while other ranks ran on
(its training thread is stuck). Missing ranks go to the diagnosis as absent (``None``).

At shutdown every rank ships what is left with a final flag, and :meth:`GroupWindows.summary`
builds the summary window (``summary_window_steps``) once every expected rank's final shipment
is in or the shutdown budget is spent.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from rankwatch.diagnosis.hang import HangReport
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time import (
    StepTimeReport,
    diagnose_arrays,
    diagnose_cube,
    diagnose_window,
    name_fault_unit,
)
from rankwatch.diagnosis.step_time.blocks import BLOCK_STEPS, StepBlocks
from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.diagnosis.step_time.pace import PaceHistory, rows_pace
from rankwatch.diagnosis.step_time.rules import outlier_rule
from rankwatch.diagnosis.step_time.table import ROW_WIDTH
from rankwatch.exporter.aggregator.rows import GroupRows
from rankwatch.exporter.aggregator.wire import Blocks, Rows
from rankwatch.exporter.config import RankwatchConfig

__all__ = ["ROOT_TAIL_MIN_ROWS", "GroupWindows", "Window", "root_tail_rows", "window_arrays"]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02  # slack on "shipped within the last interval"
# Keep a little more than the window per rank when cutting tails, for steps some rank skipped.
_TAIL_SLACK = 2
# Rows per rank kept in a group this small or smaller (``TAIL_BYTES`` decides above): a live
# window aligns ranks up to about this many steps apart (a rank further behind leaves the others
# no common steps to align on).
ROOT_TAIL_MIN_ROWS = 1024
# The rows of a larger group's ranks share this many bytes, down to the least a window needs.
TAIL_BYTES = 512 << 20


def root_tail_rows(config: RankwatchConfig, ranks: int = 1) -> int:
    """Rows of each rank kept: the live window's tail and two blocks of steps (the least),
    and in a group of up to a few thousand ranks room for ranks that are apart by several
    hundred steps (ranks that do not synchronise, a rank that stalled and runs behind), as
    many as ``TAIL_BYTES`` hold above that. Older steps live on as block sums, so memory does
    not grow with the run."""
    live = config.diagnosis.step_time.live_window_steps
    least = max(live * _TAIL_SLACK + 16, 2 * BLOCK_STEPS + 16)
    fits = TAIL_BYTES // (max(1, ranks) * ROW_WIDTH * 8)
    return max(least, min(ROOT_TAIL_MIN_ROWS, fits))


def window_arrays(
    buffers: GroupRows,
    present: Sequence[int],
    window: int,
    rows: int | None = None,
) -> dict[int, NDArray[np.float64] | None]:
    """Per expected rank: the tail the diagnosis aligns (None for absent ranks).

    Tails are cut at the lowest last step among present ranks (no rank can be aligned beyond
    it) and to ``rows`` rows (default: ``window`` steps plus slack), so a live window costs the
    same however long the buffers are. The diagnosis itself keeps the last ``window`` step ids
    every rank has.
    """
    rows = window * _TAIL_SLACK + 16 if rows is None else rows
    present_set = set(present)
    index = buffers.index
    lasts = [buffers.last_step[index[r]] for r in present_set if buffers.size(index[r])]
    top = float(min(lasts)) if lasts else None
    out: dict[int, NDArray[np.float64] | None] = {}
    for rank, i in index.items():
        out[rank] = buffers.tail(i, rows, top) if rank in present_set else None
    return out


class RankStates:
    """What the windows know of each rank, one array per field (by the rank's index in the
    group), so that a round of thousands of ranks updates them in a few numpy operations."""

    def __init__(self, n: int) -> None:
        self.last_heard = np.full(n, -math.inf)  # monotonic time of the last shipment
        self.round_seq = np.full(n, -1, dtype=np.int64)  # highest round seq whose end arrived
        self.round_end_at = np.full(n, -math.inf)  # monotonic time that end arrived
        self.final = np.zeros(n, dtype=bool)
        self.missing_since = np.full(n, math.nan)  # set while the rank is considered missing
        self.lost = np.zeros(n, dtype=np.int64)
        self.hung_up = np.zeros(n, dtype=bool)  # its connection closed
        self.refused = np.zeros(n, dtype=bool)  # no room to take its connection
        self.strategy: dict[int, str] = {}  # by index, the ranks that named one

    def broken(self) -> np.ndarray:
        """Ranks that cannot ship: refused, or hung up before their final rows."""
        return self.refused | (self.hung_up & ~self.final)

    def missing(self) -> np.ndarray:
        return ~np.isnan(self.missing_since)


@dataclass(frozen=True)
class Window:
    """One diagnosed window: its report and the rows behind it (for the window's file)."""

    report: WindowReport
    per_rank: dict[int, NDArray[np.float64] | None]
    steps: int  # the window's length in steps (live or summary)


class GroupWindows:
    """The windows of one group (see the module docstring); one thread uses it."""

    def __init__(
        self, ranks: Sequence[int], config: RankwatchConfig, *, first_window_index: int = 0
    ) -> None:
        self.ranks = tuple(ranks)
        self.root = self.ranks[0]
        self.config = config
        cap = root_tail_rows(config, len(self.ranks))
        self.rows = GroupRows(self.ranks, cap)
        self.blocks = StepBlocks(
            self.ranks,
            window_steps=config.diagnosis.step_time.summary_window_steps,
            tail_rows=cap,
            outliers=outlier_rule(config.diagnosis.step_time),
        )
        self.state = RankStates(len(self.ranks))
        self.index = self.rows.index
        self.infos: dict[int, RankInfo] = {}
        self._infos_tuple: tuple[RankInfo, ...] | None = None  # every rank's, until a hello
        self._hosts: dict[int, str] | None = None  # rank -> node name, until a hello
        self.mesh: MeshLayout | None = None
        self.pace = PaceHistory(config.diagnosis.step_time)
        self._pace_counted_through: int | None = None  # last step of the last live window
        self.window_index = first_window_index
        self._last_key: tuple[Any, ...] | None = None
        self._rounds_done = 0
        self._round_start: float | None = None
        self._round_seq = 0
        self._round_requested = 0  # sync mode: the highest round any rank shipped
        self.next_tick = time.monotonic() + config.interval_seconds
        self.changed: set[int] = set()  # ranks whose progress moved since the board was written

    # ---- intake ----------------------------------------------------------------------------

    def hello(self, info: RankInfo) -> None:
        """A rank connected (again): where it runs."""
        self.infos[info.rank] = info
        self._infos_tuple = self._hosts = None
        i = self.index[info.rank]
        self.state.hung_up[i] = self.state.refused[i] = False
        self.changed.add(info.rank)

    def refused(self, rank: int) -> None:
        """A rank the intake had no room for: named missing."""
        self.state.refused[self.index[rank]] = True
        self.changed.add(rank)

    def hung_up(self, rank: int) -> None:
        """A rank's connection closed (after its final rows, or not)."""
        self.state.hung_up[self.index[rank]] = True
        self.changed.add(rank)

    def take(self, rank: int, shipment: Rows, now: float) -> None:
        """One shipment (or part) of ``rank``'s rows."""
        self.take_all([shipment], now)

    def take_blocks(self, shipments: Sequence[Blocks]) -> None:
        """Closed blocks of steps, each summed by its rank, for the summary window."""
        if not shipments:
            return
        ranks = [s.rank for s in shipments for _ in range(len(s.records))]
        # One buffer of every record: concatenating thousands of small structured arrays
        # costs more than their bytes (numpy promotes each array's fields).
        dtype = shipments[0].records.dtype
        records = np.frombuffer(b"".join(s.records.tobytes() for s in shipments), dtype=dtype)
        try:
            self.blocks.put_records(ranks, records)
        except ValueError as exc:  # a rank of another version; its rows still count
            log.warning("rankwatch: dropped closed blocks: %s", exc)

    def take_all(self, shipments: Sequence[Rows], now: float) -> None:
        """Every shipment read in one turn, in the order read, with the usual round (every
        rank's rows after its last, the same count each) taken in a few passes of numpy
        instead of one per rank."""
        by_rank: dict[int, list[Rows]] = {}
        for shipment in shipments:
            by_rank.setdefault(shipment.rank, []).append(shipment)
        by_length: dict[int, tuple[list[int], list[NDArray[np.float64]]]] = {}
        for rank, parts in by_rank.items():
            rows = parts[0].rows if len(parts) == 1 else np.concatenate([p.rows for p in parts])
            ranks, arrays = by_length.setdefault(len(rows), ([], []))
            ranks.append(rank)
            arrays.append(rows)
        for ranks, arrays in by_length.values():
            idx = np.fromiter((self.index[r] for r in ranks), np.int64, len(ranks))
            for j in self.rows.append_batch(idx, arrays, now).tolist():
                self.rows.append(int(idx[j]), arrays[j], now)
        self._note(by_rank, now)

    def _note(self, by_rank: dict[int, list[Rows]], now: float) -> None:
        """What the shipments say of their ranks: heard, rounds ended, final rows, back."""
        if not by_rank:
            return
        st = self.state
        last = [parts[-1] for parts in by_rank.values()]
        idx = np.fromiter((self.index[s.rank] for s in last), np.int64, len(last))
        st.last_heard[idx] = now
        st.lost[idx] = [s.lost for s in last]
        ended = [
            (i, p.seq)
            for i, parts in zip(idx.tolist(), by_rank.values(), strict=True)
            for p in parts
            if p.end_of_round
        ]
        if ended:
            e_idx = np.fromiter((i for i, _ in ended), np.int64, len(ended))
            seqs = np.fromiter((q for _, q in ended), np.int64, len(ended))
            np.maximum.at(st.round_seq, e_idx, seqs)
            st.round_end_at[e_idx] = now
            self._round_requested = max(self._round_requested, int(seqs.max()))
        for i, parts in zip(idx.tolist(), by_rank.values(), strict=True):
            for part in parts:
                if part.strategy is not None and st.strategy.get(i) != part.strategy:
                    st.strategy[i] = part.strategy
                if part.final:
                    st.final[i] = True
        back = idx[~np.isnan(st.missing_since[idx]) & (now > st.missing_since[idx])]
        for i in back.tolist():
            log.info("rankwatch: rank %d is back", self.ranks[i])
        st.missing_since[back] = math.nan
        self.changed.update(by_rank)

    # ---- windows ---------------------------------------------------------------------------

    def due(self, now: float) -> float:
        """Seconds until the loop should look again (a round waiting, the next tick)."""
        if self._round_start is not None:
            return POLL_SECONDS
        if self.config.async_mode:
            return max(0.0, min(0.1, self.next_tick - now))
        return 0.1

    def tick(self, now: float) -> Window | None:
        """The live window, when a round completed (or timed out) at ``now``."""
        cfg = self.config
        if self._round_start is None:
            if cfg.async_mode and now >= self.next_tick:
                self._round_start, self._round_seq = now, self._rounds_done + 1
            elif not cfg.async_mode and self._round_requested > self._rounds_done:
                self._round_start, self._round_seq = now, self._round_requested
        if self._round_start is None:
            return None
        waiting = self._waiting_for(self._round_seq, self._round_start)
        if waiting and now < self._round_start + cfg.gather_timeout_seconds:
            return None
        for rank in waiting:
            self._mark_missing(rank, now)
        self._rounds_done = self._round_seq
        self._round_start = None
        self.next_tick = now + cfg.interval_seconds
        return self._window("live", cfg.diagnosis.step_time.live_window_steps, now)

    def finals_missing(self) -> list[int]:
        """Ranks whose final shipment is still expected (shutdown)."""
        st = self.state
        waiting = ~st.final & ~st.missing() & ~st.broken()
        return [self.ranks[i] for i in np.flatnonzero(waiting).tolist()]

    def summary(self, now: float) -> Window | None:
        """The summary window, once the final shipments are in or the budget is spent."""
        for rank in self.finals_missing():
            self._mark_missing(rank, now)
        return self._window("summary", self.config.diagnosis.step_time.summary_window_steps, now)

    def hang_report(self, hang: HangReport) -> WindowReport:
        """The hang watcher's verdict (or its end) as the group's next report."""
        return self._next_report(hang=hang)

    def progress_at(self, rank: int) -> float | None:
        """When ``rank``'s shipped steps last advanced (monotonic; None before any)."""
        i = self.rows.index.get(rank)
        if i is None or not self.rows.size(i):
            return None
        return float(self.rows.progress_at[i])

    # ---- internals -------------------------------------------------------------------------

    def _waiting_for(self, round_seq: int, round_start: float) -> list[int]:
        """Ranks expected in this round that have not shipped for it yet.

        Async: a rank is in when it shipped within the last interval (it ships once per
        interval, on its own clock), so a healthy round closes at once. Sync: a rank is in when
        its round ``round_seq`` (or a later one) has arrived.
        """
        recent = round_start - self.config.interval_seconds - POLL_SECONDS
        st = self.state
        expected = ~st.missing() & ~st.final & ~st.broken()
        done = st.round_end_at >= recent if self.config.async_mode else st.round_seq >= round_seq
        return [self.ranks[i] for i in np.flatnonzero(expected & ~done).tolist()]

    def _broken(self) -> set[int]:
        """Ranks that cannot ship (refused for want of room, or hung up before their final
        rows)."""
        return {self.ranks[i] for i in np.flatnonzero(self.state.broken()).tolist()}

    def _mark_missing(self, rank: int, now: float) -> None:
        i = self.index[rank]
        if math.isnan(self.state.missing_since[i]):
            log.warning(
                "rankwatch: rank %d did not ship within %.1f s; marked missing",
                rank,
                self.config.gather_timeout_seconds,
            )
            self.state.missing_since[i] = now

    def _missing(self, now: float, summary: bool) -> list[int]:
        """Ranks absent from the window: not shipping, or (live windows) shipping without
        progress. The summary counts a rank that shipped its final rows as present, however
        early it stopped stepping."""
        st = self.state
        missing = {self.ranks[i] for i in np.flatnonzero(st.missing() | st.broken()).tolist()}
        if summary:
            return sorted(missing)
        # Stalled: still shipping but no new step for the gather timeout while another rank
        # ran further.
        rows = self.rows
        alive = rows.count > 0
        if missing:
            alive[[rows.index[r] for r in missing]] = False
        if np.count_nonzero(alive) > 1:
            top = rows.last_step[alive].max()
            limit = self.config.gather_timeout_seconds
            stalled = alive & (rows.last_step < top) & (now - rows.progress_at > limit)
            missing.update(self.ranks[i] for i in np.flatnonzero(stalled).tolist())
        return sorted(missing)

    def strategy(self) -> str | None:
        """The root's own strategy, else the first one another rank detected."""
        named = self.state.strategy
        if 0 in named:  # the root's (index 0: the lowest rank)
            return named[0]
        return named[min(named)] if named else None

    def _window(self, kind: str, window: int, now: float) -> Window | None:
        missing = self._missing(now, summary=kind == "summary")
        present = [r for r in self.ranks if r not in missing]
        started = time.perf_counter()
        try:
            per_rank, step_time = self._diagnose(kind, present, window)
        except Exception:
            log.exception("rankwatch: step-time diagnosis failed for this window")
            return None
        if self._hosts is None:
            self._hosts = {r: info.hostname for r, info in self.infos.items()}
        step_time = name_fault_unit(step_time, self._hosts, self.config.diagnosis.step_time)
        elapsed = time.perf_counter() - started
        key = (step_time.step_range, tuple(missing))
        if kind == "live" and (
            key == self._last_key or (step_time.step_range is None and not missing)
        ):
            return None  # nothing new since the last window: do not publish it twice
        self._last_key = key
        pace = None
        if kind == "live":
            try:
                rows = rows_pace(per_rank, step_time.clock, self._pace_counted_through)
                pace = self.pace.update(step_time, self.window_index, self._hosts, rows)
                if step_time.step_range is not None:
                    self._pace_counted_through = step_time.step_range[1]
            except Exception:  # the verdict goes out without it
                log.exception("rankwatch: the pace baseline failed for this window")
        report = self._next_report(
            window_kind=kind,
            missing_ranks=tuple(missing),
            step_time=step_time,
            pace=pace,
            diagnosis_seconds={"step_time": elapsed},
        )
        return Window(report, per_rank, window)

    def _next_report(self, **fields: Any) -> WindowReport:
        if self._infos_tuple is None:
            self._infos_tuple = tuple(self.infos.get(r) or RankInfo(r) for r in self.ranks)
        report = WindowReport(
            group=self.config.group_name,
            window_index=self.window_index,
            created_at_s=time.time(),
            ranks=self._infos_tuple,
            run=self.config.run_id,
            **fields,
        )
        self.window_index += 1
        return report

    def _diagnose(
        self, kind: str, present: list[int], window: int
    ) -> tuple[dict[int, NDArray[np.float64] | None], StepTimeReport]:
        """The window's rows as kept and its report. Live windows come from the rows; the
        summary from the rows and the block sums of older steps (bounded memory)."""
        cfg, strategy, mesh = self.config.diagnosis.step_time, self.strategy(), self.mesh
        rows = self.rows
        if kind != "summary":
            report = self._in_step(present, window)
            if report is not None:
                return report
            # Ranks not in step: align their tails, the last ``window`` rows first (the
            # usual case, half the cost), else the longer ones.
            per_rank = window_arrays(rows, present, window, rows=window)
            report = diagnose_arrays(
                per_rank, strategy=strategy, window=window, config=cfg, mesh=mesh
            )
            if report.steps < window:
                per_rank = window_arrays(rows, present, window)
                report = diagnose_arrays(
                    per_rank, strategy=strategy, window=window, config=cfg, mesh=mesh
                )
            return per_rank, report
        side_by_side = self._summary_in_step(present, window)
        if side_by_side is not None:
            return side_by_side
        keep = set(present)
        tails: dict[int, NDArray[np.float64] | None] = {
            r: (rows.tail(i, rows.size(i)) if r in keep else None) for r, i in rows.index.items()
        }
        complete = [r for r, i in rows.index.items() if rows.count[i] <= rows.capacity]
        means = self.blocks.reduce(tails, window, complete=complete)
        return tails, diagnose_window(means, strategy=strategy, config=cfg, mesh=mesh)

    def _summary_in_step(
        self, present: list[int], window: int
    ) -> tuple[dict[int, NDArray[np.float64] | None], StepTimeReport] | None:
        """The summary when every present rank's kept rows end in step (as :meth:`_in_step`):
        their rows up to the lowest last step, side by side, with the older steps from the
        blocks; no tail copied per rank (at 16,384 ranks the general way takes seconds). None
        when they are not in step."""
        rows = self.rows
        if not present:
            return None
        idx = np.fromiter((rows.index[r] for r in present), np.int64, len(present))
        lasts = rows.last_step[idx]
        skip = (lasts - lasts.min()).astype(np.int64)
        n = int((np.minimum(rows.count[idx], rows.capacity) - skip).min())
        if n <= 0:
            return None
        complete = bool((rows.count[idx] <= rows.capacity).all())
        if not complete:
            # Closed blocks hold every step before the newest block edge of the lowest rank:
            # the rows from one block before it on are enough (a few hundred rows, not the
            # whole ring: this is what keeps the summary of a large group within close()).
            bs = self.blocks.block_steps
            edge = (int(lasts.min()) // bs - 1) * bs
            ids_of_one = rows.last_rows(idx[:1], n, skip[:1])[0, :, 0]
            n -= int(np.searchsorted(ids_of_one, edge))
        cube = rows.last_rows(idx, n, skip)
        ids = cube[0, :, 0]
        if ids[-1] != lasts.min() or not (cube[:, :, 0] == ids).all():
            return None
        means = self.blocks.reduce_cube(present, cube, window, complete=complete)
        cfg = self.config.diagnosis.step_time
        report = diagnose_window(means, strategy=self.strategy(), config=cfg, mesh=self.mesh)
        per_rank: dict[int, NDArray[np.float64] | None] = dict.fromkeys(self.ranks)
        for j, rank in enumerate(present):
            per_rank[rank] = cube[j]
        return per_rank, report

    def _in_step(
        self, present: list[int], window: int
    ) -> tuple[dict[int, NDArray[np.float64] | None], StepTimeReport] | None:
        """The live window when every present rank holds the ``window`` step ids up to the
        lowest last step among them, one row per id (the usual case: ranks that shipped a few
        steps apart): one gather of their rows, none aligned one by one. None otherwise."""
        rows = self.rows
        if not present:
            return None
        idx = np.fromiter((rows.index[r] for r in present), np.int64, len(present))
        lasts = rows.last_step[idx]
        skip = (lasts - lasts.min()).astype(np.int64)  # rows past the lowest last step
        if (np.minimum(rows.count[idx], rows.capacity) < window + skip).any():
            return None
        cube = rows.last_rows(idx, window, skip)  # a view of the rows when it can be one
        ids = cube[0, :, 0]
        if ids[-1] != lasts.min() or not (cube[:, :, 0] == ids).all():
            return None
        cfg = self.config.diagnosis.step_time
        report = diagnose_cube(
            self.ranks,
            present,
            cube,
            strategy=self.strategy(),
            window=window,
            config=cfg,
            mesh=self.mesh,
        )
        per_rank: dict[int, NDArray[np.float64] | None] = dict.fromkeys(self.ranks)
        for j, rank in enumerate(present):
            per_rank[rank] = cube[j]
        return per_rank, report
