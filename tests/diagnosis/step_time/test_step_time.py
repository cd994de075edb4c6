"""The step-time policy, sentence by sentence, at its boundaries (through ``diagnose_means``).

The reference window: every normal rank has input_wait 5, forward 40, backward 50,
optimizer 5 and step 95 (ms), so its outer step is 100 ms, its input share 0.05, residual 0 and
compute share 0.95 (an info ``COMPUTE_BOUND`` that never outranks a warning). A culprit that
arrives ``gap`` ms late at the all-reduce waits ``gap`` ms less in backward; where that time
went decides the attribution. With victim input_wait + step = 100, the score is ``gap / 100``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from rankwatch.diagnosis.config import StepTimeConfig
from rankwatch.diagnosis.step_time import (
    KINDS,
    SIGNALS,
    Finding,
    StepTimeReport,
    diagnose_means,
    normalize_strategy,
    strategy_from_metadata,
)

NORMAL: dict[str, float | None] = {
    "input_wait": 5.0,
    "forward": 40.0,
    "backward": 50.0,
    "optimizer": 5.0,
    "step": 95.0,
}


def normal(**changes: float | None) -> dict[str, float | None]:
    """A normal rank's means with some values changed (None = unmeasured)."""
    out = dict(NORMAL)
    out.update(changes)
    return out


def late(gap: float, cause: str = "input", **changes: float | None) -> dict[str, float | None]:
    """A culprit ``gap`` ms late at the all-reduce because of ``cause`` (input/h2d/compute/none).

    Its backward is ``gap`` shorter; the lateness shows as extra input wait, H2D or forward
    time, or nowhere (``none``: the time went to an unmeasured part of the step).
    """
    out = normal(backward=50.0 - gap)
    if cause == "input":
        out["input_wait"] = 5.0 + gap
        out["step"] = 95.0 - gap
    elif cause == "h2d":
        out["h2d"] = gap
    elif cause == "compute":
        out["forward"] = 40.0 + gap
    elif cause != "none":
        raise AssertionError(cause)
    out.update(changes)
    return out


def window(
    culprit: dict[str, float | None] | None = None, n: int = 3, at: int = 0
) -> dict[int, dict[str, float | None] | None]:
    """``n`` normal ranks, rank ``at`` replaced by ``culprit``."""
    out: dict[int, dict[str, float | None] | None] = {r: normal() for r in range(n)}
    if culprit is not None:
        out[at] = culprit
    return out


def diag(means: Any, steps: int = 100, **kw: Any) -> StepTimeReport:
    return diagnose_means(means, steps=steps, **kw)


def kinds(report: StepTimeReport) -> list[str]:
    return [f.kind for f in report.findings]


def finding(report: StepTimeReport, kind: str) -> Finding:
    (found,) = [f for f in report.findings if f.kind == kind]
    return found


def stragglers(report: StepTimeReport) -> list[Finding]:
    return [f for f in report.findings if f.is_straggler]


# --- reference window and report shape -----------------------------------------------------


def test_balanced_reference_window_is_compute_bound_info() -> None:
    r = diag(window())
    assert r.kind == "COMPUTE_BOUND"
    assert r.severity == "info"
    assert r.findings[0].score == pytest.approx(0.95)
    assert r.straggler is not None and r.straggler.score == 0.0
    assert r.clock == "cpu" and r.strategy == "ddp" and r.steps == 100
    assert r.ranks == (0, 1, 2)


def test_balanced_when_no_rule_fires_and_nothing_abstained() -> None:
    # Compute share 0.89, residual 0.06: not compute bound; shares of input/residual below 0.10.
    means = {r: normal(step=95.0, forward=34.0) for r in range(3)}
    r = diag(means)
    assert r.kind == "BALANCED"
    assert r.severity is None
    assert r.findings == (Finding("BALANCED", "info", 0.0),)


def test_report_rank_means_and_visible() -> None:
    r = diag(window(late(10.0)))
    assert r.rank_means[0] == {
        "input_wait": 15.0,
        "h2d": None,
        "forward": 40.0,
        "backward": 40.0,
        "optimizer": 5.0,
        "step": 85.0,
        "residual": 0.0,
        "forward_wait": None,
        "backward_wait": None,
        "visible": 40.0,
    }
    assert r.rank_means[1]["visible"] == 50.0
    assert r.missing_signals == {0: ("h2d",), 1: ("h2d",), 2: ("h2d",)}


