"""Which attempt of its run a job is: a restart keeps the run's name and counts up from 0.

A launcher or scheduler that restarts a failed job starts the same command again, so the run
keeps its name (``run_name.py``) and only the attempt tells the two apart. What this reads
(checked in the upstream code and manuals, see docs/fleet.md):

- torchrun sets ``TORCHELASTIC_RESTART_COUNT`` (the worker group's restarts so far: 0 on the
  first start) and ``TORCHELASTIC_MAX_RESTARTS`` (its ``--max-restarts``) in every worker's
  environment (``torch/distributed/elastic/agent/server/local_elastic_agent.py``). A
  re-rendezvous after a membership change does not count as a restart there, so it keeps its
  attempt too.
- Slurm sets ``SLURM_RESTART_COUNT`` in a batch job that was requeued or restarted after a node
  failure (the number of restarts; unset before the first).
- A JobSet labels and annotates each pod with ``jobset.sigs.k8s.io/restart-attempt``; no
  variable carries it, so the pod spec maps it (downward API, ``metadata.labels``) into
  ``JOBSET_RESTART_ATTEMPT``, as ``JOBSET_NAME`` is mapped from the JobSet's name label.

Under a scheduler's restart *and* torchrun's together (``torchrun --max-restarts=2`` inside a
requeued Slurm job) the two counts are combined so that every attempt has its own number:
``scheduler restarts x (max restarts + 1) + torchrun restarts``. ``RANKWATCH_ATTEMPT`` (the
configuration's ``attempt``) overrides all of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["MAX_ATTEMPT", "Attempt", "attempt_from_env"]

# Far above any real restart budget; keeps the label and the combined count bounded.
MAX_ATTEMPT = 1_000_000

TORCHRUN_RESTARTS = "TORCHELASTIC_RESTART_COUNT"
TORCHRUN_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
SCHEDULER_RESTARTS = ("SLURM_RESTART_COUNT", "JOBSET_RESTART_ATTEMPT")


@dataclass(frozen=True)
class Attempt:
    """The attempt's number and the variables it came from (empty: the first, nothing said)."""

    value: int
    source: str


def _count(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    # ASCII digits only, as for ranks: no launcher writes "+1" or "1_0".
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_ATTEMPT:
        raise ValueError(f"{name}: expected a restart count from 0 to {MAX_ATTEMPT}, got {raw!r}")
    return int(raw)


def attempt_from_env(env: Mapping[str, str]) -> Attempt:
    """The attempt the launcher's variables say (see the module docstring); ``Attempt(0, "")``
    when none is set. A variable that is not a count raises ``ValueError`` naming it and its
    value (a wrong attempt would merge two attempts' series)."""
    if not isinstance(env, Mapping):
        raise TypeError(f"env: expected a mapping of variable names to values, got {env!r}")
    scheduler = next(
        ((name, n) for name in SCHEDULER_RESTARTS if (n := _count(env, name)) is not None), None
    )
    restarts = _count(env, TORCHRUN_RESTARTS)
    value, names = 0, []
    if scheduler is not None:
        name, n = scheduler
        per_allocation = 1
        if restarts is not None:
            per_allocation = (_count(env, TORCHRUN_MAX_RESTARTS) or restarts) + 1
        value, names = n * per_allocation, [name]
    if restarts is not None:
        value, names = value + restarts, [*names, TORCHRUN_RESTARTS]
    if value > MAX_ATTEMPT:
        raise ValueError(f"{', '.join(names)}: the combined attempt {value} is over {MAX_ATTEMPT}")
    return Attempt(value, ", ".join(names) if value else "")
