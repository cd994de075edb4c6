"""The shipped Prometheus alert rules: promtool's own checks and unit tests, and their metadata.

``promtool check rules`` and ``promtool test rules`` run the real promtool on
``dashboards/rules``; the other tests hold every alert to the conventions users rely on
(severity, summary, description, a runbook that exists, debouncing) and to the metric catalogue,
check the generator's settings (a copy rendered with other settings passes promtool too), and
run the shipped Alertmanager inhibition rules in a real Alertmanager on the label sets the
promtool tests show the alerts carry.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankwatch.exporter.assets import ALERT_TIMING, Settings
from rankwatch.exporter.assets.settings import DEFAULT_RUNBOOK_URL
from rankwatch.exporter.cli import main as rankwatch_main
from rankwatch.exporter.publish.catalogue import CATALOGUE, COMMON_LABELS
from tests.servers import REPO, alertmanager, http_get, http_post, require_binary, wait_until

RULES_DIR = REPO / "dashboards" / "rules"
RULES = RULES_DIR / "rankwatch.rules.yml"
TESTS_DIR = RULES_DIR / "tests"
RUNBOOKS = REPO / "docs" / "runbooks.md"

REQUIRED_ALERTS = {
    "RankwatchStepTimeStragglerCritical",
    "RankwatchDeepEPGlobalDataPathSlowdown",
    "RankwatchDeepEPLocalizedDataPathSlowdown",
    "RankwatchDeepEPPreStageArrivalSkew",
    "RankwatchDeepEPHangSuspect",
    "RankwatchExporterDown",
    "RankwatchNoFreshWindows",
    "RankwatchExportFailing",
}
SEVERITIES = {"critical", "warning", "info"}
# Labels Prometheus itself attaches to every scraped series.
TARGET_LABELS = {"job", "instance"}


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    binary = require_binary("promtool")
    return subprocess.run(
        [binary, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading (lowercase, punctuation dropped)."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


@pytest.mark.servers
@pytest.mark.parallel_safe
def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", str(RULES), cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


@pytest.mark.servers
@pytest.mark.parallel_safe
@pytest.mark.parametrize("test_file", sorted(p.name for p in TESTS_DIR.glob("*.yml")))
def test_promtool_unit_tests(test_file: str) -> None:
    result = _promtool("test", "rules", f"tests/{test_file}", cwd=RULES_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.servers
@pytest.mark.parallel_safe
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
    # The DeepEP alerts take the incident's severity (a label of the series they aggregate).
    severity = alert.get("labels", {}).get("severity")
    if severity is None:
        assert re.search(r"max by \([^)]*\bseverity\b", alert["expr"]), alert["alert"]
    else:
        assert severity in SEVERITIES
    annotations = alert["annotations"]
    assert set(annotations) >= {"summary", "description", "runbook_url"}
    # Debounced on both edges: pending before firing, held over a scrape gap before resolving.
    assert "for" in alert and "keep_firing_for" in alert
    # The runbook link lands on a heading of docs/runbooks.md named after the alert.
    url = annotations["runbook_url"]
    path, _, fragment = url.partition("#")
    # Absolute by default, so a page opened from a notification reaches it.
    assert path == DEFAULT_RUNBOOK_URL
    assert path.startswith("https://") and path.endswith("/docs/runbooks.md")
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
    for needle in ("$labels.culprit_rank", "$labels.hostname", ".Labels.cause", "$value"):
        if needle in ("$labels.culprit_rank", "$labels.hostname") and (
            "global_data_path" in alert["expr"]
        ):
            continue  # a fabric-wide slowdown has no single rank or host
        if needle in ("$labels.culprit_rank", "$labels.hostname") and (
            "job_slowdown" in alert["expr"]
        ):
            # Every rank, or the ranks whose own work grew: looked up, not labels.
            assert ".Labels.culprit_rank" in text, alert["alert"]
            continue
        if needle == "$labels.culprit_rank" and "step_time_slow_node" in alert["expr"]:
            # A node's late ranks may change while it lasts: looked up, not a label.
            assert ".Labels.culprit_rank" in text, alert["alert"]
            continue
        if needle == "$value" and "rankwatch_incident_active" in alert["expr"]:
            continue  # a hang names ranks and measures no score: its value is only "open"
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
    from rankwatch.diagnosis.vocabulary import INCIDENT_CLASSES
    from rankwatch.diagnosis.vocabulary import INCIDENT_SEVERITIES as SEVERITIES

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


def test_diagnosis_alert_labels_do_not_carry_the_cause() -> None:
    """The cause follows the latest window; as a label it would restart for: at every flip."""
    for alert in _alerts():
        if "rankwatch_incident" not in alert["expr"]:
            continue
        for grouping in re.findall(r"\bby\s*\(([^)]*)\)", alert["expr"]):
            assert "cause" not in grouping, alert["alert"]
        assert "without" not in alert["expr"]
        assert ".Labels.cause" in alert["annotations"]["description"]


# --- the generator's settings ------------------------------------------------------------------


@pytest.mark.servers
@pytest.mark.parallel_safe
def test_settings_render_a_different_installation(tmp_path: Path) -> None:
    """Runbook base, job selector and for: come from `rankwatch assets export`'s settings
    (a JSON file and options, which win); the result passes promtool."""
    settings_file = tmp_path / "settings.json"
    settings_file.write_text(
        json.dumps(
            {
                "runbook_url": "https://wiki.example.com/ops/rankwatch.md",
                "for": {"RankwatchStepTimeStragglerWarning": "10m", "RankwatchExporterDown": "1m"},
            }
        )
    )
    out = tmp_path / "out"
    argv = ["assets", "export", str(out), "--settings", str(settings_file)]
    argv += ["--job-selector", 'job="training"', "--for", "RankwatchExporterDown=15m"]
    assert rankwatch_main(argv) == 0
    rules_file = out / "dashboards/rules/rankwatch.rules.yml"
    doc = yaml.safe_load(rules_file.read_text())
    alerts = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    assert alerts["RankwatchStepTimeStragglerWarning"]["for"] == "10m"
    assert alerts["RankwatchExporterDown"]["for"] == "15m"
    critical = ALERT_TIMING["RankwatchStepTimeStragglerCritical"].for_
    assert alerts["RankwatchStepTimeStragglerCritical"]["for"] == critical  # the default stays
    for alert in alerts.values():
        assert alert["annotations"]["runbook_url"].startswith(
            "https://wiki.example.com/ops/rankwatch.md#rankwatch"
        )
    # Every rule that reads scraped series selects the job (the fleet's ledger alert reads
    # only its own recorded series, which did).
    for rule in (r for g in doc["groups"] for r in g["rules"]):
        if re.search(r"\b(?:rankwatch_\w+|up)\{", rule["expr"]):
            assert 'job="training"' in rule["expr"], rule
        assert ".*rankwatch.*" not in rule["expr"]
    result = _promtool("check", "rules", str(rules_file), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # The PrometheusRule carries the same rules.
    (rule_object,) = yaml.safe_load_all((out / "deploy/kubernetes/prometheusrule.yaml").read_text())
    assert rule_object["spec"] == doc
    # The dashboards' runbook links follow the same setting.
    overview = (out / "dashboards/rankwatch-overview.json").read_text()
    assert "https://wiki.example.com/ops/rankwatch.md#rankwatch" in overview
    assert DEFAULT_RUNBOOK_URL not in overview


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--for", "RankwatchNoSuchAlert=5m"], "--for 'RankwatchNoSuchAlert=5m': for: unknown"),
        (["--for", "RankwatchExporterDown=5 minutes"], "got '5 minutes'"),
        (["--for", "RankwatchExporterDown=1.5m"], "got '1.5m'"),
        (["--for", "RankwatchExporterDown"], "--for 'RankwatchExporterDown': expected ALERT="),
        (["--for", "=1m"], "--for '=1m': expected ALERT=DURATION"),
        (["--keep-firing-for", "RankwatchExporterDown=soon"], "--keep-firing-for"),
        (["--job-selector", "training"], "job_selector"),
        (["--stale-window-seconds", "0"], "stale_window_seconds"),
        (["--settings", "missing.json"], "--settings 'missing.json'"),
    ],
)
def test_export_refuses_bad_settings_with_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert rankwatch_main(["assets", "export", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rankwatch assets: error: "), err
    assert message in err
    assert not out.exists()  # nothing written


def test_export_refuses_a_settings_file_that_is_not_a_json_object(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for text in ("for: {}\n", "[1, 2]"):  # YAML is not read (no PyYAML at run time)
        (tmp_path / "s.json").write_text(text)
        assert (
            rankwatch_main(
                ["assets", "export", str(tmp_path / "o"), "--settings", str(tmp_path / "s.json")]
            )
            == 2
        )
        assert "--settings" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"for": {"RankwatchExporterDown": "5 minutes"}}, "for.RankwatchExporterDown"),
        ({"for": {"RankwatchNoSuchAlert": "5m"}}, "for: unknown alert"),
        ({"keep_firing_for": {"RankwatchExporterDown": 5}}, "keep_firing_for.Rankwatch"),
        ({"job_selector": "rankwatch"}, "job_selector"),
        ({"runbook_url": "https://x.example/r.md#top"}, "runbook_url"),
        ({"stale_window_seconds": 0}, "stale_window_seconds"),
        ({"ledger_window": "a week"}, "ledger_window: expected a Prometheus duration"),
        ({"ledger_window": "0s"}, "ledger_window: must be longer than 0"),
        ({"ledger_interval": 300}, "ledger_interval: expected a Prometheus duration"),
        ({"repeat_offender_runs": 0}, "repeat_offender_runs: expected an int from 1 to 10000"),
        ({"repeat_offender_runs": True}, "repeat_offender_runs: expected an int"),
        ({"repeat_offender_healthy_runs": -1}, "repeat_offender_healthy_runs: expected an int"),
        ({"runbook": "x"}, "unknown key 'runbook'"),
    ],
)
def test_bad_settings_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        Settings.load(overrides)


# --- Alertmanager inhibition --------------------------------------------------------------------

AM_CONFIG = REPO / "deploy" / "compose" / "alertmanager.yml"


def _tested_alert_labels() -> dict[str, list[dict[str, str]]]:
    """Label sets each alert fires with in the promtool tests (what the rules really produce)."""
    out: dict[str, list[dict[str, str]]] = {}
    for path in TESTS_DIR.glob("*.yml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                for alert in case["exp_alerts"]:
                    labels = {k: str(v) for k, v in alert["exp_labels"].items()}
                    out.setdefault(case["alertname"], []).append(labels)
    return out


def _alertname(matchers: list[str]) -> str:
    (name,) = [m.split("=", 1)[1].strip('"') for m in matchers if m.startswith("alertname=")]
    return name


def test_inhibition_rules_can_match_the_labels_alerts_carry() -> None:
    """Every label an inhibition rule compares is on both alerts (a missing label on one side
    would never be equal to a present one on the other)."""
    config = yaml.safe_load(AM_CONFIG.read_text())
    fired = _tested_alert_labels()
    assert config["inhibit_rules"]
    for rule in config["inhibit_rules"]:
        source, target = _alertname(rule["source_matchers"]), _alertname(rule["target_matchers"])
        for name in (source, target):
            assert any(set(rule["equal"]) <= set(labels) for labels in fired[name]), (
                f"{name} never carries all of {rule['equal']} in the rule tests"
            )


def _post_alerts(am_url: str, alerts: list[dict[str, str]]) -> None:
    now = time.time()
    body = [
        {
            "labels": labels,
            "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 60)),
            "endsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now + 600)),
        }
        for labels in alerts
    ]
    http_post(
        f"{am_url}/api/v2/alerts",
        json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


@pytest.mark.servers
@pytest.mark.parallel_safe
def test_inhibition_in_a_real_alertmanager() -> None:
    """The shipped inhibition rules, on the alerts' real label sets, in a real Alertmanager."""
    fired = _tested_alert_labels()

    def alert(name: str, **labels: str) -> dict[str, str]:
        # The label set a promtool test shows, with this scenario's run/group/instance.
        base = next(ls for ls in fired[name] if set(labels) <= set(ls) | {"instance"})
        return {"alertname": name, **base, **labels}

    down = alert("RankwatchExporterDown", run="r7", instance="node-3:9465")
    stale_same_run = alert("RankwatchNoFreshWindows", run="r7", instance="node-0:9464")
    stale_other_run = alert("RankwatchNoFreshWindows", run="r8", instance="node-5:9464")
    critical = alert("RankwatchStepTimeStragglerCritical", run="r7", group="world")
    warning_same = alert("RankwatchStepTimeStragglerWarning", run="r7", group="world")
    warning_other = alert("RankwatchStepTimeStragglerWarning", run="r7", group="dp1")
    with alertmanager(AM_CONFIG.read_text()) as am:
        _post_alerts(
            am.url, [down, stale_same_run, stale_other_run, critical, warning_same, warning_other]
        )

        def states() -> dict[tuple[str, str, str], list[str]]:
            got = json.loads(http_get(f"{am.url}/api/v2/alerts"))
            return {
                (
                    a["labels"]["alertname"],
                    a["labels"].get("run", ""),
                    a["labels"].get("group", ""),
                ): a["status"]["inhibitedBy"]
                for a in got
            }

        # The inhibitor learns its source alerts asynchronously: wait for both targets.
        inhibited = wait_until(
            lambda: (
                (s := states())
                and s.get(("RankwatchNoFreshWindows", "r7", "world"))
                and s.get(("RankwatchStepTimeStragglerWarning", "r7", "world"))
                and s
            ),
            15,
            what="the inhibited alerts",
        )
        time.sleep(1)  # and give a wrong inhibition of the others the same chance
        inhibited = states()
    assert len(inhibited) == 6
    assert inhibited[("RankwatchNoFreshWindows", "r7", "world")], "same run: inhibited"
    assert not inhibited[("RankwatchNoFreshWindows", "r8", "world")], "another run: not"
    assert inhibited[("RankwatchStepTimeStragglerWarning", "r7", "world")]
    assert not inhibited[("RankwatchStepTimeStragglerWarning", "r7", "dp1")]
    assert not inhibited[("RankwatchExporterDown", "r7", "")]
    assert not inhibited[("RankwatchStepTimeStragglerCritical", "r7", "world")]
