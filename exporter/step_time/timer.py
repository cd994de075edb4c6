"""The step timer: per-step rows of phase times, written into a preallocated ring.

One row per training step, in the step-time diagnosis' layout (``ROW_WIDTH`` float64 columns):
``[step_id, 6 cpu signals (ms), 6 gpu signals (ms), cpu forward_wait, cpu backward_wait,
gpu forward_wait, gpu backward_wait, async_collectives]`` with the signals in ``SIGNALS``
order (``input_wait, h2d, forward, backward, optimizer, step``). NaN means the signal was not
timed in that step; a timed phase that took no time is ``0.0``. The waits are timed by the
hooks inside ``forward`` and ``backward`` (see :mod:`.hooks`) and by every sync wait
(:meth:`StepTimer.sync_wait`), on the CPU clock and, when GPU timing is on, on the compute
stream (see :mod:`.gpu_events`); ``async_collectives`` is 1 on a rank whose collectives do
not block the host (see :attr:`StepTimer.async_collectives`).

How the columns are defined:

* a phase's time is the sum of every time it ran in the step (gradient accumulation runs
  forward and backward several times);
* ``step`` is the step's bracket minus the input wait timed inside it, so it never counts
  input wait twice;
* a phase timed while no step is open (typically ``input_wait``/``h2d`` of the next batch
  fetched before the step opens) is credited to the next step.

The CPU clock is ``time.perf_counter_ns``. The GPU clock (CUDA events, see
:mod:`.gpu_events`) is optional; its columns are filled later, when the device has passed the
step's markers, which is why the ring has two cursors: ``written`` (CPU columns final) and
``finished`` (GPU columns final too). On CPU both advance together.

The hot path is the training thread entering and leaving phases and steps. Leaving a phase
adds its milliseconds into the open step's row, a plain list of floats, and closing the step
stores that list in the ring (one reference) and starts a fresh one: no numpy call, no buffer
copy, no lock, no I/O, and nothing allocated per phase (the phase context managers are created
once). Between torch's kernels every distinct interpreter path the hot path takes runs with
cold caches, so the fewest and plainest operations win there: a buffer copy of the row into a
numpy ring cost about 2 us per step inside a training loop (0.2 us in isolation). The
background thread converts finished rows to numpy with :meth:`StepTimer.read`, which drops
rows the training thread may have replaced while they were being read (with the GIL a row is
complete before ``written`` moves past it, and a stored row is never written again except for
its GPU columns, which are final before ``finished`` moves past it).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from rankwatch.diagnosis.step_time import ROW_WIDTH, SIGNALS
from rankwatch.diagnosis.step_time.table import SYNC_SIGNALS, column

if TYPE_CHECKING:
    from rankwatch.exporter.step_time.gpu_events import GpuTimeline

__all__ = [
    "BACKWARD_WAIT",
    "FORWARD_WAIT",
    "INPUT_WAIT",
    "PHASES",
    "TIMED_SIGNALS",
    "StepTimer",
]

# The phases a user (or a hook) brackets; ``step`` is derived from the step's own bracket.
PHASES: tuple[str, ...] = SIGNALS[:-1]
INPUT_WAIT, H2D, FORWARD, BACKWARD, OPTIMIZER = range(len(PHASES))
_NG = len(PHASES)
# The sync waits inside forward and backward, in SYNC_SIGNALS order.
FORWARD_WAIT, BACKWARD_WAIT = range(_NG, _NG + len(SYNC_SIGNALS))
# Everything the timer times on both clocks: the phases, then the waits (a GpuTimeline's
# signals; its step time comes last).
TIMED_SIGNALS: tuple[str, ...] = (*PHASES, *SYNC_SIGNALS)
_N = len(TIMED_SIGNALS)
_NAN = math.nan
_MS = 1e-6  # ns -> ms
_STEP_COL = column("cpu", "step")
_ASYNC_COL = ROW_WIDTH - 1
# Row column of each timed signal (``TIMED_SIGNALS`` order), per clock; the GPU list ends with
# the GPU step column (a GpuTimeline's output order).
_COL: tuple[int, ...] = tuple(column("cpu", name) for name in TIMED_SIGNALS)
_GPU_COL: tuple[int, ...] = (
    *(column("gpu", name) for name in TIMED_SIGNALS),
    column("gpu", "step"),
)
_FWD_COL, _BWD_COL, _OPT_COL = _COL[FORWARD], _COL[BACKWARD], _COL[OPTIMIZER]


class _Phase:
    """Context manager of one phase; one instance per phase per timer, reused every time."""

    __slots__ = ("_col", "_end", "_i", "_timer")

    def __init__(self, timer: StepTimer, index: int) -> None:
        self._timer = timer
        self._i = index
        self._col = _COL[index]
        self._end = timer.end

    def __enter__(self) -> _Phase:
        # ``StepTimer.begin`` inlined, as ``end`` is below: inside a training loop every
        # Python call of a mark costs 0.1-0.2 us (cold caches between torch's kernels).
        timer = self._timer
        timer._start[self._i] = timer._clock()
        if timer._gpu is not None:
            timer._gpu.begin(self._i)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Three named parameters, not ``*exc_info``: packing a tuple costs ~10 ns per mark.
        timer = self._timer
        now = timer._clock()
        starts = timer._start
        start = starts[self._i]
        if start < 0:
            return
        starts[self._i] = -1
        timer.marks += 1  # progress, for the hang watcher (a plain attribute write)
        row, col = timer._row, self._col
        before = row[col]  # NaN (not timed yet in this step) is the only value unequal to itself
        row[col] = (now - start) * _MS if before != before else before + (now - start) * _MS
        if timer._gpu is not None:
            timer._gpu.end(self._i)


class _InputWaitPhase(_Phase):
    """``input_wait``: its exit also keeps the step's bracket from counting the wait twice."""

    __slots__ = ()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._end(self._i)


