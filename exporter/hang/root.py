"""The group root's hang loop: reads every rank's hang record when the root itself stopped
progressing, classifies (:func:`rankwatch.diagnosis.hang.classify_hang`), opens the ``hang``
incident at once and closes it when the job moves on.

Runs on the root's hang watcher thread (:mod:`.watch`), one call per poll. While the root
progresses it reads nothing. Once the root has not progressed for a third of its budget it
reads every rank's record from the store (one ``multi_get``) each poll; a rank whose record
stopped changing is *silent* (its thread cannot run: the interpreter lock held by C code, the
process stopped) unless its shipped steps show it progressing; a silent rank on this host
whose process is gone, or whose connection to rankwatch's group failed, is *dead*. A rank
whose last record says it left (it closed rankwatch, or its interpreter exited without an error)
is never silent nor dead: the rules decide whether anyone still waits for it.

The verdict opens when no rank progressed for the group's budget (the largest of the ranks'
own: a declared long phase, warm-up or a slow job's step time on any rank raises it for the
group), or earlier for a mismatch or a dead rank seen on two consecutive polls. It closes once
every living rank has finished a step since it opened or progresses again.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from rankwatch.diagnosis.hang import HangReport, HangVerdict, RankRecord, classify_hang
from rankwatch.diagnosis.hang.records import (
    ANSWERED,
    COLLECTIVE_MISMATCH,
    DEAD,
    LEFT,
    NO_ANSWER,
    RANK_DEAD,
    record_from_dict,
)
from rankwatch.diagnosis.hang.words import hang_line
from rankwatch.exporter.hang.watch import SUSPECT_FRACTION, record_key

__all__ = ["HangRoot", "process_state", "record_payload"]

log = logging.getLogger("rankwatch.hang")

_MAX_RECORD_BYTES = 64 * 1024
# What the watcher adds to a record for the root alone (not part of the record).
_TRANSPORT_KEYS = ("beat", "pidns", "written_at_s", "left")
# A record that has not changed for this many polls (and at least this many seconds) is silent.
_FRESH_POLLS = 4
_FRESH_MIN_SECONDS = 2.0


def _progressing(record: RankRecord) -> bool:
    """The rank progressed within a third of its budget when it wrote this record."""
    return record.stalled_seconds < record.budget_seconds * SUSPECT_FRACTION


def record_payload(raw: bytes) -> dict[str, Any] | None:
    """A rank's hang record as written to the store (a JSON object, bounded in size), or None
    when it is too large or not one."""
    if len(raw) > _MAX_RECORD_BYTES:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def process_state(pid: int) -> str:
    """``gone``, ``stopped`` or ``running`` for a process of this pid namespace (``running``
    when it cannot be told)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "running"
    state = raw.rpartition(b")")[2].split()[:1]
    if state in ([b"Z"], [b"X"]):
        return "gone"
    if state in ([b"T"], [b"t"]):
        return "stopped"
    return "running"


