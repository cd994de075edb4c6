"""The GPU clock's device check (bench/gpu_check.py) where no GPU is: its one line, and the
table logic it judges a device run with, fed rows the timer produced on the CUDA double."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import (
    ACCELERATE_SCENARIOS,
    FAULT_MS,
    SCENARIOS,
    SLOW_RANK,
    Check,
    checks_of,
    exit_code,
    judge_clock,
    judge_cost,
    judge_verdict,
    render,
    run_cell,
    verdict_of,
)
from rankwatch.diagnosis.step_time.table import column
from rankwatch.exporter.step_time.timer import BACKWARD, FORWARD, OPTIMIZER
from tests.exporter.step_time.cuda_double import Device
from tests.exporter.step_time.test_gpu_streams import PARAMS, Rank, two_ranks_ddp

REPO = Path(__file__).resolve().parents[3]


def test_without_cuda_the_script_prints_one_line_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "gpu_check: no CUDA device here: nothing to check (run it on a machine with a GPU)"
    ]


def clock_cell_on_the_double(steps: int = 8) -> tuple[dict, dict]:
    """The clock cell's loop with the double as the device: the script's own events around
    forward, backward and the optimizer, and the timer's GPU columns of the same steps."""
    rank = Rank(Device())
    t, c = rank.timer, rank.compute
    own: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for i in range(steps):
        marks = [rank.device.event() for _ in range(4)]
        t.start_step()
        marks[0].record(c)
        t.begin(FORWARD)
        c.launch(3.0 + i)
        t.end(FORWARD)
        marks[1].record(c)
        t.begin(BACKWARD)
        for name in PARAMS:
            c.launch(1.0)
            t.last_grad(name)
        t.end(BACKWARD)
        marks[2].record(c)
        t.begin(OPTIMIZER)
        c.launch(0.5)
        t.end(OPTIMIZER)
        marks[3].record(c)
        t.end_step()
        rank.device.advance(100.0)
        t.poll_gpu()
        for k, phase in enumerate(own):
            own[phase].append(marks[k].elapsed_time(marks[k + 1]))
    rows = rank.rows()
    got = {p: rows[:, column("gpu", p)].tolist() for p in own}
    return got, own


def test_the_clock_cell_agrees_with_the_scripts_own_events() -> None:
    got, own = clock_cell_on_the_double()
    check = judge_clock(got, own)
    assert check.ok, check
    assert check.got == "0 absent, worst excess 0.000 ms"
    # A step without its GPU time, or a time off by more than the tolerance, fails the cell.
    missing = {p: list(v) for p, v in got.items()}
    missing["backward"][3] = float("nan")
    assert not judge_clock(missing, own).ok
    off = {p: list(v) for p, v in got.items()}
    off["forward"][5] += 2.0
    bad = judge_clock(off, own)
    assert not bad.ok and "worst excess" in bad.got
    short = {p: v[:-1] for p, v in got.items()}
    assert not judge_clock(short, own).ok


def test_verdicts_from_rows_the_timer_made_on_the_double() -> None:
    per_rank = two_ranks_ddp(SLOW_RANK, FAULT_MS, 30)
    verdict = verdict_of({r: rows.tolist() for r, rows in per_rank.items()}, window=100)
    assert verdict == {
        "kind": "COMPUTE_STRAGGLER",
        "culprit": SLOW_RANK,
        "clock": "gpu",
        "visible": "sync_wait",
    }
    assert judge_verdict("gloo", "forward", verdict).ok
    assert not judge_verdict("gloo", "data", verdict).ok  # expected an input straggler
    assert not judge_verdict("gloo", "control", verdict).ok
    control = verdict_of(two_ranks_ddp(SLOW_RANK, 0.0, 30), window=100)
    assert judge_verdict("gloo", "control", control).ok
    # The right culprit on the seed's fallback definition is not what the check asks.
    assert not judge_verdict("gloo", "forward", {**verdict, "visible": "backward"}).ok


def test_cost_table_and_exit_code() -> None:
    assert judge_cost(10.0, 10.4).ok and not judge_cost(10.0, 11.5).ok
    checks = [Check("cost", "a", "b", True), Check("nccl", "2+ GPUs", "skipped: 1 GPU", True)]
    assert exit_code(checks) == 0
    assert exit_code([*checks, Check("clock", "x", "y", False)]) == 1
    assert exit_code([]) == 1
    table = render([*checks, Check("clock", "x", "y", False)]).splitlines()
    assert table[0].split() == ["cell", "expected", "got", "ok"]
    assert table[-1].split()[-1] == "FAIL" and len(table) == 4


def test_a_cell_that_fails_is_a_row_not_an_exception(tmp_path: Path) -> None:
    # No CUDA here: the clock cell's process fails; the driver reports it and goes on.
    result, error = run_cell("clock", tmp_path)
    assert result is None and error.startswith("exit ")
    (row,) = checks_of("clock", result, error)
    assert not row.ok and row.got == error


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_has_a_row(scenario: str) -> None:
    verdict = {"kind": "BALANCED", "culprit": None, "clock": "gpu", "visible": "sync_wait"}
    rows = checks_of("nccl", dict.fromkeys(SCENARIOS, verdict), "")
    assert [r.cell for r in rows] == [f"nccl {s}" for s in SCENARIOS]
    assert next(r for r in rows if r.cell == f"nccl {scenario}").ok == (scenario == "control")


def test_a_cell_past_its_time_limit_is_killed_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench.gpu_check as check

    monkeypatch.setitem(check.CELL_SECONDS, "cost", 0.05)  # killed while it imports torch
    result, error = run_cell("cost", tmp_path)
    assert result is None and error == "no result within 0 s"


def test_the_accelerate_scenarios_are_judged_by_verdict_and_incidents() -> None:
    """The Accelerate N-D cell (4+ GPUs): the slow rank named, no incident elsewhere, and a
    quiet control."""
    named = {"kind": "STRAGGLER", "culprit": SLOW_RANK, "opened": [[SLOW_RANK]]}
    result = {
        "control": {"kind": "COMPUTE_BOUND", "culprit": None, "opened": []},
        "data": {**named, "kind": "INPUT_STRAGGLER"},
        "forward": named,
    }
    rows = checks_of("accelerate", result, "")
    assert [r.cell for r in rows] == [f"accelerate {s}" for s in ACCELERATE_SCENARIOS]
    assert all(r.ok for r in rows), render(rows)
    wrong = {
        "control": {"kind": "COMPUTE_BOUND", "culprit": None, "opened": [[0, 1, 2, 3]]},
        "data": {**named, "culprit": 0},
        "forward": {**named, "opened": [[SLOW_RANK], [0]]},
    }
    assert not any(r.ok for r in checks_of("accelerate", wrong, ""))


def test_the_hang_cells_are_judged_by_class_and_named_rank() -> None:
    from bench.gpu_check import HANG_SCENARIOS, checks_of, judge_hang

    right = {"cause": "stuck_alive", "ranks": [1]}
    assert judge_hang("sleep", right).ok
    assert not judge_hang("sleep", {"cause": "all_stalled", "ranks": []}).ok
    assert not judge_hang("mismatch", None).ok
    rows = checks_of("hang", {"sleep": right, "mismatch": None}, "")
    assert [r.cell for r in rows] == [f"hang/{s}" for s in HANG_SCENARIOS]
    assert [r.ok for r in rows] == [True, False]
