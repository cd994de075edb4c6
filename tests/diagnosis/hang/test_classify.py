"""The hang rules on hand-made records: every class, the named ranks, phase and collective,
and bad inputs refused with the field named."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.hang import Collective, RankRecord, classify_hang, record_from_dict
from rankwatch.diagnosis.hang.artifact import (
    classify_files,
    hang_file_name,
    is_hang_file_name,
    load_hang_file,
)
from rankwatch.diagnosis.hang.classify import HangReport
from rankwatch.diagnosis.hang.records import DEAD, LEFT, NO_ANSWER
from rankwatch.diagnosis.hang.words import hang_line
from rankwatch.diagnosis.untrusted_files import ArtifactError

STALL = 20.0


def _coll(
    op: str = "all_reduce",
    seq: int = 7,
    shape: tuple[int, ...] = (4,),
    dtype: str = "float32",
    group: str = "0",
) -> Collective:
    return Collective(group, op, seq, (shape,), (dtype,), site="train.py:10 step", seconds=5.0)


def _waiting(rank: int, **kw: object) -> RankRecord:
    return RankRecord(
        rank=rank,
        phase="backward",
        phase_seconds=18.0,
        stalled_seconds=STALL,
        collective=kw.pop("collective", _coll()),  # type: ignore[arg-type]
        group_seqs=kw.pop("group_seqs", {"0": 7}),  # type: ignore[arg-type]
        frames=("torch/distributed_c10d.py:2900 all_reduce", "train.py:10 step"),
        **kw,  # type: ignore[arg-type]
    )


def _stuck(rank: int = 2, phase: str = "input") -> RankRecord:
    return RankRecord(
        rank=rank,
        host="node-b",
        pid=4242,
        phase=phase,
        phase_seconds=21.5,
        stalled_seconds=STALL + 1,
        group_seqs={"0": 6},
        frames=("data.py:12 __getitem__", "train.py:8 step"),
    )


def _left(rank: int, seq: int = 7) -> RankRecord:
    return RankRecord(
        rank=rank,
        state=LEFT,
        phase="left",
        phase_seconds=30.0,
        stalled_seconds=STALL + 30,
        group_seqs={"0": seq},
        frames_note="stack unavailable: the rank left (closed rankwatch)",
    )


def test_ranks_that_left_while_the_root_works_on_outside_any_collective_are_no_hang() -> None:
    # Rank 0 writes the final checkpoint (or waits for its last window) after ranks 1 and 2
    # closed rankwatch at the end of the job: nobody waits in anything.
    outside = RankRecord(rank=0, phase="outside_step", phase_seconds=STALL,
                         stalled_seconds=STALL, group_seqs={"0": 7})  # fmt: skip
    for bound in (False, True):
        assert (
            classify_hang([outside, _left(1), _left(2)], stalled_seconds=STALL, mismatch_only=bound)
            is None
        )
    # Without sequence numbers (a rank that left after destroying its groups): still none.
    gone = [replace(_left(r), group_seqs={}) for r in (1, 2)]
    assert classify_hang([outside, *gone], stalled_seconds=STALL) is None


def test_a_rank_waiting_for_ranks_that_left_names_them_stuck_in_phase_left() -> None:
    # Uneven inputs: rank 0 has one batch more; its gradient all-reduce (#8) waits for ranks
    # that ran out of batches at #7 and left.
    ahead = _waiting(0, collective=_coll(seq=8), group_seqs={"0": 8})
    v = classify_hang([ahead, _left(1), _left(2)], stalled_seconds=STALL)
    assert v is not None and v.hang_class == "STUCK_ALIVE", v
    assert v.ranks == (1, 2) and v.phase == "left" and v.waiting_ranks == (0,)
    assert v.collective is not None and v.collective.ident()["seq"] == 8
    assert "left the job" in v.detail and v.frames == (
        "stack unavailable: the rank left (closed rankwatch)"
    )
    assert "left the job" in hang_line(v, group="world", budget_seconds=15.0)
    # Issued in C++ (DDP's reducer): no call seen from Python, the number ahead says it.
    ahead_cpp = replace(ahead, collective=None)
    v = classify_hang([ahead_cpp, _left(1), _left(2)], stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks) == ("STUCK_ALIVE", (1, 2)), v
    # Inside a call whose numbers say nothing (the ranks that left sent none): still named.
    blind = _waiting(0, group_seqs={})
    gone = [replace(_left(r), group_seqs={}) for r in (1, 2)]
    v = classify_hang([blind, *gone], stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks) == ("STUCK_ALIVE", (1, 2)), v


def test_a_rank_stuck_in_a_phase_is_named_even_after_others_left() -> None:
    # Rank 1 left; rank 0 waits in its all-reduce for rank 2, stuck in its data loader.
    v = classify_hang([_waiting(0), _left(1, seq=7), _stuck(2)], stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks, v.phase) == ("STUCK_ALIVE", (2,), "input")


def test_stuck_alive_names_the_rank_behind_its_phase_and_what_the_others_wait_in() -> None:
    v = classify_hang([_waiting(0), _waiting(1), _stuck()], stalled_seconds=STALL)
    assert v is not None and v.hang_class == "STUCK_ALIVE"
    assert v.ranks == (2,) and v.phase == "input" and v.phase_seconds == 21.5
    assert v.collective is not None and v.collective.ident() == {
        "group": "0",
        "op": "all_reduce",
        "seq": 7,
    }
    assert v.waiting_ranks == (0, 1)
    assert v.frames == ["data.py:12 __getitem__", "train.py:8 step"]
    assert isinstance(v.waiting_frames, list) and "all_reduce" in v.waiting_frames[0]
    ev = HangReport(v, 15.0, 20.0, "line").evidence()
    for key in (
        "hang_class",
        "phase",
        "phase_seconds",
        "collective",
        "culprit_collective",
        "frames",
        "waiting_ranks",
        "waiting_frames",
        "stalled_seconds",
        "detected_after_seconds",
    ):
        assert key in ev
    json.dumps(ev)
    line = hang_line(v, group="world", budget_seconds=15.0)
    for part in (
        "STUCK_ALIVE",
        "rank 2",
        "node-b",
        "4242",
        "phase input",
        "all_reduce #7 of group 0",
        "data.py:12 __getitem__",
    ):
        assert part in line, line


def test_a_collective_issued_in_cpp_is_seen_by_its_sequence_number() -> None:
    ddp = [_waiting(r, collective=None, group_seqs={"0": 7}) for r in (0, 1)]
    v = classify_hang([*ddp, _stuck()], stalled_seconds=STALL)
    assert v is not None and v.hang_class == "STUCK_ALIVE" and v.ranks == (2,)
    assert v.collective == Collective("0", "unknown", 7)


def test_a_silent_rank_is_named_with_why_its_stack_is_missing() -> None:
    silent = RankRecord(
        rank=2, state=NO_ANSWER, frames_note="stack unavailable: no answer for 20 s (x)"
    )
    v = classify_hang([_waiting(0), _waiting(1), silent], stalled_seconds=STALL)
    assert v is not None and v.hang_class == "STUCK_ALIVE" and v.ranks == (2,)
    assert v.frames == "stack unavailable: no answer for 20 s (x)"


@pytest.mark.parametrize(
    "other",
    [
        _coll(op="broadcast"),  # an extra all_reduce against the others' next collective
        _coll(shape=(8,)),
        _coll(dtype="float64"),
        _coll(seq=9),
    ],
)
def test_collective_mismatch_names_the_smaller_side_and_both_collectives(other: Collective) -> None:
    v = classify_hang(
        [_waiting(0), _waiting(1), _waiting(2, collective=other)],
        stalled_seconds=2.0,
        mismatch_only=True,
    )
    assert v is not None and v.hang_class == "COLLECTIVE_MISMATCH" and v.ranks == (2,)
    assert v.culprit_collective == other
    assert v.collective is not None and v.collective.op == "all_reduce"
    assert v.waiting_ranks == (0, 1)
    assert "train.py:10" in v.detail


def test_two_equal_sides_are_both_named_with_both_calls() -> None:
    # One rank in an all_reduce, the other in a broadcast at the same number: which call is
    # the odd one cannot be told, so neither rank is guessed.
    v = classify_hang(
        [_waiting(0), _waiting(1, collective=_coll(op="broadcast"))], stalled_seconds=STALL
    )
    assert v is not None and v.hang_class == "COLLECTIVE_MISMATCH" and v.ranks == (0, 1)
    assert "rank(s) 0 in all_reduce #7" in v.detail and "rank(s) 1 in broadcast #7" in v.detail


def test_stalled_in_collective_names_who_entered_last() -> None:
    late = _waiting(
        2, collective=Collective("0", "all_reduce", 7, ((4,),), ("float32",), seconds=1.0)
    )
    v = classify_hang([_waiting(0), _waiting(1), late], stalled_seconds=STALL)
    assert v is not None and v.hang_class == "STALLED_IN_COLLECTIVE" and v.ranks == (2,)
    assert v.waiting_ranks == (0, 1)


def test_rank_dead_comes_first() -> None:
    dead = RankRecord(rank=1, state=DEAD, frames_note="stack unavailable: the process is gone")
    v = classify_hang([_waiting(0), dead, _stuck()], stalled_seconds=STALL)
    assert v is not None and v.hang_class == "RANK_DEAD" and v.ranks == (1,)


def test_all_stalled_names_nobody() -> None:
    quiet = [
        RankRecord(rank=r, phase="input", stalled_seconds=STALL, group_seqs={"0": 3})
        for r in range(3)
    ]
    v = classify_hang(quiet, stalled_seconds=STALL)
    assert v is not None and v.hang_class == "ALL_STALLED" and v.ranks == () and v.phase == ""


def test_mismatch_only_says_nothing_about_a_plain_stuck_rank() -> None:
    assert classify_hang([_waiting(0), _stuck()], stalled_seconds=2.0, mismatch_only=True) is None


def test_bad_inputs_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="records"):
        classify_hang([], stalled_seconds=1.0)
    with pytest.raises(ValueError, match="repeat"):
        classify_hang([_stuck(1), _stuck(1)], stalled_seconds=1.0)
    with pytest.raises(TypeError, match="RankRecord"):
        classify_hang([{"rank": 1}], stalled_seconds=1.0)  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"rank": -1}, "rank"),
        ({"rank": True}, "rank"),
        ({"state": "asleep"}, "state"),
        ({"phase_seconds": float("nan")}, "phase_seconds"),
        ({"phase_seconds": -1}, "phase_seconds"),
        ({"phase": "x" * 600}, "phase"),
        ({"frames": "not a list"}, "frames"),
        ({"frames": ["x"] * 40}, "frames"),
        ({"group_seqs": {"0": "7"}}, "group_seqs"),
        ({"collective": {"group": "0", "op": "x", "seq": -2}}, "collective.seq"),
        (
            {"collective": {"group": "0", "op": "x", "seq": 1, "shapes": [[-1]]}},
            "collective.shapes",
        ),
        ({"collective": 5}, "collective"),
        ({"finished_calls": {"group": "0"}}, "finished_calls"),
        ({"finished_calls": [None]}, r"finished_calls\[0\]"),
        ({"finished_calls": [{"group": "0", "op": "x", "seq": "1"}]}, r"finished_calls\[0\]\.seq"),
        ({"finished_calls": [{"group": "0", "op": "x", "seq": 1}] * 65}, "finished_calls"),
        ({"crossing_call": "yes"}, "crossing_call"),
        ({"crossing_call": 1}, "crossing_call"),
    ],
)
def test_a_record_from_another_process_is_checked_field_by_field(
    patch: dict[str, object], field: str
) -> None:
    good = _stuck().to_dict()
    assert record_from_dict(good) == _stuck()
    with pytest.raises(ValueError, match=field):
        record_from_dict({**good, **patch})


def _write(folder: Path, record: RankRecord, **extra: object) -> Path:
    body = {
        "format": "rankwatch.hang_record",
        "version": 1,
        "rank": record.rank,
        "host": "h",
        "pid": 7,
        "run": "r",
        "group": "world",
        "written_at_s": 1.0,
        "reason": "suspect",
        "records": [record.to_dict()],
        "stacks": {"MainThread": list(record.frames)},
        "verdict": None,
        **extra,
    }
    path = folder / hang_file_name(record.rank, 7)
    path.write_text(json.dumps(body))
    return path


def test_hang_files_read_back_give_the_live_verdict(tmp_path: Path) -> None:
    paths = [_write(tmp_path, r) for r in (_waiting(0), _waiting(1), _stuck())]
    assert all(is_hang_file_name(p.name) for p in paths)
    files = [load_hang_file(p) for p in paths]
    v = classify_files(files)
    assert v is not None and v.hang_class == "STUCK_ALIVE" and v.ranks == (2,)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"format": "other"}, "format"),
        ({"version": 2}, "version"),
        ({"records": []}, "records"),
        ({"records": [{"rank": "x"}]}, "records"),
        ({"stacks": {"t": "no list"}}, "stacks"),
        ({"verdict": 3}, "verdict"),
        ({"host": 5}, "host"),
    ],
)
def test_a_bad_hang_file_is_refused_naming_file_and_field(
    tmp_path: Path, extra: dict[str, object], field: str
) -> None:
    path = _write(tmp_path, _stuck(), **extra)
    with pytest.raises(ArtifactError, match=field) as info:
        load_hang_file(path)
    assert str(path) in str(info.value)


def test_a_hang_file_that_is_not_a_regular_file_or_too_deep_is_refused(tmp_path: Path) -> None:
    (tmp_path / "hang-rank1-2.json").mkdir()
    with pytest.raises((ArtifactError, OSError)):
        load_hang_file(tmp_path / "hang-rank1-2.json")
    deep = tmp_path / "hang-rank3-2.json"
    deep.write_text("[" * 10_000 + "]" * 10_000)
    with pytest.raises(ArtifactError):
        load_hang_file(deep)


def test_a_broadcast_root_waiting_for_a_silent_receiver_is_not_named() -> None:
    # Rank 0 broadcasts (#21) and waits for rank 2, which stopped; rank 1 received and went on
    # into DDP's all-reduce (#22, issued in C++).
    root = _waiting(0, collective=_coll(op="broadcast", seq=21), group_seqs={"0": 21})
    ahead = _waiting(1, collective=None, group_seqs={"0": 22})
    stopped = RankRecord(rank=2, state=NO_ANSWER, frames_note="stack unavailable: stopped")
    v = classify_hang([root, ahead, stopped], stalled_seconds=STALL)
    assert v is not None and v.hang_class == "STUCK_ALIVE" and v.ranks == (2,)
    assert v.waiting_ranks == (0, 1)


# ---- the wait-for graph: pipelines, extra calls, ranks left behind ------------------------------


def _rec(
    rank: int,
    seqs: dict[str, int],
    collective: Collective | None = None,
    phase: str = "backward",
    finished_calls: tuple[Collective, ...] = (),
) -> RankRecord:
    return RankRecord(
        rank=rank,
        phase=phase,
        phase_seconds=STALL,
        stalled_seconds=STALL,
        collective=collective,
        group_seqs=seqs,
        group_sizes={g: 2 if g.startswith("dp") or g.startswith("pp") else 4 for g in seqs},
        frames=(f"train.py:{rank} step",),
        finished_calls=finished_calls,
    )


def test_a_pipeline_stage_waiting_on_its_peer_points_through_to_the_stuck_rank() -> None:
    # Mesh (pp, dp) = (2, 2): rank 2 (stage 1) sleeps in forward. Rank 0 (stage 0) waits in
    # its receive from rank 2; rank 1 waits for rank 0 in DDP's all-reduce over dp01 (issued
    # in C++: ahead by its number); rank 3 waits for rank 2 in dp23.
    recv = Collective("pp02", "recv", 0, ((4, 8),), ("float32",), peers=(2,))
    records = [
        _rec(0, {"dp01": 5, "pp02": 0}, recv),
        _rec(1, {"dp01": 6, "pp13": 0}),
        _rec(2, {"dp23": 5, "pp02": 0}, phase="forward"),
        _rec(3, {"dp23": 6, "pp13": 0}),
    ]
    v = classify_hang(records, stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks, v.phase) == ("STUCK_ALIVE", (2,), "forward")
    assert v.waiting_ranks == (0, 1, 3)
    assert v.collective is not None and v.collective.group in ("pp02", "dp23")


def test_an_extra_collective_on_one_rank_is_a_mismatch_naming_it() -> None:
    # Every rank all-reduces a metric on group "m" once a step; rank 2 twice once: its extra call
    # (#11) waits alone, the others wait in the next step's DDP all-reduce on "w" (#31, issued
    # in C++), which rank 2 never reaches.
    extra = Collective("m", "all_reduce", 11, ((2,),), ("float32",), site="train.py:40 log")
    records = [_rec(r, {"m": 10, "w": 31}) for r in (0, 1, 3)]
    records.append(_rec(2, {"m": 11, "w": 30}, extra, phase="outside_step"))
    v = classify_hang(records, stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks) == ("COLLECTIVE_MISMATCH", (2,))
    assert v.culprit_collective == extra
    assert v.waiting_ranks == (0, 1, 3)
    assert "train.py:40" in v.detail
    # Before the budget, a cycle alone is not raised (only a visible disagreement is).
    assert classify_hang(records, stalled_seconds=2.0, mismatch_only=True) is None


def test_a_rank_left_inside_a_call_the_others_finished_is_a_mismatch_naming_it() -> None:
    # A 3-float all-reduce against the others' 2 floats: they finish their side and go on into
    # the next step's all-reduce on "w", which rank 2 never reaches.
    left = Collective("m", "all_reduce", 10, ((3,),), ("float32",), site="train.py:40 log")
    records = [_rec(r, {"m": 10, "w": 31}) for r in (0, 1, 3)]
    records.append(_rec(2, {"m": 10, "w": 30}, left, phase="outside_step"))
    for early in (False, True):
        v = classify_hang(records, stalled_seconds=STALL, mismatch_only=early)
        assert v is not None and (v.hang_class, v.ranks) == ("COLLECTIVE_MISMATCH", (2,))
        assert v.culprit_collective == left and v.waiting_ranks == (0, 1, 3)


def test_a_silent_rank_is_waited_on_only_in_groups_it_belongs_to() -> None:
    # Rank 1 is ahead on dp01 and waits on rank 0, which is outside every collective; rank 3
    # does not answer, but dp01's size says both its members answered: it is not waited on.
    silent = RankRecord(rank=3, state=NO_ANSWER, frames_note="stack unavailable: stopped")
    records = [
        _rec(0, {"dp01": 5}, phase="input"),
        _rec(1, {"dp01": 6}),
        _rec(2, {"dp23": 5}, phase="input"),
        silent,
    ]
    v = classify_hang(records, stalled_seconds=STALL)
    assert v is not None and v.hang_class == "STUCK_ALIVE" and v.ranks == (0,)


_GROUPS = ("0", "dp01", "dp23", "m")


@st.composite
def _any_record(draw: st.DrawFn, rank: int) -> RankRecord:
    state = draw(st.sampled_from(["answered", "answered", NO_ANSWER, DEAD]))
    seqs = draw(st.dictionaries(st.sampled_from(_GROUPS), st.integers(0, 5), max_size=4))
    collective = draw(
        st.none()
        | st.builds(
            Collective,
            group=st.sampled_from(_GROUPS),
            op=st.sampled_from(["all_reduce", "broadcast", "unknown", "recv", "wait_tensor"]),
            seq=st.integers(0, 5),
            shapes=st.sampled_from([(), ((2,),), ((3,),)]),
            dtypes=st.sampled_from([(), ("float32",), ("float64",)]),
            peers=st.sampled_from([(), (0,), (1, 3)]),
        )
    )
    return RankRecord(
        rank=rank,
        state=state,
        phase=draw(st.sampled_from(["input", "forward", "outside_step", ""])),
        collective=collective,
        failed_collective=draw(st.none() | st.just(Collective("m", "all_reduce", 3, ((2,),)))),
        group_seqs=seqs,
        group_sizes=draw(st.sampled_from([{}, {g: 4 for g in seqs}, {g: 2 for g in seqs}])),
    )


@given(st.integers(1, 4).flatmap(lambda n: st.tuples(*(_any_record(r) for r in range(n)))))
@settings(max_examples=400)
def test_any_records_give_a_verdict_or_none_never_an_error(records: tuple[RankRecord, ...]) -> None:
    # The root's hang loop runs this on whatever the ranks sent: it must never raise.
    for early in (False, True):
        v = classify_hang(list(records), stalled_seconds=STALL, mismatch_only=early)
        assert v is None or set(v.ranks) <= {r.rank for r in records}


def test_a_stopped_rank_under_ddp_is_named_with_the_group_it_is_missing_from() -> None:
    # DDP's all-reduce waits in C++ (no frame names it); rank 2 stopped and sent nothing: the
    # others wait in the world group, which has one member fewer answering than its size.
    records: list[RankRecord] = [_rec(r, {"0": 66, "1": 60}) for r in (0, 1, 3)]
    records.append(RankRecord(rank=2, state=NO_ANSWER, frames_note="stack unavailable: stopped"))
    v = classify_hang(records, stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks) == ("STUCK_ALIVE", (2,))
    assert v.collective == Collective("0", "unknown", 66)
    assert v.frames == "stack unavailable: stopped"


def test_an_extra_collective_against_calls_seen_in_python_names_the_one_most_left_waiting() -> None:
    # FSDP2: the others wait inside their all-gather (a c10d call in their frames) for rank 2,
    # which is inside an all-reduce the three of them never make.
    extra = Collective("m", "all_reduce", 11, ((2,),), ("float32",), site="train.py:40 log")
    gather = Collective("0", "all_gather_single", 31, ((64,),), ("float32",))
    records = [_rec(r, {"m": 10, "0": 31}, gather) for r in (0, 1, 3)]
    records.append(_rec(2, {"m": 11, "0": 30}, extra, phase="outside_step"))
    v = classify_hang(records, stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks) == ("COLLECTIVE_MISMATCH", (2,))
    assert v.culprit_collective == extra and v.collective == gather


def test_a_broadcast_receiver_that_went_on_sides_with_the_broadcast() -> None:
    # Rank 2 calls an all_reduce the others never call; ranks 0 and 1 broadcast from rank 0
    # at that number: rank 1 received and went on, rank 0 waits for rank 2. One against one
    # inside the call, but only a call with a root lets a rank finish: rank 1 was a broadcast.
    bcast = _coll(op="broadcast", seq=51)
    extra = _coll(op="all_reduce", seq=51)
    records = [
        _waiting(0, collective=bcast, group_seqs={"0": 51}),
        _waiting(1, collective=None, group_seqs={"0": 52}),
        _waiting(2, collective=extra, group_seqs={"0": 51}),
    ]
    v = classify_hang(records, stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks) == ("COLLECTIVE_MISMATCH", (2,))
    assert v.culprit_collective == extra and v.collective == bcast


def _sized(n: int, dtype: str = "float32") -> Collective:
    return Collective("m", "all_reduce", 61, ((n,),), (dtype,), site="train.py:40 log")


def test_ranks_that_finished_the_disputed_call_say_which_side_is_odd() -> None:
    # TP x DP, a 3-float all-reduce on rank 1 against 2 floats: ranks 0 and 3 finished their
    # side and went on, ranks 1 and 2 are left inside, one against one. What 0 and 3 finished
    # at that number (2 floats) makes rank 1 the odd one.
    mine, theirs = _sized(3), _sized(2)
    finished = (replace(_sized(2), site="", seconds=None),)
    records = [
        _rec(0, {"m": 61}, None, finished_calls=finished),
        _rec(1, {"m": 61}, mine),
        _rec(2, {"m": 61}, theirs),
        _rec(3, {"m": 61}, None, finished_calls=finished),
    ]
    v = classify_hang(records, stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks) == ("COLLECTIVE_MISMATCH", (1,))
    assert v.culprit_collective == mine and v.collective == theirs
    # Without what they finished it is one against one: both named, none guessed.
    bare = [replace(r, finished_calls=()) for r in records]
    v = classify_hang(bare, stalled_seconds=STALL)
    assert v is not None and v.ranks == (1, 2)


def test_a_finished_call_at_another_number_or_agreeing_with_both_sides_says_nothing() -> None:
    mine, theirs = _sized(3), _sized(2)
    for finished in (
        (replace(_sized(2), seq=60),),  # an earlier call of the group
        (Collective("m", "unknown", 61),),  # nothing known of it: agrees with either side
    ):
        records = [
            _rec(0, {"m": 61}, None, finished_calls=finished),
            _rec(1, {"m": 61}, mine),
            _rec(2, {"m": 61}, theirs),
        ]
        v = classify_hang(records, stalled_seconds=STALL)
        assert v is not None and v.ranks == (1, 2), finished


def test_a_dtype_mismatch_whose_receiver_died_names_the_odd_dtype() -> None:
    # DDP under Gloo: float64 on rank 2 against float32; Gloo aborted receiving rank 1 (gone),
    # rank 3's call raised, rank 0 finished its side and went on. The float32 side has ranks
    # 0 and 3; rank 2 is named, the death said.
    f64, f32 = _sized(2, "float64"), _sized(2)
    records = [
        _rec(0, {"m": 61, "0": 66}, None, finished_calls=(f32,)),
        RankRecord(rank=1, state=DEAD),
        _rec(2, {"m": 61, "0": 65}, f64),
        replace(_rec(3, {"m": 61, "0": 65}, None), failed_collective=f32),
    ]
    v = classify_hang(records, stalled_seconds=STALL)
    assert v is not None and (v.hang_class, v.ranks) == ("COLLECTIVE_MISMATCH", (2,))
    assert "the process is gone" in v.detail
