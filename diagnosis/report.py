"""The one report model every publisher reads: what the root learned from one window.

The collectors build a ``WindowReport`` per window; Prometheus, OTLP, the log lines and the
artifacts all publish from it. It is plain data and knows nothing of where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rankwatch.diagnosis.deepep.low_latency import LowLatencyResult
    from rankwatch.diagnosis.deepep.normal.report import NormalReport
    from rankwatch.diagnosis.hang.classify import HangReport
    from rankwatch.diagnosis.step_time import StepTimeReport
    from rankwatch.diagnosis.step_time.pace import PaceReport

__all__ = ["RankInfo", "WindowReport"]


@dataclass(frozen=True)
class RankInfo:
    """Identity of one global rank: where it runs (``gpu``/``gpu_uuid``: its CUDA device's index
    and UUID as dcgm-exporter labels them, empty on CPU)."""

    rank: int
    hostname: str = ""
    local_rank: int = 0
    gpu: str = ""
    gpu_uuid: str = ""


@dataclass(frozen=True)
class WindowReport:
    """Everything diagnosed for one window of one group.

    ``step_time``/``normal``/``low_latency`` are None when that engine did not run for this
    window; ``normal_invalid_reason`` / ``low_latency_invalid_reason`` say why a DeepEP window
    was rejected.
    ``missing_ranks`` lists global ranks expected but absent (an incomplete window).
    """

    group: str
    window_index: int
    created_at_s: float
    ranks: tuple[RankInfo, ...]
    run: str = ""
    # "live" for the rolling window, "summary" for the final long window at shutdown.
    window_kind: str = "live"
    missing_ranks: tuple[int, ...] = ()
    step_time: StepTimeReport | None = None
    normal: NormalReport | None = None
    normal_invalid_reason: str | None = None
    low_latency_invalid_reason: str | None = None
    low_latency: dict[str, LowLatencyResult] | None = None
    diagnosis_seconds: dict[str, float] = field(default_factory=dict)
    # The hang watcher's state (rankwatch.diagnosis.hang), on the reports it publishes only.
    hang: HangReport | None = None
    # The group's pace against its own baseline (rankwatch.diagnosis.step_time.pace), on live
    # step-time windows.
    pace: PaceReport | None = None
    # Ranks in the group when ``ranks`` lists only some of them (a report bounded for the
    # training process: ``rank_budget``); 0 when ``ranks`` and ``missing_ranks`` are all of it.
    group_size: int = 0

    @property
    def incomplete(self) -> bool:
        return bool(self.missing_ranks)

    @property
    def size(self) -> int:
        """Ranks in the group (every rank, also those a bounded report leaves out)."""
        if self.group_size:
            return self.group_size
        return len({r.rank for r in self.ranks} | set(self.missing_ranks))

    @cached_property
    def _infos_by_rank(self) -> dict[int, RankInfo]:
        # Publishing looks up every rank of the report: a scan per lookup was quadratic (about
        # 100 ms per 4,096-rank report, on the publishing thread).
        by_rank: dict[int, RankInfo] = {}
        for info in self.ranks:
            by_rank.setdefault(info.rank, info)
        return by_rank

    def rank_info(self, rank: int) -> RankInfo:
        """The identity of ``rank``; an empty one (the rank alone) if the report lacks it."""
        info = self._infos_by_rank.get(rank)
        return RankInfo(rank) if info is None else info

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (no NaN: engines' ``to_dict`` already map NaN to None)."""
        return {
            "group": self.group,
            "run": self.run,
            "window_index": self.window_index,
            "window_kind": self.window_kind,
            "created_at_s": self.created_at_s,
            "ranks": [
                {"rank": r.rank, "hostname": r.hostname, "local_rank": r.local_rank}
                for r in self.ranks
            ],
            "missing_ranks": list(self.missing_ranks),
            "step_time": None if self.step_time is None else self.step_time.to_dict(),
            "normal": None if self.normal is None else self.normal.to_dict(),
            "normal_invalid_reason": self.normal_invalid_reason,
            "low_latency_invalid_reason": self.low_latency_invalid_reason,
            "low_latency": None
            if self.low_latency is None
            else {k: v.to_dict() for k, v in self.low_latency.items()},
            "diagnosis_seconds": dict(self.diagnosis_seconds),
            **({} if self.hang is None else {"hang": self.hang.to_dict()}),
            **({} if self.pace is None else {"pace": self.pace.to_dict()}),
            **({"group_size": self.group_size} if self.group_size else {}),
        }
