"""The run's final summary, and the words rankwatch uses to explain a diagnosis.

A diagnosis is only useful if a person can act on it, so every report can be turned into a
:class:`Verdict`: *what* is wrong, *which rank*, *why* rankwatch thinks so (the numbers behind
it), and *what to do*. The same wording serves the live table, ``rankwatch diagnose``,
``rankwatch replay`` and the final summary.

:class:`RunRecorder` is a publisher for the root: it follows every window (incidents with the
same k-of-n / m-clean rules as the exporter), keeps the final long-window report the collectors
publish at shutdown, and writes ``summary.json`` plus a short ``summary.txt`` verdict.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rankwatch.diagnosis.deepep.normal.report import NormalReport
from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.step_time.rules import Finding, StepTimeReport
from rankwatch.diagnosis.vocabulary import SEVERITY_LEVELS
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.incidents import IncidentEvent, IncidentTracker, OpenIncident

__all__ = [
    "SUMMARY_JSON",
    "SUMMARY_TEXT",
    "IncidentRecord",
    "RunRecorder",
    "Verdict",
    "describe_normal",
    "describe_step",
    "incident_label",
    "normal_verdict",
    "step_verdict",
    "summary_text",
    "write_summary",
]

SUMMARY_JSON = "summary.json"
SUMMARY_TEXT = "summary.txt"


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
_COMPONENT_KINDS = {
    "input": "INPUT_STRAGGLER",
    "h2d": "H2D_STRAGGLER",
    "compute": "COMPUTE_STRAGGLER",
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
    gap = None
    if finding.visible_victim_ms is not None and finding.visible_culprit_ms is not None:
        gap = finding.visible_victim_ms - finding.visible_culprit_ms
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
        action = " ".join(actions[_COMPONENT_KINDS[c]] for c in sorted(split))
    elif coverage:
        parts = ", ".join(f"{c} {_pct(v)}" for c, v in sorted(coverage.items()))
        why += f". No measured component explains enough of the gap alone ({parts})"
    else:
        why += ". No component was measured on both ranks, so none can be blamed"
    return Verdict(
        kind=finding.kind,
        severity=finding.severity,
        what=f"rank {culprit} is {_STRAGGLER_LABELS[finding.kind]}",
        why=why + f" (over {report.steps} aligned steps, {report.clock} clock).",
        action=action,
        rank=culprit,
        ranks=(culprit,),
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
            why=f"{_pct(finding.score)} {why} (over {report.steps} steps).",
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
    if inc.cls == "pre_stage_arrival_skew":
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
    if inc.cls == "global_data_path_slowdown":
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
    if inc.cls == "localized_data_path_slowdown":
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


@dataclass(frozen=True)
class IncidentRecord:
    """One incident of the run: when it opened, when (if) it closed, and its last evidence."""

    incident_id: str
    cls: str
    severity: str
    probe: str
    cause: str
    ranks: tuple[int, ...]
    hostnames: tuple[str, ...]
    score: float | None
    opened_window: int
    opened_at_s: float
    closed_window: int | None = None
    closed_at_s: float | None = None
    causes: tuple[str, ...] = ()  # every cause seen while open, in order (e.g. input, compute)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["class"] = out.pop("cls")
        out["ranks"] = list(self.ranks)
        out["hostnames"] = list(self.hostnames)
        out["causes"] = list(self.causes)
        if self.score is not None and not math.isfinite(self.score):
            out["score"] = None
        return out


class RunRecorder:
    """A root-side publisher that remembers what the final summary needs.

    It follows incidents with its own :class:`IncidentTracker` (the exporter's rules and
    thresholds, so it agrees with ``rankwatch_incident_active``), keeps the latest live report of
    each engine and the final ``summary`` window, and counts windows. :meth:`summary` returns the
    final summary at any time. With ``out_dir``, ``close`` writes it there (``summary.json`` and
    ``summary.txt``): ``RankWatch.close`` publishes the long window first, then closes its
    publishers, so a recorder among them writes the run's summary at shutdown. A recorder that
    never received a report (a rank other than the root) writes nothing.
    """

    def __init__(
        self,
        config: RankwatchConfig | None = None,
        out_dir: str | os.PathLike[str] | None = None,
        run: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config if config is not None else RankwatchConfig()
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.run = dict(run or {})
        self.written: tuple[Path, Path] | None = None
        self._tracker = IncidentTracker.from_config(self.config)
        self._lock = threading.Lock()
        self._incidents: dict[str, IncidentRecord] = {}
        self.latest_step: WindowReport | None = None
        self.latest_normal: WindowReport | None = None
        self.final_step: WindowReport | None = None
        self.windows: Counter[str] = Counter()
        self.step_kinds: Counter[str] = Counter()
        self.normal_classes: Counter[str] = Counter()

    def publish(self, report: WindowReport) -> None:
        """Follow one window (any engine, live or summary)."""
        with self._lock:
            if report.window_kind == "summary":
                if report.step_time is not None:
                    self.final_step = report
                return
            if report.step_time is not None:
                self.latest_step = report
                self.windows["step_time"] += 1
                self.step_kinds[report.step_time.kind] += 1
            if report.normal is not None:
                self.latest_normal = report
                self.windows["normal"] += 1
                for inc in report.normal.incidents:
                    self.normal_classes[inc.cls] += 1
            if report.normal_invalid_reason:
                self.windows["normal_invalid"] += 1
            for event in self._tracker.update(report):
                self._record(event)
            for inc in self._tracker.snapshot().open:
                self._follow(inc)

    def _record(self, event: IncidentEvent) -> None:
        inc = event.incident
        known = self._incidents.get(inc.incident_id)
        causes = known.causes if known is not None else ()
        record = IncidentRecord(
            incident_id=inc.incident_id,
            cls=inc.cls,
            severity=inc.severity,
            probe=inc.probe,
            cause=inc.cause,
            ranks=tuple(inc.ranks),
            hostnames=tuple(inc.hostnames),
            score=inc.score,
            opened_window=inc.opened_window,
            opened_at_s=inc.opened_at_s,
            causes=causes if inc.cause in causes else (*causes, inc.cause),
        )
        if event.action == "close":
            record = _closed(record, event)
        self._incidents[inc.incident_id] = record

    def _follow(self, inc: OpenIncident) -> None:
        # An open incident's severity escalates and its cause follows the latest window.
        record = self._incidents.get(inc.incident_id)
        if record is None or record.closed_at_s is not None:
            return
        causes = record.causes if inc.cause in record.causes else (*record.causes, inc.cause)
        self._incidents[inc.incident_id] = replace(
            record, severity=inc.severity, cause=inc.cause, score=inc.score, causes=causes
        )

    def close(self, timeout_seconds: float) -> None:
        """Write the summary into ``out_dir`` (when given and a report was received)."""
        with self._lock:
            received = bool(self.windows) or self.final_step is not None
        if self.out_dir is not None and received:
            self.written = write_summary(self.out_dir, self.summary(self.run))

    def incidents(self) -> list[IncidentRecord]:
        """Every incident of the run so far, in opening order; open ones have no close time."""
        with self._lock:
            return sorted(self._incidents.values(), key=lambda r: (r.opened_at_s, r.incident_id))

    def summary(self, run: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The final summary as JSON-ready data (see :func:`write_summary`)."""
        with self._lock:
            step_window = self.final_step or self.latest_step
            normal_window = self.latest_normal
            windows = dict(self.windows)
            step_kinds = dict(self.step_kinds)
            normal_classes = dict(self.normal_classes)
        incidents = self.incidents()
        out: dict[str, Any] = {
            "run": dict(run or {}),
            "written_at_s": time.time(),
            "windows": windows,
            "step_time": None,
            "deepep_normal": None,
            "incidents": [i.to_dict() for i in incidents],
        }
        if step_window is not None and step_window.step_time is not None:
            st = step_window.step_time
            out["step_time"] = {
                "window_kind": step_window.window_kind,
                "verdict": step_verdict(st, step_window).to_dict(),
                "live_kinds_seen": step_kinds,
                "report": st.to_dict(),
                "ranks": [
                    {"rank": r.rank, "hostname": r.hostname, "local_rank": r.local_rank}
                    for r in step_window.ranks
                ],
            }
        if normal_window is not None and normal_window.normal is not None:
            nr = normal_window.normal
            out["deepep_normal"] = {
                "window_index": nr.window_index,
                "verdict": normal_verdict(nr, normal_window).to_dict(),
                "incident_classes_seen": normal_classes,
                "last_window": nr.to_dict(include_arrays=False),
            }
        out["verdict"] = _headline(out)
        return out


