"""GPU-clock timing of training phases: pooled CUDA events, resolved by polling, never waited on.

The step timer records a pair of events around every phase it times on the GPU clock and one
pair around the whole step. Recording an event only enqueues a marker on the current stream, so
it costs the training thread a few microseconds and never waits for the GPU. A step's GPU
times are known only once the GPU has passed its last marker; :meth:`GpuTimeline.poll` asks
each pending step's events ``query()`` (which never blocks), turns the finished ones into
milliseconds and returns the events to the :class:`EventPool` for reuse. Nothing here calls
``synchronize()``.

Everything is bounded: the pool creates at most ``capacity`` events, and a step that cannot get
an event (pool empty) or that waits too long behind the GPU is finished with its GPU columns
absent (NaN) rather than growing a queue. A phase one of whose occurrences in a step could not
get its markers is absent for that step (never a partial sum of the occurrences that could).
On a machine without CUDA this path is never switched on and the GPU columns of every row stay
NaN: the diagnosis then uses the CPU clock.

Devices. A CUDA event belongs to the device of the stream it was first recorded on, and torch
refuses to record it on another device's stream. The autograd engine runs a CUDA backward on a
per-device thread whose current device is the tensors' device, which need not be the main
thread's current device (a script that never calls ``torch.cuda.set_device``). So a timeline
records every marker on an explicit stream, the model's device's current stream, and each
device has its own pool: an event never meets a stream of another device.

Sync waits on the device. A wait for a collective is, on the compute stream, a
``wait_event`` on the communication stream's event (``Work.wait()`` of an NCCL collective,
FSDP2's ``wait_for_unshard``/``post_backward``/``finalize_backward``): the host returns at once
and the stream stalls later. A marker recorded just before that point and one just after sit
around it in stream order, ``[A][stream waits for the collective][B]``, so ``B - A`` is the
time the compute stream sat blocked behind the collective, 0 when the collective was done
already. :meth:`GpuTimeline.wait_begin`/:meth:`GpuTimeline.wait_end` place those markers (the
outermost of nested waits only). The wait after the last gradient of a DDP backward starts at
an event recorded in the post-accumulate-grad hook of the parameter whose gradient came last
in the previous pass (:meth:`GpuTimeline.grad_mark`): one record per backward pass instead of
one per parameter. Every hook still compares, so the pair is credited only when no gradient
came after the marked one; an unchanged graph runs in the same order every pass, so that is
the usual case. When another parameter's gradient arrives after the marked one, that pass's
wait is left absent (never a value that holds compute) while the timeline learns the new last
parameter.

Failures never reach training. A marker requested while a CUDA graph is being captured
(recording a timing event there is illegal) is not recorded: the phase or wait is absent for
that step. An exception from ``record``, ``query`` or ``elapsed_time`` is caught: the step's GPU
columns are absent, and after ``max_errors`` of them the timeline switches itself off
(:attr:`GpuTimeline.broken`; the timer then drops it). Each cause is named in one warning.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "DEVICE_ERRORS_BEFORE_OFF",
    "EventLike",
    "EventPool",
    "GpuTimeline",
    "cuda_capturing",
    "cuda_event_factory",
    "cuda_stream_of",
]

NAN = math.nan
log = logging.getLogger(__name__)
# Device errors (record/query/elapsed_time raising) after which GPU timing switches off; the
# default of ``RankwatchConfig.gpu_device_errors_before_off``.
DEVICE_ERRORS_BEFORE_OFF = 3
_NESTED = object()  # a wait opened inside another: the outer one's markers hold it


class EventLike(Protocol):
    """What a timing event must do: ``torch.cuda.Event(enable_timing=True)`` does all three."""

    def record(self, stream: Any = None) -> None:
        """Enqueue the marker on ``stream`` (None: the current device's current stream)."""

    def query(self) -> bool:
        """True once the device has passed the marker; never blocks."""

    def elapsed_time(self, end_event: EventLike) -> float:
        """Milliseconds from this marker to ``end_event`` (both must have completed)."""


def cuda_event_factory() -> Callable[[], EventLike]:
    """Factory of timing-enabled CUDA events (imported lazily: torch stays optional here)."""
    import torch

    def make() -> EventLike:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[return-value]

    return make


def cuda_stream_of(device: Any) -> Callable[[], Any]:
    """The current stream of ``device``, asked at each record (a ``with stream:`` block of the
    training loop is honoured), whatever the calling thread's current device is."""
    import torch

    def stream() -> Any:
        return torch.cuda.current_stream(device)

    return stream


def cuda_capturing() -> Callable[[], bool]:
    """True while the current stream is being captured into a CUDA graph (``torch.cuda.graph``,
    ``torch.compile(mode="reduce-overhead")``): no timing event may be recorded then."""
    import torch

    return torch.cuda.is_current_stream_capturing


class EventPool:
    """A bounded free list of timing events.

    ``acquire`` hands out a recycled event, or creates one while fewer than ``capacity`` exist,
    or returns None: the caller then skips GPU timing for that phase instead of allocating.
    ``release`` puts an event back once its time has been read.
    """

    def __init__(self, capacity: int, factory: Callable[[], EventLike]) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"EventPool.capacity: expected an int, got {capacity!r}")
        if capacity < 2:
            raise ValueError(f"EventPool.capacity: must be >= 2 (one pair), got {capacity!r}")
        if not callable(factory):
            raise TypeError(f"EventPool.factory: expected a callable, got {factory!r}")
        self.capacity = capacity
        self._factory = factory
        self._free: list[EventLike] = []
        self.created = 0

    @property
    def in_use(self) -> int:
        """Events handed out and not yet released."""
        return self.created - len(self._free)

    def acquire(self) -> EventLike | None:
        """A free event, a new one while under capacity, else None."""
        if self._free:
            return self._free.pop()
        if self.created < self.capacity:
            self.created += 1
            return self._factory()
        return None

    def release(self, event: EventLike) -> None:
        """Return an event whose time has been read (or that will never be read)."""
        self._free.append(event)


