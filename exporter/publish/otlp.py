"""The push path: OTLP metrics and incident log records, on a thread of their own.

:class:`OtlpPublisher` owns an OpenTelemetry ``MeterProvider`` and ``LoggerProvider`` (by default
not the global ones: the application may have its own; with ``otlp_use_global_providers`` it
uses the application's global providers when they are set, see below) and one worker thread,
``rankwatch-otlp``, that does all network I/O. Nothing else ever waits for the network:

* **Metrics.** One *observable* instrument per catalogue family (gauges, info series and
  counters), each reading the same samples as ``/metrics`` (:mod:`.samples`).
  The worker takes one snapshot of the samples per collection, so every instrument of an export
  describes the same state, then exports every ``otlp_export_interval_seconds``. Observable
  instruments are used on purpose: the synchronous Gauge of some SDK releases forgets its value
  between collections, and a series not observed in a collection is dropped, so departed ranks
  and closed incidents disappear from the push path exactly as from ``/metrics``.
* **Large exports in a child process.** From ``otlp_process_min_points`` points on (2,000:
  a group of a few hundred ranks) each metrics export is handed to a child process
  (:mod:`.otlp_process`) with the same resource and environment: the SDK's Python per point
  would otherwise hold this process's interpreter lock, which the training thread needs.
* **Names.** Instrument names and units come from the catalogue (``MetricSpec.otel_name``,
  ``otel_unit``) so that the standard OTLP-to-Prometheus translation gives back the catalogue's
  Prometheus names: ``rankwatch.phase`` with unit ``s`` becomes ``rankwatch_phase_seconds``, the
  counter ``rankwatch.incidents`` becomes ``rankwatch_incidents_total``, and only ``_ratio``
  families carry unit ``1`` (the translation appends ``_ratio`` to every unit-``1`` gauge).
  Samples are never NaN (the SDK would drop them with a warning). The SDK's default cardinality
  limit (2,000 series per instrument, beyond which points fold into an overflow series) is
  raised: the cell budget already bounds what rankwatch emits, and an EP256 job has 2,048 phase
  series.
* **Events.** Incident openings and closings become log records with an event name (the Events
  API is gone; see :mod:`rankwatch.exporter.publish.events`), exported as they come.
* **Configuration** is the standard one: ``OTEL_EXPORTER_OTLP_[METRICS_|LOGS_]ENDPOINT``,
  ``..._PROTOCOL`` (``http/protobuf``, the default, or ``grpc``), ``..._HEADERS``,
  ``..._TIMEOUT``, ``..._COMPRESSION``, ``..._CERTIFICATE``, ``OTEL_SERVICE_NAME``,
  ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_SDK_DISABLED``, and ``OTEL_METRICS_EXPORTER`` /
  ``OTEL_LOGS_EXPORTER`` = ``none`` to switch a signal off. A signal is exported only when an
  endpoint is configured for it (its own or the general one), so an unconfigured job does not
  spend its life failing to reach ``localhost:4318``.
* **Identity.** The resource carries ``service.name`` (``OTEL_SERVICE_NAME``, else
  ``rankwatch``), a ``service.instance.id`` unique per rank (a UUID; a value given in
  ``OTEL_RESOURCE_ATTRIBUTES`` gets ``-rank<N>`` appended, since every rank of a torchrun job
  shares that variable), ``host.name``, ``process.pid``, and the job identity
  ``rankwatch.run``, ``rankwatch.group``, ``rankwatch.rank``, ``rankwatch.local_rank`` (the
  attempt is a label of every metric point, as on ``/metrics``, and an event attribute).
  Values set in the environment win over these defaults.
* **Global providers.** With ``RANKWATCH_OTLP_USE_GLOBAL_PROVIDERS=1`` and a global
  ``MeterProvider`` / ``LoggerProvider`` set by the application (before rankwatch starts),
  rankwatch registers its instruments on, and emits its incident records through, those
  providers (scope ``rankwatch``): the application's exporters, export schedule and resource
  apply, no endpoint variable is needed, and rankwatch neither shuts them down nor counts their
  export failures. The worker refreshes the samples every ``otlp_export_interval_seconds``; a
  signal whose global provider is not set falls back to rankwatch's own.
* **Failures** (refused, black-holed, rejected) are counted through ``on_failure`` (the hub
  turns that into ``rankwatch_export_failures_total{exporter="otlp_metrics"|"otlp_logs"}``) and
  logged once per outage; the exporters' own per-attempt log lines from this thread are muted.
  :meth:`OtlpPublisher.close` returns within its timeout even if an export hangs: the worker is a
  daemon thread and is abandoned.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import (
    LogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
)
from opentelemetry.sdk.resources import OTELResourceDetector, Resource

import rankwatch
from rankwatch.exporter.config import RankwatchConfig, redacted_url
from rankwatch.exporter.identity import k8s_attributes, node_hostname
from rankwatch.exporter.publish.events import event_log_record
from rankwatch.exporter.publish.incidents import IncidentEvent
from rankwatch.exporter.publish.otlp_metrics import (
    SCOPE_NAME,
    FailureLog,
    OwnMetrics,
    add_instruments,
    grpc_missing,
    observations,
    otlp_metric_exporter,
)
from rankwatch.exporter.publish.otlp_process import MetricsProcess
from rankwatch.exporter.publish.protocol import check_timeout_seconds
from rankwatch.exporter.publish.samples import Sample

__all__ = [
    "OTLP_LOGS",
    "OTLP_METRICS",
    "PROTOCOLS",
    "OtlpPublisher",
    "OtlpSettings",
    "global_logger_provider",
    "global_meter_provider",
    "otel_resource",
    "otlp_settings",
]

log = logging.getLogger("rankwatch.otlp")

OTLP_METRICS = "otlp_metrics"
OTLP_LOGS = "otlp_logs"
PROTOCOLS: tuple[str, ...] = ("http/protobuf", "grpc")
WORKER_NAME = "rankwatch-otlp"
# Incident events waiting for the worker; beyond this the oldest are dropped (and counted).
MAX_PENDING_EVENTS = 256
# Events the worker emits before it looks at the metrics clock again: one, so a log endpoint
# that takes the exporter's whole timeout per record delays a metric export by one timeout.
EVENTS_PER_TURN = 1

# The OTel exporters log every failed attempt; from our worker thread that would be one line per
# interval for as long as a collector is down. We log once per outage instead.
_EXPORTER_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._log_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc._log_exporter",
    "opentelemetry.sdk.metrics._internal.export",
    "opentelemetry.sdk._logs._internal.export",
)


class _MuteWorkerThreads(logging.Filter):
    """Drops records logged from rankwatch's OTLP worker threads (only those)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.threadName or not record.threadName.startswith(WORKER_NAME)


