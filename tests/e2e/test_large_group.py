"""The largest real world this machine holds, as a large job runs: 40 Gloo processes in 5 nodes
of 8 (node leaders relay each node), the root publishing 8 ranks' series, every rank serving
its own, and a real Prometheus scraping all 40 targets.

Rank 17's input is slow. What must hold: the run's verdict names rank 17 as an input straggler,
exactly one incident opens (a straggler incident naming it, critical by the run's end) and
nothing else does; the root's reports are bounded (8 ranks' series, the group's size 40);
every follower ships through its node's leader, and the summary misses none of them;
Prometheus holds every rank's phase series (each from its own target) and the group's series
from the root.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.framework_world import run_world
from tests.servers import free_port, prom_query, prometheus

pytestmark = [pytest.mark.servers, pytest.mark.multiproc]

WORLD = 40
PER_NODE = 8
BUDGET = 8
SLOW_RANK = 17
STEPS = 160
SLEEP_S = 0.1


def scenario_large(rank: int, world: int, out: str) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.publish.hub import default_publishers
    from rankwatch.exporter.step_time.rank_watch import RankWatch

    # Five nodes of eight: what a launcher says of a multi-node job.
    os.environ.update(LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE))
    dist.init_process_group("gloo")
    base = int(Path(out, "port").read_text())
    config = RankwatchConfig.from_env(
        interval_seconds=1.0,
        metrics_enabled=True,
        metrics_port=base,
        node_leaders="on",
        root_rank_budget=BUDGET,
    )
    incidents: list[dict[str, Any]] = []
    publishers = default_publishers(
        config,
        rank,
        on_incident=lambda e: incidents.append(
            {
                "action": e.action,
                "cls": e.incident.cls,
                "ranks": list(e.incident.ranks),
                "severity": e.incident.severity,
            }
        ),
    )
    rw = RankWatch(config=config, publishers=publishers, strategy="ddp")
    grad = torch.ones(256)
    for step in range(STEPS):
        with rw.step():
            with rw.phase("input_wait"):
                time.sleep(SLEEP_S if rank == SLOW_RANK else 0.002)
            with rw.phase("forward"):
                time.sleep(0.002)
            with rw.phase("backward"), rw.sync_wait():
                dist.all_reduce(grad)
        if step == STEPS // 2:
            Path(out, f"half.{rank}").write_text("")
    # Every rank waits here until the test has scraped (its series stay served meanwhile).
    deadline = time.monotonic() + 120
    while not Path(out, "scraped").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    collector = rw._collector
    assert collector is not None
    peer = collector.connection.peer
    dist.barrier()
    # Forty processes on a machine of two cores: closing is given the time it takes there.
    rw.close(30.0)
    latest = rw.latest_report
    result: dict[str, Any] = {
        "incidents": incidents,
        "via_leader": peer is not None and peer[1] == -1,
    }
    if latest is not None:
        result["latest"] = latest.to_dict()
    dist.destroy_process_group()
    return result


def test_forty_ranks_in_five_nodes_name_the_straggler_once_and_serve_every_rank(
    tmp_path: Path,
) -> None:
    base = free_port()
    while any(_taken(base + r) for r in range(WORLD)):
        base = free_port()
    Path(tmp_path, "port").write_text(str(base))
    targets = json.dumps([f"127.0.0.1:{base + r}" for r in range(WORLD)])
    config = (
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: rankwatch\n    static_configs: [{{targets: {targets}}}]\n"
    )
    results: dict[int, dict[str, Any]] = {}
    with prometheus(config) as prom:

        def scrape_when_half_done() -> None:
            deadline = time.monotonic() + 200
            while time.monotonic() < deadline:
                if all((tmp_path / f"half.{r}").exists() for r in range(WORLD)):
                    break
                time.sleep(0.2)
            time.sleep(4.0)  # a few scrapes of every target after the first windows
            (tmp_path / "queried").write_text(json.dumps(_query(prom)))
            (tmp_path / "scraped").write_text("")

        thread = threading.Thread(target=scrape_when_half_done)
        thread.start()
        results = run_world(f"{__name__}:scenario_large", WORLD, tmp_path)
        thread.join()
    seen = json.loads((tmp_path / "queried").read_text())
    root = results[0]["latest"]
    st = root["step_time"]
    assert root["window_kind"] == "summary" and root["missing_ranks"] == []
    assert st["kind"] == "INPUT_STRAGGLER" and st["straggler"]["culprit_rank"] == SLOW_RANK, st
    assert st["severity"] == "critical", st["straggler"]
    opened = [e for e in results[0]["incidents"] if e["action"] == "open"]
    assert len(opened) == 1, opened
    assert opened[0]["cls"] == "step_time_straggler" and opened[0]["ranks"] == [SLOW_RANK]
    # Its first windows hold fewer steps than a page needs (min_steps_critical): it may open
    # as a warning, and escalates while open; the run's end closes it critical.
    closed = [e for e in results[0]["incidents"] if e["action"] == "close"]
    assert [(e["cls"], e["ranks"], e["severity"]) for e in closed] == [
        ("step_time_straggler", [SLOW_RANK], "critical")
    ]
    # The root's reports are bounded: 8 ranks' series, the straggler among them.
    assert root["group_size"] == WORLD
    assert len(root["ranks"]) == BUDGET and SLOW_RANK in {r["rank"] for r in root["ranks"]}
    # Every follower shipped through its node's leader.
    followers = [r for r in range(WORLD) if r % PER_NODE]
    assert all(results[r]["via_leader"] for r in followers)
    # Prometheus: every rank's phase series, each served where the rank runs; the root's
    # target holds only its budget of ranks; the group's size from the root.
    assert seen["ranks"] == list(range(WORLD)), seen
    assert seen["root_target_ranks"] <= BUDGET
    assert seen["group_ranks"] == WORLD


def _taken(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _query(prom: Any) -> dict[str, Any]:
    series = prom_query(prom, 'rankwatch_phase_seconds{phase="step"}')
    ranks = sorted({int(s["metric"]["rank"]) for s in series})
    root_instance = next(s["metric"]["instance"] for s in prom_query(prom, "rankwatch_group_ranks"))
    root_ranks = {s["metric"]["rank"] for s in series if s["metric"]["instance"] == root_instance}
    group = prom_query(prom, "max(rankwatch_group_ranks)")
    return {
        "ranks": ranks,
        "root_target_ranks": len(root_ranks),
        "group_ranks": int(float(group[0]["value"][1])) if group else None,
    }
