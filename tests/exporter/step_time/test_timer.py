"""Step timer, hooks and RankWatch in one process (no torch.distributed).

Times are checked only from below (a sleep of s ms lasts at least s ms) or with generous upper
bounds: these machines are shared and slow, and speed is the benchmarks' business.
"""

from __future__ import annotations

import collections
import math
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.step_time import ROW_WIDTH, SIGNALS
from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.step_time.gpu_events import EventPool, GpuTimeline
from rankwatch.exporter.step_time.hooks import WatchedLoader, detect_strategy, move_to_device
from rankwatch.exporter.step_time.rank_watch import RankWatch
from rankwatch.exporter.step_time.timer import PHASES, TIMED_SIGNALS, StepTimer

CPU = {s: 1 + i for i, s in enumerate(SIGNALS)}
GPU = {s: 1 + len(SIGNALS) + i for i, s in enumerate(SIGNALS)}
SLACK_MS = 250.0  # upper-bound slack for a loaded 2-core machine


def rows_of(timer: StepTimer) -> np.ndarray:
    rows, _, lost = timer.read(0)
    assert lost == 0
    return rows


# ---- explicit API ------------------------------------------------------------------------


def test_explicit_rows_measure_what_was_timed_and_nan_the_rest() -> None:
    timer = StepTimer(16)
    for _ in range(3):
        with timer.step():
            with timer.phase("input_wait"):
                time.sleep(0.004)
            with timer.phase("forward"):
                time.sleep(0.003)
    rows = rows_of(timer)
    assert rows.shape == (3, ROW_WIDTH)
    assert rows[:, 0].tolist() == [0, 1, 2]
    assert (rows[:, CPU["input_wait"]] >= 4.0).all()
    assert (rows[:, CPU["forward"]] >= 3.0).all()
    # Never timed: absent, not zero.
    for s in ("h2d", "backward", "optimizer"):
        assert np.isnan(rows[:, CPU[s]]).all(), s
    assert np.isnan(rows[:, GPU["step"] :]).all() and np.isnan(rows[:, 7:]).all()
    # step excludes the input wait timed inside it, and still covers the forward.
    step = rows[:, CPU["step"]]
    assert (step >= 3.0).all()
    assert (step < rows[:, CPU["input_wait"]] + rows[:, CPU["forward"]]).all()


def test_measured_zero_is_not_absent() -> None:
    timer = StepTimer(4)
    with timer.step(), timer.phase("h2d"):
        pass
    row = rows_of(timer)[0]
    assert row[CPU["h2d"]] >= 0.0 and not math.isnan(row[CPU["h2d"]])


def test_repeated_phases_accumulate_and_pending_input_wait_goes_to_next_step() -> None:
    timer = StepTimer(8)
    with timer.phase("input_wait"):  # fetched before the step opens: credited to it
        time.sleep(0.005)
    with timer.step():
        for _ in range(3):  # gradient accumulation
            with timer.phase("forward"):
                time.sleep(0.002)
    row = rows_of(timer)[0]
    assert row[CPU["input_wait"]] >= 5.0
    assert row[CPU["forward"]] >= 6.0
    # The pending wait happened before the step's bracket, so nothing is subtracted for it.
    assert row[CPU["step"]] >= 6.0


def test_exception_inside_step_discards_the_row() -> None:
    timer = StepTimer(4)
    with pytest.raises(RuntimeError, match="boom"), timer.step():
        raise RuntimeError("boom")
    with timer.step():
        pass
    rows = rows_of(timer)
    assert rows[:, 0].tolist() == [0]


