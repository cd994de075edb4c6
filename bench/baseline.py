"""The code before, measured in the same run: the tree of ``BEFORE`` in a process of its own.

The group's root did all of its work in the training process until the aggregator. To set the
two side by side, the benchmark takes that commit's tree out of git (``git archive``: this
checkout's history), lays it out as the installed package is laid out (``rankwatch`` with
``diagnosis`` and ``exporter`` inside), and runs that tree's own benchmark helpers in a
subprocess whose import path finds it first, pinned to the CPU the new code's training
process runs on. Its figures per group size:

* ``root_lost_ms``: training time lost per 5 s window interval of the root, counted as the
  new code's benchmark counts it (the training loop on the main thread, pinned to one core; the
  CPU every other thread of the process took meanwhile), the work being what the root did per
  window: its intake of every rank's shipment, the block sums, the live window, the report's
  publication, and its doorbell polls for the rest of the interval; ``scrape_lost_ms`` the same
  for one ``/metrics`` scrape;
* ``rank_lost_ms``: a non-root rank's shipment (its rows read and encoded, its doorbells rung;
  Gloo's own send left out, so this figure is a floor), the same way;
* ``scrape_ms``, ``latency_s`` (the shipments drained, the live window, the report published),
  ``window_cpu_ms`` (the window thread's CPU) and ``memory_mib`` (its rows and blocks).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BEFORE = "dd7ee5c"  # the last commit before the aggregator: the root in the training process
ROOT = Path(__file__).resolve().parent.parent

_DRIVER = r"""
import json, multiprocessing as mp, os, sys, time
import numpy as np
os.sched_setaffinity(0, {0})
sizes = json.loads(sys.argv[1])
from bench.bench_root_stall import _Training, _scraper
from bench.bench_scale import _FeedTimer, _Root, _fill, _store
from rankwatch.diagnosis.step_time.artifact import example_window
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.step_time.collector import WindowCollector
from rankwatch.exporter.step_time.messages import FLAG_END_OF_ROUND, message_buffer
from rankwatch.exporter.step_time.transport import GroupLayout
training = _Training()
REPEATS = 3


def _lost(work, interval=0.0, idle=None):
    # What ``work`` on another thread (it is rankwatch's work here: the root's window, a
    # shipment, the scrape's handling), then ``idle`` every 0.1 s until ``interval`` seconds
    # from the start (the root's doorbell polls between windows), took from this process's one
    # core while the training loop ran: every thread's CPU but the training thread's, as the
    # new code's benchmark counts it (there the measuring thread is subtracted too; here it
    # does the work).
    import threading
    done = threading.Event()
    def run():
        end = time.monotonic() + interval
        work()
        while idle is not None and time.monotonic() < end:
            idle()
            time.sleep(0.1)
        time.sleep(0.05)
        done.set()
    p0, m0 = time.process_time(), time.thread_time()
    thread = threading.Thread(target=run)
    thread.start()
    training.steps(until=done)
    thread.join()
    return ((time.process_time() - p0) - (time.thread_time() - m0)) * 1e3


class _Sender:
    # A non-root rank's transport without Gloo's own send: the buffer, the doorbells.
    def __init__(self, store):
        self.store, self.send_buffer, self.failed = store, message_buffer(), False
    def admitted(self):
        return True
    def send(self, message):
        self.store.add("db/1", 1)
        self.store.add("db/any", 1)


def _rank_lost():
    store = _store()
    timer = _FeedTimer()
    config = RankwatchConfig.from_env(env={})
    sender = WindowCollector(GroupLayout((0, 1), 1), timer, config, [], _Sender(store),
                             lambda: "ddp", ("node-0", 1))
    template = example_window(2, 100, slow_rank=None).per_rank[0]
    out = []
    for k in range(REPEATS + 1):
        rows = template.copy()
        rows[:, 0] = np.arange(k * 100, (k + 1) * 100)
        timer.queue.append(rows)
        out.append(_lost(lambda k=k: sender._ship(k + 1, FLAG_END_OF_ROUND)))
    return out[1:]


