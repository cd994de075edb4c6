"""The hang watcher's parts in one process: the phase read from the timer, declared phases and
their budget, the device clock on the CUDA double, and the root's loop over records in a real
c10d store (other ranks' records written as they would write them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from rankwatch.diagnosis.hang import Collective, HangReport, RankRecord
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.hang.record import DeclaredPhase, DeviceWaitClock, current_phase
from rankwatch.exporter.hang.root import HangRoot, process_state
from rankwatch.exporter.hang.watch import HangWatcher, record_key
from rankwatch.exporter.step_time.timer import FORWARD, INPUT_WAIT, StepTimer
from tests.exporter.step_time.cuda_double import Device
from tests.exporter.step_time.test_gpu_streams import Rank
from tests.servers import free_port


def test_the_phase_is_the_innermost_one_entered_and_a_declared_one_wins() -> None:
    timer = StepTimer(8)
    now = time.perf_counter_ns()
    assert current_phase(timer, now, now - 2_000_000_000) == ("outside_step", 2.0)
    timer.begin(INPUT_WAIT)
    assert current_phase(timer, time.perf_counter_ns(), now)[0] == "input"
    timer.end(INPUT_WAIT)
    timer.begin(FORWARD)
    assert current_phase(timer, time.perf_counter_ns(), now)[0] == "forward"
    marks = timer.marks
    with DeclaredPhase(timer, "checkpoint", 60.0, None):
        assert current_phase(timer, time.perf_counter_ns(), now)[0] == "checkpoint"
        assert timer.declared[-1][:2] == ("checkpoint", 60.0)
    assert timer.declared == [] and timer.marks == marks + 1


def test_the_budget_follows_warmup_the_job_and_declared_phases() -> None:
    cfg = RankwatchConfig.from_env(
        {}, hang_budget_seconds=4.0, hang_warmup_budget_seconds=50.0, hang_warmup_steps=2
    )
    timer = StepTimer(64)
    watcher = HangWatcher(0, timer, cfg, None, "h", 0)
    now = time.perf_counter_ns()
    assert watcher.budget_seconds(now) == 50.0  # no step done yet
    for _ in range(3):
        timer.start_step()
        timer.end_step()
    watcher._history_at = 0.0
    assert watcher.budget_seconds(now) == 4.0
    with DeclaredPhase(timer, "eval", 30.0, None):
        assert watcher.budget_seconds(now) == 30.0
    timer.first_fetch = True  # an epoch's first batch: the loader's workers start
    assert watcher.budget_seconds(now) == 50.0


def test_the_device_clock_says_how_long_the_device_is_inside_a_wait() -> None:
    rank = Rank(Device())
    t = rank.timer
    t.start_step()
    with t.sync_wait():
        done = rank.collective(50_000.0)  # a collective that does not finish
        rank.compute.wait_event(done)
    rank.device.advance(1.0)
    clock = DeviceWaitClock()
    markers = rank.gpu.wait_markers()
    assert markers
    assert clock.seconds(markers, 100.0) == 0.0
    assert clock.seconds(rank.gpu.wait_markers(), 105.0) == 5.0
    rank.device.advance(60_000.0)
    assert clock.seconds(rank.gpu.wait_markers(), 106.0) is None
    rank.device.fail.add("query")
    assert clock.seconds(markers, 107.0) is None


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))


def _put(store: Any, record: RankRecord, beat: int) -> None:
    store.set(record_key(record.rank), json.dumps({**record.to_dict(), "beat": beat}))


def _root(store: Any, reports: list[HangReport], ranks: tuple[int, ...] = (0, 1, 2)) -> HangRoot:
    return HangRoot(
        ranks, 0, store, 0.05, reports.append, group="world", host="h", pidns=0, log_lines=False
    )


def _me(stalled: float, budget: float = 3.0, steps: int = 5) -> RankRecord:
    return RankRecord(
        rank=0, phase="backward", stalled_seconds=stalled, since_step_seconds=stalled,
        budget_seconds=budget, steps=steps,
        group_seqs={"0": 9}, frames=("x.py:1 f",),
    )  # fmt: skip


def test_the_root_reads_nothing_while_it_progresses(store: Any) -> None:
    reports: list[HangReport] = []
    root = _root(store, reports)
    root.tick(_me(0.1))
    assert root.reads == 0 and reports == []


def test_the_root_names_the_rank_behind_and_closes_when_every_rank_moved_on(store: Any) -> None:
    reports: list[HangReport] = []
    root = _root(store, reports)
    waiting = RankRecord(rank=1, phase="backward", stalled_seconds=4.0, since_step_seconds=4.0,
                         budget_seconds=3.0,
                         steps=5, group_seqs={"0": 9}, frames=("y.py:2 g",))  # fmt: skip
    stuck = RankRecord(rank=2, phase="input", phase_seconds=4.2, stalled_seconds=4.2,
                       since_step_seconds=4.2,
                       budget_seconds=3.0, steps=5, group_seqs={"0": 8},
                       frames=("data.py:3 __getitem__",))  # fmt: skip
    _put(store, waiting, 1)
    _put(store, stuck, 1)
    root.tick(_me(4.0))
    assert len(reports) == 1 and reports[0].verdict is not None
    v = reports[0].verdict
    assert (v.hang_class, v.ranks, v.phase) == ("STUCK_ALIVE", (2,), "input")
    assert reports[0].evidence()["collective"] == {"group": "0", "op": "unknown", "seq": 9}
    # Every rank finishes a step: closed once.
    for r, beat in ((waiting, 2), (stuck, 2)):
        _put(store, RankRecord(rank=r.rank, stalled_seconds=0.0, budget_seconds=3.0, steps=6), beat)
    root.tick(_me(0.0, steps=6))
    assert len(reports) == 2 and reports[1].verdict is None


def test_a_rank_that_stops_answering_is_silent_and_a_gone_process_is_dead(store: Any) -> None:
    reports: list[HangReport] = []
    root = _root(store, reports, ranks=(0, 1))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert process_state(gone.pid) == "gone" and process_state(os.getpid()) == "running"
    first = RankRecord(rank=1, host="h", pid=gone.pid, stalled_seconds=0.0, budget_seconds=3.0)
    store.set(record_key(1), json.dumps({**first.to_dict(), "beat": 0, "pidns": 0}))
    root.tick(_me(4.0))
    assert len(reports) == 1 and reports[0].verdict is not None
    assert reports[0].verdict.hang_class == "RANK_DEAD" and reports[0].verdict.ranks == (1,)


def test_a_rank_that_closed_and_exited_is_not_dead_and_no_hang_while_nobody_waits(
    store: Any,
) -> None:
    # Rank 1 closes rankwatch (its watcher writes the record that says it left) and its
    # process ends, while the root works on outside any collective for longer than its budget.
    cfg = RankwatchConfig.from_env({}, hang_budget_seconds=3.0)
    timer = StepTimer(16)
    for _ in range(3):
        timer.start_step()
        timer.end_step()
    leaving = HangWatcher(1, timer, cfg, store, "h", 0)
    leaving.start()
    leaving.stop(1.0)
    payload = json.loads(store.get(record_key(1)))
    assert payload["left"] == "closed rankwatch" and payload["rank"] == 1
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # (its groups' numbers as a rank of a real job would have sent them)
    payload = {**payload, "pid": gone.pid, "pidns": 0, "group_seqs": {"0": 9}}
    store.set(record_key(1), json.dumps(payload))
    reports: list[HangReport] = []
    root = HangRoot((0, 1), 0, store, 0.05, reports.append, group="world", host="h", pidns=0,
                    broken=lambda: {1}, log_lines=False)  # fmt: skip
    for stalled in (4.0, 5.0, 30.0):
        root.tick(_me(stalled))
    assert reports == [] and root.reads == 3
    assert root.seen[1].state == "left" and root.seen[1].phase == "left"
    # The root then calls a collective rank 1 never will (one batch more): rank 1 is named.
    root.tick(replace(_me(31.0), group_seqs={"0": 10}))
    assert len(reports) == 1 and reports[0].verdict is not None
    v = reports[0].verdict
    assert (v.hang_class, v.ranks, v.phase) == ("STUCK_ALIVE", (1,), "left"), v
    assert "left the job" in v.detail
    # A rankwatch started again in that rank writes an ordinary record: it counts again.
    store.set(record_key(1), json.dumps({**payload, "beat": 99, "left": ""}))
    root.tick(_me(32.0))
    assert root.seen[1].state != "left"


def test_a_verdict_waits_one_poll_for_a_rank_crossing_a_calls_edge(store: Any) -> None:
    # Seen once in the hang tests under load: ranks 1 and 2 had left, and the root's own record
    # was taken while its training thread was inside all_reduce's issue (the group's number
    # already counting it, the call not yet in flight): judged then, the others' wait read
    # "unknown #10" instead of the all_reduce it was.
    left = RankRecord(rank=1, budget_seconds=3.0, steps=5, group_seqs={"0": 9})
    store.set(record_key(1), json.dumps({**left.to_dict(), "beat": 0, "left": "closed rankwatch"}))
    reports: list[HangReport] = []
    root = _root(store, reports, ranks=(0, 1))
    crossing = replace(_me(31.0), group_seqs={"0": 10}, crossing_call=True)
    root.tick(crossing)
    assert reports == [] and root.next_check == float("inf")  # judged a full poll later
    inside = Collective(group="0", op="all_reduce", seq=10, site="train.py:9")
    root.tick(replace(_me(31.5), group_seqs={"0": 10}, collective=inside))
    assert len(reports) == 1 and reports[0].verdict is not None
    assert (reports[0].verdict.hang_class, reports[0].verdict.ranks) == ("STUCK_ALIVE", (1,))
    assert reports[0].evidence()["collective"] == {"group": "0", "op": "all_reduce", "seq": 10}
    # A rank crossing at two polls in a row is judged at the second: the wait is one poll.
    # A poll between (here the job moved) makes a later crossing wait again.
    again: list[HangReport] = []
    root = _root(store, again, ranks=(0, 1))
    root.tick(crossing)
    root.tick(_me(0.1))
    root.tick(crossing)
    assert again == []
    root.tick(replace(crossing, stalled_seconds=31.5))
    assert len(again) == 1 and again[0].verdict is not None


_EXITING_RANK = """
import sys, threading
from datetime import timedelta
import torch.distributed as dist
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.hang.watch import HangWatcher
from rankwatch.exporter.step_time.timer import StepTimer
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, False, timeout=timedelta(seconds=10))
watcher = HangWatcher(1, StepTimer(8), RankwatchConfig.from_env({}), store, "h",
                      threading.get_ident())
