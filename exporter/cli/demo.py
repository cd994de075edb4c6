"""The demo job behind ``rankwatch demo``: a small DDP world with scripted stragglers.

This module is the parent process: it spawns ``ranks`` workers (Gloo on CPU; what each runs
is :mod:`.demo_rank`, what the run is told is :mod:`.demo_plan`), receives every report the
root publishes through a channel, draws the live table, keeps the run's incidents, draws the
heatmaps and writes the step-time window files and the final summary. Every worker trains a
tiny model under :class:`~rankwatch.exporter.RankWatch`; the root also runs the DeepEP
collector's real root pipeline on a simulated EP 16 group, and publishes both engines' windows
to ``/metrics``, OTLP (when an endpoint is set), log lines and NPZ artifacts.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rankwatch.exporter.cli.demo_plan import (
    DEEPEP_PHASES,
    SIM_EP_SIZE,
    SIM_LATE_RANK,
    SIM_RANKS_PER_NODE,
    DemoOptions,
)
from rankwatch.exporter.cli.demo_rank import rank_config, run_worker
from rankwatch.exporter.cli.ports import free_port

__all__ = ["preflight", "run_demo"]

EXIT_OK, EXIT_FAILURE, EXIT_INTERRUPTED = 0, 1, 130
# Spawning the ranks and importing torch can take long on a busy two-core machine.
STARTUP_TIMEOUT_S = 180.0
# From a stop request (end of timeline, Ctrl-C, a failed rank) to the root's "done".
STOP_TIMEOUT_S = 30.0
# From "done" to every process having exited.
JOIN_TIMEOUT_S = 15.0


class _Interrupts:
    """Counts SIGINT/SIGTERM; the first asks for a clean stop, the second for an immediate one."""

    def __init__(self) -> None:
        self.count = 0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    @contextlib.contextmanager
    def ignored(self) -> Iterator[None]:
        """While spawning: children inherit an ignored SIGINT, so a Ctrl-C reaches only the
        parent, which stops every rank at the same step instead of killing them mid-collective."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def check_port(addr: str, port: int) -> None:
    """Raise ``OSError`` naming the address when ``/metrics`` could not listen there."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {addr}:{port}: {exc.strerror}") from None


@dataclass
class _RunState:
    """What the parent learned from the ranks while supervising them."""

    metrics_url: str | None = None
    started_at_s: float | None = None
    done: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    last_progress: Any = None
    stop_reason: str = ""
    rows: dict[int, Any] = field(default_factory=dict)
    # Set when waiting for the ranks to stop on their own makes no sense any more.
    force_stop: bool = False
    exited: set[int] = field(default_factory=set)  # ranks seen exiting with an error
    segment_of_step: list[tuple[int, int]] = field(default_factory=list)


def preflight(options: DemoOptions) -> None:
    """Refuse, before spawning anything, what would make the demo fail at once: a bad
    ``RANKWATCH_*``/``DEEPEP_*`` environment (``ValueError``/``TypeError``) or a ``/metrics``
    port already taken (``OSError``)."""
    rank_config(options, "preflight")  # the one config object: DeepEP settings included
    check_port(options.addr, options.port)


def run_demo(options: DemoOptions) -> int:
    """Run the demo end to end; returns the exit code (0, 1, or 130 after Ctrl-C)."""
    import torch.multiprocessing as mp

    from rankwatch.exporter.cli.live_table import LiveView
    from rankwatch.exporter.publish.recorder import RunRecorder, summary_text, write_summary

    preflight(options)
    run_id = "demo-" + time.strftime("%Y%m%d-%H%M%S")
    config = rank_config(options, run_id)
    options.out.mkdir(parents=True, exist_ok=True)
    _clear_previous_run(options.out)
    recorder = RunRecorder(config)
    ctx = mp.get_context("spawn")
    channel = ctx.Queue(maxsize=4096)
    stop_event = ctx.Event()
    master_port = free_port()
    interrupts = _Interrupts()
    state = _RunState()
    header = (
        f"rankwatch demo: {options.ranks} ranks, timeline {options.timeline.spec()}, "
        f"straggler rank {options.straggler_rank}, output {options.out}; DeepEP group "
        f"simulated at EP {SIM_EP_SIZE} over {SIM_EP_SIZE // SIM_RANKS_PER_NODE} nodes "
        f"(late rank {SIM_LATE_RANK})"
    )
    procs = []
    with interrupts.ignored():
        for rank in range(options.ranks):
            proc = ctx.Process(
                target=run_worker,
                args=(rank, options, channel, stop_event, master_port, run_id),
                name=f"rankwatch-demo-rank{rank}",
            )
            proc.start()
            procs.append(proc)
    interrupts.install()
    renderer = _HeatmapRenderer(options)
    try:
        with LiveView(
            header=header,
            segments=[(s.phase, s.seconds) for s in options.timeline.segments],
            deepep_phases=DEEPEP_PHASES,
            recorder=recorder,
            live=options.live,
        ) as view:
            _supervise(procs, channel, stop_event, interrupts, view, recorder, state, renderer)
    finally:
        _reap(procs, channel, recorder, state, lambda: interrupts.count >= 2)
    # Our handlers stay installed until the summary is written: a Ctrl-C now only shortens
    # the wait for the heatmaps (a second one skips it).
    heatmaps = renderer.finish(state.started_at_s, cancelled=lambda: interrupts.count >= 2)
    step_windows = _write_step_windows(options, state, config, run_id)
    run = {
        "run_id": run_id,
        "ranks": options.ranks,
        "timeline": options.timeline.spec(),
        "straggler_rank": options.straggler_rank,
        # The DeepEP group is simulated, independent of the training ranks.
        "deepep_group": {
            "simulated": True,
            "ep_size": SIM_EP_SIZE,
            "ranks_per_node": SIM_RANKS_PER_NODE,
            "late_rank": SIM_LATE_RANK,
            "phases": list(DEEPEP_PHASES),
        },
        "steps": _steps(state),
        "duration_s": round(_elapsed(state), 1),
        "started_at_s": state.started_at_s,
        "interrupted": interrupts.count > 0,
        "stop_reason": state.stop_reason or "timeline finished",
        "metrics_url": state.metrics_url,
        "errors": state.errors,
    }
    summary = recorder.summary(run)
    summary["files"] = {
        "summary": str(options.out / "summary.json"),
        "verdict": str(options.out / "summary.txt"),
        "deepep_windows": str(options.out / "deepep"),
        "step_windows": str(options.out / "step-windows") if step_windows else "none written",
        "heatmaps": str(options.out / "heatmaps") if heatmaps else "none rendered",
        "logs": str(options.out / "logs"),
    }
    write_summary(options.out, summary)
    interrupts.restore()
    print()
    print(summary_text(summary), end="", flush=True)
    if interrupts.count:
        return EXIT_INTERRUPTED
    if state.errors or state.done is None:
        return EXIT_FAILURE
    return EXIT_OK


# What a demo run writes under --out: a new run removes exactly these, nothing else there.
_OWN_FILES = (
    "summary.json",
    "summary.txt",
    "deepep/deepep-normal-*.npz",
    "deepep/deepep_diagnose_rank*.log",
    "heatmaps/*/deepep-normal-*.png",
    "step-windows/step-window-*.json",
    "logs/rank*.log",
)


def _clear_previous_run(out: Path) -> None:
    # Windows of two runs in one folder would interleave in a replay.
    for pattern in _OWN_FILES:
        for path in out.glob(pattern):
            path.unlink(missing_ok=True)
    for folder in sorted(out.glob("heatmaps/*"), reverse=True):
        with contextlib.suppress(OSError):  # not empty: something of the user's is in it
            folder.rmdir()


def _steps(state: _RunState) -> int | None:
    if state.done is not None:
        return int(state.done["steps"])
    return None if state.last_progress is None else int(state.last_progress.steps)


def _elapsed(state: _RunState) -> float:
    if state.done is not None:
        return float(state.done["elapsed_s"])
    return 0.0 if state.last_progress is None else float(state.last_progress.elapsed_s)


def _absorb(msg: Any, recorder: Any, state: _RunState) -> None:
    """Keep what a rank sent: reports go to the recorder, the rest into ``state``."""
    kind = msg[0]
    if kind == "report":
        recorder.publish(msg[1])
    elif kind == "progress":
        state.last_progress = msg[1]
    elif kind == "ready":
        state.metrics_url = msg[1]
    elif kind == "started":
        state.started_at_s = msg[1]
    elif kind == "done":
        state.done = msg[1]
    elif kind == "rows":
        state.rows[msg[1]] = msg[2]
    elif kind == "segments":
        state.segment_of_step = msg[1]
    elif kind == "error":
        _, rank, text = msg
        last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
        state.errors.append(f"rank {rank}: {last}")
        print(f"rank {rank} failed:\n{text}", file=sys.stderr, flush=True)


def _handle_message(msg: Any, view: Any, recorder: Any, state: _RunState) -> None:
    """Keep the message, then show it."""
    _absorb(msg, recorder, state)
    kind = msg[0]
    if kind == "report":
        view.report(msg[1])
    elif kind == "progress":
        view.progress(msg[1])
    elif kind == "ready":
        view.note(f"/metrics at {msg[1]}" if msg[1] else "/metrics disabled")
    elif kind == "error":
        view.note(f"{state.errors[-1]}")


def _supervise(
    procs: list[Any],
    channel: Any,
    stop_event: Any,
    interrupts: _Interrupts,
    view: Any,
    recorder: Any,
    state: _RunState,
    renderer: _HeatmapRenderer,
) -> None:
    """Relay messages to the view until the root reports done, stopping the ranks when asked."""
    started = time.monotonic()
    stop_since: float | None = None

    def request_stop(reason: str, note: str) -> None:
        nonlocal stop_since
        if stop_since is None:
            stop_since = time.monotonic()
            state.stop_reason = reason
            stop_event.set()
            view.note(note)

    while state.done is None:
        with contextlib.suppress(queue.Empty):
            _handle_message(channel.get(timeout=0.1), view, recorder, state)
        if state.last_progress is not None:
            renderer.poll(state.started_at_s, state.last_progress.elapsed_s)
        now = time.monotonic()
        if interrupts.count >= 2:
            state.stop_reason = "interrupted twice"
            state.force_stop = True
            view.note("second interrupt: stopping the ranks now")
            return
        if interrupts.count == 1:
            if state.metrics_url is None and state.started_at_s is None:
                state.stop_reason = "interrupted during start-up"
                state.force_stop = True
                return  # nothing to stop cleanly yet
            request_stop(
                "interrupted",
                "Ctrl-C: stopping every rank at its next step and writing the summary "
                "(Ctrl-C again to stop at once)",
            )
        failed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        for i in failed:
            if i not in state.exited:
                state.exited.add(i)
                code = procs[i].exitcode
                how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
                state.errors.append(f"rank {i}: {how}")
        if failed:
            request_stop("a rank failed", f"rank(s) {failed} exited early: stopping the others")
            if all(p.exitcode is not None for p in procs) or procs[0].exitcode is not None:
                state.force_stop = True
                return  # nobody left to report done
        if state.started_at_s is None and now - started > STARTUP_TIMEOUT_S:
            state.stop_reason = "start-up timed out"
            state.force_stop = True
            view.note(f"the ranks did not start within {STARTUP_TIMEOUT_S:.0f} s")
            return
        if stop_since is not None and now - stop_since > STOP_TIMEOUT_S:
            state.force_stop = True
            view.note(f"the ranks did not stop within {STOP_TIMEOUT_S:.0f} s")
            return


def _reap(
    procs: list[Any],
    channel: Any,
    recorder: Any,
    state: _RunState,
    hurry: Callable[[], bool],
) -> None:
    """Wait for every rank to exit (draining the channel so none blocks on it), unless
    ``state.force_stop`` or ``hurry()`` says not to; then terminate what is left."""
    deadline = time.monotonic() + (0.0 if state.force_stop else JOIN_TIMEOUT_S)
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline and not hurry():
        try:
            _absorb(channel.get(timeout=0.1), recorder, state)
        except queue.Empty:
            continue
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    # Reports still queued after the ranks exited (e.g. the final summary window).
    while True:
        try:
            msg = channel.get_nowait()
        except (queue.Empty, OSError, EOFError):
            break
        _absorb(msg, recorder, state)
    channel.close()
    channel.cancel_join_thread()


class _HeatmapRenderer:
    """Draws one representative DeepEP window per phase (the last one wholly inside it) on a
    thread of its own, as soon as the phase is over, so the pictures are ready at the end."""

    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self.share = options.timeline.total_seconds / len(DEEPEP_PHASES)
        self.written: list[Path] = []
        self._scheduled: set[int] = set()
        self._jobs: queue.Queue[tuple[int, float] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rankwatch-heatmaps", daemon=True)
        self._thread.start()

    def poll(self, started_at_s: float | None, elapsed_s: float) -> None:
        """Schedule every phase that ended at least two windows ago."""
        if started_at_s is None:
            return
        margin = 2 * self.options.interval_seconds
        for index in range(len(DEEPEP_PHASES)):
            if index not in self._scheduled and elapsed_s >= (index + 1) * self.share + margin:
                self._scheduled.add(index)
                self._jobs.put((index, started_at_s))

    def finish(
        self,
        started_at_s: float | None,
        timeout_s: float = 60.0,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> list[Path]:
        """Schedule what is left, wait (bounded, or until ``cancelled()``) for the thread,
        return the written files."""
        if started_at_s is not None:
            for index in range(len(DEEPEP_PHASES)):
                if index not in self._scheduled:
                    self._scheduled.add(index)
                    self._jobs.put((index, started_at_s))
        self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline and not cancelled():
            self._thread.join(0.1)
        return list(self.written)

    def _pick(self, index: int, started_at_s: float) -> Path | None:
        from rankwatch.diagnosis.deepep.artifact import ArtifactError, load_window_artifact

        best: tuple[float, Path] | None = None
        for path in sorted((self.options.out / "deepep").glob("*.npz")):
            try:
                _, _, meta = load_window_artifact(path)
            except (ArtifactError, OSError):
                continue
            start = meta.start_time_s - started_at_s
            end = meta.end_time_s - started_at_s
            inside = index * self.share <= start and end <= (index + 1) * self.share
            if inside and (best is None or end > best[0]):
                best = (end, path)
        return None if best is None else best[1]

    def _run(self) -> None:
        from rankwatch.exporter.cli.heatmap import render_all

        while (job := self._jobs.get()) is not None:
            index, started_at_s = job
            path = self._pick(index, started_at_s)
            if path is None:
                continue
            out_dir = self.options.out / "heatmaps" / f"{index + 1}-{DEEPEP_PHASES[index]}"
            try:
                self.written += render_all(path, out_dir)
            except (ValueError, OSError) as exc:
                print(f"heatmap of {path} failed: {exc}", file=sys.stderr)


def _write_step_windows(
    options: DemoOptions, state: _RunState, config: Any, run_id: str
) -> list[Path]:
    """Step-time window files: one per timeline segment, and the whole run's long window.

    ``rankwatch diagnose`` and ``rankwatch replay`` read them back; each carries the diagnosis
    it had when written, so a replay shows whether the engine still agrees.
    """
    import numpy as np

    from rankwatch.diagnosis.step_time import diagnose_arrays
    from rankwatch.diagnosis.step_time.artifact import save_window

    if not state.rows or not state.segment_of_step:
        return []
    folder = options.out / "step-windows"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config.diagnosis.step_time
    ids = np.array([i for i, _ in state.segment_of_step], dtype=np.float64)
    segs = np.array([k for _, k in state.segment_of_step])
    windows: list[tuple[str, int, str, Any]] = []
    for k, seg in enumerate(options.timeline.segments):
        wanted = ids[segs == k]
        if len(wanted) >= 2:
            windows.append((f"step-window-{k + 1}-{seg.phase}.json", k, seg.phase, wanted))
    windows.append(("step-window-run.json", len(options.timeline.segments), "run", ids))
    written = []
    for name, index, phase, wanted in windows:
        per_rank = {r: rows[np.isin(rows[:, 0], wanted)] for r, rows in state.rows.items()}
        size = int(min(len(wanted), cfg.summary_window_steps))
        if size < 2:
            continue
        report = diagnose_arrays(per_rank, strategy="ddp", window=size, config=cfg)
        meta = {
            "run_id": run_id,
            "window_index": index,
            "phase": phase,
            "straggler_rank": options.straggler_rank,
        }
        written.append(
            save_window(
                folder / name,
                per_rank,
                strategy="ddp",
                window=size,
                config=cfg,
                meta=meta,
                report=report,
            )
        )
    return written