def test_kinds_list_is_the_documented_set() -> None:
    assert set(KINDS) == {
        "STRAGGLER",
        "INPUT_STRAGGLER",
        "COMPUTE_STRAGGLER",
        "H2D_STRAGGLER",
        "INPUT_BOUND",
        "H2D_BOUND",
        "RESIDUAL_HEAVY",
        "COMPUTE_BOUND",
        "WARMUP",
        "INCOMPLETE_DATA",
        "BALANCED",
    }


# --- score thresholds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gap", "severity"),
    [(0.0, None), (9.99, None), (10.0, "warning"), (19.99, "warning"), (20.0, "critical")],
)
def test_score_boundaries(gap: float, severity: str | None) -> None:
    r = diag(window(late(gap)))
    assert r.straggler is not None
    assert r.straggler.score == pytest.approx(gap / 100.0)
    found = stragglers(r)
    if severity is None:
        assert found == []
    else:
        assert [f.severity for f in found] == [severity]
        assert r.kind == "INPUT_STRAGGLER" and r.severity == severity


def test_score_formula_uses_victim_outer_step() -> None:
    # Victim: input_wait 20 + step 180 = 200; visible gap 30 -> 0.15.
    means = {
        0: {"input_wait": 20.0, "forward": 60.0, "backward": 50.0, "step": 180.0},
        1: {"input_wait": 20.0, "forward": 60.0, "backward": 80.0, "step": 180.0},
        2: {"input_wait": 20.0, "forward": 60.0, "backward": 80.0, "step": 180.0},
    }
    r = diag(means)
    assert r.straggler is not None
    assert r.straggler.score == pytest.approx(30.0 / 200.0)
    assert (r.straggler.visible_culprit_ms, r.straggler.visible_victim_ms) == (50.0, 80.0)


def test_evidence_published_below_the_warning_score() -> None:
    r = diag(window(late(4.0)))
    assert stragglers(r) == []
    ev = r.straggler
    assert ev is not None
    assert ev.score == pytest.approx(0.04)
    assert ev.culprit_rank == 0 and ev.component == "input"
    assert ev.component_coverage["input"] == pytest.approx(1.0)
    assert r.to_dict()["straggler"]["score"] == pytest.approx(0.04)


def test_custom_thresholds_from_config() -> None:
    cfg = StepTimeConfig(straggler_warning_score=0.03, straggler_critical_score=0.05)
    assert stragglers(diag(window(late(4.0)), config=cfg))[0].severity == "warning"
    assert stragglers(diag(window(late(5.0)), config=cfg))[0].severity == "critical"


# --- culprit and victim --------------------------------------------------------------------


def test_two_ranks_victim_is_the_other_rank() -> None:
    r = diag({0: normal(), 1: late(15.0)})
    f = stragglers(r)[0]
    assert (f.culprit_rank, f.victim_rank) == (1, 0)
    assert f.ranks == (1,)


def test_even_rank_count_victim_is_upper_median() -> None:
    # visible (backward): rank 0: 30, 1: 45, 2: 47, 3: 49 -> sorted index 4 // 2 = 2 -> rank 2.
    means = {
        0: normal(backward=30.0),
        1: normal(backward=45.0),
        2: normal(backward=47.0),
        3: normal(backward=49.0),
    }
    ev = diag(means).straggler
    assert ev is not None
    assert (ev.culprit_rank, ev.victim_rank) == (0, 2)
    assert ev.score == pytest.approx(17.0 / 100.0)


def test_odd_rank_count_victim_is_the_median() -> None:
    backward = {0: 49.0, 1: 30.0, 2: 47.0, 3: 45.0, 4: 50.0}  # sorted: 1, 3, 2, 0, 4
    ev = diag({r: normal(backward=b) for r, b in backward.items()}).straggler
    assert ev is not None
    assert (ev.culprit_rank, ev.victim_rank) == (1, 2)


def test_ties_go_to_the_lower_rank_id() -> None:
    means = {
        7: normal(backward=30.0),
        3: normal(backward=30.0),
        5: normal(backward=50.0),
        9: normal(backward=50.0),
    }
    ev = diag(means).straggler
    assert ev is not None
    # sorted by (visible, rank): 3, 7, 5, 9 -> culprit 3, victim index 2 = rank 5.
    assert (ev.culprit_rank, ev.victim_rank) == (3, 5)


