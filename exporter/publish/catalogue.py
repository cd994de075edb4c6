"""The metric catalogue: every series rankwatch publishes, defined once.

Both publishers (Prometheus ``/metrics`` and OTLP) read this table, and ``docs/metrics.md`` is
generated from it, so a metric's name, type, unit, labels and meaning live in exactly one place.
Prometheus names follow the conventions: ``rankwatch_`` prefix, base units, ``_total`` only on
counters, ``_ratio`` for 0..1 ratios. Every series also carries the ``run``, ``group`` and
``attempt`` labels (listed in ``COMMON_LABELS``) so one Prometheus can hold many jobs, their
restarts and EP/DP groups.

The OTel instrument of each family is derived from its Prometheus name so that the standard
OTLP-to-Prometheus translation (dots to underscores, the unit appended as a word, ``_total`` on
monotonic sums, ``_ratio`` on unit-``"1"`` gauges) gives that Prometheus name back exactly:
the unit word and the ``_total``/``_ratio`` suffix are taken off the name and carried by the
unit and the instrument kind instead. For that reason unit ``"1"`` is reserved for families whose
name ends in ``_ratio``; other dimensionless families have unit ``""``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankwatch.diagnosis.config import NormalConfig, StepTimeConfig

__all__ = [
    "CATALOGUE",
    "COMMON_LABELS",
    "METRIC_NAMES",
    "MetricNames",
    "MetricSpec",
    "by_name",
    "markdown_table",
    "render_doc",
]

# ``attempt``: which start of the run (0 the first; a restart keeps the run's name).
COMMON_LABELS: tuple[str, ...] = ("run", "group", "attempt")


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: Prometheus name, type (gauge/counter/info), unit, labels, help."""

    name: str
    type: str
    unit: str
    labels: tuple[str, ...]
    help: str

    @property
    def all_labels(self) -> tuple[str, ...]:
        """``COMMON_LABELS`` followed by the family's own labels (the order samples use)."""
        return COMMON_LABELS + self.labels

    @property
    def otel_name(self) -> str:
        """The dotted OTel instrument name that translates back to ``name``.

        ``rankwatch_phase_seconds`` -> ``rankwatch.phase`` (unit ``s``),
        ``rankwatch_incidents_total`` -> ``rankwatch.incidents`` (a counter),
        ``rankwatch_deepep_notify_ratio`` -> ``rankwatch.deepep.notify`` (unit ``1``).
        """
        body = self.name
        for suffix, applies in (
            ("_total", self.type == "counter"),
            ("_seconds", self.unit == "s"),
            ("_ratio", self.unit == "1"),
        ):
            if applies and body.endswith(suffix):
                body = body[: -len(suffix)]
        return body.replace("_", ".")

    @property
    def otel_unit(self) -> str:
        """The UCUM unit of the OTel instrument (``s``, ``1`` or empty)."""
        return self.unit

    @property
    def openmetrics_unit(self) -> str:
        """The OpenMetrics ``# UNIT`` of the family (the name's unit suffix), or empty."""
        return {"s": "seconds", "1": "ratio"}.get(self.unit, "")


# The default thresholds the help texts state (read, not repeated: a changed default follows).
_STEP_TIME = StepTimeConfig()
_NORMAL = NormalConfig()


def _m(name: str, type_: str, unit: str, labels: tuple[str, ...], help_: str) -> MetricSpec:
    return MetricSpec("rankwatch_" + name, type_, unit, labels, help_)


# Where a rank runs; gpu and UUID carry dcgm-exporter's label names (and values) so per-rank
# series join a GPU's telemetry. Empty on CPU.
RANK = ("rank", "local_rank", "hostname", "gpu", "UUID")

