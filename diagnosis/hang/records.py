"""The hang records: what one rank says about itself while the job does not progress.

A record is built by the rank's background thread from what its training thread left behind
(the phase it is in and since when, the collective it waits in, the group sequence numbers,
its top frames) and shipped to the group's root as JSON; the root adds the ranks that did not
answer. Everything here is plain data; :func:`record_from_dict` reads a record back from a
decoded JSON object that may come from another process or a file, checking every field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ALL_STALLED",
    "ANSWERED",
    "COLLECTIVE_MISMATCH",
    "DEAD",
    "HANG_CLASSES",
    "LEFT",
    "NO_ANSWER",
    "RANK_DEAD",
    "RANK_STATES",
    "STALLED_IN_COLLECTIVE",
    "STUCK_ALIVE",
    "Collective",
    "RankRecord",
    "collective_from_dict",
    "record_from_dict",
]

STUCK_ALIVE = "STUCK_ALIVE"
COLLECTIVE_MISMATCH = "COLLECTIVE_MISMATCH"
STALLED_IN_COLLECTIVE = "STALLED_IN_COLLECTIVE"
RANK_DEAD = "RANK_DEAD"
ALL_STALLED = "ALL_STALLED"
HANG_CLASSES: tuple[str, ...] = (
    STUCK_ALIVE,
    COLLECTIVE_MISMATCH,
    STALLED_IN_COLLECTIVE,
    RANK_DEAD,
    ALL_STALLED,
)

# How the root heard from a rank: its record came in (fresh), it did not answer (its thread
# cannot run: the interpreter lock held by C code, the process stopped), its process is gone,
# or it left: it closed rankwatch or its interpreter exited without an error (its part of the
# job is over; a hang only when a living rank waits for it).
ANSWERED = "answered"
NO_ANSWER = "no_answer"
DEAD = "dead"
LEFT = "left"
RANK_STATES: tuple[str, ...] = (ANSWERED, NO_ANSWER, DEAD, LEFT)

# Bounds on what a record may hold (a record read from a file or another process is untrusted).
MAX_FRAMES = 32
MAX_TEXT = 512
MAX_SHAPES = 16
MAX_DIMS = 8
MAX_GROUPS = 64
MAX_PEERS = 64


@dataclass(frozen=True)
class Collective:
    """A collective a rank is inside: process group name, op, the group's sequence number,
    the tensors' shapes and dtypes, where the training code called it, seconds inside it."""

    group: str
    op: str
    seq: int
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    site: str = ""
    seconds: float | None = None
    # Point-to-point (a pipeline stage's send or receive): the global ranks it waits on.
    peers: tuple[int, ...] = ()

    def ident(self) -> dict[str, Any]:
        """``{"group", "op", "seq"}``: what the incident names."""
        return {"group": self.group, "op": self.op, "seq": self.seq}

    def signature(self) -> tuple[str, tuple[tuple[int, ...], ...], tuple[str, ...]]:
        """What must agree between ranks at one sequence number of one group (unknown parts,
        an op ``unknown`` or no shapes, agree with anything)."""
        return (self.op, self.shapes, self.dtypes)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.ident(),
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "site": self.site,
            "seconds": self.seconds,
            "peers": list(self.peers),
        }


