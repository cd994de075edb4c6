"""The publishing hub: every window report to ``/metrics``, OTLP and log lines, off the caller's
thread.

:class:`PublisherHub` implements the :class:`~.protocol.Publisher` protocol.
``publish(report)`` only hands the report over and returns at once: a bounded queue
(``MAX_QUEUED_REPORTS``) where the newest report wins, so a burst of windows is still fed to the
incident trackers in order while a stuck hub can never hold more than a few reports (the oldest
one dropped is counted in ``rankwatch_export_failures_total{exporter="publish_queue"}``). The
hub's thread then

1. feeds the report to the :class:`~.incidents.IncidentTracker` of its group,
2. folds it into the latest state of its group (:class:`LatestState`), which ``/metrics`` scrapes
   and OTLP collections read (both through the same samples, so they cannot disagree),
3. writes each incident event as one log line (JSON by default, on the ``rankwatch.incidents``
   logger, openings and closings both at WARNING, both naming the incident id) and queues it
   for OTLP as a log record.

``close`` ends every incident still open when the run stops with a closing of reason
``run ended`` (log line, OTLP record, ``on_incident``), so every opening has its closing.

One hub serves every collector of a process at once: the step-time collector (group ``world``,
say) and the DeepEP collector (group ``ep``) may hand their reports to the same hub, and
``/metrics`` and OTLP carry both sets of series side by side. The state is kept per group
(``report.group``, else ``config.group_name``), and within a group per engine: a step-time
report replaces the step-time series of its group and leaves the DeepEP series of the group
alone, and the other way round. Incidents are tracked per group, so each group keeps its own
k-of-n and m-clean windows.

Network I/O happens only on the OTLP worker thread and the HTTP server's threads, so an
unreachable or black-holed collector costs the training loop nothing; its failures are counted
and logged once. ``close(timeout_seconds)`` is bounded: it stops the hub thread, gives OTLP one
last export within what is left of the budget, and stops the HTTP server.

:func:`default_publishers` builds what a training process needs from the configuration.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time.report import RANK_MEAN_KEYS
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.identity import node_hostname, rank_from_env
from rankwatch.exporter.publish.events import event_json, event_message
from rankwatch.exporter.publish.incidents import (
    CLOSED_RUN_ENDED,
    IncidentEvent,
    IncidentSnapshot,
    IncidentTracker,
)
from rankwatch.exporter.publish.otlp import (
    OTLP_LOGS,
    OTLP_METRICS,
    OtlpPublisher,
    OtlpSettings,
    global_logger_provider,
    global_meter_provider,
    otlp_settings,
)
from rankwatch.exporter.publish.prometheus import MetricsServer, SampleParts, start_metrics_server
from rankwatch.exporter.publish.protocol import Publisher, check_timeout_seconds
from rankwatch.exporter.publish.recorder import RunRecorder
from rankwatch.exporter.publish.samples import (
    ENGINES,
    ExporterHealth,
    Sample,
    clock_samples,
    engine_samples,
    health_samples,
    incident_samples,
    own_means_samples,
    window_invalid_samples,
    window_samples,
)
from rankwatch.exporter.storage import storage_error_counts

__all__ = [
    "MAX_GROUPS",
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
# Groups one hub keeps a state (and an incident tracker) for; beyond this the group that
# published least recently is forgotten. A process has a handful (world, ep, a few DP groups).
MAX_GROUPS = 64


class HealthCounters:
    """The exporter's own counters; any thread may count, readers get immutable snapshots."""

    def __init__(self, started_at_s: float, exporters: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self.started_at_s = started_at_s
        self._failures: dict[str, int] = dict.fromkeys(exporters, 0)
        self._collection: dict[str, int] = {}

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

    def snapshot(self, up: bool = True) -> ExporterHealth:
        """The counters as they are now.

        Rejected DeepEP windows are not among them: they belong to a group and are counted in
        that group's :class:`LatestState`.
        """
        with self._lock:
            return ExporterHealth(
                started_at_s=self.started_at_s,
                up=up,
                export_failures=dict(self._failures),
                collection_errors=dict(self._collection),
                storage_errors=storage_error_counts(),
            )


def _carries(report: WindowReport, engine: str) -> bool:
    """Whether ``report`` has an outcome of ``engine``: a result, or a reason it was rejected."""
    if engine == "step_time":
        return report.step_time is not None
    if engine == "normal":
        return report.normal is not None or report.normal_invalid_reason is not None
    return report.low_latency is not None or report.low_latency_invalid_reason is not None


@dataclass(frozen=True)
class _Part:
    """One engine's part of a group's state: the report it came from and that part's samples,
    computed once per report (and labelled with that report's ranks)."""

    source: WindowReport | None
    samples: list[Sample]


_NO_PART = _Part(None, [])


@dataclass(frozen=True)
class _GroupState:
    """The latest state of one group; immutable, replaced as a whole."""

    report: WindowReport  # the merged view (see LatestState)
    parts: tuple[_Part, ...]  # one per ENGINES, in that order
    window: list[Sample]  # samples of the window itself, from the merged view
    incidents: IncidentSnapshot
    invalid: Mapping[str, int]  # DeepEP windows of this group rejected so far, by reason


@dataclass(frozen=True)
class _View:
    """Everything readers see, swapped in one assignment."""

    groups: dict[str, _GroupState]  # least recently updated first (eviction order)
    newest: WindowReport | None
    # The per-report samples of every group (sorted by group), one list object per update.
    per_report: list[Sample]
    # This rank's own series per group, when its group's root does not publish them (a group
    # larger than the root's rank budget): see ``set_own_means``.
    own: dict[str, list[Sample]] = field(default_factory=dict)


def _merged(report: WindowReport, parts: Sequence[_Part], prev: _GroupState | None) -> WindowReport:
    """``report`` with each engine's outcome taken from the part's source report, and the
    diagnosis times of every engine seen in the group (the newest per engine)."""
    seconds = dict(prev.report.diagnosis_seconds) if prev is not None else {}
    seconds.update(report.diagnosis_seconds)
    step, normal, low = (part.source for part in parts)
    if all(src is None or src is report for src in (step, normal, low)) and (
        seconds == report.diagnosis_seconds
    ):
        return report  # nothing taken from an earlier report
    return replace(
        report,
        step_time=None if step is None else step.step_time,
        normal=None if normal is None else normal.normal,
        normal_invalid_reason=None if normal is None else normal.normal_invalid_reason,
        low_latency=None if low is None else low.low_latency,
        low_latency_invalid_reason=None if low is None else low.low_latency_invalid_reason,
        diagnosis_seconds=seconds,
    )


def _per_report(groups: Mapping[str, _GroupState], own: Mapping[str, list[Sample]]) -> list[Sample]:
    per_report: list[Sample] = []
    for g in sorted(groups):
        for part in groups[g].parts:
            per_report += part.samples
        per_report += groups[g].window
    for g in sorted(own):
        per_report += own[g]
    return per_report


class LatestState:
    """The latest published state of every group, read by ``/metrics`` scrapes and OTLP
    collections.

    **Per group.** A report belongs to the group ``report.group`` (``config.group_name`` when
    empty). Each group keeps its own state, so the step-time collector's group and the DeepEP
    collector's group are published side by side, each with its own ``group`` label. At most
    :data:`MAX_GROUPS` groups are kept: a group that has not published for a long time stays (its
    series and a growing ``rankwatch_window_age_seconds``, which is what the stale-window alert
    needs) until a new group beyond the bound replaces the group that published least recently.

    **Per engine within a group.** The step-time part (``step_time``) comes from the newest report
    of the group that carries one, the normal-mode part (``normal``, ``normal_invalid_reason``)
    from the newest that carries a normal-mode outcome, the low-latency part (``low_latency``,
    ``low_latency_invalid_reason``) likewise; window index, timestamp, run, kind, ranks and
    missing ranks come from the newest report of the group, and ``diagnosis_seconds`` keeps the
    newest time of every engine. An engine's series are rebuilt only from that engine's reports:
    a rank that left the group loses its series at the group's next window of that engine. A
    ``summary`` window (published once at shutdown) is folded in like any other report; the
    incident trackers ignore it.

    **Caching.** Each engine's samples are computed once per report that carries it and reused
    while later reports of the group leave that engine alone; incident, health and age samples
    are rebuilt at every read.

    **Threads.** ``update`` runs on the hub thread and swaps in a new immutable view in one
    assignment; readers on other threads always see a consistent state.
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
        self._view = _View({}, None, [])
        # Two writers (the hub thread's reports, the collector thread's own means): each swaps
        # in a view made from the one before.
        self._write_lock = threading.Lock()

    def group_of(self, report: WindowReport) -> str:
        """The group ``report`` is kept under (and published with): its own, else the config's."""
        return report.group or self.config.group_name

    def update(self, report: WindowReport, incidents: IncidentSnapshot) -> None:
        """Fold ``report`` into its group's state, with ``incidents`` (its group's, as of it)."""
        if not isinstance(report, WindowReport):
            raise TypeError(f"report: expected WindowReport, got {type(report).__name__}")
        if not isinstance(incidents, IncidentSnapshot):
            raise TypeError(f"incidents: expected IncidentSnapshot, got {type(incidents).__name__}")
        with self._write_lock:
            self._update(report, incidents)

    def _update(self, report: WindowReport, incidents: IncidentSnapshot) -> None:
        view = self._view
        key = self.group_of(report)
        prev = view.groups.get(key)
        parts: list[_Part] = []
        for i, engine in enumerate(ENGINES):
            if _carries(report, engine):
                parts.append(_Part(report, engine_samples(report, self.config, engine)))
            else:
                parts.append(_NO_PART if prev is None else prev.parts[i])
        merged = _merged(report, parts, prev)
        invalid = dict(prev.invalid) if prev is not None else {}
        for reason in (report.normal_invalid_reason, report.low_latency_invalid_reason):
            if reason:
                invalid[str(reason)] = invalid.get(str(reason), 0) + 1
        state = _GroupState(
            merged, tuple(parts), window_samples(merged, self.config), incidents, invalid
        )
        groups = {g: st for g, st in view.groups.items() if g != key}
        groups[key] = state
        while len(groups) > MAX_GROUPS:
            del groups[next(iter(groups))]
        self._view = _View(groups, report, _per_report(groups, view.own), view.own)

    def set_own_means(self, group: str, samples: list[Sample]) -> None:
        """This rank's own series of ``group`` (replacing the last)."""
        with self._write_lock:
            view = self._view
            own = {**view.own, group: samples}
            self._view = _View(view.groups, view.newest, _per_report(view.groups, own), own)

    @property
    def report(self) -> WindowReport | None:
        """The newest report handed to :meth:`update`, of any group (None before the first)."""
        return self._view.newest

    @property
    def reports(self) -> dict[str, WindowReport]:
        """The state of every kept group as one report each (by group name): the newest report of
        the group with every engine's part from the newest report that carried it."""
        groups = self._view.groups
        return {g: groups[g].report for g in sorted(groups)}

    @property
    def groups(self) -> tuple[str, ...]:
        """The names of the kept groups, sorted."""
        return tuple(sorted(self._view.groups))

    @property
    def incidents(self) -> IncidentSnapshot:
        """The incidents of the newest report's group, as of that report."""
        view = self._view
        if view.newest is None:
            return IncidentSnapshot()
        state = view.groups.get(self.group_of(view.newest))
        return IncidentSnapshot() if state is None else state.incidents

    @property
    def incidents_by_group(self) -> dict[str, IncidentSnapshot]:
        """The incidents of every kept group (by group name)."""
        groups = self._view.groups
        return {g: groups[g].incidents for g in sorted(groups)}

    def parts(self) -> SampleParts:
        """(per-report samples, the same list object until the next report; the rest, fresh).

        Per group: its engines' and window's samples (cached), its incidents, its rejected
        DeepEP windows and its window's age. Once per process, labelled with ``config.run_id``
        and ``config.group_name`` (the identity the hub was configured with, as in its OTLP
        resource): the exporter's own health and counters, which belong to no one group.
        """
        view = self._view
        config = self.config
        now = self.clock()
        fresh: list[Sample] = []
        if not view.groups:
            # No report yet: the incident counters exist from the start, so increase() sees
            # the first incident.
            fresh += incident_samples(None, IncidentSnapshot(), config)
        for g in sorted(view.groups):
            state = view.groups[g]
            fresh += incident_samples(state.report, state.incidents, config)
            fresh += window_invalid_samples(state.report, state.invalid, config)
            fresh += clock_samples(state.report, config, now)
        fresh += health_samples(None, self.health.snapshot(), config)
        return view.per_report, fresh

    def samples(self) -> list[Sample]:
        """Every sample of the latest state (what ``/metrics`` and OTLP publish)."""
        per_report, fresh = self.parts()
        return list(per_report) + list(fresh)


class PublisherHub:
    """Publishes window reports to Prometheus, OTLP and log lines from a thread of its own.

    Every collector of the process may share one hub: reports of different groups and engines
    are published side by side (see :class:`LatestState`), and each group has its own
    :class:`~.incidents.IncidentTracker` (``trackers``), kept exactly as long
    as the group's state.

    ``metrics=False`` skips the HTTP endpoint (else it follows ``config.metrics_enabled``);
    ``otlp`` overrides the OTLP settings read from the environment (``None``: read them;
    ``False``: no OTLP). ``rank`` and ``hostname`` identify this process in OTLP resources
    (defaults: ``$RANK`` and the host name). ``clock`` gives unix seconds (tests pin it).

    ``on_incident`` is called with every :class:`~.incidents.IncidentEvent`
    (each incident's ``open`` and ``close``, once each, the same events the log lines and OTLP
    carry), on the hub's thread, after they are logged: the place for a training script to
    react to a verdict (checkpoint, log, stop). It must return quickly (it holds up
    publishing); an exception it raises is logged and does not stop the hub.
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
        on_incident: Callable[[IncidentEvent], object] | None = None,
    ) -> None:
        if not isinstance(config, RankwatchConfig):
            raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
            raise ValueError(f"local_rank: expected an int >= 0, got {local_rank!r}")
        if rank is None:
            rank = rank_from_env() or 0
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank: expected an int >= 0, got {rank!r}")
        if not callable(clock):
            raise TypeError(f"clock: expected a callable returning unix seconds, got {clock!r}")
        if on_incident is not None and not callable(on_incident):
            raise TypeError(
                f"on_incident: expected a function taking an IncidentEvent, got {on_incident!r}"
            )
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
            # Nothing to push to; unless the application's global providers are to be used.
            uses_global = config.otlp_use_global_providers and (
                global_meter_provider() is not None or global_logger_provider() is not None
            )
            settings = settings if uses_global else None

        self.config = config
        self.hostname = (
            hostname if hostname is not None else node_hostname(config.node_name_env)
        ).lower()
        exporters = [PUBLISH_QUEUE]
        if settings is not None:
            signals = ((OTLP_METRICS, settings.metrics), (OTLP_LOGS, settings.logs))
            exporters += [name for name, on in signals if on]
        self.health = HealthCounters(clock(), exporters)
        self.state = LatestState(config, self.health, clock)
        # One tracker per group (hub thread only): a group's windows never count for, or close,
        # another group's incidents, and its events carry its own group.
        self._trackers: dict[str, IncidentTracker] = {}
        self._on_incident = on_incident

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
        check_timeout_seconds(timeout_seconds)
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        # The hub thread only computes (milliseconds per report); it ends as soon as the reports
        # already handed over are published.
        # Its last act closes the incidents still open (on that thread, like every event).
        self._thread.join(max(0.0, (deadline - time.monotonic()) * 0.25))
        if self.otlp is not None:
            # Keep a little for the HTTP server's shutdown (it polls every 0.1 s).
            self.otlp.close(max(0.0, deadline - time.monotonic() - 0.3))
        if self.metrics_server is not None:
            self.metrics_server.close(max(0.0, deadline - time.monotonic()))

    # -- extras -----------------------------------------------------------------------------

    def publish_own_means(self, group: str, info: RankInfo, means: Sequence[float]) -> None:
        """This rank's own means (ms, ``RANK_MEAN_KEYS`` order, NaN where unmeasured) of the
        latest window of ``group``, as its group's aggregator sent them (a group larger than
        the root's rank budget): served as this rank's ``rankwatch_phase_seconds`` until the
        next."""
        by_key = dict(zip(RANK_MEAN_KEYS, means, strict=False))
        self.state.set_own_means(
            group,
            own_means_samples(
                info,
                by_key,
                self.config.run_id,
                group or self.config.group_name,
                self.config.attempt,
            ),
        )

    def count_collection_error(self, reason: str) -> None:
        """Count a failure to gather or form a window (``rankwatch_collection_errors_total``)."""
        self.health.collection_error(reason)

    def flush(self, timeout_seconds: float = 10.0) -> bool:
        """Wait until every report handed over so far is published and OTLP has exported it.

        For tests and for a final export before shutdown; True if done within the timeout.
        """
        check_timeout_seconds(timeout_seconds)
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
    def trackers(self) -> dict[str, IncidentTracker]:
        """The incident tracker of every kept group (by group name); read them after
        :meth:`flush`, as the hub thread updates them."""
        return dict(self._trackers)

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
                try:
                    self._close_open_incidents()
                except Exception:
                    log.exception("rankwatch: closing the open incidents at run end failed")
                return

    def _handle(self, report: WindowReport) -> None:
        group = self.state.group_of(report)
        tracker = self._trackers.get(group)
        if tracker is None:
            tracker = self._trackers[group] = IncidentTracker(
                self.config.incident_open_k,
                self.config.incident_open_n,
                self.config.incident_close_m,
                group=group,
                run=self.config.run_id,
            )
        try:
            events = tracker.update(report)
            self.state.update(report, tracker.snapshot())
        finally:
            # A tracker lives as long as its group's state: forget those of groups the state
            # dropped (the MAX_GROUPS bound) or never took (a report that failed to publish).
            kept = set(self.state.groups)
            for name in [name for name in self._trackers if name not in kept]:
                del self._trackers[name]
        for event in events:
            self._send(event)

    def _close_open_incidents(self) -> None:
        """The run is ending: close every group's open incidents, reason ``run ended``."""
        now = time.time()
        for tracker in self._trackers.values():
            for event in tracker.close_all(CLOSED_RUN_ENDED, now):
                self._send(event)

    def _send(self, event: IncidentEvent) -> None:
        """One incident event to the log, OTLP and ``on_incident``."""
        self._log_event(event)
        if self.otlp is not None:
            self.otlp.emit(event)
        if self._on_incident is not None:
            try:
                self._on_incident(event)
            except Exception:  # the script's reaction must not stop publishing
                log.exception("rankwatch: on_incident failed for %s", event.event_name)

    def _log_event(self, event: IncidentEvent) -> None:
        # Openings and closings at one level, so a run that shows one shows the other.
        line = event_json(event) if self.config.log_json else event_message(event)
        event_log.warning(line)


def default_publishers(
    config: RankwatchConfig,
    local_rank: int,
    *,
    on_incident: Callable[[IncidentEvent], object] | None = None,
    run_source: str = "",
) -> list[Publisher]:
    """What a training process publishes through, as configured: one :class:`PublisherHub`
    (``/metrics`` on port base + ``local_rank`` when enabled, OTLP when an endpoint is set,
    incident log lines, ``on_incident`` called with each incident event) and a
    :class:`~.recorder.RunRecorder` for the run's summary (written into ``artifact_dir`` when
    set; printed at the end by ``RankWatch.close``), or nothing when rankwatch is disabled.
    ``run_source`` says where ``config.run_id`` came from (the summary and end block show it)."""
    if not isinstance(config, RankwatchConfig):
        raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank: expected an int >= 0, got {local_rank!r}")
    if not config.enabled:
        return []
    hub = PublisherHub(config, local_rank=local_rank, on_incident=on_incident)
    run = {"run_id": config.run_id, "attempt": config.attempt, "started_at_s": time.time()}
    if run_source:
        run["run_id_source"] = run_source
    recorder = RunRecorder(config, config.artifact_dir or None, run)
    return [hub, recorder]