def test_explicit_step_ids() -> None:
    timer = StepTimer(4)
    with timer.step(10):
        pass
    with timer.step():
        pass
    assert rows_of(timer)[:, 0].tolist() == [10, 11]
    with pytest.raises(ValueError, match=r"step_id.*11"):
        timer.step(11)
    with pytest.raises(TypeError, match="step_id"):
        timer.step(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step_id"):
        timer.step(True)  # type: ignore[arg-type]


def test_bad_phase_names_and_nested_steps() -> None:
    timer = StepTimer(4)
    with pytest.raises(ValueError, match=r"name.*'step'"):
        timer.phase("step")
    with pytest.raises(ValueError, match=r"name.*'fwd'"):
        timer.phase("fwd")
    with pytest.raises(ValueError, match="name"):
        timer.phase(None)  # type: ignore[arg-type]
    with timer.step(), pytest.raises(RuntimeError, match="already open"), timer.step():
        pass


def test_bad_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        StepTimer(1)
    with pytest.raises(TypeError, match="capacity"):
        StepTimer(3.0)  # type: ignore[arg-type]


def test_ring_wraps_and_reader_counts_lost_rows() -> None:
    timer = StepTimer(8)
    for _ in range(5):
        with timer.step():
            pass
    first, cursor, lost = timer.read(0)
    assert first[:, 0].tolist() == [0, 1, 2, 3, 4] and cursor == 5 and lost == 0
    for _ in range(20):
        with timer.step():
            pass
    rows, cursor, lost = timer.read(cursor)
    # 20 new rows into a ring of 8: the reader keeps only rows the writer cannot be touching.
    assert cursor == 25
    assert lost + len(rows) == 20
    assert len(rows) == 7
    assert rows[:, 0].tolist() == list(range(18, 25))
    empty, cursor2, lost2 = timer.read(cursor)
    assert len(empty) == 0 and cursor2 == 25 and lost2 == 0


def test_a_read_the_writer_laps_counts_each_row_once() -> None:
    """The writer finishes more rows than the ring holds while a read takes its slice (the
    race the threaded test below hits now and then): those rows are counted lost once, not
    once by this read and again by the next (a fresh clone's make test failed on 20,115 rows
    read or lost of 20,000)."""
    timer = StepTimer(2)

    def write(n: int) -> None:
        for _ in range(n):
            with timer.step():
                timer.add(PHASES.index("forward"), 1_000)

    laps = [5]  # rows the writer finishes during the first slice the read takes

    class Lapped(list):  # type: ignore[type-arg]
        def __getitem__(self, index: Any) -> Any:
            got = super().__getitem__(index)
            if isinstance(index, slice) and laps[0]:
                n, laps[0] = laps[0], 0
                write(n)
            return got

    write(3)
    timer._rows = Lapped(timer._rows)
    rows, cursor, lost = timer.read(0)
    rows2, cursor2, lost2 = timer.read(cursor)
    assert laps == [0] and timer.finished == 8
    assert cursor2 == 8
    assert len(rows) + lost + len(rows2) + lost2 == 8, (len(rows), lost, len(rows2), lost2)
    assert [r[0] for r in rows2.tolist()] == [7.0]  # the newest row, as it was written


def test_reader_thread_never_sees_a_torn_or_repeated_row() -> None:
    """The background thread reads while the training thread writes and wraps a small ring:
    every row read is one the writer finished (its forward column carries its own step id),
    step ids only grow, and rows read plus rows counted lost are every row written."""
    timer = StepTimer(2)  # the smallest ring: any write during a read can replace a row
    total = 20_000
    done = threading.Event()
    seen: list[float] = []
    lost_total = 0
    bad: list[tuple[float, float]] = []

    def read_all() -> None:
        nonlocal lost_total
        cursor = 0
        while True:
            finished = done.is_set()  # read before the last poll: nothing after it is missed
            rows, cursor, lost = timer.read(cursor)
            lost_total += lost
            for row in rows.tolist():
                if not math.isclose(
                    row[CPU["forward"]], row[0] * 1e-3, rel_tol=1e-9, abs_tol=1e-12
                ):
                    bad.append((row[0], row[CPU["forward"]]))
                seen.append(row[0])
            if finished:
                return

    reader = threading.Thread(target=read_all)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as the interpreter can
    try:
        reader.start()
        for step_id in range(total):
            with timer.step():
                timer.add(PHASES.index("forward"), step_id * 1_000)  # ns: the id in us
        done.set()
        reader.join(30)
    finally:
        sys.setswitchinterval(switch)
    assert not reader.is_alive()
    assert bad == []
    assert seen == sorted(set(seen))  # strictly increasing: no row read twice
    assert len(seen) + lost_total == total
    assert seen[-1] == total - 1


# ---- GPU bookkeeping ---------------------------------------------------------------------


class HostClockEvent:
    """A timing event on the host clock whose completion the test controls.

    No GPU exists on these machines; this implements the event protocol (record / query /
    elapsed_time) so the pending-step bookkeeping of the GPU path runs for real.
    """

    device_done = True

    def __init__(self) -> None:
        self.t = 0.0
        self.recorded = 0

    def record(self) -> None:
        self.t = time.perf_counter()
        self.recorded += 1

    def query(self) -> bool:
        return HostClockEvent.device_done

    def elapsed_time(self, end: Any) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time on an unfinished event")
        return (end.t - self.t) * 1e3


def test_gpu_columns_resolve_by_polling_in_order() -> None:
    HostClockEvent.device_done = False
    try:
        pool = EventPool(64, HostClockEvent)
        timer = StepTimer(16, gpu=GpuTimeline(pool, len(TIMED_SIGNALS), 0, max_pending_steps=8))
        for _ in range(3):
            with timer.step():
                with timer.phase("input_wait"):
                    time.sleep(0.003)
                with timer.phase("forward"):
                    time.sleep(0.002)
        # The "device" has not passed the markers: CPU columns written, rows not finished.
        assert timer.written == 3 and timer.finished == 0
        assert len(rows_of(timer)) == 0
        HostClockEvent.device_done = True
        assert timer.poll_gpu() == 3
        rows = rows_of(timer)
        assert len(rows) == 3
        assert (rows[:, GPU["input_wait"]] >= 3.0).all()
        assert (rows[:, GPU["forward"]] >= 2.0).all()
        assert np.isnan(rows[:, GPU["backward"]]).all()
        # GPU step excludes the input wait timed inside the step, like the CPU step.
        assert (rows[:, GPU["step"]] >= 2.0).all()
        assert (rows[:, GPU["step"]] < rows[:, GPU["input_wait"]] + rows[:, GPU["forward"]]).all()
        # Every event went back to the pool.
        assert pool.in_use == 0
    finally:
        HostClockEvent.device_done = True


def test_gpu_pool_exhaustion_and_lagging_device_stay_bounded() -> None:
    HostClockEvent.device_done = False
    try:
        pool = EventPool(6, HostClockEvent)
        timer = StepTimer(64, gpu=GpuTimeline(pool, len(TIMED_SIGNALS), 0, max_pending_steps=4))
        for _ in range(20):
            with timer.step(), timer.phase("forward"):
                pass
        assert pool.created <= 6
        # Steps the device lagged on were finished without GPU times, keeping the queue short.
        assert timer.gpu is not None and timer.gpu.pending <= 5
        timer.drain_gpu(0.01)
        assert timer.finished == timer.written == 20
        rows = rows_of(timer)
        assert np.isnan(rows[:, GPU["forward"]]).all()
        assert not np.isnan(rows[:, CPU["forward"]]).any()
    finally:
        HostClockEvent.device_done = True


def test_event_pool_bad_input() -> None:
    with pytest.raises(ValueError, match="capacity"):
        EventPool(1, HostClockEvent)
    with pytest.raises(TypeError, match="capacity"):
        EventPool("8", HostClockEvent)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="factory"):
        EventPool(8, None)  # type: ignore[arg-type]


