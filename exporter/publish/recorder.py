"""The run's final summary: :class:`RunRecorder` follows a run and writes what it found.

:class:`RunRecorder` is a publisher for the root: it follows every window (incidents with the
same k-of-n / m-clean rules as the exporter), keeps the final long-window report the collectors
publish at shutdown, and writes ``summary.json`` plus a short ``summary.txt`` verdict, worded by
:mod:`.verdicts`.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rankwatch.diagnosis.config import option_env
from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.vocabulary import (
    FAULT,
    PROPERTY,
    SEVERITY_LEVELS,
    incident_nature,
    incident_pages,
)
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.culprits import (
    RunCulprits,
    earlier_attempts_lines,
    keep_earlier_attempts,
    run_culprits,
)
from rankwatch.exporter.publish.incidents import (
    CLOSED_RUN_ENDED,
    IncidentEvent,
    IncidentTracker,
    OpenIncident,
)
from rankwatch.exporter.publish.time_lost import time_lost_text
from rankwatch.exporter.publish.verdicts import (
    incident_label,
    normal_verdict,
    step_verdict,
)
from rankwatch.exporter.storage import GuardedWrites, atomic_write, ensure_folder

__all__ = [
    "SUMMARY_JSON",
    "SUMMARY_TEXT",
    "IncidentRecord",
    "RunRecorder",
    "end_of_run_text",
    "incident_counts",
    "summary_text",
    "write_summary",
]

SUMMARY_JSON = "summary.json"
SUMMARY_TEXT = "summary.txt"


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
    close_reason: str | None = None  # "clean windows" or "run ended" once closed
    lost_rank_seconds: float = 0.0  # what it cost the group (time_lost.py)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["class"] = out.pop("cls")
        # A fault or a steady property of the job; only a critical fault pages.
        out["nature"] = incident_nature(self.cls)
        out["pages"] = incident_pages(self.cls, self.severity)
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
        # The summary is written once, at close; a storage fault is said, counted, and named
        # in the end block instead of the files.
        self.guard = (
            None
            if out_dir is None
            else GuardedWrites(
                "summary",
                "run summary",
                option_env(RankwatchConfig, "artifact_dir"),
                str(out_dir),
                retries=False,
            )
        )
        self._tracker = IncidentTracker.from_config(self.config)
        self._lock = threading.Lock()
        self._incidents: dict[str, IncidentRecord] = {}
        self.latest_step: WindowReport | None = None
        self.latest_normal: WindowReport | None = None
        self.final_step: WindowReport | None = None
        self.windows: Counter[str] = Counter()
        self.step_kinds: Counter[str] = Counter()
        self.normal_classes: Counter[str] = Counter()
        # What the earlier attempts of this run found (read from out_dir at close, attempt > 0).
        self.earlier: list[RunCulprits] = []

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
            lost_rank_seconds=inc.lost_rank_seconds,
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
            record,
            severity=inc.severity,
            cause=inc.cause,
            score=inc.score,
            causes=causes,
            lost_rank_seconds=inc.lost_rank_seconds,
        )

    def close(self, timeout_seconds: float) -> None:
        """End the run: incidents still open close with reason ``run ended`` (as the hub
        closes them); then write the summary into ``out_dir`` (when given and a report was
        received)."""
        with self._lock:
            for event in self._tracker.close_all(CLOSED_RUN_ENDED, time.time()):
                self._record(event)
            received = bool(self.windows) or self.final_step is not None
        out_dir, guard = self.out_dir, self.guard
        if out_dir is not None and guard is not None and received:
            self.written = guard.run(out_dir, lambda: self._write(out_dir))

    def _write(self, out_dir: Path) -> tuple[Path, Path]:
        # A restart writes into the folder of the attempts before it: their summaries are read
        # (the end block says what they found) and kept beside this attempt's.
        attempt = self.config.attempt
        if attempt > 0:
            self.earlier = keep_earlier_attempts(out_dir, self.config.run_id, attempt)
        return write_summary(out_dir, self.summary(self.run))

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
        if self.earlier:
            current = run_culprits({"run": out["run"], "incidents": out["incidents"]})
            out["earlier_attempts"] = earlier_attempts_lines(current, self.earlier)
        return out


def _closed(record: IncidentRecord, event: IncidentEvent) -> IncidentRecord:
    return replace(
        record,
        closed_window=event.window_index,
        closed_at_s=event.time_s,
        close_reason=event.reason or None,
    )


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


def _clock(t: float, start: float | None) -> str:
    if start is None:
        return time.strftime("%H:%M:%S", time.localtime(t))
    return f"{t - start:+.0f} s"


def summary_text(summary: Mapping[str, Any]) -> str:
    """The short human verdict: what, which rank, why, what to do; then incidents and files."""
    run = summary.get("run") or {}
    start = run.get("started_at_s")
    lines = ["rankwatch summary"]
    keys = ("run_id", "attempt", "ranks", "steps", "duration_s")
    facts = [f"{k}={run[k]}" for k in keys if k in run and (k != "attempt" or run[k])]
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
    lines.append(f"Incidents of the run: {incident_counts(incidents)}")
    lines += [f"  {_incident_line(inc, start)}" for inc in incidents]
    if lost := time_lost_text(incidents):
        lines.append(f"Time lost: {lost}")
    if summary.get("earlier_attempts"):
        lines.append("Earlier attempts of the run:")
        lines += [f"  {line}" for line in summary["earlier_attempts"]]
    files = summary.get("files") or {}
    if files:
        lines.append("")
        lines.append("Files:")
        for name, value in files.items():
            lines.append(f"  {name}: {value}")
    return "\n".join(lines) + "\n"


def _incident_line(inc: Mapping[str, Any], start: float | None) -> str:
    ranks = ",".join(str(r) for r in inc["ranks"]) or "-"
    score = "" if inc.get("score") is None else f" score {inc['score']:.2f}"
    causes = " then ".join(
        incident_label(inc["class"], c, inc.get("probe") or "")
        for c in inc.get("causes") or [inc["cause"]]
    )
    opened = _clock(inc["opened_at_s"], start)
    if inc["closed_at_s"] is None:
        when = f"opened {opened}, still open"
    else:
        when = f"opened {opened}, closed {_clock(inc['closed_at_s'], start)}"
        if inc.get("close_reason"):
            when += f" ({inc['close_reason']})"
    nature = ", a property: does not page" if _nature(inc) == PROPERTY else ""
    lost = float(inc.get("lost_rank_seconds") or 0.0)
    cost = f", lost {lost:.0f} rank-seconds" if lost > 0 else ""
    return f"{inc['class']} {inc['severity']}{nature} ranks {ranks} ({causes}){score}: {when}{cost}"


def _nature(inc: Mapping[str, Any]) -> str:
    # Summaries written before the nature was recorded: from the class.
    return str(inc.get("nature") or incident_nature(str(inc.get("class", ""))))


def incident_counts(incidents: Sequence[Mapping[str, Any]]) -> str:
    """How many incidents, faults and properties apart: ``"2 (1 critical fault; 1 property,
    does not page)"``; only a critical fault pages."""
    faults = [inc for inc in incidents if _nature(inc) == FAULT]
    critical = sum(1 for inc in faults if inc.get("severity") == "critical")
    properties = len(incidents) - len(faults)

    def n(count: int, word: str, plural: str) -> str:
        return f"{count} {word if count == 1 else plural}"

    parts = []
    if critical:
        parts.append(n(critical, "critical fault", "critical faults"))
    if len(faults) - critical:
        parts.append(n(len(faults) - critical, "warning fault", "warning faults"))
    if properties:
        verb = "does" if properties == 1 else "do"
        parts.append(f"{n(properties, 'property', 'properties')}, {verb} not page")
    return f"{len(incidents)} ({'; '.join(parts)})" if parts else "0"


