"""What one DeepEP window costs the EP root's training process: the root's window work on a
thread of that process (before) and in a child process of it (after), side by side.

The EP group's root turns each gathered snapshot into a window: the window's deltas and checks,
the normal-mode diagnosis, its log lines, and the report to the publishers (the hub's samples
for ``/metrics``, incidents). :class:`~rankwatch.exporter.deepep.root.DeepEPRoot` does all of it
on a thread of the training process; :class:`~rankwatch.exporter.deepep.root_process.
DeepEPRootProcess` sends the snapshot's raw int64 rows to a child process, which does all but
the publishing, and publishes the report the child sends back. Measured the way
``bench_aggregator`` measures the step-time root: this process runs on CPU 0 alone (the child
on CPU 1), a training loop (the tiny MLP of ``bench_hot_path``) on its main thread, and the
figure is the CPU time every other thread of this process took while one window went through
(its snapshot submitted, its report published by the hub, a short pad after): time the loop
could not run. The next snapshot is built before each measurement, so the figure holds the
root's work only. Beside it: the diagnosis call alone on the same window (the part a root in
the training process cannot avoid), the child's own CPU per window (from ``/proc``, in clock
ticks: a mean over the rounds), and one ``/metrics`` scrape (the hub stays in the training
process either way).

Sizes: EP 16, 64 and 160, and EP 1,024 simulated. DeepEP's internode normal mode runs 2 to 20
nodes of 8 GPUs (``MAX_INTERNODE_EP``), so a real normal-mode window is at most EP 160; EP 1,024
exists only in the engine's simulator, fed through both roots the same way.

Usage: ``python -m bench.bench_deepep_root``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from typing import Any

import numpy as np

from bench.bench_hot_path import _row
from bench.training_loop import Training

EP_SIZES = (16, 64, 160, 1024)
MAX_REAL_EP = 160  # DeepEP's internode normal mode: at most 20 nodes of 8
RANKS_PER_NODE = 8
ROUNDS = 3
_TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0


class _Probe:
    def __init__(self) -> None:
        self.event = threading.Event()

    def publish(self, report: Any) -> None:
        self.event.set()

    def close(self, timeout_seconds: float) -> None:
        pass


def _root(ep: int, off_process: bool) -> tuple[Any, Any, _Probe]:
    from rankwatch.diagnosis.report import RankInfo
    from rankwatch.exporter.cli.ports import free_port
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.deepep.root import DeepEPRoot, RootSpec
    from rankwatch.exporter.deepep.root_process import DeepEPRootProcess
    from rankwatch.exporter.publish.hub import default_publishers

    config = RankwatchConfig.from_env(
        env={},
        metrics_enabled=True,
        metrics_port=free_port(),
        end_summary=False,
    )
    spec = RootSpec(
        members=tuple(
            RankInfo(rank=r, hostname=f"node-{r // RANKS_PER_NODE}", local_rank=r % RANKS_PER_NODE)
            for r in range(ep)
        ),
        ranks_per_node=RANKS_PER_NODE,
        config=config.deepep,
        normal_config=config.diagnosis.normal,
        low_latency_config=config.diagnosis.low_latency,
        normal=True,
        low_latency=False,
        instance_id=uuid.uuid4().hex,
        group_name="ep",
        run="bench",
    )
    probe = _Probe()
    publishers = default_publishers(config, 0)
    make = DeepEPRootProcess if off_process else DeepEPRoot.from_spec
    return make(spec, [*publishers, probe]), publishers, probe


class _Feed:
    """Cumulative counters of a simulated EP group, one snapshot per window, 5 s apart."""

    def __init__(self, ep: int, root: Any, probe: _Probe, hub: Any) -> None:
        from rankwatch.diagnosis.deepep.normal import NormalSimulator
        from rankwatch.diagnosis.deepep.normal.schema import counter_length

        self.sim = NormalSimulator(ep, RANKS_PER_NODE, seed=0)
        self.root, self.probe, self.hub = root, probe, hub
        self.counters = np.zeros((ep, counter_length(ep)), dtype=np.int64)
        self.taken = time.time()

    def next(self, phase: str | None) -> Any:
        """The next gathered snapshot (``phase`` None: nothing more counted, a boundary)."""
        import torch

        from rankwatch.diagnosis.deepep.normal.window import snapshot_counters
        from rankwatch.exporter.deepep.snapshot import PendingSnapshot

        if phase is not None:
            self.counters += snapshot_counters(self.sim.window(phase))
            self.taken += 5.0
        rows = torch.from_numpy(self.counters.copy())
        return PendingSnapshot(rows=rows, taken_at_s=self.taken)

    def deliver(self, pending: Any) -> None:
        """One snapshot in; returns once its report is published (hub included)."""
        self.probe.event.clear()
        self.root.submit(("normal",), pending)
        if not self.probe.event.wait(120):
            raise RuntimeError(f"no DeepEP report within 120 s of snapshot {pending.taken_at_s}")
        self.hub.flush(60)


def _process_cpu_ms(pid: int) -> float:
    """User and system CPU of process ``pid`` so far (Linux ``/proc``; clock-tick steps)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_MS


