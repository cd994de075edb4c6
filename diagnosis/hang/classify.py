"""The hang rules: the records of every rank of a group that stopped progressing, to one verdict.

The root calls :func:`classify_hang` with one record per rank once no rank progressed for the
budget (or earlier, when a mismatch or a dead rank is already visible: ``mismatch_only``). The
rules, in order:

Who waits on whom comes from :mod:`.waits` (sequence numbers, point-to-point peers, silent
ranks). The rules, in order:

1. ``RANK_DEAD``: some process is gone. Named: the dead ranks.
2. ``COLLECTIVE_MISMATCH``: ranks inside the same call (group and sequence number) with a
   different op, shapes or dtypes; or ranks left inside a call the rest of their group went
   past; or (at the budget) waiting ranks that only wait on each other, a cycle no rank can
   leave (an extra collective on one rank, collectives in another order). Named: the smaller
   side, the ranks that went past a disputed call counted with the side their own finished
   call agrees with (sides that tie for smallest are all named: which call is the odd one
   cannot be told).
3. ``STUCK_ALIVE``: the ranks the waiting ones wait on, directly or through others, that are
   outside every collective (stuck in a phase) or silent. Named with their phase.
4. ``STALLED_IN_COLLECTIVE``: every rank is inside the same collective and none finishes.
   Named: the rank that entered it last.
5. ``ALL_STALLED``: nobody is in a collective and nobody progresses. Nobody named.

A rank that *left* (closed rankwatch, or exited without an error) takes part as a rank outside
every collective, in phase ``left``, that waits on nobody: a living rank waiting for it makes a
``STUCK_ALIVE`` naming it (a rank that ran out of batches first). Once some rank has left and no
living one waits in a collective, the job is ending: no verdict (rank 0 writing the final
checkpoint while the others have exited is not a hang).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from rankwatch.diagnosis.hang.records import (
    ALL_STALLED,
    ANSWERED,
    COLLECTIVE_MISMATCH,
    DEAD,
    LEFT,
    NO_ANSWER,
    RANK_DEAD,
    STALLED_IN_COLLECTIVE,
    STUCK_ALIVE,
    Collective,
    RankRecord,
)
from rankwatch.diagnosis.hang.waits import OPAQUE_OPS, WaitGraph, wait_graph

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


def _agree(a: Collective, b: Collective) -> bool:
    """Same op, shapes and dtypes where both are known."""
    if "unknown" not in (a.op, b.op) and a.op != b.op:
        return False
    if a.shapes and b.shapes and a.shapes != b.shapes:
        return False
    return not (a.dtypes and b.dtypes and a.dtypes != b.dtypes)


_NO_CALL = Collective("", "", 0)


def _minority(sides: Sequence[list[RankRecord]]) -> tuple[list[RankRecord], list[RankRecord]]:
    """(the culprit side, the rest): the smallest side; where sides tie for smallest, all of
    them, every side included when all tie (which call is the odd one cannot be told: both
    are named, not one guessed)."""
    smallest = min(len(s) for s in sides)
    culprit = sorted(
        (r for side in sides if len(side) == smallest for r in side), key=lambda r: r.rank
    )
    rest = [r for side in sides for r in side if r not in culprit]
    return culprit, rest


def _frames(records: Sequence[RankRecord]) -> list[str] | str:
    """Frames of the first record that has some, else the first one's note."""
    for r in records:
        if r.frames:
            return list(r.frames)
    return records[0].frames_or_note() if records else "no rank"


def _mismatch(answered: Sequence[RankRecord]) -> tuple[list[RankRecord], list[RankRecord]] | None:
    """(culprit side, other side) of the first call (group and sequence number) whose ranks
    inside it disagree on op, shapes or dtypes."""
    by_group: dict[tuple[str, int], list[RankRecord]] = {}
    for r in answered:
        c = _call_of(r)
        if c is not None and c.op != "unknown" and not c.peers:
            by_group.setdefault((c.group, c.seq), []).append(r)
    for group in sorted(by_group):
        inside = by_group[group]
        sides: list[list[RankRecord]] = []
        for r in inside:
            c = _call_of(r)
            assert c is not None
            for side in sides:
                first = _call_of(side[0])
                assert first is not None
                if _agree(first, c):
                    side.append(r)
                    break
            else:
                sides.append([r])
        if len(sides) > 1:
            culprit, rest = _minority(_with_finished(sides, group, answered))
            # (the ranks gone past weigh in; the sides are the calls' own ranks)
            return culprit, [r for r in rest if r in inside]
    return None