def test_victim_is_median_not_the_maximum() -> None:
    means = {r: normal() for r in range(5)}
    means[0] = normal(backward=30.0)
    means[4] = normal(backward=90.0)  # an outlier on the other side is not the reference
    ev = diag(means).straggler
    # sorted: (30, 0), (50, 1), (50, 2), (50, 3), (90, 4) -> index 2 = rank 2, visible 50.
    assert ev is not None and ev.victim_rank == 2 and ev.visible_victim_ms == 50.0


# --- eligibility ---------------------------------------------------------------------------


def test_fewer_than_two_eligible_ranks_no_straggler() -> None:
    r = diag({0: normal()})
    assert r.straggler is None
    assert stragglers(r) == []


def test_zero_backward_is_ineligible_but_not_missing() -> None:
    # Rank 0's measured zero backward makes it ineligible, not a fast rank; no abstention.
    means = {0: normal(backward=0.0, step=45.0), 1: normal(forward=34.0)}
    r = diag(means)
    assert r.straggler is None
    assert r.kind != "INCOMPLETE_DATA"
    assert r.missing_signals == {0: ("h2d",), 1: ("h2d",)}


def test_zero_outer_step_is_ineligible() -> None:
    # Eligibility tests the outer step (input_wait + step), as the reference implementation.
    means = window(normal(step=0.0, input_wait=0.0, backward=10.0))
    ev = diag(means).straggler
    assert ev is not None and 0 not in ev.eligible_ranks
    means = window(normal(step=0.0, input_wait=30.0, backward=10.0))
    ev = diag(means).straggler
    assert ev is not None and 0 in ev.eligible_ranks


def test_unmeasured_input_wait_makes_the_rule_abstain() -> None:
    means = {0: normal(input_wait=None), 1: normal(input_wait=None)}
    r = diag(means)
    assert r.straggler is None
    assert r.kind == "INCOMPLETE_DATA" and r.severity is None
    assert r.findings[0].missing_signals == ("input_wait",)
    assert r.findings[0].ranks == (0, 1)


def test_measured_zero_input_wait_is_kept() -> None:
    means = {0: normal(input_wait=0.0, h2d=0.0), 1: late(20.0, "h2d", input_wait=0.0)}
    r = diag(means)
    assert r.straggler is not None
    assert r.straggler.component_excesses_ms["input"] == 0.0
    assert r.straggler.component == "h2d"


def test_abstention_on_one_rank_still_diagnoses_the_others() -> None:
    means = window(late(20.0), n=4)
    means[3] = normal(step=None)
    r = diag(means)
    assert r.kind == "INPUT_STRAGGLER"
    assert r.straggler is not None and r.straggler.eligible_ranks == (0, 1, 2)


def test_abstention_without_any_finding_is_incomplete_not_balanced() -> None:
    means = {r: normal(forward=34.0) for r in range(3)}
    assert diag(means).kind == "BALANCED"
    means[2] = normal(forward=34.0, backward=None)
    r = diag(means)
    assert r.kind == "INCOMPLETE_DATA"
    assert r.findings[0].ranks == (2,)
    assert r.findings[0].missing_signals == ("backward",)
    assert r.missing_signals[2] == ("h2d", "backward")


def test_missing_rank_is_incomplete_data_naming_its_signals() -> None:
    means: dict[int, Any] = {r: normal(forward=34.0) for r in range(3)}
    means[3] = None
    r = diag(means)
    assert r.kind == "INCOMPLETE_DATA"
    assert r.missing_ranks == (3,)
    assert r.missing_signals[3] == SIGNALS
    assert r.rank_means[3] == dict.fromkeys(r.rank_means[3])  # all None
    assert r.findings[0].ranks == (3,)


def test_all_ranks_missing_is_incomplete_data() -> None:
    r = diag({0: None, 1: None})
    assert r.kind == "INCOMPLETE_DATA"
    assert r.missing_ranks == (0, 1)


# --- attribution ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("excess", "kind", "component"),
    [
        (15.8, "STRAGGLER", "sync_or_unattributed"),  # coverage 0.79
        (16.0, "INPUT_STRAGGLER", "input"),  # coverage 0.80
    ],
)
def test_coverage_boundary(excess: float, kind: str, component: str) -> None:
    culprit = normal(backward=30.0, input_wait=5.0 + excess)
    r = diag(window(culprit))
    f = stragglers(r)[0]
    assert f.kind == kind and f.component == component
    assert f.component_coverage["input"] == pytest.approx(excess / 20.0)
    assert f.component_excesses_ms["input"] == pytest.approx(excess)


