"""DeepEP normal-mode diagnosis: counter schema, windows, per-probe rules, incidents."""

from rankwatch.diagnosis.deepep.normal.diagnoser import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.hang import StallFinding, find_stall
from rankwatch.diagnosis.deepep.normal.history import GlobalHistory
from rankwatch.diagnosis.deepep.normal.report import Anomaly, Incident, NormalReport, ProbeResult
from rankwatch.diagnosis.deepep.normal.schema import (
    COMPLETION_PROBES,
    NOTIFY_PROBES,
    PROBES,
    counter_length,
    counter_slots,
)
from rankwatch.diagnosis.deepep.normal.simulator import PHASES as SIMULATOR_PHASES
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator, phase_timeline
from rankwatch.diagnosis.deepep.normal.window import (
    CounterSnapshot,
    InvalidWindowError,
    NormalWindow,
    snapshot_counters,
)

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
    "StallFinding",
    "counter_length",
    "counter_slots",
    "find_stall",
    "phase_timeline",
    "snapshot_counters",
]