# c10d calls with a root (torch.distributed's): a non-root rank can finish its side of one
# while another member is in some other call; a call that needs every member cannot.
_ROOTED_OPS = frozenset(
    {"broadcast", "broadcast_object_list", "scatter", "scatter_object_list", "gather",
     "gather_object", "reduce"}
)  # fmt: skip


def _with_finished(
    sides: list[list[RankRecord]], call: tuple[str, int], answered: Sequence[RankRecord]
) -> list[list[RankRecord]]:
    """The sides, with the ranks that already went past the call counted where they belong. A
    rank that finished the call says what it agreed to (its finished call at that number: with
    the side whose call agrees with it, when exactly one does: a 3-float all-reduce left inside
    with one 2-float rank, the two ranks that finished with 2 floats make the 3-float one the
    odd side). The others count with the one side whose op has a root, when exactly one has
    (only such a call lets a rank finish while another member is in a different one: a
    broadcast's receiver went on, the extra all-reduce's owner did not)."""
    group, seq = call
    inside = {r.rank for side in sides for r in side}
    past = [r for r in answered if r.rank not in inside and r.group_seqs.get(group, -1) >= seq]
    firsts = [_call_of(side[0]) or _NO_CALL for side in sides]
    extra: list[list[RankRecord]] = [[] for _ in sides]
    unsaid = []
    for r in past:
        done = next((c for c in r.finished_calls if (c.group, c.seq) == call), None)
        agree = [i for i, c in enumerate(firsts) if done is not None and _agree(c, done)]
        if len(agree) == 1:
            extra[agree[0]].append(r)
        else:
            unsaid.append(r)
    rooted = [i for i, c in enumerate(firsts) if c.op in _ROOTED_OPS]
    if unsaid and len(rooted) == 1:
        extra[rooted[0]] += unsaid
    return [[*side, *more] for side, more in zip(sides, extra, strict=True)]


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
    left = [r for r in recs if r.state == LEFT]

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

    graph = wait_graph([*answered, *left], [r.rank for r in silent])
    for r in left:
        graph.edges[r.rank] = set()  # it left: it waits on nobody
    by_rank = {r.rank: r for r in recs}
    gone_ranks = ", ".join(str(r.rank) for r in left)
    left_note = f"rank(s) {gone_ranks} left the job (closed rankwatch or exited)" if left else ""

    def collective_of(
        named: Sequence[RankRecord], waiting: Sequence[RankRecord]
    ) -> Collective | None:
        """What the waiting ranks wait in for the named ones: the most common reason (None:
        nobody is seen waiting in anything)."""
        named_ranks = {r.rank for r in named}
        reasons = [
            graph.why[(w.rank, n)]
            for w in waiting
            for n in sorted(graph.edges.get(w.rank, ()))
            if n in named_ranks and (w.rank, n) in graph.why
        ]
        if not reasons:
            reasons = [w.collective for w in waiting if w.collective is not None]
        if not reasons:
            return None
        return max(reasons, key=lambda c: (sum(x.ident() == c.ident() for x in reasons), -c.seq))

    if dead:
        # A call the ranks disagreed on explains a death (Gloo aborts a rank that receives more
        # bytes than it posted): the mismatch is named, the death said.
        mismatch = _mismatch(answered)
        if mismatch is not None:
            gone = ", ".join(str(r.rank) for r in dead)
            return _mismatch_verdict(
                verdict, *mismatch, answered, note=f"rank(s) {gone}: the process is gone"
            )
        waiting = [r for r in answered if graph.edges.get(r.rank) or r.collective is not None]
        coll = collective_of(dead, waiting) if waiting else None
        return verdict(RANK_DEAD, dead, waiting or answered, coll, detail="the process is gone")
    mismatch = _mismatch(answered) or _left_behind(graph, by_rank)
    if mismatch is not None:
        return _mismatch_verdict(verdict, *mismatch, answered)
    if mismatch_only:
        return None
    waiting = [by_rank[r] for r in graph.waiting()]
    if waiting:
        blocked = graph.reachable([r.rank for r in waiting])
        ends = [by_rank[r] for r in sorted(blocked) if not graph.edges.get(r)]
        # Waited on and waiting on nobody: outside every collective (stuck in a phase), or
        # silent. Those inside one the whole group is in are stalled there (below).
        stuck = [r for r in ends if r.state != ANSWERED or r.collective is None]
        if stuck:
            others = [r for r in answered if r.rank not in {x.rank for x in stuck}]
            gone = left_note if any(r.state == LEFT for r in stuck) else ""
            return verdict(STUCK_ALIVE, stuck, others, collective_of(stuck, waiting), detail=gone)
        if not ends:
            # Every waiting rank waits on another waiting one: a cycle no rank can leave.
            return _deadlock_verdict(verdict, graph, waiting, answered)
    inside = [r for r in answered if r.collective is not None]
    if left:
        # Ranks left and nobody waits on a known rank: the job is ending, unless living ranks
        # sit inside a collective (issued after the others left): then those outside it are
        # the ones it waits for.
        if not inside:
            return None
        outside = [r for r in recs if r.state != DEAD and r.collective is None]
        first = inside[0].collective
        return verdict(STUCK_ALIVE, outside, inside, first, detail=left_note)
    if silent:
        # Nobody waits on a known rank, yet some ranks do not answer: they are the ones to look
        # at. The others wait in their own call, else (issued in C++) in the group a member is
        # missing from, at its highest number.
        coll = inside[0].collective if inside else _missing_member_group(graph)
        return verdict(STUCK_ALIVE, silent, answered, coll)
    if inside:
        first = inside[0].collective
        assert first is not None
        same = [r for r in inside if _same_call(r.collective, first)]
        if len(same) == len(inside):
            last = min(inside, key=lambda r: _seconds(r.collective))
            others = [r for r in answered if r is not last]
            return verdict(
                STALLED_IN_COLLECTIVE,
                [last],
                others,
                last.collective,
                detail="every rank is inside it; none finishes",
            )
        # Some inside a collective, some not, and nobody ahead of anybody: the ones outside
        # never reached it.
        outside = [r for r in answered if r.collective is None]
        if outside:
            return verdict(STUCK_ALIVE, outside, inside, first)
    return verdict(
        ALL_STALLED, [], [], None, detail="no rank is in a collective and none progresses"
    )