# ---- hooks ---------------------------------------------------------------------------------


FWD_S, IW_S, H2D_S, BWD_S, OPT_S = 0.006, 0.004, 0.003, 0.005, 0.002


class SlowBatch:
    """A batch whose host-to-device move takes time (the H2D under test on a CPU box)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def to(self, device: torch.device, non_blocking: bool = False) -> SlowBatch:
        time.sleep(H2D_S)
        return SlowBatch(self.x.to(device), self.y.to(device))


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BWD_S)
        return grad


class SlowModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FWD_S)
        return self.lin(SlowBackward.apply(x.requires_grad_()))


class SlowSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(OPT_S)
        return super().step(closure)


class SlowLoader:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        for _ in range(self.n):
            time.sleep(IW_S)
            yield SlowBatch(torch.randn(4, 8), torch.randn(4, 1))


def single_config(**overrides: Any) -> RankwatchConfig:
    # Every step shipped: these tests count steps from the first one.
    base: dict[str, Any] = {
        "interval_seconds": 0.2,
        "gather_timeout_seconds": 2.0,
        "warmup_steps": 0,
    }
    base.update(overrides)
    return RankwatchConfig.from_env(env={}, **base)


def explicit_rows(n: int) -> np.ndarray:
    model = SlowModel()
    opt = SlowSGD(model.parameters(), lr=0.01)
    rw = RankWatch(config=single_config())
    it = iter(SlowLoader(n))
    for _ in range(n):
        with rw.step():
            with rw.phase("input_wait"):
                batch = next(it)
            with rw.phase("h2d"):
                batch = batch.to(torch.device("cpu"))
            with rw.phase("forward"):
                loss = torch.nn.functional.mse_loss(model(batch.x), batch.y)
            with rw.phase("backward"):
                loss.backward()
            with rw.phase("optimizer"):
                opt.step()
            opt.zero_grad()
    assert rw.timer is not None
    rows = rows_of(rw.timer)
    rw.close(2.0)
    return rows


def watched_rows(n: int) -> tuple[np.ndarray, RankWatch]:
    model = SlowModel()
    opt = SlowSGD(model.parameters(), lr=0.01)
    rw = RankWatch(config=single_config())
    loader = rw.watch(model, opt, SlowLoader(n))
    assert isinstance(loader, WatchedLoader) and len(loader) == n and loader.n == n
    for batch in loader:
        loss = torch.nn.functional.mse_loss(model(batch.x), batch.y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        # Evaluation between steps is not a training step and must not leak into one.
        with torch.no_grad():
            model.eval()
            model(batch.x)
            model.train()
    assert rw.timer is not None
    rows = rows_of(rw.timer)
    rw.close(2.0)
    return rows, rw


def test_watch_on_a_plain_model_gives_the_explicit_rows() -> None:
    n = 6
    ex = explicit_rows(n)
    wa, rw = watched_rows(n)
    assert rw.strategy is None  # a plain module: no wrapper, the diagnosis uses DDP rules
    assert ex.shape == wa.shape == (n, ROW_WIDTH)
    assert ex[:, 0].tolist() == wa[:, 0].tolist() == list(range(n))
    # Same signals measured (all six on the CPU clock), none on the GPU clock; the hooks also
    # time the CPU clock's waits of a plain module (none here: 0 before forward, and the short
    # stretch after the last gradient), which explicit phases leave absent.
    waits = [column("cpu", "forward_wait"), column("cpu", "backward_wait")]
    others = [c for c in range(ROW_WIDTH) if c not in waits]
    assert np.array_equal(np.isnan(ex[:, others]), np.isnan(wa[:, others]))
    assert np.isnan(ex[:, waits]).all() and not np.isnan(wa[:, waits]).any()
    assert (wa[:, waits[0]] == 0.0).all()
    assert not np.isnan(wa[:, 1:7]).any() and np.isnan(wa[:, 7:13]).all()
    floors = {
        "input_wait": IW_S,
        "h2d": H2D_S,
        "forward": FWD_S,
        "backward": BWD_S,
        "optimizer": OPT_S,
        "step": H2D_S + FWD_S + BWD_S + OPT_S,
    }
    for rows in (ex, wa):
        for signal, floor_s in floors.items():
            col = rows[:, CPU[signal]]
            assert (col >= floor_s * 1e3).all(), (signal, col)
            assert (col < floor_s * 1e3 + SLACK_MS).all(), (signal, col)
    # The two ways agree closely on each phase (medians over the steps).
    for signal in floors:
        diff = abs(np.median(ex[:, CPU[signal]]) - np.median(wa[:, CPU[signal]]))
        assert diff < 50.0, (signal, diff)


def test_watched_loader_that_runs_out_leaves_no_row() -> None:
    rw = RankWatch(config=single_config())
    loader = rw.watch(dataloader=[torch.zeros(1)] * 2)
    assert rw.timer is not None
    seen = 0
    for _ in loader:
        seen += 1
        rw.timer.end_step()  # without an optimizer hook, the loop closes the auto step
    assert seen == 2
    assert not rw.timer.in_step
    assert rows_of(rw.timer)[:, 0].tolist() == [0, 1]
    rw.close(1.0)


def test_a_loop_that_stops_at_its_step_count_keeps_its_last_step() -> None:
    """A trainer fetches exactly its steps' batches: no next fetch closes the last step, so
    close() writes it (ending at its optimizer step); a batch that never reached the
    optimizer is no step."""
    model = SlowModel()
    opt = SlowSGD(model.parameters(), lr=0.01)
    rw = RankWatch(config=single_config())
    it = iter(rw.watch(model, opt, SlowLoader(10)))
    for _ in range(3):
        batch = next(it)
        torch.nn.functional.mse_loss(model(batch.x), batch.y).backward()
        opt.step()
        opt.zero_grad()
    assert rw.timer is not None
    timer = rw.timer
    time.sleep(0.6)  # work after the last optimizer step is not in the step written at close
    rw.close(2.0)
    rows = rows_of(timer)
    assert rows[:, 0].tolist() == [0, 1, 2]
    assert not np.isnan(rows[2, CPU["optimizer"]])
    assert rows[2, CPU["step"]] < (H2D_S + FWD_S + BWD_S + OPT_S) * 1e3 + SLACK_MS < 600.0

    rw = RankWatch(config=single_config())
    it = iter(rw.watch(model, opt, SlowLoader(10)))
    batch = next(it)
    model(batch.x)  # left before the optimizer: discarded
    assert rw.timer is not None
    timer = rw.timer
    rw.close(2.0)
    assert rows_of(timer).shape[0] == 0


def test_explicit_step_adopts_the_step_the_loader_opened() -> None:
    rw = RankWatch(config=single_config())
    loader = rw.watch(dataloader=SlowLoader(3))
    for batch in loader:  # the fetch happens before the with block...
        with rw.step(), rw.phase("forward"):
            batch.x.sum()
    assert rw.timer is not None
    rows = rows_of(rw.timer)
    # ...and still counts as the step's input wait, like the loader wrapper alone would.
    assert rows[:, 0].tolist() == [0, 1, 2]
    assert (rows[:, CPU["input_wait"]] >= IW_S * 1e3).all()
    # Without a model there is no device to move batches to: no h2d is timed.
    assert np.isnan(rows[:, CPU["h2d"]]).all()
    rw.close(1.0)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")


class FailOnce(torch.nn.Module):
    """Identity whose backward fails the first time: after the output's gradient exists."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            self.fail = False
            x = FailingBackward.apply(x.requires_grad_())
        return self.lin(x)


