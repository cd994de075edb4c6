"""Cross-rank windows: every rank ships its finished step rows to the group's root, which
aligns them, diagnoses the window and hands the report to the publishers.

How rows travel is :mod:`.transport`'s business (Gloo point to point, store doorbells); this
module decides when, and what the root makes of them.

Rounds
------
Async mode: every rank ships every ``interval_seconds``; the root starts a round every
``interval_seconds``; a rank that shipped within the last interval is in at once, and the root
waits (up to ``gather_timeout_seconds``) for the others' next shipment. Sync mode: every
``sync_step``-th ``collect()`` call ships (round *k* on every rank); the root's round *k* waits
for every expected rank's round *k*.
A rank is *missing* from a window when its shipment did not come in time, or when it still
ships but its steps stopped advancing for ``gather_timeout_seconds`` while other ranks ran on
(its training thread is stuck). Missing ranks go to the diagnosis as absent (``None``).

At shutdown every rank ships what is left with a final flag, and the root builds the summary
window (``summary_window_steps``) once every expected rank's final shipment is in or the
shutdown budget is spent.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from rankwatch.diagnosis.hang import HangReport
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time import StepTimeReport, diagnose_arrays, diagnose_window
from rankwatch.diagnosis.step_time.blocks import BLOCK_STEPS, StepBlocks
from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.diagnosis.step_time.rules import outlier_rule
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.identity import (
    local_identity,
)
from rankwatch.exporter.publish.protocol import Publisher, publish_to_all
from rankwatch.exporter.step_time.artifacts import StepArtifactWriter
from rankwatch.exporter.step_time.messages import (
    CHUNK_ROWS,
    FLAG_END_OF_ROUND,
    FLAG_FINAL,
    RowBuffer,
    decode_message,
    encode_message,
)
from rankwatch.exporter.step_time.timer import StepTimer
from rankwatch.exporter.step_time.transport import GroupLayout, Transport
from rankwatch.exporter.storage import GuardedWrites

__all__ = ["WindowCollector", "root_tail_rows", "window_arrays"]

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02  # root: doorbell poll period while a round or shutdown is waiting
# Root: doorbell poll period otherwise (each poll is one store request, answered by a thread
# of the store's host, usually rank 0: polling fast costs that process CPU time).
IDLE_POLL_SECONDS = 0.1
_MAX_POLLS_PER_DRAIN = 16
# Keep a little more than the window per rank when cutting tails, for steps some rank skipped.
_TAIL_SLACK = 2
# The root's rows per rank, at least: a live window aligns ranks up to about this many steps
# apart (a rank further behind leaves the others no common steps to align on).
ROOT_TAIL_MIN_ROWS = 1024


def root_tail_rows(config: RankwatchConfig) -> int:
    """Rows of each rank the root keeps: the live window's tail and two blocks of steps, and
    room for ranks that are apart by several hundred steps (ranks that do not synchronise, a
    rank that stalled and runs behind); older steps live on as block sums, so the root's
    memory does not grow with the run."""
    live = config.diagnosis.step_time.live_window_steps
    return max(live * _TAIL_SLACK + 16, 2 * BLOCK_STEPS + 16, ROOT_TAIL_MIN_ROWS)


def window_arrays(
    buffers: Mapping[int, RowBuffer],
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
    lasts = [buffers[r].last_step for r in present_set if len(buffers[r])]
    top = min(lasts) if lasts else None
    out: dict[int, NDArray[np.float64] | None] = {}
    for rank, buf in buffers.items():
        if rank not in present_set:
            out[rank] = None
            continue
        out[rank] = buf.tail(rows, top)
    return out


# ---- the collector thread ------------------------------------------------------------------


@dataclass
class _PeerState:
    last_heard: float = -math.inf  # monotonic time of the last message
    round_seq: int = -1  # highest round seq whose end arrived
    round_end_at: float = -math.inf  # monotonic time the last end-of-round arrived
    final: bool = False
    missing_since: float | None = None  # set while the rank is considered missing
    lost: int = 0
    strategy: str | None = None


class WindowCollector:
    """The background thread of one rank: ships rows (every rank) and builds windows (root).

    ``trigger()`` is ``collect()``'s hand-off in sync mode (sets an event, never blocks).
    ``stop(timeout)`` ships the last rows, lets the root build the summary window, and joins
    the thread within the timeout.
    """

    def __init__(
        self,
        layout: GroupLayout,
        timer: StepTimer,
        config: RankwatchConfig,
        publishers: Sequence[Publisher],
        transport: Transport | None,
        strategy: Callable[[], str | None],
        identity: tuple[str, int, str, str] | None = None,
    ) -> None:
        self.layout = layout
        self.timer = timer
        self.config = config
        self.publishers = tuple(publishers)
        self.transport = transport
        self._strategy = strategy
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._final_deadline = math.inf
        self._sync_requested = 0
        self._cursor = 0
        self.lost = 0  # rows overwritten in the local ring before they were shipped
        self.sent_messages = 0
        self.latest_report: WindowReport | None = None
        self.reports_published = 0
        # CPU time this thread has used (its own clock): what rankwatch costs besides hooks.
        self.cpu_seconds = 0.0
        self._cpu0 = 0.0
        self._thread = threading.Thread(
            target=self._run, name=f"rankwatch-{layout.rank}", daemon=True
        )
        # Root state (buffers only on the root: the others just ship): the newest rows of each
        # rank, and block sums of the older ones for the summary window.
        cap = root_tail_rows(config)
        self._buffers = {r: RowBuffer(cap) for r in layout.ranks} if layout.is_root else {}
        self._blocks = (
            StepBlocks(
                layout.ranks,
                window_steps=config.diagnosis.step_time.summary_window_steps,
                tail_rows=cap,
                outliers=outlier_rule(config.diagnosis.step_time),
            )
            if layout.is_root
            else None
        )
        self._artifacts = StepArtifactWriter.from_config(config) if layout.is_root else None
        self._peers = {r: _PeerState() for r in layout.peers}
        ident = identity if identity is not None else local_identity(config.node_name_env)
        self._info: dict[int, RankInfo] = {layout.rank: RankInfo(layout.rank, *ident)}
        self._window_index = 0
        # The hang watcher publishes from its own thread: window numbers and publishing in order.
        self._publish_lock = threading.Lock()
        self._last_key: tuple[Any, ...] | None = None
        # The job's device mesh (root: the diagnosis compares ranks within its comparison
        # groups); set by ``RankWatch.watch`` on every rank, read by this thread per window.
        self.mesh: MeshLayout | None = None

    # ---- control (training thread) -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def trigger(self) -> None:
        """Sync mode: one more round is due (called every ``sync_step`` collects)."""
        self._sync_requested += 1
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def storage_guards(self) -> list[GuardedWrites]:
        """The storage-fault guards of what this collector writes (the root's step windows)."""
        return [] if self._artifacts is None else [self._artifacts.guard]

    def stop(self, timeout_seconds: float) -> bool:
        """Ship the rest, build the summary (root), join, and release the group once the
        thread has ended; True if it ended in time (a thread left behind keeps the group)."""
        if not self._thread.is_alive():
            self._release()
            return True
        start = time.monotonic()
        # The root waits for final shipments for at most half the budget (and never longer
        # than the gather timeout), keeping the rest for the summary and the publishers.
        self._final_deadline = start + min(self.config.gather_timeout_seconds, timeout_seconds / 2)
        self._stop.set()
        self._wake.set()
        self._thread.join(max(0.0, timeout_seconds - (time.monotonic() - start)))
        if self._thread.is_alive():
            log.warning(
                "rankwatch: rank %d background thread still busy after %.1f s (blocked on the "
                "root?); leaving it behind",
                self.layout.rank,
                timeout_seconds,
            )
            return False
        self._release()
        return True

    def _release(self) -> None:
        if self.transport is not None:
            self.transport.release()

    # ---- thread --------------------------------------------------------------------------

    def _run(self) -> None:
        self._cpu0 = time.thread_time()
        try:
            if self.layout.is_root:
                self._run_root()
            else:
                self._run_sender()
        except Exception:  # the thread must never take training down with it
            log.exception("rankwatch: rank %d background thread failed", self.layout.rank)
        finally:
            if self.transport is not None:
                self.transport.close()
            self._account()

    def _account(self) -> None:
        self.cpu_seconds = time.thread_time() - self._cpu0

    # sender ---------------------------------------------------------------------------------

    def _run_sender(self) -> None:
        cfg = self.config
        shipped_rounds = 0
        next_ship = time.monotonic() + cfg.interval_seconds
        while True:
            if cfg.async_mode:
                self._wake.wait(max(0.0, next_ship - time.monotonic()))
            else:
                self._wake.wait()
            self._wake.clear()
            self._account()
            stopping = self._stop.is_set()
            if stopping:
                self._ship(self._sync_requested, FLAG_END_OF_ROUND | FLAG_FINAL)
                return
            if cfg.async_mode:
                if time.monotonic() >= next_ship:
                    shipped_rounds += 1
                    self._ship(shipped_rounds, FLAG_END_OF_ROUND)
                    next_ship = time.monotonic() + cfg.interval_seconds
            elif self._sync_requested > shipped_rounds:
                shipped_rounds = self._sync_requested
                self._ship(shipped_rounds, FLAG_END_OF_ROUND)
            if self.transport is not None and self.transport.failed:
                return

    def _ship(self, seq: int, flags: int) -> None:
        transport = self.transport
        if transport is None or transport.failed:
            return
        try:
            if not self._wait_admitted(final=bool(flags & FLAG_FINAL)):
                return  # the root has no room for this rank (yet): the rows stay in the ring
            rows = self._read()
            buf = transport.send_buffer
            chunks = max(1, math.ceil(len(rows) / CHUNK_ROWS))
            for k in range(chunks):
                part = rows[k * CHUNK_ROWS : (k + 1) * CHUNK_ROWS]
                last = k == chunks - 1
                encode_message(
                    buf,
                    part,
                    sender=self.layout.rank,
                    seq=seq,
                    flags=flags if last else 0,
                    lost=self.lost,
                    strategy=self._strategy(),
                )
                transport.send(buf)
                self.sent_messages += 1
        except Exception as exc:  # root gone, store gone: stop shipping, keep training
            log.warning(
                "rankwatch: rank %d cannot ship to root %d (%s); stopping shipments",
                self.layout.rank,
                self.layout.root,
                exc,
            )
            transport.failed = True

    def _read(self) -> NDArray[np.float64]:
        """This rank's new rows from the timer, without its first ``warmup_steps`` steps
        (never shipped: compilation, lazy initialisation, the first collective's start-up
        skew and loader workers starting would swing the first windows' means)."""
        rows, self._cursor, lost = self.timer.read(self._cursor)
        self.lost += lost
        first = self._cursor - len(rows)  # the rows' index among every step this rank timed
        skip = self.config.warmup_steps - first
        return rows[skip:] if skip > 0 else rows

    def _wait_admitted(self, *, final: bool) -> bool:
        """Whether the root has admitted this rank. The final shipment waits for it until the
        final deadline: a rank that closes before the root's first look at its hello (a short
        run, a synchronous run with no round before close) would otherwise lose its rows."""
        transport = self.transport
        assert transport is not None
        while not transport.admitted():
            if not final or time.monotonic() >= self._final_deadline:
                return False
            time.sleep(POLL_SECONDS)
        return True

    # root -----------------------------------------------------------------------------------

    def _run_root(self) -> None:
        cfg = self.config
        next_tick = time.monotonic() + cfg.interval_seconds
        rounds_done = 0
        round_start: float | None = None
        round_seq = 0
        while True:
            self._drain()
            now = time.monotonic()
            if self._stop.is_set():
                self._final_round()
                return
            if round_start is None:
                if cfg.async_mode and now >= next_tick:
                    round_start, round_seq = now, rounds_done + 1
                elif not cfg.async_mode and self._sync_requested > rounds_done:
                    round_start, round_seq = now, self._sync_requested
            if round_start is not None:
                waiting = self._waiting_for(round_seq, round_start)
                if not waiting or now >= round_start + cfg.gather_timeout_seconds:
                    for peer in waiting:
                        self._mark_missing(peer, now)
                    self._window("live", cfg.diagnosis.step_time.live_window_steps)
                    rounds_done = round_seq
                    round_start = None
                    next_tick = now + cfg.interval_seconds
            if round_start is not None:
                timeout = POLL_SECONDS
            elif cfg.async_mode:
                timeout = min(IDLE_POLL_SECONDS, max(0.0, next_tick - now))
            else:
                timeout = IDLE_POLL_SECONDS
            self._account()
            self._wake.wait(timeout)
            self._wake.clear()

    def _drain(self) -> None:
        """Move the root's own new rows and every arrived message into the row buffers."""
        if self._blocks is not None:
            self._blocks.flush()  # the blocks the last drain closed, batched over ranks
        now = time.monotonic()
        self._keep(self.layout.rank, self._read(), now)
        if self.transport is None or self.transport.failed:
            return
        messages: list[NDArray[np.float64]] = []
        try:
            # A multi-chunk shipment's next chunk lands once we re-posted the receive: ask
            # again while messages keep coming (bounded), instead of one chunk per poll period.
            for _ in range(_MAX_POLLS_PER_DRAIN):
                got = self.transport.poll()
                if not got:
                    break
                messages.extend(got)
        except Exception as exc:  # the store is gone: no more rows will arrive
            log.warning("rankwatch: root cannot read shipments (%s); windows stop", exc)
            self.transport.failed = True
        for raw in messages:
            try:
                msg = decode_message(raw)
            except ValueError as exc:
                log.warning("rankwatch: dropped a malformed message: %s", exc)
                continue
            state = self._peers.get(msg.sender)
            if state is None:
                log.warning("rankwatch: message from rank %d, not in the group", msg.sender)
                continue
            self._keep(msg.sender, msg.rows, now)
            state.last_heard = now
            state.lost = msg.lost
            if msg.strategy is not None:
                state.strategy = msg.strategy
            if msg.end_of_round:
                state.round_seq = max(state.round_seq, msg.seq)
                state.round_end_at = now
            if msg.final:
                state.final = True
            if state.missing_since is not None and now > state.missing_since:
                log.info("rankwatch: rank %d is back", msg.sender)
                state.missing_since = None

    def _keep(self, rank: int, rows: NDArray[np.float64], now: float) -> None:
        self._buffers[rank].append(rows, now)
        if self._blocks is not None:
            self._blocks.add(rank, rows)

    def _waiting_for(self, round_seq: int, round_start: float) -> list[int]:
        """Peers expected in this round that have not shipped for it yet.

        Async: a peer is in when it shipped within the last interval (it ships once per
        interval, on its own clock), so a healthy round closes at once. Sync: a peer is in
        when its round ``round_seq`` (or a later one) has arrived.
        """
        recent = round_start - self.config.interval_seconds - POLL_SECONDS
        out = []
        for peer, st in self._peers.items():
            if st.missing_since is not None or st.final or peer in self._broken():
                continue
            done = (
                st.round_end_at >= recent if self.config.async_mode else st.round_seq >= round_seq
            )
            if not done:
                out.append(peer)
        return out

    def _broken(self) -> set[int]:
        """Peers that cannot ship (refused for want of open files at the root, or failed) or
        can ship no more and have not shipped their final rows."""
        if self.transport is None:
            return set()
        hung_up = {p for p in self.transport.closed if not self._peers[p].final}
        return self.transport.broken | self.transport.refused | hung_up

    def _mark_missing(self, peer: int, now: float) -> None:
        st = self._peers[peer]
        if st.missing_since is None:
            log.warning(
                "rankwatch: rank %d did not ship within %.1f s; marked missing",
                peer,
                self.config.gather_timeout_seconds,
            )
            st.missing_since = now

    def _missing(self, now: float, summary: bool) -> list[int]:
        """Ranks absent from the window: not shipping, or (live windows) shipping without
        progress. The summary counts a rank that shipped its final rows as present, however
        early it stopped stepping."""
        missing = {p for p, st in self._peers.items() if st.missing_since is not None}
        missing |= self._broken()
        if summary:
            return sorted(missing)
        # Stalled: still shipping (or the root itself) but no new step for the gather timeout
        # while another rank ran further.
        lasts = {r: b.last_step for r, b in self._buffers.items() if r not in missing and len(b)}
        if len(lasts) > 1:
            top = max(lasts.values())
            limit = self.config.gather_timeout_seconds
            for r, last in lasts.items():
                if last < top and now - self._buffers[r].progress_at > limit:
                    missing.add(r)
        return sorted(missing)

    def _final_round(self) -> None:
        """Shutdown: wait (bounded) for every expected final shipment, then the summary."""
        while time.monotonic() < self._final_deadline:
            waiting = [
                p
                for p, st in self._peers.items()
                if not st.final and st.missing_since is None and p not in self._broken()
            ]
            if not waiting or self.transport is None or self.transport.failed:
                break
            time.sleep(POLL_SECONDS)
            self._drain()
        now = time.monotonic()
        for peer, st in self._peers.items():
            if not st.final and st.missing_since is None and peer not in self._broken():
                self._mark_missing(peer, now)
        self._window("summary", self.config.diagnosis.step_time.summary_window_steps)

    def _rank_infos(self) -> tuple[RankInfo, ...]:
        if self.transport is not None and not self.transport.failed:
            for r in self.layout.ranks:
                if r in self._info:
                    continue
                try:
                    ident = self.transport.identity(r)
                except Exception:  # the store is gone; report what we know
                    break
                if ident is not None:
                    self._info[r] = RankInfo(r, *ident)
        return tuple(self._info.get(r, RankInfo(r)) for r in self.layout.ranks)

    def strategy(self) -> str | None:
        """The root's own strategy, else the first one a peer detected."""
        mine = self._strategy()
        if mine is not None:
            return mine
        for st in self._peers.values():
            if st.strategy is not None:
                return st.strategy
        return None

    def _window(self, kind: str, window: int) -> None:
        now = time.monotonic()
        missing = self._missing(now, summary=kind == "summary")
        present = [r for r in self.layout.ranks if r not in missing]
        started = time.perf_counter()
        try:
            per_rank, step_time = self._diagnose(kind, present, window)
        except Exception:
            log.exception("rankwatch: step-time diagnosis failed for this window")
            return
        elapsed = time.perf_counter() - started
        key = (step_time.step_range, tuple(missing))
        if kind == "live" and (
            key == self._last_key or (step_time.step_range is None and not missing)
        ):
            return  # nothing new since the last window: do not publish it twice
        self._last_key = key
        with self._publish_lock:
            report = self._next_report(
                window_kind=kind,
                missing_ranks=tuple(missing),
                step_time=step_time,
                diagnosis_seconds={"step_time": elapsed},
            )
            self.latest_report = report
            self.reports_published += 1
            if self._artifacts is not None:
                self._artifacts.save(report, per_rank, window)
            publish_to_all(self.publishers, report, log)

    def publish_hang(self, hang: HangReport) -> None:
        """The hang watcher's verdict (or its end) as a report of the group (root; any thread)."""
        with self._publish_lock:
            publish_to_all(self.publishers, self._next_report(hang=hang), log)

    def _next_report(self, **fields: Any) -> WindowReport:
        """The group's next report with ``fields`` (its window number taken; the caller holds
        ``_publish_lock``)."""
        report = WindowReport(
            group=self.config.group_name,
            window_index=self._window_index,
            created_at_s=time.time(),
            ranks=self._rank_infos(),
            run=self.config.run_id,
            **fields,
        )
        self._window_index += 1
        return report

    def progress_age(self, rank: int) -> float | None:
        """Seconds since ``rank``'s shipped steps last advanced (root; None before any)."""
        buf = self._buffers.get(rank)
        if buf is None or not len(buf):
            return None
        return time.monotonic() - buf.progress_at

    def _diagnose(
        self, kind: str, present: list[int], window: int
    ) -> tuple[dict[int, NDArray[np.float64] | None], StepTimeReport]:
        """The window's rows as kept and its report. Live windows come from the rows; the
        summary from the rows and the block sums of older steps (bounded memory)."""
        cfg, strategy, mesh = self.config.diagnosis.step_time, self.strategy(), self.mesh
        if kind != "summary" or self._blocks is None:
            # Ranks in step (the usual case) share their last ``window`` rows: aligning just
            # those gives the same window at half the cost; otherwise align the longer tails.
            per_rank = window_arrays(self._buffers, present, window, rows=window)
            report = diagnose_arrays(
                per_rank, strategy=strategy, window=window, config=cfg, mesh=mesh
            )
            if report.steps < window:
                per_rank = window_arrays(self._buffers, present, window)
                report = diagnose_arrays(
                    per_rank, strategy=strategy, window=window, config=cfg, mesh=mesh
                )
            return per_rank, report
        keep = set(present)
        tails: dict[int, NDArray[np.float64] | None] = {
            r: (b.tail(len(b)) if r in keep else None) for r, b in self._buffers.items()
        }
        complete = [r for r, b in self._buffers.items() if b.count <= b.capacity]
        means = self._blocks.reduce(tails, window, complete=complete)
        return tails, diagnose_window(means, strategy=strategy, config=cfg, mesh=mesh)
