"""DeepEP diagnosis inside every EP rank: the ``Diagnose`` factory (:mod:`.diagnose`), the
counter block DeepEP writes (:mod:`.counters`), ordered snapshots and their gather
(:mod:`.snapshot`), the root's windows (:mod:`.windows`), diagnosis and history (:mod:`.root`),
in a child process of the root from some EP size on (:mod:`.root_process`,
:mod:`.root_child`), and DeepXTrace's ``deepxtrace.diagnose`` served over them
(:mod:`.deepxtrace`, :func:`install_as_deepxtrace`).

The public names load on first use, so the root's child process, which imports modules of this
package, never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rankwatch.exporter.deepep.deepxtrace import install_as_deepxtrace, uninstall_deepxtrace
    from rankwatch.exporter.deepep.diagnose import (
        HISTORY_WINDOWS,
        Diagnose,
        infer_ranks_per_node,
    )

__all__ = [
    "HISTORY_WINDOWS",
    "Diagnose",
    "infer_ranks_per_node",
    "install_as_deepxtrace",
    "uninstall_deepxtrace",
]

# Public name -> the module that defines it (imported on first access).
_LAZY = {
    "HISTORY_WINDOWS": "rankwatch.exporter.deepep.diagnose",
    "Diagnose": "rankwatch.exporter.deepep.diagnose",
    "infer_ranks_per_node": "rankwatch.exporter.deepep.diagnose",
    "install_as_deepxtrace": "rankwatch.exporter.deepep.deepxtrace",
    "uninstall_deepxtrace": "rankwatch.exporter.deepep.deepxtrace",
}


def __getattr__(name: str) -> Any:
    from rankwatch.exporter import load_lazy

    return load_lazy(__name__, _LAZY, name)
