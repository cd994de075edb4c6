"""Per-step CPU-side cost of the GPU clock (event records for phases and sync waits), side by
side with the CPU-only path in the same run.

No GPU here, so two stand-ins with the GPU path's call pattern (``record`` on the model
device's stream, ``query`` when polling, ``elapsed_time`` once the device has passed):

* events that do nothing: the figure is rankwatch's own bookkeeping around the events (the
  pool, the pairs, the nesting rule, the last-gradient marker, the capture check, polling,
  writing the GPU columns);
* the CUDA double of the tests (``tests/exporter/step_time/cuda_double.py``), which keeps
  CUDA's rules in Python (its own calls cost more than the bookkeeping).

A real ``cudaEventRecord`` costs the host a few microseconds per record; the record count per
step is given so that cost can be added (records x the device's record cost).

One DDP-shaped step: input wait and H2D (loader), forward with DDP's forward wait, backward
with one post-accumulate-grad mark per parameter (``PARAMS``) and the trailing wait, two
collectives timed as sync waits, the optimizer, the step's close and one poll. The CPU-only
timer runs the same calls; blocks of both alternate (interleaved repetitions).

Usage: ``python -m bench.run_all --only bench_gpu_clock``.
"""

from __future__ import annotations

import time
from typing import Any

from bench.bench_hot_path import _row

REPEATS = 9
STEPS = 2_000
PARAMS = 16  # parameters with a gradient hook (a small model; DDP marks each)
SYNC_WAITS = 2  # collectives the loop runs per step, timed as sync waits
# Per-step extra of the GPU path's bookkeeping over the CPU-only one: about 2.5 us per record,
# the order of what the CUDA driver itself takes the host per cudaEventRecord.
TARGET_US = 50.0


class _NullEvent:
    """An event that costs nothing: what remains is rankwatch's own work."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


def _timer(gpu: str) -> tuple[Any, Any]:
    """A timer on the CPU clock only (``gpu=""``), or with the GPU clock on ``"null"``
    events or on the ``"double"``'s."""
    from rankwatch.exporter.step_time.gpu_events import EventPool, GpuTimeline
    from rankwatch.exporter.step_time.timer import (
        BACKWARD_WAIT,
        FORWARD_WAIT,
        TIMED_SIGNALS,
        StepTimer,
    )
    from tests.exporter.step_time.cuda_double import Device

    device = Device()
    timer = StepTimer(4096)
    if gpu:
        stream = device.stream(0)
        timer.set_gpu(
            GpuTimeline(
                EventPool(64 * 40, device.event if gpu == "double" else _NullEvent),
                len(TIMED_SIGNALS),
                0,
                64,
                stream=lambda: stream,
                device=0,
                capturing=device.is_current_stream_capturing,
                wait_signals=(FORWARD_WAIT, BACKWARD_WAIT),
            )
        )
    return timer, device


def _steps_us(timer: Any, device: Any, n: int) -> float:
    """Mean microseconds of one DDP-shaped step's bookkeeping over ``n`` steps."""
    from rankwatch.exporter.step_time.timer import (
        BACKWARD,
        FORWARD,
        FORWARD_WAIT,
        H2D,
        INPUT_WAIT,
        OPTIMIZER,
    )

    params = [object() for _ in range(PARAMS)]
    wait = timer.sync_wait()
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(n):
        timer.start_step()
        timer.begin(INPUT_WAIT)
        timer.end(INPUT_WAIT)
        timer.begin(H2D)
        timer.end(H2D)
        timer.begin(FORWARD)
        timer.begin(FORWARD_WAIT)
        timer.end(FORWARD_WAIT)
        timer.end(FORWARD)
        timer.begin(BACKWARD)
        last = 0
        for p in params:
            last = timer.last_grad(p)
        timer.add_backward_wait(clock() - last)
        timer.end(BACKWARD)
        for _ in range(SYNC_WAITS):
            with wait:
                pass
        timer.begin(OPTIMIZER)
        timer.end(OPTIMIZER)
        timer.end_step()
        device.advance(1.0)  # the device keeps up: each step's events resolve on a poll
    return (clock() - t0) / n / 1e3


def run() -> list[dict[str, Any]]:
    """Rows: per-step CPU cost with the GPU clock on (double events) vs CPU only; records per
    step."""
    timers = {kind: _timer(kind) for kind in ("", "null", "double")}
    for timer, device in timers.values():
        _steps_us(timer, device, 200)  # warm-up: the pool fills
    us: dict[str, list[float]] = {kind: [] for kind in timers}
    records = 0.0
    double = timers["double"][1]
    for _ in range(REPEATS):
        for kind, (timer, device) in timers.items():
            before = double.records
            us[kind].append(_steps_us(timer, device, STEPS))
            if kind == "double":
                records = (double.records - before) / STEPS
    cpu = us[""]
    extra = [g - c for g, c in zip(us["null"], cpu, strict=True)]
    return [
        _row("DDP-shaped step, CPU clock only, per step", None, cpu, "us", cpu),
        _row("extra of the GPU clock's bookkeeping (null events)", TARGET_US, extra, "us", cpu),
        _row(
            "DDP-shaped step, GPU clock on the CUDA double, per step", None, us["double"], "us", cpu
        ),
        {
            "name": "event records per step (phases, step, waits)",
            "target": None,
            "median": records,
            "spread": 0.0,
            "unit": "records",
            "baseline": None,
            "ratio": None,
        },
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
