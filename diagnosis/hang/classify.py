"""The hang rules: the records of every rank of a group that stopped progressing, to one verdict.

The root calls :func:`classify_hang` with one record per rank once no rank progressed for the
budget (or earlier, when a mismatch or a dead rank is already visible: ``mismatch_only``). The
rules, in order:

1. ``RANK_DEAD``: some process is gone. Named: the dead ranks.
2. ``COLLECTIVE_MISMATCH``: two ranks inside the same group at the same sequence number with a
   different op, shapes or dtypes, or inside the same group at different sequence numbers.
   Named: the smaller side (on a tie, the side without the lowest rank).
3. ``STUCK_ALIVE``: in some group, ranks are ahead (they issued a collective: their sequence
   number is the group's highest, the collective they wait in) while others are behind it or
   do not answer. Named: the ranks behind and the silent ones, with their phase.
4. ``STALLED_IN_COLLECTIVE``: every rank is inside the same collective and none finishes.
   Named: the rank that entered it last.
5. ``ALL_STALLED``: nobody is in a collective and nobody progresses. Nobody named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankwatch.diagnosis.hang.records import (
    ALL_STALLED,
    ANSWERED,
    COLLECTIVE_MISMATCH,
    DEAD,
    NO_ANSWER,
    RANK_DEAD,
    STALLED_IN_COLLECTIVE,
    STUCK_ALIVE,
    Collective,
    RankRecord,
)

__all__ = ["HangReport", "HangVerdict", "classify_hang"]


@dataclass(frozen=True)
class HangVerdict:
    """One hang, classified: the class, the named ranks (sorted), the culprit's phase and
    frames, what the waiting ranks are in, and the other side for a mismatch."""

    hang_class: str
    ranks: tuple[int, ...]
    phase: str
    phase_seconds: float
    collective: Collective | None
    culprit_collective: Collective | None
    frames: list[str] | str
    waiting_ranks: tuple[int, ...]
    waiting_frames: list[str] | str
    stalled_seconds: float
    detail: str = ""
    records: tuple[RankRecord, ...] = field(default=(), compare=False)

    @property
    def cause(self) -> str:
        """The class in lower case: the incident's cause."""
        return self.hang_class.lower()

    def evidence(self, detected_after_seconds: float) -> dict[str, Any]:
        """The incident's evidence (plain JSON-able data)."""
        culprit = next((r for r in self.records if r.rank in self.ranks), None)
        return {
            "hang_class": self.hang_class,
            "phase": self.phase,
            "phase_seconds": round(self.phase_seconds, 3),
            "collective": None if self.collective is None else self.collective.ident(),
            "culprit_collective": (
                None if self.culprit_collective is None else self.culprit_collective.ident()
            ),
            "collective_detail": None if self.collective is None else self.collective.to_dict(),
            "culprit_collective_detail": (
                None if self.culprit_collective is None else self.culprit_collective.to_dict()
            ),
            "frames": self.frames,
            "waiting_ranks": list(self.waiting_ranks),
            "waiting_frames": self.waiting_frames,
            "stalled_seconds": round(self.stalled_seconds, 3),
            "detected_after_seconds": round(detected_after_seconds, 3),
            "detail": self.detail,
            "host": culprit.host if culprit is not None else "",
            "pid": culprit.pid if culprit is not None else 0,
        }


def _side_key(c: Collective) -> tuple[Any, ...]:
    return (c.op, c.shapes, c.dtypes)


def _agree(a: Collective, b: Collective) -> bool:
    """Same op, shapes and dtypes where both are known."""
    if "unknown" not in (a.op, b.op) and a.op != b.op:
        return False
    if a.shapes and b.shapes and a.shapes != b.shapes:
        return False
    return not (a.dtypes and b.dtypes and a.dtypes != b.dtypes)


def _minority(sides: Sequence[list[RankRecord]]) -> tuple[list[RankRecord], list[RankRecord]]:
    """(the culprit side, the rest): the smaller side; on a tie the side without the lowest
    rank."""
    lowest = min(r.rank for side in sides for r in side)
    ordered = sorted(sides, key=lambda s: (len(s), any(r.rank == lowest for r in s)))
    culprit = ordered[0]
    rest = [r for side in ordered[1:] for r in side]
    return culprit, rest


def _frames(records: Sequence[RankRecord]) -> list[str] | str:
    """Frames of the first record that has some, else the first one's note."""
    for r in records:
        if r.frames:
            return list(r.frames)
    return records[0].frames_or_note() if records else "no rank"


