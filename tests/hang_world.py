"""Worlds that hang on purpose, for the hang watcher's tests.

Each rank is a process of its own with torchrun's environment (as in :mod:`tests.framework_world`).
A scenario hangs its training; the root's ``on_incident`` callback (the publishing thread)
reads ``/metrics`` and writes ``root.json`` once the hang incident it waits for has opened (and,
for a scenario that moves on, closed). The parent waits for that file (bounded) and then kills
every rank, whatever happened: a hung world never outlives its test.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.framework_world import _entry, _stderr_tails
from tests.rank_processes import rank_process
from tests.servers import free_port

__all__ = ["HangRoot", "run_hang_world"]


def run_hang_world(
    scenario: str,
    world: int,
    out_dir: Path,
    wait_s: float,
    *,
    during: Callable[[list[Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``scenario`` on ``world`` ranks until the root wrote ``root.json`` (at most
    ``wait_s``), then kill every rank; the root's result. ``during(procs)`` runs in the parent
    once every rank is up (to signal one)."""
    port = free_port()
    procs = [rank_process(_entry, (r, world, port, scenario, str(out_dir))) for r in range(world)]
    result = out_dir / "root.json"
    try:
        for p in procs:
            p.start()
        if during is not None:
            during(procs)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not result.exists():
            if all(not p.is_alive() for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
    assert result.exists(), (
        f"the root wrote no result in {wait_s} s"
        + _hang_files(out_dir)
        + _stderr_tails(out_dir, world)
    )
    out: dict[str, Any] = json.loads(result.read_text())
    out["exitcodes"] = [p.exitcode for p in procs]
    return out


def _hang_files(out_dir: Path) -> str:
    """The hang record files the ranks left (what each saw last), for a failure's message."""
    parts = []
    for f in sorted(out_dir.glob("**/hang-rank*.json")):
        parts.append(f"\n--- {f.name} ---\n{f.read_text()[:4000]}")
    return "".join(parts)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


class HangRoot:
    """The root's side of a hang scenario: collects incident events and log lines, and once
    ``done(events)`` holds writes ``root.json`` (with a ``/metrics`` scrape) and ends the
    process. Other ranks' instances do nothing."""

    def __init__(self, rank: int, out: str, done: Callable[[list[dict[str, Any]]], bool]) -> None:
        self.rank, self.out, self.done = rank, out, done
        self.events: list[dict[str, Any]] = []
        self.lines = _Lines()
        self.port = free_port() if rank == 0 else 0
        self.started = time.monotonic()
        self.hang_at: float | None = None
        logging.getLogger("rankwatch").addHandler(self.lines)
        logging.getLogger("rankwatch").setLevel(logging.INFO)
        self._written = threading.Event()

    def on_incident(self, event: Any) -> None:
        inc = event.incident
        self.events.append(
            {
                "action": event.action,
                "cls": inc.cls,
                "severity": inc.severity,
                "cause": inc.cause,
                "ranks": list(inc.ranks),
                "probe": inc.probe,
                "evidence": dict(inc.evidence),
                "reason": event.reason,
                "at": time.monotonic(),
            }
        )
        if self.rank == 0 and not self._written.is_set() and self.done(self.events):
            self._written.set()
            self.finish()

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        # Every rank writes its hang record file within a poll of shipping its record, and
        # the root may open on the record it read first: give the files that poll.
        time.sleep(1.0)
        metrics = ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                metrics = r.read().decode()
        except OSError as exc:
            metrics = f"scrape failed: {exc}"
        body = {
            "events": self.events,
            "lines": self.lines.lines,
            "metrics": metrics,
            "hang_at": self.hang_at,
            **(extra or {}),
        }
        Path(self.out, "root.json.tmp").write_text(json.dumps(body, default=str))
        os.replace(Path(self.out, "root.json.tmp"), Path(self.out, "root.json"))
        os.kill(os.getpid(), signal.SIGKILL)  # the training thread may be stuck: end now
