"""Every generated operator file from one settings object and one diagnosis configuration.

The dashboards' bands and the alerts' prose read the thresholds of
:class:`~rankwatch.diagnosis.config.DiagnosisConfig`, the queries read metric names from the
catalogue, and the rules read their timing from :class:`~.settings.Settings`; the committed
copies under ``dashboards/`` and ``deploy/kubernetes/`` are this module's output for the
defaults (``make generate``; a test fails when they are stale).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rankwatch.diagnosis.config import DiagnosisConfig
from rankwatch.exporter.assets import deepep_normal, fleet, overview, step_time
from rankwatch.exporter.assets.grafana import Dashboard
from rankwatch.exporter.assets.kubernetes import configmaps, prometheus_rule
from rankwatch.exporter.assets.rules import rules_yaml
from rankwatch.exporter.assets.settings import Settings

__all__ = ["DASHBOARDS", "GENERATED", "RULES_FILE", "render", "write"]

DASHBOARDS: dict[str, Callable[[Settings, DiagnosisConfig], Dashboard]] = {
    "rankwatch-overview.json": overview.build,
    "rankwatch-step-time.json": step_time.build,
    "rankwatch-deepep-normal.json": deepep_normal.build,
    "rankwatch-fleet.json": fleet.build,
}
RULES_FILE = "dashboards/rules/rankwatch.rules.yml"
CONFIGMAPS_FILE = "deploy/kubernetes/dashboards.yaml"
PROMETHEUS_RULE_FILE = "deploy/kubernetes/prometheusrule.yaml"
# Every generated file, relative to the root of a checkout or an export.
GENERATED: tuple[str, ...] = (
    *(f"dashboards/{name}" for name in DASHBOARDS),
    RULES_FILE,
    CONFIGMAPS_FILE,
    PROMETHEUS_RULE_FILE,
)


def render(
    settings: Settings | None = None, config: DiagnosisConfig | None = None
) -> dict[str, str]:
    """Every generated file's text by its path relative to the root (see :data:`GENERATED`);
    defaults: ``Settings()`` and the default ``DiagnosisConfig()``."""
    s = Settings() if settings is None else settings
    cfg = DiagnosisConfig() if config is None else config
    dashboards = {
        name: json.dumps(build(s, cfg), indent=2, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }
    out = {f"dashboards/{name}": text for name, text in dashboards.items()}
    out[RULES_FILE] = rules_yaml(s, cfg)
    out[CONFIGMAPS_FILE] = configmaps(dashboards)
    out[PROMETHEUS_RULE_FILE] = prometheus_rule(s, cfg)
    return out


def write(root: Path, settings: Settings | None = None) -> list[Path]:
    """Write every generated file under ``root`` with the default thresholds (what
    ``make generate`` commits); returns the paths written."""
    written = []
    for relative, text in render(settings).items():
        path = Path(root) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
