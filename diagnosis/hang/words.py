"""A hang verdict in words: the one log line a person reads first."""

from __future__ import annotations

from rankwatch.diagnosis.hang.classify import HangVerdict

__all__ = ["hang_line", "top_frame"]


def top_frame(frames: list[str] | str) -> str:
    """The innermost frame, or the sentence saying why there is none."""
    if isinstance(frames, str):
        return frames
    return frames[0] if frames else "no frames"


def hang_line(verdict: HangVerdict, *, group: str, budget_seconds: float) -> str:
    """``rankwatch: HANG <class> in group <g>: rank 2 (host h, pid p) in phase input for 16.0 s;
    ranks 0,1 wait in all_reduce #12 of group 0; top frame: file:line fn``."""
    culprit = next((r for r in verdict.records if r.rank in verdict.ranks), None)
    who = (
        "no rank named"
        if not verdict.ranks
        else f"rank {','.join(str(r) for r in verdict.ranks)}"
        + (f" (host {culprit.host}, pid {culprit.pid})" if culprit is not None else "")
    )
    phase = f" in phase {verdict.phase} for {verdict.phase_seconds:.1f} s" if verdict.phase else ""
    coll = verdict.collective
    waits = (
        f"; rank(s) {','.join(str(r) for r in verdict.waiting_ranks) or '-'} wait in "
        f"{coll.op} #{coll.seq} of group {coll.group}"
        if coll is not None
        else ""
    )
    mine = verdict.culprit_collective
    own = f"; it is in {mine.op} #{mine.seq} of group {mine.group}" if mine is not None else ""
    return (
        f"rankwatch: HANG {verdict.hang_class} in group {group}: {who}{phase}{own}{waits}; "
        f"no progress for {verdict.stalled_seconds:.1f} s (budget {budget_seconds:.1f} s); "
        f"top frame: {top_frame(verdict.frames)}"
        + (f"; {verdict.detail}" if verdict.detail else "")
    )
