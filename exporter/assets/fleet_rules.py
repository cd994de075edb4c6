"""The fleet's ledger: recording rules and an alert that remember bad hosts across runs.

A run's incidents end with the run, but Prometheus keeps its series. Two rule groups turn them
into a per-host ledger (docs/fleet.md):

``rankwatch-fleet`` (every evaluation, instant aggregations only):

- :data:`CULPRIT_ACTIVE` ``{hostname, run, attempt}`` = 1 while a critical incident of a class
  that blames a culprit (a straggler, a slow node, a hang, a DeepEP localized slowdown; see
  ``vocabulary.CULPRIT_CLASSES``) names the host in that attempt of that run;
- :data:`HOST_PRESENT` ``{hostname, run, attempt}`` = 1 while a rank on the host publishes its
  phase times in that attempt (the runs the host took part in). Fewer series than the rank
  series the exporter already publishes: one per host and live attempt.

``rankwatch-fleet-ledger`` (every ``ledger_interval``, 5 minutes by default: these look
``ledger_window`` back):

- :data:`CULPRIT_RUNS` / :data:`CULPRIT_ATTEMPTS` ``{hostname}``: distinct runs / attempts in
  which the host was a culprit within the window;
- :data:`HEALTHY_RUNS` ``{hostname}``: runs it took part in without being a culprit in any of
  their attempts. Only for hosts that were culprits: every output of the ledger is keyed by
  culprit hosts alone, so its cardinality is the number of bad hosts, not the fleet's;
- the alert ``RankwatchRepeatOffenderHost``: a host that was the culprit in at least
  ``repeat_offender_runs`` runs with at most ``repeat_offender_healthy_runs`` healthy ones.

An incident that names several hosts (a hang between two nodes) carries them in one
comma-separated ``hostname`` value (``rankwatch_incident_active``): the ledger keeps that value
as one entry, which ``rankwatch hosts`` splits.
"""

from __future__ import annotations

import json
from typing import Any

from rankwatch.diagnosis.vocabulary import CULPRIT_CLASSES
from rankwatch.exporter.assets.settings import Settings
from rankwatch.exporter.publish.catalogue import METRIC_NAMES as M

__all__ = [
    "CULPRIT_ACTIVE",
    "CULPRIT_ATTEMPTS",
    "CULPRIT_RUNS",
    "HEALTHY_RUNS",
    "HOST_PRESENT",
    "fleet_groups",
]

CULPRIT_ACTIVE = "rankwatch:host_culprit:active"
HOST_PRESENT = "rankwatch:host_run:present"
CULPRIT_RUNS = "rankwatch:host_culprit_runs:count"
CULPRIT_ATTEMPTS = "rankwatch:host_culprit_attempts:count"
HEALTHY_RUNS = "rankwatch:host_healthy_runs:count"

ALERT = "RankwatchRepeatOffenderHost"


def _sel(s: Settings, *matchers: str) -> str:
    return "{" + ", ".join((s.job_selector.strip(), *matchers)) + "}"


def _per_run(series: str, window: str, by: str) -> str:
    """Distinct ``by`` values of ``series`` within ``window``, counted per host."""
    return f"count by (hostname) (\n  count by ({by}) (max_over_time({series}[{window}]))\n)"


def _runs_list(window: str, value: str) -> str:
    """Template text listing the host's culprit runs (run/attempts) of the window."""
    query = f"max by (run) (max_over_time({CULPRIT_ACTIVE}{{hostname=%q}}[{window}]))"
    return (
        f'{{{{ range printf `{query}` {value} | query | sortByLabel "run" }}}}'
        "{{ .Labels.run }} {{ end }}"
    )


def fleet_groups(s: Settings) -> list[dict[str, Any]]:
    """The two rule groups of the ledger (see the module docstring)."""
    classes = "|".join(CULPRIT_CLASSES)
    culprit = _sel(s, f"class=~{json.dumps(classes)}", 'severity="critical"', 'hostname!=""')
    window = s.ledger_window
    n, m = s.repeat_offender_runs, s.repeat_offender_healthy_runs
    total_runs = _per_run(HOST_PRESENT, window, "hostname, run")
    alert: dict[str, Any] = {
        "alert": ALERT,
        # `unless`: a culprit host whose runs were not seen (no phase series) still counts.
        "expr": f"{CULPRIT_RUNS} >= {n}\nunless on (hostname)\n{HEALTHY_RUNS} > {m}\n",
        "for": s.for_[ALERT],
        "keep_firing_for": s.keep_firing_for[ALERT],
        "labels": {"severity": "warning"},
        "annotations": {
            "summary": "Host {{ $labels.hostname }} was the culprit in {{ $value }} runs in "
            f"the last {window}",
            "description": "Host {{ $labels.hostname }} was named by a critical incident "
            "(straggler, slow node, hang or DeepEP localized slowdown) in {{ $value }} distinct "
            f"runs within {window} (alert from {n}), and took part in at most {m} runs without "
            f"being one. Runs: {_runs_list(window, '$labels.hostname')}. Cordon or exclude it "
            "before the next job lands there (rankwatch hosts prints the commands), then "
            "inspect it.",
            "runbook_url": s.runbook(ALERT),
        },
    }
    return [
        {
            "name": "rankwatch-fleet",
            "rules": [
                {
                    "record": CULPRIT_ACTIVE,
                    "expr": (
                        f"max by (hostname, run, attempt) (\n  {M.incident_active}{culprit}\n)\n"
                    ),
                },
                {
                    "record": HOST_PRESENT,
                    "expr": (
                        "group by (hostname, run, attempt) (\n"
                        f"  {M.phase_seconds}{_sel(s, 'hostname!=' + json.dumps(''))}\n)\n"
                    ),
                },
            ],
        },
        {
            "name": "rankwatch-fleet-ledger",
            # Days of its own recorded series: every 5 minutes (the default) is plenty for a
            # count of runs, and costs a fifth of a per-minute evaluation.
            "interval": s.ledger_interval,
            "rules": [
                {
                    "record": CULPRIT_RUNS,
                    "expr": _per_run(CULPRIT_ACTIVE, window, "hostname, run") + "\n",
                },
                {
                    "record": CULPRIT_ATTEMPTS,
                    "expr": _per_run(CULPRIT_ACTIVE, window, "hostname, run, attempt") + "\n",
                },
                {
                    # Runs the host took part in, less those it was a culprit in; only for
                    # culprit hosts (the `on` match needs a culprit count).
                    "record": HEALTHY_RUNS,
                    "expr": f"clamp_min(\n{total_runs}\n- on (hostname) {CULPRIT_RUNS}, 0)\n",
                },
                alert,
            ],
        },
    ]
