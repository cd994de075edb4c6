"""The step-time engine: is one rank of a DDP/FSDP job a straggler, which one, why, how sure.

Modules, in reading order: :mod:`.table` (the columnar rows and their reduction to per-rank
means), :mod:`.row_dicts` (row dictionaries into that table), :mod:`.blocks` (bounded state
for long windows), :mod:`.mesh` (a job's device mesh and its comparison groups), :mod:`.rules`
(the policy: straggler score, attribution, bottlenecks, gates), :mod:`.units` (the fault's
unit: a rank or its host), :mod:`.report` (what it returns) and :mod:`.artifact` (windows saved
as JSON).
"""

from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.diagnosis.step_time.report import (
    COMPONENTS,
    KINDS,
    RANK_MEAN_KEYS,
    STATUS_KINDS,
    STRAGGLER_KINDS,
    Finding,
    StepTimeReport,
    StragglerEvidence,
)
from rankwatch.diagnosis.step_time.row_dicts import rows_to_array
from rankwatch.diagnosis.step_time.rules import (
    STRATEGIES,
    diagnose_arrays,
    diagnose_cube,
    diagnose_means,
    diagnose_steps,
    diagnose_window,
    normalize_strategy,
    strategy_from_metadata,
)
from rankwatch.diagnosis.step_time.table import CLOCKS, ROW_WIDTH, SIGNALS
from rankwatch.diagnosis.step_time.units import name_fault_unit
from rankwatch.diagnosis.vocabulary import SEVERITIES

__all__ = [
    "CLOCKS",
    "COMPONENTS",
    "KINDS",
    "RANK_MEAN_KEYS",
    "ROW_WIDTH",
    "SEVERITIES",
    "SIGNALS",
    "STATUS_KINDS",
    "STRAGGLER_KINDS",
    "STRATEGIES",
    "Finding",
    "MeshLayout",
    "StepTimeReport",
    "StragglerEvidence",
    "diagnose_arrays",
    "diagnose_cube",
    "diagnose_means",
    "diagnose_steps",
    "diagnose_window",
    "name_fault_unit",
    "normalize_strategy",
    "rows_to_array",
    "strategy_from_metadata",
]
