"""Storage faults in real two-rank Gloo jobs: the representative cells of the matrix.

``bench/reliability_matrix.py`` (``make reliability-matrix``) runs every fault against every
writer and writes the matrix into docs/reliability.md; here two of its runs guard the policy in
``make test``: the issue's own case (``RANKWATCH_ARTIFACT_DIR=/dev/null``, a setting unusable
from the start) and a disk that fills up in the middle of a run. Each asserts, per writer: no
traceback, training went on after the fault, exactly one line naming the setting and the
errno, ``/metrics`` and the incidents still out, the files written before the fault intact.
"""

from __future__ import annotations

import pytest

from bench.reliability_matrix import FAULTS, WRITERS, run_fault
from tests.servers import missing_in_ci

pytestmark = [pytest.mark.multiproc, pytest.mark.parallel_safe, pytest.mark.timeout(240)]


@pytest.mark.parametrize("name", ["path_is_a_device", "full_disk"])
def test_storage_fault_never_reaches_training(name: str) -> None:
    fault = next(f for f in FAULTS if f.name == name)
    run = run_fault(fault)
    if run.not_run:
        reason = f"{name} cannot be set up on this machine: {run.not_run}"
        missing_in_ci(reason, pytrace=False)
    print(
        f"\n{name}: {run.steps} steps, {run.steps_after_fault} after the fault, {run.seconds:.1f} s"
    )
    assert not run.traceback, run.output
    assert run.exit_codes == (0, 0), run.output
    assert [c.writer for c in run.cells] == [w.name for w in WRITERS]
    failed = [f"{c.writer}: {c.why}" for c in run.cells if not c.ok]
    assert failed == [], run.output
    summary_lines = run.end_block.splitlines()
    assert any(
        line.startswith("  Not written: run summary (RANKWATCH_ARTIFACT_DIR=")
        for line in summary_lines
    ), run.end_block
    assert not any("set RANKWATCH_ARTIFACT_DIR" in line for line in summary_lines)
