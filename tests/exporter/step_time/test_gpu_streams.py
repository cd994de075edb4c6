"""Sync waits on the GPU clock, against the CUDA double with streams (:mod:`.cuda_double`).

A rank's step runs on a compute stream; its collectives on a communication stream. The timer
is the real one; only CUDA is the double. Times in ms of the double's test clock.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from rankwatch.diagnosis.step_time import diagnose_arrays
from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.step_time.gpu_events import EventPool, GpuTimeline
from rankwatch.exporter.step_time.timer import (
    BACKWARD,
    BACKWARD_WAIT,
    FORWARD,
    FORWARD_WAIT,
    TIMED_SIGNALS,
    StepTimer,
)
from tests.exporter.step_time.cuda_double import Device, FakeEvent, FakeStream, HostSync

FWD_MS, BWD_PER_PARAM_MS, ALLREDUCE_MS, OPT_MS = 10.0, 5.0, 2.0, 3.0
PARAMS = ("w1", "b1", "w2", "b2")  # the autograd order of gradients: the last one is b2


class Rank:
    """One rank: a timer on the double, its compute and communication streams."""

    def __init__(self, device: Device, capacity: int = 256, max_errors: int = 3) -> None:
        self.device = device
        self.compute = device.stream(0)
        self.comm = device.stream(0)
        self.pool = EventPool(capacity, device.event)
        self.gpu = GpuTimeline(
            self.pool,
            len(TIMED_SIGNALS),
            0,
            64,
            stream=lambda: self.compute,
            device=0,
            capturing=device.is_current_stream_capturing,
            wait_signals=(FORWARD_WAIT, BACKWARD_WAIT),
            max_errors=max_errors,
        )
        self.timer = StepTimer(256, gpu=self.gpu)

    def collective(self, ms: float) -> FakeEvent:
        """Launch a collective that takes ``ms`` on the communication stream once the compute
        stream reached this point (NCCL's stream waits for the inputs); returns its event."""
        ready = self.device.work_event()
        ready.record(self.compute)
        self.comm.wait_event(ready)
        self.comm.launch(ms)
        done = self.device.work_event()
        done.record(self.comm)
        return done

    def ddp_step(self, *, peer_late_ms: float = 0.0, order: tuple[str, ...] = PARAMS) -> None:
        """A DDP step: forward with a buffer broadcast in DDP's pre-forward, backward whose
        last bucket's all-reduce the compute stream waits for at the end (``Work.wait()``),
        the optimizer. The peer arrives ``peer_late_ms`` late at both collectives."""
        t, c = self.timer, self.compute
        t.start_step()
        t.begin(FORWARD)
        t.begin(FORWARD_WAIT)  # DDP's wrapper pre hook
        broadcast = self.collective(ALLREDUCE_MS + peer_late_ms)
        c.wait_event(broadcast)
        t.end(FORWARD_WAIT)  # the module's pre hook
        c.launch(FWD_MS)
        t.end(FORWARD)
        self.ddp_backward(ALLREDUCE_MS + peer_late_ms, order)
        t.begin(4)  # optimizer
        c.launch(OPT_MS)
        t.end(4)
        t.end_step()

    def ddp_backward(self, allreduce_ms: float, order: tuple[str, ...] = PARAMS) -> None:
        """DDP's backward: a gradient per parameter (its post-accumulate-grad hook), then the
        compute stream waits for the last bucket's all-reduce (the reducer's finalize)."""
        t, c = self.timer, self.compute
        t.begin(BACKWARD)
        last = -1
        for name in order:
            c.launch(BWD_PER_PARAM_MS)
            last = t.last_grad(name)
        c.wait_event(self.collective(allreduce_ms))
        t.add_backward_wait(t._clock() - last)
        t.end(BACKWARD)

    def collective_step(self, *, peer_late_ms: float, overlap_ms: float) -> None:
        """A step with a collective the loop runs (timed through ``sync_wait``, as every
        collective the timer sees is): launched, ``overlap_ms`` of compute, then its wait."""
        t, c = self.timer, self.compute
        t.start_step()
        with t.phase("forward"):
            c.launch(FWD_MS)
            work = self.collective(ALLREDUCE_MS + peer_late_ms)
            c.launch(overlap_ms)
            with t.sync_wait():
                c.wait_event(work)
        t.end_step()

    def rows(self) -> np.ndarray:
        self.device.advance(10_000.0)  # the device catches up
        self.timer.poll_gpu(1 << 20)
        rows, _, _ = self.timer.read(0)
        return rows


def gpu(rows: np.ndarray, signal: str) -> np.ndarray:
    return rows[:, column("gpu", signal)]


def test_a_collective_wait_is_the_time_the_compute_stream_sat_behind_it() -> None:
    rank = Rank(Device())
    rank.collective_step(peer_late_ms=30.0, overlap_ms=5.0)  # waits 2 + 30 - 5
    rank.collective_step(peer_late_ms=0.0, overlap_ms=5.0)  # control: done already
    rank.collective_step(peer_late_ms=0.0, overlap_ms=1.0)  # control: 1 ms of the collective
    rows = rank.rows()
    np.testing.assert_allclose(gpu(rows, "forward_wait"), [27.0, 0.0, 1.0])
    # The wait is inside forward: forward holds it, and compute is forward minus the wait.
    np.testing.assert_allclose(
        gpu(rows, "forward"), [FWD_MS + 5.0 + 27.0, FWD_MS + 5.0, FWD_MS + 1.0 + 1.0]
    )
    assert np.isnan(gpu(rows, "backward_wait")).all()


def test_a_ddp_step_gives_the_device_side_waits() -> None:
    rank = Rank(Device())
    for late in (0.0, 0.0, 40.0, 0.0):
        rank.ddp_step(peer_late_ms=late)
    rows = rank.rows()
    # The broadcast: the stream waits for all of it (nothing overlaps it).
    np.testing.assert_allclose(gpu(rows, "forward_wait"), [2.0, 2.0, 42.0, 2.0])
    # The trailing wait: from the last gradient to the end of backward. The first pass learns
    # which parameter's gradient comes last: its wait is absent, not a value holding compute.
    bww = gpu(rows, "backward_wait")
    assert math.isnan(bww[0])
    np.testing.assert_allclose(bww[1:], [2.0, 42.0, 2.0])
    np.testing.assert_allclose(gpu(rows, "backward")[1:], [22.0, 62.0, 22.0])
    assert rank.gpu.relearned_passes == 1
    # One marker per pass for the last gradient, not one per parameter.
    assert rank.device.records < 4 * (2 * 7 + 2 * len(PARAMS))


def test_a_changed_gradient_order_leaves_that_pass_absent_then_relearns() -> None:
    rank = Rank(Device())
    rank.ddp_step()
    rank.ddp_step()
    rank.ddp_step(order=("w1", "b1", "b2", "w2"))  # b2 is no longer last: w2 is
    rank.ddp_step(order=("w1", "b1", "b2", "w2"))
    bww = gpu(rank.rows(), "backward_wait")
    assert math.isnan(bww[0]) and bww[1] == pytest.approx(2.0)
    assert math.isnan(bww[2])  # the marked gradient (b2) was not the last: absent
    assert bww[3] == pytest.approx(2.0)  # relearned (w2)


def two_ranks_ddp(slow_rank: int, extra_fwd_ms: float, steps: int) -> dict[int, np.ndarray]:
    """Two ranks in lockstep: ``slow_rank`` computes ``extra_fwd_ms`` more in every forward,
    so its peer waits that long at the next collective (the gradient all-reduce)."""
    out = {}
    for r in (0, 1):
        rank = Rank(Device())
        for _ in range(steps):
            t, c = rank.timer, rank.compute
            mine = extra_fwd_ms if r == slow_rank else 0.0
            theirs = extra_fwd_ms if r != slow_rank else 0.0
            t.start_step()
            with t.phase("input_wait"):
                pass
            t.begin(FORWARD)
            c.launch(FWD_MS + mine)
            t.end(FORWARD)
            # The all-reduce ends when the later rank arrives: the peer's extra compute.
            rank.ddp_backward(ALLREDUCE_MS + theirs)
            t.begin(FORWARD_WAIT)  # the broadcast of the next forward (nothing late there)
            t.end(FORWARD_WAIT)
            t.end_step()
            rank.device.advance(1_000.0)  # the device keeps up: events return to the pool
            t.poll_gpu()
        out[r] = rank.rows()[1:]  # the first pass learns the last gradient
    return out


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_the_rule_names_the_forward_straggler_on_the_gpu_clock(slow_rank: int) -> None:
    per_rank = two_ranks_ddp(slow_rank, 30.0, 30)
    report = diagnose_arrays(per_rank, window=100)
    assert report.clock == "gpu" and report.visible_definition == "sync_wait"
    assert report.straggler is not None and report.straggler.culprit_rank == slow_rank
    assert report.kind == "COMPUTE_STRAGGLER"
    control = diagnose_arrays(two_ranks_ddp(slow_rank, 0.0, 30), window=100)
    assert control.kind != "COMPUTE_STRAGGLER" and control.visible_definition == "sync_wait"


def test_a_wait_during_graph_capture_is_absent_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rank = Rank(Device())
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        rank.collective_step(peer_late_ms=10.0, overlap_ms=0.0)
        for _ in range(2):  # torch.compile(mode="reduce-overhead") capturing the wait
            t, c = rank.timer, rank.compute
            t.start_step()
            with t.phase("forward"):
                c.launch(FWD_MS)
                work = rank.collective(ALLREDUCE_MS)
                with c.capture(), t.sync_wait():
                    c.wait_event(work)
            t.end_step()
        rank.collective_step(peer_late_ms=10.0, overlap_ms=0.0)
    fww = gpu(rank.rows(), "forward_wait")
    assert fww[0] == pytest.approx(12.0) and fww[3] == pytest.approx(12.0)
    assert np.isnan(fww[1:3]).all()  # absent, never recorded inside the capture
    said = [r.getMessage() for r in caplog.records if "captured" in r.getMessage()]
    assert len(said) == 1
    assert rank.gpu.captured_marks == 2  # one start marker per step; no end without a start


def test_an_exhausted_pool_leaves_the_wait_absent_never_a_partial_sum() -> None:
    # The step's start, forward's start, the first wait's pair and the second wait's start
    # take the 5 events: the second wait gets no end marker.
    rank = Rank(Device(), capacity=5)
    t, c = rank.timer, rank.compute
    t.start_step()
    with t.phase("forward"):
        for _ in range(2):
            work = rank.collective(ALLREDUCE_MS + 5.0)
            with t.sync_wait():
                c.wait_event(work)
    t.end_step()
    rows = rank.rows()
    assert np.isnan(gpu(rows, "forward_wait")).all()
    assert rank.pool.in_use == 0


@pytest.mark.parametrize("call", ["record", "query", "elapsed_time"])
def test_a_device_error_loses_the_step_then_switches_gpu_timing_off(
    call: str, caplog: pytest.LogCaptureFixture
) -> None:
    device = Device()
    rank = Rank(device, max_errors=2)
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        rank.ddp_step()
        rank.ddp_step()
        device.advance(1_000.0)
        rank.timer.poll_gpu(64)
        device.fail.add(call)
        rank.ddp_step()  # training never sees the exception
        device.advance(1_000.0)
        rank.timer.poll_gpu(64)
        device.fail.discard(call)
        rank.ddp_step()
        device.fail.add(call)
        for _ in range(3):
            rank.ddp_step()
            device.advance(1_000.0)
            rank.timer.poll_gpu(64)
        device.fail.discard(call)
        rank.ddp_step()
    rows = rank.rows()
    assert len(rows) == 8
    assert not np.isnan(gpu(rows[:2], "forward")).any()
    assert np.isnan(gpu(rows[2:3], "forward")).all()  # the failed step: every GPU column
    assert rank.timer.gpu is None  # off after 2 errors
    assert np.isnan(gpu(rows[-1:], "step")).all()
    assert not np.isnan(rows[:, column("cpu", "step")]).any()  # the CPU clock is whole
    off = [r for r in caplog.records if "GPU timing is off" in r.getMessage()]
    assert len(off) == 1
    raised = [r for r in caplog.records if f"raised in {call}" in r.getMessage()]
    assert len(raised) == 1


def test_the_gpu_path_never_synchronises(caplog: pytest.LogCaptureFixture) -> None:
    device = Device()
    rank = Rank(device)
    for late in (0.0, 30.0) * 10:  # the device never catches up during the loop
        rank.ddp_step(peer_late_ms=late)
        rank.collective_step(peer_late_ms=late, overlap_ms=1.0)
        rank.timer.poll_gpu(8)
    assert rank.timer.finished == 0  # nothing resolved: the host never waited
    rank.timer.drain_gpu(0.01)  # shutdown with the device behind: gives up, does not block
    assert rank.timer.finished == rank.timer.written == 40
    with pytest.raises(HostSync):
        FakeStream(device, 0).synchronize()
    with pytest.raises(HostSync):
        device.event().synchronize()


def test_fsdp2_device_waits_are_timed_on_the_compute_stream() -> None:
    # A real FSDP2 model (one-rank Gloo world, in this process); the CUDA double stands in for
    # the device. As on CUDA, the host-blocking shadows are not installed (async collectives):
    # FSDP2's waits reach the GPU columns only through the device waits.
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rankwatch.exporter.step_time.device_waits import FSDP_DEVICE_WAITS, fsdp_device_waits
    from rankwatch.exporter.step_time.hooks import install
    from tests.servers import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rank = Rank(Device())
        rank.timer.async_collectives = True
        shadows = fsdp_device_waits(rank.timer, model)
        assert len(shadows) == 2 * len(FSDP_DEVICE_WAITS)  # two units
        handles = [*install(rank.timer, model, [opt]), *shadows]
        for _ in range(3):
            rank.timer.start_step()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            rank.timer.end_step()
        for handle in handles:
            handle.remove()
        rows = rank.rows()
    finally:
        dist.destroy_process_group()
    assert len(rows) == 3
    assert not np.isnan(gpu(rows, "forward_wait")).any()  # wait_for_unshard, each unit
    assert not np.isnan(gpu(rows, "backward_wait")).any()  # post_backward, finalize_backward
    assert np.isnan(rows[:, column("cpu", "forward_wait")]).all()  # the host never blocked
    group = model._get_fsdp_state()._fsdp_param_group
    assert not set(FSDP_DEVICE_WAITS) & set(vars(group))  # the methods are given back


def test_a_failed_backward_does_not_leave_later_waits_nested() -> None:
    rank = Rank(Device())
    rank.ddp_step()  # learns the last gradient
    t = rank.timer
    t.start_step()
    t.begin(BACKWARD)
    for name in PARAMS:
        t.last_grad(name)  # the marker at the last gradient is recorded
    t.abort_step()  # the pass raised before its end: no row
    rank.collective_step(peer_late_ms=10.0, overlap_ms=0.0)
    fww = gpu(rank.rows(), "forward_wait")
    assert len(fww) == 2 and fww[1] == pytest.approx(12.0)


def test_bad_timelines_are_refused_by_name() -> None:
    device = Device()
    pool = EventPool(8, device.event)
    with pytest.raises(
        ValueError, match=r"StepTimer.gpu: the timeline times 5 signals, expected 7"
    ):
        StepTimer(8, gpu=GpuTimeline(pool, 5, 0))
    with pytest.raises(ValueError, match=r"StepTimer.gpu: the timeline times 5 signals"):
        StepTimer(8).set_gpu(GpuTimeline(pool, 5, 0))
    with pytest.raises(ValueError, match=r"GpuTimeline.max_errors: must be an int >= 1, got 0"):
        GpuTimeline(pool, len(TIMED_SIGNALS), 0, max_errors=0)
    with pytest.raises(ValueError, match=r"GpuTimeline.wait_signals: \(9,\) must lie in 0..6"):
        GpuTimeline(pool, len(TIMED_SIGNALS), 0, wait_signals=(9,))
