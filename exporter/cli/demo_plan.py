"""What ``rankwatch demo`` runs: its options, its named timelines and their phases.

Pure data and validation, shared by the parent process (:mod:`.demo`) and the ranks it spawns
(:mod:`.demo_rank`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DEEPEP_PHASES",
    "SCENARIOS",
    "SIM_EP_SIZE",
    "SIM_LATE_RANK",
    "SIM_RANKS_PER_NODE",
    "STEP_PHASES",
    "DemoOptions",
    "Segment",
    "Timeline",
    "deepep_phase_at",
    "parse_timeline",
    "scenario_timeline",
]

# What the straggler rank does in each step-time phase.
STEP_PHASES: dict[str, str] = {
    "balanced": "every rank does the same work",
    "input": "the straggler rank sleeps in its data loading",
    "compute": "the straggler rank's forward pass is slowed",
}
# The simulator's five DeepEP normal-mode phases, in the order of the DeepEP validation run.
DEEPEP_PHASES: tuple[str, ...] = (
    "baseline",
    "pre_dispatch_delay",
    "pre_combine_delay",
    "all_hca_pressure",
    "single_hca_pressure",
)
# The simulated DeepEP group, whatever the number of training ranks: EP 16 over two nodes of
# eight, the layout of the DeepEP validation run, whose rank 9 is the late one.
SIM_EP_SIZE = 16
SIM_RANKS_PER_NODE = 8
SIM_LATE_RANK = 9
# Named timelines as shares of the duration.
SCENARIOS: dict[str, tuple[tuple[str, float], ...]] = {
    "full": (("balanced", 0.2), ("input", 0.3), ("compute", 0.3), ("balanced", 0.2)),
    "critical-straggler": (("input", 0.6), ("balanced", 0.4)),
    "balanced": (("balanced", 1.0),),
}


@dataclass(frozen=True)
class Segment:
    """One stretch of the timeline: a step-time phase held for ``seconds``."""

    phase: str
    seconds: float


@dataclass(frozen=True)
class Timeline:
    """The scripted step-time phases in order, plus where each one starts."""

    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("timeline: needs at least one segment")
        for seg in self.segments:
            if seg.phase not in STEP_PHASES:
                raise ValueError(
                    f"timeline: unknown phase {seg.phase!r}, expected one of {list(STEP_PHASES)}"
                )
            if not (math.isfinite(seg.seconds) and seg.seconds > 0):
                raise ValueError(
                    f"timeline: phase {seg.phase!r} needs a duration > 0 s, got {seg.seconds!r}"
                )

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.segments)

    def index_at(self, elapsed_s: float) -> int:
        """Index of the segment running ``elapsed_s`` seconds in (the last one after the end)."""
        end = 0.0
        for i, seg in enumerate(self.segments):
            end += seg.seconds
            if elapsed_s < end:
                return i
        return len(self.segments) - 1

    def scaled(self, total_seconds: float) -> Timeline:
        """The same proportions stretched or squeezed to last ``total_seconds``."""
        factor = total_seconds / self.total_seconds
        return Timeline(tuple(Segment(s.phase, s.seconds * factor) for s in self.segments))

    def spec(self) -> str:
        """The timeline written back in ``phase:seconds`` form."""
        return ",".join(f"{s.phase}:{s.seconds:g}" for s in self.segments)


def parse_timeline(spec: str) -> Timeline:
    """Parse ``"balanced:10,input:30,balanced:20"`` (phase:seconds, comma separated)."""
    segments = []
    for part in spec.split(","):
        part = part.strip()
        phase, sep, seconds = part.partition(":")
        if not sep or not phase.strip():
            raise ValueError(f"timeline: expected phase:seconds, got {part!r} in {spec!r}")
        try:
            value = float(seconds)
        except ValueError:
            raise ValueError(
                f"timeline: seconds of {phase.strip()!r} must be a number, got {seconds!r}"
            ) from None
        segments.append(Segment(phase.strip(), value))
    return Timeline(tuple(segments))


def scenario_timeline(name: str, duration_s: float) -> Timeline:
    """A named scenario laid out over ``duration_s`` seconds."""
    if name not in SCENARIOS:
        raise ValueError(f"scenario: unknown scenario {name!r}, expected one of {list(SCENARIOS)}")
    return Timeline(tuple(Segment(p, share * duration_s) for p, share in SCENARIOS[name]))


def deepep_phase_at(elapsed_s: float, total_s: float) -> int:
    """Index into :data:`DEEPEP_PHASES`: the five phases share the run equally."""
    share = total_s / len(DEEPEP_PHASES)
    return min(int(elapsed_s // share), len(DEEPEP_PHASES) - 1)


@dataclass(frozen=True)
class DemoOptions:
    """Everything ``rankwatch demo`` can be told; validated when built."""

    ranks: int = 4
    timeline: Timeline = field(default_factory=lambda: scenario_timeline("full", 60.0))
    port: int = 9464
    addr: str = "127.0.0.1"
    out: Path = Path("rankwatch-out")
    straggler_rank: int = 1
    straggler_ms: float = 40.0
    interval_seconds: float = 1.0
    live: bool | None = None
    # Every rank's forward pass waits this long, standing for its device's kernels (on a GPU the
    # host waits for them). The host's own work is a few milliseconds a step, and a busy host's
    # scheduling moves that by tenths of a millisecond: without a device's share, a balanced
    # step of 7 ms reached straggler scores of 0.09-0.10 on two shared cores.
    device_ms: float = 15.0
    # Pause after every step, outside the timed step: keeps a few ranks on two cores polite.
    step_pause_ms: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int):
            raise TypeError(f"DemoOptions.ranks: expected an int, got {self.ranks!r}")
        if not 2 <= self.ranks <= 8:
            raise ValueError(f"DemoOptions.ranks: must be in 2..8, got {self.ranks}")
        if not 0 <= self.straggler_rank < self.ranks:
            raise ValueError(
                f"DemoOptions.straggler_rank: must be below ranks ({self.ranks}), "
                f"got {self.straggler_rank}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"DemoOptions.port: must be in 0..65535, got {self.port}")
        for name in ("straggler_ms", "interval_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"DemoOptions.{name}: must be a finite number > 0, got {value!r}")
        for name in ("device_ms", "step_pause_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"DemoOptions.{name}: must be >= 0, got {value!r}")