def _call_of(r: RankRecord) -> Collective | None:
    """The call a rank is inside, else the one that last raised on it."""
    return r.collective if r.collective is not None else r.failed_collective


def _missing_member_group(graph: WaitGraph) -> Collective | None:
    """The largest group whose size exceeds the answering ranks in it (a member did not
    answer; of equal sizes the most used one), at its highest sequence number, op unknown;
    None when no size says so."""
    short = [g for g, per in graph.seqs.items() if graph.sizes.get(g, 0) > len(per)]
    if not short:
        return None
    group = max(short, key=lambda g: (graph.sizes[g], max(graph.seqs[g].values()), g))
    return Collective(group, "unknown", max(graph.seqs[group].values()))


def _same_call(c: Collective | None, first: Collective) -> bool:
    return c is not None and c.group == first.group and c.seq == first.seq


def _mismatch_verdict(
    verdict: Any,
    culprits: Sequence[RankRecord],
    others: Sequence[RankRecord],
    answered: Sequence[RankRecord],
    note: str = "",
) -> HangVerdict:
    mine = _call_of(culprits[0])
    if mine is None:
        raise AssertionError("a mismatch side without a collective")
    # Each distinct call, with the ranks in it: the named ones' first.
    calls: dict[tuple[Any, ...], tuple[Collective, list[int]]] = {}
    for r in [*culprits, *others]:
        c = _call_of(r)
        if c is not None:
            key = (c.group, c.op, c.seq, c.shapes, c.dtypes)
            calls.setdefault(key, (c, []))[1].append(r.rank)
    theirs = next(
        (c for c, ranks in calls.values() if not set(ranks) & {r.rank for r in culprits}), None
    )
    if theirs is None and len(calls) > 1:
        theirs = list(calls.values())[1][0]  # every side named: the second call is "theirs"
    detail = "; ".join(
        f"rank(s) {', '.join(map(str, ranks))} in {c.op} #{c.seq} of group {c.group} "
        f"{_sig(c)} at {c.site or '?'}"
        for c, ranks in calls.values()
    )
    if note:
        detail += f"; {note}"
    # Every other rank waits too: those inside the other side's collective, and those that
    # went past it (a broadcast's receivers) into a later one.
    culprit_ranks = {r.rank for r in culprits}
    rest = [r for r in answered if r.rank not in culprit_ranks]
    return cast(HangVerdict, verdict(COLLECTIVE_MISMATCH, culprits, rest, theirs, mine, detail))


