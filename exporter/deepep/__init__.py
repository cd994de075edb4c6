"""DeepEP diagnosis inside every EP rank: the ``Diagnose`` factory (:mod:`.diagnose`), the
counter block DeepEP writes (:mod:`.counters`), ordered snapshots and their gather
(:mod:`.snapshot`), the root's windows, diagnosis and history (:mod:`.root`), and DeepXTrace's
``deepxtrace.diagnose`` served over them (:mod:`.deepxtrace`, :func:`install_as_deepxtrace`)."""

from rankwatch.exporter.deepep.deepxtrace import install_as_deepxtrace, uninstall_deepxtrace
from rankwatch.exporter.deepep.diagnose import HISTORY_WINDOWS, Diagnose, infer_ranks_per_node

__all__ = [
    "HISTORY_WINDOWS",
    "Diagnose",
    "infer_ranks_per_node",
    "install_as_deepxtrace",
    "uninstall_deepxtrace",
]
