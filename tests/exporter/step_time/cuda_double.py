"""A CUDA double with streams, stream waits and a test clock: enough of CUDA's rules to check
the GPU clock's logic on a machine without a GPU.

What it enforces, as CUDA does:

* every stream runs its work in order: a kernel starts when the stream is free and the host has
  launched it, an event recorded on a stream completes when the stream reaches it (so its
  time is that moment), ``wait_event`` makes the stream's later work wait for the event's
  last record as of the call, ``wait_stream`` for the other stream's work launched so far;
* the device advances only with the test clock (:meth:`Device.advance`, milliseconds): the
  host launching work never waits for the device, and ``query()`` says whether the clock
  has passed an event;
* an event belongs to the device of the stream it was first recorded on, recording it on a
  stream of another device raises; ``elapsed_time`` needs both events recorded, completed
  and on one device, else raises (CUDA's "not ready" / "device mismatch");
* recording an event on a stream that is being captured into a graph raises;
* any host synchronisation (``synchronize`` of an event, a stream or the device) fails the
  test: the GPU clock must never block the host.

Faults: ``Device.fail`` names calls (``record``, ``query``, ``elapsed_time``) that raise a
device error until cleared.

Each stream keeps its queue as the completion time of the last item enqueued: streams are in
order, so that time is what the next item waits for (the queue's items need no other state).
"""

from __future__ import annotations

from typing import Any


class HostSync(AssertionError):
    """The code under test synchronised with the device (it must never block)."""


class DeviceError(RuntimeError):
    """A CUDA error raised by a call the test chose to fail."""


class Device:
    """One machine's test clock and its CUDA devices' shared state."""

    def __init__(self) -> None:
        self.now_ms = 0.0  # the test clock: host and device time
        self.fail: set[str] = set()
        self.records = 0  # every event record (the per-step cost counts them)
        self.capturing: set[int] = set()  # ids of streams being captured

    def advance(self, ms: float) -> None:
        """Let ``ms`` of host time pass (the device runs meanwhile)."""
        self.now_ms += ms

    def stream(self, device: int = 0) -> FakeStream:
        return FakeStream(self, device)

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def work_event(self) -> FakeEvent:
        """An event of the simulated job itself (a collective's): never fails."""
        return FakeEvent(self, faults=False)

    def is_current_stream_capturing(self) -> bool:
        return bool(self.capturing)

    def synchronize(self) -> None:
        raise HostSync("torch.cuda.synchronize() called: the host would block on the device")

    def check(self, call: str) -> None:
        if call in self.fail:
            raise DeviceError(f"CUDA error: an illegal memory access was encountered ({call})")


class FakeStream:
    """An in-order queue of work on one device."""

    def __init__(self, machine: Device, device: int) -> None:
        self.machine = machine
        self.device = device
        self.free_at_ms = 0.0  # completion time of the last item enqueued

    def _next_start(self) -> float:
        # An item starts once the stream is free and the host has launched it.
        return max(self.free_at_ms, self.machine.now_ms)

    def launch(self, ms: float) -> None:
        """Enqueue a kernel of ``ms`` milliseconds."""
        self.free_at_ms = self._next_start() + ms

    def wait_event(self, event: FakeEvent) -> None:
        """Later work waits for the event's last record (a never-recorded event: no wait)."""
        if event.at_ms is not None:
            self.free_at_ms = max(self._next_start(), event.at_ms)

    def wait_stream(self, other: FakeStream) -> None:
        self.free_at_ms = max(self._next_start(), other.free_at_ms)

    def query(self) -> bool:
        return self.machine.now_ms >= self.free_at_ms

    def synchronize(self) -> None:
        raise HostSync("Stream.synchronize() called: the host would block on the device")

    def capture(self) -> _Capture:
        """Context manager: this stream is being captured into a graph."""
        return _Capture(self)


class _Capture:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    def __enter__(self) -> _Capture:
        self.stream.machine.capturing.add(id(self.stream))
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.machine.capturing.discard(id(self.stream))


class FakeEvent:
    """A timing event: ``record``/``query``/``elapsed_time`` with CUDA's rules."""

    def __init__(self, machine: Device, faults: bool = True) -> None:
        self.machine = machine
        self.faults = faults
        self.device: int | None = None
        self.at_ms: float | None = None  # when the stream reaches the last record

    def record(self, stream: Any = None) -> None:
        machine = self.machine
        if self.faults:
            machine.check("record")
        if not isinstance(stream, FakeStream):
            raise TypeError("record: the double needs an explicit stream (the model's)")
        if id(stream) in machine.capturing:
            raise RuntimeError(
                "CUDA error: operation not permitted when stream is capturing "
                "(a timing event recorded during graph capture)"
            )
        if self.device is not None and self.device != stream.device:
            raise RuntimeError(
                f"Event device {self.device} does not match recording stream's device "
                f"{stream.device}"
            )
        self.device = stream.device
        machine.records += self.faults
        stream.free_at_ms = stream._next_start()
        self.at_ms = stream.free_at_ms

    def query(self) -> bool:
        if self.faults:
            self.machine.check("query")
        return self.at_ms is None or self.machine.now_ms >= self.at_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        self.machine.check("elapsed_time")
        if self.at_ms is None or end.at_ms is None:
            raise RuntimeError("elapsed_time: both events must be recorded")
        if self.device != end.device:
            raise RuntimeError("Both events must be recorded on the same device")
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")
        return end.at_ms - self.at_ms

    def synchronize(self) -> None:
        raise HostSync("Event.synchronize() called: the host would block on the device")

    def wait(self, stream: FakeStream) -> None:
        stream.wait_event(self)