CATALOGUE: tuple[MetricSpec, ...] = (
    # --- step time (rank-straggler policy) ---
    _m(
        "straggler_score",
        "gauge",
        "",
        (),
        "Straggler score of the current window: (visible_victim - visible_culprit) / "
        "(input_wait_victim + step_victim). Warning from "
        f"{_STEP_TIME.straggler_warning_score:.2f}, critical from "
        f"{_STEP_TIME.straggler_critical_score:.2f}.",
    ),
    _m(
        "cause_coverage_ratio",
        "gauge",
        "1",
        ("component",),
        "Bounded share of the visible wait explained by a component (input, h2d, compute); "
        "a component unmeasured on culprit or victim is absent.",
    ),
    _m(
        "component_excess_seconds",
        "gauge",
        "s",
        ("component",),
        "Culprit minus victim window-mean time of a component (input, h2d, compute).",
    ),
    _m(
        "phase_seconds",
        "gauge",
        "s",
        (*RANK, "phase"),
        "Window mean of a phase per rank on the selected clock: input_wait, h2d, forward, "
        "backward, optimizer, step, residual, visible. An unmeasured phase is absent.",
    ),
    _m(
        "diagnosis_info",
        "info",
        "",
        ("kind", "severity", "culprit_rank", "victim_rank", "component", "clock", "strategy"),
        "The current step-time diagnosis (value 1): kind, severity, culprit and victim rank.",
    ),
    _m(
        "diagnosis_severity",
        "gauge",
        "",
        (),
        "Severity of the current step-time diagnosis: 0 none, 1 info, 2 warning, 3 critical.",
    ),
    _m("window_steps", "gauge", "", (), "Steps aligned across all ranks in the current window."),
    _m(
        "step_outlier_steps",
        "gauge",
        "",
        (),
        "Most steps left out of one rank's window means as outlier steps (an outer step above "
        f"{_STEP_TIME.outlier_step_factor:g}x the rank's median, when at most "
        f"{_STEP_TIME.outlier_steps_max_fraction:.0%} of the window's steps are).",
    ),
    # --- DeepEP normal mode ---
    _m(
        "deepep_notify_ratio",
        "gauge",
        "1",
        ("probe", "rank"),
        "Notify kernel duration of a rank divided by the median of its peers; "
        f"<= {_NORMAL.notify_ratio:g} is "
        "late-arrival evidence.",
    ),
    _m(
        "deepep_notify_duration_seconds",
        "gauge",
        "s",
        ("probe", "rank"),
        "Average Notify kernel duration per launch in the window.",
    ),
    _m(
        "deepep_completion_cycles_per_sample",
        "gauge",
        "",
        ("probe", "src_rank", "dst_rank"),
        "Completion cost per sample of one src->dst cell (only within the cell budget; above it "
        "only flagged cells).",
    ),
    _m(
        "deepep_completion_row_cycles_per_sample",
        "gauge",
        "",
        ("probe", "src_rank"),
        "Median completion cost per sample over a source row.",
    ),
    _m(
        "deepep_completion_column_cycles_per_sample",
        "gauge",
        "",
        ("probe", "dst_rank"),
        "Median completion cost per sample over a destination column.",
    ),
    _m(
        "deepep_residual_slowdown_factor",
        "gauge",
        "",
        ("probe", "scope", "src", "dst"),
        "Slowdown factor of a flagged scope (row, column, point, block, src_gateway, "
        "dst_gateway, edge) after removing wider effects; src/dst are ranks or n<node>.",
    ),
    _m(
        "deepep_global_slowdown_factor",
        "gauge",
        "",
        ("probe",),
        "Completion cost of the probe's slowest link class (intra-node, inter-node, gateway) "
        "over the median of that class's recent normal windows; "
        f">= {_NORMAL.global_slowdown:g} is a global slowdown. "
        "Absent until the history is bootstrapped.",
    ),
    _m(
        "deepep_probe_anomalous",
        "gauge",
        "",
        ("probe",),
        "1 when the probe reported an anomaly in the current window, else 0.",
    ),
    _m(
        "deepep_stalled_rank",
        "gauge",
        "",
        ("rank", "stage"),
        "1 for each rank a hang suspect names in the current window: its counters stood still "
        "(or no rank received from it) while its peers advanced; stage is the first probe it "
        "missed. Absent when no rank stalled.",
    ),
    _m(
        "deepep_window_invalid_total",
        "counter",
        "",
        ("reason",),
        "DeepEP windows (normal or low-latency) rejected before diagnosis, by reason.",
    ),
    # --- DeepEP low-latency mode ---
    _m(
        "deepep_ll_row_ratio",
        "gauge",
        "1",
        ("phase", "rank"),
        "Low-latency receive wait: a receiver row's mean over the mean of all row means.",
    ),
    _m(
        "deepep_ll_column_ratio",
        "gauge",
        "1",
        ("phase", "rank"),
        "Low-latency receive wait: a peer column's mean over the mean of all column means.",
    ),
    _m(
        "deepep_ll_point_ratio",
        "gauge",
        "1",
        ("phase", "src_rank", "dst_rank"),
        "Low-latency receive wait of a flagged cell over the matrix mean; src_rank is the peer "
        "waited for (matrix column), dst_rank the rank that waited (matrix row).",
    ),
    # --- the run against itself (step_time.pace) ---
    _m(
        "job_pace_ratio",
        "gauge",
        "1",
        (),
        "The group's step pace (median outer step over ranks, less a straggler's gap) over its "
        "own baseline (the median of its first windows after warm-up); absent until formed. A "
        f"job_slowdown incident opens from {_STEP_TIME.job_slowdown_warning_ratio} for "
        f"{_STEP_TIME.job_slowdown_windows} windows in a row.",
    ),
    _m(
        "job_baseline_step_seconds",
        "gauge",
        "s",
        (),
        "The baseline of the group's own pace: the outer step time it is compared with.",
    ),
    _m(
        "rank_pace_ratio",
        "gauge",
        "1",
        RANK,
        "A rank's own work per step (outer step less its synchronisation waits) over its own "
        "baseline: a rank degrading shows here before it is a straggler.",
    ),
    # --- incidents ---
    _m(
        "incidents_total",
        "counter",
        "",
        ("class", "severity"),
        "Incidents opened, by class and severity.",
    ),
    _m(
        "incident_active",
        "gauge",
        "",
        ("class", "severity", "probe", "culprit_rank", "hostname", "cause"),
        "1 while an incident is open; the series is removed when it closes.",
    ),
    _m(
        "incident_score",
        "gauge",
        "",
        ("class", "severity", "probe", "culprit_rank", "hostname", "cause"),
        "Score of an open incident: the straggler score for step-time classes, the largest "
        "slowdown factor for data-path classes, the smallest Notify ratio for arrival skew.",
    ),
    _m(
        "time_lost_seconds_total",
        "counter",
        "s",
        ("class", "cause", "culprit_rank", "hostname"),
        "Time the group lost to its incidents, in rank-seconds (seconds summed over ranks; one "
        'rank is one GPU; docs/metrics.md, "Time lost"): for a '
        "straggler or a slow node, the gap every rank waited for the culprit per step, times "
        "the steps and the group's ranks; for a hang, the stalled seconds times the ranks. "
        "Counted from the windows that opened the incident on; only culprits are labels.",
    ),
    _m(
        "goodput_ratio",
        "gauge",
        "1",
        (),
        "1 minus the rank-seconds lost to incidents over the rank-seconds since the first "
        "window (wall time x the group's ranks): the share of the group's time not lost.",
    ),
    # --- hangs (one open hang incident per group at most: the labels stay bounded) ---
    _m(
        "hang_active",
        "gauge",
        "",
        ("hang_class", "culprit_rank", "phase", "op"),
        "1 while a hang incident is open (no rank progressed for the hang budget): its class, "
        "the named ranks, the first one's phase, the op the others wait in; removed when the job "
        "moves on.",
    ),
    _m(
        "hang_stalled_seconds",
        "gauge",
        "s",
        ("hang_class",),
        "Seconds without progress on any rank when the open hang incident was last classified.",
    ),
    _m(
        "hang_collective_seq",
        "gauge",
        "",
        ("hang_class", "collective_group", "op"),
        "Sequence number (collectives issued on the process group) of the collective the "
        "waiting ranks are in, while a hang incident is open.",
    ),
    # --- windows and the exporter itself ---
    _m("window_index", "gauge", "", (), "Index of the latest diagnosed window."),
    _m(
        "window_timestamp_seconds",
        "gauge",
        "s",
        (),
        "Unix time at which the latest window was diagnosed.",
    ),
    _m("window_age_seconds", "gauge", "s", (), "Seconds since the latest window was diagnosed."),
    _m(
        "window_missing_ranks",
        "gauge",
        "",
        (),
        "Ranks expected but missing from the latest window (0 when complete).",
    ),
    _m("group_ranks", "gauge", "", (), "Ranks in the group."),
    _m(
        "diagnosis_duration_seconds",
        "gauge",
        "s",
        ("engine",),
        "Wall time the last diagnosis took, per engine (step_time, normal, low_latency).",
    ),
    _m(
        "collection_errors_total",
        "counter",
        "",
        ("reason",),
        "Failures to gather or form a window, by reason.",
    ),
    _m(
        "storage_errors_total",
        "counter",
        "",
        ("writer",),
        "Failed writes of rankwatch's files in this process, by writer (step_windows, summary, "
        "hang_records, deepep_npz, deepep_log, deepxtrace_log); each kind of error is also "
        "logged once per "
        "writer, naming the setting, the path and the errno.",
    ),
    _m(
        "export_failures_total",
        "counter",
        "",
        ("exporter",),
        "Failed export attempts (otlp_metrics, otlp_logs), incident events dropped before "
        "export (otlp_logs), and window reports replaced in the publish queue before they were "
        "published (publish_queue).",
    ),
    _m("exporter_up", "gauge", "", (), "1 while the rankwatch exporter runs."),
    _m("exporter_start_time_seconds", "gauge", "s", (), "Unix time the exporter started."),
    _m(
        "build_info",
        "info",
        "",
        ("version", "python", "torch"),
        "The versions of rankwatch, Python and torch the exporter runs with (value 1).",
    ),
)


