"""DeepEP normal-mode diagnosis: counter schema, windows, per-probe rules, incidents."""

from .schema import COMPLETION_PROBES, NOTIFY_PROBES, PROBES, counter_length, counter_slots
from .window import CounterSnapshot, InvalidWindowError, NormalWindow, snapshot_counters

__all__ = [
    "COMPLETION_PROBES",
    "NOTIFY_PROBES",
    "PROBES",
    "CounterSnapshot",
    "InvalidWindowError",
    "NormalWindow",
    "counter_length",
    "counter_slots",
    "snapshot_counters",
]