def _left_behind(
    graph: WaitGraph, by_rank: Mapping[int, RankRecord]
) -> tuple[list[RankRecord], list[RankRecord]] | None:
    """Ranks left inside a collective the rest of its group went past, against those ranks:
    the smaller side is named (both on a tie)."""
    if not graph.left_behind:
        return None
    behind = sorted(graph.left_behind)
    past = sorted({r for ranks in graph.left_behind.values() for r in ranks})
    call = _call_of(by_rank[behind[0]])
    assert call is not None  # a rank is left behind inside a call
    # A rank gone past and outside every call is described by where it is in that group.
    gone = [
        by_rank[r]
        if _call_of(by_rank[r]) is not None
        else replace(
            by_rank[r], collective=Collective(call.group, "unknown", graph.seqs[call.group][r])
        )
        for r in past
    ]
    return _minority([[by_rank[r] for r in behind], gone])


def _deadlock_verdict(
    verdict: Any,
    graph: WaitGraph,
    waiting: Sequence[RankRecord],
    answered: Sequence[RankRecord],
) -> HangVerdict:
    """Every waiting rank waits on another: calls that do not pair (an extra collective on one
    rank, collectives in another order). Named: the ranks of the cycle blocked in a call of
    their own (a c10d call seen in their frames, not a peer transfer or a wait on work issued
    elsewhere) whose group has the largest share of members that never arrived: the others
    only wait for them. Without one, the sides are the calls the ranks are ahead in and the
    smaller side is named."""
    cycle = graph.in_cycles()
    own = [
        r
        for r in waiting
        if r.rank in cycle
        and r.collective is not None
        and not r.collective.peers
        and r.collective.op not in OPAQUE_OPS
    ]
    if own:
        # Of those, the call most of whose group has not arrived (an extra all-reduce on the
        # whole job keeps three of four away; the calls the others wait in lack only one rank).
        def missing(r: RankRecord) -> float:
            c = r.collective
            assert c is not None
            per = graph.seqs.get(c.group, {})
            return sum(seq < c.seq for seq in per.values()) / max(1, len(per))

        most = max(missing(r) for r in own)
        culprits = [r for r in own if missing(r) == most]
        named = {r.rank for r in culprits}
        others = [r for r in waiting if r.rank not in named]
    else:
        sides: dict[tuple[str, int], list[RankRecord]] = {}
        for r in waiting:
            reason = _reason(graph, r)
            sides.setdefault((reason.group, reason.seq), []).append(r)
        groups = list(sides.values())
        culprits, others = (groups[0], []) if len(groups) < 2 else _minority(groups)

    # A rank ahead without being inside its call (issued in C++) is described by that call.
    def described(side: Sequence[RankRecord]) -> list[RankRecord]:
        return [
            r if r.collective is not None else replace(r, collective=_reason(graph, r))
            for r in side
        ]

    return _mismatch_verdict(verdict, described(culprits), described(others), answered)


def _reason(graph: WaitGraph, r: RankRecord) -> Collective:
    """What ``r`` waits in: its own call, else the first rank it waits on's reason."""
    if r.collective is not None:
        return r.collective
    return graph.why[(r.rank, sorted(graph.edges[r.rank])[0])]


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