_MUTE = _MuteWorkerThreads()


@dataclass(frozen=True)
class OtlpSettings:
    """Which OTLP signals are on, and over which protocol."""

    metrics: bool
    logs: bool
    metrics_protocol: str = "http/protobuf"
    logs_protocol: str = "http/protobuf"


def _protocol(env: Mapping[str, str], signal: str) -> str:
    name = f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"
    raw = env.get(name) or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    source = name if env.get(name) else "OTEL_EXPORTER_OTLP_PROTOCOL"
    value = raw.strip().lower()
    if value not in PROTOCOLS:
        raise ValueError(
            f"{source}: must be one of {list(PROTOCOLS)} (the OpenTelemetry Python exporters "
            f"have no http/json), got {raw!r}"
        )
    return value


def otlp_settings(env: Mapping[str, str] | None = None) -> OtlpSettings:
    """Read the standard OTel variables: which signals have an endpoint, and their protocols.

    Raises ``ValueError`` naming the variable for an unknown protocol.
    """
    src = os.environ if env is None else env
    if not isinstance(src, Mapping):
        raise TypeError(f"env: expected a mapping of strings, got {type(src).__name__}")
    metrics_protocol = _protocol(src, "METRICS")
    logs_protocol = _protocol(src, "LOGS")
    if src.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return OtlpSettings(False, False, metrics_protocol, logs_protocol)
    general = bool(src.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())
    metrics = general or bool(src.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip())
    logs = general or bool(src.get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "").strip())
    if src.get("OTEL_METRICS_EXPORTER", "").strip().lower() == "none":
        metrics = False
    if src.get("OTEL_LOGS_EXPORTER", "").strip().lower() == "none":
        logs = False
    return OtlpSettings(metrics, logs, metrics_protocol, logs_protocol)


