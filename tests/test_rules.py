"""The shipped Prometheus alert rules: promtool's own checks and unit tests, and their metadata.

``promtool check rules`` and ``promtool test rules`` run the real promtool on
``dashboards/rules``; the other tests hold every alert to the conventions users rely on
(severity, summary, description, a runbook that exists, debouncing) and to the metric catalogue.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from rankwatch.exporter.catalogue import CATALOGUE, COMMON_LABELS

from tests.servers import REPO, require_binary

RULES_DIR = REPO / "dashboards" / "rules"
RULES = RULES_DIR / "rankwatch.rules.yml"
TESTS_DIR = RULES_DIR / "tests"
RUNBOOKS = REPO / "docs" / "runbooks.md"

REQUIRED_ALERTS = {
    "RankwatchStepTimeStragglerCritical",
    "RankwatchDeepEPGlobalDataPathSlowdown",
    "RankwatchDeepEPLocalizedDataPathSlowdown",
    "RankwatchDeepEPPreStageArrivalSkew",
    "RankwatchExporterDown",
    "RankwatchNoFreshWindows",
    "RankwatchExportFailing",
}
SEVERITIES = {"critical", "warning", "info"}
# Labels Prometheus itself attaches to every scraped series.
TARGET_LABELS = {"job", "instance"}


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    binary = require_binary("promtool")
    return subprocess.run(
        [binary, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading (lowercase, punctuation dropped)."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", str(RULES), cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout


@pytest.mark.parametrize("test_file", sorted(p.name for p in TESTS_DIR.glob("*.yml")))
def test_promtool_unit_tests(test_file: str) -> None:
    result = _promtool("test", "rules", f"tests/{test_file}", cwd=RULES_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_unit_tests_fail_when_debouncing_is_removed(tmp_path: Path) -> None:
    """The unit tests have teeth: the same tests against rules without for: must fail."""
    rules_dir = tmp_path / "rules"
    shutil.copytree(RULES_DIR, rules_dir)
    text = (rules_dir / "rankwatch.rules.yml").read_text()
    weakened = re.sub(r"\n\s+for: \S+", "", text)
    assert weakened != text
    (rules_dir / "rankwatch.rules.yml").write_text(weakened)
    result = _promtool("test", "rules", "tests/diagnosis_test.yml", cwd=rules_dir)
    assert result.returncode != 0
    assert "RankwatchStepTimeStragglerCritical, time: 1m45s" in result.stdout + result.stderr


def test_required_alerts_present() -> None:
    names = [a["alert"] for a in _alerts()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS


@pytest.mark.parametrize("alert", _alerts(), ids=lambda a: a["alert"])
def test_alert_metadata(alert: dict[str, Any]) -> None:
    assert alert["labels"]["severity"] in SEVERITIES
    annotations = alert["annotations"]
    assert set(annotations) >= {"summary", "description", "runbook_url"}
    # Debounced on both edges: pending before firing, held over a scrape gap before resolving.
    assert "for" in alert and "keep_firing_for" in alert
    # The runbook link lands on a heading of docs/runbooks.md named after the alert.
    url = annotations["runbook_url"]
    path, _, fragment = url.partition("#")
    assert path == "docs/runbooks.md"
    headings = [
        github_anchor(line.lstrip("#"))
        for line in RUNBOOKS.read_text().splitlines()
        if line.startswith("## ")
    ]
    assert fragment == alert["alert"].lower()
    assert fragment in headings, f"no runbook heading for {alert['alert']}"


@pytest.mark.parametrize(
    "alert",
    [a for a in _alerts() if "rankwatch_incident" in a["expr"]],
    ids=lambda a: a["alert"],
)
def test_diagnosis_alerts_name_culprit_cause_and_score(alert: dict[str, Any]) -> None:
    """Diagnosis alerts say who (rank, host), why (cause) and how bad ($value = the score)."""
    text = alert["annotations"]["summary"] + alert["annotations"]["description"]
    for needle in ("$labels.culprit_rank", "$labels.hostname", "$labels.cause", "$value"):
        if needle in ("$labels.culprit_rank", "$labels.hostname") and (
            "global_data_path" in alert["expr"]
        ):
            continue  # a fabric-wide slowdown has no single rank or host
        assert needle in text, f"{alert['alert']} does not mention {needle}"


def test_rules_only_use_catalogue_metrics_and_labels() -> None:
    catalogue = {spec.name: set(spec.all_labels) for spec in CATALOGUE}
    for alert in _alerts():
        expr = alert["expr"]
        for name in re.findall(r"\b(rankwatch_[a-z_]+)", expr):
            assert name in catalogue, f"{alert['alert']}: {name} is not in the catalogue"
            labels = catalogue[name] | TARGET_LABELS
            # Every selector of that metric matches only labels it has.
            for selector in re.findall(rf"{name}\{{([^}}]*)\}}", expr):
                for label in re.findall(r"(\w+)\s*=~?", selector):
                    assert label in labels, f"{alert['alert']}: {name} has no label {label}"
        for grouping in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
            for label in (x.strip() for x in grouping.split(",")):
                assert label in TARGET_LABELS | set(COMMON_LABELS) | {
                    lab for spec in CATALOGUE for lab in spec.labels
                }, f"{alert['alert']}: unknown label {label}"


def test_every_alert_has_unit_tests_on_both_sides() -> None:
    """Each alert is tested firing and not firing (before its for:, after recovery)."""
    fired: set[str] = set()
    silent: set[str] = set()
    for path in TESTS_DIR.glob("*.yml"):
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../rankwatch.rules.yml"]
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                (fired if case["exp_alerts"] else silent).add(case["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names <= fired, f"never tested firing: {names - fired}"
    assert names <= silent, f"never tested silent: {names - silent}"


def test_rule_classes_are_the_exporters_incident_classes() -> None:
    """A renamed incident class in the exporter must not silently mute an alert."""
    from rankwatch.exporter.incidents import INCIDENT_CLASSES, SEVERITIES

    text = RULES.read_text()
    used = set(re.findall(r'class="(\w+)"', text))
    assert used <= set(INCIDENT_CLASSES)
    assert used >= {
        "step_time_straggler",
        "global_data_path_slowdown",
        "localized_data_path_slowdown",
        "pre_stage_arrival_skew",
    }
    assert set(re.findall(r'severity="(\w+)"', text)) <= set(SEVERITIES)
