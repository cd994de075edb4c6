"""OTLP metric exports in a child process, off the training process's interpreter lock.

The OpenTelemetry SDK spends tens of microseconds of Python per exported point (attribute
checks and hashing, aggregation, protobuf encoding), all holding the interpreter lock of the
process that exports. On a group's root that is the training process: a 1,024-rank report is
about 8,000 points, and its export took the training thread 0.3-0.5 s each time (4,096 ranks:
1.1-2.8 s), every ``otlp_export_interval_seconds``. Above ``otlp_process_min_points`` points the
:class:`~.otlp.OtlpPublisher` therefore hands each export's samples to a child process that
owns the MeterProvider and the exporter; the training process only pickles the samples (about
20 ms at 4,096 ranks).

The child is ``python -m rankwatch.exporter.publish.otlp_process``, started when first needed,
with the parent's environment (so the ``OTEL_EXPORTER_OTLP_*`` settings are the same) and the
parent's resource attributes (so its points carry the same identity). It never logs export
failures itself: it returns each export's outcomes and the parent counts and logs them as it
does its own. It ends when asked, and on its own when the parent's end of the pipe closes (the
parent died). A child that cannot start or dies makes :meth:`MetricsProcess.export` return
None, and the publisher exports in its own process again.

Frames in both directions are a 4-byte little-endian length and a pickle; only the parent and
its own child read them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from rankwatch.exporter.child_frames import FrameReader, frame, read_frame

__all__ = ["MetricsProcess", "main"]

log = logging.getLogger("rankwatch.otlp")

_MODULE = "rankwatch.exporter.publish.otlp_process"


class MetricsProcess:
    """The parent's handle on the export child (used by the OTLP worker thread only).

    ``attributes`` and ``schema_url`` are the resource of the parent's points; ``protocol`` is
    the OTLP metrics protocol. Construction starts the child and does not wait for it.
    """

    def __init__(self, attributes: dict[str, Any], schema_url: str, protocol: str) -> None:
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-m", _MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        # Kept after ``_proc`` is let go of (by close() or a failed pipe, on other threads,
        # before they reap it): kill() reaps it whatever those have got to.
        self._child = self._proc
        self._reader = FrameReader()
        self._ready: list[Any] = []
        self._generation = 0
        self._closing = False
        self._send(("setup", attributes, schema_url, protocol))

    @property
    def pid(self) -> int | None:
        """The child's process id, None once it is gone."""
        return None if self._proc is None else self._proc.pid

    def export(
        self, samples: Sequence[tuple[str, tuple[str, ...], float]], timeout_seconds: float
    ) -> list[tuple[str, str]] | None:
        """Export ``samples`` through the child within ``timeout_seconds``.

        Returns the export's outcomes (``("failed", why)`` or ``("succeeded", "")``, as the
        exporter reported them; an export that did not finish in time is a failure), or None
        when the child is gone (then it is reaped and this handle stays closed).
        """
        if self._proc is None:
            return None
        self._generation += 1
        generation = self._generation
        deadline = time.monotonic() + timeout_seconds
        if not self._send(("export", generation, samples, timeout_seconds)):
            return None
        while True:
            reply = self._receive(deadline)
            if reply is None:
                if self._proc is None:
                    return None
                return [("failed", f"no answer within {timeout_seconds:g} s")]
            if reply[0] == "done" and reply[1] == generation:
                return list(reply[2])
            # An answer to an export that had timed out: stale, skip it.

    def close(self, timeout_seconds: float) -> None:
        """Ask the child to shut its provider down and end; kill it after the timeout.

        May run while the worker thread waits in :meth:`export`: that wait then ends as the
        child's pipe closes, quietly.
        """
        self._closing = True
        proc = self._proc
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError):  # already gone
            proc.stdin.write(frame(("close", timeout_seconds)))  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_seconds)
        self._proc = None
        _reap(proc)  # a worker still reading sees the pipe fail, quietly

    def kill(self) -> None:
        """End the child at once and reap it, whatever :meth:`close` (maybe still waiting on
        another thread) has got to. Safe to call when the child is already gone."""
        self._closing = True
        self._proc = None
        _reap(self._child)

    def _send(self, message: object) -> bool:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return False
        try:
            proc.stdin.write(frame(message))
            proc.stdin.flush()
            return True
        except (OSError, ValueError) as exc:  # ValueError: closed by close()
            self._gone(f"its pipe failed ({exc})")
            return False

    def _receive(self, deadline: float) -> tuple[Any, ...] | None:
        """The next frame from the child before ``deadline``; None on timeout or when the
        child is gone."""
        proc = self._proc
        if proc is None or proc.stdout is None:
            return None
        while True:
            if not self._ready:
                self._ready = self._reader.frames()
            if self._ready:
                reply: tuple[Any, ...] = self._ready.pop(0)
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                fd = proc.stdout.fileno()
                ready, _, _ = select.select([fd], [], [], left)
                if not ready:
                    return None
                chunk = os.read(fd, 1 << 16)
            except (OSError, ValueError) as exc:
                self._gone(f"its pipe failed ({exc})")
                return None
            if not chunk:
                code = proc.poll()
                self._gone(
                    "it closed its output" if code is None else f"it exited with status {code}"
                )
                return None
            self._reader.feed(chunk)

    def _gone(self, why: str) -> None:
        if not self._closing:
            log.warning(
                "rankwatch: the OTLP export process is gone (%s); exporting from this process",
                why,
            )
        proc, self._proc = self._proc, None
        if proc is not None:
            _reap(proc)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child if it still runs, wait for it, and close both pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError, ValueError):
                pipe.close()


# ---- the child -------------------------------------------------------------------------------


class _Outcomes:
    """Collects what the exporter reported, for the parent to count and log."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def failed(self, why: str) -> None:
        self.items.append(("failed", why))

    def succeeded(self) -> None:
        self.items.append(("succeeded", ""))

    def take(self) -> list[tuple[str, str]]:
        out, self.items = self.items, []
        return out


def main() -> int:
    """The child: set up from the first frame, then export each frame's samples."""
    # The parent decides when to stop (close, or its end of the pipe closing): a Ctrl-C sent
    # to the whole process group must not kill the export mid-way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent counts and logs each export's outcome; the exporters' own lines (a retry
    # notice per attempt against a collector that is down) would repeat them here.
    logging.disable(logging.CRITICAL)
    from opentelemetry.sdk.resources import Resource

    from rankwatch.exporter.publish.otlp_metrics import OwnMetrics, otlp_metric_exporter

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    setup = read_frame(stdin)
    if setup is None:
        return 0
    _, attributes, schema_url, protocol = setup
    outcomes = _Outcomes()
    metrics = OwnMetrics(Resource(attributes, schema_url), otlp_metric_exporter(protocol), outcomes)
    try:
        while True:
            message = read_frame(stdin)
            if message is None or message[0] == "close":
                timeout = 5.0 if message is None else float(message[1])
                metrics.shutdown(timeout)
                return 0
            _, generation, samples, timeout = message
            metrics.export(samples, timeout)
            stdout.write(frame(("done", generation, outcomes.take())))
            stdout.flush()
    except BrokenPipeError:  # the parent is gone
        return 0


if __name__ == "__main__":
    sys.exit(main())
