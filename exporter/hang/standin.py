"""A stand-in for a group root that is gone: the lowest living rank runs the group's hang loop.

The root classifies hangs (:mod:`.root`). When the root's own process ends without leaving
(a crash, SIGKILL, Gloo aborting it on a mismatched collective) nobody would; yet the records
still reach the store whenever the store outlives the root: under ``torchrun`` the agent serves
it (``TORCHELASTIC_USE_AGENT_STORE``), not rank 0, and the agent gives the other workers a grace
(SIGTERM, then SIGKILL after a timeout) in which their watchers still run. So on every other
rank, once that rank is itself suspect, :class:`StandIn` looks whether the root is gone:

- its process is gone, where that can be told (same host and pid namespace, from the pid in the
  root's first record: ``/proc``), or
- this rank's shipments to the root have failed for a while (no connection to the group's
  aggregator, which ends with its root's process),

and its record does not say it *left* (a root that closed rankwatch or exited normally is the
end of a run, not a fault). The stand-in is the lowest rank after the root whose process is not
known to be gone; once it stands in it stays (a root does not come back). From then on it runs
the same :class:`.hang_root.HangRoot` loop the root would have run, publishing through its own
process's publishers, and the root is one of the ranks it judges (dead, normally).

A root on another host whose connection to this rank did not fail, or a root that is stopped
rather than gone, is not stood in for (docs/hang.md, "What it cannot see").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from rankwatch.diagnosis.hang import HangReport, RankRecord
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.hang.root import HangRoot, process_state, record_payload
from rankwatch.exporter.hang.watch import SUSPECT_FRACTION, record_key
from rankwatch.exporter.layout import GroupLayout
from rankwatch.exporter.publish.protocol import Publisher, publish_to_all

__all__ = ["LocalHangReports", "StandIn"]

log = logging.getLogger("rankwatch.hang")


class StandIn:
    """A non-root rank's readiness to run the group's hang loop (see the module docstring).

    ``loop``: the :class:`HangRoot` this rank runs once it stands in (built for this rank).
    ``root_rank``: the group's root; ``ranks``: the group's ranks, root first.
    ``root_unreachable()``: this rank's shipments to the root failed.
    """

    def __init__(
        self,
        loop: HangRoot,
        root_rank: int,
        ranks: Sequence[int],
        *,
        root_unreachable: Callable[[], bool] = lambda: False,
    ) -> None:
        self.loop = loop
        self.root_rank = root_rank
        me = loop.rank
        # The ranks before this one that would stand in first (the root excluded).
        self.before = tuple(r for r in ranks if r != root_rank and r < me)
        self.root_unreachable = root_unreachable
        # The loop judges the root as the root judges a rank whose connection failed: dead.
        broken = loop.broken
        loop.broken = lambda: broken() | ({root_rank} if root_unreachable() else set())
        self.acting = False
        self.looks = 0  # checks made (none while this rank progresses)

    def tick(self, own: RankRecord) -> None:
        """One poll with this rank's own record: look whether to stand in (only while this rank
        is suspect), and once standing in, the group's hang loop."""
        if not self.acting:
            if own.stalled_seconds < own.budget_seconds * SUSPECT_FRACTION:
                return
            self.looks += 1
            why = self._root_gone()
            if not why or not all(self._gone(r) for r in self.before):
                return
            self.acting = True
            log.warning(
                "rankwatch: rank %d, the root of group %s, is gone (%s); rank %d classifies "
                "the group's stalls in its place",
                self.root_rank,
                self.loop.group,
                why,
                self.loop.rank,
            )
        self.loop.tick(own)

    def _root_gone(self) -> str:
        """Why the root is gone (its process ended, its connection failed), or ``""``. Never
        without the root's record read from the store now: a store that does not answer has
        nothing to classify with (and where rank 0 served it, it went with the root)."""
        meta = self._read(self.root_rank)
        if meta is None or meta[3]:
            return ""  # unreadable, or it left: the run ended there, no fault
        gone = self._gone(self.root_rank, meta)
        if gone:
            return gone
        if self.root_unreachable():
            return "this rank's shipments to it have failed"
        return ""

    def _gone(self, rank: int, meta: tuple[int, int, str, bool] | None = None) -> str:
        """``"its process ended"`` when ``rank``'s process is known to be gone, else ``""``."""
        meta = meta if meta is not None else self._read(rank)
        if meta is None:
            return ""
        pid, pidns, host, _ = meta
        same = pid and host == self.loop.host and pidns == self.loop.pidns
        return "its process ended" if same and process_state(pid) == "gone" else ""

    def _read(self, rank: int) -> tuple[int, int, str, bool] | None:
        """(pid, pid namespace, host, left) from ``rank``'s latest record in the store, or None
        (no record, an unreadable one, a store that does not answer)."""
        key = record_key(rank)
        try:
            if not self.loop.store.check([key]):
                return None
            raw = self.loop.store.get(key)
        except Exception as exc:  # the store is gone
            log.debug("rankwatch: cannot read the record of rank %d: %s", rank, exc)
            return None
        payload = record_payload(raw)
        if payload is None:
            return None
        pid, pidns, host = payload.get("pid"), payload.get("pidns"), payload.get("host")
        if isinstance(pid, bool) or not isinstance(pid, int) or not isinstance(host, str):
            return None
        return pid, pidns if isinstance(pidns, int) else 0, host, bool(payload.get("left"))


class LocalHangReports:
    """How a stand-in publishes: the hang reports of its loop as reports of the group, through
    this rank's own publishers (the root and its aggregator are gone), the ranks' identities
    read from the store where each rank left them at start."""

    def __init__(
        self,
        layout: GroupLayout,
        config: RankwatchConfig,
        publishers: Sequence[Publisher],
        store: Any,
    ) -> None:
        self.layout, self.config, self.publishers, self.store = layout, config, publishers, store
        self._index = 0
        self._infos: dict[int, RankInfo] = {}

    def publish(self, hang: HangReport) -> None:
        ranks = {self.layout.rank, self.layout.root}
        if hang.verdict is not None:
            ranks.update(hang.verdict.ranks)
        report = WindowReport(
            group=self.config.group_name,
            window_index=self._index,
            created_at_s=time.time(),
            ranks=tuple(self._info(r) for r in sorted(ranks)),
            run=self.config.run_id,
            hang=hang,
            group_size=len(self.layout.ranks),
        )
        self._index += 1
        publish_to_all(self.publishers, report, log)

    def _info(self, rank: int) -> RankInfo:
        info = self._infos.get(rank)
        if info is not None:
            return info
        key = f"info/{rank}"
        try:
            if self.store is None or not self.store.check([key]):
                return RankInfo(rank)
            host, local, gpu, uuid = [*self.store.get(key).decode().split("\n"), "", "", ""][:4]
            info = RankInfo(rank, host, int(local) if local.isdigit() else 0, gpu, uuid)
        except Exception:  # the store is gone: the rank alone
            return RankInfo(rank)
        self._infos[rank] = info
        return info
