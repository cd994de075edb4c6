"""The generator in the package: thresholds from the configuration, its YAML writer, its inputs.

The dashboards and rules are rendered from ``DiagnosisConfig``: a changed threshold moves every
band and every sentence that states it, with no copy left behind. The YAML writer is checked
against PyYAML (a test dependency, not a runtime one): the same text for the shipped documents
and for awkward strings, and the same data read back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankwatch.diagnosis.config import DiagnosisConfig, NormalConfig, StepTimeConfig
from rankwatch.exporter.assets import ALERT_TIMING, GENERATED, Settings, render
from rankwatch.exporter.assets import yaml_text as yaml_writer
from rankwatch.exporter.assets.grafana import with_runbooks
from rankwatch.exporter.assets.prose import number, percent
from rankwatch.exporter.assets.settings import duration_seconds
from rankwatch.exporter.cli import main as rankwatch_main
from rankwatch.exporter.publish.catalogue import METRIC_NAMES
from tests.servers import REPO

CHANGED = DiagnosisConfig(
    step_time=StepTimeConfig(
        straggler_warning_score=0.15,
        straggler_critical_score=0.35,
        min_steps_warning=4,
        min_steps_critical=30,
        cause_coverage_min=0.7,
    ),
    normal=NormalConfig(
        notify_ratio=0.3, global_slowdown=1.5, axis_slowdown=1.4, point_slowdown=3.0
    ),
)


def _panels(text: str) -> dict[str, dict[str, Any]]:
    return {p["title"]: p for p in json.loads(text)["panels"]}


def _steps(panel: dict[str, Any]) -> list[float]:
    return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"][1:]]


def _alerts(rules_text: str) -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load(rules_text)
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


# --- thresholds come from the configuration -------------------------------------------------


def test_a_changed_configuration_moves_every_band_and_sentence() -> None:
    default, changed = render(), render(config=CHANGED)
    st = _panels(changed["dashboards/rankwatch-step-time.json"])
    assert _steps(st["Straggler score"]) == [0.15, 0.35]
    assert (
        "Yellow from 15 % (warning), red from 35 % (critical)."
        in st["Straggler score"]["description"]
    )
    assert _steps(st["Window steps"]) == [4, 30]
    assert "Below 4 no straggler" in st["Window steps"]["description"]
    assert _steps(st["Cause coverage by component"]) == [0.7]
    assert "reaching 70 %" in st["Cause coverage by component"]["description"]
    dn = _panels(changed["dashboards/rankwatch-deepep-normal.json"])
    assert _steps(dn["Global slowdown factor per probe"]) == [1.5]
    assert _steps(dn["Notify ratio per rank and probe"]) == [0.3]
    assert _steps(dn["Residual slowdown factors by scope"]) == [1.4, 3.0]
    assert (
        "from 1.4x, points and edges from 3x"
        in dn["Residual slowdown factors by scope"]["description"]
    )
    ov = _panels(changed["dashboards/rankwatch-overview.json"])
    assert _steps(ov["Straggler score by group"]) == [0.15, 0.35]
    alerts = _alerts(changed["dashboards/rules/rankwatch.rules.yml"])
    assert (
        "(critical from 35%)"
        in alerts["RankwatchStepTimeStragglerCritical"]["annotations"]["description"]
    )
    assert (
        "alert from 1.5x"
        in alerts["RankwatchDeepEPGlobalDataPathSlowdown"]["annotations"]["description"]
    )
    assert (
        "late from 0.3 down"
        in alerts["RankwatchDeepEPPreStageArrivalSkew"]["annotations"]["description"]
    )
    # No sentence still states a default: the old figures are gone from every changed file.
    defaults = DiagnosisConfig()
    warning = percent(defaults.step_time.straggler_warning_score)
    slowdown = number(defaults.normal.global_slowdown)
    for name in GENERATED:
        if name.endswith(".json"):
            # The DeepEP dashboard has no straggler band; the fleet's counts runs, no bands.
            assert f"{warning} %" in default[name] or name.endswith(
                ("deepep-normal.json", "fleet.json")
            )
            assert f"{warning} %" not in changed[name] and f"{slowdown}x" not in changed[name]
    assert f"{warning}%" not in changed["dashboards/rules/rankwatch.rules.yml"]
    # The rules' expressions do not depend on thresholds (they read the incidents).
    exprs = {n: a["expr"] for n, a in alerts.items()}
    assert exprs == {
        n: a["expr"] for n, a in _alerts(default["dashboards/rules/rankwatch.rules.yml"]).items()
    }


def test_export_reads_the_thresholds_of_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANKWATCH_STRAGGLER_WARNING_SCORE", "0.05")
    assert rankwatch_main(["assets", "export", str(tmp_path)]) == 0
    st = _panels((tmp_path / "dashboards/rankwatch-step-time.json").read_text())
    assert _steps(st["Straggler score"]) == [
        0.05,
        DiagnosisConfig().step_time.straggler_critical_score,
    ]


def test_alert_timing_changes_the_prose_that_states_it() -> None:
    settings = Settings.load({"for": {"RankwatchStepTimeStragglerCritical": "3m"}})
    st = _panels(render(settings)["dashboards/rankwatch-step-time.json"])
    assert "after 3 minutes, a page" in st["Straggler score over time"]["description"]
    default = _panels(render()["dashboards/rankwatch-step-time.json"])
    assert "after a minute, a page" in default["Straggler score over time"]["description"]


def test_every_alert_has_a_timing_and_every_timing_an_alert() -> None:
    alerts = _alerts(render()["dashboards/rules/rankwatch.rules.yml"])
    assert set(alerts) == set(ALERT_TIMING)
    for name, timing in ALERT_TIMING.items():
        assert (alerts[name]["for"], alerts[name]["keep_firing_for"]) == (
            timing.for_,
            timing.keep_firing_for,
        )


def test_unknown_names_are_refused() -> None:
    assert METRIC_NAMES.straggler_score == "rankwatch_straggler_score"
    with pytest.raises(AttributeError, match="'rankwatch_no_such_metric' is not in the catalogue"):
        _ = METRIC_NAMES.no_such_metric
    panel = {"title": "p"}
    with pytest.raises(ValueError, match=r"panel 'p': runbook of unknown alert\(s\) \['Nope'\]"):
        with_runbooks([panel], Settings(), {"p": ("Nope",)})


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("1m", 60.0), ("1h30m", 5400.0), ("500ms", 0.5), ("2d", 172800.0)],
)
def test_durations(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("bad", ["", "1", "m", "1.5m", "1m1h", "5 minutes", "-1m"])
def test_bad_durations_name_the_value(bad: str) -> None:
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        duration_seconds(bad)


@pytest.mark.slow
def test_make_generate_entry_point(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rankwatch.exporter.assets", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"ROOT {str(tmp_path)!r}: has no dashboards/ folder"
    (tmp_path / "dashboards").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "rankwatch.exporter.assets", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for name in GENERATED:
        assert (tmp_path / name).read_bytes() == (REPO / name).read_bytes(), name


# --- the YAML writer --------------------------------------------------------------------------


def _pyyaml(document: Any) -> str:
    class Block(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Block.add_representer(str, text)
    return yaml.dump(document, Dumper=Block, sort_keys=False, width=100)


AWKWARD = [
    "",
    "plain words",
    "1",
    "0x1F",
    "1_000",
    "1:20",
    "1.5",
    ".inf",
    "true",
    "No",
    "null",
    "~",
    "2001-12-14",
    "2001-12-14 21:59:43.10 -5",
    "<<",
    "=",
    "- dash",
    "-dash",
    "? q",
    ": colon",
    "a: b",
    "ends:",
    "a #b",
    "a#b",
    "#comment",
    "{{ $labels.x }}",
    "[x]",
    "it's",
    "'quoted'",
    '"double"',
    "%percent",
    "@at",
    "`tick`",
    "---",
    "...",
    " leading",
    "trailing ",
    "two  spaces " * 12,
    "tab\there",
    "caf\u00e9",
    "word " * 40 + "end",
    "x" * 130 + " y z",
    "it's a long one: " + "with quotes' and words " * 8,
    "line\n",
    "line one\nline two\n",
    "line\n\nafter a blank\n",
    "no final newline\nhere",
    "two final\n\n",
    " indented first\nline\n",
    "trailing space \nline\n",
    'job=~".*rankwatch.*"',
]


@pytest.mark.parametrize("value", AWKWARD)
def test_yaml_writer_reads_back_every_string(value: str) -> None:
    document = {"key": value, "list": [value, {"inner": value}]}
    assert yaml.safe_load(yaml_writer.dump(document)) == document


def test_yaml_writer_matches_pyyaml_where_pyyaml_writes_plain_or_quoted() -> None:
    """Same text as PyYAML for the strings it writes plain, single-quoted or as a literal block
    (the writer escapes with JSON's double quotes, PyYAML with its own: only those differ)."""
    for value in AWKWARD:
        document = {"groups": [{"name": value, "rules": [{"expr": value, "n": 1, "b": True}]}]}
        expected = _pyyaml(document)
        if '"' in expected.replace('\\"', ""):  # PyYAML chose double quotes
            continue
        assert yaml_writer.dump(document) == expected, value


@pytest.mark.parametrize("name", [n for n in GENERATED if not n.endswith(".json")])
def test_yaml_writer_matches_pyyaml_on_the_shipped_files(name: str) -> None:
    text = render()[name]
    documents = [d for d in yaml.safe_load_all(text) if d is not None]
    expected = "---\n".join(_pyyaml(d) for d in documents)
    # Only the header comment is the writer's own (column 0; literal blocks are indented).
    assert "\n".join(ln for ln in text.splitlines() if not ln.startswith("#")) + "\n" == expected


def test_yaml_writer_refuses_what_it_cannot_write() -> None:
    with pytest.raises(TypeError, match="cannot write a float"):
        yaml_writer.dump({"x": 1.5})
    with pytest.raises(ValueError, match="unsupported mapping key 'a: b'"):
        yaml_writer.dump({"a: b": 1})
    with pytest.raises(ValueError, match="a sequence directly inside a sequence"):
        yaml_writer.dump({"x": [[1]]})
    with pytest.raises(TypeError, match="a document must be a mapping"):
        yaml_writer.dump(["x"])  # type: ignore[arg-type]