out = {}
rank_lost = _rank_lost()
for ranks in sizes:
    try:
        root = _Root(ranks, _store())
        _fill(root)
        c = root.collector
        live = c.config.diagnosis.step_time.live_window_steps
        hub = PublisherHub(RankwatchConfig(metrics_port=0), otlp=False)
        hub.publish(c.latest_report)
        hub.flush(300)
        ctx = mp.get_context("spawn")
        client, server_end = ctx.Pipe()
        scraper = ctx.Process(target=_scraper, args=(server_end, hub.metrics_url), daemon=True)
        scraper.start()
        os.sched_setaffinity(scraper.pid, {1})
        lost, scrape_lost, latency, cpu, scrape = [], [], [], [], []
        for _ in range(REPEATS):
            root.ship()

            def window():
                t0, c0 = time.perf_counter(), time.thread_time()
                c._drain()
                c._window("live", live)
                cpu.append((time.thread_time() - c0) * 1e3)
                hub.publish(c.latest_report)
                hub.flush(300)
                latency.append(time.perf_counter() - t0)

            def scrape_once():
                client.send(True)
                scrape.append(client.recv())

            lost.append(_lost(window, 5.0, c._drain))
            scrape_lost.append(_lost(scrape_once))
        client.send(False)
        scraper.join(30)
        hub.close(5)
        out[ranks] = {
            "root_lost_ms": lost,
            "scrape_lost_ms": scrape_lost,
            "rank_lost_ms": rank_lost,
            "scrape_ms": scrape,
            "latency_s": latency,
            "window_cpu_ms": cpu,
            "memory_mib": root.nbytes() / 2**20,
        }
    except MemoryError as exc:
        out[ranks] = {"error": repr(exc)}
    print(json.dumps({ranks: out[ranks]}), file=sys.stderr, flush=True)
print(json.dumps(out))
"""


def _tree(commit: str, into: Path) -> Path:
    """``commit``'s tree laid out for import: ``into/pkg`` (the package) and ``into/src``."""
    src = into / "src"
    src.mkdir()
    archive = into / "tree.tar"
    with open(archive, "wb") as f:
        subprocess.run(
            ["git", "archive", commit, "rankwatch", "diagnosis", "exporter", "bench"],
            cwd=ROOT,
            stdout=f,
            check=True,
        )
    with tarfile.open(archive) as tar:
        tar.extractall(src, filter="data")
    pkg = into / "pkg" / "rankwatch"
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "py.typed"):
        if (src / "rankwatch" / name).exists():
            (pkg / name).write_bytes((src / "rankwatch" / name).read_bytes())
    (pkg / "diagnosis").symlink_to(src / "diagnosis")
    (pkg / "exporter").symlink_to(src / "exporter")
    # Only the laid-out package may be found as ``rankwatch``: one found elsewhere first would
    # leave its subpackages to this checkout's editable install.
    shutil.rmtree(src / "rankwatch")
    return src


@contextlib.contextmanager
def before_env(commit: str = BEFORE) -> Iterator[dict[str, str] | None]:
    """An environment whose Python imports ``commit``'s rankwatch (None, said on stderr, when
    this checkout does not hold it); the tree is removed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            src = _tree(commit, Path(tmp))
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"the code before ({commit}) is not in this checkout: {exc}", file=sys.stderr)
            yield None
            return
        yield dict(os.environ, PYTHONPATH=f"{Path(tmp) / 'pkg'}{os.pathsep}{src}")


def before_figures(sizes: tuple[int, ...], commit: str = BEFORE) -> dict[int, dict[str, Any]]:
    """The code before's figures per size, each size in a process of its own (its memory
    given back before the next); a size it could not run is left out, said on stderr."""
    out: dict[int, dict[str, Any]] = {}
    with before_env(commit) as env:
        if env is None:
            return out
        for size in sizes:
            done = subprocess.run(
                [sys.executable, "-c", _DRIVER, json.dumps([size])],
                cwd=env["PYTHONPATH"].split(os.pathsep)[1],
                env=env,
                capture_output=True,
                text=True,
                timeout=3 * 3600,
            )
            if done.returncode != 0:
                print(
                    f"the code before did not run at {size} ranks (exit {done.returncode}):\n"
                    f"{done.stderr[-2000:]}",
                    file=sys.stderr,
                )
                continue
            for k, v in json.loads(done.stdout.splitlines()[-1]).items():
                if "error" not in v:
                    out[int(k)] = v
    return out