def test_coverage_is_bounded_to_one_and_zero() -> None:
    culprit = normal(backward=40.0, input_wait=40.0, forward=30.0)  # excess 35 of a 10 gap
    ev = diag(window(culprit)).straggler
    assert ev is not None
    assert ev.component_coverage == {"input": 1.0, "compute": 0.0}
    # Evidence excesses are floored at 0: a culprit faster than the victim has no excess.
    assert ev.component_excesses_ms == {"input": 35.0, "compute": 0.0}


def test_h2d_straggler_when_measured_on_both() -> None:
    means = {r: normal(h2d=0.0) for r in range(3)}
    means[0] = late(20.0, "h2d")
    r = diag(means)
    assert r.kind == "H2D_STRAGGLER"
    assert r.findings[0].component == "h2d"
    assert r.findings[0].component_coverage["h2d"] == 1.0


def test_measured_zero_h2d_vs_unmeasured_h2d_in_attribution() -> None:
    measured = {r: normal(h2d=0.0) for r in range(3)}
    measured[0] = late(20.0, "none", h2d=0.0)
    unmeasured = window(late(20.0, "none"))
    ev_m, ev_u = diag(measured).straggler, diag(unmeasured).straggler
    assert ev_m is not None and ev_u is not None
    assert ev_m.component_excesses_ms == {"input": 0.0, "h2d": 0.0, "compute": 0.0}
    assert ev_u.component_excesses_ms == {"input": 0.0, "compute": 0.0}
    assert "h2d" not in ev_u.component_coverage
    assert ev_u.missing_signals == ("h2d",)
    assert ev_m.missing_signals == ()


def test_h2d_measured_on_the_culprit_only_cannot_name_the_cause() -> None:
    means = window(late(20.0, "h2d"))  # victims have no h2d measurement
    r = diag(means)
    assert r.kind == "STRAGGLER"
    assert r.findings[0].component == "sync_or_unattributed"
    assert "h2d" not in r.findings[0].component_excesses_ms
    assert r.findings[0].missing_signals == ("h2d",)


def test_compute_straggler_ddp() -> None:
    r = diag(window(late(20.0, "compute")))
    assert r.kind == "COMPUTE_STRAGGLER" and r.severity == "critical"
    assert r.findings[0].component_coverage["compute"] == 1.0


def test_compute_attribution_needs_forward_on_both() -> None:
    means = window(late(20.0, "compute"))
    means[1] = normal(forward=None)
    means[2] = normal(forward=None)
    r = diag(means)
    assert stragglers(r)[0].kind == "STRAGGLER"
    assert "compute" not in stragglers(r)[0].component_coverage
    assert stragglers(r)[0].missing_signals == ("h2d", "forward")


def test_unattributed_straggler_keeps_its_severity() -> None:
    r = diag(window(late(25.0, "none")))
    f = stragglers(r)[0]
    assert f.kind == "STRAGGLER" and f.component == "sync_or_unattributed"
    assert f.severity == "critical"


def test_component_ties_prefer_input_then_h2d_then_compute() -> None:
    # Each cause covers half of a 20 ms gap... and all three are equal.
    base = {r: normal(h2d=0.0) for r in range(3)}
    tie = normal(backward=30.0, input_wait=25.0, h2d=20.0, forward=60.0)
    base[0] = tie
    assert diag(base).findings[0].component == "input"
    base[0] = normal(backward=30.0, h2d=20.0, forward=60.0)
    assert diag(base).findings[0].component == "h2d"
    base[0] = normal(backward=30.0, h2d=10.0, forward=60.0)
    assert diag(base).findings[0].component == "compute"


def test_best_component_wins_over_order() -> None:
    means = {r: normal(h2d=0.0) for r in range(3)}
    means[0] = normal(backward=30.0, input_wait=10.0, h2d=18.0)
    r = diag(means)
    assert r.kind == "H2D_STRAGGLER"
    assert r.findings[0].component_coverage == {"input": 0.25, "h2d": 0.9, "compute": 0.0}


# --- strategy ------------------------------------------------------------------------------


