"""The DeepEP engines: normal mode (:mod:`.normal`, Notify and Completion probes), the
low-latency receive-wait matrix rule (:mod:`.low_latency`), a normal-mode window saved as
NPZ (:mod:`.artifact`) and its structured log lines (:mod:`.log_lines`).

The names most callers need are importable from here; :mod:`.normal` has the rest.
"""

from rankwatch.diagnosis.deepep.low_latency import (
    LowLatencyResult,
    diagnose_low_latency,
    diagnose_matrix,
)
from rankwatch.diagnosis.deepep.normal import (
    NormalDiagnoser,
    NormalReport,
    NormalSimulator,
    NormalWindow,
)

__all__ = [
    "LowLatencyResult",
    "NormalDiagnoser",
    "NormalReport",
    "NormalSimulator",
    "NormalWindow",
    "diagnose_low_latency",
    "diagnose_matrix",
]
