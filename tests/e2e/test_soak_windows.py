"""10,000 windows through the normal-mode diagnoser and the exporter: memory and series stay flat.

Each window is diagnosed by a real ``NormalDiagnoser`` (seeded simulator counters, EP 8, phases
cycling through a healthy baseline, a slow HCA, a late rank and a global slowdown, so incidents
keep opening and closing), joined with a step-time report whose culprit moves from rank to rank,
and handed to a real ``PublisherHub``; every 10th window the ``/metrics`` collector renders the
exposition a scrape would get, and every 50th window is saved to a bounded artifact store.

Measured at 1,000 and at 10,000 windows: resident memory (``/proc/self/statm``), the number of
series in the exposition, every series ever seen, the history, the incident tracker and the
artifact folder. After the first 1,000 windows nothing may grow: no new series, no more memory
than allocator noise.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rankwatch.diagnosis.deepep.artifact import ArtifactStore
from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time import diagnose_means
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.publish.prometheus import RankwatchCollector

pytestmark = pytest.mark.parallel_safe

EP, RPN = 8, 4
WINDOWS = 10_000
CHECKPOINT = 1_000
SCRAPE_EVERY = 10
SAVE_EVERY = 50
RETENTION = 20
# Growth allowed between 1,000 and 10,000 windows: allocator noise, not a leak. A leak of one
# report per window (~20 KiB at EP 8) would be ~180 MiB here.
RSS_GROWTH_BYTES = 8 * 2**20
PHASES = (
    ["baseline"] * 5
    + ["single_hca_pressure"] * 4
    + ["baseline"] * 5
    + ["pre_dispatch_delay"] * 4
    + ["baseline"] * 5
    + ["all_hca_pressure"] * 4
)
BALANCED = {"input_wait": 5.0, "h2d": 1.0, "forward": 30.0, "backward": 60.0, "optimizer": 5.0}


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step_reports() -> list:
    """One DDP window per culprit rank: its input wait makes it the straggler."""
    out = []
    for culprit in range(EP):
        means = {}
        for r in range(EP):
            m = dict(BALANCED, step=101.0)
            if r == culprit:
                m.update(input_wait=45.0, backward=20.0, step=76.0)
            means[r] = m
        out.append(diagnose_means(means, steps=50, strategy="ddp"))
    return out


def series(text: str) -> set[str]:
    """Every series of a text exposition: the sample line without its value (name + labels)."""
    return {
        line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")
    }


def test_ten_thousand_windows_keep_memory_and_series_flat(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.ERROR)  # a few thousand incident lines are not the point here
    sim = NormalSimulator(EP, RPN, seed=2, slow_rank=5)
    pool = [sim.window(p, i) for i, p in enumerate(PHASES * 2)]
    steps = step_reports()
    ranks = tuple(RankInfo(r, f"node-{r // RPN}", r % RPN) for r in range(EP))
    config = RankwatchConfig(cell_budget=16, run_id="soak")
    hub = PublisherHub(config, metrics=False, otlp=False, hostname="node-0")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankwatchCollector(hub.state.parts))
    store = ArtifactStore(tmp_path / "artifacts", retention=RETENTION)
    diagnoser = NormalDiagnoser()

    seen_early: set = set()
    seen_late: set = set()
    counts: list[int] = []
    marks: dict[int, dict[str, float]] = {}
    t0 = time.perf_counter()
    try:
        for i in range(WINDOWS):
            window = pool[i % len(pool)]
            normal = diagnoser.diagnose(window)
            report = WindowReport(
                group="soak",
                window_index=i,
                created_at_s=1.7e9 + 5.0 * i,
                ranks=ranks,
                run="soak",
                step_time=steps[(i // 7) % EP],
                normal=normal,
                diagnosis_seconds={"normal": 0.002},
            )
            hub.publish(report)
            if i % SAVE_EVERY == 0:
                store.save(window, normal)
            if i % SCRAPE_EVERY == 0:
                assert hub.flush(10)
                found = series(generate_latest(registry).decode())
                counts.append(len(found))
                (seen_early if i < CHECKPOINT else seen_late).update(found)
            if i + 1 in (CHECKPOINT, WINDOWS):
                assert hub.flush(10)
                # The exposition is still valid Prometheus text after all these windows.
                text = generate_latest(registry).decode()
                parsed = sum(len(f.samples) for f in text_string_to_metric_families(text))
                assert parsed == len(series(text))
                gc.collect()
                marks[i + 1] = {
                    "rss": rss_bytes(),
                    "seconds": time.perf_counter() - t0,
                    "tracked": sum(t.tracked for t in hub.trackers.values()),
                }
    finally:
        hub.close(2)

    early, late = marks[CHECKPOINT], marks[WINDOWS]
    growth = late["rss"] - early["rss"]
    history = max(len(diagnoser.history.values(p)) for p in normal.probes)
    files = len(store.paths())
    print(
        f"{WINDOWS} windows in {late['seconds']:.1f} s "
        f"({late['seconds'] / WINDOWS * 1e3:.2f} ms each); "
        f"RSS {early['rss'] / 2**20:.1f} MiB at {CHECKPOINT}, {late['rss'] / 2**20:.1f} MiB at "
        f"{WINDOWS} (growth {growth / 2**20:+.2f} MiB); series per scrape "
        f"{min(counts)}..{max(counts)}; distinct series {len(seen_early)} in the first "
        f"{CHECKPOINT}, {len(seen_late - seen_early)} new after; history {history}; "
        f"tracked incidents {early['tracked']}/{late['tracked']}; artifact files {files}"
    )
    assert growth < RSS_GROWTH_BYTES, growth
    # Every series of windows 1,001..10,000 already existed in the first 1,000.
    assert seen_late - seen_early == set()
    assert max(counts) <= len(seen_early)
    assert history <= 16
    assert late["tracked"] <= max(early["tracked"], 1) * 2
    assert files == RETENTION


def test_a_new_group_name_every_window_keeps_the_series_bounded(caplog) -> None:
    """A job that names its group differently every window (a misconfigured run id, a group
    per step): 1,000 windows, yet the exposition holds at most MAX_GROUPS groups' series."""
    from rankwatch.exporter.publish.hub import MAX_GROUPS

    caplog.set_level(logging.ERROR)
    steps = step_reports()
    ranks = tuple(RankInfo(r, f"node-{r // RPN}", r % RPN) for r in range(EP))
    hub = PublisherHub(RankwatchConfig(run_id="soak"), metrics=False, otlp=False)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankwatchCollector(hub.state.parts))
    per_group = 0
    counts = []
    try:
        for i in range(1000):
            hub.publish(
                WindowReport(
                    group=f"group-{i}",
                    window_index=i,
                    created_at_s=1.7e9 + i,
                    ranks=ranks,
                    run="soak",
                    step_time=steps[i % EP],
                )
            )
            if i == 0 or i % 100 == 99:
                assert hub.flush(10)
                found = series(generate_latest(registry).decode())
                groups = {
                    s.split('group="', 1)[1].split('"', 1)[0] for s in found if 'group="' in s
                }
                if i == 0:
                    per_group = len(found)
                counts.append((len(groups), len(found)))
    finally:
        hub.close(2)
    print(f"groups and series after 1, 100, ..., 1,000 windows: {counts} (bound {MAX_GROUPS})")
    assert max(g for g, _ in counts) <= MAX_GROUPS + 1  # + the exporter's own group
    assert max(n for _, n in counts) <= per_group * (MAX_GROUPS + 1)
    assert counts[-1] == counts[-2]  # flat once the bound is reached
