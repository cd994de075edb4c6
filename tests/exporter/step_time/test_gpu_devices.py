"""GPU-clock logic against an event double that enforces torch's device rule.

No CUDA here: :class:`DeviceEvent` behaves as a CUDA event does where it matters. It belongs
to the device of the stream it is first recorded on, recording it on another device's stream
raises, and ``elapsed_time`` needs both events on one device. ``Cuda.current`` is the calling
thread's current device: the autograd engine runs a CUDA backward on a thread whose current
device is the model's, while the main thread of a script that never calls ``set_device``
stays on device 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest
import torch

from rankwatch.diagnosis.step_time import SIGNALS
from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.step_time.gpu_events import EventPool, GpuTimeline
from rankwatch.exporter.step_time.hooks import model_device
from rankwatch.exporter.step_time.timer import BACKWARD, FORWARD, TIMED_SIGNALS, StepTimer

GPU = {s: 1 + len(SIGNALS) + i for i, s in enumerate(SIGNALS)}


class Stream:
    def __init__(self, device: int) -> None:
        self.device = device


class Cuda:
    current = 0  # the calling "thread"'s current device


class DeviceEvent:
    """A timing event with CUDA's device rule; the device is always done."""

    def __init__(self) -> None:
        self.device: int | None = None
        self.t = 0

    def record(self, stream: Stream | None = None) -> None:
        stream = Stream(Cuda.current) if stream is None else stream
        if self.device is not None and self.device != stream.device:
            raise RuntimeError(
                f"Event device {self.device} does not match recording stream's device "
                f"{stream.device}"
            )
        self.device = stream.device
        self.t = time.perf_counter_ns()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: DeviceEvent) -> float:
        if self.device != end.device:
            raise RuntimeError("Both events must be recorded on the same device")
        return (end.t - self.t) / 1e6


def one_step(timer: StepTimer, backward_device: int) -> None:
    """A step whose backward markers are recorded from a thread on ``backward_device``."""
    timer.start_step()
    Cuda.current = 0
    timer.begin(FORWARD)
    timer.end(FORWARD)
    with timer.sync_wait():  # a collective after forward
        pass
    Cuda.current = backward_device  # the autograd device thread
    timer.begin(BACKWARD)
    last = timer.last_grad("w")  # post-accumulate-grad hooks, on that thread too
    timer.add_backward_wait(timer._clock() - last)
    timer.end(BACKWARD)
    Cuda.current = 0
    timer.end_step()


def test_the_double_enforces_the_device_rule(caplog: pytest.LogCaptureFixture) -> None:
    event = DeviceEvent()
    event.record(Stream(0))
    with pytest.raises(RuntimeError, match="does not match"):
        event.record(Stream(1))
    # Without an explicit stream (the old recording), a recycled event meets device 1: the
    # error is caught, the steps lose their GPU columns, and GPU timing switches itself off.
    timer = StepTimer(8, gpu=GpuTimeline(EventPool(8, DeviceEvent), len(TIMED_SIGNALS), 0, 2))
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        for _ in range(6):
            one_step(timer, backward_device=1)
    assert timer.gpu is None
    timer.drain_gpu(0.1)
    rows, _, _ = timer.read(0)
    assert len(rows) == 6 and np.isnan(rows[:, GPU["forward"]]).any()
    assert not np.isnan(rows[:, 1 + SIGNALS.index("forward")]).any()  # the CPU clock is whole
    off = [r for r in caplog.records if "GPU timing is off" in r.getMessage()]
    assert len(off) == 1


def test_markers_go_on_the_model_devices_stream_from_every_thread() -> None:
    stream = Stream(1)  # the model is on cuda:1; the main thread stays on cuda:0
    gpu = GpuTimeline(EventPool(32, DeviceEvent), len(TIMED_SIGNALS), 0, 2, stream=lambda: stream)
    timer = StepTimer(16, gpu=gpu)
    for _ in range(10):  # events are recycled many times over
        one_step(timer, backward_device=1)
    timer.drain_gpu(1.0)
    rows, _, _ = timer.read(0)
    assert len(rows) == 10
    assert not np.isnan(rows[:, [GPU["forward"], GPU["backward"], GPU["step"]]]).any()
    # The waits' markers too (the first pass learns its last gradient: absent there).
    assert not np.isnan(rows[:, column("gpu", "forward_wait")]).any()
    assert not np.isnan(rows[1:, column("gpu", "backward_wait")]).any()


def test_a_phase_that_could_not_be_timed_is_absent_not_a_partial_sum(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 4 events: the step's start and the first forward's pair, then the second forward's
    # start: its end (and the step's end) get none.
    pool = EventPool(4, DeviceEvent)
    timer = StepTimer(8, gpu=GpuTimeline(pool, len(TIMED_SIGNALS), 0, 2, stream=lambda: Stream(0)))
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        for _ in range(2):
            with timer.step():
                for _ in range(2):  # gradient accumulation: forward twice
                    with timer.phase("forward"):
                        time.sleep(0.001)
    timer.drain_gpu(1.0)
    rows, _, _ = timer.read(0)
    assert len(rows) == 2
    # One occurrence had no marker: the phase is absent, not the other occurrence alone.
    assert np.isnan(rows[:, GPU["forward"]]).all()
    assert (rows[:, 1 + SIGNALS.index("forward")] >= 2.0).all()  # the CPU clock is whole
    assert len([r for r in caplog.records if "ran out of events" in r.getMessage()]) == 1
    assert pool.in_use == 0


class _Spread(torch.nn.Module):
    """A model whose tensors report two CUDA devices (doubles: no CUDA here)."""

    def parameters(self, recurse: bool = True) -> Any:
        class T:
            def __init__(self, d: str) -> None:
                self.device = torch.device(d)

        return iter([T("cuda:0"), T("cuda:1")])


def test_a_model_on_several_devices_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"several devices \(cuda:0, cuda:1\)"):
        model_device(_Spread())
    bn = torch.nn.BatchNorm1d(4)
    assert model_device(bn) == torch.device("cpu")
    buffers_only = torch.nn.Module()
    buffers_only.register_buffer("b", torch.zeros(1))
    assert model_device(buffers_only) == torch.device("cpu")
    assert model_device(torch.nn.ReLU()) is None


class LaggingEvent(DeviceEvent):
    """A device that never gets past the markers."""

    def query(self) -> bool:
        return False


def test_a_lagging_device_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    pool = EventPool(64, LaggingEvent)
    gpu = GpuTimeline(pool, len(TIMED_SIGNALS), 0, 2, stream=lambda: Stream(0))
    timer = StepTimer(16, gpu=gpu)
    with caplog.at_level(logging.WARNING, logger="rankwatch"):
        for _ in range(8):
            with timer.step(), timer.phase("forward"):
                pass
    said = [r.getMessage() for r in caplog.records if "GPU timing is incomplete" in r.getMessage()]
    assert len(said) == 1 and "more than 2 steps behind" in said[0]
    assert gpu.dropped_steps >= 4
