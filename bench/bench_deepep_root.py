"""What one DeepEP window costs the EP root's training process, at the EP sizes DeepEP runs.

The EP group's root (:class:`~rankwatch.exporter.deepep.root.DeepEPRoot`) turns each gathered
snapshot into a window on a thread of the training process: the window's deltas and checks,
the normal-mode diagnosis, its log lines, and the report to the publishers (the hub's samples
for ``/metrics``, incidents). Measured the way ``bench_aggregator`` measures the step-time
root: this process runs on CPU 0 alone, a training loop (the tiny MLP of ``bench_hot_path``) on
its main thread, and the figure is the CPU time every other thread took while one window went
through (a snapshot submitted, its report published by the hub, a short pad after): time the
loop could not run. The baseline is the diagnosis call alone on the same window, the part no
root can avoid.

Sizes: EP 16, 64 and 160. DeepEP's internode normal mode runs 2 to 20 nodes of 8 GPUs
(``MAX_INTERNODE_EP``; its kernels are compiled for those node counts), so a normal-mode window
of a real group is at most EP 160. EP 1,024 exists only in the engine's simulator: its row is
the engine alone on a simulated window (``bench_normal`` times the same call), measured the
same way.

Usage: ``python -m bench.bench_deepep_root``.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from bench.bench_hot_path import _row
from bench.training_loop import Training

EP_SIZES = (16, 64, 160)
ENGINE_ONLY_EP = 1024
RANKS_PER_NODE = 8
ROUNDS = 5


class _Probe:
    def __init__(self) -> None:
        self.event = threading.Event()

    def publish(self, report: Any) -> None:
        self.event.set()

    def close(self, timeout_seconds: float) -> None:
        pass


def _root(ep: int) -> tuple[Any, Any, _Probe]:
    from rankwatch.diagnosis.report import RankInfo
    from rankwatch.exporter.cli.ports import free_port
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.deepep.root import DeepEPRoot
    from rankwatch.exporter.publish.hub import default_publishers

    config = RankwatchConfig.from_env(
        env={},
        metrics_enabled=True,
        metrics_port=free_port(),
        end_summary=False,
    )
    members = [
        RankInfo(rank=r, hostname=f"node-{r // RANKS_PER_NODE}", local_rank=r % RANKS_PER_NODE)
        for r in range(ep)
    ]
    probe = _Probe()
    publishers = default_publishers(config, 0)
    root = DeepEPRoot(
        members=members,
        ranks_per_node=RANKS_PER_NODE,
        config=config.deepep,
        normal_config=config.diagnosis.normal,
        low_latency_config=config.diagnosis.low_latency,
        normal=True,
        low_latency=False,
        instance_id=uuid.uuid4().hex,
        group_name="ep",
        publishers=[*publishers, probe],
        run="bench",
    )
    return root, publishers, probe


class _Feed:
    """Cumulative counters of a simulated EP group, one snapshot per window, 5 s apart."""

    def __init__(self, ep: int, sim: Any, root: Any, probe: _Probe, hub: Any) -> None:
        from rankwatch.diagnosis.deepep.normal.schema import counter_length

        self.sim, self.root, self.probe, self.hub = sim, root, probe, hub
        self.counters = np.zeros((ep, counter_length(ep)), dtype=np.int64)
        self.taken = time.time()

    def boundary(self) -> Any:
        import torch

        from rankwatch.exporter.deepep.snapshot import PendingSnapshot

        return PendingSnapshot(rows=torch.from_numpy(self.counters.copy()), taken_at_s=self.taken)

    def window(self, phase: str) -> None:
        """One snapshot in; returns once its report is published (hub included)."""
        import torch

        from rankwatch.diagnosis.deepep.normal.window import snapshot_counters
        from rankwatch.exporter.deepep.snapshot import PendingSnapshot

        self.counters += snapshot_counters(self.sim.window(phase))
        self.taken += 5.0
        self.probe.event.clear()
        rows = torch.from_numpy(self.counters.copy())
        self.root.submit(("normal",), PendingSnapshot(rows=rows, taken_at_s=self.taken))
        if not self.probe.event.wait(60):
            raise RuntimeError(f"no DeepEP report within 60 s of snapshot {self.taken}")
        self.hub.flush(60)


def _scrape(url: str) -> None:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as response:
        response.read()


def run(
    ep_sizes: tuple[int, ...] = EP_SIZES,
    engine_ep: int = ENGINE_ONLY_EP,
    rounds: int = ROUNDS,
    pin: bool = True,
) -> list[dict[str, Any]]:
    """Per EP size: training time lost to one window, and the diagnosis call alone (this
    process pinned to CPU 0 when ``pin``)."""

    from rankwatch.diagnosis.deepep.normal import NormalDiagnoser, NormalSimulator

    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    training = Training()
    training.steps(500)  # warm
    rows: list[dict[str, Any]] = []
    for ep in ep_sizes:
        sim = NormalSimulator(ep, RANKS_PER_NODE, seed=0)
        root, publishers, probe = _root(ep)
        root.start(time.time() - 3600.0)  # warm-up long over
        feed = _Feed(ep, sim, root, probe, publishers[0])
        root.submit(("normal",), feed.boundary())  # the first snapshot: no window yet
        for _ in range(3):  # the global history, as a job's first windows build it
            feed.window("baseline")
        lost, alone = [], []
        for _ in range(rounds):
            lost.append(training.others_cpu_ms(lambda f=feed: f.window("single_hca_pressure")))
            diagnoser = NormalDiagnoser(root.normal_config)
            for _ in range(3):
                diagnoser.diagnose(sim.window("baseline"))
            w = sim.window("single_hca_pressure")
            alone.append(training.others_cpu_ms(lambda d=diagnoser, w=w: d.diagnose(w)))
        url = publishers[0].metrics_url
        scrape = [training.others_cpu_ms(lambda u=url: _scrape(u)) for _ in range(rounds)]
        root.stop(10.0)
        for pub in publishers:
            pub.close(5.0)
        rows.append(
            _row(
                f"training time lost to one DeepEP window, EP {ep} (snapshot to report "
                "published; baseline: the diagnosis call alone)",
                50.0,
                lost,
                "ms",
                alone,
            )
        )
        rows.append(
            _row(
                f"training time lost to one /metrics scrape, EP {ep} (baseline: the window)",
                None,
                scrape,
                "ms",
                lost,
            )
        )
    sim = NormalSimulator(engine_ep, RANKS_PER_NODE, seed=0)
    alone = []
    for _ in range(rounds):
        diagnoser = NormalDiagnoser()
        for _ in range(3):
            diagnoser.diagnose(sim.window("baseline"))
        w = sim.window("single_hca_pressure")
        alone.append(training.others_cpu_ms(lambda d=diagnoser, w=w: d.diagnose(w)))
    rows.append(
        _row(
            f"training time lost to the normal-mode diagnosis alone, EP {engine_ep:,} "
            "(simulated: DeepEP runs at most EP 160; baseline: itself)",
            50.0,
            alone,
            "ms",
            alone,
        )
    )
    return rows


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")
