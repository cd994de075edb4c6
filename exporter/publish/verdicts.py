"""The words rankwatch uses to explain a diagnosis.

A diagnosis is only useful if a person can act on it, so every report can be turned into a
:class:`Verdict`: *what* is wrong, *which rank*, *why* rankwatch thinks so (the numbers behind
it), and *what to do*. The same wording serves the live table, ``rankwatch diagnose``,
``rankwatch replay`` and the run's summary (:mod:`.recorder`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rankwatch.diagnosis.deepep.normal.report import NormalReport
from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.step_time import Finding, StepTimeReport
from rankwatch.diagnosis.vocabulary import (
    GLOBAL_DATA_PATH_SLOWDOWN,
    LOCALIZED_DATA_PATH_SLOWDOWN,
    PRE_STAGE_ARRIVAL_SKEW,
    SEVERITY_LEVELS,
    STRAGGLER_KINDS,
)

__all__ = [
    "Verdict",
    "describe_normal",
    "describe_step",
    "incident_label",
    "normal_verdict",
    "step_verdict",
]


@dataclass(frozen=True)
class Verdict:
    """A diagnosis in words: what, which rank (None: the whole job), why, what to do."""

    kind: str
    severity: str | None
    what: str
    why: str
    action: str
    rank: int | None = None
    ranks: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranks"] = list(self.ranks)
        return out


def _ms(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.1f} ms"


def _pct(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.0%}"


def _host(report: WindowReport | None, rank: int) -> str:
    host = report.rank_info(rank).hostname if report is not None else ""
    return f" on host {host}" if host else ""


# --- step time -------------------------------------------------------------------------------

_STRAGGLER_LABELS = {
    "INPUT_STRAGGLER": "an input-pipeline straggler",
    "COMPUTE_STRAGGLER": "a compute straggler",
    "H2D_STRAGGLER": "a host-to-device copy straggler",
    "STRAGGLER": "a straggler (cause not attributed)",
}
_COMPONENT_WORDS = {
    "input": "waiting for its next batch",
    "h2d": "copying its batch to the device",
    "compute": "its forward pass",
}


def _straggler_actions(rank: int, where: str) -> dict[str, str]:
    return {
        "INPUT_STRAGGLER": f"Look at rank {rank}'s input pipeline{where}: data-loader workers "
        "and prefetching, slow storage or network reads, CPU contention from other processes.",
        "COMPUTE_STRAGGLER": f"Look at rank {rank}'s device and batches{where}: a throttled or "
        "degraded GPU, a noisy neighbour, longer sequences or bigger batches routed to it.",
        "H2D_STRAGGLER": f"Look at rank {rank}'s host-to-device copies{where}: pinned memory, "
        "non_blocking copies, the NUMA and PCIe placement of its GPU.",
        "STRAGGLER": f"Rank {rank} arrives late for a reason the timed phases do not show: "
        f"look for logging, checkpointing, garbage collection or CPU stalls{where}, and wrap "
        "suspect code in rw.phase() so the next window can attribute it.",
    }


def _straggler_verdict(
    finding: Finding, report: StepTimeReport, window: WindowReport | None
) -> Verdict:
    culprit = finding.culprit_rank if finding.culprit_rank is not None else -1
    victim = finding.victim_rank
    visible = "forward + backward" if report.strategy == "fsdp" else "backward"
    gap = finding.gap_ms
    why = (
        f"the other ranks wait for rank {culprit} in {visible}: rank {victim} (the median rank) "
        f"spends {_ms(finding.visible_victim_ms)} per step there, rank {culprit} only "
        f"{_ms(finding.visible_culprit_ms)}; the gap of {_ms(gap)} is a score of "
        f"{finding.score:.2f} of the median rank's step"
    )
    coverage = finding.component_coverage
    where = _host(window, culprit)
    actions = _straggler_actions(culprit, where)
    action = actions[finding.kind]
    # Several components that each explain a real share: the rank was slow for more than one
    # reason within this window (typical of a long window spanning several episodes).
    split = {c: v for c, v in coverage.items() if v is not None and v >= 0.25}
    if finding.kind != "STRAGGLER" and finding.component in coverage:
        comp = finding.component
        why += (
            f". Rank {culprit} spends {_ms(finding.component_excesses_ms.get(comp))} more per "
            f"step {_COMPONENT_WORDS.get(comp, comp)} than rank {victim}, which explains "
            f"{_pct(coverage[comp])} of the gap"
        )
    elif len(split) >= 2:
        parts = " and ".join(f"{c} ({_pct(v)})" for c, v in sorted(split.items()))
        why += (
            f". The gap is split between {parts}: rank {culprit} was slow for more than one "
            "reason in this window, none alone reaching the attribution threshold"
        )
        action = " ".join(actions[STRAGGLER_KINDS[c]] for c in sorted(split))
    elif coverage:
        parts = ", ".join(f"{c} {_pct(v)}" for c, v in sorted(coverage.items()))
        why += f". No measured component explains enough of the gap alone ({parts})"
    else:
        why += ". No component was measured on both ranks, so none can be blamed"
    what = f"rank {culprit} is {_STRAGGLER_LABELS[finding.kind]}"
    ranks: tuple[int, ...] = (culprit,)
    if finding.culprit_position:
        # "rank 3: pp 1, dp 1" -> "rank 3 (pp 1, dp 1)"
        where_in_mesh = finding.culprit_position.partition(": ")[2]
        what = f"rank {culprit} ({where_in_mesh}) is {_STRAGGLER_LABELS[finding.kind]}"
        why += f". Ranks were compared within {finding.compared_group}"
    if finding.slow_group:
        what = f"{finding.slow_group} is slow as a whole"
        why += (
            f". Every pipeline stage names its member of {finding.slow_group}: the replica is "
            "late at every stage, and which of its ranks makes it late cannot be told from "
            "the waits"
        )
        ranks = finding.slow_group_ranks
    if finding.slow_host:
        listed = ", ".join(str(r) for r in finding.slow_host_ranks)
        share = "most" if finding.slow_host_size > len(finding.slow_host_ranks) else "all"
        what = (
            f"node {finding.slow_host} is slow: ranks {listed} ({share} of {finding.slow_host}) "
            f"are late together, each {_STRAGGLER_LABELS[finding.kind]}"
        )
        why += (
            f". Ranks {listed} share host {finding.slow_host} and each arrives about as late as "
            f"rank {culprit}: the node, not one GPU, holds the others back"
        )
        action = (
            f"Drain or inspect node {finding.slow_host} (its NIC, PCIe switch, power, cooling, "
            f"CPU load) before its GPUs one by one. " + action.replace(f"rank {culprit}'s", "its")
        )
        ranks = finding.slow_host_ranks
    return Verdict(
        kind=finding.kind,
        severity=finding.severity,
        what=what,
        why=why + f" (over {report.steps} aligned steps, {report.clock} clock).",
        action=action,
        rank=culprit,
        ranks=ranks,
    )


_BOTTLENECKS = {
    "INPUT_BOUND": (
        "the job is input-bound",
        "of each step is spent waiting for input on the median rank",
        "Speed up the data pipeline for every rank: more loader workers, prefetching, "
        "faster storage, or cheaper preprocessing.",
    ),
    "H2D_BOUND": (
        "the job is bound by host-to-device copies",
        "of each step is spent copying batches to the device on the median rank",
        "Pin host memory, copy with non_blocking=True and overlap copies with compute.",
    ),
    "RESIDUAL_HEAVY": (
        "much of each step is outside the timed phases",
        "of each step is not forward, backward, optimizer or copies on the median rank",
        "Find the untimed work (logging, metrics, synchronisation, checkpointing) and wrap "
        "it in rw.phase() to see which it is.",
    ),
    "COMPUTE_BOUND": (
        "the job is compute-bound and balanced",
        "of each step is forward, backward and optimizer on the median rank",
        "Nothing to fix in the input pipeline or between ranks; speed-ups come from the model "
        "or its kernels.",
    ),
}


def step_verdict(report: StepTimeReport, window: WindowReport | None = None) -> Verdict:
    """The verdict of a step-time report (its first finding is the diagnosis)."""
    finding = report.findings[0] if report.findings else None
    kind = report.kind
    if finding is not None and finding.is_straggler and finding.kind in _STRAGGLER_LABELS:
        return _straggler_verdict(finding, report, window)
    if finding is not None and kind in _BOTTLENECKS:
        what, why, action = _BOTTLENECKS[kind]
        return Verdict(
            kind=kind,
            severity=finding.severity,
            what=what,
            # A share of the step is the same from window to window: a property of the job to
            # improve, not a fault to be woken for (critical is for faults only).
            why=f"{_pct(finding.score)} {why} (over {report.steps} steps); a steady property "
            "of the job, not a fault: it does not page.",
            action=action,
            ranks=tuple(finding.ranks),
        )
    if kind == "WARMUP":
        return Verdict(
            kind,
            None,
            "not enough steps to judge yet",
            f"the window holds {report.steps} aligned steps.",
            "Let the job run longer.",
        )
    if kind == "INCOMPLETE_DATA":
        missing = "; ".join(
            f"rank {r}: {', '.join(s)}" for r, s in sorted(report.missing_signals.items()) if s
        )
        absent = f"; ranks sending nothing: {list(report.missing_ranks)}" * bool(
            report.missing_ranks
        )
        return Verdict(
            kind,
            None,
            "some timings are missing, so the rules abstained",
            f"unmeasured signals: {missing or 'none'}{absent}.",
            "Time the missing phases (rw.watch or rw.phase) on every rank.",
            ranks=tuple(report.missing_ranks),
        )
    ev = report.straggler
    why = "no rank waits measurably for another"
    if ev is not None:
        why = (
            f"the largest gap, rank {ev.culprit_rank} against the median rank "
            f"{ev.victim_rank}, is a score of {ev.score:.2f}, below the warning threshold"
        )
    return Verdict(kind, None, "no straggler: the ranks are balanced", why + ".", "Nothing to do.")


def describe_step(report: StepTimeReport) -> str:
    """One line: kind, severity, culprit, victim, score and the attributing component."""
    finding = report.findings[0] if report.findings else None
    parts = [report.kind]
    if report.severity:
        parts.append(report.severity)
    if finding is not None and finding.is_straggler:
        parts.append(f"culprit={finding.culprit_rank} victim={finding.victim_rank}")
        if finding.culprit_position:
            parts.append(f"({finding.culprit_position.partition(': ')[2]})")
        parts.append(f"score={finding.score:.2f}")
        if finding.component in finding.component_coverage:
            cov = finding.component_coverage[finding.component or ""]
            parts.append(f"{finding.component}={_pct(cov)}")
    elif finding is not None and finding.severity:
        parts.append(f"share={_pct(finding.score)}")
    elif report.straggler is not None:
        parts.append(f"score={report.straggler.score:.2f}")
    parts.append(f"({report.steps} steps, {report.clock})")
    return " ".join(parts)


# --- DeepEP normal mode ----------------------------------------------------------------------

_STAGES = {
    "notify_dispatch": "dispatch",
    "cached_notify_dispatch": "cached dispatch",
    "cached_notify_combine": "combine",
}


def _notify_ratio(report: NormalReport, probe: str, rank: int) -> float | None:
    result = report.probes.get(probe)
    if result is None or result.notify_ratio is None or rank >= len(result.notify_ratio):
        return None
    value = float(result.notify_ratio[rank])
    return value if math.isfinite(value) else None


def _global_factors(report: NormalReport, probes: Sequence[str]) -> str:
    parts = []
    for probe in probes:
        result = report.probes.get(probe)
        if result is not None and result.global_factor is not None:
            cls = getattr(result, "global_class", None)
            parts.append(f"{probe} {result.global_factor:.2f}x" + (f" ({cls})" if cls else ""))
    return ", ".join(parts) or "n/a"


def _hot_load(evidence: Mapping[str, Any]) -> str:
    """A sentence when the slow place also carried much more traffic (DeepEP load context)."""
    load = evidence.get("load") if isinstance(evidence, Mapping) else None
    if not isinstance(load, Mapping) or not load.get("hot"):
        return ""
    ratio = load.get("load_ratio")
    times = f"{ratio:.1f}x" if isinstance(ratio, (int, float)) else "much more than"
    return (
        f" It also carried {times} the tokens per sample of its peers: an expert hot spot "
        "(routing imbalance) rather than a hardware fault."
    )


def normal_verdict(report: NormalReport, window: WindowReport | None = None) -> Verdict:
    """The verdict of a DeepEP normal-mode report: its most severe incident, if any."""
    incidents = sorted(report.incidents, key=lambda i: (-SEVERITY_LEVELS[i.severity], i.cls))
    if not incidents:
        if report.raw_anomalies:
            late = sorted({a.src for a in report.raw_anomalies if a.src is not None})
            return Verdict(
                "raw_anomaly",
                None,
                f"late Notify arrival of ranks {late}, not confirmed",
                "a Notify probe flags them, but the Completion probes downstream are anomalous "
                "or lack samples, so the delay cannot be placed before the stage.",
                "Watch the next windows; inspect this window's heatmaps.",
                ranks=tuple(late),
            )
        return Verdict(
            "ok",
            None,
            "DeepEP dispatch and combine are healthy",
            f"all six probes are within their thresholds (window {report.window_index}, "
            f"EP{report.ep_size}).",
            "Nothing to do.",
        )
    inc = incidents[0]
    ranks = tuple(int(r) for r in inc.ranks)
    hosts = sorted({window.rank_info(r).hostname for r in ranks} - {""}) if window else []
    on_hosts = f" on {', '.join(hosts)}" if hosts else ""
    if inc.cls == PRE_STAGE_ARRIVAL_SKEW:
        probe = inc.probes[0] if inc.probes else ""
        rank = ranks[0] if ranks else -1
        stage = _STAGES.get(probe, probe)
        ratio = _notify_ratio(report, probe, rank)
        ratio_text = "n/a" if ratio is None else f"{ratio:.3f}"
        return Verdict(
            inc.cls,
            inc.severity,
            f"rank {rank} arrives late at {stage} (pre-stage arrival skew)",
            f"its {probe} Notify kernel lasts {ratio_text} of its peers' median (late from "
            "0.25) while the Completion probes are normal: the time is lost before the stage, "
            "not on the network.",
            f"Look at what rank {rank} does before {stage}{on_hosts}: uneven expert load or "
            "routing, host-side stalls, a slow preceding kernel.",
            rank=rank,
            ranks=ranks,
        )
    if inc.cls == GLOBAL_DATA_PATH_SLOWDOWN:
        return Verdict(
            inc.cls,
            inc.severity,
            "every DeepEP data path is slower (global data-path slowdown)",
            "completion cost per sample against the recent normal windows: "
            f"{_global_factors(report, inc.probes)}.",
            "Check the fabric as a whole: congestion from other jobs, switch health, HCA "
            "settings; compare with the cluster's network telemetry.",
            ranks=ranks,
        )
    hot = _hot_load(inc.evidence)
    if inc.cls == LOCALIZED_DATA_PATH_SLOWDOWN:
        return Verdict(
            inc.cls,
            inc.severity,
            f"the data path of ranks {list(ranks)} is slow (localized)",
            f"dispatch and combine both flag the same ranks ({inc.scope}), while the others are "
            "normal." + hot,
            "Check the expert routing balance (hot expert) before the hardware."
            if hot
            else f"Check the NIC (HCA) those ranks share{on_hosts}: link errors, its cable and "
            "switch port, its PCIe placement.",
            rank=ranks[0] if len(ranks) == 1 else None,
            ranks=ranks,
        )
    return Verdict(
        inc.cls,
        inc.severity,
        "a completion anomaly without a second probe to confirm it"
        + (f" (ranks {list(ranks)})" if ranks else ""),
        f"{', '.join(inc.probes)} flags scope {inc.scope}, but no other probe agrees, so "
        "rankwatch does not classify it." + hot,
        "Watch whether it persists; inspect this window's heatmaps.",
        ranks=ranks,
    )


def describe_normal(report: NormalReport) -> str:
    """One line: the window's incidents (class and ranks), or its anomalous probes, or ok."""
    head = f"w{report.window_index} EP{report.ep_size}"
    if report.incidents:
        parts = [
            f"{i.cls}[{','.join(str(r) for r in i.ranks)}] ({','.join(i.probes)})"
            for i in report.incidents
        ]
        return f"{head}: " + "; ".join(parts)
    anomalous = [p for p, r in report.probes.items() if r.anomalous]
    if anomalous:
        return f"{head}: anomalous probes {', '.join(anomalous)}, no incident"
    insufficient = [p for p, r in report.probes.items() if r.status == "insufficient"]
    if insufficient:
        return f"{head}: ok (insufficient: {', '.join(insufficient)})"
    return f"{head}: ok"


# --- the run's incidents and the final summary -----------------------------------------------


def incident_label(cls: str, cause: str, probe: str) -> str:
    """What an incident is about in a few words: the step-time cause, or the DeepEP probe(s)."""
    if cls.startswith("step_time") or not probe:
        return cause
    return probe if cause == "rank" else f"{cause}: {probe}"