watcher.start()
if sys.argv[2] == "error":
    raise RuntimeError("the training script failed")
"""


@pytest.mark.parametrize("end", ["normal", "error"])
def test_a_process_that_ends_without_close_left_only_when_it_ended_without_an_error(
    end: str,
) -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    proc = subprocess.run(
        [sys.executable, "-c", _EXITING_RANK, str(port), end],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == (0 if end == "normal" else 1), proc.stderr[-2000:]
    payload = json.loads(store.get(record_key(1)))  # its first record, at least
    if end == "normal":
        assert payload.get("left") == "its process exited", payload
    else:  # a crash: no word of leaving; the root names it dead once the process is gone
        assert "left" not in payload, payload


def test_a_silent_rank_on_another_host_is_named_with_why_there_is_no_stack(store: Any) -> None:
    reports: list[HangReport] = []
    root = _root(store, reports, ranks=(0, 1))
    other = RankRecord(rank=1, host="elsewhere", pid=1, stalled_seconds=0.0, budget_seconds=3.0)
    store.set(record_key(1), json.dumps({**other.to_dict(), "beat": 0}))
    root.tick(_me(4.0))
    assert len(reports) == 1 and reports[0].verdict is not None
    v = reports[0].verdict
    assert v.hang_class == "STUCK_ALIVE" and v.ranks == (1,)
    assert isinstance(v.frames, str) and v.frames.startswith("stack unavailable: no answer for")


def test_a_rank_in_a_declared_long_phase_holds_the_group_budget_up(store: Any) -> None:
    reports: list[HangReport] = []
    root = _root(store, reports, ranks=(0, 1))
    saving = RankRecord(rank=1, phase="checkpoint", stalled_seconds=0.0, budget_seconds=60.0)
    store.set(record_key(1), json.dumps({**saving.to_dict(), "beat": 3}))
    root.tick(_me(10.0))
    assert reports == []


def test_evaluation_forwards_and_an_epochs_first_batch_are_seen_by_the_watcher() -> None:
    import torch

    from rankwatch.exporter.step_time.rank_watch import RankWatch

    rw = RankWatch(config=RankwatchConfig.from_env({}, metrics_enabled=False))
    try:
        model = torch.nn.Linear(4, 1)
        loader = rw.watch(model, None, [torch.ones(2, 4)] * 3)
        assert rw.timer is not None
        marks = rw.timer.marks
        model.eval()
        with torch.no_grad():
            model(torch.ones(2, 4))  # evaluation: no step opens, but it is progress
        assert rw.timer.marks == marks + 1
        it = iter(loader)
        assert rw.timer.first_fetch  # the loader's workers may be starting
        next(it)
        assert not rw.timer.first_fetch
    finally:
        rw.close(2.0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_torch_distributed_checkpoint_save_is_a_declared_long_phase(tmp_path: Any) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from rankwatch.exporter.hang.record import install_checkpoint_phases

    timer = StepTimer(8)
    shadows = install_checkpoint_phases(timer, 900.0)
    try:
        assert shadows and getattr(dcp.save, "_rankwatch_checkpoint", False)
        marks = timer.marks
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "ckpt"))
        assert timer.marks == marks + 1 and timer.declared == []
        assert any((tmp_path / "ckpt").iterdir())
    finally:
        for shadow in shadows:
            shadow.remove()
    assert not getattr(dcp.save, "_rankwatch_checkpoint", False)


def test_declared_phases_refuse_bad_names_and_budgets() -> None:
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    rw = RankWatch(config=RankwatchConfig.from_env({}, metrics_enabled=False))
    try:
        for name, budget, field in (
            ("", 10.0, "name"),
            ("x" * 65, 10.0, "name"),
            ("save", 0.0, "budget_seconds"),
            ("save", float("inf"), "budget_seconds"),
            ("save", True, "budget_seconds"),
        ):
            with pytest.raises(ValueError, match=field):
                rw.phase(name, budget_seconds=budget)
        with rw.phase("save", budget_seconds=30):
            assert rw.timer is not None and rw.timer.declared[-1][:2] == ("save", 30.0)
        with rw.phase("forward", budget_seconds=30):  # a timed phase, timed as well
            assert rw.timer is not None and rw.timer.phase_open(FORWARD)
    finally:
        rw.close(2.0)


def test_a_checkpoint_being_written_is_recognised_in_the_frames() -> None:
    import sys
    import threading

    import torch

    from rankwatch.exporter.hang.record import long_work_in_frames

    inside, release = threading.Event(), threading.Event()

    class SlowFile:
        def write(self, data: bytes) -> int:
            inside.set()
            release.wait(10)
            return len(data)

        def flush(self) -> None:
            pass

    thread = threading.Thread(target=lambda: torch.save({"w": torch.ones(2)}, SlowFile()))
    thread.start()
    try:
        assert inside.wait(10)
        assert thread.ident is not None
        assert long_work_in_frames(sys._current_frames()[thread.ident]) == "checkpoint"
        assert long_work_in_frames(sys._getframe()) == ""
    finally:
        release.set()
        thread.join(10)


def test_code_run_under_dynamo_disable_is_not_compiling() -> None:
    """FSDP2's hooks run under ``torch._dynamo.disable``: a rank waiting in its all-gather has
    Dynamo's eval_frame.py on its stack and must keep its hang budget; a compile (Dynamo's
    convert_frame.py) is long work."""
    from rankwatch.exporter.hang.record import long_work_in_frames

    def frame_in(filename: str) -> Any:
        space: dict[str, Any] = {"sys": sys}
        exec(compile("def here():\n    return sys._getframe()\n", filename, "exec"), space)
        return space["here"]()

    disabled = frame_in("/site-packages/torch/_dynamo/eval_frame.py")
    assert long_work_in_frames(disabled) == ""
    compiling = frame_in("/site-packages/torch/_dynamo/convert_frame.py")
    assert long_work_in_frames(compiling) == "compile"
    assert long_work_in_frames(frame_in("/site-packages/torch/_inductor/compile_fx.py")) == (
        "compile"
    )
