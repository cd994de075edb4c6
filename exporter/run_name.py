"""The run's name on every rank, and where it came from, when the job is started.

:func:`rankwatch.exporter.identity.run_name_from_env` names a run from what the launcher or
scheduler gives every process alike (``RANKWATCH_RUN_ID``, Slurm, Kubernetes, torchrun's
``--rdzv-id``). A job started without any of them (``torchrun`` with ``--master-port`` or over
several nodes without ``--rdzv-id``, ``mp.spawn``, a hand-written ``init_process_group``) has
none, and its series would carry an empty ``run`` label. Then rank 0 makes a readable name,
its host and the time rankwatch started there (``node-a-20261203-051500``, UTC), and every
rank reads that one name from the job's c10d store (the store ``init_process_group`` made,
which every rank of the job shares).

The key is set with ``compare_set``: the first value stored is kept, and every rank reads
whatever is stored. Rank 0 stores its name without waiting; any other rank waits up to
:data:`WAIT_SECONDS` for it (rank 0 starts rankwatch at about the same time: rankwatch's own
group, created next, needs it anyway) and then, if none is stored yet (rank 0 is late, or does
not run rankwatch), stores its own, which rank 0 then takes too: the ranks always agree, and a
start is held back 5 seconds at most. A torchrun restart keeps the store, and
so the name. Without ``torch.distributed`` initialised there is nothing to share: the run stays
unnamed, as before (one warning on the root).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rankwatch.exporter.config import MAX_LABEL_CHARS, RankwatchConfig
from rankwatch.exporter.identity import (
    RUN_ID_ENV,
    node_hostname,
    run_name_from_env,
)

__all__ = [
    "AT_START",
    "IN_CODE",
    "RUN_NAME_KEY",
    "WAIT_SECONDS",
    "ResolvedRunName",
    "made_run_name",
    "made_source",
    "resolve_run_name",
    "share_run_name",
]

log = logging.getLogger(__name__)

# The store key (the job's default store: every rank of the job sees it).
RUN_NAME_KEY = "rankwatch/run_name"
# How long a rank other than 0 waits for rank 0's name before it stores its own.
WAIT_SECONDS = 5.0
# The source of a name given to init() or RankwatchConfig in code.
IN_CODE = "run_id given in code"
# What `rankwatch config` says of a run nothing in the environment names.
AT_START = (
    "when rankwatch starts under torch.distributed, rank 0 names the run <host>-<start time, "
    "UTC> and every rank takes that name (the run label is empty only without it)"
)


@dataclass(frozen=True)
class ResolvedRunName:
    """The run's name on this rank and where it came from (``source``, for people: the
    variables that named it, :data:`IN_CODE`, or the rank that made it); both empty when the
    run has no name."""

    name: str
    source: str


def made_run_name(hostname: str, started_at_s: float) -> str:
    """A readable run name: ``<hostname>-<YYYYmmdd-HHMMSS>`` (UTC), within the label limit."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started_at_s))
    host = (hostname or "host")[: MAX_LABEL_CHARS - len(stamp) - 1]
    return f"{host}-{stamp}"


def made_source(rank: int) -> str:
    """The ``source`` of a name rank ``rank`` made."""
    return (
        f"made by rank {rank} (its host and start time; no launcher named the run), "
        "shared with every rank over the c10d store"
    )


def share_run_name(
    store: Any, rank: int, make: Callable[[], str], wait_s: float
) -> tuple[str, int]:
    """``(name, maker)``: the name stored under :data:`RUN_NAME_KEY`, storing ``make()`` when
    none is stored; rank 0 stores at once, other ranks wait up to ``wait_s`` seconds for one
    first. ``maker`` is the rank whose name was kept (``rank`` when it was this one's, else 0:
    the store does not say who stored it, and rank 0 is the one that does)."""
    if rank != 0:
        # The store's timeout raises: rank 0 stored nothing yet, so this rank stores its own.
        with contextlib.suppress(Exception):
            store.wait([RUN_NAME_KEY], timedelta(seconds=wait_s))
    mine = make()
    stored = store.compare_set(RUN_NAME_KEY, "", mine)
    name = stored.decode() if isinstance(stored, bytes) else str(stored)
    return name, (rank if name == mine and rank != 0 else 0)


def _default_store() -> tuple[Any, int] | None:
    """``(store, global rank)`` of the initialised default process group, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store(), dist.get_rank()


def resolve_run_name(
    config: RankwatchConfig,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    wait_s: float = WAIT_SECONDS,
) -> ResolvedRunName:
    """The run's name for ``config`` (built from ``env`` and ``overrides``) and its source.

    ``config.run_id`` when it has one (from ``overrides``: :data:`IN_CODE`; else what
    :func:`run_name_from_env` found). Else, under ``torch.distributed``, the name rank 0 made
    and shared (see the module docstring); else ``("", "")``. Collective with the job's other
    ranks only through the store, and never raises: a store that fails leaves the run unnamed
    with one warning (a name must not stop training).
    """
    if config.run_id:
        if overrides and overrides.get("run_id"):
            return ResolvedRunName(config.run_id, IN_CODE)
        found = run_name_from_env(env)
        source = found.source if found.name == config.run_id else RUN_ID_ENV
        return ResolvedRunName(config.run_id, source)
    if overrides and "run_id" in overrides:  # run_id="" given on purpose: left unnamed
        return ResolvedRunName("", "")
    try:
        default = _default_store()
        if default is None:
            return ResolvedRunName("", "")
        store, rank = default
        started = time.time()
        host = node_hostname(config.node_name_env, env)
        name, maker = share_run_name(store, rank, lambda: made_run_name(host, started), wait_s)
    except Exception as exc:  # a store that cannot be used: unnamed, as before
        log.warning("rankwatch: could not share a run name over the c10d store (%s)", exc)
        return ResolvedRunName("", "")
    return ResolvedRunName(name, made_source(maker))
