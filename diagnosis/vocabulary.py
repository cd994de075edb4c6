"""The words both engines and every publisher share, defined once: severities and their order,
the step-time kinds and components, the incident classes."""

from __future__ import annotations

__all__ = [
    "BOTTLENECK_CLASS",
    "CLOSE_AT_ONCE_CLASSES",
    "COMPONENTS",
    "CULPRIT_CLASSES",
    "FAULT",
    "GLOBAL_DATA_PATH_SLOWDOWN",
    "HANG_CLASS",
    "HANG_SUSPECT",
    "INCIDENT_CLASSES",
    "INCIDENT_SEVERITIES",
    "JOB_SLOWDOWN_CLASS",
    "KINDS",
    "LOCALIZED_DATA_PATH_SLOWDOWN",
    "NORMAL_INCIDENT_CLASSES",
    "OPEN_AT_ONCE_CLASSES",
    "PRE_STAGE_ARRIVAL_SKEW",
    "PROPERTY",
    "PROPERTY_CLASSES",
    "SEVERITIES",
    "SEVERITY_LEVELS",
    "SLOW_NODE_CLASS",
    "STATUS_KINDS",
    "STRAGGLER_CLASS",
    "STRAGGLER_KINDS",
    "UNATTRIBUTED",
    "UNCLASSIFIED",
    "incident_nature",
    "incident_pages",
]

# Severities of a finding, most severe first.
SEVERITIES: tuple[str, ...] = ("critical", "warning", "info")
# Their order as numbers (no finding: 0): the value of the ``diagnosis_severity`` series, and
# the key every "most severe first" sort uses.
SEVERITY_LEVELS: dict[str | None, int] = {None: 0, "info": 1, "warning": 2, "critical": 3}
# Severities that open an incident, in increasing order (info findings never page).
INCIDENT_SEVERITIES: tuple[str, ...] = ("warning", "critical")

# The step-time engine's kinds: stragglers, bottlenecks, then the statuses of a window with no
# finding (``severity`` None).
KINDS: tuple[str, ...] = (
    "STRAGGLER",
    "INPUT_STRAGGLER",
    "COMPUTE_STRAGGLER",
    "H2D_STRAGGLER",
    "INPUT_BOUND",
    "H2D_BOUND",
    "RESIDUAL_HEAVY",
    "COMPUTE_BOUND",
    "WARMUP",
    "INCOMPLETE_DATA",
    "BALANCED",
)
STATUS_KINDS: tuple[str, ...] = ("WARMUP", "INCOMPLETE_DATA", "BALANCED")
# The components a straggler's visible gap is attributed to (this order breaks ties), and the
# kind each names; a gap no component covers is a plain ``STRAGGLER``.
COMPONENTS: tuple[str, ...] = ("input", "h2d", "compute")
UNATTRIBUTED = "sync_or_unattributed"
STRAGGLER_KINDS: dict[str, str] = {
    "input": "INPUT_STRAGGLER",
    "h2d": "H2D_STRAGGLER",
    "compute": "COMPUTE_STRAGGLER",
    UNATTRIBUTED: "STRAGGLER",
}

# Incident classes: one per step-time finding family, and the normal-mode engine's own.
STRAGGLER_CLASS = "step_time_straggler"
# The whole group slower than its own baseline (step_time.pace), for k windows in a row.
JOB_SLOWDOWN_CLASS = "job_slowdown"
# A straggler whose unit is a host: most of one node's ranks late together (step_time.units).
SLOW_NODE_CLASS = "step_time_slow_node"
BOTTLENECK_CLASS = "step_time_bottleneck"
PRE_STAGE_ARRIVAL_SKEW = "pre_stage_arrival_skew"
GLOBAL_DATA_PATH_SLOWDOWN = "global_data_path_slowdown"
LOCALIZED_DATA_PATH_SLOWDOWN = "localized_data_path_slowdown"
UNCLASSIFIED = "unclassified"
# Some ranks stopped advancing their DeepEP counters while others went on.
HANG_SUSPECT = "hang_suspect"
NORMAL_INCIDENT_CLASSES: tuple[str, ...] = (
    PRE_STAGE_ARRIVAL_SKEW,
    GLOBAL_DATA_PATH_SLOWDOWN,
    LOCALIZED_DATA_PATH_SLOWDOWN,
    UNCLASSIFIED,
    HANG_SUSPECT,
)
# Classes whose incident opens on the first window that shows them, without the k-of-n
# debounce: DeepEP's own timeout ends a hung job about 100 s later.
# No rank of a step-time group progressed for the hang budget (rankwatch.diagnosis.hang): it
# opens at once and closes as soon as the job moves on (the hang watcher's own hysteresis).
HANG_CLASS = "hang"
# A job slowdown is reported only after k windows in a row already (its own debounce).
OPEN_AT_ONCE_CLASSES: tuple[str, ...] = (HANG_SUSPECT, HANG_CLASS, JOB_SLOWDOWN_CLASS)
CLOSE_AT_ONCE_CLASSES: tuple[str, ...] = (HANG_CLASS,)
INCIDENT_CLASSES: tuple[str, ...] = (
    STRAGGLER_CLASS,
    SLOW_NODE_CLASS,
    JOB_SLOWDOWN_CLASS,
    BOTTLENECK_CLASS,
    *NORMAL_INCIDENT_CLASSES,
    HANG_CLASS,
)
# The classes whose critical incident blames a culprit that may be a bad host: what the fleet's
# ledger counts per host across runs (docs/fleet.md). A job slowdown blames no one, a DeepEP
# global slowdown the shared fabric, a pre-stage skew the work before the collective.
CULPRIT_CLASSES: tuple[str, ...] = (
    STRAGGLER_CLASS,
    SLOW_NODE_CLASS,
    HANG_CLASS,
    LOCALIZED_DATA_PATH_SLOWDOWN,
)

# One severity story. An incident is a *fault* (something holds the job back and someone
# should look: a straggler or a slow node the others wait for, a DeepEP incident class, a
# hang) or a steady *property* of the job (how its step divides: input-bound, residual-heavy,
# compute-bound, which is the same from the first window to the last). Critical means a fault
# that pages; a property is a warning at most and never pages. Every class not listed here is a
# fault.
FAULT = "fault"
PROPERTY = "property"
PROPERTY_CLASSES: tuple[str, ...] = (BOTTLENECK_CLASS,)


def incident_nature(cls: str) -> str:
    """``"property"`` for a class in :data:`PROPERTY_CLASSES`, else ``"fault"``."""
    return PROPERTY if cls in PROPERTY_CLASSES else FAULT


def incident_pages(cls: str, severity: str) -> bool:
    """Whether an incident of this class and severity pages: a critical fault."""
    return severity == "critical" and incident_nature(cls) == FAULT
