"""Every rank's background thread: its finished step rows, shipped to the group's aggregator.

The windows themselves are built by the group's aggregator (:mod:`rankwatch.exporter.aggregator`),
off every training process; this thread only reads the timer's new rows, frames them and
hands them to its :class:`~.shipping.Connection`, on the schedule of the rounds:

* async mode: every ``interval_seconds``, with the end-of-round flag;
* sync mode: at every ``sync_step``-th ``collect()`` (``trigger()``), round *k* on every rank.

At shutdown it ships what is left with the final flag and sends it within the shutdown budget.
Its cost does not depend on the size of the group: one rank's rows, one connection.

In a group larger than ``root_rank_budget`` the aggregator answers each rank with its own means
of the window just diagnosed; this thread hands them to the publishers that serve a rank's own
series (:meth:`PublisherHub.publish_own_means`), so every rank's series are served where the
rank runs.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from rankwatch.diagnosis.report import RankInfo
from rankwatch.diagnosis.step_time.blocks import BLOCK_STEPS, StepBlocks
from rankwatch.diagnosis.step_time.rules import outlier_rule
from rankwatch.exporter.aggregator.wire import (
    FLAG_END_OF_ROUND,
    FLAG_FINAL,
    MAX_BLOCKS_PER_FRAME,
    MAX_ROWS_PER_FRAME,
    OwnMeans,
    encode_blocks,
    encode_rows,
)
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.layout import GroupLayout
from rankwatch.exporter.publish.protocol import Publisher
from rankwatch.exporter.step_time.node_relay import NodeRelay
from rankwatch.exporter.step_time.shipping import Connection
from rankwatch.exporter.step_time.timer import StepTimer

__all__ = ["RowShipper"]

log = logging.getLogger(__name__)

# Between shipments the thread turns this often while it has something to finish (frames the
# socket did not take yet, a connection to make) or a node's ranks to relay; otherwise it
# sleeps until the next shipment (and reads the aggregator's answers then).
PUMP_SECONDS = 0.25


class RowShipper:
    """The background thread of one rank (see the module docstring).

    ``trigger()`` is ``collect()``'s hand-off in sync mode (sets an event, never blocks).
    ``stop(timeout)`` ships the last rows and sends them within the timeout.
    """

    def __init__(
        self,
        layout: GroupLayout,
        timer: StepTimer,
        config: RankwatchConfig,
        publishers: Sequence[Publisher],
        address: Callable[[], tuple[str, int, str] | None],
        strategy: Callable[[], str | None],
        identity: tuple[str, int, str, str],
        *,
        relay_name: str | None = None,
    ) -> None:
        self.layout = layout
        self.timer = timer
        self.config = config
        self.publishers = tuple(publishers)
        self._strategy = strategy
        self.identity = identity
        # A node's leader relays its node's other ranks (``node_relay``): their hellos go up
        # again on every new connection of its own.
        self.relay: NodeRelay | None = None
        self.connection = Connection(
            layout.rank,
            identity,
            address,
            pid=os.getpid(),
            relayed=lambda: [] if self.relay is None else self.relay.hellos(),
        )
        if relay_name is not None:
            self.relay = NodeRelay(relay_name, self.connection)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._final_deadline = math.inf
        self._sync_requested = 0
        self._cursor = 0
        self.lost = 0  # rows overwritten in the local ring before they were shipped
        self.sent_messages = 0
        self.shipped_rows = 0
        # CPU time this thread has used (its own clock): what rankwatch costs besides hooks.
        self.cpu_seconds = 0.0
        self._cpu0 = 0.0
        self._info = RankInfo(layout.rank, *identity)
        # This rank's blocks of 100 steps, summed here as each closes and shipped with the
        # rows: the group's summary window reads older steps from them (a few hundred
        # microseconds per 100 steps on this thread, instead of the aggregator summing every
        # rank's).
        self._blocks = StepBlocks(
            (layout.rank,),
            window_steps=config.diagnosis.step_time.summary_window_steps,
            tail_rows=2 * BLOCK_STEPS,
            outliers=outlier_rule(config.diagnosis.step_time),
            records=True,
        )
        self._thread = threading.Thread(
            target=self._run, name=f"rankwatch-{layout.rank}", daemon=True
        )

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

    def unreachable(self) -> bool:
        """This rank's shipments have not reached the group's aggregator for a while."""
        return self.connection.unreachable()

    def stop(self, timeout_seconds: float) -> bool:
        """Ship the rest (final flag) and send it, waiting at most half the budget (and never
        longer than the gather timeout) for the aggregator; True if the thread ended in time."""
        if not self._thread.is_alive():
            return True
        start = time.monotonic()
        self._final_deadline = start + min(self.config.gather_timeout_seconds, timeout_seconds / 2)
        self._stop.set()
        self._wake.set()
        self._thread.join(max(0.0, timeout_seconds - (time.monotonic() - start)))
        if self._thread.is_alive():
            log.warning(
                "rankwatch: rank %d background thread still busy after %.1f s; leaving it behind",
                self.layout.rank,
                timeout_seconds,
            )
            return False
        return True

    # ---- thread --------------------------------------------------------------------------

    def _run(self) -> None:
        self._cpu0 = time.thread_time()
        try:
            self._loop()
        except Exception:  # the thread must never take training down with it
            log.exception("rankwatch: rank %d background thread failed", self.layout.rank)
        finally:
            if self.relay is not None:
                self.relay.close()
            self.connection.close()
            self._account()

    def _account(self) -> None:
        self.cpu_seconds = time.thread_time() - self._cpu0

    def _loop(self) -> None:
        cfg = self.config
        shipped_rounds = 0
        next_ship = time.monotonic() + cfg.interval_seconds
        while True:
            now = time.monotonic()
            conn = self.connection
            busy = self.relay is not None or conn.pending_bytes or not conn.connected
            wait = PUMP_SECONDS if busy else cfg.interval_seconds
            if cfg.async_mode:
                wait = min(wait, max(0.0, next_ship - now))
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                self._ship(self._sync_requested, FLAG_END_OF_ROUND | FLAG_FINAL)
                self._relay_finals()
                self.connection.flush(self._final_deadline)
                self._account()
                return
            if cfg.async_mode:
                if time.monotonic() >= next_ship:
                    shipped_rounds += 1
                    self._ship(shipped_rounds, FLAG_END_OF_ROUND)
                    next_ship = time.monotonic() + cfg.interval_seconds
            elif self._sync_requested > shipped_rounds:
                shipped_rounds = self._sync_requested
                self._ship(shipped_rounds, FLAG_END_OF_ROUND)
            if self.relay is not None:
                self.relay.pump()
            for own in self.connection.pump():
                self._own(own)
            self._account()

    def _relay_finals(self) -> None:
        """A leader that stops relays its node until every rank connected to it has sent its
        final rows (they close about when it does), or the final deadline passes; those it
        still holds then are dropped and their ranks ship directly."""
        relay = self.relay
        if relay is None:
            return
        relay.pump()
        while relay.waiting() and time.monotonic() < self._final_deadline:
            self.connection.pump()
            time.sleep(0.01)  # shutdown only: a few hundred turns at most
            relay.pump()

    def _ship(self, seq: int, flags: int) -> None:
        """Queue this rank's new rows as frames (the flags on the last); none are read while
        the outbox is full (they wait in the timer's ring)."""
        final = bool(flags & FLAG_FINAL)
        if not self.connection.room() and not final:
            return
        rows = self._read()
        self._blocks.add(self.layout.rank, rows)
        self._blocks.flush()
        _, records = self._blocks.taken_records()
        for k in range(0, len(records), MAX_BLOCKS_PER_FRAME):
            self.connection.queue(
                encode_blocks(self.layout.rank, records[k : k + MAX_BLOCKS_PER_FRAME])
            )
        chunks = max(1, math.ceil(len(rows) / MAX_ROWS_PER_FRAME))
        strategy = self._strategy()
        for k in range(chunks):
            part = rows[k * MAX_ROWS_PER_FRAME : (k + 1) * MAX_ROWS_PER_FRAME]
            last = k == chunks - 1
            self.connection.queue(
                encode_rows(
                    part,
                    rank=self.layout.rank,
                    seq=seq,
                    flags=flags if last else 0,
                    strategy=strategy,
                    lost=self.lost,
                )
            )
            self.sent_messages += 1
        self.shipped_rows += len(rows)

    def _read(self) -> NDArray[np.float64]:
        """This rank's new rows from the timer, without its first ``warmup_steps`` steps
        (never shipped: compilation, lazy initialisation, the first collective's start-up
        skew and loader workers starting would swing the first windows' means)."""
        rows, self._cursor, lost = self.timer.read(self._cursor)
        self.lost += lost
        first = self._cursor - len(rows)  # the rows' index among every step this rank timed
        skip = self.config.warmup_steps - first
        return rows[skip:] if skip > 0 else rows

    def _own(self, own: OwnMeans) -> None:
        """This rank's own means of a window, to the publishers that serve a rank's series."""
        for pub in self.publishers:
            serve = getattr(pub, "publish_own_means", None)
            if serve is None:
                continue
            try:
                serve(self.config.group_name, self._info, own.means)
            except Exception:
                log.exception("rankwatch: publisher %r failed on this rank's own means", pub)
