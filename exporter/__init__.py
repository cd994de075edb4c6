"""rankwatch exporter: the collectors inside training ranks, the publishers, the command line.

Layers: :mod:`.step_time` (the ``RankWatch`` object and what feeds it), :mod:`.deepep` (the
DeepEP collector), :mod:`.publish` (reports to ``/metrics``, OTLP and log lines),
:mod:`.cli` (the ``rankwatch`` command and the demo), :mod:`.integrations` (framework
callbacks). What they share sits here: :mod:`.config`, :mod:`.identity`, :mod:`.gloo`.

The names a training script needs are importable from here; they load on first use, so
``import rankwatch.exporter`` stays free of torch and OpenTelemetry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.deepep.diagnose import Diagnose
    from rankwatch.exporter.publish.hub import default_publishers
    from rankwatch.exporter.publish.incidents import IncidentEvent
    from rankwatch.exporter.publish.protocol import Publisher
    from rankwatch.exporter.publish.recorder import RunRecorder
    from rankwatch.exporter.step_time.rank_watch import RankWatch

__all__ = [
    "Diagnose",
    "IncidentEvent",
    "Publisher",
    "RankWatch",
    "RankwatchConfig",
    "RunRecorder",
    "default_publishers",
    "init",
]

# Public name -> the module that defines it (imported on first access).
_LAZY = {
    "Diagnose": "rankwatch.exporter.deepep.diagnose",
    "IncidentEvent": "rankwatch.exporter.publish.incidents",
    "Publisher": "rankwatch.exporter.publish.protocol",
    "RankWatch": "rankwatch.exporter.step_time.rank_watch",
    "RankwatchConfig": "rankwatch.exporter.config",
    "RunRecorder": "rankwatch.exporter.publish.recorder",
    "default_publishers": "rankwatch.exporter.publish.hub",
}


def load_lazy(package: str, table: dict[str, str], name: str) -> Any:
    """``name`` of ``package``, imported on first use from the module ``table`` names for it
    (a package's ``__getattr__``: this one's, and ``rankwatch.exporter.deepep``'s)."""
    module = table.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    return load_lazy(__name__, _LAZY, name)


def init(
    group: Any = None,
    strategy: str | None = None,
    *,
    on_incident: Callable[[IncidentEvent], object] | None = None,
    **overrides: Any,
) -> RankWatch:
    """Start rankwatch in this training process with its default publishers.

    ``overrides`` are ``RankwatchConfig`` fields on top of the ``RANKWATCH_*`` environment
    (e.g. ``metrics_port=9500``). The publishers follow the configuration: ``/metrics`` on port
    base + ``$LOCAL_RANK``, OTLP when an ``OTEL_EXPORTER_OTLP_*`` endpoint is set, incident log
    lines. Collective like ``RankWatch`` itself: call it on every rank of ``group``.

    ``on_incident(event)`` is called on the group's root (the only rank that diagnoses) with
    every incident opened or closed, on the publishing thread; see
    :class:`~rankwatch.exporter.publish.hub.PublisherHub`.
    """
    # Imported here: torch and the OTel SDK load only when rankwatch is actually started.
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.identity import local_rank_from_env
    from rankwatch.exporter.publish.hub import default_publishers
    from rankwatch.exporter.run_name import resolve_run_name
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    config = RankwatchConfig.from_env(**overrides)
    # Strict: the metrics port is base + LOCAL_RANK, so a bad value must not become a guess.
    local_rank = local_rank_from_env(strict=True)
    # No launcher named the run: rank 0 names it and every rank takes that name, before the
    # publishers (their labels and OTLP resource carry it) are made.
    run = resolve_run_name(config, overrides) if config.enabled else None
    if run is not None and run.name != config.run_id:
        config = dataclasses.replace(config, run_id=run.name)
    publishers = default_publishers(
        config,
        0 if local_rank is None else local_rank,
        on_incident=on_incident,
        run_source="" if run is None else run.source,
    )
    try:
        return RankWatch(group, strategy, config, publishers)
    except BaseException:
        for pub in publishers:
            pub.close(1.0)
        raise
