"""rankwatch exporter: collectors inside training ranks, windows, publishers, CLI."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .incidents import IncidentEvent
    from .rankwatch import RankWatch

__all__ = ["init"]


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
    :class:`~rankwatch.exporter.publishing.PublisherHub`.
    """
    # Imported here: torch and the OTel SDK load only when rankwatch is actually started.
    import os

    from .config import RankwatchConfig
    from .publishing import default_publishers
    from .rankwatch import RankWatch

    config = RankwatchConfig.from_env(**overrides)
    raw = os.environ.get("LOCAL_RANK", "0").strip() or "0"
    if not raw.isdigit():
        raise ValueError(f"LOCAL_RANK: expected a non-negative integer, got {raw!r}")
    publishers = default_publishers(config, int(raw), on_incident=on_incident)
    try:
        return RankWatch(group, strategy, config, publishers)
    except BaseException:
        for pub in publishers:
            pub.close(1.0)
        raise
