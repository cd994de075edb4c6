"""The fault's unit: a rank, or the host whose ranks are late together (``step_time/units.py``)."""

from __future__ import annotations

import pytest

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.step_time import diagnose_means, name_fault_unit

BASE_MS = {"input_wait": 5.0, "h2d": 1.0, "forward": 30.0, "backward": 60.0, "optimizer": 5.0}


def _means(n: int, slow: dict[int, float]) -> dict[int, dict[str, float | None]]:
    """A DDP window: the ``slow`` ranks spend extra ms in forward, every other rank waits that
    long in its backward (the gradient all-reduce), so every step takes as long."""
    most = max(slow.values(), default=0.0)
    means: dict[int, dict[str, float | None]] = {}
    for r in range(n):
        m: dict[str, float | None] = dict(BASE_MS)
        extra = slow.get(r, 0.0)
        m["forward"] = 30.0 + extra
        m["backward"] = 60.0 + most - extra
        m["step"] = 100.0 + most
        means[r] = m
    return means


def _hosts(n: int, per_host: int) -> dict[int, str]:
    return {r: f"node-{chr(ord('a') + r // per_host)}" for r in range(n)}


def _unit(n: int, per_host: int, slow: dict[int, float], **cfg: float):
    report = diagnose_means(_means(n, slow), steps=50)
    named = name_fault_unit(report, _hosts(n, per_host), StepTimeConfig(**cfg))
    return report, named, named.findings[0]


def test_a_slow_node_is_named_with_its_late_ranks():
    report, _, finding = _unit(4, 2, {2: 40.0, 3: 39.0})
    assert report.findings[0].culprit_rank == 2 and not report.findings[0].slow_host
    assert finding.slow_host == "node-b"
    assert finding.slow_host_ranks == (2, 3) and finding.ranks == (2, 3)
    assert finding.slow_host_size == 2
    # The culprit, score and attribution stay the latest rank's.
    assert finding.culprit_rank == 2 and finding.kind == "COMPUTE_STRAGGLER"
    assert finding.score == report.findings[0].score
    assert finding.to_dict()["slow_host"] == "node-b"


def test_a_lone_slow_gpu_on_a_healthy_node_stays_a_rank():
    report, named, finding = _unit(4, 2, {2: 40.0})
    assert named is report
    assert finding.slow_host == "" and finding.ranks == (2,)
    assert "slow_host" not in finding.to_dict()


def test_most_of_a_node_is_the_node_half_of_it_is_not():
    _, _, most = _unit(8, 4, {4: 40.0, 5: 38.0, 6: 36.0})
    assert most.slow_host == "node-b" and most.slow_host_ranks == (4, 5, 6)
    assert most.slow_host_size == 4
    _, _, half = _unit(8, 4, {4: 40.0, 5: 38.0})
    assert half.slow_host == "" and half.ranks == (4,)


def test_a_neighbour_much_less_late_is_not_late_with_the_culprit():
    # Rank 3 is late by 10 of rank 2's 40 ms: below half the culprit's gap.
    _, _, finding = _unit(4, 2, {2: 40.0, 3: 10.0})
    assert finding.slow_host == ""
    # With a lower bar, it is.
    _, _, lower = _unit(4, 2, {2: 40.0, 3: 10.0}, slow_host_gap_fraction=0.2)
    assert lower.slow_host == "node-b"


def test_unknown_hosts_and_one_rank_per_host_never_make_a_host():
    report = diagnose_means(_means(4, {2: 40.0, 3: 40.0}), steps=50)
    assert name_fault_unit(report, {}) is report
    assert name_fault_unit(report, {r: "" for r in range(4)}) is report
    assert name_fault_unit(report, _hosts(4, 1)) is report


def test_a_balanced_window_is_left_alone():
    report = diagnose_means(_means(4, {}), steps=50)
    assert name_fault_unit(report, _hosts(4, 2)) is report


def test_bad_input_names_the_field():
    report = diagnose_means(_means(4, {2: 40.0}), steps=50)
    with pytest.raises(TypeError, match="report: expected StepTimeReport"):
        name_fault_unit({"kind": "STRAGGLER"}, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hostnames: expected a mapping"):
        name_fault_unit(report, ["node-a"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config: expected StepTimeConfig"):
        name_fault_unit(report, {}, {"slow_host_gap_fraction": 0.5})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("slow_host_gap_fraction", 0.0),
        ("slow_host_gap_fraction", 1.5),
        ("slow_host_rank_fraction", 0.5),
        ("slow_host_rank_fraction", 2.0),
    ],
)
def test_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=f"{field}.*{value}"):
        StepTimeConfig(**{field: value})


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANKWATCH_SLOW_HOST_RANK_FRACTION", "1")
    assert StepTimeConfig.from_env().slow_host_rank_fraction == 1.0
    monkeypatch.setenv("RANKWATCH_SLOW_HOST_RANK_FRACTION", "half")
    with pytest.raises(ValueError, match=r"RANKWATCH_SLOW_HOST_RANK_FRACTION.*half"):
        StepTimeConfig.from_env()