def _mismatch(answered: Sequence[RankRecord]) -> tuple[list[RankRecord], list[RankRecord]] | None:
    """(culprit side, other side) of the first group where ranks inside a collective disagree."""
    by_group: dict[str, list[RankRecord]] = {}
    for r in answered:
        if r.collective is not None and r.collective.op != "unknown":
            by_group.setdefault(r.collective.group, []).append(r)
    for group in sorted(by_group):
        inside = by_group[group]
        sides: list[list[RankRecord]] = []
        for r in inside:
            c = r.collective
            assert c is not None
            for side in sides:
                first = side[0].collective
                assert first is not None
                if first.seq == c.seq and _agree(first, c):
                    side.append(r)
                    break
            else:
                sides.append([r])
        if len(sides) > 1:
            return _minority(sides)
    return None


def _group_seqs(answered: Sequence[RankRecord]) -> dict[str, dict[int, int]]:
    """Per group: each answering rank's sequence number (from its collective or its seqs)."""
    out: dict[str, dict[int, int]] = {}
    for r in answered:
        for group, seq in r.group_seqs.items():
            out.setdefault(group, {})[r.rank] = seq
        if r.collective is not None:
            out.setdefault(r.collective.group, {})[r.rank] = r.collective.seq
    return out


def _waited_collective(waiting: Sequence[RankRecord], group: str, seq: int) -> Collective:
    """The collective the waiting ranks are in: one of theirs when seen (the one entered
    first), else the group and sequence number with the op unknown (issued in C++)."""
    seen = [
        r.collective
        for r in waiting
        if r.collective is not None and r.collective.group == group and r.collective.seq == seq
    ]
    if seen:
        return max(seen, key=lambda c: c.seconds if c.seconds is not None else -1.0)
    return Collective(group=group, op="unknown", seq=seq)