def test_fsdp_visible_phase_is_forward_plus_backward() -> None:
    means = window(normal(forward=30.0, backward=40.0, input_wait=25.0, step=75.0))
    r = diag(means, strategy="fsdp")
    ev = r.straggler
    assert ev is not None
    assert (ev.visible_culprit_ms, ev.visible_victim_ms) == (70.0, 90.0)
    assert ev.score == pytest.approx(0.2)
    assert r.rank_means[1]["visible"] == 90.0


def test_fsdp_caps_at_warning() -> None:
    # DDP: visible gap 20 -> 0.20; FSDP: gap 30 -> 0.30; input excess 30 covers both.
    means = window(normal(forward=30.0, backward=30.0, input_wait=35.0, step=65.0))
    assert diag(means).severity == "critical"
    r = diag(means, strategy="fsdp")
    assert r.kind == "INPUT_STRAGGLER" and r.severity == "warning"


@pytest.mark.parametrize("input_wait", [30.0, 900.0])  # input share 0.24 and 0.90
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bottlenecks_are_never_critical(input_wait: float, strategy: str) -> None:
    # A share of the step is a steady property of the job, not a fault: it never pages.
    means = {r: normal(input_wait=input_wait) for r in range(3)}
    assert finding(diag(means, strategy=strategy), "INPUT_BOUND").severity == "warning"


def test_fsdp_never_attributes_compute() -> None:
    means = window(normal(forward=60.0, backward=20.0))
    ev = diag(means, strategy="fsdp").straggler
    assert ev is not None
    # Present with 0 (measured, not attributable), as the reference implementation.
    assert ev.component_excesses_ms["compute"] == 0.0
    assert ev.component_coverage["compute"] == 0.0
    assert ev.component != "compute"
    assert diag(means).straggler is not None


def test_fsdp_eligibility_needs_forward() -> None:
    means = window(normal(forward=0.0))
    ev = diag(means, strategy="fsdp").straggler
    assert ev is not None and ev.eligible_ranks == (1, 2)
    means = window(normal(forward=None))
    r = diag(means, strategy="fsdp")
    assert r.straggler is not None and r.straggler.eligible_ranks == (1, 2)


@pytest.mark.parametrize("strategy", [None, "", "ddp", "DDP", " ddp "])
def test_missing_strategy_means_ddp(strategy: str | None) -> None:
    r = diag(window(late(25.0)), strategy=strategy)
    assert r.strategy == "ddp" and r.severity == "critical"


def test_fsdp_strategy_in_any_case() -> None:
    assert diag(window(), strategy="FSDP").strategy == "fsdp"
    assert normalize_strategy("Fsdp") == "fsdp"


@pytest.mark.parametrize("bad", ["deepspeed", "fsdp3", "zero"])
def test_unknown_strategy_string_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match=rf"strategy.*{bad!r}"):
        diag(window(), strategy=bad)


@pytest.mark.parametrize("bad", [1, 1.0, True, ["ddp"], b"ddp"])
def test_strategy_of_the_wrong_type_is_a_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match="strategy"):
        diag(window(), strategy=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        (None, "ddp"),
        ("", "ddp"),
        ("deepspeed", "ddp"),
        (42, "ddp"),
        ("ddp", "ddp"),
        ("FSDP", "fsdp"),
        ("fsdp2", "fsdp"),
        ("fully-sharded-data-parallel", "fsdp"),
    ],
)
def test_advisory_metadata_defaults_to_ddp(metadata: object, expected: str) -> None:
    assert strategy_from_metadata(metadata) == expected


# --- confidence gates ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "kind", "severity"),
    [
        (0, "WARMUP", None),
        (1, "WARMUP", None),
        (2, "INPUT_STRAGGLER", "warning"),
        (19, "INPUT_STRAGGLER", "warning"),
        (20, "INPUT_STRAGGLER", "critical"),
    ],
)
def test_step_gates(steps: int, kind: str, severity: str | None) -> None:
    r = diag(window(late(25.0)), steps=steps)
    assert (r.kind, r.severity) == (kind, severity)
    assert r.steps == steps


def test_warmup_still_publishes_evidence() -> None:
    r = diag(window(late(25.0)), steps=1)
    assert r.findings == (Finding("WARMUP", "info", 0.0),)
    assert r.straggler is not None and r.straggler.score == pytest.approx(0.25)