# (signals credited, start marker, end marker, inside the step's bracket). A phase credits
# one signal; a sync wait outside forward credits forward and forward_wait, as on the CPU.
_Pair = tuple[tuple[int, ...], EventLike, EventLike, bool]


class _PendingStep:
    """One finished step whose GPU markers the device may not have passed yet."""

    __slots__ = ("failed", "pairs", "slot", "step_pair", "untimed")

    def __init__(
        self,
        slot: int,
        pairs: list[_Pair],
        step_pair: tuple[EventLike, EventLike] | None,
        untimed: frozenset[int] = frozenset(),
        failed: bool = False,
    ) -> None:
        self.slot = slot
        self.pairs = pairs
        self.step_pair = step_pair
        self.untimed = untimed
        self.failed = failed  # a device error in the step: every GPU column absent


class GpuTimeline:
    """GPU-clock bookkeeping of the step timer (one per timer, used by the training thread).

    ``begin``/``end`` bracket a phase (``signal`` is the index into the timer's signal list),
    ``start_step``/``finish_step`` bracket a step, and ``poll`` resolves steps whose markers
    the device has passed, oldest first, writing milliseconds through ``write``. A phase that
    occurs several times in a step (gradient accumulation) is summed; if one occurrence could
    not be timed (no event left) the phase is absent for that step.

    ``stream`` returns the stream to record on (the model device's; see the module docstring);
    None records on the caller's current stream (single-device use). ``device`` names the
    device the pool's events belong to. ``capturing`` says whether a CUDA graph is being
    captured (no marker is recorded then). ``wait_signals`` are the signals whose
    ``begin``/``end`` pairs are themselves waits (DDP's forward wait): a sync wait inside one
    is nested in it.
    """

    def __init__(
        self,
        pool: EventPool,
        n_signals: int,
        input_wait_signal: int,
        max_pending_steps: int = 256,
        *,
        stream: Callable[[], Any] | None = None,
        device: Any = None,
        capturing: Callable[[], bool] | None = None,
        wait_signals: tuple[int, ...] = (),
        max_errors: int = DEVICE_ERRORS_BEFORE_OFF,
    ) -> None:
        if max_pending_steps < 1:
            raise ValueError(
                f"GpuTimeline.max_pending_steps: must be >= 1, got {max_pending_steps!r}"
            )
        if isinstance(max_errors, bool) or not isinstance(max_errors, int) or max_errors < 1:
            raise ValueError(f"GpuTimeline.max_errors: must be an int >= 1, got {max_errors!r}")
        if any(not 0 <= s < n_signals for s in wait_signals):
            raise ValueError(
                f"GpuTimeline.wait_signals: {wait_signals!r} must lie in 0..{n_signals - 1}"
            )
        self.pool = pool
        self.n_signals = n_signals
        self.input_wait_signal = input_wait_signal
        self.max_pending_steps = max_pending_steps
        self._open: list[EventLike | None] = [None] * n_signals
        self._open_inside: list[bool] = [False] * n_signals
        self._pairs: list[_Pair] = []
        self._step_start: EventLike | None = None
        self._pending: deque[_PendingStep] = deque()
        self._stream = stream
        self._capturing = capturing
        self._wait_signals = tuple(wait_signals)
        self.max_errors = max_errors
        self.device = device
        # Signals one of whose occurrences in the open step got no marker: absent this step.
        self._untimed: set[int] = set()
        # Steps finished without GPU times because the pool ran dry or the device lagged.
        self.dropped_steps = 0
        self.untimed_phases = 0  # phase or wait occurrences that got no marker
        self._warned: set[str] = set()
        self._miss = ""  # why the last marker could not be recorded
        # Open sync waits, outermost first: the start marker, None (none could be recorded)
        # or _NESTED.
        self._waits: list[Any] = []
        # The last gradient of a backward pass (see the module docstring).
        self._grad_key: object = None  # the parameter whose gradient came last, last pass
        self._grad_pass_last: object = None  # the last one seen in this pass
        self._grad_event: EventLike | None = None  # recorded at the learned last parameter
        self._grad_late = False  # a gradient came after the learned last one in this pass
        self._grad_missed = False  # the learned last parameter's marker could not be recorded
        self.relearned_passes = 0  # passes whose trailing wait was absent (order learned)
        self._step_failed = False
        self.errors = 0  # device errors caught
        self.captured_marks = 0  # markers not recorded because a graph was being captured
        self.broken = False  # switched off after max_errors device errors

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _record(self) -> EventLike | None:
        """A recorded marker, or None (``_miss`` says why); never raises."""
        # Called for every marker on the training thread: the usual path is one capture query,
        # a pop from the free list and the record, with no further call.
        if self.broken:
            self._miss = "off"
            return None
        capturing, stream = self._capturing, self._stream
        try:
            if capturing is not None and capturing():
                self.captured_marks += 1
                self._miss = "capture"
                return None
        except Exception as exc:  # the capture query itself failed: a device error
            self._device_error("is_current_stream_capturing", exc)
            self._miss = "error"
            return None
        free = self.pool._free
        event = free.pop() if free else self.pool.acquire()
        if event is None:
            self._miss = "pool"
            return None
        try:
            if stream is None:
                event.record()
            else:
                event.record(stream())
        except Exception as exc:
            self.pool.release(event)  # the next record of it overwrites whatever it holds
            self._device_error("record", exc)
            self._miss = "error"
            return None
        return event

    def _device_error(self, call: str, exc: Exception) -> None:
        self.errors += 1
        self._step_failed = True
        self._warn_once("error", f"the device raised in {call} ({type(exc).__name__}: {exc})")
        if self.errors >= self.max_errors and not self.broken:
            self.broken = True
            log.warning(
                "rankwatch: GPU timing is off after %d device errors; steps are timed on "
                "the CPU clock",
                self.errors,
            )

    def _warn_once(self, reason: str, why: str) -> None:
        # One warning per cause and timeline, naming why GPU times are missing; the rest are
        # counted.
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning(
                "rankwatch: GPU timing is incomplete: %s; those steps lack GPU times and "
                "windows holding them use the CPU clock",
                why,
            )

    def _lost(self, signal: int) -> None:
        self._untimed.add(signal)
        self.untimed_phases += 1
        if self._miss == "pool":
            self._warn_once("pool", f"the pool ran out of events ({self.pool.capacity})")
        elif self._miss == "capture":
            self._warn_once(
                "capture",
                "a CUDA graph was being captured (torch.cuda.graph, torch.compile "
                'mode="reduce-overhead"), and no timing event may be recorded during capture',
            )

    def begin(self, signal: int) -> None:
        """Marker at the start of a phase."""
        stale = self._open[signal]
        if stale is not None:  # a begin without its end: forget the unmatched marker
            self.pool.release(stale)
        event = self._record()
        self._open[signal] = event
        self._open_inside[signal] = self._step_start is not None
        if event is None:
            self._lost(signal)

    def end(self, signal: int) -> None:
        """Marker at the end of a phase; pairs it with the phase's start marker."""
        start = self._open[signal]
        if start is None:
            return
        self._open[signal] = None
        stop = self._record()
        if stop is None:
            self.pool.release(start)
            self._lost(signal)
            return
        self._pairs.append(((signal,), start, stop, self._open_inside[signal]))

    # ---- sync waits ------------------------------------------------------------------------

    def wait_begin(self) -> None:
        """Marker before a sync wait on the compute stream (see the module docstring). A wait
        inside another (a collective called by a timed one, a sync wait inside DDP's forward
        wait or after the last gradient) records nothing: the outer markers hold it."""
        open_ = self._open
        nested = (
            bool(self._waits)
            or self._grad_event is not None
            or any(open_[s] is not None for s in self._wait_signals)
        )
        self._waits.append(_NESTED if nested else self._record())

    def wait_end(self, signals: tuple[int, ...]) -> None:
        """Marker after the sync wait; its time is credited to each of ``signals``."""
        if not self._waits:
            return
        start = self._waits.pop()
        if start is _NESTED:
            return
        stop = self._record() if start is not None else None
        if stop is None:
            if start is not None:
                self.pool.release(start)
            for signal in signals:
                self._lost(signal)
            return
        self._pairs.append((signals, start, stop, self._step_start is not None))

    def wait_markers(self) -> list[tuple[EventLike, EventLike]]:
        """(start, end) markers of the sync waits the device may not have passed yet: the open
        step's and the pending steps'. For the hang watcher's background thread, which only
        ``query()``s them (a snapshot: the training thread appends while it reads)."""
        pairs = list(self._pairs)
        for step in list(self._pending):
            pairs += step.pairs
        # The timer's signals end with its two waits (forward_wait, backward_wait).
        waits = self.n_signals - 2
        return [(start, stop) for signals, start, stop, _ in pairs if signals[-1] >= waits]

    def grad_mark(self, key: object) -> None:
        """A parameter's gradient was accumulated (its post-accumulate-grad hook, ``key``
        naming the parameter): the parameter whose gradient came last in the previous pass
        records the marker the trailing wait starts from."""
        self._grad_pass_last = key
        if key is self._grad_key:
            if self._grad_event is not None:  # the same parameter twice in a pass
                self.pool.release(self._grad_event)
            self._grad_event = self._record()
            self._grad_missed = self._grad_event is None
            self._grad_late = False
        elif self._grad_event is not None:
            self._grad_late = True  # the marked gradient was not the last one

    def grad_reset(self) -> None:
        """A backward pass starts: forget a marker a pass that never finished left behind."""
        if self._grad_event is not None:
            self.pool.release(self._grad_event)
            self._grad_event = None
        self._grad_late = self._grad_missed = False
        self._grad_pass_last = None

    def grad_wait_end(self, signal: int) -> None:
        """The backward pass ended: credit ``signal`` with the time from the last gradient's
        marker to now, or leave it absent this step (the first pass, or the last parameter
        changed: the timeline learns this pass's last one)."""
        start, self._grad_event = self._grad_event, None
        late, missed = self._grad_late, self._grad_missed
        self._grad_late = self._grad_missed = False
        self._grad_key, self._grad_pass_last = self._grad_pass_last, None
        if start is not None and not late:
            stop = self._record()
            if stop is not None:
                self._pairs.append(((signal,), start, stop, self._step_start is not None))
                return
            missed = True
        if start is not None:
            self.pool.release(start)
        if missed:
            self._lost(signal)  # no marker could be recorded: named in a warning
        else:
            self.relearned_passes += 1  # learning the last parameter: absent, quietly
            self._untimed.add(signal)

    def start_step(self) -> None:
        """Marker at the start of a step (phases recorded before it still count toward it)."""
        if self._step_start is not None:
            self.pool.release(self._step_start)
        self._step_start = self._record()

    def abort_step(self) -> None:
        """Forget the open step and its phases (the step produced no row)."""
        self._step_failed = False
        self.grad_reset()  # a backward that failed must not hold the next waits as nested
        for _, a, b, _ in self._pairs:
            self.pool.release(a)
            self.pool.release(b)
        self._pairs = []
        for i, ev in enumerate(self._open):
            if ev is not None:
                self.pool.release(ev)
                self._open[i] = None
        if self._step_start is not None:
            self.pool.release(self._step_start)
            self._step_start = None
        self._untimed = set()

    def finish_step(self, slot: int) -> None:
        """Close the step whose CPU row sits in ring ``slot``; its GPU times come from ``poll``.

        Input wait timed inside the step's bracket is subtracted from the GPU step time:
        ``step`` excludes input wait on both clocks.
        """
        start = self._step_start
        self._step_start = None
        stop = self._record() if start is not None else None
        step_pair: tuple[EventLike, EventLike] | None = None
        if start is not None and stop is not None:
            step_pair = (start, stop)
        elif start is not None:
            self.pool.release(start)
        untimed = frozenset(self._untimed) if self._untimed else frozenset()
        self._pending.append(_PendingStep(slot, self._pairs, step_pair, untimed, self._step_failed))
        self._pairs = []
        self._untimed = set()
        self._step_failed = False

    def poll(self, write: Callable[[int, list[float]], None], max_steps: int) -> int:
        """Resolve up to ``max_steps`` finished steps, oldest first; never blocks.

        ``write(slot, gpu_ms)`` receives the step's GPU milliseconds per signal (NaN where not
        timed), the step time last. Returns how many steps were resolved. Steps are resolved
        in order, so the caller can advance its "finished" cursor by the return value.
        """
        done = 0
        while self._pending and done < max_steps:
            head = self._pending[0]
            overdue = len(self._pending) > self.max_pending_steps
            ready = self._ready(head)
            if not overdue and not ready:
                break
            self._pending.popleft()
            if overdue and not ready:
                # The device is far behind: give up on this step's GPU times, keep bounded.
                self.dropped_steps += 1
                self._warn_once(
                    "lag", f"the device is more than {self.max_pending_steps} steps behind"
                )
                write(head.slot, [NAN] * (self.n_signals + 1))
            else:
                write(head.slot, self._times(head))
            self._release(head)
            done += 1
        return done

    def drop_all(self, write: Callable[[int, list[float]], None]) -> int:
        """Finish every pending step without GPU times (shutdown when the device lags)."""
        n = 0
        while self._pending:
            head = self._pending.popleft()
            if not self.broken and self._ready(head):
                write(head.slot, self._times(head))
            else:
                self.dropped_steps += 1
                write(head.slot, [NAN] * (self.n_signals + 1))
            self._release(head)
            n += 1
        return n

    def _ready(self, step: _PendingStep) -> bool:
        """The device passed every marker of the step (a failed step is ready at once)."""
        if step.failed or self.broken:
            return True
        try:
            # Markers may sit on different streams (autograd's device thread): ask every one.
            if step.step_pair is not None and not (
                step.step_pair[0].query() and step.step_pair[1].query()
            ):
                return False
            return all(a.query() and b.query() for _, a, b, _ in step.pairs)
        except Exception as exc:
            self._device_error("query", exc)
            step.failed = True
            return True

    def _times(self, step: _PendingStep) -> list[float]:
        if step.failed or self.broken:
            return [NAN] * (self.n_signals + 1)
        try:
            return self._elapsed(step)
        except Exception as exc:
            self._device_error("elapsed_time", exc)
            return [NAN] * (self.n_signals + 1)

    def _elapsed(self, step: _PendingStep) -> list[float]:
        out = [NAN] * (self.n_signals + 1)
        inside_wait = 0.0
        for signals, a, b, inside in step.pairs:
            ms = max(0.0, float(a.elapsed_time(b)))
            for signal in signals:
                prev = out[signal]
                out[signal] = ms if prev != prev else prev + ms  # NaN check without a call
                if inside and signal == self.input_wait_signal:
                    inside_wait += ms
        if step.step_pair is not None:
            total = float(step.step_pair[0].elapsed_time(step.step_pair[1]))
            out[self.n_signals] = max(0.0, total - inside_wait)
        for signal in step.untimed:
            # Some occurrence got no marker: a sum of the others would undercount.
            out[signal] = NAN
            if signal == self.input_wait_signal:  # the step's own subtraction is unknown
                out[self.n_signals] = NAN
        return out

    def _release(self, step: _PendingStep) -> None:
        release = self.pool.release
        for _, a, b, _ in step.pairs:
            release(a)
            release(b)
        if step.step_pair is not None:
            release(step.step_pair[0])
            release(step.step_pair[1])