def classify_hang(
    records: Sequence[RankRecord],
    *,
    stalled_seconds: float,
    mismatch_only: bool = False,
) -> HangVerdict | None:
    """The verdict for the records of every rank of the group (one each), or None when the
    records show no hang (``mismatch_only``: only a mismatch or a dead rank, seen before the
    budget ran out, makes one). ``stalled_seconds``: how long no rank has progressed.
    ``ValueError`` for records that are not one per rank."""
    if not records:
        raise ValueError("classify_hang: field records: value () is empty")
    for r in records:
        if not isinstance(r, RankRecord):
            raise TypeError(
                f"classify_hang: field records: expected RankRecord, got {type(r).__name__}"
            )
    ranks = [r.rank for r in records]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"classify_hang: field records: ranks {sorted(ranks)} repeat a rank")
    recs = tuple(sorted(records, key=lambda r: r.rank))
    answered = [r for r in recs if r.state == ANSWERED]
    dead = [r for r in recs if r.state == DEAD]
    silent = [r for r in recs if r.state == NO_ANSWER]

    def verdict(
        cls: str,
        named: Sequence[RankRecord],
        waiting: Sequence[RankRecord],
        collective: Collective | None,
        culprit_collective: Collective | None = None,
        detail: str = "",
    ) -> HangVerdict:
        first = named[0] if named else None
        return HangVerdict(
            hang_class=cls,
            ranks=tuple(sorted(r.rank for r in named)),
            phase=first.phase if first is not None else "",
            phase_seconds=first.phase_seconds if first is not None else 0.0,
            collective=collective,
            culprit_collective=culprit_collective,
            frames=first.frames_or_note() if first is not None else "",
            waiting_ranks=tuple(sorted(r.rank for r in waiting)),
            waiting_frames=_frames(waiting) if waiting else "",
            stalled_seconds=stalled_seconds,
            detail=detail,
            records=recs,
        )

    seqs = _group_seqs(answered)

    def ahead(group_filter: Sequence[RankRecord]) -> tuple[str, int, list[RankRecord]] | None:
        """The group where some answering ranks are ahead of others (or of silent ranks):
        (group, the highest seq, the ranks at it)."""
        best: tuple[int, str, int, list[RankRecord]] | None = None
        for group in sorted(seqs):
            per = seqs[group]
            top = max(per.values())
            at_top = [r for r in group_filter if per.get(r.rank) == top]
            behind = [r for r in group_filter if r.rank in per and per[r.rank] < top]
            if not at_top or (not behind and not silent and not dead):
                continue
            if best is None or len(at_top) > best[0]:
                best = (len(at_top), group, top, at_top)
        return None if best is None else (best[1], best[2], best[3])

    if dead:
        found = ahead(answered)
        coll = _waited_collective(found[2], found[0], found[1]) if found else None
        waiting = found[2] if found else answered
        return verdict(RANK_DEAD, dead, waiting, coll, detail="the process is gone")
    mismatch = _mismatch(answered)
    if mismatch is not None:
        culprits, others = mismatch
        theirs = others[0].collective if others else None
        mine = culprits[0].collective
        assert mine is not None
        detail = (
            f"rank(s) {', '.join(str(r.rank) for r in culprits)} in {mine.op} #{mine.seq} of group "
            f"{mine.group} {_sig(mine)} at {mine.site or '?'}; "
            + (
                f"rank(s) {', '.join(str(r.rank) for r in others)} in {theirs.op} #{theirs.seq} "
                f"{_sig(theirs)} at {theirs.site or '?'}"
                if theirs is not None
                else ""
            )
        )
        # Every other rank waits too: those inside the other side's collective, and those
        # that went past it (a broadcast's receivers) into a later one.
        culprit_ranks = {r.rank for r in culprits}
        others = [r for r in answered if r.rank not in culprit_ranks]
        return verdict(COLLECTIVE_MISMATCH, culprits, others, theirs, mine, detail)
    if mismatch_only:
        return None
    found = ahead(answered)
    if found is not None:
        group, top, waiting = found
        per = seqs[group]
        behind = [r for r in answered if r.rank in per and per[r.rank] < top]
        # A rank behind but itself inside a collective waits too (a broadcast's root waiting
        # for a receiver while the other receivers went on): it is named only when nobody
        # else can be.
        outside = [r for r in behind if r.collective is None]
        named = sorted([*(outside or ([] if silent else behind)), *silent], key=lambda r: r.rank)
        named_ranks = {r.rank for r in named}
        waiting = [*waiting, *(r for r in behind if r.rank not in named_ranks)]
        coll = _waited_collective(waiting, group, top)
        if named:
            return verdict(STUCK_ALIVE, named, waiting, coll)
    if silent:
        # Nobody ahead anywhere, yet some ranks do not answer: they are the ones to look at.
        waiting = [r for r in answered if r.collective is not None]
        coll = waiting[0].collective if waiting else None
        return verdict(STUCK_ALIVE, silent, waiting, coll)
    inside = [r for r in answered if r.collective is not None]
    if inside and len(inside) == len(answered):
        first = inside[0].collective
        assert first is not None
        if all(
            r.collective is not None
            and r.collective.group == first.group
            and r.collective.seq == first.seq
            for r in inside
        ):
            last = min(inside, key=lambda r: _seconds(r.collective))
            others = [r for r in inside if r is not last]
            return verdict(
                STALLED_IN_COLLECTIVE,
                [last],
                others,
                last.collective,
                detail="every rank is inside it; none finishes",
            )
    if inside:
        # Some inside a collective, some not, at the same sequence numbers: the ones outside
        # never reached it.
        outside = [r for r in answered if r.collective is None]
        coll = inside[0].collective
        return verdict(STUCK_ALIVE, outside, inside, coll)
    return verdict(
        ALL_STALLED, [], [], None, detail="no rank is in a collective and none progresses"
    )


def _seconds(c: Collective | None) -> float:
    return c.seconds if c is not None and c.seconds is not None else float("inf")


def _sig(c: Collective) -> str:
    shapes = ",".join("x".join(str(d) for d in s) or "scalar" for s in c.shapes)
    dtypes = ",".join(c.dtypes)
    return f"[{shapes}] {dtypes}".strip()


def records_by_rank(records: Sequence[RankRecord]) -> Mapping[int, RankRecord]:
    """The records keyed by rank."""
    return {r.rank: r for r in records}


@dataclass(frozen=True)
class HangReport:
    """What the hang watcher publishes: a verdict while the hang lasts (None once the job
    moved on), the budget it was judged against, how long after the last progress it was
    detected, and its log line."""

    verdict: HangVerdict | None
    budget_seconds: float
    detected_after_seconds: float = 0.0
    message: str = ""

    def evidence(self) -> dict[str, Any]:
        """The incident's evidence (empty once cleared)."""
        if self.verdict is None:
            return {}
        out = self.verdict.evidence(self.detected_after_seconds)
        out["budget_seconds"] = round(self.budget_seconds, 3)
        out["message"] = self.message
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_seconds": self.budget_seconds,
            "detected_after_seconds": self.detected_after_seconds,
            "verdict": None if self.verdict is None else self.evidence(),
            "ranks": None if self.verdict is None else list(self.verdict.ranks),
            "records": [] if self.verdict is None else [r.to_dict() for r in self.verdict.records],
        }
