"""What the hang watcher costs: on the training thread, and on its own thread.

On the training thread the watcher adds one attribute increment (``StepTimer.marks += 1``)
to every phase left, every sync wait ended (every collective the shadows time) and every step
written, and one attribute write per fetched batch. The rows measure, interleaved in blocks
of ``CALLS`` so both sides see the same machine load:

* a phase mark (enter + exit of a timed phase) as it is, against the same mark less one
  ``marks += 1`` (the increment timed alone and subtracted: the code before the watcher);
* a completed ``Work.wait()`` through the collective shadow with a step open (a sync wait),
  the same way;
* the finished-call note (:mod:`rankwatch.exporter.hang.finished_calls`: the last call
  each group finished, noted when its wait ends) on the frames of a real blocking
  ``all_reduce`` (2 floats, a one-rank Gloo world), against an empty hook called the same
  way: what it adds to every collective the shadows time;
* one poll of the watcher while the job progresses (its thread holds the interpreter lock for
  this long every ``hang_poll_seconds``);
* one poll of a suspect rank: the training thread's frames, the collective read from them, the
  group sequence numbers, the JSON record written to a real c10d store; and the same on a
  rank that also looks whether the root is gone (:mod:`rankwatch.exporter.hang.standin`:
  the root's record read from the store, ``/proc``), interleaved with it.

Usage: ``python -m bench.run_all --only bench_hang_watch``.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

from bench.bench_hot_path import _row

REPEATS = 9
CALLS = 20_000
TARGET_MARK_US = 1.0  # per collective (issue 29): at most 1 us added


class _Counter:
    __slots__ = ("marks",)

    def __init__(self) -> None:
        self.marks = 0


def _increment_us(calls: int) -> float:
    c = _Counter()
    clock = time.perf_counter
    start = clock()
    for _ in range(calls):
        c.marks += 1
    loop = clock() - start
    start = clock()
    for _ in range(calls):
        pass
    return max(0.0, (loop - (clock() - start)) / calls * 1e6)


def _mark_us(timer: Any, calls: int) -> float:
    phase = timer.phase("forward")
    clock = time.perf_counter
    start = clock()
    for _ in range(calls):
        with phase:
            pass
    return (clock() - start) / calls * 1e6


def _wait_us(work: Any, calls: int) -> float:
    clock = time.perf_counter
    start = clock()
    for _ in range(calls):
        work.wait()
    return (clock() - start) / calls * 1e6


def _hook_us(hook: Any, frame: Any, calls: int) -> float:
    clock = time.perf_counter
    start = clock()
    for _ in range(calls):
        hook(frame)
    return (clock() - start) / calls * 1e6


def run() -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from rankwatch.diagnosis.hang import RankRecord
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.hang.finished_calls import FinishedCalls
    from rankwatch.exporter.hang.root import HangRoot
    from rankwatch.exporter.hang.standin import StandIn
    from rankwatch.exporter.hang.watch import HangWatcher, record_key
    from rankwatch.exporter.step_time.collectives import install_collective_waits
    from rankwatch.exporter.step_time.timer import StepTimer
    from tests.servers import free_port

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    timer = StepTimer(4096)
    handles = install_collective_waits(timer)
    work = dist.all_reduce(torch.ones(1), async_op=True)
    assert work is not None
    work.wait()
    timer.start_step()
    try:
        inc, marks, waits = [], [], []
        for _ in range(REPEATS):
            inc.append(_increment_us(CALLS))
            marks.append(_mark_us(timer, CALLS))
            waits.append(_wait_us(work, CALLS))
        inc_med = statistics.median(inc)
        # The note's own cost, on the frames of a real blocking all_reduce (kept from one call:
        # a frame keeps its locals once it has returned), against an empty hook.
        finished = FinishedCalls()
        kept: list[Any] = []
        timer.on_wait_done = kept.append
        dist.all_reduce(torch.ones(2))
        timer.on_wait_done = None
        frame = kept[0]
        notes, empty = [], []
        for _ in range(REPEATS):
            notes.append(_hook_us(finished.note, frame, CALLS))
            empty.append(_hook_us(lambda f: None, frame, CALLS))
        assert finished.calls() and finished.calls()[0].shapes == ((2,),)
        rows = [
            _row(
                "one marks += 1 (the watcher's per-mark addition)", TARGET_MARK_US, inc, "us", inc
            ),
            _row(
                "phase mark (enter + exit) with the watcher, against without",
                None,
                marks,
                "us",
                [m - inc_med for m in marks],
            ),
            _row(
                "completed Work.wait() through the shadow (a collective's wait), against without",
                None,
                waits,
                "us",
                [w - inc_med for w in waits],
            ),
            _row(
                "finished-call note on a real all_reduce's frames (per collective), "
                "against an empty hook",
                TARGET_MARK_US,
                notes,
                "us",
                empty,
            ),
        ]
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
        cfg = RankwatchConfig.from_env({}, hang_budget_seconds=1.0, hang_warmup_steps=0)
        watcher = HangWatcher(0, timer, cfg, store, "bench", threading.get_ident())
        healthy, suspect = [], []
        for _ in range(REPEATS):
            for _ in range(200):
                timer.marks += 1  # progress between polls: the healthy case
                t0 = time.perf_counter()
                watcher.tick()
                healthy.append((time.perf_counter() - t0) * 1e6)
        watcher._progress_ns = time.perf_counter_ns() - 10**10  # 10 s without progress
        # A suspect rank 1 of two, whose stand-in looks whether the root (alive: this process,
        # by its first record) is gone, every poll; interleaved with the plain suspect poll.
        root_record = RankRecord(rank=0, host="bench", pid=os.getpid(), budget_seconds=1.0)
        store.set(record_key(0), json.dumps({**root_record.to_dict(), "beat": 1, "pidns": 0}))
        loop = HangRoot((0, 1), 1, store, 0.5, lambda report: None, group="world", host="bench",
                        pidns=0, log_lines=False)  # fmt: skip
        standin = StandIn(loop, 0, (0, 1))
        looking = HangWatcher(1, timer, cfg, store, "bench", threading.get_ident(), standin=standin)
        looking._marks, looking._progress_ns = timer.marks, watcher._progress_ns
        looks = []
        for _ in range(REPEATS * 20):
            t0 = time.perf_counter()
            watcher.tick()
            suspect.append((time.perf_counter() - t0) * 1e6)
            t0 = time.perf_counter()
            looking.tick()
            looks.append((time.perf_counter() - t0) * 1e6)
        assert watcher.suspect and looking.suspect
        assert standin.looks == REPEATS * 20 and not standin.acting
        rows.append(_row("watcher poll while the job progresses", None, healthy, "us", healthy))
        rows.append(
            _row(
                "watcher poll of a suspect rank (frames, record to the store)",
                None,
                suspect,
                "us",
                suspect,
            )
        )
        rows.append(
            _row(
                "the same on a rank that also looks whether the root is gone (its record read, "
                "/proc), against without",
                None,
                looks,
                "us",
                suspect,
            )
        )
        return rows
    finally:
        for h in handles:
            h.remove()
        dist.destroy_process_group()