def _scrape(url: str) -> None:
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as response:
        response.read()


def _measure(
    training: Training, ep: int, off_process: bool, rounds: int, pin: bool
) -> dict[str, Any]:
    """One root of ``ep`` ranks: training ms lost per window (and the child's CPU, the scrape
    and the pipe's bytes when ``off_process``)."""
    root, publishers, probe = _root(ep, off_process)
    root.start(time.time() - 3600.0)  # warm-up long over
    out: dict[str, Any] = {"lost": [], "child": [], "scrape": [], "bytes": 0}
    try:
        if off_process:
            deadline = time.monotonic() + 60
            while not root.ready and time.monotonic() < deadline:
                time.sleep(0.01)
            if pin and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(root.pid, {1})
        feed = _Feed(ep, root, probe, publishers[0])
        feed.deliver(feed.next(None))  # the first window, from the all-zero start: empty
        for _ in range(3):  # the global history, as a job's first windows build it
            feed.deliver(feed.next("baseline"))
        child_before = _process_cpu_ms(root.pid) if off_process else 0.0
        for _ in range(rounds):
            pending = feed.next("single_hca_pressure")
            out["lost"].append(training.others_cpu_ms(lambda f=feed, p=pending: f.deliver(p)))
        if off_process:
            out["child"] = [(_process_cpu_ms(root.pid) - child_before) / rounds]
            out["bytes"] = root.snapshot_bytes
            url = publishers[0].metrics_url
            out["scrape"] = [
                training.others_cpu_ms(lambda u=url: _scrape(u)) for _ in range(rounds)
            ]
    finally:
        root.stop(30.0)
        for pub in publishers:
            pub.close(5.0)
    return out


def _diagnosis_alone(training: Training, ep: int, rounds: int, normal_config: Any) -> list[float]:
    from rankwatch.diagnosis.deepep.normal import NormalDiagnoser, NormalSimulator

    sim = NormalSimulator(ep, RANKS_PER_NODE, seed=0)
    alone = []
    for _ in range(rounds):
        diagnoser = NormalDiagnoser(normal_config)
        for _ in range(3):
            diagnoser.diagnose(sim.window("baseline"))
        w = sim.window("single_hca_pressure")
        alone.append(training.others_cpu_ms(lambda d=diagnoser, w=w: d.diagnose(w)))
    return alone


def run(
    ep_sizes: tuple[int, ...] = EP_SIZES, rounds: int = ROUNDS, pin: bool = True
) -> list[dict[str, Any]]:
    """Per EP size: training time lost to one window with the root in a child process and on a
    thread of the training process, the diagnosis call alone, the child's CPU per window and one
    scrape (this process pinned to CPU 0 and the child to CPU 1 when ``pin``)."""
    from rankwatch.exporter.config import RankwatchConfig

    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    normal_config = RankwatchConfig.from_env(env={}).diagnosis.normal
    training = Training()
    training.steps(500)  # warm
    rows: list[dict[str, Any]] = []
    for ep in ep_sizes:
        label = f"EP {ep:,}" + (" (simulated)" if ep > MAX_REAL_EP else "")
        after = _measure(training, ep, True, rounds, pin)
        before = _measure(training, ep, False, rounds, pin)
        alone = _diagnosis_alone(training, ep, rounds, normal_config)
        mib = after["bytes"] / 2**20
        rows.append(
            _row(
                f"training time lost to one DeepEP window, {label}, root in a child process "
                f"({mib:.2f} MiB of raw int64 rows through the pipe; baseline: the root on a "
                "thread of the training process)",
                50.0,
                after["lost"],
                "ms",
                before["lost"],
            )
        )
        rows.append(
            _row(
                f"training time lost to one DeepEP window, {label}, root on a thread of the "
                "training process (before; baseline: the diagnosis call alone)",
                None,
                before["lost"],
                "ms",
                alone,
            )
        )
        rows.append(
            _row(
                f"the root child's own CPU per window, {label} (its process, mean over the "
                "rounds; baseline: the window on a thread of the training process)",
                None,
                after["child"],
                "ms",
                [statistics.median(before["lost"])],
            )
        )
        rows.append(
            _row(
                f"training time lost to one /metrics scrape, {label} (baseline: the window, "
                "root in a child process)",
                None,
                after["scrape"],
                "ms",
                after["lost"],
            )
        )
    return rows


if __name__ == "__main__":
    from bench.run_all import table

    print(table(run()), end="")
