"""A c10d call on the stack counts as in flight only once it has issued its work (or stays put).

A real one-rank Gloo group in this process; the training thread is held (by a trace function)
inside ``torch.distributed.all_reduce``, first on the line that issues the work, then on its way
out after the wait returned. In both places the group's sequence number is not the one of a call
in flight (the call before's, then the call's own after it finished), and a record taken then
said the rank was inside the call: beside ranks already in the next call, a mismatch, opened on
sight (seen once under load in the hang tests, a rank's peers having left).
"""

from __future__ import annotations

import linecache
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.hang.record import CallsInFlight
from rankwatch.exporter.hang.watch import HangWatcher
from rankwatch.exporter.step_time.timer import StepTimer
from tests.servers import free_port

TIMEOUT_S = 30.0


class Held:
    """Runs ``dist.all_reduce`` on a thread of its own, held where ``where(frame, event, line)``
    says, until released."""

    def __init__(self, where: Callable[[FrameType, str, str], bool]) -> None:
        self.where = where
        self.at = threading.Event()
        self.go = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_name != "all_reduce" or not frame.f_code.co_filename.endswith(
            "distributed_c10d.py"
        ):
            return None

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            if not self.at.is_set() and self.where(frame, event, line):
                self.at.set()
                self.go.wait(TIMEOUT_S)
            return local

        return local

    def _run(self) -> None:
        sys.settrace(self._trace)
        try:
            dist.all_reduce(torch.ones(3))
        except BaseException as exc:
            self.error = exc
        finally:
            sys.settrace(None)

    def __enter__(self) -> Held:
        self.thread.start()
        assert self.at.wait(TIMEOUT_S), "the call never reached the place to hold it"
        return self

    def __exit__(self, *exc: object) -> None:
        self.go.set()
        self.thread.join(TIMEOUT_S)
        assert self.error is None, self.error


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _watcher(thread: threading.Thread) -> HangWatcher:
    """The held thread's watcher; no wait of it is timed (none is while a call is entered or
    left)."""
    return HangWatcher(0, StepTimer(16), RankwatchConfig.from_env({}), None, "h", thread.ident or 0)


def _record(watcher: HangWatcher) -> Any:
    return watcher._record(time.perf_counter_ns(), frames=True)


def _look(watcher: HangWatcher) -> Any:
    return _record(watcher).collective


def _seq() -> int:
    return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())


def test_a_call_about_to_issue_its_work_is_not_yet_inside_it(group: None) -> None:
    before = _seq()
    with Held(lambda f, event, line: event == "line" and "group.allreduce(" in line) as held:
        watcher = _watcher(held.thread)
        assert _seq() == before  # nothing issued yet: the number is the call before's
        entering = _record(watcher)
        # Crossing the call's edge: the root judges at its next poll instead.
        assert entering.collective is None and entering.crossing_call
        # Still there at the next look: held where no wait is timed, it counts.
        held_record = _record(watcher)
        stuck = held_record.collective
        assert stuck is not None and (stuck.op, stuck.seq) == ("all_reduce", before)
        assert stuck.shapes == ((3,),) and stuck.dtypes == ("float32",)
        assert not held_record.crossing_call


def test_a_call_on_its_way_out_is_no_longer_inside_it(group: None) -> None:
    before = _seq()
    with Held(lambda f, event, line: event == "return") as held:
        watcher = _watcher(held.thread)
        assert _seq() == before + 1  # issued and finished
        leaving = _record(watcher)
        assert leaving.collective is None and leaving.crossing_call


def test_work_issued_and_not_finished_counts_at_once() -> None:
    class Work:
        def __init__(self, done: bool) -> None:
            self.done = done

        def is_completed(self) -> bool:
            return self.done

    def suspended() -> Iterator[None]:
        yield

    frames = []
    for _ in range(2):  # frames that stay at one instruction, as a held call's does
        gen = suspended()
        next(gen, None)
        frames.append((gen, gen.gi_frame))
    frame, other = frames[0][1], frames[1][1]
    calls = CallsInFlight()
    assert calls.check(1, frame, {"work": Work(False)})
    assert not calls.check(2, frame, {"work": Work(True)})  # finished: on its way out
    assert calls.check(3, frame, {"work": Work(True)})  # ... and still there a look later
    assert not calls.check(5, frame, {})  # a look was skipped: seen once again, not twice
    assert not calls.check(6, other, {})  # another frame at the next look
    assert calls.check(7, other, {"work": object()})  # not a Work: the frame decides