class _SyncWait:
    """Context manager crediting a wait at a synchronisation point outside the hooks' reach
    (one instance per timer, reused; see :meth:`StepTimer.sync_wait`). With GPU timing on,
    the wait is also timed on the compute stream (:meth:`.GpuTimeline.wait_begin`)."""

    __slots__ = ("_gpu", "_start", "_timer", "muted")

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self._start = -1
        self._gpu: GpuTimeline | None = None  # the timeline the open block began on
        # Open :meth:`StepTimer.untimed_collectives` blocks: the collective shadows time nothing.
        self.muted = 0

    @property
    def open(self) -> bool:
        """A block is open (they do not nest)."""
        return self._start >= 0

    @property
    def busy(self) -> bool:
        """A block is open, or an ``untimed_collectives`` block: a collective is not timed."""
        return self._start >= 0 or self.muted > 0

    @property
    def timer(self) -> StepTimer:
        """The timer this wait credits."""
        return self._timer

    @property
    def in_backward(self) -> bool:
        """The timer is inside a timed backward pass."""
        return self._timer._start[BACKWARD] >= 0

    def __enter__(self) -> _SyncWait:
        if self._start >= 0:
            raise RuntimeError("sync_wait: already inside a sync_wait block (they do not nest)")
        timer = self._timer
        self._start = timer._clock()
        gpu = self._gpu = timer._gpu
        if gpu is not None:
            gpu.wait_begin()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        timer = self._timer
        ns = timer._clock() - self._start
        self._start = -1
        timer.marks += 1
        timer.credit_wait(ns)
        gpu, self._gpu = self._gpu, None
        if gpu is not None:
            gpu.wait_end(timer.wait_signals())
        if exc_type is not None and timer.on_wait_error is not None:
            # The collective raised (a peer gone, a size Gloo refused): the hang watcher notes
            # which call it was, from the frames still on the stack. The error path only.
            timer.on_wait_error(sys._getframe(1))


class _Untimed:
    """Context manager of :meth:`StepTimer.untimed_collectives` (one per timer, reused;
    blocks nest)."""

    __slots__ = ("_wait",)

    def __init__(self, wait: _SyncWait) -> None:
        self._wait = wait

    def __enter__(self) -> _Untimed:
        self._wait.muted += 1
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._wait.muted = max(0, self._wait.muted - 1)


class _DeviceWait:
    """Context manager timing a wait on the compute stream only (GPU clock; the host does not
    block there: FSDP2's ``wait_for_unshard``); see :meth:`StepTimer.device_wait`. Inside a
    sync wait or another device wait it records nothing (the outer markers hold it)."""

    __slots__ = ("_open", "_timer")

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self._open: list[GpuTimeline | None] = []  # per open block, the timeline it began on

    def __enter__(self) -> _DeviceWait:
        gpu = self._timer._gpu
        self._open.append(gpu)
        if gpu is not None:
            gpu.wait_begin()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        gpu = self._open.pop() if self._open else None
        if gpu is not None:
            gpu.wait_end(self._timer.wait_signals())