def test_warning_needs_two_steps_even_for_info() -> None:
    assert diag(window(), steps=1).kind == "WARMUP"
    assert diag(window(), steps=2).kind == "COMPUTE_BOUND"


def test_custom_step_gates() -> None:
    cfg = StepTimeConfig(min_steps_warning=5, min_steps_critical=50)
    assert diag(window(late(25.0)), steps=4, config=cfg).kind == "WARMUP"
    assert diag(window(late(25.0)), steps=49, config=cfg).severity == "warning"
    assert diag(window(late(25.0)), steps=50, config=cfg).severity == "critical"


# --- single-rank bottlenecks ---------------------------------------------------------------


def _input_share(share: float) -> dict[int, dict[str, float | None]]:
    # outer 100: input_wait = share * 100, the rest in compute (no residual).
    iw = share * 100.0
    return {r: normal(input_wait=iw, step=100.0 - iw, forward=45.0 - iw) for r in range(3)}


@pytest.mark.parametrize(
    ("share", "severity"),
    [(0.0999, None), (0.10, "warning"), (0.1999, "warning"), (0.20, "warning"), (0.45, "warning")],
)
def test_input_bound_boundaries(share: float, severity: str | None) -> None:
    r = diag(_input_share(share))
    got = [f for f in r.findings if f.kind == "INPUT_BOUND"]
    if severity is None:
        assert got == []
    else:
        assert [f.severity for f in got] == [severity]
        assert got[0].score == pytest.approx(share)
        assert got[0].ranks == (0, 1, 2)


def test_bottleneck_uses_the_median_across_ranks() -> None:
    means = {
        0: normal(input_wait=5.0),
        1: normal(input_wait=30.0, step=70.0, forward=15.0),  # 0.30
        2: normal(input_wait=12.0, step=88.0, forward=33.0),  # 0.12
    }
    f = finding(diag(means), "INPUT_BOUND")
    assert f.score == pytest.approx(0.12)
    assert f.severity == "warning"
    assert f.ranks == (1, 2)


def test_bottleneck_median_of_an_even_count_averages_the_middle_pair() -> None:
    means = {
        0: normal(input_wait=5.0),
        1: normal(input_wait=15.0, step=85.0, forward=30.0),
    }
    f = finding(diag(means), "INPUT_BOUND")
    assert f.score == pytest.approx(0.10)
    assert f.ranks == (1,)


@pytest.mark.parametrize(
    ("residual", "severity"),
    [(9.99, None), (10.0, "warning"), (19.99, "warning"), (20.0, "warning"), (40.0, "warning")],
)
def test_residual_heavy_boundaries(residual: float, severity: str | None) -> None:
    means = {r: normal(forward=40.0 - residual) for r in range(3)}
    got = [f for f in diag(means).findings if f.kind == "RESIDUAL_HEAVY"]
    assert [f.severity for f in got] == ([] if severity is None else [severity])


def test_residual_is_derived_and_can_be_overridden() -> None:
    r = diag({0: normal(forward=20.0)})
    assert r.rank_means[0]["residual"] == 20.0
    r = diag({0: normal(forward=20.0, residual=3.0)})
    assert r.rank_means[0]["residual"] == 3.0
    assert [f.kind for f in r.findings] == ["BALANCED"]


def test_residual_never_negative() -> None:
    r = diag({0: normal(forward=80.0)})
    assert r.rank_means[0]["residual"] == 0.0


@pytest.mark.parametrize("clock", ["cpu", "gpu"])
def test_h2d_bound_only_on_the_gpu_clock(clock: str) -> None:
    means = {r: normal(h2d=25.0, forward=15.0) for r in range(3)}  # h2d share 0.25
    r = diag(means, clock=clock)
    if clock == "gpu":
        assert r.kind == "H2D_BOUND" and r.severity == "warning"
    else:
        assert "H2D_BOUND" not in kinds(r)
    assert r.clock == clock


def test_measured_zero_h2d_vs_unmeasured_h2d_on_the_gpu_clock() -> None:
    zero = {r: normal(h2d=0.0, forward=34.0) for r in range(3)}
    none = {r: normal(forward=34.0) for r in range(3)}
    assert diag(zero, clock="gpu").kind == "BALANCED"
    r = diag(none, clock="gpu")
    assert r.kind == "INCOMPLETE_DATA"
    assert r.findings[0].missing_signals == ("h2d",)
    # On the CPU clock no rule needs H2D: nothing abstained.
    assert diag(none, clock="cpu").kind == "BALANCED"


