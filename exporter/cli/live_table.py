"""The demo's live view: per-rank phases, the current diagnosis, and the timeline's progress.

On a terminal it is a ``rich`` live table redrawn a few times a second; anywhere else (a pipe,
a CI log) it prints one plain line per event instead, because cursor tricks in a log file are
noise. Both read the same state: the latest report of each engine, the timeline position, and
the incidents the :class:`~rankwatch.exporter.RunRecorder` follows.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from rankwatch.diagnosis.report import WindowReport
from rankwatch.exporter.publish.recorder import RunRecorder
from rankwatch.exporter.publish.verdicts import (
    describe_normal,
    describe_step,
    incident_label,
    normal_verdict,
    step_verdict,
)

__all__ = ["LiveView", "Progress"]

_PHASE_COLUMNS = ("input_wait", "forward", "backward", "optimizer", "step", "visible")
_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
_MAX_INCIDENT_LINES = 4


@dataclass(frozen=True)
class Progress:
    """Where the demo's timeline is: seconds in, which phases, how many steps so far."""

    elapsed_s: float
    step_phase: int
    deepep_phase: int
    steps: int


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:7.1f}"


class LiveView:
    """Shows the demo as it runs; ``live=None`` picks the rich table only on a terminal."""

    def __init__(
        self,
        *,
        header: str,
        segments: Sequence[tuple[str, float]],
        deepep_phases: Sequence[str],
        recorder: RunRecorder,
        live: bool | None = None,
        stream: IO[str] | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.header = header
        self.segments = list(segments)
        self.total_s = sum(s for _, s in self.segments)
        self.deepep_phases = list(deepep_phases)
        self.recorder = recorder
        self.progress_state: Progress | None = None
        self.step_report: WindowReport | None = None
        self.normal_report: WindowReport | None = None
        self.notes: list[str] = []
        self._started = time.monotonic()
        self._seen_incidents: dict[str, bool] = {}
        self._console = Console(file=self.stream)
        self._live: Live | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> LiveView:
        if self.live:
            self._live = Live(
                self.render(), console=self._console, refresh_per_second=4, transient=False
            )
            self._live.__enter__()
        else:
            self._line(self.header)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(None, None, None)
            self._live = None

    # -- inputs ----------------------------------------------------------------------------

    def progress(self, state: Progress) -> None:
        """The timeline moved on; plain mode prints a line when a phase changes."""
        previous = self.progress_state
        self.progress_state = state
        if not self.live:
            if previous is None or previous.step_phase != state.step_phase:
                name, seconds = self.segments[state.step_phase]
                self._line(f"timeline: {name} for {seconds:.0f} s")
            if previous is None or previous.deepep_phase != state.deepep_phase:
                self._line(f"deepep: {self.deepep_phases[state.deepep_phase]}")
        self._refresh()

    def report(self, report: WindowReport) -> None:
        """A window arrived from the root (the recorder has already seen it)."""
        if report.window_kind == "live" and report.step_time is not None:
            self.step_report = report
            if not self.live:
                self._line(f"step w{report.window_index}: {describe_step(report.step_time)}")
        if report.normal is not None:
            self.normal_report = report
            if not self.live:
                self._line(f"deepep {describe_normal(report.normal)}")
        # An idle DeepEP window (no dispatch since the last one) is routine, not news.
        if report.normal_invalid_reason not in (None, "empty_window") and not self.live:
            self._line(f"deepep window rejected: {report.normal_invalid_reason}")
        self._incident_lines()
        self._refresh()

    def note(self, text: str) -> None:
        """A message from the demo itself (stopping, a rank failed, ...)."""
        self.notes = [*self.notes[-2:], text]
        if not self.live:
            self._line(text)
        self._refresh()

    # -- output ----------------------------------------------------------------------------

    def _elapsed(self) -> float:
        if self.progress_state is not None:
            return self.progress_state.elapsed_s
        return 0.0

    def _line(self, text: str) -> None:
        print(f"[{self._elapsed():6.1f}s] {text}", file=self.stream, flush=True)

    def _incident_lines(self) -> None:
        for inc in self.recorder.incidents():
            closed = inc.closed_at_s is not None
            if self._seen_incidents.get(inc.incident_id) == closed:
                continue
            self._seen_incidents[inc.incident_id] = closed
            if not self.live:
                action = "closed" if closed else "opened"
                label = incident_label(inc.cls, inc.cause, inc.probe)
                self._line(
                    f"incident {action}: {inc.cls} {inc.severity} ranks {_ranks(inc.ranks)} "
                    f"({label})"
                )

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self.render())

    def render(self) -> RenderableType:
        """The whole live view as one rich renderable, compact enough for a 24-line terminal."""
        parts: list[RenderableType] = [Text(self.header, style="bold", overflow="ellipsis")]
        parts.append(self._timeline())
        parts.append(self._rank_table())
        parts.extend(self._diagnosis())
        if self.notes:
            parts.append(Text(self.notes[-1], style="dim", overflow="ellipsis", no_wrap=True))
        return Group(*parts)

    def _timeline(self) -> RenderableType:
        state = self.progress_state
        elapsed = state.elapsed_s if state is not None else 0.0
        line = Text("timeline ")
        for i, (name, seconds) in enumerate(self.segments):
            current = state is not None and i == state.step_phase
            line.append(f" {name} {seconds:.0f}s ", style="reverse bold" if current else "dim")
        line.append("\ndeepep   ")
        for i, name in enumerate(self.deepep_phases):
            current = state is not None and i == state.deepep_phase
            line.append(f" {name} ", style="reverse bold" if current else "dim")
        bar = ProgressBar(total=max(self.total_s, 1e-9), completed=min(elapsed, self.total_s))
        steps = state.steps if state is not None else 0
        status = Text(f"{elapsed:5.1f} s / {self.total_s:.0f} s   {steps} steps")
        table = Table.grid(padding=(0, 1))
        table.add_row(bar, status)
        return Group(line, table)

    def _rank_table(self) -> RenderableType:
        report = self.step_report
        table = Table(box=box.SIMPLE_HEAD, title_justify="left", padding=(0, 1), pad_edge=False)
        table.add_column("rank", justify="right")
        table.add_column("host")
        for col in _PHASE_COLUMNS:
            table.add_column(f"{col} ms", justify="right")
        table.add_column("role")
        if report is None or report.step_time is None:
            table.title = "step time: waiting for the first window"
            return table
        st = report.step_time
        finding = st.findings[0] if st.findings else None
        straggler = finding is not None and finding.is_straggler
        culprit = finding.culprit_rank if finding is not None and straggler else None
        victim = finding.victim_rank if finding is not None and straggler else None
        table.title = (
            f"step time: window {report.window_index}, last {st.steps} steps, {st.clock} clock, "
            f"{st.strategy}"
        )
        for rank in sorted(st.rank_means):
            means = st.rank_means[rank]
            role, style = "", ""
            if rank == culprit and finding is not None:
                role, style = "culprit", _SEVERITY_STYLE.get(finding.severity, "")
            elif rank == victim:
                role = "victim (median)"
            table.add_row(
                str(rank),
                report.rank_info(rank).hostname,
                *(_fmt_ms(means.get(c)) for c in _PHASE_COLUMNS),
                role,
                style=style,
            )
        return table

    def _diagnosis(self) -> list[RenderableType]:
        lines: list[RenderableType] = []
        if self.step_report is not None and self.step_report.step_time is not None:
            st = self.step_report.step_time
            v = step_verdict(st, self.step_report)
            sev = f" [{v.severity}]" if v.severity else ""
            style = _SEVERITY_STYLE.get(v.severity or "", "green")
            lines.append(Text(f"step time: {v.what}{sev}", style=style, no_wrap=True))
            lines.append(Text(f"  {describe_step(st)}", style="dim", no_wrap=True))
        if self.normal_report is not None and self.normal_report.normal is not None:
            nr = self.normal_report.normal
            v = normal_verdict(nr, self.normal_report)
            sev = f" [{v.severity}]" if v.severity else ""
            style = _SEVERITY_STYLE.get(v.severity or "", "green")
            head = f"deepep window {nr.window_index} (EP{nr.ep_size}): {v.what}{sev}"
            lines.append(Text(head, style=style, no_wrap=True, overflow="ellipsis"))
        open_incidents = [i for i in self.recorder.incidents() if i.closed_at_s is None]
        if open_incidents:
            lines.append(Text(f"open incidents ({len(open_incidents)}):", style="bold"))
            for inc in open_incidents[:_MAX_INCIDENT_LINES]:
                lines.append(
                    Text(
                        f"  {inc.cls} {inc.severity} ranks {_ranks(inc.ranks)} "
                        f"({incident_label(inc.cls, inc.cause, inc.probe)})",
                        style=_SEVERITY_STYLE.get(inc.severity, ""),
                        no_wrap=True,
                        overflow="ellipsis",
                    )
                )
            if len(open_incidents) > _MAX_INCIDENT_LINES:
                lines.append(Text(f"  ... and {len(open_incidents) - _MAX_INCIDENT_LINES} more"))
        if not lines:
            lines.append(Text("diagnosis: waiting for the first window", style="dim"))
        return lines


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks) or "-"