def end_of_run_text(
    summary: Mapping[str, Any],
    written: tuple[Path, Path] | None,
    not_written: Sequence[str] = (),
) -> str:
    """The few lines the root prints when rankwatch closes: the run's verdict, its incidents,
    and where the summary files are (``written``: the paths :func:`write_summary` returned;
    None when none were written). ``not_written`` says, one item per output, what storage
    faults kept from being written and why (:meth:`GuardedWrites.not_written`); the summary's
    own fault, when it is among them, replaces the hint to set a folder."""
    if not isinstance(summary, Mapping):
        raise TypeError(
            f"summary: expected the mapping RunRecorder.summary() returns, got {summary!r}"
        )
    if written is not None and not (isinstance(written, tuple) and len(written) == 2):
        raise TypeError(
            f"written: expected (summary.json, summary.txt) paths or None, got {written!r}"
        )
    run = summary.get("run") or {}
    verdict = summary.get("verdict")
    # A first start reads as before; a restart says which attempt ended.
    attempt = f" attempt {run['attempt']}" if run.get("attempt") else ""
    lines = [f"rankwatch: run {run.get('run_id') or '(unnamed)'}{attempt} ended"]
    if verdict is None:
        lines.append("  Verdict: no window was diagnosed.")
    else:
        sev = f" [{verdict['severity']}]" if verdict.get("severity") else ""
        lines.append(f"  Verdict: {verdict['what']}{sev}")
        lines.append(f"  Why: {verdict['why']}")
        lines.append(f"  What to do: {verdict['action']}")
    incidents = summary.get("incidents") or []
    lines.append(f"  Incidents: {incident_counts(incidents)}")
    lines += [f"    {_incident_line(inc, run.get('started_at_s'))}" for inc in incidents]
    if lost := time_lost_text(incidents):
        lines.append(f"  Time lost: {lost}")
    if summary.get("earlier_attempts"):
        lines.append("  Earlier attempts:")
        lines += [f"    {line}" for line in summary["earlier_attempts"]]
    if run.get("run_id_source"):
        lines.append(f"  Run name: {run['run_id_source']}")
    if isinstance(not_written, str) or not all(isinstance(t, str) for t in not_written):
        raise TypeError(f"not_written: expected a sequence of strings, got {not_written!r}")
    if written is not None:
        lines.append(f"  Summary: {written[1]} (and {written[0].name} beside it)")
    elif not not_written:
        lines.append("  Summary: not written (set RANKWATCH_ARTIFACT_DIR=DIR to keep one)")
    lines += [f"  Not written: {text}" for text in not_written]
    return "\n".join(lines) + "\n"


def write_summary(out_dir: str | os.PathLike[str], summary: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``summary.json`` and ``summary.txt`` into ``out_dir`` (atomically); return both."""
    folder = ensure_folder(out_dir)
    json_path, text_path = folder / SUMMARY_JSON, folder / SUMMARY_TEXT
    atomic_write(json_path, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    atomic_write(text_path, summary_text(summary))
    return json_path, text_path
