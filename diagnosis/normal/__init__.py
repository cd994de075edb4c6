"""DeepEP normal-mode diagnosis: counter schema, windows, per-probe rules, incidents."""

from .report import Anomaly, Incident, NormalReport, ProbeResult
from .schema import COMPLETION_PROBES, NOTIFY_PROBES, PROBES, counter_length, counter_slots
from .window import CounterSnapshot, InvalidWindowError, NormalWindow, snapshot_counters

__all__ = [
    "COMPLETION_PROBES",
    "NOTIFY_PROBES",
    "PROBES",
    "Anomaly",
    "CounterSnapshot",
    "Incident",
    "InvalidWindowError",
    "NormalReport",
    "NormalWindow",
    "ProbeResult",
    "counter_length",
    "counter_slots",
    "snapshot_counters",
]