@pytest.mark.parametrize(
    ("compute", "kind"), [(0.8999, "BALANCED"), (0.90, "COMPUTE_BOUND"), (0.95, "COMPUTE_BOUND")]
)
def test_compute_bound_boundary(compute: float, kind: str) -> None:
    # outer 100: input 0.05, compute `compute`, residual the rest (<= 0.0501).
    means = {
        r: {
            "input_wait": 5.0,
            "forward": 40.0,
            "backward": compute * 100.0 - 45.0,
            "optimizer": 5.0,
            "step": 95.0,
        }
        for r in range(3)
    }
    r = diag(means)
    assert r.kind == kind
    if kind == "COMPUTE_BOUND":
        assert r.severity == "info"
        assert r.findings[0].score == pytest.approx(compute)


def test_compute_bound_needs_every_other_share_below_warning() -> None:
    means = {r: normal(input_wait=10.0, step=90.0, forward=35.0) for r in range(3)}
    # compute (35+50+5)/100 = 0.90, input 0.10 -> INPUT_BOUND only.
    assert kinds(diag(means)) == ["INPUT_BOUND"]


def test_compute_bound_is_never_capped_above_info() -> None:
    r = diag(window(), steps=5, strategy="fsdp")
    assert (r.kind, r.severity) == ("COMPUTE_BOUND", "info")


# --- precedence ----------------------------------------------------------------------------


def test_higher_severity_wins() -> None:
    # Straggler critical 0.25 vs residual-heavy warning 0.50 (all ranks): the fault first.
    means = {r: normal(residual=50.0) for r in range(3)}
    means[0] = late(25.0, residual=50.0)
    r = diag(means)
    assert kinds(r)[:2] == ["INPUT_STRAGGLER", "RESIDUAL_HEAVY"]
    assert r.severity == "critical"
    assert finding(r, "RESIDUAL_HEAVY").score == pytest.approx(0.5)


def test_residual_heavy_and_a_straggler_of_the_same_severity_rank_by_score() -> None:
    # Straggler warning 0.12 vs residual-heavy warning 0.25: the higher score first.
    means = {r: normal(forward=15.0) for r in range(3)}
    means[0] = normal(forward=15.0, backward=38.0, input_wait=17.0, step=83.0)
    r = diag(means)
    assert kinds(r)[:2] == ["RESIDUAL_HEAVY", "INPUT_STRAGGLER"]
    assert r.severity == "warning"


def test_same_severity_higher_score_wins() -> None:
    means = {r: normal(input_wait=15.0, step=85.0, forward=30.0) for r in range(3)}  # 0.15
    means[0] = normal(input_wait=27.0, step=73.0, forward=30.0, backward=38.0)  # gap 12
    r = diag(means)
    assert kinds(r)[:2] == ["INPUT_BOUND", "INPUT_STRAGGLER"]
    assert finding(r, "INPUT_BOUND").score == pytest.approx(0.15)
    assert finding(r, "INPUT_STRAGGLER").score == pytest.approx(0.12)


def test_straggler_wins_an_exact_tie() -> None:
    means = {r: normal(input_wait=15.0, step=85.0, forward=30.0) for r in range(3)}  # 0.15
    means[0] = normal(input_wait=30.0, step=70.0, forward=30.0, backward=35.0)  # gap 15
    r = diag(means)
    assert finding(r, "INPUT_STRAGGLER").score == finding(r, "INPUT_BOUND").score
    assert kinds(r)[:2] == ["INPUT_STRAGGLER", "INPUT_BOUND"]


def test_report_kind_and_severity_follow_the_first_finding() -> None:
    r = diag(window(late(12.0)))
    assert r.kind == r.findings[0].kind == "INPUT_STRAGGLER"
    assert r.severity == r.findings[0].severity == "warning"


# --- to_dict -------------------------------------------------------------------------------