@dataclass(frozen=True)
class RankRecord:
    """One rank as the root sees it while the job does not progress.

    ``phase``: ``input``, ``h2d``, ``forward``, ``backward``, ``optimizer``, ``outside_step`` or
    a phase the user declared; ``phase_seconds`` in it. ``stalled_seconds``: since the rank's
    training thread last progressed (a phase left, a collective finished, a step written);
    ``since_step_seconds``: since it last finished a step (since it started, before any).
    ``budget_seconds``: the rank's own budget now (raised in a declared long phase, before the
    first steps). ``collective``: the one it is inside, or None; ``failed_collective``: the
    last one that raised on it in this step (a peer gone, a size refused). ``group_seqs``: each
    process group's sequence number (collectives issued so far, C++ ones included) and
    ``group_sizes`` its number of ranks. ``finished_calls``: per group, the last c10d call this
    rank finished there (what it agreed to: it says which side of a disputed call was the odd
    one). ``frames``: the
    training thread's top frames (innermost first) or empty with ``frames_note`` saying why.
    ``state``: :data:`ANSWERED`, :data:`NO_ANSWER`, :data:`DEAD` or :data:`LEFT`;
    ``silent_seconds``: how long it has not answered (for a rank that left: since it left).
    ``crossing_call``: the training thread was entering or leaving a c10d call when the record
    was taken, so its group numbers may or may not count that call yet (its next record
    settles it).
    """

    rank: int
    state: str = ANSWERED
    host: str = ""
    pid: int = 0
    phase: str = ""
    phase_seconds: float = 0.0
    stalled_seconds: float = 0.0
    since_step_seconds: float = 0.0
    steps: int = 0
    budget_seconds: float = 15.0
    collective: Collective | None = None
    failed_collective: Collective | None = None
    group_seqs: Mapping[str, int] = field(default_factory=dict)
    group_sizes: Mapping[str, int] = field(default_factory=dict)
    finished_calls: tuple[Collective, ...] = ()
    frames: tuple[str, ...] = ()
    frames_note: str = ""
    silent_seconds: float = 0.0
    crossing_call: bool = False

    def frames_or_note(self) -> list[str] | str:
        """The frames, or the sentence saying why there are none (never silent)."""
        if self.frames:
            return list(self.frames)
        return self.frames_note or "stack unavailable: the rank sent no frames"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "state": self.state,
            "host": self.host,
            "pid": self.pid,
            "phase": self.phase,
            "phase_seconds": self.phase_seconds,
            "stalled_seconds": self.stalled_seconds,
            "since_step_seconds": self.since_step_seconds,
            "steps": self.steps,
            "budget_seconds": self.budget_seconds,
            "collective": None if self.collective is None else self.collective.to_dict(),
            "failed_collective": (
                None if self.failed_collective is None else self.failed_collective.to_dict()
            ),
            "group_seqs": dict(self.group_seqs),
            "group_sizes": dict(self.group_sizes),
            "finished_calls": [c.to_dict() for c in self.finished_calls],
            "frames": list(self.frames),
            "frames_note": self.frames_note,
            "silent_seconds": self.silent_seconds,
            "crossing_call": self.crossing_call,
        }


def _where(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _int(obj: Mapping[str, Any], name: str, where: str, lo: int = 0, hi: int = 2**62) -> int:
    value = obj.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(
            f"hang record: field {_where(where, name)}: value {value!r} is not an int in {lo}..{hi}"
        )
    return value


def _float(obj: Mapping[str, Any], name: str, where: str, *, optional: bool = False) -> float:
    value = obj.get(name, 0.0)
    if value is None and optional:
        return math.nan
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"hang record: field {_where(where, name)}: value {value!r} is not a finite number >= 0"
        )
    return float(value)


def _text(obj: Mapping[str, Any], name: str, where: str) -> str:
    value = obj.get(name, "")
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(
            f"hang record: field {_where(where, name)}: "
            f"value {str(value)[:80]!r} is not a text of at most {MAX_TEXT} characters"
        )
    return value


def _flag(obj: Mapping[str, Any], name: str, where: str) -> bool:
    value = obj.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(
            f"hang record: field {_where(where, name)}: value {str(value)[:80]!r} is not a bool"
        )
    return value


def _texts(obj: Mapping[str, Any], name: str, where: str, limit: int) -> tuple[str, ...]:
    value = obj.get(name, [])
    if not isinstance(value, list) or len(value) > limit:
        raise ValueError(
            f"hang record: field {_where(where, name)}: expected a list of at most {limit} texts"
        )
    out = []
    for i, item in enumerate(value):
        out.append(_text({"v": item}, "v", f"{_where(where, name)}[{i}]"))
    return tuple(out)


