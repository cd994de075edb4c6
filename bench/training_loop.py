"""What the training-cost benchmarks measure against: a small training loop, and a scraper.

``Training`` runs the tiny MLP of ``bench_hot_path`` (one torch thread) on the calling thread;
``lost_ms`` measures how much of its time a piece of work on another thread costs it: its step
times while the work runs, less as many steps at the loop's own median just before;
``others_cpu_ms`` the CPU the process's other threads took meanwhile (on one pinned core, the
loop's lost time without its noise; ``bench.baseline``'s driver counts the code before the same
way). ``scraper`` is a ``/metrics`` client in a process of its own.
"""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

BASE_STEPS = 1500


def scraper(conn: Any, url: str) -> None:
    """A scraping client in a process of its own: one GET of ``url`` per request, its wall
    time (ms) in reply; ``False`` ends it."""
    while conn.recv():
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=120) as response:
            response.read()
        conn.send((time.perf_counter() - t0) * 1e3)


class Training:
    """The tiny MLP's training loop on the calling thread."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.batch = (torch.randn(16, 32), torch.randn(16, 1))
        self.loss = torch.nn.functional.mse_loss

    def steps(self, n: int | None = None, until: threading.Event | None = None) -> list[float]:
        clock, times = time.perf_counter, []
        x, y = self.batch
        while True:
            t0 = clock()
            self.loss(self.model(x), y).backward()
            self.opt.step()
            self.opt.zero_grad()
            times.append(clock() - t0)
            if (n is not None and len(times) >= n) or (until is not None and until.is_set()):
                return times

    def lost_ms(self, work: Callable[[], object]) -> tuple[float, float]:
        """(training ms lost while ``work`` runs on another thread, that thread's CPU ms)."""
        bare = statistics.median(self.steps(BASE_STEPS))
        done = threading.Event()
        cpu: list[float] = []

        def run() -> None:
            c0 = time.thread_time()
            work()
            cpu.append(time.thread_time() - c0)
            done.set()

        thread = threading.Thread(target=run)
        thread.start()
        during = self.steps(until=done)
        thread.join()
        return (sum(during) - len(during) * bare) * 1e3, cpu[0] * 1e3

    def others_cpu_ms(self, work: Callable[[], object], pad_seconds: float = 0.05) -> float:
        """CPU ms every thread of this process but this one took while ``work()`` ran on
        another thread (and ``pad_seconds`` after it) and the loop ran here: on a process
        pinned to one core, time the loop could not run."""
        done = threading.Event()

        def run() -> None:
            work()
            time.sleep(pad_seconds)
            done.set()

        p0, m0 = time.process_time(), time.thread_time()
        thread = threading.Thread(target=run)
        thread.start()
        self.steps(until=done)
        thread.join()
        return ((time.process_time() - p0) - (time.thread_time() - m0)) * 1e3
