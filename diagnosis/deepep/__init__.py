"""The DeepEP engines: normal mode (:mod:`.normal`, Notify and Completion probes), the
low-latency receive-wait matrix rule (:mod:`.low_latency`), a normal-mode window saved as
NPZ (:mod:`.artifact`) and its structured log lines (:mod:`.log_lines`)."""

from rankwatch.diagnosis.deepep.low_latency import LowLatencyResult, diagnose_low_latency
from rankwatch.diagnosis.deepep.normal import (
    COMPLETION_PROBES,
    NOTIFY_PROBES,
    PROBES,
    Anomaly,
    CounterSnapshot,
    Incident,
    InvalidWindowError,
    NormalDiagnoser,
    NormalReport,
    NormalSimulator,
    NormalWindow,
    ProbeResult,
    counter_length,
)

__all__ = [
    "COMPLETION_PROBES",
    "NOTIFY_PROBES",
    "PROBES",
    "Anomaly",
    "CounterSnapshot",
    "Incident",
    "InvalidWindowError",
    "LowLatencyResult",
    "NormalDiagnoser",
    "NormalReport",
    "NormalSimulator",
    "NormalWindow",
    "ProbeResult",
    "counter_length",
    "diagnose_low_latency",
]