def otel_resource(
    config: RankwatchConfig,
    *,
    rank: int = 0,
    local_rank: int = 0,
    hostname: str | None = None,
) -> Resource:
    """The OTel resource of this rank (see the module docstring); environment values win."""
    if not isinstance(config, RankwatchConfig):
        raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
    for name, value in (("rank", rank), ("local_rank", local_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    host = (hostname if hostname is not None else node_hostname(config.node_name_env)).lower()
    from_env = dict(OTELResourceDetector().detect().attributes)
    ours: dict[str, Any] = {
        "service.name": "rankwatch",
        "service.version": rankwatch.__version__,
        **k8s_attributes(config.node_name_env),
        "host.name": host,
        "process.pid": os.getpid(),
        "rankwatch.group": config.group_name,
        "rankwatch.rank": rank,
        "rankwatch.local_rank": local_rank,
    }
    if config.run_id:
        ours["rankwatch.run"] = config.run_id
    for key in from_env:
        ours.pop(key, None)
    given = from_env.get("service.instance.id")
    ours["service.instance.id"] = f"{given}-rank{rank}" if given else str(uuid.uuid4())
    return Resource.create(ours)


class _CountingLogExporter(LogRecordExporter):
    """Delegates to the real log exporter; a failure or exception is counted, never raised."""

    def __init__(self, inner: LogRecordExporter, failures: FailureLog) -> None:
        self._inner, self._failures = inner, failures

    def export(self, batch: Sequence[Any]) -> LogRecordExportResult:
        try:
            result = self._inner.export(batch)
        except Exception as exc:
            self._failures.failed(repr(exc))
            return LogRecordExportResult.FAILURE
        if result is LogRecordExportResult.SUCCESS:
            self._failures.succeeded()
        else:
            self._failures.failed("the exporter reported a failure")
        return result

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._inner.shutdown()


def _log_exporter(protocol: str) -> LogRecordExporter:
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc._log_exporter import (
                OTLPLogExporter as GrpcLogExporter,
            )
        except ImportError as exc:
            raise grpc_missing("LOGS") from exc

        return GrpcLogExporter()
    from opentelemetry.exporter.otlp.proto.http._log_exporter import (
        OTLPLogExporter as HttpLogExporter,
    )

    return HttpLogExporter()


def _endpoint_of(exporter: Any) -> str:
    """The exporter's endpoint as failure logs may print it (credentials hidden)."""
    for attr in ("_endpoint", "_endpoint_url"):
        value = getattr(exporter, attr, None)
        if isinstance(value, str):
            return redacted_url(value)
    return type(exporter).__name__


class OtlpPublisher:
    """OTLP metrics from ``source()`` and incident log records, exported by one worker thread.

    ``source`` returns the current samples (it is called on the worker thread once per export).
    ``on_failure(exporter)`` is called once per failed export attempt (``otlp_metrics``,
    ``otlp_logs``) and once per incident event dropped from a full queue (``otlp_logs``).
    ``settings`` defaults to :func:`otlp_settings` of the environment; ``metric_exporter`` /
    ``log_exporter`` replace the OTLP exporters (for another back-end). :meth:`emit` and
    :meth:`request_export` never block; :meth:`flush` and :meth:`close` are bounded.
    """

    def __init__(
        self,
        config: RankwatchConfig,
        source: Callable[[], Sequence[Sample]],
        *,
        rank: int = 0,
        local_rank: int = 0,
        hostname: str | None = None,
        on_failure: Callable[[str], None] | None = None,
        settings: OtlpSettings | None = None,
        metric_exporter: MetricExporter | None = None,
        log_exporter: LogRecordExporter | None = None,
    ) -> None:
        if not isinstance(config, RankwatchConfig):
            raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
        if not callable(source):
            raise TypeError(f"source: expected a callable returning samples, got {source!r}")
        if on_failure is not None and not callable(on_failure):
            raise TypeError(f"on_failure: expected a callable or None, got {on_failure!r}")
        if settings is None:
            settings = otlp_settings()
        elif not isinstance(settings, OtlpSettings):
            raise TypeError(f"settings: expected OtlpSettings, got {type(settings).__name__}")
        self.config = config
        self.settings = settings
        self._source = source
        self._on_failure = on_failure or (lambda _name: None)
        self.resource = otel_resource(config, rank=rank, local_rank=local_rank, hostname=hostname)
        self.interval_seconds = config.otlp_export_interval_seconds

        for name in _EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(_MUTE)

        self._current: dict[str, list[tuple[float, dict[str, str]]]] = {}
        self._meter_provider: MeterProvider | None = None
        self._own: OwnMetrics | None = None
        self._metric_failures: FailureLog | None = None
        self._process: MetricsProcess | None = None
        # The child as started, kept after the worker lets go of it: close() ends it whatever
        # the worker has got to.
        self._started_process: MetricsProcess | None = None
        self._process_allowed = False
        # The application's global providers, when configured to use them and they are set:
        # rankwatch then only adds instruments / emits records; their exporters, schedule and
        # resource are the application's, and their shutdown too.
        self._global_meter_provider: Any = None
        self._global_logger_provider: Any = None
        use_global = config.otlp_use_global_providers
        if use_global and metric_exporter is None:
            self._global_meter_provider = global_meter_provider()
        if use_global and log_exporter is None:
            self._global_logger_provider = global_logger_provider()
        if self._global_meter_provider is not None:
            meter = self._global_meter_provider.get_meter(SCOPE_NAME, rankwatch.__version__)
            add_instruments(meter, lambda: self._current)
        elif settings.metrics or metric_exporter is not None:
            inner = metric_exporter or otlp_metric_exporter(settings.metrics_protocol)
            self._metric_failures = FailureLog(OTLP_METRICS, _endpoint_of(inner), self._on_failure)
            self._own = OwnMetrics(self.resource, inner, self._metric_failures)
            self._meter_provider = self._own.provider
            # Large exports run in a child process (see .otlp_process), configured like this
            # one by the environment: not with an exporter object handed in.
            self._process_allowed = metric_exporter is None and config.otlp_process_min_points > 0

        self._logger_provider: LoggerProvider | None = None
        self._otel_logger: Any = None
        self._log_failures = FailureLog(OTLP_LOGS, "the global LoggerProvider", self._on_failure)
        if self._global_logger_provider is not None:
            self._otel_logger = self._global_logger_provider.get_logger(
                SCOPE_NAME, rankwatch.__version__
            )
        elif settings.logs or log_exporter is not None:
            inner_log = log_exporter or _log_exporter(settings.logs_protocol)
            self._log_failures = FailureLog(OTLP_LOGS, _endpoint_of(inner_log), self._on_failure)
            self._logger_provider = LoggerProvider(resource=self.resource, shutdown_on_exit=False)
            # Synchronous processor: the export runs on our worker thread, which emits.
            self._logger_provider.add_log_record_processor(
                SimpleLogRecordProcessor(_CountingLogExporter(inner_log, self._log_failures))
            )
            self._otel_logger = self._logger_provider.get_logger(SCOPE_NAME)

        self._cond = threading.Condition()
        self._events: deque[IncidentEvent] = deque()
        self._stop = False
        self._requested = 0  # export generations asked for
        self._completed = 0  # export generations finished
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=WORKER_NAME, daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        """True when at least one signal is exported."""
        return self._meter_provider is not None or self._otel_logger is not None

    @property
    def uses_global_providers(self) -> tuple[bool, bool]:
        """(metrics, logs): whether each signal goes through the application's global provider."""
        return (self._global_meter_provider is not None, self._global_logger_provider is not None)

    @property
    def export_process_pid(self) -> int | None:
        """Process id of the child exporting the metrics, None while they export here."""
        return None if self._process is None else self._process.pid

    # -- producer side (any thread; never blocks on the network) ----------------------------

    def emit(self, event: IncidentEvent) -> None:
        """Queue an incident event for export as a log record."""
        if not isinstance(event, IncidentEvent):
            raise TypeError(f"event: expected IncidentEvent, got {type(event).__name__}")
        if self._otel_logger is None:
            return
        with self._cond:
            if self._stop:
                return
            if len(self._events) >= MAX_PENDING_EVENTS:
                self._events.popleft()
                self._on_failure(OTLP_LOGS)
            self._events.append(event)
            self._cond.notify_all()

    def request_export(self) -> int:
        """Ask for a metrics export as soon as the worker is free; returns its generation."""
        with self._cond:
            self._requested += 1
            self._cond.notify_all()
            return self._requested

    def flush(self, timeout_seconds: float = 10.0) -> bool:
        """Export pending events and the current metrics now; True if done within the timeout."""
        check_timeout_seconds(timeout_seconds)
        deadline = time.monotonic() + timeout_seconds
        generation = self.request_export()
        with self._cond:
            while self._completed < generation:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_seconds: float | None = None) -> None:
        """One last export if time allows, then shut the providers down; bounded by
        ``timeout_seconds`` (default: the configured ``shutdown_timeout_seconds``)."""
        if timeout_seconds is None:
            timeout_seconds = self.config.shutdown_timeout_seconds
        check_timeout_seconds(timeout_seconds)
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        # Leave a little of the budget for the providers' own shutdown.
        self._thread.join(max(0.0, (deadline - time.monotonic()) * 0.8))

        def shutdown() -> None:
            child = self._process
            if child is not None:
                child.close(max(0.0, deadline - time.monotonic()))
            if self._own is not None:
                left = max(0.0, deadline - time.monotonic())
                self._own.shutdown(left, last_export=child is None)
            if self._logger_provider is not None:
                try:
                    self._logger_provider.shutdown()
                except Exception:  # shutting down must not raise into the caller
                    log.debug("rankwatch: OTel provider shutdown failed", exc_info=True)

        closer = threading.Thread(target=shutdown, name=f"{WORKER_NAME}-close", daemon=True)
        closer.start()
        closer.join(max(0.0, deadline - time.monotonic()))
        # The closer's own kill comes only after its wait for the child ends, a moment after
        # this join gives up: kill the child here so that nothing of ours outlives close().
        child = self._started_process
        if child is not None:
            child.kill()

    # -- worker side ------------------------------------------------------------------------

    def _samples(self) -> Sequence[Sample]:
        try:
            return self._source()
        except Exception:
            log.exception("rankwatch: reading the samples for OTLP failed")
            return []

    def _export_metrics(self, requested: bool = False) -> None:
        if self._global_meter_provider is not None:
            # The application's reader collects on its own schedule from the latest snapshot;
            # an explicit flush (close, flush()) pushes it through the application's provider.
            self._current = observations(self._samples())
            if requested:
                try:
                    self._global_meter_provider.force_flush(
                        timeout_millis=self.interval_seconds * 1000
                    )
                except Exception:
                    log.debug("rankwatch: flushing the global MeterProvider failed", exc_info=True)
            return
        if self._own is None:
            return
        samples = self._samples()
        if (
            self._process is None
            and self._process_allowed
            and len(samples) >= self.config.otlp_process_min_points
        ):
            self._start_process(len(samples))
        if self._process is not None and self._export_in_child(samples):
            return
        self._own.export(samples, self.interval_seconds)

    def _start_process(self, points: int) -> None:
        self._process_allowed = False  # one child for the life of the publisher
        try:
            self._process = self._started_process = MetricsProcess(
                dict(self.resource.attributes),
                self.resource.schema_url,
                self.settings.metrics_protocol,
            )
        except OSError as exc:
            log.warning("rankwatch: cannot start the OTLP export process (%s)", exc)
            return
        if self._process.pid is None:  # gone already (warned): export here
            self._process = None
            return
        log.info(
            "rankwatch: OTLP exports of %d points and more run in a child process (pid %d)",
            points,
            self._process.pid,
        )

    def _export_in_child(self, samples: Sequence[Sample]) -> bool:
        """True if the child took the export (its outcomes are counted here)."""
        assert self._process is not None and self._metric_failures is not None
        rows = [(s.name, s.labels, s.value) for s in samples]
        outcomes = self._process.export(rows, self.interval_seconds)
        if outcomes is None:
            self._process = None
            return False
        for kind, why in outcomes:
            if kind == "failed":
                self._metric_failures.failed(why)
            else:
                self._metric_failures.succeeded()
        return True

    def _emit_events(self, events: list[IncidentEvent]) -> None:
        for event in events:
            try:
                self._otel_logger.emit(event_log_record(event))
            except Exception as exc:
                self._log_failures.failed(repr(exc))

    def _run(self) -> None:
        next_export = time.monotonic() + self.interval_seconds
        while True:
            with self._cond:
                while (
                    not self._stop
                    and not self._events
                    and self._requested == self._completed
                    and time.monotonic() < next_export
                ):
                    self._cond.wait(max(0.0, next_export - time.monotonic()))
                # Not the whole queue at once: each event may take the exporter's full timeout
                # against a stuck log endpoint, and metric exports must keep their interval
                # meanwhile; events not yet taken stay under the queue's bound.
                n = min(len(self._events), EVENTS_PER_TURN)
                events = [self._events.popleft() for _ in range(n)]
                drained = not self._events
                stop = self._stop and drained
                target = self._requested
            if events:
                self._emit_events(events)
            requested = stop or (drained and target > self._completed)
            if requested or time.monotonic() >= next_export:
                self._export_metrics(requested)
                next_export = time.monotonic() + self.interval_seconds
            with self._cond:
                if drained:  # a flush covers the events queued before it: all emitted now
                    self._completed = max(self._completed, target)
                self._cond.notify_all()
            if stop:
                return


def _is_set(provider: Any, *placeholders: str) -> bool:
    # The API hands out a proxy (or a no-op) until the application sets a provider.
    return provider is not None and type(provider).__name__ not in placeholders


def global_meter_provider() -> Any:
    """The application's global MeterProvider, or None while none has been set."""
    from opentelemetry import metrics

    provider = metrics.get_meter_provider()
    return provider if _is_set(provider, "_ProxyMeterProvider", "NoOpMeterProvider") else None


def global_logger_provider() -> Any:
    """The application's global LoggerProvider, or None while none has been set."""
    from opentelemetry import _logs

    provider = _logs.get_logger_provider()
    return provider if _is_set(provider, "ProxyLoggerProvider", "NoOpLoggerProvider") else None
