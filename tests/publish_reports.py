"""Window reports for the publisher tests, built by the real engines (no hand-made fakes).

Step-time reports come from ``diagnose_means`` over chosen per-rank means, normal-mode reports
from the seeded simulator through the real diagnoser, low-latency results from the real rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from rankwatch.diagnosis.deepep.low_latency import LowLatencyResult, diagnose_low_latency
from rankwatch.diagnosis.deepep.normal.diagnoser import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.report import NormalReport
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time import StepTimeReport, diagnose_means

T0 = 1_800_000_000.0  # a fixed "now" for reports: the clock is an input of the samples

BALANCED_MS = {
    "input_wait": 5.0,
    "h2d": 1.0,
    "forward": 30.0,
    "backward": 60.0,
    "optimizer": 5.0,
    "step": 100.0,
}


def hostname_of(rank: int, ranks_per_host: int = 8) -> str:
    return f"node-{rank // ranks_per_host}"


def rank_infos(
    n: int, ranks_per_host: int = 8, hostnames: Mapping[int, str] | None = None
) -> tuple[RankInfo, ...]:
    hosts = dict(hostnames or {})
    return tuple(
        RankInfo(r, hosts.get(r, hostname_of(r, ranks_per_host)), r % ranks_per_host)
        for r in range(n)
    )


def step_report(
    n: int = 4,
    culprit: int | None = 2,
    *,
    steps: int = 50,
    strategy: str = "ddp",
    input_ms: float = 45.0,
    ranks: Iterable[int] | None = None,
) -> StepTimeReport:
    """A DDP window where ``culprit`` (if any) waits on its input: an input straggler."""
    means: dict[int, dict[str, float | None]] = {}
    for r in ranks if ranks is not None else range(n):
        m: dict[str, float | None] = dict(BALANCED_MS)
        if r == culprit:
            m.update(input_wait=input_ms, backward=20.0, step=60.0)
        means[r] = m
    return diagnose_means(means, steps=steps, strategy=strategy)


def normal_reports(
    phases: Iterable[str], ep: int = 16, rpn: int = 8, seed: int = 1, baseline: int = 4
) -> list[NormalReport]:
    """Normal-mode reports of ``phases`` after ``baseline`` windows that bootstrap history."""
    sim = NormalSimulator(ep, rpn, seed=seed, slow_rank=min(9, ep - 1))
    diagnoser = NormalDiagnoser()
    out = []
    for i in range(baseline):
        diagnoser.diagnose(sim.window("baseline", i))
    for i, phase in enumerate(phases, start=baseline):
        out.append(diagnoser.diagnose(sim.window(phase, i)))
    return out


def low_latency(ep: int = 16, slow_peer: int = 5, seed: int = 0) -> dict[str, LowLatencyResult]:
    rng = np.random.default_rng(seed)
    out = {}
    for phase in ("dispatch", "combine"):
        mat = rng.uniform(900, 1100, size=(ep, ep))
        mat[:, slow_peer] *= 6.0
        mat[1, 2] *= 40.0
        out[phase] = diagnose_low_latency(mat, phase)
    return out


def window(
    index: int,
    *,
    n: int = 4,
    step_time: StepTimeReport | None = None,
    normal: NormalReport | None = None,
    low_latency: dict[str, LowLatencyResult] | None = None,
    ranks: tuple[RankInfo, ...] | None = None,
    group: str = "world",
    run: str = "run-1",
    created_at_s: float | None = None,
    missing: tuple[int, ...] = (),
    normal_invalid_reason: str | None = None,
    low_latency_invalid_reason: str | None = None,
    window_kind: str = "live",
    diagnosis_seconds: dict[str, float] | None = None,
) -> WindowReport:
    if diagnosis_seconds is None:
        diagnosis_seconds = {"step_time": 0.0012, "normal": 0.0034}
    return WindowReport(
        group=group,
        window_index=index,
        created_at_s=T0 + 5.0 * index if created_at_s is None else created_at_s,
        ranks=ranks if ranks is not None else rank_infos(n),
        run=run,
        window_kind=window_kind,
        missing_ranks=missing,
        step_time=step_time,
        normal=normal,
        normal_invalid_reason=normal_invalid_reason,
        low_latency=low_latency,
        low_latency_invalid_reason=low_latency_invalid_reason,
        diagnosis_seconds=diagnosis_seconds,
    )


def step_window(
    index: int, n: int = 4, culprit: int | None = 2, *, group: str = "world", **kw
) -> WindowReport:
    """What the step-time collector publishes: a step-time report only."""
    return window(
        index,
        n=n,
        step_time=step_report(n, culprit=culprit),
        group=group,
        diagnosis_seconds={"step_time": 0.0012},
        **kw,
    )


def deepep_window(
    index: int,
    normal: NormalReport | None,
    ep: int = 16,
    *,
    group: str = "ep",
    low_latency_results: dict[str, LowLatencyResult] | None = None,
    **kw,
) -> WindowReport:
    """What the DeepEP collector publishes: normal-mode and low-latency outcomes only."""
    seconds = {"normal": 0.0034} if normal is not None else {}
    if low_latency_results is not None:
        seconds["low_latency"] = 0.0005
    return window(
        index,
        n=ep,
        normal=normal,
        low_latency=low_latency_results,
        group=group,
        diagnosis_seconds=seconds,
        **kw,
    )


def full_report(index: int = 7, ep: int = 16, phase: str = "single_hca_pressure") -> WindowReport:
    """Every engine at once on ``ep`` ranks: a step-time straggler, a normal-mode phase and a
    low-latency matrix."""
    return window(
        index,
        n=ep,
        step_time=step_report(ep, culprit=3),
        normal=normal_reports([phase], ep=ep)[0],
        low_latency=low_latency(ep),
    )
