"""DeepEP diagnosis inside every EP rank: the ``Diagnose`` factory (:mod:`.diagnose`), the
counter block DeepEP writes (:mod:`.counters`), ordered snapshots and their gather
(:mod:`.snapshot`) and the root's windows, diagnosis and history (:mod:`.root`)."""

from rankwatch.exporter.deepep.diagnose import HISTORY_WINDOWS, Diagnose, infer_ranks_per_node

__all__ = ["HISTORY_WINDOWS", "Diagnose", "infer_ranks_per_node"]
