"""Incidents: per-window findings turned into incidents that open and close with hysteresis.

A single window can be noisy: one slow data-loader fetch or one checkpoint can make a rank look
like a straggler for five seconds. Paging on that would teach people to ignore the page. So a
finding becomes an *incident* only when it persists, and an incident ends only when it has
really gone:

* **open**: an incident opens when the same finding (same identity, see below) was present in
  at least ``k`` of the last ``n`` windows (``RankwatchConfig.incident_open_k`` /
  ``incident_open_n``, default 2 of 3); a ``hang_suspect`` opens on its first window
  (``OPEN_AT_ONCE_CLASSES``), since DeepEP's own timeout ends a hung job about 100 s later;
* **close**: an open incident closes after ``m`` consecutive windows without it
  (``incident_close_m``, default 3);
* after closing, the identity starts from a clean history: it must again be seen in ``k`` of the
  next ``n`` windows to reopen.

With the defaults one noisy window neither opens an incident nor, once one is open, closes it.

Only windows in which the engine behind a finding actually ran count, for opening and for
closing: a window without a step-time report says nothing about a step-time straggler (missing
data is not a clean window). The final ``summary`` window is not a live window and is ignored.

Findings that become incidents, and their identity:

* step-time findings of severity ``warning`` or ``critical``: the rank-straggler kinds
  (``STRAGGLER``, ``INPUT_STRAGGLER``, ``COMPUTE_STRAGGLER``, ``H2D_STRAGGLER``) become class
  ``step_time_straggler`` identified by the culprit rank, with the kind (lower case) as the
  cause, so a straggler whose attribution wavers between windows stays one incident; the
  single-rank bottleneck kinds (``INPUT_BOUND``, ``COMPUTE_BOUND``, ``RESIDUAL_HEAVY``, ...)
  become class ``step_time_bottleneck`` identified by kind and ranks. A bottleneck is a steady
  property of the job, not a fault: its incident is a warning at most, never pages, and says
  so (``pages: false`` in its evidence; :attr:`OpenIncident.pages`, see
  ``vocabulary.incident_pages``: only a critical fault pages);
* a straggler finding whose unit is a host (``slow_host``: most of one node's ranks late
  together, see ``diagnosis.step_time.units``) becomes class ``step_time_slow_node``
  identified by the host, whichever of its ranks was last; while it is open, a straggler
  finding that names one of its ranks supports it instead of opening a rank incident;
* a job slowdown (``WindowReport.pace``: the group slower than its own baseline for k windows
  in a row, ``diagnosis.step_time.pace``) becomes class ``job_slowdown``, one per group, its
  cause the phase that grew the most; it opens on its first signal (already debounced);
* one fault, one incident: a bottleneck finding that blames the straggler's culprit and no
  other rank (in a small group a slow input pipeline on one rank lifts the median input share
  over its threshold, so ``INPUT_BOUND`` names the same rank as ``INPUT_STRAGGLER``) is the
  straggler seen as a share, not a second problem. It is folded into the straggler's signal
  (listed under ``related`` in its evidence; the signal takes the more severe of the two) when
  both are in the same window, and supports an open straggler incident of that culprit when
  it comes alone. A bottleneck that blames other ranks too stays an incident of its own;
* every normal-mode ``Incident`` keeps its class (``pre_stage_arrival_skew``,
  ``global_data_path_slowdown``, ``localized_data_path_slowdown``, ``unclassified``) and is
  identified by class, probes and ranks.

While open, an incident's severity only escalates (the highest severity of the windows that
supported it); its cause, score and evidence follow the latest supporting window. Each incident
emits exactly one ``open`` and one ``close`` event; the close says why (``reason``:
:data:`CLOSED_CLEAN` after m clean windows, :data:`CLOSED_RUN_ENDED` from :meth:`close_all`
when the run ends with the incident still open). ``rankwatch_incidents_total`` counts openings
by the severity at opening.

State is bounded: at most ``max_tracked`` identities are remembered (open incidents first; the
least recently seen candidates are forgotten when the bound is reached), and each keeps a
history of ``n`` booleans.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rankwatch.diagnosis.report import WindowReport
from rankwatch.diagnosis.vocabulary import (
    CLOSE_AT_ONCE_CLASSES,
    HANG_CLASS,
    JOB_SLOWDOWN_CLASS,
    OPEN_AT_ONCE_CLASSES,
    SLOW_NODE_CLASS,
    STRAGGLER_CLASS,
    incident_nature,
    incident_pages,
)
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.signals import (
    ENGINE_HANG,
    ENGINE_NORMAL,
    ENGINE_STEP_TIME,
    LATE_CLASSES,
    SEVERITY_ORDER,
    Signal,
    caused_by,
    finite_or_none,
    fold,
    signals_from_report,
)
from rankwatch.exporter.publish.time_lost import (
    goodput_ratio,
    hang_cost_rank_seconds,
    late_cost_rank_seconds,
    new_steps,
)

__all__ = [
    "CLOSED_CLEAN",
    "CLOSED_RUN_ENDED",
    "IncidentEvent",
    "IncidentSnapshot",
    "IncidentTracker",
    "OpenIncident",
    "Signal",
    "signals_from_report",
]

# Why an incident closed: its finding was absent for m windows, or the run ended first.
CLOSED_CLEAN = "clean windows"
CLOSED_RUN_ENDED = "run ended"


@dataclass(frozen=True)
class OpenIncident:
    """An incident as it stands: identity, where, how bad, and the latest evidence."""

    incident_id: str
    cls: str
    severity: str
    probe: str
    cause: str
    ranks: tuple[int, ...]
    hostnames: tuple[str, ...]
    score: float | None
    evidence: Mapping[str, Any]
    opened_window: int
    opened_at_s: float
    # What it cost the group so far (time_lost.py), from the windows that opened it on.
    lost_rank_seconds: float = 0.0

    @property
    def nature(self) -> str:
        """``"fault"`` or ``"property"`` (a steady property of the job; see the vocabulary)."""
        return incident_nature(self.cls)

    @property
    def pages(self) -> bool:
        """Whether this incident pages: a critical fault (a property never does)."""
        return incident_pages(self.cls, self.severity)


@dataclass(frozen=True)
class IncidentEvent:
    """An incident opened or closed (emitted exactly once each)."""

    action: str  # "open" | "close"
    incident: OpenIncident
    window_index: int
    time_s: float
    group: str
    run: str
    # Why a close happened: CLOSED_CLEAN (m clean windows) or CLOSED_RUN_ENDED; empty for opens.
    reason: str = ""
    # Which start of the run (RankwatchConfig.attempt): 0 the first, a restart counts up.
    attempt: int = 0

    @property
    def event_name(self) -> str:
        """The OTel event name: ``rankwatch.incident.open`` or ``rankwatch.incident.close``."""
        return f"rankwatch.incident.{self.action}"


@dataclass(frozen=True)
class IncidentSnapshot:
    """What the publishers need: the open incidents and the opening counts so far."""

    open: tuple[OpenIncident, ...] = ()
    opened_total: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # Rank-seconds lost by (class, cause, culprit ranks, hostnames) of the incidents so far.
    lost_total: Mapping[tuple[str, str, str, str], float] = field(default_factory=dict)
    # 1 - lost / (wall seconds since the first window x ranks); None before any time passed.
    goodput_ratio: float | None = None


@dataclass
class _Track:
    """Mutable per-identity state inside the tracker."""

    history: deque[bool]
    engine: str
    last_seen: int
    latest: Signal | None = None
    incident: OpenIncident | None = None
    clean_run: int = 0
    # Severities of the windows in ``history`` that supported this identity (same length).
    severities: deque[str | None] = field(default_factory=deque)
    lost_rank_seconds: float = 0.0  # what its supporting windows cost (time_lost.py)
    stalled_counted_s: float = 0.0  # a hang's stalled seconds already counted


def _part_of(sig: Signal, owner: OpenIncident) -> bool:
    """Whether ``sig`` is the open ``owner``'s fault seen another way: a bottleneck that blames
    only its ranks, or (owner a slow node) a straggler that is one of the node's ranks (a
    window in which only the last of them crossed the line)."""
    if caused_by(sig, owner.ranks):
        return True
    return (
        owner.cls == SLOW_NODE_CLASS
        and sig.cls == STRAGGLER_CLASS
        and bool(sig.ranks)
        and set(sig.ranks) <= set(owner.ranks)
    )


class IncidentTracker:
    """Opens an incident after ``k`` of the last ``n`` windows agree, closes it after ``m``
    clean windows; see the module docstring for identities and the rules.

    Not thread-safe: one publishing thread feeds it (``update``) and hands out ``snapshot()``s,
    which are immutable.
    """

    def __init__(
        self,
        open_k: int = 2,
        open_n: int = 3,
        close_m: int = 3,
        *,
        max_tracked: int = 256,
        group: str = "",
        run: str = "",
        attempt: int = 0,
    ) -> None:
        for name, value in (
            ("open_k", open_k),
            ("open_n", open_n),
            ("close_m", close_m),
            ("max_tracked", max_tracked),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"IncidentTracker.{name}: expected an int, got {value!r}")
            if value < 1:
                raise ValueError(f"IncidentTracker.{name}: must be >= 1, got {value!r}")
        if open_k > open_n:
            raise ValueError(
                f"IncidentTracker.open_k: must be <= open_n ({open_n}), got {open_k!r}"
            )
        self.open_k, self.open_n, self.close_m = open_k, open_n, close_m
        self.max_tracked = max_tracked
        self.group, self.run, self.attempt = group, run, attempt
        self._tracks: dict[tuple[Any, ...], _Track] = {}
        self._opened_total: dict[tuple[str, str], int] = {}
        self._seq = 0
        self._windows = 0
        # Time lost (time_lost.py): the last step a window counted, totals, the first window.
        self._counted_through: int | None = None
        self._lost_total: dict[tuple[str, str, str, str], float] = {}
        self._first_at_s: float | None = None
        self._ranks = 0
        # What the windows of a job slowdown's streak cost before it was reported (it is
        # reported after k windows): counted into its incident when it opens.
        self._streak_lost = 0.0
        # The latest live window fed (index, time, group, run): what a close at run end names.
        self._last: tuple[int, float, str, str] = (-1, 0.0, group, run)

    @classmethod
    def from_config(cls, config: RankwatchConfig) -> IncidentTracker:
        """A tracker with the configured k, n and m."""
        if not isinstance(config, RankwatchConfig):
            raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
        return cls(
            config.incident_open_k,
            config.incident_open_n,
            config.incident_close_m,
            group=config.group_name,
            run=config.run_id,
            attempt=config.attempt,
        )

    def update(self, report: WindowReport) -> list[IncidentEvent]:
        """Feed one window; return the open/close events it caused (opens after closes)."""
        if not isinstance(report, WindowReport):
            raise TypeError(f"report: expected WindowReport, got {type(report).__name__}")
        if report.window_kind != "live":
            if report.window_kind == "summary":
                self._count_tail(report)
            return []
        ran = {
            e
            for e, part in (
                (ENGINE_STEP_TIME, report.step_time),
                (ENGINE_NORMAL, report.normal),
                (ENGINE_HANG, report.hang),
            )
            if part
        }
        if not ran:
            return []
        self._windows += 1
        signals = self._fold_into_open_stragglers({s.key: s for s in signals_from_report(report)})
        steps = self._new_steps(report)
        self._ranks = report.size
        self._note_streak(report, steps)
        if self._first_at_s is None:
            self._first_at_s = report.created_at_s
        group = report.group or self.group
        run = report.run or self.run
        self._last = (report.window_index, report.created_at_s, group, run)
        closes: list[IncidentEvent] = []
        opens: list[IncidentEvent] = []

        for key, new in signals.items():
            if key not in self._tracks:
                self._tracks[key] = _Track(
                    history=deque(maxlen=self.open_n),
                    severities=deque(maxlen=self.open_n),
                    engine=new.engine,
                    last_seen=self._windows,
                )
        for key, track in list(self._tracks.items()):
            if track.engine not in ran:
                continue  # this window says nothing about it
            sig = signals.get(key)
            track.history.append(sig is not None)
            track.severities.append(None if sig is None else sig.severity)
            cost = 0.0
            if sig is not None:
                track.last_seen = self._windows
                track.latest = sig
                track.clean_run = 0
                cost = self._cost(track, sig, steps, report.size)
                if sig.cls == JOB_SLOWDOWN_CLASS and self._streak_lost:
                    cost += self._streak_lost  # its streak's windows before it was reported
                    self._streak_lost = 0.0
                track.lost_rank_seconds += cost
            else:
                track.clean_run += 1
            if track.incident is not None:
                if sig is not None:
                    track.incident = self._refresh(track.incident, sig, report)
                    track.incident = replace(
                        track.incident, lost_rank_seconds=track.lost_rank_seconds
                    )
                    self._count_lost(track.incident, cost)
                elif track.clean_run >= (
                    1 if track.incident.cls in CLOSE_AT_ONCE_CLASSES else self.close_m
                ):
                    closes.append(
                        self._event("close", track.incident, report, group, run, CLOSED_CLEAN)
                    )
                    del self._tracks[key]
                continue
            opens_now = sig is not None and sig.cls in OPEN_AT_ONCE_CLASSES
            if (sum(track.history) >= self.open_k or opens_now) and sig is not None:
                track.incident = self._open(track, sig, report)
                self._count_lost(track.incident, track.lost_rank_seconds)
                opens.append(self._event("open", track.incident, report, group, run))
            elif not any(track.history):
                del self._tracks[key]  # nothing left to remember
        self._bound()
        return closes + opens

    def close_all(
        self, reason: str = CLOSED_RUN_ENDED, time_s: float | None = None
    ) -> list[IncidentEvent]:
        """Close every open incident now, with ``reason`` (the run ended before its findings
        cleared), in opening order; candidates are forgotten. The events carry the latest
        window fed; ``time_s`` defaults to that window's time."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason: expected a non-empty string, got {reason!r}")
        window, last_s, group, run = self._last
        if time_s is None:
            time_s = last_s
        elif isinstance(time_s, bool) or not isinstance(time_s, (int, float)):
            raise TypeError(f"time_s: expected unix seconds, got {time_s!r}")
        events = [
            IncidentEvent("close", inc, window, float(time_s), group, run, reason, self.attempt)
            for inc in self.snapshot().open
        ]
        self._tracks.clear()
        return events

    def snapshot(self) -> IncidentSnapshot:
        """Open incidents (in opening order) and opening counts, as immutable data."""
        open_ = sorted(
            (t.incident for t in self._tracks.values() if t.incident is not None),
            key=lambda i: (i.opened_window, i.incident_id),
        )
        goodput = None
        if self._first_at_s is not None:
            elapsed = self._last[1] - self._first_at_s
            goodput = goodput_ratio(sum(self._lost_total.values()), elapsed, self._ranks)
        return IncidentSnapshot(
            open=tuple(open_),
            opened_total=dict(self._opened_total),
            lost_total=dict(self._lost_total),
            goodput_ratio=goodput,
        )

    @property
    def tracked(self) -> int:
        """How many identities are remembered (open incidents and candidates)."""
        return len(self._tracks)

    # -- internals ---------------------------------------------------------------------------

    def _open(self, track: _Track, sig: Signal, report: WindowReport) -> OpenIncident:
        self._seq += 1
        severity = max(
            (s for s in track.severities if s is not None), key=SEVERITY_ORDER.__getitem__
        )
        self._opened_total[(sig.cls, severity)] = self._opened_total.get((sig.cls, severity), 0) + 1
        return OpenIncident(
            incident_id=f"{sig.cls}-{report.window_index}-{self._seq}",
            cls=sig.cls,
            severity=severity,
            probe=sig.probe,
            cause=sig.cause,
            ranks=sig.ranks,
            hostnames=_hostnames(report, sig.ranks),
            score=sig.score,
            evidence=dict(sig.evidence),
            opened_window=report.window_index,
            opened_at_s=report.created_at_s,
            lost_rank_seconds=track.lost_rank_seconds,
        )

    def _new_steps(self, report: WindowReport) -> int:
        """The window's steps no earlier window counted (live windows overlap)."""
        st = report.step_time
        step_range = None if st is None else st.step_range
        steps = new_steps(step_range, self._counted_through)
        if step_range is not None:
            last = int(step_range[1])
            if self._counted_through is None or last > self._counted_through:
                self._counted_through = last
        return steps

    @staticmethod
    def _cost(track: _Track, sig: Signal, steps: int, ranks: int) -> float:
        """What this window of ``sig`` cost the group, in rank-seconds (time_lost.py)."""
        if sig.cls == HANG_CLASS:
            cost = hang_cost_rank_seconds(sig.score, track.stalled_counted_s, ranks)
            if sig.score is not None and sig.score > track.stalled_counted_s:
                track.stalled_counted_s = sig.score
            return cost
        if sig.cls in LATE_CLASSES:
            return late_cost_rank_seconds(finite_or_none(sig.evidence.get("gap_ms")), steps, ranks)
        if sig.cls == JOB_SLOWDOWN_CLASS:  # every rank, each new step, its excess
            excess = finite_or_none(sig.evidence.get("recent_excess_ms"))
            return late_cost_rank_seconds(excess, steps, ranks)
        return 0.0

    def _count_tail(self, report: WindowReport) -> None:
        """The run's last steps, after its last live window (the summary window reaches
        further): what they cost the incidents still open, at their latest window's rate."""
        steps = self._new_steps(report)
        if steps <= 0:
            return
        for track in self._tracks.values():
            inc, sig = track.incident, track.latest
            if inc is None or sig is None or sig.cls == HANG_CLASS:
                continue
            cost = self._cost(track, sig, steps, report.size or self._ranks)
            if cost > 0:
                track.lost_rank_seconds += cost
                track.incident = replace(inc, lost_rank_seconds=track.lost_rank_seconds)
                self._count_lost(track.incident, cost)

    def _note_streak(self, report: WindowReport, steps: int) -> None:
        """Keep what a job slowdown's streak costs while it is not yet reported (its first
        k - 1 windows, and before them the windows whose new steps alone were slow); a window
        with neither forgets it."""
        pace = report.pace
        if pace is None or report.step_time is None:
            return
        if pace.severity:
            return  # reported: this window is the incident's own
        if not (pace.streak or pace.recent_slow):
            self._streak_lost = 0.0
            return
        self._streak_lost += late_cost_rank_seconds(pace.recent_excess_ms, steps, report.size)

    def _count_lost(self, inc: OpenIncident, rank_seconds: float) -> None:
        if rank_seconds <= 0:
            return
        key = (
            inc.cls,
            inc.cause,
            ",".join(str(r) for r in inc.ranks),
            ",".join(inc.hostnames),
        )
        self._lost_total[key] = self._lost_total.get(key, 0.0) + rank_seconds

    @staticmethod
    def _refresh(inc: OpenIncident, sig: Signal, report: WindowReport) -> OpenIncident:
        severity = max(inc.severity, sig.severity, key=SEVERITY_ORDER.__getitem__)
        return OpenIncident(
            incident_id=inc.incident_id,
            cls=inc.cls,
            severity=severity,
            probe=sig.probe,
            cause=sig.cause,
            ranks=sig.ranks,
            hostnames=_hostnames(report, sig.ranks) or inc.hostnames,
            score=sig.score,
            evidence=dict(sig.evidence),
            opened_window=inc.opened_window,
            opened_at_s=inc.opened_at_s,
            lost_rank_seconds=inc.lost_rank_seconds,
        )

    def _event(
        self,
        action: str,
        inc: OpenIncident,
        report: WindowReport,
        group: str,
        run: str,
        reason: str = "",
    ) -> IncidentEvent:
        return IncidentEvent(
            action, inc, report.window_index, report.created_at_s, group, run, reason, self.attempt
        )

    def _fold_into_open_stragglers(
        self, signals: dict[tuple[Any, ...], Signal]
    ) -> dict[tuple[Any, ...], Signal]:
        """Bottleneck signals that blame only the culprit of an open straggler incident support
        that incident instead of becoming one of their own (the window's straggler finding
        may be missing, e.g. below its threshold, while the culprit's share still is not)."""
        open_stragglers = [
            (key, t.incident)
            for key, t in self._tracks.items()
            if t.incident is not None and t.incident.cls in LATE_CLASSES
        ]
        if not open_stragglers:
            return signals
        out = dict(signals)
        for key, sig in signals.items():
            owner = next(
                ((k, inc) for k, inc in open_stragglers if k != key and _part_of(sig, inc)),
                None,
            )
            if owner is None:
                continue
            del out[key]
            skey, inc = owner
            base = out.get(skey) or Signal(
                key=skey,
                engine=ENGINE_STEP_TIME,
                cls=inc.cls,
                severity=sig.severity,
                probe="",
                cause=inc.cause,
                ranks=inc.ranks,
                score=inc.score,
                evidence={k: v for k, v in sig.evidence.items() if k not in ("kind", "pages")},
            )
            out[skey] = fold(base, [sig])
        return out

    def _bound(self) -> None:
        excess = len(self._tracks) - self.max_tracked
        if excess <= 0:
            return
        # Forget the least recently seen candidates first; open incidents only if unavoidable.
        order = sorted(
            self._tracks.items(),
            key=lambda kv: (kv[1].incident is not None, kv[1].last_seen),
        )
        for key, _ in order[:excess]:
            del self._tracks[key]


def _hostnames(report: WindowReport, ranks: tuple[int, ...]) -> tuple[str, ...]:
    names: list[str] = []
    for r in ranks:
        host = report.rank_info(r).hostname.lower()
        if host and host not in names:
            names.append(host)
    return tuple(names)
