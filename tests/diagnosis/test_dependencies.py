"""The engines stay pure: importing every module of ``rankwatch.diagnosis`` loads none of
torch, OpenTelemetry, prometheus-client, matplotlib or rich, and nothing of the exporter.

Checked in a fresh interpreter (this one has long since imported everything)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "opentelemetry", "prometheus_client", "matplotlib", "rich", "rankwatch.exporter")

_PROBE = """
import json, pkgutil, importlib, sys
import rankwatch.diagnosis as pkg
names = [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": sorted(sys.modules)}))
"""


def _loaded(code: str) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    result: dict[str, list[str]] = json.loads(out.strip().splitlines()[-1])
    return result


def test_importing_every_diagnosis_module_loads_no_heavy_dependency() -> None:
    result = _loaded(_PROBE)
    # The walk found the engines (a broken walk must not pass by importing nothing).
    assert "rankwatch.diagnosis.step_time.rules" in result["modules"]
    assert "rankwatch.diagnosis.deepep.normal.completion" in result["modules"]
    heavy = [m for m in result["loaded"] if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == [], f"rankwatch.diagnosis pulled in: {heavy[:10]}"


def test_importing_the_exporter_package_loads_neither_torch_nor_opentelemetry() -> None:
    """``rankwatch.exporter`` re-exports its public names lazily: a process that only imports
    it (to call ``init`` later, or read a config) pays for nothing yet."""
    code = (
        "import json, sys, rankwatch.exporter, rankwatch.exporter.config\n"
        "print(json.dumps({'modules': [], 'loaded': sorted(sys.modules)}))"
    )
    loaded = _loaded(code)["loaded"]
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "opentelemetry")]
