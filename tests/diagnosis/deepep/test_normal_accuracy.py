"""A representative subset of the DeepEP accuracy matrix (bench/accuracy_deepep.py).

One node, two nodes (the validation layout) and four nodes, every fault row, two seeds; and
quiet windows at EP 64 on eight nodes without a single incident. The full matrix (all sizes,
three seeds, 1,000 quiet windows at EP 64 and EP 128) is generated into the docs.
"""

from __future__ import annotations

import pytest

from bench.accuracy_deepep import FAULTS, Topology, false_positive_rate, run_cell


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
@pytest.mark.parametrize("topology", [Topology(16, 2), Topology(32, 4)], ids=str)
def test_every_fault_gives_the_expected_incidents(topology, fault):
    right, total, wrong = run_cell(topology, fault, seeds=(0, 1))
    assert right == total, f"expected {sorted(fault.expected(topology))}, got {wrong}"


def test_expectations_differ_with_the_topology():
    # The test above could not fail for a fault that expects nothing everywhere.
    node_pair = next(f for f in FAULTS if f.name == "node_pair")
    assert node_pair.expected(Topology(8, 1)) == []
    assert node_pair.expected(Topology(16, 2))[0][0] == "global_data_path_slowdown"
    assert node_pair.expected(Topology(32, 4))[0][0] == "localized_data_path_slowdown"


def test_quiet_windows_raise_no_incident():
    bad, n = false_positive_rate(Topology(64, 8), windows=100, seed=5)
    assert (bad, n) == (0, 100)
