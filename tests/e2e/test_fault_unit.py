"""The fault's unit and cost on real runs (a subset of ``make accuracy-unit``): a node whose
two ranks are slow is one ``step_time_slow_node`` incident naming the node and its ranks, and
every rank slower from a step on is one ``job_slowdown`` incident; each counts the time it cost
within 15 % of the injected truth."""

from __future__ import annotations

import pytest

from bench.accuracy_fault_unit import CELLS, run_cell

pytestmark = [pytest.mark.multiproc]

_BY_NAME = {cell.name: cell for cell in CELLS}


@pytest.mark.parametrize(
    "name",
    [
        "slow node, 4 ranks in 2 nodes",
        "every rank slower in forward from step 700 (3 ranks)",
    ],
)
def test_one_incident_per_fault_naming_its_unit_and_its_cost(name: str) -> None:
    cell = _BY_NAME[name]
    result = run_cell(cell)
    assert result.opened == cell.expected, result
    truth = cell.truth_rank_seconds
    assert abs(result.lost_rank_seconds - truth) <= 0.15 * truth, (result.lost_rank_seconds, truth)
