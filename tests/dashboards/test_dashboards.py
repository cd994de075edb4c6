"""The shipped Grafana dashboards: Grafana's schema, import/provisioning wiring, panel quality.

Schema: every dashboard is decoded with the typed models of Grafana's dashboard schema
(``grafana-foundation-sdk``, generated from Grafana 11.6's schema, panel options and field
config decoded per panel plugin) and encoded again; any field the schema does not know is lost
on the way and fails the test. The same round trip runs against the SDK generated from the
oldest Grafana the docs claim (10.4, installed beside the venv by ``make venv``), in a separate
interpreter because both SDKs are the same package. ``__inputs``/``__requires`` are the import
envelope, not part of the dashboard model, and are checked structurally; a UI import is
replayed as Grafana's import does it (every ``${DS_PROMETHEUS}`` in every string replaced by the
chosen data source) to show the data source stays switchable. Types and enum values the SDK
does not check (panel types, units, threshold and colour modes, variable types, mappings) are
checked here against the SDK's own tables.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog import plugins as grafana_plugins
from grafana_foundation_sdk.cog import runtime as grafana_runtime
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as grafana_dashboard
from grafana_foundation_sdk.models import units as grafana_units

from rankwatch.diagnosis.config import DiagnosisConfig
from rankwatch.exporter.assets.grafana import OLDEST_GRAFANA
from rankwatch.exporter.publish.catalogue import CATALOGUE
from tests.servers import REPO

DASHBOARD_DIR = REPO / "dashboards"
FILES = sorted(p.name for p in DASHBOARD_DIR.glob("rankwatch-*.json"))
DS_REF = {"type": "prometheus", "uid": "${datasource}"}
SCOPED = 'cluster=~"$cluster", namespace=~"$namespace", job=~"$job", run=~"$run", group=~"$group"'
OLDEST_SDK = REPO / ".venv" / "grafana-sdk-oldest"
GRAFANA_DOCS = REPO / "docs" / "grafana.md"

grafana_plugins.register_default_plugins()


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DASHBOARD_DIR / name).read_text())
    return data


def panels(name: str) -> list[dict[str, Any]]:
    return list(load(name)["panels"])


def all_panels() -> list[tuple[str, dict[str, Any]]]:
    return [(name, p) for name in FILES for p in panels(name)]


def _lost(original: Any, decoded: Any, path: str = "") -> list[str]:
    """Paths of ``original`` that are missing or different in ``decoded``."""
    if isinstance(original, dict):
        if not isinstance(decoded, dict):
            return [path]
        out = []
        for key, value in original.items():
            if key not in decoded:
                out.append(f"{path}/{key}")
            else:
                out += _lost(value, decoded[key], f"{path}/{key}")
        return out
    if isinstance(original, list):
        if not isinstance(decoded, list) or len(original) != len(decoded):
            return [path]
        return [
            p
            for i, (a, b) in enumerate(zip(original, decoded, strict=True))
            for p in _lost(a, b, f"{path}[{i}]")
        ]
    return [] if original == decoded else [f"{path} ({original!r} != {decoded!r})"]


def test_four_dashboards_are_shipped() -> None:
    assert FILES == [
        "rankwatch-deepep-normal.json",
        "rankwatch-fleet.json",
        "rankwatch-overview.json",
        "rankwatch-step-time.json",
    ]


@pytest.mark.parametrize("name", FILES)
def test_dashboard_round_trips_through_grafana_schema(name: str) -> None:
    data = load(name)
    decoded = json.loads(json.dumps(grafana_dashboard.Dashboard.from_json(data), cls=JSONEncoder))
    envelope = {"__inputs", "__requires"}
    lost = [p for p in _lost(data, decoded) if p.lstrip("/") not in envelope]
    assert lost == [], f"fields Grafana's schema does not know: {lost}"


def test_schema_check_catches_unknown_fields() -> None:
    """The round trip is a real check: a misspelt option is lost and reported."""
    data = load("rankwatch-step-time.json")
    data["panels"][0]["options"]["colourMode"] = "background"
    data["panels"][0]["fieldConfig"]["defaults"]["tresholds"] = {}
    decoded = json.loads(json.dumps(grafana_dashboard.Dashboard.from_json(data), cls=JSONEncoder))
    lost = _lost(data, decoded)
    assert "/panels[0]/options/colourMode" in lost
    assert "/panels[0]/fieldConfig/defaults/tresholds" in lost


@pytest.mark.parametrize("name", FILES)
def test_import_envelope_and_datasource_variable(name: str) -> None:
    data = load(name)
    assert data["__inputs"] == [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
            "description": "Prometheus that scrapes the rankwatch exporters",
        }
    ]
    required = {(r["type"], r["id"]) for r in data["__requires"]}
    assert ("datasource", "prometheus") in required
    assert {("panel", p["type"]) for p in data["panels"]} <= required
    grafana = {r["id"]: r["version"] for r in data["__requires"] if r["type"] == "grafana"}
    assert grafana == {"grafana": OLDEST_GRAFANA}
    # The input is only the initial value of the datasource variable that every panel reads.
    ds_var = data["templating"]["list"][0]
    assert ds_var["name"] == "datasource"
    assert ds_var["type"] == "datasource"
    assert ds_var["query"] == "prometheus"
    assert ds_var["current"]["value"] == "${DS_PROMETHEUS}"
    # Stable identity, current schema, tags.
    assert data["uid"] == name.removesuffix(".json")
    assert 8 <= len(data["uid"]) <= 40
    assert data["schemaVersion"] == grafana_dashboard.Dashboard().schema_version
    assert "rankwatch" in data["tags"]
    assert data.get("id") is None  # an instance id would clash on import


@pytest.mark.parametrize("name", FILES)
def test_templating(name: str) -> None:
    data = load(name)
    by_name = {v["name"]: v for v in data["templating"]["list"]}
    assert {"datasource", "cluster", "namespace", "job", "run", "group"} <= set(by_name)
    for var in data["templating"]["list"]:
        assert var["type"] in {t.value for t in grafana_dashboard.VariableType}
        if var["type"] == "query":
            assert var["datasource"] == DS_REF
            assert re.fullmatch(r"label_values\(.+, \w+\)", var["query"]["query"])
    # The overview and the fleet look across runs; the others at one run and group.
    multi = name in ("rankwatch-overview.json", "rankwatch-fleet.json")
    for key in ("job", "run", "group"):
        assert by_name[key]["multi"] is multi
        assert by_name[key]["includeAll"] is multi
    # cluster and namespace are optional labels: All (the default) must be ".*", which matches
    # series without the label too (the e2e runs the queries so against a real Prometheus).
    for key in ("cluster", "namespace"):
        assert by_name[key]["includeAll"] is True
        assert by_name[key]["allValue"] == ".*"
        assert by_name[key]["current"]["value"] == "$__all"
    for key in ("job", "run", "group"):
        assert 'cluster=~"$cluster", namespace=~"$namespace"' in by_name[key]["query"]["query"]


@pytest.mark.parametrize("name", FILES)
def test_panel_layout_and_ids(name: str) -> None:
    ps = panels(name)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for p in ps:
        g = p["gridPos"]
        assert set(g) == {"h", "w", "x", "y"}
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        area = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & area, f"panel {p['title']!r} overlaps another"
        cells |= area


VALID_UNITS = {
    v for k, v in vars(grafana_units).items() if isinstance(v, str) and not k.startswith("_")
}


@pytest.mark.parametrize(
    ("name", "panel"), all_panels(), ids=lambda x: x if isinstance(x, str) else x["title"]
)
def test_panel_quality(name: str, panel: dict[str, Any]) -> None:
    """Description, unit, thresholds, datasource input and targets on every panel."""
    assert panel["type"] in grafana_runtime.Runtime().panelcfg_variants
    assert len(panel["description"]) >= 40, f"{panel['title']}: description too thin"
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] in VALID_UNITS, f"{panel['title']}: unknown unit {defaults['unit']}"
    thresholds = defaults["thresholds"]
    assert thresholds["mode"] in {m.value for m in grafana_dashboard.ThresholdsMode}
    assert thresholds["steps"][0]["value"] is None
    values = [s["value"] for s in thresholds["steps"][1:]]
    assert values == sorted(values)
    assert defaults["color"]["mode"] in {m.value for m in grafana_dashboard.FieldColorModeId}
    for mapping in defaults.get("mappings", []):
        assert mapping["type"] in {m.value for m in grafana_dashboard.MappingType}
    assert panel["datasource"] == DS_REF
    assert panel["targets"], "a panel without a query"
    for t in panel["targets"]:
        assert t["datasource"] == DS_REF
        assert t["expr"].strip()
    refs = [t["refId"] for t in panel["targets"]]
    assert len(refs) == len(set(refs))


def test_panel_types_are_known_to_the_schema() -> None:
    known = set(grafana_runtime.Runtime().panelcfg_variants)
    used = {p["type"] for _, p in all_panels()}
    assert used <= known, used - known


def _by_title(name: str) -> dict[str, dict[str, Any]]:
    return {p["title"]: p for p in panels(name)}


def _threshold_values(panel: dict[str, Any]) -> list[float]:
    return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"][1:]]


def test_policy_thresholds_are_drawn() -> None:
    """The diagnosis thresholds (the configuration's defaults) appear where a reader needs them."""
    step_time, normal = DiagnosisConfig().step_time, DiagnosisConfig().normal
    score = [step_time.straggler_warning_score, step_time.straggler_critical_score]
    st = _by_title("rankwatch-step-time.json")
    assert _threshold_values(st["Straggler score"]) == score
    assert _threshold_values(st["Straggler score over time"]) == score
    assert _threshold_values(st["Window steps"]) == [
        step_time.min_steps_warning,
        step_time.min_steps_critical,
    ]
    ts = next(p for p in panels("rankwatch-step-time.json") if p["type"] == "timeseries")
    assert ts["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "line+area"
    assert _threshold_values(st["Cause coverage by component"]) == [step_time.cause_coverage_min]
    dn = _by_title("rankwatch-deepep-normal.json")
    assert _threshold_values(dn["Notify ratio per rank and probe"]) == [normal.notify_ratio]
    (green_from,) = _threshold_values(dn["Lowest Notify ratio"])
    assert normal.notify_ratio < green_from < normal.notify_ratio + 0.001
    assert _threshold_values(dn["Global slowdown factor per probe"]) == [normal.global_slowdown]
    assert _threshold_values(dn["Residual slowdown factors by scope"]) == [
        normal.axis_slowdown,
        normal.point_slowdown,
    ]
    ov = _by_title("rankwatch-overview.json")
    assert _threshold_values(ov["Straggler score by group"]) == score


MATRIX_PROBES = ("dispatch_final", "dispatch_rdma_recv", "combine_logical_recv")


def matrix_panels() -> list[dict[str, Any]]:
    return [p for p in panels("rankwatch-deepep-normal.json") if "(src x dst)" in p["title"]]


def test_matrix_panels() -> None:
    ms = matrix_panels()
    assert [m["title"].split()[2] for m in ms] == list(MATRIX_PROBES)
    for m in ms:
        assert m["type"] == "table"
        (t,) = m["targets"]
        assert t["instant"] is True and t["range"] is False and t["format"] == "table"
        # Numeric order: ranks zero-padded, rows sorted by "src-dst" before pivoting.
        assert '"0000$1", "src_rank", "([0-9]{1})"' in t["expr"]
        assert '"0$1", "dst_rank", "([0-9]{4})"' in t["expr"]
        ids = [tr["id"] for tr in m["transformations"]]
        assert ids == ["sortBy", "groupingToMatrix"]
        assert m["transformations"][0]["options"]["sort"] == [{"field": "key", "desc": False}]
        g = m["transformations"][1]["options"]
        assert (g["rowField"], g["columnField"], g["valueField"]) == ("src", "dst", "Value")
        defaults = m["fieldConfig"]["defaults"]
        assert defaults["custom"]["cellOptions"]["type"] == "color-background"
        assert defaults["color"]["mode"].startswith("continuous-")


def test_heatmap_rows_are_ranks_in_numeric_order() -> None:
    maps = [p for p in panels("rankwatch-step-time.json") if p["type"] == "heatmap"]
    assert [hm["title"] for hm in maps] == [
        "Visible phase per rank",
        "Per-rank pace against its own baseline",
    ]
    for hm in maps:
        (t,) = hm["targets"]
        assert t["expr"].startswith("max by (r) (")
        assert t["legendFormat"] == "{{r}}"
        assert hm["options"]["calculate"] is False
    assert 'phase="visible"' in maps[0]["targets"][0]["expr"]
    assert "rankwatch_rank_pace_ratio" in maps[1]["targets"][0]["expr"]


def test_required_panels_exist() -> None:
    st = _by_title("rankwatch-step-time.json")
    types = {title: p["type"] for title, p in st.items()}
    assert types["Incident timeline"] == "state-timeline"
    assert types["Visible phase per rank"] == "heatmap"
    assert {"Current diagnosis", "Per-host breakdown", "Cause coverage by component"} <= set(st)
    dn = _by_title("rankwatch-deepep-normal.json")
    assert {
        "Notify ratio per rank and probe",
        "Residual slowdown factors by scope",
        "Global slowdown factor per probe",
        "Incidents by class",
        "Low-latency row and column ratios",
    } <= set(dn)


def test_overview_links_both_dashboards() -> None:
    data = load("rankwatch-overview.json")
    urls = {lk["url"] for lk in data["links"]}
    assert urls == {"/d/rankwatch-step-time", "/d/rankwatch-deepep-normal"}
    for lk in data["links"]:
        assert lk["includeVars"] and lk["keepTime"]
    for name in ("rankwatch-step-time.json", "rankwatch-deepep-normal.json"):
        assert "/d/rankwatch-overview" in {lk["url"] for lk in load(name)["links"]}


def test_queries_use_catalogue_metrics_and_labels() -> None:
    catalogue = {spec.name: set(spec.all_labels) for spec in CATALOGUE}
    catalogue["up"] = set()
    for name, p in all_panels():
        for t in p["targets"]:
            expr = t["expr"]
            metrics = re.findall(r"\b(rankwatch_[a-z_]+|up)\{([^}]*)\}", expr)
            assert metrics, f"{name} {p['title']}: no metric selector in {expr}"
            for metric, selector in metrics:
                assert metric in catalogue, f"{metric} is not in the catalogue"
                for label in re.findall(r"(\w+)\s*[=!]~?", selector):
                    allowed = catalogue[metric] | {"job", "instance", "cluster", "namespace"}
                    assert label in allowed, (metric, label)
            # Every rankwatch query is scoped to the selected cluster/namespace/job/run/group.
            if "rankwatch_" in expr:
                assert SCOPED in expr
            else:
                assert 'cluster=~"$cluster", namespace=~"$namespace", job=~"$job"' in expr


def test_provisioning_files() -> None:
    providers = yaml.safe_load(
        (DASHBOARD_DIR / "provisioning/dashboards/rankwatch.yml").read_text()
    )
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/rankwatch"
    sources = yaml.safe_load(
        (DASHBOARD_DIR / "provisioning/datasources/prometheus.yml").read_text()
    )
    (ds,) = sources["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    compose = yaml.safe_load((REPO / "deploy/compose/compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert "../../dashboards:/var/lib/grafana/dashboards/rankwatch:ro" in mounts
    assert "../../dashboards/provisioning:/etc/grafana/provisioning:ro" in mounts
    assert ds["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]


def test_docs_describe_every_panel() -> None:
    text = " ".join(GRAFANA_DOCS.read_text().split())
    for name, p in all_panels():
        assert f"**{p['title']}**" in text, (
            f"docs/grafana.md does not describe {p['title']!r} ({name})"
        )


# --- import, versions, rank order, runbooks -----------------------------------------------------


def _strings(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [x for v in node.values() for x in _strings(v)]
    if isinstance(node, list):
        return [x for v in node for x in _strings(v)]
    return [node] if isinstance(node, str) else []


def grafana_import(data: dict[str, Any], inputs: dict[str, str]) -> dict[str, Any]:
    """What Grafana's dashboard import does with the inputs: every ``${NAME}`` of an input, in
    every string of the JSON, replaced by the chosen value; ``__inputs`` dropped."""

    def evaluate(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: evaluate(v) for k, v in node.items() if k != "__inputs"}
        if isinstance(node, list):
            return [evaluate(v) for v in node]
        if isinstance(node, str):
            return re.sub(r"\$\{.+?\}", lambda m: inputs.get(m.group(0)[2:-1], m.group(0)), node)
        return node

    result: dict[str, Any] = evaluate(data)
    return result


@pytest.mark.parametrize("name", FILES)
def test_ui_import_keeps_the_data_source_switchable(name: str) -> None:
    """After an import the panels still follow the datasource variable, which starts on the
    data source picked in the import dialog; no panel is pinned to that data source's uid."""
    data = load(name)
    assert [i["name"] for i in data["__inputs"]] == ["DS_PROMETHEUS"]
    imported = grafana_import(data, {"DS_PROMETHEUS": "picked-uid"})
    ds_var = imported["templating"]["list"][0]
    assert ds_var["current"]["value"] == "picked-uid"
    # The picked uid is the variable's value and nothing else.
    assert sum(s == "picked-uid" for s in _strings(imported)) == 2  # current text and value
    for p in imported["panels"]:
        assert p["datasource"] == DS_REF
        assert all(t["datasource"] == DS_REF for t in p["targets"])
    for var in imported["templating"]["list"][1:]:
        assert var["datasource"] == DS_REF
    assert not any("DS_PROMETHEUS" in s for s in _strings(imported))


def _label_replace(labels: dict[str, str], expr: str) -> dict[str, str]:
    """Apply the label_replace calls of ``expr`` (innermost first), anchored as Prometheus does."""
    # Nested calls: the innermost call's arguments come first in the text.
    calls = re.findall(r'"(\w+)", "([^"]*)", "(\w+)", "([^"]*)"\)', expr)
    for dst, replacement, src, regex in calls:
        m = re.fullmatch(regex, labels.get(src, ""))
        if m:
            labels[dst] = m.expand(replacement.replace("$1", r"\1"))
    return labels


def test_rank_padding_orders_100k_ranks_numerically() -> None:
    """The padded rank label sorts as the number for groups far beyond 1,000 ranks."""
    for hm in [p for p in panels("rankwatch-step-time.json") if p["type"] == "heatmap"]:
        expr = hm["targets"][0]["expr"]
        ranks = [0, 1, 9, 10, 99, 100, 999, 1000, 1023, 4095, 10000, 65535, 99999]
        padded = [_label_replace({"rank": str(r)}, expr)["r"] for r in ranks]
        assert sorted(padded) == padded
        assert [int(x) for x in padded] == ranks
        assert all(len(x) == 5 for x in padded)


def test_every_alert_has_a_runbook_link_on_a_panel() -> None:
    rules = yaml.safe_load((DASHBOARD_DIR / "rules" / "rankwatch.rules.yml").read_text())
    runbooks = {
        r["alert"]: r["annotations"]["runbook_url"]
        for g in rules["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    linked = {lk["url"] for _, p in all_panels() for lk in p.get("links", [])}
    assert set(runbooks.values()) <= linked, set(runbooks.values()) - linked
    for _, p in all_panels():
        for lk in p.get("links", []):
            if lk["title"].startswith("Runbook: "):
                assert lk["url"] == runbooks[lk["title"].removeprefix("Runbook: ")]
                assert lk["targetBlank"] is True


_OLDEST_CHECK = """
import json, sys
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard
plugins.register_default_plugins()
data = json.load(open(sys.argv[1]))
decoded = dashboard.Dashboard.from_json(data)
print(json.dumps(json.loads(json.dumps(decoded, cls=JSONEncoder))))
"""


@pytest.mark.slow
def test_oldest_claimed_grafana_schema_loads_the_dashboards() -> None:
    """docs/grafana.md claims Grafana 10.4 and newer: the 10.4 schema knows every field."""
    oldest = OLDEST_GRAFANA
    assert f"Grafana {oldest.rsplit('.', 1)[0]} and newer" in GRAFANA_DOCS.read_text()
    meta = list(OLDEST_SDK.glob("grafana_foundation_sdk-*.dist-info"))
    assert meta, f"{OLDEST_SDK} is missing: run make venv"
    assert meta[0].name.endswith(f"!{oldest}.dist-info"), meta[0].name
    for name in FILES:
        result = subprocess.run(
            [
                sys.executable,
                "-I",
                "-c",
                f"import sys; sys.path.insert(0, {str(OLDEST_SDK)!r})\n" + _OLDEST_CHECK,
                str(DASHBOARD_DIR / name),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        data = load(name)
        lost = [
            p
            for p in _lost(data, json.loads(result.stdout))
            if p.lstrip("/") not in {"__inputs", "__requires"}
        ]
        assert lost == [], f"{name}: fields Grafana {oldest}'s schema does not know: {lost}"
