"""rankwatch's own OTLP metrics pipeline: the exporter, its failure count, the instruments.

:class:`OwnMetrics` is a ``MeterProvider`` with one observable instrument per catalogue family,
exported when asked (no SDK thread), its exporter wrapped so that a failure is counted and
logged once per outage, never raised. :class:`~.otlp.OtlpPublisher` uses it in its process, and
the export child (:mod:`.otlp_process`) in its own; both import it from here, and neither
imports the other's side.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider, ObservableCounter, ObservableGauge
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource

from rankwatch.exporter.publish.catalogue import CATALOGUE

__all__ = [
    "CARDINALITY_LIMIT",
    "SCOPE_NAME",
    "FailureLog",
    "OwnMetrics",
    "Rows",
    "add_instruments",
    "cardinality_limits",
    "grpc_missing",
    "observations",
    "otlp_metric_exporter",
]

log = logging.getLogger("rankwatch.otlp")

SCOPE_NAME = "rankwatch"
# Far above anything the cell budget lets through; the SDK default (2,000) is not.
CARDINALITY_LIMIT = 1_000_000


def cardinality_limits() -> dict[str, Any]:
    """The reader's keyword raising the SDK's cardinality limit, where the SDK has one (it came
    after 1.39, the floor; before it, the SDK folds nothing into an overflow series)."""
    if "cardinality_limits" not in inspect.signature(PeriodicExportingMetricReader).parameters:
        return {}
    limits = {ObservableGauge: CARDINALITY_LIMIT, ObservableCounter: CARDINALITY_LIMIT}
    return {"cardinality_limits": limits}


class FailureLog:
    """Counts failures and logs the first of each outage (and the recovery)."""

    def __init__(self, exporter: str, where: str, on_failure: Callable[[str], None]) -> None:
        self.exporter, self.where, self.on_failure = exporter, where, on_failure
        self.failing = 0

    def failed(self, why: str) -> None:
        self.on_failure(self.exporter)
        if self.failing == 0:
            log.warning(
                "rankwatch: %s export to %s failed (%s); further failures are counted in "
                "rankwatch_export_failures_total{exporter=%r} and not logged until it recovers",
                self.exporter,
                self.where,
                why,
                self.exporter,
            )
        self.failing += 1

    def succeeded(self) -> None:
        if self.failing:
            log.info(
                "rankwatch: %s export to %s recovered after %d failed attempts",
                self.exporter,
                self.where,
                self.failing,
            )
        self.failing = 0


class _CountingMetricExporter(MetricExporter):
    """Delegates to the real exporter; a failure or exception is counted, never raised."""

    def __init__(self, inner: MetricExporter, failures: FailureLog) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner, self._failures = inner, failures
        self.silent = False  # exports are dropped (a provider shutting down after a hand-over)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        if self.silent:
            return MetricExportResult.SUCCESS
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:  # network errors must never reach the caller
            self._failures.failed(repr(exc))
            return MetricExportResult.FAILURE
        if result is MetricExportResult.SUCCESS:
            self._failures.succeeded()
        else:
            self._failures.failed("the exporter reported a failure")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def grpc_missing(signal: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL / OTEL_EXPORTER_OTLP_{signal}_PROTOCOL: 'grpc' needs the "
        "OTLP gRPC exporter, which is not installed (it is an optional extra): "
        "pip install 'rankwatch[grpc]', or use the default 'http/protobuf' (port 4318)"
    )


def otlp_metric_exporter(protocol: str) -> MetricExporter:
    """The OTLP metric exporter of ``protocol``, configured by the environment."""
    # Imported here: the gRPC stack is slow to import, most jobs never use it, and it is an extra.
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcMetricExporter,
            )
        except ImportError as exc:
            raise grpc_missing("METRICS") from exc

        return GrpcMetricExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )

    return HttpMetricExporter()


Rows = Iterable[tuple[str, tuple[str, ...], float]]  # (family name, label values, value)


def observations(rows: Rows) -> dict[str, list[tuple[float, dict[str, str]]]]:
    """Samples grouped by family, labels as the attribute dicts the instruments report."""
    names: dict[str, tuple[str, ...]] = {spec.name: spec.all_labels for spec in CATALOGUE}
    current: dict[str, list[tuple[float, dict[str, str]]]] = {}
    for name, labels, value in rows:
        current.setdefault(name, []).append((value, dict(zip(names[name], labels, strict=True))))
    return current


def add_instruments(
    meter: Any, current: Callable[[], Mapping[str, list[tuple[float, dict[str, str]]]]]
) -> None:
    """One observable instrument per catalogue family, reporting ``current()``'s samples."""
    for spec in CATALOGUE:

        def observe(_options: CallbackOptions, name: str = spec.name) -> Iterable[Observation]:
            return [Observation(value, attrs) for value, attrs in current().get(name, ())]

        kwargs = {"callbacks": [observe], "unit": spec.otel_unit, "description": spec.help}
        if spec.type == "counter":
            meter.create_observable_counter(spec.otel_name, **kwargs)
        else:
            meter.create_observable_gauge(spec.otel_name, **kwargs)


class OwnMetrics:
    """rankwatch's own MeterProvider: the catalogue's instruments, exported on demand.

    ``failures`` is told of every export's outcome (``failed(why)`` / ``succeeded()``). Used
    by :class:`OtlpPublisher` in its process and by the export child of
    :mod:`.otlp_process`.
    """

    def __init__(self, resource: Resource, exporter: MetricExporter, failures: Any) -> None:
        # An infinite interval: no SDK thread; the caller decides when to collect.
        self._exporter = _CountingMetricExporter(exporter, failures)
        self.reader = PeriodicExportingMetricReader(
            self._exporter,
            export_interval_millis=math.inf,
            **cardinality_limits(),
        )
        self.provider = MeterProvider(
            resource=resource, metric_readers=[self.reader], shutdown_on_exit=False
        )
        self._current: dict[str, list[tuple[float, dict[str, str]]]] = {}
        add_instruments(self.provider.get_meter(SCOPE_NAME), lambda: self._current)

    def export(self, rows: Rows, timeout_seconds: float) -> None:
        """Collect ``rows`` and export them; failures go to ``failures``, never raised."""
        self._current = observations(rows)
        try:
            self.reader.force_flush(timeout_millis=timeout_seconds * 1000)
        except Exception:  # e.g. a collection timeout; counted by the exporter when it exports
            log.debug("rankwatch: OTLP metric collection failed", exc_info=True)

    def shutdown(self, timeout_seconds: float, *, last_export: bool = True) -> None:
        """Shut the provider down, bounded; with ``last_export`` the SDK exports the current
        samples one last time (without: the samples are another exporter's now)."""
        self._exporter.silent = not last_export
        try:
            self.provider.shutdown(timeout_millis=timeout_seconds * 1000)
        except Exception:  # shutting down must not raise into the caller
            log.debug("rankwatch: OTel provider shutdown failed", exc_info=True)