class HangRoot:
    """The hang loop of one group's root (see the module docstring).

    ``publish(report)`` hands a :class:`HangReport` to the publishers (through the collector,
    in its window order). ``broken()``: ranks whose connection to rankwatch's group failed.
    ``progress_age(rank)``: seconds since the rank's shipped steps last advanced (None when
    unknown).
    """

    def __init__(
        self,
        ranks: Sequence[int],
        rank: int,
        store: Any,
        poll_seconds: float,
        publish: Callable[[HangReport], None],
        *,
        group: str,
        host: str,
        pidns: int,
        broken: Callable[[], set[int]] = set,
        progress_age: Callable[[int], float | None] = lambda r: None,
        log_lines: bool = True,
        warmup_steps: int = 0,
    ) -> None:
        self.ranks = tuple(ranks)
        self.rank = rank
        self.store = store
        self.publish = publish
        self.group, self.host, self.pidns = group, host, pidns
        self.broken, self.progress_age = broken, progress_age
        self.log_lines = log_lines
        self.warmup_steps = warmup_steps
        self.fresh_seconds = max(_FRESH_POLLS * poll_seconds, _FRESH_MIN_SECONDS)
        self.poll_seconds = poll_seconds
        self._written_at: dict[int, float] = {}  # rank -> wall clock its record says it was written
        self._known: set[str] = set()
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (beat, monotonic of change)
        self._last: dict[int, RankRecord] = {}
        self._meta: dict[int, tuple[int, int, str]] = {}  # rank -> (pid, pidns, host)
        self._left: dict[int, str] = {}  # rank -> how it left (its last record said so)
        self.open: HangVerdict | None = None
        self._opened_at = 0.0
        self._steps_at_open: dict[int, int] = {}
        self._recovered: set[int] = set()
        self._pending: tuple[str, tuple[int, ...]] | None = None
        self._polls = 0
        self._waited_at_poll = -1  # the poll whose verdict waited for a rank crossing a call
        self.reads = 0  # store reads made (none while the job progresses)
        self.seen: list[RankRecord] = []  # every rank's record at the last read (hang file)
        self.open_evidence: dict[str, Any] | None = None
        # When the budget runs out if nothing moves (monotonic): the watcher looks then, not
        # up to a poll later.
        self.next_check = math.inf

    # ---- one poll --------------------------------------------------------------------------

    def tick(self, own: RankRecord) -> None:
        """One poll with the root's own record."""
        self._polls += 1
        suspect = own.stalled_seconds >= own.budget_seconds * SUSPECT_FRACTION
        self.next_check = math.inf
        if self.open is None and not suspect:
            self._pending = None
            return
        now = time.monotonic()
        records = self._records(own, now)
        self.seen = records
        if self.open is not None:
            self._follow(records, now)
            return
        answered = [r for r in records if r.state == ANSWERED]
        if any(_progressing(r) for r in answered):
            self._pending = None
            return  # some rank progresses: no hang
        silent = [r for r in records if r.state == NO_ANSWER]
        for r in silent:
            age = self.progress_age(r.rank)
            if age is not None and age < r.budget_seconds:
                self._pending = None
                return  # its shipped steps advance: it progresses, it just is not suspect
        stalled = min(
            [r.stalled_seconds for r in answered] + [r.silent_seconds for r in silent]
            or [own.stalled_seconds]
        )
        # Every rank's latest budget, answering or not: a rank in a declared long phase said
        # so when it entered it, and keeps the whole group's budget up while it lasts.
        budget = max([own.budget_seconds, *(self._budget_of(r, own) for r in self._last.values())])
        # The budget runs from the last step any rank finished (every rank has also made no
        # progress for a third of it: checked above).
        since_step = self._since_step(own, answered, silent, now)
        self.next_check = now + max(0.0, budget - since_step)
        if self._wait_for_crossing(records):
            return
        if since_step >= budget:
            verdict = classify_hang(records, stalled_seconds=stalled)
        else:
            # Early (a mismatch, a dead rank) only once every living rank answered: a side
            # not heard yet would be left out of the verdict.
            if any(r.state == NO_ANSWER for r in records):
                return
            verdict = classify_hang(records, stalled_seconds=stalled, mismatch_only=True)
            if verdict is not None:
                seen = (verdict.hang_class, verdict.ranks)
                if self._pending != seen:
                    self._pending = seen  # raised on the next poll that sees it again
                    return
        if verdict is None:
            return
        self._opened_at = now
        self._steps_at_open = {r.rank: r.steps for r in records}
        self._recovered = set()
        self._open(verdict, budget, since_step)

    def _wait_for_crossing(self, records: Sequence[RankRecord]) -> bool:
        """Whether to judge at the next poll instead: a rank was entering or leaving a c10d
        call when its record was taken, so which call its group numbers count is not known
        (judged now, the call it waits in could read "unknown", or a mismatch). Its next
        record settles it (in flight, or held at the same instruction: blocked there), so the
        wait is one poll at most."""
        crossing = any(r.state == ANSWERED and r.crossing_call for r in records)
        if not crossing or self._waited_at_poll == self._polls - 1:
            return False
        self._waited_at_poll = self._polls
        self.next_check = math.inf  # a full poll: a look sooner could still see the edge
        return True

    def _since_step(
        self,
        own: RankRecord,
        answered: Sequence[RankRecord],
        silent: Sequence[RankRecord],
        now: float,
    ) -> float:
        """Seconds since any rank of the group last finished a step, as far as the root can
        tell: each record's figure aged by the time since the root saw it written; a silent
        rank's from its shipped steps."""
        ages = [own.since_step_seconds]
        wall = time.time()
        for r in answered:
            if r.rank != self.rank:
                # Written before the root saw it, by at most a poll: the writer's own clock
                # says when, held to that range (another host's clock may be off).
                seen = max(0.0, now - self._beats.get(r.rank, (0, now))[1])
                written = wall - self._written_at.get(r.rank, wall)
                ages.append(
                    r.since_step_seconds + min(max(written, seen), seen + self.poll_seconds)
                )
        for r in silent:
            shipped = self.progress_age(r.rank)
            if shipped is not None:
                ages.append(shipped)
        return min(ages)

    def _budget_of(self, record: RankRecord, own: RankRecord) -> float:
        """A rank's latest budget, unless it is the warm-up budget of a record written before
        its first steps while the root is well past them (a rank stopped right after warm-up,
        before its watcher's next poll, would otherwise hold the group's budget at the warm-up
        one: the group steps together, so its warm-up is over too)."""
        if record.steps < self.warmup_steps <= own.steps - 2 and not record.frames:
            return own.budget_seconds
        return record.budget_seconds

    # ---- records ---------------------------------------------------------------------------

    def _records(self, own: RankRecord, now: float) -> list[RankRecord]:
        """One record per rank: the fresh ones as sent, the others silent or dead."""
        raw = self._read_store()
        self.reads += 1
        broken = self.broken()
        out: list[RankRecord] = []
        group_stalled = own.stalled_seconds
        for rank in self.ranks:
            if rank == self.rank:
                out.append(own)
                continue
            payload = raw.get(rank)
            record: RankRecord | None = None
            if payload is not None:
                beat = payload.get("beat")
                try:
                    record = record_from_dict(
                        {k: v for k, v in payload.items() if k not in _TRANSPORT_KEYS},
                        f"rank {rank}",
                    )
                except ValueError as exc:
                    log.debug("rankwatch: unreadable hang record of rank %d: %s", rank, exc)
                if record is not None:
                    self._meta[rank] = (record.pid, int(payload.get("pidns") or 0), record.host)
                    written = payload.get("written_at_s")
                    if isinstance(written, (int, float)) and math.isfinite(written):
                        self._written_at[rank] = float(written)
                    prev = self._beats.get(rank)
                    if prev is None or prev[0] != beat:
                        # First sight of a record counts as a change only if it is a suspect one.
                        changed_at = (
                            now
                            if prev is not None or record.frames or record.frames_note
                            else -math.inf
                        )
                        self._beats[rank] = (beat if isinstance(beat, int) else -1, changed_at)
                    self._last[rank] = record
                    how = payload.get("left")
                    if isinstance(how, str) and how:
                        self._left[rank] = how[:200]
                    else:  # a rankwatch started again in that rank
                        self._left.pop(rank, None)
            last = self._last.get(rank)
            if rank in self._left and last is not None:
                out.append(self._gone_away(last, self._left[rank]))
                continue
            beat_at = self._beats.get(rank, (0, -math.inf))[1]
            if last is not None and now - beat_at <= self.fresh_seconds:
                out.append(last)
                continue
            silent_for = min(now - beat_at, group_stalled) if beat_at > -math.inf else group_stalled
            out.append(self._silent(rank, last, silent_for, broken))
        return out

    def _gone_away(self, last: RankRecord, how: str) -> RankRecord:
        """A rank that left, as of now: outside every collective in phase ``left``, for as long
        as it has been gone (its own clock, never negative)."""
        written = self._written_at.get(last.rank)
        gone_for = max(0.0, time.time() - written) if written is not None else 0.0
        return replace(
            last,
            state=LEFT,
            phase="left",
            phase_seconds=round(gone_for, 3),
            stalled_seconds=round(last.stalled_seconds + gone_for, 3),
            since_step_seconds=round(last.since_step_seconds + gone_for, 3),
            silent_seconds=round(gone_for, 3),
            collective=None,
            frames=(),
            frames_note=f"stack unavailable: the rank left ({how})",
        )

    def _silent(
        self, rank: int, last: RankRecord | None, silent_for: float, broken: set[int]
    ) -> RankRecord:
        pid, pidns, host = self._meta.get(rank, (0, 0, last.host if last else ""))
        state = NO_ANSWER
        why = "its interpreter lock held by C code, or the process stopped"
        if rank in broken:
            state = DEAD
        elif pid and host == self.host and pidns == self.pidns:
            seen = process_state(pid)
            if seen == "gone":
                state = DEAD
            elif seen == "stopped":
                why = "the process is stopped (SIGSTOP)"
        note = (
            "stack unavailable: the process is gone"
            if state == DEAD
            else f"stack unavailable: no answer for {silent_for:.0f} s ({why})"
        )
        base = last if last is not None else RankRecord(rank=rank, host=host, pid=pid)
        return replace(
            base,
            state=state,
            frames=(),
            frames_note=note,
            silent_seconds=round(silent_for, 3),
            collective=None,
            group_seqs={},
            phase=base.phase if last is not None and last.frames else "",
        )

    def _read_store(self) -> dict[int, dict[str, Any]]:
        keys = {r: record_key(r) for r in self.ranks if r != self.rank}
        for key in keys.values():
            if key not in self._known:
                try:
                    if self.store.check([key]):
                        self._known.add(key)
                except Exception:
                    return {}
        ranks = [r for r, k in keys.items() if k in self._known]
        if not ranks:
            return {}
        try:
            values = self.store.multi_get([keys[r] for r in ranks])
        except Exception as exc:  # the store is gone: every rank is silent
            log.debug("rankwatch: cannot read hang records: %s", exc)
            return {}
        out: dict[int, dict[str, Any]] = {}
        for rank, value in zip(ranks, values, strict=True):
            obj = record_payload(value)
            if obj is not None:
                out[rank] = obj
        return out

    # ---- open, follow, close -----------------------------------------------------------------

    def _open(self, verdict: HangVerdict, budget: float, stalled: float) -> None:
        self.open = verdict
        self._budget = budget
        line = hang_line(verdict, group=self.group, budget_seconds=budget)
        if self.log_lines:
            log.warning(line)
        report = HangReport(verdict, budget, detected_after_seconds=stalled, message=line)
        self.open_evidence = report.evidence()
        self.publish(report)

    def _follow(self, records: list[RankRecord], now: float) -> None:
        """An open hang: refine it while it lasts (a rank dying, a mismatch seen later), close
        it once every living rank finished a step since it opened."""
        assert self.open is not None
        for r in records:
            if r.state == ANSWERED and (
                r.steps > self._steps_at_open.get(r.rank, r.steps) or _progressing(r)
            ):
                self._recovered.add(r.rank)
        living = {r.rank for r in records if r.state not in (DEAD, LEFT)}
        if living and living <= self._recovered:
            self.open = None
            self.open_evidence = None
            self._pending = None
            if self.log_lines:
                log.warning(
                    "rankwatch: hang in group %s over: every rank finished a step", self.group
                )
            self.publish(HangReport(None, self._budget))
            return
        if living & self._recovered or any(
            r.state == ANSWERED and _progressing(r) for r in records
        ):
            return  # moving on: leave the verdict as it was
        if self._wait_for_crossing(records):
            return
        stalled = min(
            [r.stalled_seconds for r in records if r.state == ANSWERED]
            + [r.silent_seconds for r in records if r.state == NO_ANSWER]
            or [0.0]
        )
        # Refined only by what is worse than a stuck rank: a death or a mismatch seen later.
        verdict = classify_hang(records, stalled_seconds=stalled)
        if verdict is not None and verdict.hang_class not in (RANK_DEAD, COLLECTIVE_MISMATCH):
            return
        if verdict is not None and (verdict.hang_class, verdict.ranks) != (
            self.open.hang_class,
            self.open.ranks,
        ):
            self._open(verdict, self._budget, stalled)
