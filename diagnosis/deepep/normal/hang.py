"""Who hung: ranks whose DeepEP counters stood still while their peers' advanced.

A window where *no* rank advanced is idle (``empty_window``, no finding): training paused or
finished. A window where some ranks advanced and others did not is a hang suspect, and the
counters the ranks still report say who stopped and where:

* a **stalled rank**: its own counter block advanced by nothing (no Notify launch finished, no
  Completion sample recorded) while a peer finished at least ``hang_min_progress`` Notify
  launches or recorded that many samples;
* a **silent source** of a Completion probe: no rank recorded a sample from it while the probe
  recorded at least ``hang_min_progress`` samples from other sources (its tokens stopped
  arriving, e.g. a rank stuck inside dispatch while the others' kernels wait for it).

``stage`` names the first probe, in the order a layer runs them (dispatch Notify, dispatch
Completion, combine Notify, combine Completion), where a named rank is missing: where it
stopped. DeepEP's kernels trap after about 100 s of waiting, so the finding must come from the
first window that shows the stall; later windows, when every rank waits, are idle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rankwatch.diagnosis.config import NormalConfig, config_or_default
from rankwatch.diagnosis.deepep.normal.window import NormalWindow

__all__ = ["PIPELINE_ORDER", "StallFinding", "find_stall"]

# The order a layer's kernels run in; the first probe a named rank misses is where it stopped.
PIPELINE_ORDER: tuple[str, ...] = (
    "notify_dispatch",
    "cached_notify_dispatch",
    "dispatch_rdma_recv",
    "dispatch_final",
    "cached_notify_combine",
    "combine_logical_recv",
)


@dataclass(frozen=True)
class StallFinding:
    """The ranks that stopped in one window, and where.

    ``stalled_ranks``: ranks whose whole counter block stood still. ``silent_sources``: per
    Completion probe, sources no rank recorded a sample from. ``launches``: per Notify probe,
    every rank's finished launches in the window (what the peers did meanwhile). ``stage``: the
    first probe, in pipeline order, where a named rank is missing.
    """

    stalled_ranks: tuple[int, ...]
    silent_sources: dict[str, tuple[int, ...]] = field(default_factory=dict)
    launches: dict[str, tuple[int, ...]] = field(default_factory=dict)
    stage: str = ""

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank the finding names: stalled ranks and silent sources."""
        named = set(self.stalled_ranks)
        for sources in self.silent_sources.values():
            named.update(sources)
        return tuple(sorted(named))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (incident evidence)."""
        return {
            "stalled_ranks": list(self.stalled_ranks),
            "silent_sources": {p: list(s) for p, s in self.silent_sources.items()},
            "launches": {p: list(c) for p, c in self.launches.items()},
            "stage": self.stage,
        }


def _stage(window: NormalWindow, named: set[int], silent: dict[str, tuple[int, ...]]) -> str:
    for probe in PIPELINE_ORDER:
        if probe in window.notify:
            count = window.notify[probe][1]
            if count.max() > 0 and any(count[r] == 0 for r in named):
                return probe
        elif probe in silent:
            return probe
        elif probe in window.completion:
            samples = window.completion[probe][1]
            # A named rank recorded nothing as a receiver while its peers did.
            if samples.sum() > 0 and any(samples[:, r].sum() == 0 for r in named):
                return probe
    return ""


def find_stall(window: NormalWindow, config: NormalConfig | None = None) -> StallFinding | None:
    """The hang-suspect finding of ``window``, or None when every rank advanced (or none did)."""
    if not isinstance(window, NormalWindow):
        raise TypeError(f"window: expected a NormalWindow, got {type(window).__name__}")
    cfg = config_or_default(config, NormalConfig)
    ep = window.ep_size
    # Per rank: Notify launches finished and Completion samples recorded as a receiver (its own
    # block holds what it received, the [*, dst] column of the source-oriented matrices).
    launches = np.zeros(ep)
    for _, count in window.notify.values():
        launches += count
    received = np.zeros(ep)
    for _, samples, _ in window.completion.values():
        received += samples.sum(axis=0)
    advanced = (launches > 0) | (received > 0)
    peer_progress = max(float(launches.max(initial=0.0)), float(received.max(initial=0.0)))
    if peer_progress < cfg.hang_min_progress:
        return None
    stalled = tuple(int(r) for r in np.flatnonzero(~advanced))
    silent: dict[str, tuple[int, ...]] = {}
    for probe, (_, samples, _) in window.completion.items():
        sent = samples.sum(axis=1)
        if sent.sum() < cfg.hang_min_progress:
            continue
        # A source counts only where some rank could have received from it: on the RDMA probe
        # a rank's own row holds its local lane, so this compares like with like.
        quiet = np.flatnonzero(sent == 0)
        if quiet.size and quiet.size < ep:
            silent[probe] = tuple(int(s) for s in quiet)
    if not stalled and not silent:
        return None
    named = set(stalled) | {s for sources in silent.values() for s in sources}
    return StallFinding(
        stalled_ranks=stalled,
        silent_sources=silent,
        launches={
            p: tuple(int(c) for c in count.tolist()) for p, (_, count) in window.notify.items()
        },
        stage=_stage(window, named, silent),
    )
