"""The generated operator files: Grafana dashboards, Prometheus alert rules and the Kubernetes
objects that carry them, rendered from the metric catalogue, the diagnosis thresholds and the
installation's :class:`Settings`.

Modules: :mod:`.settings` (what an installation changes, alert timing), :mod:`.grafana` (panel
building blocks), one module per dashboard (:mod:`.overview`, :mod:`.step_time`,
:mod:`.deepep_normal`), :mod:`.rules`, :mod:`.kubernetes`, :mod:`.yaml_text` (the YAML writer:
PyYAML is not a runtime dependency) and :mod:`.render` (all of them at once).
"""

from rankwatch.exporter.assets.render import GENERATED, render
from rankwatch.exporter.assets.settings import ALERT_TIMING, AlertTiming, Settings

__all__ = ["ALERT_TIMING", "GENERATED", "AlertTiming", "Settings", "render"]
