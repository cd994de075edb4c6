"""What an installation may change in the generated rules and dashboards, and the alert timing.

Alert timing is a choice with a price, so it is stated here once. A critical step-time
straggler pages about 110 s after the fault starts: the exporter's tracker opens the incident
after k of n windows (~10 s), Prometheus sees it at the next scrape and evaluation, the alert
stays pending for its ``for:`` (1 minute), and Alertmanager holds the first notification of a
group for ``group_wait`` (101 s from the incident opening to the page, measured). An incident
shorter than its ``for:`` never pages, nor may one up to two scrape/evaluation intervals longer;
``keep_firing_for:`` holds an alert over a failed scrape or a briefly closed incident. The
figures, measured and computed, are in docs/runbooks.md ("Alert timing"); ``rankwatch assets
export DIR --for ALERT=DURATION`` renders the rules with other durations.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ALERT_TIMING",
    "DEFAULT_RUNBOOK_URL",
    "AlertTiming",
    "Settings",
    "duration_seconds",
]

# Where the runbooks are read; each alert links to the heading named after it (lower case).
DEFAULT_RUNBOOK_URL = "https://github.com/rankwatch/rankwatch/blob/main/docs/runbooks.md"


@dataclass(frozen=True)
class AlertTiming:
    """An alert's ``for:`` (pending before it fires) and ``keep_firing_for:`` (hold after its
    condition clears), as Prometheus durations."""

    for_: str
    keep_firing_for: str


# Every alert the rules define and its default timing. A new alert is one line here and one
# rule in rules.py (the rules read their timing from Settings, which accepts only these names).
ALERT_TIMING: dict[str, AlertTiming] = {
    "RankwatchStepTimeStragglerCritical": AlertTiming("1m", "1m"),
    "RankwatchStepTimeStragglerWarning": AlertTiming("5m", "2m"),
    "RankwatchSlowNode": AlertTiming("1m", "1m"),
    # The slowdown already lasted job_slowdown_windows windows before its incident opened.
    "RankwatchJobSlowdown": AlertTiming("2m", "2m"),
    "RankwatchDeepEPGlobalDataPathSlowdown": AlertTiming("2m", "2m"),
    "RankwatchDeepEPLocalizedDataPathSlowdown": AlertTiming("5m", "2m"),
    "RankwatchDeepEPPreStageArrivalSkew": AlertTiming("5m", "2m"),
    # A hang is a page at once: DeepEP's own timeout ends the job about 100 s in.
    "RankwatchDeepEPHangSuspect": AlertTiming("0s", "5m"),
    # The hang watcher has already waited its budget (15 s by default) before it opened one.
    "RankwatchHang": AlertTiming("0s", "2m"),
    "RankwatchExporterDown": AlertTiming("5m", "1m"),
    "RankwatchNoFreshWindows": AlertTiming("2m", "1m"),
    "RankwatchExportFailing": AlertTiming("10m", "5m"),
    # The fleet's ledger counts runs over days: nothing to debounce, and the host stays on the
    # list for an hour after its count drops (the next run's incident usually comes back).
    "RankwatchRepeatOffenderHost": AlertTiming("0s", "1h"),
}
_DEFAULT_FOR = {alert: t.for_ for alert, t in ALERT_TIMING.items()}
_DEFAULT_KEEP_FIRING_FOR = {alert: t.keep_firing_for for alert, t in ALERT_TIMING.items()}

# A Prometheus duration: units from largest to smallest, each at most once ("1h30m", "90s").
_DURATION = re.compile(
    r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?"
)
_UNIT_SECONDS = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


def duration_seconds(value: str) -> float:
    """Seconds of a Prometheus duration (``"1m"`` -> 60.0); ``ValueError`` naming ``value``
    when it is not one (Prometheus would refuse the rule file)."""
    match = _DURATION.fullmatch(value) if isinstance(value, str) else None
    if not value or match is None:
        raise ValueError(f"expected a Prometheus duration such as 1m or 1h30m, got {value!r}")
    return float(
        sum(int(n) * unit for n, unit in zip(match.groups(), _UNIT_SECONDS, strict=True) if n)
    )


@dataclass(frozen=True)
class Settings:
    """What an installation may change in the rules and dashboards (mixin-style config).

    ``runbook_url``: the runbooks page; alerts and dashboard panels link to
    ``runbook_url#<alert name in lower case>``. ``job_selector``: the PromQL label matcher every
    rule's selectors carry (the scrape job(s) of the training ranks). ``for_`` and
    ``keep_firing_for``: per alert, overriding :data:`ALERT_TIMING`. ``stale_window_seconds``:
    the age of the latest window from which RankwatchNoFreshWindows counts.
    ``ledger_window``: how far back the fleet's ledger counts runs per host (a Prometheus
    duration); ``repeat_offender_runs``: RankwatchRepeatOffenderHost fires for a host that was
    the culprit of a critical incident in at least this many distinct runs in that window, and
    in at most ``repeat_offender_healthy_runs`` runs it took part in without being one;
    ``ledger_interval``: how often the ledger's counts are evaluated.
    """

    runbook_url: str = DEFAULT_RUNBOOK_URL
    job_selector: str = 'job=~".*rankwatch.*"'
    for_: Mapping[str, str] = field(default_factory=lambda: dict(_DEFAULT_FOR))
    keep_firing_for: Mapping[str, str] = field(
        default_factory=lambda: dict(_DEFAULT_KEEP_FIRING_FOR)
    )
    stale_window_seconds: int = 180
    ledger_window: str = "7d"
    ledger_interval: str = "5m"
    repeat_offender_runs: int = 3
    repeat_offender_healthy_runs: int = 3

    def __post_init__(self) -> None:
        url, selector = self.runbook_url, self.job_selector
        if (
            not isinstance(url, str)
            or not re.fullmatch(r"https?://\S+|[\w./-]+", url)
            or "#" in url
        ):
            raise ValueError(f"runbook_url: expected a URL without a fragment, got {url!r}")
        if not isinstance(selector, str) or not re.fullmatch(
            r'\w+\s*(=|!=|=~|!~)\s*"[^"]*"', selector.strip()
        ):
            raise ValueError(
                f'job_selector: expected one label matcher such as job="x", got {selector!r}'
            )
        for name, table in (("for", self.for_), ("keep_firing_for", self.keep_firing_for)):
            unknown = set(table) - set(ALERT_TIMING)
            if unknown:
                raise ValueError(
                    f"{name}: unknown alert(s) {sorted(unknown)} (known: {sorted(ALERT_TIMING)})"
                )
            for alert, value in table.items():
                try:
                    duration_seconds(value)
                except ValueError as exc:
                    raise ValueError(f"{name}.{alert}: {exc}") from None
        if isinstance(self.stale_window_seconds, bool) or not (
            isinstance(self.stale_window_seconds, int) and self.stale_window_seconds > 0
        ):
            raise ValueError(
                f"stale_window_seconds: expected a positive int, got {self.stale_window_seconds!r}"
            )
        for name in ("ledger_window", "ledger_interval"):
            try:
                if duration_seconds(getattr(self, name)) <= 0:
                    raise ValueError(f"must be longer than 0, got {getattr(self, name)!r}")
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        for name, low in (("repeat_offender_runs", 1), ("repeat_offender_healthy_runs", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 10_000:
                raise ValueError(f"{name}: expected an int from {low} to 10000, got {value!r}")

    @classmethod
    def load(cls, overrides: Mapping[str, Any]) -> Settings:
        """Defaults updated with ``overrides`` (keys as in a settings file: ``for`` is ``for_``);
        per-alert tables are merged into the defaults, unknown keys raise ValueError."""
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in overrides.items():
            name = "for_" if key == "for" else key
            if name not in known:
                raise ValueError(f"settings: unknown key {key!r} (known: {sorted(known)})")
            if name in ("for_", "keep_firing_for"):
                if not isinstance(value, Mapping):
                    raise ValueError(f"{key}: expected a mapping of alert name to duration")
                base = _DEFAULT_FOR if name == "for_" else _DEFAULT_KEEP_FIRING_FOR
                value = {**base, **values.get(name, {}), **value}
            values[name] = value
        return cls(**values)

    def runbook(self, alert: str) -> str:
        """The runbook link of ``alert`` (its heading in docs/runbooks.md)."""
        return f"{self.runbook_url}#{alert.lower()}"
