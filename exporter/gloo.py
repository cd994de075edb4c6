"""The dedicated Gloo group both collectors talk over, and what comes with it.

rankwatch never uses the training job's own groups: the step-time collector and the DeepEP
collector each create a Gloo group of their own (:func:`create_gloo_group`), with a timeout
long enough that a slow root never tears a sender's connection down (:func:`group_timeout`),
and keep their doorbells and identities under a store prefix private to that group
(:func:`dedicated_store`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

from rankwatch.exporter.config import RankwatchConfig

__all__ = ["create_gloo_group", "dedicated_store", "group_timeout", "own_group_names"]

_GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


_OWN_GROUPS: set[str] = set()


def create_gloo_group(
    ranks: Sequence[int], members_only: bool, timeout: timedelta, lazy: bool
) -> Any:
    """The dedicated Gloo group over ``ranks`` (global).

    ``members_only=False`` is the ordinary ``new_group``: every process of the job calls it,
    in the same order as its other ``new_group`` calls. ``members_only=True`` lets only the
    members call it (for a group given as a process group handle, which non-members lack).

    ``lazy`` (the caller's ``RankwatchConfig.gloo_lazy_connect``) makes the group connect
    lazily (Gloo's ``TORCH_GLOO_LAZY_INIT``, set only while it is created): a pair connects on
    its first message, and only rank-to-root pairs ever carry one, so a rank holds one
    monitoring connection instead of one per member (a full mesh: thousands of sockets per
    rank in a 4,096-rank job). ``new_group`` ignores Gloo options, so the variable is the only
    switch; other groups are created as they would be without it.
    """
    import torch.distributed as dist

    with _env(_GLOO_LAZY_INIT, "1") if lazy else contextlib.nullcontext():
        group = dist.new_group(
            list(ranks), timeout=timeout, backend="gloo", use_local_synchronization=members_only
        )
    name = getattr(group, "group_name", None)
    if isinstance(name, str):
        _OWN_GROUPS.add(name)
    return group


def own_group_names() -> frozenset[str]:
    """Names of the groups rankwatch made in this process (its traffic is not the job's: the
    hang records leave them out)."""
    return frozenset(_OWN_GROUPS)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` for the block, then the previous value (or none)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def dedicated_store(group: Any) -> Any:
    """A prefix of the job's c10d store private to rankwatch's group (doorbells, identities)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(f"rankwatch/{group.group_name}/", _get_default_store())


def group_timeout(config: RankwatchConfig) -> timedelta:
    """Timeout of the dedicated group's blocking operations.

    Only a sender waits on Gloo (its send completes when the root's posted receive takes it);
    the root never waits on anything that has not arrived. A long timeout keeps a slow root
    from tearing down the senders' connections.
    """
    return timedelta(seconds=max(600.0, 20 * config.gather_timeout_seconds))
