"""The words both engines and every publisher share, defined once: severities and their order,
the straggler kinds, the incident classes."""

from __future__ import annotations

__all__ = [
    "BOTTLENECK_CLASS",
    "INCIDENT_CLASSES",
    "INCIDENT_SEVERITIES",
    "NORMAL_INCIDENT_CLASSES",
    "SEVERITIES",
    "SEVERITY_LEVELS",
    "STRAGGLER_CLASS",
    "STRAGGLER_KINDS",
    "UNATTRIBUTED",
]

# Severities of a finding, most severe first.
SEVERITIES: tuple[str, ...] = ("critical", "warning", "info")
# Their order as numbers (no finding: 0): the value of the ``diagnosis_severity`` series, and
# the key every "most severe first" sort uses.
SEVERITY_LEVELS: dict[str | None, int] = {None: 0, "info": 1, "warning": 2, "critical": 3}
# Severities that open an incident, in increasing order (info findings never page).
INCIDENT_SEVERITIES: tuple[str, ...] = ("warning", "critical")

# The step-time straggler kind named by the component that covers the visible gap.
UNATTRIBUTED = "sync_or_unattributed"
STRAGGLER_KINDS: dict[str, str] = {
    "input": "INPUT_STRAGGLER",
    "h2d": "H2D_STRAGGLER",
    "compute": "COMPUTE_STRAGGLER",
    UNATTRIBUTED: "STRAGGLER",
}

# Incident classes: one per step-time finding family, and the normal-mode engine's own.
STRAGGLER_CLASS = "step_time_straggler"
BOTTLENECK_CLASS = "step_time_bottleneck"
NORMAL_INCIDENT_CLASSES: tuple[str, ...] = (
    "pre_stage_arrival_skew",
    "global_data_path_slowdown",
    "localized_data_path_slowdown",
    "unclassified",
)
INCIDENT_CLASSES: tuple[str, ...] = (STRAGGLER_CLASS, BOTTLENECK_CLASS, *NORMAL_INCIDENT_CLASSES)