def test_a_failed_backward_does_not_stop_backward_timing() -> None:
    from rankwatch.exporter.step_time.hooks import install

    timer = StepTimer(8)
    model = FailOnce()
    install(timer, model, [])
    x = torch.randn(2, 4)
    with timer.step():
        out = model(x)
        with pytest.raises(RuntimeError, match="backward failed"):
            out.sum().backward()
    with timer.step():
        model(x).sum().backward()
    rows = rows_of(timer)
    assert len(rows) == 2
    assert not math.isnan(rows[1, CPU["backward"]])
    assert not math.isnan(rows[1, CPU["forward"]])


def test_move_to_device_walks_structures() -> None:
    cpu = torch.device("cpu")
    batch = {"a": torch.zeros(2), "b": [torch.ones(1), (torch.ones(1), 3)], "c": "text"}
    moved = move_to_device(batch, cpu)
    assert moved["c"] == "text" and moved["b"][1][1] == 3
    assert isinstance(moved["b"][1], tuple) and moved["a"].device == cpu


def test_detect_strategy_plain_module() -> None:
    assert detect_strategy(torch.nn.Linear(2, 2)) is None


# ---- RankWatch in one process --------------------------------------------------------------


class Recorder:
    """A real publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.reports: list[WindowReport] = []
        self.closed_with: float | None = None

    def publish(self, report: WindowReport) -> None:
        self.reports.append(report)

    def close(self, timeout_seconds: float) -> None:
        self.closed_with = timeout_seconds


def test_single_process_live_windows_and_summary() -> None:
    rec = Recorder()
    rw = RankWatch(config=single_config(async_mode=False, sync_step=5), publishers=[rec])
    assert rw.is_root and rw.ranks == (0,)
    for _ in range(10):
        with rw.step():
            with rw.phase("input_wait"):
                pass
            with rw.phase("forward"):
                time.sleep(0.001)
            with rw.phase("backward"):
                time.sleep(0.001)
        rw.collect()
    deadline = time.monotonic() + 10
    while len(rec.reports) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    rw.close(3.0)
    kinds = [r.window_kind for r in rec.reports]
    assert kinds[:2] == ["live", "live"] and kinds[-1] == "summary"
    assert rec.reports[-1].step_time is not None
    assert rec.reports[-1].step_time.step_range == (0, 9)
    assert rec.reports[-1].ranks[0].rank == 0 and rec.reports[-1].ranks[0].hostname
    assert [r.window_index for r in rec.reports] == list(range(len(rec.reports)))
    assert rw.latest_report is rec.reports[-1]
    assert rec.closed_with is not None and rec.closed_with > 0
    rw.close(1.0)  # idempotent


def test_disabled_rankwatch_is_inert() -> None:
    rw = RankWatch(config=single_config(enabled=False))
    assert not rw.active and rw.timer is None
    with rw.step(), rw.phase("forward"):
        pass
    data = [1, 2]
    assert rw.watch(torch.nn.Linear(1, 1), None, data) is data
    rw.collect()
    assert rw.latest_report is None
    with pytest.raises(ValueError, match="name"):
        rw.phase("nope")
    rw.close(1.0)


def test_rankwatch_bad_input() -> None:
    cfg = single_config()
    with pytest.raises(TypeError, match="config"):
        RankWatch(config={"async_mode": True})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        RankWatch(strategy="zero3", config=cfg)
    with pytest.raises(TypeError, match="strategy"):
        RankWatch(strategy=3, config=cfg)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="publishers"):
        RankWatch(config=cfg, publishers=[object()])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="publishers"):
        RankWatch(config=cfg, publishers="prom")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gpu_timing"):
        RankWatch(config=cfg, gpu_timing="yes")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="gpu_timing"):
            RankWatch(config=cfg, gpu_timing=True)
    with pytest.raises(ValueError, match="group"):
        RankWatch(group=[0, 1], config=cfg)  # no torch.distributed: only [0] exists
    with pytest.raises(TypeError, match="group"):
        RankWatch(group="world", config=cfg)
    with pytest.raises(TypeError, match="group"):
        RankWatch(group=True, config=cfg)
    rw = RankWatch(config=cfg)
    try:
        with pytest.raises(TypeError, match="model"):
            rw.watch(model="net")
        with pytest.raises(TypeError, match="optimizer"):
            rw.watch(optimizer=[object()])
        with pytest.raises(TypeError, match="dataloader"):
            rw.watch(dataloader=3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="dataloader"):
            rw.watch(dataloader="abc")
        model = torch.nn.Linear(1, 1)
        rw.watch(model)
        with pytest.raises(ValueError, match="already watched"):
            rw.watch(model)
        with pytest.raises(ValueError, match="name"):
            rw.phase("warmup")
        with pytest.raises(TypeError, match="step_id"):
            rw.step("1")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout_seconds"):
            rw.close(0)
        with pytest.raises(ValueError, match="timeout_seconds"):
            rw.close(float("nan"))
        with pytest.raises(TypeError, match="timeout_seconds"):
            rw.close("5")  # type: ignore[arg-type]
    finally:
        rw.close(1.0)


def test_optimizer_subclass_calling_super_step_is_timed_once_from_the_outer_call() -> None:
    # Instantiating the base class first makes torch wrap SGD.step too, so SlowSGD.step's
    # super().step() fires the instance's hooks a second time, nested inside the first.
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    model = torch.nn.Linear(4, 4)
    opt = SlowSGD(model.parameters(), lr=0.01)
    rw = RankWatch(config=single_config())
    rw.watch(model, opt)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    rows = rows_of(rw.timer)
    rw.close(2.0)
    optimizer_ms = rows[:, CPU["optimizer"]]
    assert len(optimizer_ms) == 3
    assert (optimizer_ms >= OPT_S * 1e3).all(), optimizer_ms


def test_a_batch_already_on_the_device_is_returned_itself() -> None:
    # A CPU model's batch is neither rebuilt nor copied: same object, same type.
    cpu = torch.device("cpu")
    Pair = collections.namedtuple("Pair", "x y")
    for batch in (
        torch.zeros(2),
        (torch.zeros(2), torch.ones(1)),
        [torch.zeros(2), "text", 3],
        {"a": torch.zeros(2), "b": [torch.ones(1)]},
        Pair(torch.zeros(2), torch.ones(1)),
    ):
        assert move_to_device(batch, cpu) is batch
    # A tensor elsewhere (the meta device stands in for an accelerator) is still moved.
    moved = move_to_device((torch.zeros(2), torch.empty(2, device="meta")), torch.device("meta"))
    assert all(t.device.type == "meta" for t in moved)


class TupleOut(torch.nn.Module):
    """Returns a tuple whose first tensor is a leaf parameter (no autograd node)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.w, {"y": self.lin(x)}


@pytest.mark.parametrize("use", ["leaf", "nested"])
def test_backward_is_timed_from_any_output_tensor(use: str) -> None:
    # The backward start hooks an output's autograd node, or the tensor itself for a leaf.
    from rankwatch.exporter.step_time.hooks import install

    timer = StepTimer(8)
    model = TupleOut()
    install(timer, model, [])
    for _ in range(2):
        with timer.step():
            w, rest = model(torch.randn(3, 2))
            (w.sum() if use == "leaf" else rest["y"].sum()).backward()
    rows = rows_of(timer)
    assert len(rows) == 2
    assert not np.isnan(rows[:, CPU["backward"]]).any()
    assert (rows[:, CPU["backward"]] >= 0).all()
