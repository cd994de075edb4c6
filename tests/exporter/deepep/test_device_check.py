"""The DeepEP device check (bench/device_deepxtrace.py) where no GPU is: its refusal, and the
table and expectation logic it judges a device run with, fed real diagnosis reports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.device_deepxtrace import (
    MIN_NORMAL_RANKS,
    Check,
    exit_code,
    format_table,
    incidents_of,
    judge_delay,
    judge_others_empty,
    judge_quiet,
    judge_unmoved,
    missing_requirement,
    parse_args,
    run_check,
)
from rankwatch.diagnosis.deepep.normal import NormalDiagnoser, NormalSimulator
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.exporter.deepep import deepxtrace as shim

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "device_deepxtrace.py"
EP, RANKS_PER_NODE, LATE_RANK = 16, 8, 9


def _run_script(*args: str, world_size: int = 16) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WORLD_SIZE": str(world_size), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_without_cuda_the_script_says_so_in_one_line_and_exits_2(mode: str) -> None:
    proc = _run_script("--mode", mode)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.splitlines() == [
        f"device_deepxtrace --mode {mode}: needs CUDA (torch.cuda.is_available() is False); not run"
    ]


def test_bad_options_are_refused_naming_the_option() -> None:
    proc = _run_script("--mode", "hybrid")
    assert proc.returncode == 2
    assert "--mode" in proc.stderr and "'hybrid'" in proc.stderr
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--mode", "normal", "--delay-ms", "-1"])


def test_mode_defaults() -> None:
    normal = parse_args(["--mode", "normal"])
    assert (normal.num_tokens, normal.num_experts, normal.delay_rank) == (1024, 256, 9)
    ll = parse_args([])
    assert (ll.mode, ll.num_tokens, ll.num_experts) == ("ll", 128, 288)


def test_missing_requirement_names_what_is_missing_first() -> None:
    assert "CUDA" in str(missing_requirement("normal", cuda=False, deep_ep=False))
    assert "DeepEP" in str(missing_requirement("ll", cuda=True, deep_ep=False))
    assert missing_requirement("ll", cuda=True, deep_ep=True) is None
    no_pr = missing_requirement("normal", cuda=True, deep_ep=True, pr720=False, world_size=16)
    assert no_pr is not None and "pull request 720" in no_pr
    few = missing_requirement("normal", cuda=True, deep_ep=True, pr720=True, world_size=8)
    assert few is not None and f">= {MIN_NORMAL_RANKS} ranks" in few and "is 8" in few
    assert missing_requirement("normal", cuda=True, deep_ep=True, pr720=True, world_size=16) is None
    with pytest.raises(ValueError, match="mode: must be one of ll, normal, got 'x'"):
        missing_requirement("x", cuda=True, deep_ep=True)


def test_table_and_exit_code() -> None:
    checks = [
        Check("kernels counted", "15 of 15", "15 of 15 on 16 ranks", True),
        Check("delay window", "pre_stage_arrival_skew [9]", "no incident", False),
    ]
    lines = format_table(checks).splitlines()
    assert lines[0].split() == ["check", "expected", "got", "ok"]
    assert lines[1].endswith("  ok") and lines[2].endswith("  FAIL")
    # Aligned columns: every row's "got" starts at the same offset.
    words = ["got", "15 of 15 on", "no incident"]
    starts = {line.index(word) for line, word in zip(lines, words, strict=True)}
    assert len(starts) == 1
    assert exit_code(checks) == 1
    assert exit_code(checks[:1]) == 0
    assert exit_code([]) == 1  # nothing checked is not a pass


def test_a_failing_check_does_not_stop_the_others() -> None:
    def boom() -> tuple[str, bool]:
        raise RuntimeError("not reached (warm: AssertionError)")

    failed = run_check("window on rank 0", "one dict", boom)
    assert not failed.ok and failed.got == "error: RuntimeError: not reached (warm: AssertionError)"
    assert run_check("x", "y", lambda: ("seen", True)).ok is True


def _results(phases: list[str]) -> list[Any]:
    """What rank 0's ``diagnose_normal_sync`` returns for each window: real reports of the
    simulated EP 16 group (rank 9 late before dispatch in ``pre_dispatch_delay``)."""
    sim = NormalSimulator(EP, RANKS_PER_NODE, seed=0, slow_rank=LATE_RANK)
    diagnoser = NormalDiagnoser()
    ranks = tuple(RankInfo(r, f"node{r // RANKS_PER_NODE}", r % RANKS_PER_NODE) for r in range(EP))
    out = []
    for i, phase in enumerate(phases):
        normal = diagnoser.diagnose(sim.window(phase))
        report = WindowReport(
            group="ep", window_index=i, created_at_s=0.0, ranks=ranks, normal=normal
        )
        out.append(shim._normal_verdicts(report))
    return out


def test_the_delay_and_control_windows_are_judged_from_real_reports() -> None:
    *_, control, delay = _results(["baseline"] * 5 + ["pre_dispatch_delay"])
    assert judge_quiet(control) == ("no incident", True)
    got, ok = judge_delay(delay, LATE_RANK)
    assert ok and got.count(f"pre_stage_arrival_skew [{LATE_RANK}]") == 2, got
    # The same window judged for another rank, or as a control, fails.
    assert judge_delay(delay, 3)[1] is False
    assert judge_quiet(delay)[1] is False
    # A delay nobody noticed fails and says so.
    assert judge_delay(control, LATE_RANK) == ("no incident", False)


def test_judging_a_window_that_was_not_diagnosed_raises_with_the_reason() -> None:
    idle = shim._normal_verdicts(None)
    with pytest.raises(ValueError, match=r"window not diagnosed.*boundary"):
        judge_quiet(idle)
    with pytest.raises(ValueError, match=r"expected one result dict, got \[\]"):
        incidents_of([])
    assert run_check("control window", "no incident", lambda: judge_quiet(None)).ok is False


def test_delay_seen_only_as_raw_anomalies_shows_them() -> None:
    raw = {"probe": "notify_dispatch", "src": 9}
    result = [{"status": "ok", "incidents": [], "raw_anomalies": [raw]}]
    got, ok = judge_delay(result, 9)
    assert not ok and got == "no incident; raw anomalies [('notify_dispatch', 9)]"


def test_counters_that_stayed_zero_are_named_with_their_ranks() -> None:
    names = shim.NORMAL_STATS_SCHEMA
    everything = [list(names)] * EP
    assert judge_unmoved(names, everything) == (f"15 of 15 on {EP} ranks", True)
    completion = [n for n in names if "completion" in n]
    notify_only = [[n for n in names if n not in completion]] * EP
    got, ok = judge_unmoved(names, notify_only)
    assert not ok and got.startswith("6 of 15; zero: ") and "16 ranks" in got
    one_rank = [list(names)] * EP
    one_rank[5] = list(names[1:])
    got, ok = judge_unmoved(names, one_rank)
    assert not ok and got == f"14 of 15; zero: {names[0]} (ranks [5])"
    got, ok = judge_unmoved(names, [list(names), "error: AttributeError: no diagnose"])
    assert not ok and got == "ranks [1] could not read: error: AttributeError: no diagnose"
    assert judge_unmoved(names, []) == ("no rank reported", False)


def test_every_rank_but_0_must_get_an_empty_list() -> None:
    assert judge_others_empty([[{"status": "ok"}], [], []]) == ("all []", True)
    assert judge_others_empty([[{"status": "ok"}], [], None, [{}]]) == (
        "not [] on ranks [2, 3]",
        False,
    )
