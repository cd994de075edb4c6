"""DeepEP normal-mode diagnosis: counter schema, windows, per-probe rules, incidents."""

from .diagnoser import NormalDiagnoser
from .history import GlobalHistory
from .report import Anomaly, Incident, NormalReport, ProbeResult
from .schema import COMPLETION_PROBES, NOTIFY_PROBES, PROBES, counter_length, counter_slots
from .simulator import PHASES as SIMULATOR_PHASES
from .simulator import NormalSimulator, phase_timeline
from .window import CounterSnapshot, InvalidWindowError, NormalWindow, snapshot_counters

__all__ = [
    "COMPLETION_PROBES",
    "NOTIFY_PROBES",
    "PROBES",
    "SIMULATOR_PHASES",
    "Anomaly",
    "CounterSnapshot",
    "GlobalHistory",
    "Incident",
    "InvalidWindowError",
    "NormalDiagnoser",
    "NormalReport",
    "NormalSimulator",
    "NormalWindow",
    "ProbeResult",
    "counter_length",
    "counter_slots",
    "phase_timeline",
    "snapshot_counters",
]