def _closed(record: IncidentRecord, event: IncidentEvent) -> IncidentRecord:
    return replace(record, closed_window=event.window_index, closed_at_s=event.time_s)


def _headline(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """The one verdict the run ends on: the long step-time window, unless it found nothing and
    DeepEP did (then the DeepEP one)."""
    candidates = [
        part["verdict"]
        for part in (summary.get("step_time"), summary.get("deepep_normal"))
        if part is not None
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda v: SEVERITY_LEVELS.get(v["severity"], 0))


def _clock(t: float | None, start: float | None) -> str:
    if t is None:
        return "still open"
    if start is None:
        return time.strftime("%H:%M:%S", time.localtime(t))
    return f"{t - start:+.0f} s"


def summary_text(summary: Mapping[str, Any]) -> str:
    """The short human verdict: what, which rank, why, what to do; then incidents and files."""
    run = summary.get("run") or {}
    start = run.get("started_at_s")
    lines = ["rankwatch summary"]
    facts = [f"{k}={run[k]}" for k in ("run_id", "ranks", "steps", "duration_s") if k in run]
    if run.get("interrupted"):
        facts.append("interrupted")
    if facts:
        lines.append("  " + ", ".join(str(f) for f in facts))
    lines.append("")
    sections = (
        ("Step time (long window)", summary.get("step_time")),
        ("DeepEP normal mode (last window)", summary.get("deepep_normal")),
    )
    for title, part in sections:
        if part is None:
            lines.append(f"{title}: no window was diagnosed.")
            lines.append("")
            continue
        v = part["verdict"]
        sev = f" [{v['severity']}]" if v.get("severity") else ""
        lines.append(f"{title}: {v['what']}{sev}")
        lines.append(f"  Why: {v['why']}")
        lines.append(f"  What to do: {v['action']}")
        lines.append("")
    incidents = summary.get("incidents") or []
    lines.append(f"Incidents of the run: {len(incidents)}")
    for inc in incidents:
        ranks = ",".join(str(r) for r in inc["ranks"]) or "-"
        score = "" if inc.get("score") is None else f" score {inc['score']:.2f}"
        causes = " then ".join(
            incident_label(inc["class"], c, inc.get("probe") or "")
            for c in inc.get("causes") or [inc["cause"]]
        )
        opened, closed = _clock(inc["opened_at_s"], start), _clock(inc["closed_at_s"], start)
        lines.append(
            f"  {inc['class']} {inc['severity']} ranks {ranks} ({causes}){score}: "
            f"opened {opened}, closed {closed}"
        )
    files = summary.get("files") or {}
    if files:
        lines.append("")
        lines.append("Files:")
        for name, value in files.items():
            lines.append(f"  {name}: {value}")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_summary(out_dir: str | os.PathLike[str], summary: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``summary.json`` and ``summary.txt`` into ``out_dir`` (atomically); return both."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, text_path = folder / SUMMARY_JSON, folder / SUMMARY_TEXT
    _atomic_write(json_path, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    _atomic_write(text_path, summary_text(summary))
    return json_path, text_path