def test_to_dict_is_json_ready_without_nan() -> None:
    means: dict[int, Any] = window(late(22.0))
    means[5] = None
    d = diag(means).to_dict()
    text = json.dumps(d, allow_nan=False)
    back = json.loads(text)
    assert back == d
    assert back["kind"] == "INPUT_STRAGGLER"
    f = back["findings"][0]
    for key in (
        "kind",
        "severity",
        "score",
        "ranks",
        "culprit_rank",
        "victim_rank",
        "component",
        "visible_culprit_ms",
        "visible_victim_ms",
        "component_excesses_ms",
        "component_coverage",
        "missing_signals",
    ):
        assert key in f
    assert back["rank_means"]["5"]["step"] is None
    assert back["missing_signals"]["5"] == list(SIGNALS)
    assert back["missing_ranks"] == [5]


def test_to_dict_maps_non_finite_evidence_to_none() -> None:
    f = Finding("STRAGGLER", "warning", math.nan, component_coverage={"input": math.inf})
    d = f.to_dict()
    assert d["score"] is None and d["component_coverage"] == {"input": None}
    json.dumps(d, allow_nan=False)


def test_every_public_function_accepts_config_none() -> None:
    assert diag(window(), config=None).kind == "COMPUTE_BOUND"
    with pytest.raises(ValueError, match="config"):
        diag(window(), config={"straggler_warning_score": 0.1})  # type: ignore[arg-type]


# --- the worked example of docs/diagnosis-step-time.md -------------------------------------

DOC_EXAMPLE: dict[int, dict[str, float | None]] = {
    0: {"input_wait": 6, "h2d": 2, "forward": 40, "backward": 52, "optimizer": 5, "step": 101},
    1: {"input_wait": 6, "h2d": 2, "forward": 40, "backward": 50, "optimizer": 5, "step": 99},
    2: {"input_wait": 30, "h2d": 2, "forward": 41, "backward": 26, "optimizer": 5, "step": 76},
    3: {"input_wait": 6, "h2d": 2, "forward": 40, "backward": 49, "optimizer": 5, "step": 98},
}


def test_worked_example_from_the_docs() -> None:
    r = diagnose_means(DOC_EXAMPLE, steps=100, strategy="ddp", clock="cpu")
    d = r.to_dict()
    assert d["findings"][0] == {
        "kind": "INPUT_STRAGGLER",
        "severity": "critical",
        "score": 0.22857142857142856,
        "ranks": [2],
        "culprit_rank": 2,
        "victim_rank": 1,
        "component": "input",
        "visible_culprit_ms": 26.0,
        "visible_victim_ms": 50.0,
        "component_excesses_ms": {"input": 24.0, "h2d": 0.0, "compute": 1.0},
        "component_coverage": {"input": 1.0, "h2d": 0.0, "compute": 0.041666666666666664},
        "missing_signals": [],
    }
    assert d["visible_definition"] == "backward"
    second = d["findings"][1]
    assert (second["kind"], second["severity"], second["ranks"]) == (
        "COMPUTE_BOUND",
        "info",
        [0, 1, 3],
    )
    assert second["score"] == pytest.approx(0.9043, abs=1e-4)
    assert all(m["residual"] == 2.0 for m in d["rank_means"].values())

    fsdp = diagnose_means(DOC_EXAMPLE, steps=100, strategy="fsdp")
    assert (fsdp.kind, fsdp.severity) == ("INPUT_STRAGGLER", "warning")
    assert fsdp.straggler is not None
    assert fsdp.straggler.score == pytest.approx(0.2190, abs=1e-4)
    assert set(fsdp.straggler.component_coverage) == {"input", "h2d", "compute"}
    assert fsdp.straggler.component_coverage["compute"] == 0.0

    assert diagnose_means(DOC_EXAMPLE, steps=12).severity == "warning"
    warm = diagnose_means(DOC_EXAMPLE, steps=1)
    assert warm.kind == "WARMUP" and warm.straggler is not None
    assert warm.straggler.score == pytest.approx(0.2286, abs=1e-4)

    without_3: dict[int, Any] = {**DOC_EXAMPLE, 3: None}
    r3 = diagnose_means(without_3, steps=100)
    assert (r3.kind, r3.severity, r3.missing_ranks) == ("INPUT_STRAGGLER", "critical", (3,))

    no_input = {**DOC_EXAMPLE, 2: {**DOC_EXAMPLE[2], "input_wait": None}}
    r2 = diagnose_means(no_input, steps=100)
    assert (r2.kind, r2.severity) == ("COMPUTE_BOUND", "info")
    assert r2.straggler is not None and r2.straggler.score == pytest.approx(0.0095, abs=1e-4)
    assert r2.missing_signals[2] == ("input_wait",)