_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}


def by_name(name: str) -> MetricSpec:
    """The catalogue entry for a Prometheus metric name (KeyError if unknown)."""
    return _BY_NAME[name]


class MetricNames:
    """The catalogue's names by attribute, for code that writes queries: ``METRIC_NAMES.
    straggler_score`` is ``"rankwatch_straggler_score"``. A name the catalogue does not hold
    raises ``AttributeError`` naming it, so a renamed metric cannot leave a query behind."""

    def __getattr__(self, short: str) -> str:
        name = "rankwatch_" + short
        if name not in _BY_NAME:
            raise AttributeError(f"metric {name!r} is not in the catalogue")
        return name


METRIC_NAMES = MetricNames()


# docs/metrics.md holds the generated table between these markers; the prose around it is kept.
DOC_BEGIN = "<!-- catalogue: generated by `make generate` -->"
DOC_END = "<!-- /catalogue -->"


def _otel_kind(spec: MetricSpec) -> str:
    return "observable counter" if spec.type == "counter" else "observable gauge"


def markdown_table() -> str:
    """The catalogue as a Markdown table: name, type, unit, labels, OTel instrument, meaning."""
    rows = [
        "| name | type | unit | labels | OTel instrument | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for spec in CATALOGUE:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        unit = f"`{spec.unit}`" if spec.unit else "-"
        otel_unit = f"unit `{spec.otel_unit}`" if spec.otel_unit else "no unit"
        otel = f"`{spec.otel_name}` ({_otel_kind(spec)}, {otel_unit})"
        meaning = spec.help.replace("|", "\\|")
        rows.append(f"| `{spec.name}` | {spec.type} | {unit} | {labels} | {otel} | {meaning} |")
    return "\n".join(rows) + "\n"


def render_doc(text: str) -> str:
    """``text`` (the metrics doc) with the generated table between its markers replaced."""
    begin, end = text.find(DOC_BEGIN), text.find(DOC_END)
    if begin < 0 or end < begin:
        raise ValueError(f"text: the markers {DOC_BEGIN!r} ... {DOC_END!r} are missing")
    return text[: begin + len(DOC_BEGIN)] + "\n" + markdown_table() + text[end:]


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if len(sys.argv) != 2:
        sys.exit("usage: python -m rankwatch.exporter.publish.catalogue PATH/TO/metrics.md")
    path = Path(sys.argv[1])
    path.write_text(render_doc(path.read_text()))
