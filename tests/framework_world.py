"""Spawn a small CPU world the way torchrun does, for the framework integration tests.

Each rank is a process of its own (:mod:`tests.rank_processes`) with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``...), so the
framework under test initialises ``torch.distributed`` (Gloo) itself. A scenario is a
module-level function ``scenario(rank, world, out_dir) -> dict``; its result (or the traceback)
is written to ``out_dir/<rank>.json`` and the parent gets them all back.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib.util
import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

from bench.accuracy_frameworks import torchrun_env
from tests.rank_processes import rank_process
from tests.servers import free_port, missing_in_ci

JOIN_TIMEOUT_S = 240.0
SLEEP_S = 0.04  # the injected input delay: large against a tiny model's step on two cores
SLOW_RANK = 1  # the rank whose input is slow
STEPS = 120  # optimizer steps per run
BATCH = 8


def require_framework(name: str) -> None:
    """Skip unless ``name`` is installed; in CI (``CI=true``) a missing framework fails: the
    dev extra installs every framework these tests run on. Looked up, not imported: the ranks
    import it, and importing it here would cost every collection of the suite seconds."""
    if importlib.util.find_spec(name) is None:
        missing_in_ci(
            f"{name} is not installed: `pip install -e '.[dev]'` brings it", pytrace=False
        )


def _entry(rank: int, world: int, port: int, scenario: str, out: str) -> None:
    # The rank's stderr (and a fatal error's Python stack) goes to a file the parent reads
    # back when the rank dies: a C++ abort leaves no JSON to say why.
    stderr = open(Path(out, f"{rank}.stderr"), "w")  # noqa: SIM115 - lives as long as the rank
    os.dup2(stderr.fileno(), 2)
    faulthandler.enable(stderr)
    os.environ.update(torchrun_env(rank, world, port), OMP_NUM_THREADS="1")
    result: dict[str, Any] = {"rank": rank}
    try:
        import torch

        torch.set_num_threads(1)
        module, _, name = scenario.partition(":")
        result.update(getattr(importlib.import_module(module), name)(rank, world, out))
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out, f"{rank}.json").write_text(json.dumps(result, default=str))
    _quiesce()


def _quiesce() -> None:
    """Let go of the scenario's garbage and give Gloo's worker threads time to drop their
    finished works before the interpreter shuts down. A process group still alive then (torch
    2.13 keeps the world group referenced past ``destroy_process_group()`` once DDP or
    ``torch.compile`` has run after ``init_process_group``) can have a worker thread free a
    finished work, whose tensors need the GIL, during shutdown: the thread is stopped
    mid-destructor and the process aborts (``terminate called without an active exception``,
    SIGABRT). Seen in about 1 run in 10 of the collective-waits world under load (the CI
    failure); the core showed a ``runLoop`` thread in ``~AsyncAllreduceWork`` while the main
    thread ran ``Py_FinalizeEx``. With this, 25 runs in 25."""
    gc.collect()
    time.sleep(0.1)


def run_world(scenario: str, world: int, out_dir: Path) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` ("module:function") on ``world`` ranks; each rank's result by rank."""
    port = free_port()
    procs = [rank_process(_entry, (r, world, port, scenario, str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} hung in {scenario}"
    out: dict[int, dict[str, Any]] = {}
    for r, p in enumerate(procs):
        f = out_dir / f"{r}.json"
        out[r] = json.loads(f.read_text()) if f.exists() else {}
        out[r]["exitcode"] = p.exitcode
    # Every rank's error first: a rank that raised often makes its peers abort.
    errors = [f"rank {r}:\n{res['error']}" for r, res in out.items() if "error" in res]
    assert not errors, "\n".join(errors) + _stderr_tails(out_dir, world)
    died = [f"rank {r} exited with {res['exitcode']}" for r, res in out.items() if res["exitcode"]]
    assert not died, "; ".join(died) + _stderr_tails(out_dir, world)
    return out


def _stderr_tails(out_dir: Path, world: int, lines: int = 40) -> str:
    """The last lines each rank wrote to stderr, for a failure's message."""
    tails = []
    for r in range(world):
        f = out_dir / f"{r}.stderr"
        text = f.read_text(errors="replace").splitlines()[-lines:] if f.exists() else []
        tails.append(f"\n--- rank {r} stderr ---\n" + "\n".join(text))
    return "".join(tails)


class LogLines(logging.Handler):
    """Keeps (level name, message) of every record of the logger ``name`` it is attached to
    (the logger's level is left alone: what a user's default setup would show)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.lines: list[tuple[str, str]] = []
        logging.getLogger(name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def incident_fields(event: Any) -> dict[str, Any]:
    """What the tests check of an ``IncidentEvent``, JSON-ready."""
    inc = event.incident
    return {
        "action": event.action,
        "id": inc.incident_id,
        "cls": inc.cls,
        "severity": inc.severity,
        "ranks": list(inc.ranks),
        "reason": event.reason,
        "run": event.run,
        "related": [r["kind"] for r in inc.evidence.get("related", ())],
    }


class Recorder:
    """A publisher keeping every report as a dict (what the root hands its publishers)."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def publish(self, report: Any) -> None:
        self.reports.append(report.to_dict())

    def close(self, timeout_seconds: float) -> None:
        pass


def top_findings(reports: list[dict[str, Any]]) -> list[tuple[str, int | None]]:
    """(kind, culprit rank) of each live window's first step-time finding, in order."""
    out: list[tuple[str, int | None]] = []
    for r in reports:
        st = r.get("step_time")
        if r.get("window_kind") != "live" or not st or not st.get("findings"):
            continue
        top = st["findings"][0]
        out.append((top["kind"], top.get("culprit_rank")))
    return out


def assert_input_straggler(reports: list[dict[str, Any]], rank: int) -> None:
    """A live window and the closing summary both name ``rank`` as the input straggler."""
    findings = top_findings(reports)
    assert ("INPUT_STRAGGLER", rank) in findings, findings
    assert reports[-1]["window_kind"] == "summary", [r["window_kind"] for r in reports]
    summary = reports[-1]["step_time"]["findings"][0]
    assert (summary["kind"], summary["culprit_rank"]) == ("INPUT_STRAGGLER", rank), summary


class SlowCollate:
    """Stacks (x, y) pairs; sleeps first when ``delay_s`` is set (a slow input pipeline)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, examples: list[tuple[Any, Any]]) -> tuple[Any, Any]:
        import torch

        if self.delay_s:
            time.sleep(self.delay_s)
        xs, ys = zip(*examples, strict=True)
        return torch.stack(xs), torch.stack(ys)


def pairs_loader(rank: int, samples: int) -> Any:
    """A DataLoader of ``samples`` random (x[32], y[1]) pairs in batches of ``BATCH``, whose
    ``collate_fn`` sleeps ``SLEEP_S`` on ``SLOW_RANK``."""
    import torch

    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(samples, 32, generator=gen), torch.randn(samples, 1, generator=gen)
    collate = SlowCollate(SLEEP_S if rank == SLOW_RANK else 0.0)
    return torch.utils.data.DataLoader(
        list(zip(xs, ys, strict=True)), batch_size=BATCH, collate_fn=collate
    )