def collective_from_dict(obj: object, where: str = "collective") -> Collective | None:
    """A :class:`Collective` from its dict (None for None); ``ValueError`` naming the field."""
    if obj is None:
        return None
    if not isinstance(obj, Mapping):
        raise ValueError(
            f"hang record: field {where}: expected an object or null, got {type(obj).__name__}"
        )
    shapes_raw = obj.get("shapes", [])
    if not isinstance(shapes_raw, list) or len(shapes_raw) > MAX_SHAPES:
        raise ValueError(
            f"hang record: field {where}.shapes: expected a list of at most {MAX_SHAPES} shapes"
        )
    shapes = []
    for i, shape in enumerate(shapes_raw):
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)
        ):
            raise ValueError(
                f"hang record: field {where}.shapes[{i}]: value {shape!r} is not a shape"
            )
        shapes.append(tuple(shape))
    seconds = _float(obj, "seconds", where, optional=True)
    peers_raw = obj.get("peers", [])
    if (
        not isinstance(peers_raw, list)
        or len(peers_raw) > MAX_PEERS
        or any(
            isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < 2**31 for p in peers_raw
        )
    ):
        raise ValueError(
            f"hang record: field {where}.peers: value {str(peers_raw)[:80]!r} is not a list of "
            f"at most {MAX_PEERS} ranks"
        )
    return Collective(
        group=_text(obj, "group", where),
        op=_text(obj, "op", where),
        seq=_int(obj, "seq", where),
        shapes=tuple(shapes),
        dtypes=_texts(obj, "dtypes", where, MAX_SHAPES),
        site=_text(obj, "site", where),
        seconds=None if math.isnan(seconds) else seconds,
        peers=tuple(peers_raw),
    )


def _group_map(obj: Mapping[str, Any], name: str, where: str) -> dict[str, int]:
    """A ``{group name: int}`` field of a record (sequence numbers, sizes), checked."""
    raw = obj.get(name, {})
    if not isinstance(raw, Mapping) or len(raw) > MAX_GROUPS:
        raise ValueError(
            f"hang record: field {_where(where, name)}: "
            f"expected an object of at most {MAX_GROUPS} groups"
        )
    out: dict[str, int] = {}
    for key in raw:
        if not isinstance(key, str) or len(key) > MAX_TEXT:
            raise ValueError(
                f"hang record: field {_where(where, name)}: "
                f"key {str(key)[:80]!r} is not a group name"
            )
        out[key] = _int(raw, key, _where(where, name))
    return out


def record_from_dict(obj: object, where: str = "") -> RankRecord:
    """A :class:`RankRecord` from a decoded JSON object; ``ValueError`` naming the field and
    value when it is not one."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"hang record: expected an object, got {type(obj).__name__}")
    state = obj.get("state", ANSWERED)
    if state not in RANK_STATES:
        raise ValueError(
            f"hang record: field {_where(where, 'state')}: "
            f"value {state!r} is not one of {', '.join(RANK_STATES)}"
        )
    group_seqs = _group_map(obj, "group_seqs", where)
    group_sizes = _group_map(obj, "group_sizes", where)
    finished_raw = obj.get("finished_calls", [])
    if not isinstance(finished_raw, list) or len(finished_raw) > MAX_GROUPS:
        raise ValueError(
            f"hang record: field {_where(where, 'finished_calls')}: "
            f"expected a list of at most {MAX_GROUPS} calls"
        )
    finished = []
    for i, item in enumerate(finished_raw):
        at = f"{_where(where, 'finished_calls')}[{i}]"
        call = collective_from_dict(item, at)
        if call is None:
            raise ValueError(f"hang record: field {at}: value None is not a call")
        finished.append(call)
    return RankRecord(
        rank=_int(obj, "rank", where, 0, 2**31),
        state=state,
        host=_text(obj, "host", where),
        pid=_int(obj, "pid", where, 0, 2**31),
        phase=_text(obj, "phase", where),
        phase_seconds=_float(obj, "phase_seconds", where),
        stalled_seconds=_float(obj, "stalled_seconds", where),
        since_step_seconds=_float(obj, "since_step_seconds", where),
        steps=_int(obj, "steps", where),
        budget_seconds=_float(obj, "budget_seconds", where),
        collective=collective_from_dict(obj.get("collective"), _where(where, "collective")),
        failed_collective=collective_from_dict(
            obj.get("failed_collective"), _where(where, "failed_collective")
        ),
        group_seqs=group_seqs,
        group_sizes=group_sizes,
        finished_calls=tuple(finished),
        frames=_texts(obj, "frames", where, MAX_FRAMES),
        frames_note=_text(obj, "frames_note", where),
        silent_seconds=_float(obj, "silent_seconds", where),
        crossing_call=_flag(obj, "crossing_call", where),
    )
