"""Who waits on whom: the wait-for graph of a group that stopped progressing.

Built from the answering ranks' records (each rank's collective, if it is inside one, and every
process group's sequence number and size). A rank waits on another when

* it is inside a point-to-point transfer (a pipeline stage's send or receive) with that peer;
* it is ahead of the other on some group: its sequence number there is higher (it issued a
  collective the other has not; whether it waits inside that one, as a blocking call, or
  further on, as DDP's reducer does in C++, it cannot finish until the other joins);
* it waits on a group some of whose ranks did not answer (a silent rank may be the one missing;
  unless the group's size shows every member answered).

A rank inside a collective that waits on nobody while some member of the group has gone past
that sequence number was *left behind*: the others finished a collective it cannot (on Gloo a
larger tensor than the others' leaves its owner inside while the rest complete theirs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rankwatch.diagnosis.hang.records import Collective, RankRecord

__all__ = ["OPAQUE_OPS", "WaitGraph", "wait_graph"]

# Ops that say which collective a rank blocks in without being the collective's own call (the
# op is unknown, or a functional collective's wait whose number is the latest issued): a rank
# in one is waiting, never left behind.
OPAQUE_OPS = frozenset({"unknown", "wait_tensor", "p2p_wait", "device_wait"})


@dataclass
class WaitGraph:
    """``edges[rank]``: the ranks it waits on (answering ranks only have edges); ``why[(a,
    b)]``: the (group, sequence number) or transfer a waits on b in; ``seqs[group][rank]``;
    ``sizes[group]``: its number of ranks (where a record said); ``left_behind``: ranks inside
    a collective the others of its group went past."""

    edges: dict[int, set[int]] = field(default_factory=dict)
    why: dict[tuple[int, int], Collective] = field(default_factory=dict)
    seqs: dict[str, dict[int, int]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    left_behind: dict[int, list[int]] = field(default_factory=dict)

    def waiting(self) -> list[int]:
        """Ranks that wait on some rank."""
        return sorted(r for r, out in self.edges.items() if out)

    def in_cycles(self) -> set[int]:
        """Ranks on some cycle of waits (each waits, through others, on itself): the strongly
        connected components of more than one rank (Tarjan's, iteratively)."""
        index: dict[int, int] = {}
        low: dict[int, int] = {}
        stack: list[int] = []
        on_stack: set[int] = set()
        out: set[int] = set()
        counter = 0
        for start in sorted(self.edges):
            if start in index:
                continue
            work: list[tuple[int, list[int]]] = [(start, sorted(self.edges.get(start, ())))]
            index[start] = low[start] = counter
            counter += 1
            stack.append(start)
            on_stack.add(start)
            while work:
                node, todo = work[-1]
                if todo:
                    nxt = todo.pop()
                    if nxt not in index:
                        index[nxt] = low[nxt] = counter
                        counter += 1
                        stack.append(nxt)
                        on_stack.add(nxt)
                        work.append((nxt, sorted(self.edges.get(nxt, ()))))
                    elif nxt in on_stack:
                        low[node] = min(low[node], index[nxt])
                    continue
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.update(component)
        return out

    def reachable(self, starts: Sequence[int]) -> set[int]:
        """Every rank waited on, directly or through others, from ``starts``."""
        seen: set[int] = set()
        todo = list(starts)
        while todo:
            rank = todo.pop()
            for nxt in self.edges.get(rank, ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen


def _seqs(answered: Sequence[RankRecord]) -> dict[str, dict[int, int]]:
    """Per group: each answering rank's sequence number (its collective's where it is inside)."""
    out: dict[str, dict[int, int]] = {}
    for r in answered:
        for group, seq in r.group_seqs.items():
            out.setdefault(group, {})[r.rank] = seq
        c = r.collective
        if c is not None and c.group and not c.peers and c.op not in OPAQUE_OPS:
            out.setdefault(c.group, {})[r.rank] = c.seq
    return out


def wait_graph(answered: Sequence[RankRecord], silent: Sequence[int]) -> WaitGraph:
    """The wait-for graph of the answering ranks (``silent``: the ranks that did not answer)."""
    g = WaitGraph(seqs=_seqs(answered))
    # Groups seen carrying a pipeline's transfers count those in their numbers too (a stage
    # posts its next sends ahead of its peer): being ahead there says nothing; the transfers
    # are followed by their peers instead.
    p2p_groups = {r.collective.group for r in answered if r.collective and r.collective.peers}
    sizes = g.sizes
    for r in answered:
        for group, size in r.group_sizes.items():
            sizes[group] = max(size, sizes.get(group, 0))
    by_rank = {r.rank: r for r in answered}
    for r in answered:
        out = g.edges.setdefault(r.rank, set())
        c = r.collective
        if c is not None and c.peers:
            for peer in c.peers:
                if peer != r.rank and (peer in by_rank or peer in silent):
                    out.add(peer)
                    g.why[(r.rank, peer)] = c
            continue
        for group, per in g.seqs.items():
            mine = per.get(r.rank)
            if mine is None or group in p2p_groups:
                continue
            inside = c if c is not None and c.group == group and c.seq == mine else None
            for other, theirs in per.items():
                if theirs < mine:
                    out.add(other)
                    g.why[(r.rank, other)] = inside or Collective(group, "unknown", mine)
            # A silent rank may be a member that never arrived, unless every member answered.
            waits_here = inside is not None or mine > min(per.values())
            if waits_here and silent and (group not in sizes or sizes[group] > len(per)):
                for s in silent:
                    out.add(s)
                    g.why.setdefault((r.rank, s), inside or Collective(group, "unknown", mine))
    for r in answered:
        c = r.collective
        if (
            g.edges.get(r.rank)
            or c is None
            or c.peers
            or c.op in OPAQUE_OPS
            or c.group not in g.seqs
        ):
            continue
        gone_past = [
            other
            for other, seq in g.seqs[c.group].items()
            if other != r.rank
            and seq >= c.seq
            and not _inside(by_rank[other].collective, c.group, c.seq)
        ]
        if gone_past:
            g.left_behind[r.rank] = sorted(gone_past)
    return g


def _inside(c: Collective | None, group: str, seq: int) -> bool:
    return c is not None and c.group == group and c.seq == seq