class _Step:
    """Context manager of one step (reused); an exception inside the step discards its row."""

    __slots__ = ("_timer", "next_id")

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self.next_id: int | None = None

    def __enter__(self) -> _Step:
        step_id, self.next_id = self.next_id, None
        timer = self._timer
        if timer._step_start < 0:  # the usual case, one call shorter
            timer.start_step(step_id)
        else:
            timer.open_explicit(step_id)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self._timer.end_step()
        else:
            self._timer.abort_step()


def _check_timeline(gpu: GpuTimeline | None) -> None:
    if gpu is not None and gpu.n_signals != _N:
        raise ValueError(
            f"StepTimer.gpu: the timeline times {gpu.n_signals} signals, expected {_N} "
            f"({', '.join(TIMED_SIGNALS)})"
        )


class StepTimer:
    """Times phases and steps on the training thread; keeps the last ``capacity`` rows.

    Use :meth:`step` and :meth:`phase` as context managers, or the lower-level
    :meth:`start_step`/:meth:`end_step` and :meth:`begin`/:meth:`end` (what the hooks call).
    """

    def __init__(self, capacity: int, *, gpu: GpuTimeline | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"StepTimer.capacity: expected an int, got {capacity!r}")
        if capacity < 2:
            raise ValueError(f"StepTimer.capacity: must be >= 2, got {capacity!r}")
        _check_timeline(gpu)
        self.capacity = capacity
        # Written rows by slot (absolute row ``i`` in slot ``i % capacity``), each a list of
        # ROW_WIDTH floats; None for a slot never written.
        self._rows: list[list[float] | None] = [None] * capacity
        # The open step's row: a phase's milliseconds accumulate in its column, NaN until it
        # is first timed (so "not timed" and "took no time" stay apart without a flag).
        self._row: list[float] = [_NAN] * ROW_WIDTH
        self.written = 0  # rows whose CPU columns are final
        self.finished = 0  # rows whose GPU columns are final as well
        self._clock = time.perf_counter_ns
        self._start = [-1] * _N  # ns at which the phase was entered, -1 when not in it
        # Phases held by an enclosing unit of work (a pipeline stage's microbatch, see
        # :meth:`hold`): the marks of the hooks inside it leave them alone.
        self._held = [False] * _N
        self._step_start = -1  # ns, -1 when no step is open
        self._inside_wait = 0  # ns of input wait timed inside the open step's bracket
        self._auto = False  # the open step was opened by a hook, not by ``step()``
        self._step_id = 0
        self._last_id = -1
        self._gpu = gpu
        # Set by ``watch()`` for a model on an accelerator: its collectives do not block the
        # host, so the CPU clock of this rank cannot contain a wait for another rank.
        self.async_collectives = False
        # A watched loader fetching on the training thread closes hook-opened steps at the
        # next fetch (so work after the optimizer is in the step); else the optimizer does.
        self.loader_steps = False
        self.optimizer_steps = 0  # outermost optimizer steps seen by the hooks
        self.optimizer_end_ns = -1  # when the hooks last saw an outermost optimizer step end
        # For the hang watcher (rankwatch.exporter.hang.record), read by its thread only:
        # progress marks (phases left, waits ended, steps written, forwards without a step),
        # when the last step ended,
        # the phases the user declared long (name, budget seconds, entry ns), and whether the
        # watched loader's current iterator has yet to give its first batch.
        self.marks = 0
        # Called by the collective shadows with their frame when a collective's wait returns
        # (inside a sync wait already open too), and with the waiting frame when a timed wait
        # raises (the hang watcher; see :mod:`rankwatch.exporter.hang.finished_calls`).
        self.on_wait_done: Callable[[FrameType], None] | None = None
        self.on_wait_error: Callable[[FrameType], None] | None = None
        self.step_end_ns = time.perf_counter_ns()  # the last step's end (the start, before any)
        self.declared: list[tuple[str, float, int]] = []
        self.first_fetch = False
        self._phases = {
            name: (_InputWaitPhase if i == INPUT_WAIT else _Phase)(self, i)
            for i, name in enumerate(PHASES)
        }
        self._step_ctx = _Step(self)
        self._sync_wait = _SyncWait(self)
        self._untimed = _Untimed(self._sync_wait)
        self._device_wait = _DeviceWait(self)

    # ---- state ---------------------------------------------------------------------------

    @property
    def in_step(self) -> bool:
        """A step is open."""
        return self._step_start >= 0

    @property
    def auto_step(self) -> bool:
        """The open step was opened by a hook (the optimizer hook may close it)."""
        return self._step_start >= 0 and self._auto

    @property
    def last_step_id(self) -> int:
        """Id of the last step written, -1 before the first."""
        return self._last_id

    @property
    def gpu(self) -> GpuTimeline | None:
        return self._gpu

    def set_gpu(self, gpu: GpuTimeline | None) -> None:
        """Switch GPU timing on or off (between steps; an open step keeps CPU times only)."""
        _check_timeline(gpu)
        self._gpu = gpu

    def phase_open(self, index: int) -> bool:
        """Phase ``index`` has been entered and not yet left."""
        return self._start[index] >= 0

    # ---- context managers ----------------------------------------------------------------

    def phase(self, name: str) -> _Phase:
        """Context manager timing phase ``name`` (one of ``PHASES``)."""
        try:
            return self._phases[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"phase: field name: value {name!r} is not one of {', '.join(PHASES)} "
                "(the step time is measured by step())"
            ) from None

    def sync_wait(self) -> _SyncWait:
        """Context manager around a wait at a synchronisation point the hooks do not see (a
        collective the training loop runs outside the model: a token-count all-gather, an
        all-reduced metric). Its time is credited to ``forward_wait`` (and to ``forward``
        when no forward is being timed: a synchronisation before the forward pass), or to
        ``backward_wait`` inside a timed backward. Blocks do not nest (``RuntimeError``)."""
        return self._sync_wait

    def untimed_collectives(self) -> _Untimed:
        """Context manager: collectives waited in inside it are not timed as waits (control
        traffic that is not training: a harness's stop flag or timeline broadcast). Blocks
        nest; an explicit :meth:`sync_wait` inside one still counts."""
        return self._untimed

    def device_wait(self) -> _DeviceWait:
        """Context manager around a point where the compute stream waits for a collective
        without the host blocking (FSDP2's ``wait_for_unshard``): timed on the GPU clock only,
        credited as :meth:`sync_wait` credits (nothing without GPU timing)."""
        return self._device_wait

    def wait_signals(self) -> tuple[int, ...]:
        """The signals a wait ending now is credited to (as :meth:`credit_wait` does)."""
        if self._start[BACKWARD] >= 0:
            return (BACKWARD_WAIT,)
        if self._start[FORWARD] < 0:
            return (FORWARD, FORWARD_WAIT)
        return (FORWARD_WAIT,)

    def step(self, step_id: int | None = None) -> _Step:
        """Context manager of one step; ``step_id`` defaults to the previous id + 1."""
        if step_id is not None:
            self._check_id(step_id)
        self._step_ctx.next_id = step_id
        return self._step_ctx

    def _check_id(self, step_id: object) -> int:
        if isinstance(step_id, bool) or not isinstance(step_id, (int, np.integer)):
            raise TypeError(f"step: field step_id: expected an int, got {step_id!r}")
        if step_id <= self._last_id:
            raise ValueError(
                f"step: field step_id: value {step_id!r} must be greater than the previous "
                f"step id {self._last_id}"
            )
        return int(step_id)

    # ---- hot path ------------------------------------------------------------------------

    def begin(self, index: int) -> None:
        """Enter phase ``index`` (``TIMED_SIGNALS`` order); nothing while it is held."""
        if self._held[index]:
            return
        self._start[index] = self._clock()
        gpu = self._gpu
        if gpu is not None:
            if index == BACKWARD:
                gpu.grad_reset()
            gpu.begin(index)

    def end(self, index: int) -> bool:
        """Leave phase ``index``; a leave without an enter is ignored (returns False). While
        the phase is held it stays open (returns True: the caller's phase is still timed)."""
        if self._held[index]:
            return True
        now = self._clock()
        start = self._start[index]
        if start < 0:
            return False
        self._start[index] = -1
        self.marks += 1
        row, col = self._row, _COL[index]
        before = row[col]
        row[col] = (now - start) * _MS + (before if before == before else 0.0)
        if index == 0 and self._step_start >= 0 and start >= self._step_start:
            self._inside_wait += now - start
        if self._gpu is not None:
            self._gpu.end(index)
        return True

    def hold(self, index: int) -> bool:
        """Enter phase ``index`` and hold it open: :meth:`begin` and :meth:`end` of it do
        nothing until :meth:`release` (the hooks of a module inside a unit of work that is
        the phase as a whole). False, and nothing held, when the phase is open already."""
        if self._start[index] >= 0 or self._held[index]:
            return False
        self.begin(index)
        self._held[index] = True
        return True

    def release(self, index: int) -> None:
        """Leave phase ``index`` held by :meth:`hold`."""
        self._held[index] = False
        self.end(index)

    def add(self, index: int, ns: int) -> None:
        """Credit ``ns`` to phase ``index`` of the current step (a wait measured by a hook
        from its own marks, not bracketed by begin/end); CPU clock only."""
        row, col = self._row, _COL[index]
        before = row[col]
        row[col] = ns * _MS + (before if before == before else 0.0)

    def last_grad(self, param: object) -> int:
        """A parameter's gradient was accumulated (DDP's post-accumulate-grad hooks): returns
        the CPU clock now, and on the GPU clock marks the compute stream where the trailing
        wait may start (:meth:`.GpuTimeline.grad_mark`)."""
        if self._gpu is not None:
            self._gpu.grad_mark(param)
        return self._clock()

    def credited_ms(self, index: int) -> float:
        """Milliseconds signal ``index`` holds so far in the open step (0.0 when untimed)."""
        value = self._row[_COL[index]]
        return value if value == value else 0.0

    def add_backward_wait(self, ns: int) -> None:
        """End of a backward pass under DDP: credit ``ns`` since the last gradient to
        ``backward_wait``, and on the GPU clock the stream time since its marker."""
        self.add(BACKWARD_WAIT, ns)
        if self._gpu is not None:
            self._gpu.grad_wait_end(BACKWARD_WAIT)

    def credit_wait(self, ns: int) -> None:
        """Credit ``ns`` spent waiting at a synchronisation point to the current step.

        Inside a timed forward or backward the phase already holds the time: only its wait
        grows. Anywhere else the wait is a synchronisation before the forward pass (as DDP's
        buffer broadcast is): it counts as forward and as forward_wait, so it leaves the
        residual and compute (forward minus its wait) stays what it was.
        """
        if self._start[BACKWARD] >= 0:
            self.add(BACKWARD_WAIT, ns)
            return
        if self._start[FORWARD_WAIT] >= 0:
            # Inside DDP's timed pre/post-forward interval, which holds this wait already.
            return
        if self._start[FORWARD] < 0:
            self.add(FORWARD, ns)
        self.add(FORWARD_WAIT, ns)

    def start_step(
        self, step_id: int | None = None, *, auto: bool = False, start_ns: int | None = None
    ) -> None:
        """Open a step (phases timed before it, while no step was open, count toward it),
        starting now or at ``start_ns``."""
        if self._step_start >= 0:
            raise RuntimeError("step: a step is already open; close it before opening the next one")
        self._step_id = self._last_id + 1 if step_id is None else step_id
        self._auto = auto
        self._inside_wait = 0
        self._step_start = self._clock() if start_ns is None else start_ns
        if self._gpu is not None:
            self._gpu.start_step()

    def turn_step(self) -> bool:
        """A watched loader's fetch on the training thread: close the step a hook opened if it
        ran work (forward, backward or the optimizer), and open one if none is open.

        True if it opened a step. A step opened by ``step()`` is left to its ``with`` block,
        and an auto step without work (a batch the loop skipped) stays open.
        """
        if self._step_start < 0:
            self.start_step(auto=True)
            return True
        # Work in the step: forward, backward or the optimizer was timed (a timed column is
        # equal to itself; an untimed one is NaN). Checked here, on every fetch, without a call.
        row = self._row
        fwd, bwd, opt = row[_FWD_COL], row[_BWD_COL], row[_OPT_COL]
        if not (self._auto and (fwd == fwd or bwd == bwd or opt == opt)):
            return False
        now = self._clock()  # one clock read: the next step starts where this one ends
        self.end_step(now)
        self.start_step(auto=True, start_ns=now)
        return True

    def open_explicit(self, step_id: int | None) -> None:
        """``step()``'s enter: opens a step, or adopts the one a hook opened for this batch."""
        if self._step_start >= 0 and self._auto:
            self._auto = False
            if step_id is not None:
                self._step_id = step_id
            return
        self.start_step(step_id)

    def end_step(self, end_ns: int | None = None) -> None:
        """Close the open step and write its row (ending now, or at ``end_ns``)."""
        now = self._clock() if end_ns is None else end_ns
        start = self._step_start
        if start < 0:
            return
        row = self._row
        slot = self.written % self.capacity
        # Columns never timed in the step are still NaN in ``row`` (the GPU ones are filled
        # in the ring later, by ``_write_gpu``).
        row[0] = self._step_id
        row[_STEP_COL] = (now - start - self._inside_wait) * _MS
        if self.async_collectives:
            row[_ASYNC_COL] = 1.0
        self._rows[slot] = row
        self._row = [_NAN] * ROW_WIDTH
        self._last_id = self._step_id
        self._step_start = -1
        self._auto = False
        self.written += 1
        self.marks += 1
        self.step_end_ns = now
        gpu = self._gpu
        if gpu is None:
            # (if GPU timing was switched off with steps pending, those stay untimed)
            self.finished = self.written
        else:
            gpu.finish_step(slot)
            self.finished += gpu.poll(self._write_gpu, 2)
            if gpu.broken:  # switched itself off after device errors (it said so once)
                self._gpu = None

    def finish_open_step(self) -> None:
        """At shutdown: write a hook-opened step that ran its optimizer (a whole training step
        no next fetch closed: the loop ended at its step count, or left by ``break``), ending
        where its optimizer step ended; discard any other open step.

        On the GPU clock it is discarded too: its end marker cannot be placed in the past.
        """
        if self._step_start < 0:
            return
        opt = self._row[_OPT_COL]
        done = self._auto and opt == opt and self.optimizer_end_ns >= self._step_start
        if done and self._gpu is None:
            self._start = [-1] * _N
            self.end_step(self.optimizer_end_ns)
        else:
            self.abort_step()

    def abort_step(self) -> None:
        """Discard the open step (no row): an exception inside it, or a loader that ran out."""
        self._step_start = -1
        self._auto = False
        self._inside_wait = 0
        self._row = [_NAN] * ROW_WIDTH
        self._start = [-1] * _N
        if self._gpu is not None:
            self._gpu.abort_step()

    # ---- GPU columns ---------------------------------------------------------------------

    def _write_gpu(self, slot: int, gpu_ms: list[float]) -> None:
        row = self._rows[slot]
        if row is not None:
            for col, ms in zip(_GPU_COL, gpu_ms, strict=True):
                row[col] = ms

    def poll_gpu(self, max_steps: int = 64) -> int:
        """Resolve finished GPU markers without blocking (training thread only)."""
        if self._gpu is None:
            return 0
        n = self._gpu.poll(self._write_gpu, max_steps)
        self.finished += n
        return n

    def drain_gpu(self, timeout_seconds: float) -> None:
        """Shutdown: poll pending GPU markers for up to ``timeout_seconds``, then give up on the
        rest (their GPU columns stay NaN). Polls ``query()``; never synchronizes."""
        if self._gpu is None:
            self.finished = self.written
            return
        deadline = time.monotonic() + max(0.0, timeout_seconds)
        while self._gpu.pending and time.monotonic() < deadline:
            if self.poll_gpu(1 << 30) == 0:
                time.sleep(0.001)
        self.finished += self._gpu.drop_all(self._write_gpu)

    # ---- reader side (background thread) -------------------------------------------------

    def read(self, cursor: int) -> tuple[NDArray[np.float64], int, int]:
        """Finished rows from ``cursor`` on: ``(rows, new_cursor, lost)``.

        ``lost`` counts rows the ring overwrote before they were read. Safe to call from
        another thread while the training thread keeps writing.
        """
        end = self.finished
        cap = self.capacity
        lo = max(cursor, end - cap)
        if end <= lo:
            return np.empty((0, ROW_WIDTH)), max(cursor, end), lo - cursor
        a, b = lo % cap, end % cap
        ring = self._rows
        taken = ring[a:b] if a < b else ring[a:] + ring[:b]
        # The writer may have moved on while the slice was taken: drop every row whose slot it
        # could have given to a newer row. At most the rows taken: the rows after ``end`` that
        # it wrote meanwhile are the next read's to read or count lost, not this one's.
        torn = min(self.written - cap - lo + 1, end - lo)
        if torn > 0:
            taken = taken[torn:]
            lo += torn
        if not taken:
            return np.empty((0, ROW_WIDTH)), end, lo - cursor
        return np.array(taken, dtype=np.float64), end, lo - cursor

    @property
    def ring(self) -> NDArray[np.float64]:
        """A copy of the ring as ``[capacity, ROW_WIDTH]`` (NaN in slots never written), for
        inspection; the background thread reads with :meth:`read`."""
        blank = [_NAN] * ROW_WIDTH
        return np.array([blank if r is None else r for r in self._rows], dtype=np.float64)
