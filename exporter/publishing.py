"""The publishing hub: every window report to ``/metrics``, OTLP and log lines, off the caller's
thread.

:class:`PublisherHub` implements the :class:`~rankwatch.exporter.publisher.Publisher` protocol.
``publish(report)`` only hands the report over and returns at once: a bounded queue
(``MAX_QUEUED_REPORTS``) where the newest report wins, so a burst of windows is still fed to the
incident tracker in order while a stuck hub can never hold more than a few reports (the oldest
one dropped is counted in ``rankwatch_export_failures_total{exporter="publish_queue"}``). The
hub's thread then

1. feeds the report to the :class:`~rankwatch.exporter.incidents.IncidentTracker`,
2. swaps in the new latest state, which ``/metrics`` scrapes and OTLP collections read (both
   through :func:`~rankwatch.exporter.samples.build_samples`, so they cannot disagree),
3. writes each incident event as one log line (JSON by default, on the ``rankwatch.incidents``
   logger: openings at WARNING, closings at INFO) and queues it for OTLP as a log record.

Network I/O happens only on the OTLP worker thread and the HTTP server's threads, so an
unreachable or black-holed collector costs the training loop nothing; its failures are counted
and logged once. ``close(timeout_seconds)`` is bounded: it stops the hub thread, gives OTLP one
last export within what is left of the budget, and stops the HTTP server.

:func:`default_publishers` builds what a training process needs from the configuration.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from rankwatch.diagnosis.window_report import WindowReport

from .config import RankwatchConfig
from .events import event_json, event_message
from .incidents import IncidentEvent, IncidentSnapshot, IncidentTracker
from .otlp import OTLP_LOGS, OTLP_METRICS, OtlpPublisher, OtlpSettings, otlp_settings
from .prometheus import MetricsServer, SampleParts, start_metrics_server
from .publisher import Publisher
from .samples import ExporterHealth, Sample, clock_samples, report_samples, state_samples

__all__ = [
    "MAX_QUEUED_REPORTS",
    "PUBLISH_QUEUE",
    "HealthCounters",
    "LatestState",
    "PublisherHub",
    "default_publishers",
]

log = logging.getLogger("rankwatch.publishing")
event_log = logging.getLogger("rankwatch.incidents")

PUBLISH_QUEUE = "publish_queue"
# Reports waiting for the hub thread; beyond this the oldest is dropped (and counted).
MAX_QUEUED_REPORTS = 8


class HealthCounters:
    """The exporter's own counters; any thread may count, readers get immutable snapshots."""

    def __init__(self, started_at_s: float, exporters: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self.started_at_s = started_at_s
        self._failures: dict[str, int] = dict.fromkeys(exporters, 0)
        self._collection: dict[str, int] = {}
        self._invalid: dict[str, int] = {}

    @staticmethod
    def _key(kind: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{kind}: expected a non-empty string, got {value!r}")
        return value

    def export_failed(self, exporter: str) -> None:
        """One failed export attempt (or dropped item) of ``exporter``."""
        key = self._key("exporter", exporter)
        with self._lock:
            self._failures[key] = self._failures.get(key, 0) + 1

    def collection_error(self, reason: str) -> None:
        """One failure to gather or form a window."""
        key = self._key("reason", reason)
        with self._lock:
            self._collection[key] = self._collection.get(key, 0) + 1

    def window_invalid(self, reason: str) -> None:
        """One DeepEP window (normal or low-latency) rejected before diagnosis."""
        key = self._key("reason", reason)
        with self._lock:
            self._invalid[key] = self._invalid.get(key, 0) + 1

    def snapshot(self, up: bool = True) -> ExporterHealth:
        """The counters as they are now."""
        with self._lock:
            return ExporterHealth(
                started_at_s=self.started_at_s,
                up=up,
                export_failures=dict(self._failures),
                collection_errors=dict(self._collection),
                window_invalid=dict(self._invalid),
            )


class LatestState:
    """The latest published state, read by ``/metrics`` scrapes and OTLP collections.

    ``update`` (hub thread) swaps in a new report and incident snapshot in one assignment;
    readers on other threads always see a consistent pair. The report's samples are computed
    once per report; incident, health and clock samples at every read.
    """

    def __init__(
        self,
        config: RankwatchConfig,
        health: HealthCounters,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(config, RankwatchConfig):
            raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
        self.config, self.health, self.clock = config, health, clock
        empty: list[Sample] = []
        self._latest: tuple[WindowReport | None, list[Sample], IncidentSnapshot] = (
            None,
            empty,
            IncidentSnapshot(),
        )

    def update(self, report: WindowReport, incidents: IncidentSnapshot) -> None:
        """Make ``report`` (and the incidents as of it) the state every reader sees."""
        if not isinstance(report, WindowReport):
            raise TypeError(f"report: expected WindowReport, got {type(report).__name__}")
        if not isinstance(incidents, IncidentSnapshot):
            raise TypeError(f"incidents: expected IncidentSnapshot, got {type(incidents).__name__}")
        self._latest = (report, report_samples(report, self.config), incidents)

    @property
    def report(self) -> WindowReport | None:
        """The latest published window report (None before the first)."""
        return self._latest[0]

    @property
    def incidents(self) -> IncidentSnapshot:
        """The incidents as of the latest report."""
        return self._latest[2]

    def parts(self) -> SampleParts:
        """(per-report samples, the same list object until the next report; the rest, fresh)."""
        report, per_report, incidents = self._latest
        fresh = state_samples(report, incidents, self.health.snapshot(), self.config)
        fresh += clock_samples(report, self.config, self.clock())
        return per_report, fresh

    def samples(self) -> list[Sample]:
        """Every sample of the latest state (what :func:`build_samples` returns for it)."""
        per_report, fresh = self.parts()
        return list(per_report) + list(fresh)


class PublisherHub:
    """Publishes window reports to Prometheus, OTLP and log lines from a thread of its own.

    ``metrics=False`` skips the HTTP endpoint (else it follows ``config.metrics_enabled``);
    ``otlp`` overrides the OTLP settings read from the environment (``None``: read them;
    ``False``: no OTLP). ``rank`` and ``hostname`` identify this process in OTLP resources
    (defaults: ``$RANK`` and the host name). ``clock`` gives unix seconds (tests pin it).
    """

    def __init__(
        self,
        config: RankwatchConfig,
        *,
        local_rank: int = 0,
        rank: int | None = None,
        hostname: str | None = None,
        metrics: bool | None = None,
        otlp: OtlpSettings | bool | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(config, RankwatchConfig):
            raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
            raise ValueError(f"local_rank: expected an int >= 0, got {local_rank!r}")
        if rank is None:
            rank = _env_int("RANK", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank: expected an int >= 0, got {rank!r}")
        if not callable(clock):
            raise TypeError(f"clock: expected a callable returning unix seconds, got {clock!r}")
        if otlp is True:
            raise ValueError("otlp: expected OtlpSettings, False or None, got True")
        settings: OtlpSettings | None
        if otlp is None:
            settings = otlp_settings() if config.otlp_enabled else None
        elif otlp is False:
            settings = None
        elif isinstance(otlp, OtlpSettings):
            settings = otlp
        else:
            raise TypeError(f"otlp: expected OtlpSettings, False or None, got {otlp!r}")
        if settings is not None and not (settings.metrics or settings.logs):
            settings = None

        self.config = config
        self.hostname = (hostname if hostname is not None else socket.gethostname()).lower()
        exporters = [PUBLISH_QUEUE]
        if settings is not None:
            signals = ((OTLP_METRICS, settings.metrics), (OTLP_LOGS, settings.logs))
            exporters += [name for name, on in signals if on]
        self.health = HealthCounters(clock(), exporters)
        self.state = LatestState(config, self.health, clock)
        self.tracker = IncidentTracker.from_config(config)

        self.metrics_server: MetricsServer | None = None
        self.otlp: OtlpPublisher | None = None
        if config.metrics_enabled if metrics is None else metrics:
            self.metrics_server = start_metrics_server(config, local_rank, self.state.parts)
        try:
            if settings is not None:
                self.otlp = OtlpPublisher(
                    config,
                    self.state.samples,
                    rank=rank,
                    local_rank=local_rank,
                    hostname=self.hostname,
                    on_failure=self.health.export_failed,
                    settings=settings,
                )
        except BaseException:
            if self.metrics_server is not None:
                self.metrics_server.close(1.0)
            raise

        self._cond = threading.Condition()
        self._pending: deque[WindowReport] = deque()
        self._received = 0  # reports accepted by publish()
        self._handled = 0  # reports taken off the queue (published or replaced)
        self._closing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rankwatch-publish", daemon=True)
        self._thread.start()

    # -- Publisher protocol -----------------------------------------------------------------

    def publish(self, report: WindowReport) -> None:
        """Hand over one window report; returns at once (when the queue is full the oldest
        waiting report is dropped: the newest wins)."""
        if not isinstance(report, WindowReport):
            raise TypeError(f"report: expected WindowReport, got {type(report).__name__}")
        with self._cond:
            if self._closing:
                return
            if len(self._pending) >= MAX_QUEUED_REPORTS:
                self._pending.popleft()
                self.health.export_failed(PUBLISH_QUEUE)
                self._handled += 1
            self._pending.append(report)
            self._received += 1
            self._cond.notify_all()

    def close(self, timeout_seconds: float | None = None) -> None:
        """Stop within ``timeout_seconds`` (default ``config.shutdown_timeout_seconds``)."""
        if timeout_seconds is None:
            timeout_seconds = self.config.shutdown_timeout_seconds
        _check_timeout(timeout_seconds)
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        # The hub thread only computes (milliseconds per report); it ends as soon as the reports
        # already handed over are published.
        self._thread.join(max(0.0, (deadline - time.monotonic()) * 0.25))
        if self.otlp is not None:
            # Keep a little for the HTTP server's shutdown (it polls every 0.1 s).
            self.otlp.close(max(0.0, deadline - time.monotonic() - 0.3))
        if self.metrics_server is not None:
            self.metrics_server.close(max(0.0, deadline - time.monotonic()))

    # -- extras -----------------------------------------------------------------------------

    def count_collection_error(self, reason: str) -> None:
        """Count a failure to gather or form a window (``rankwatch_collection_errors_total``)."""
        self.health.collection_error(reason)

    def flush(self, timeout_seconds: float = 10.0) -> bool:
        """Wait until every report handed over so far is published and OTLP has exported it.

        For tests and for a final export before shutdown; True if done within the timeout.
        """
        _check_timeout(timeout_seconds)
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            target = self._received
            while self._handled < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        if self.otlp is not None:
            return self.otlp.flush(max(0.0, deadline - time.monotonic()))
        return True

    @property
    def metrics_url(self) -> str | None:
        """URL of ``/metrics``, or None without the HTTP endpoint."""
        return None if self.metrics_server is None else self.metrics_server.url

    # -- the hub thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                report = self._pending.popleft() if self._pending else None
                closing = self._closing and not self._pending
            if report is not None:
                try:
                    self._handle(report)
                except Exception:  # one bad report must not stop publishing
                    log.exception("rankwatch: publishing window %s failed", report.window_index)
                with self._cond:
                    self._handled += 1
                    self._cond.notify_all()
            if closing:
                return

    def _handle(self, report: WindowReport) -> None:
        events = self.tracker.update(report)
        for reason in (report.normal_invalid_reason, report.low_latency_invalid_reason):
            if reason:
                self.health.window_invalid(reason)
        self.state.update(report, self.tracker.snapshot())
        for event in events:
            self._log_event(event)
            if self.otlp is not None:
                self.otlp.emit(event)

    def _log_event(self, event: IncidentEvent) -> None:
        level = logging.WARNING if event.action == "open" else logging.INFO
        line = event_json(event) if self.config.log_json else event_message(event)
        event_log.log(level, line)


def default_publishers(config: RankwatchConfig, local_rank: int) -> list[Publisher]:
    """What a training process publishes through, as configured: one :class:`PublisherHub`
    (``/metrics`` on port base + ``local_rank`` when enabled, OTLP when an endpoint is set,
    incident log lines), or nothing when rankwatch is disabled."""
    if not isinstance(config, RankwatchConfig):
        raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank: expected an int >= 0, got {local_rank!r}")
    if not config.enabled:
        return []
    return [PublisherHub(config, local_rank=local_rank)]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {raw!r}")
    return value


def _check_timeout(timeout_seconds: Any) -> None:
    if (
        isinstance(timeout_seconds, bool)
        or not isinstance(timeout_seconds, (int, float))
        or not math.isfinite(timeout_seconds)
        or timeout_seconds < 0
    ):
        raise ValueError(f"timeout_seconds: expected a finite number >= 0, got {timeout_seconds!r}")
