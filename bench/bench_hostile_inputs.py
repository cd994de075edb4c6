"""What hostile inputs cost: damaged and oversized DeepEP window artifacts, a ``/metrics``
scrape with idle and half-sent connections open or after a connection flood, and ``publish()``
while the OTLP endpoint is unreachable.

The tests check the behaviour (every damaged file is refused or read back unchanged, memory
stays bounded, the scrape is answered); the figures are measured here, each beside a baseline
from the same rounds:

- **Damaged artifacts**: the fuzz test's 800 seeded damaged copies of a valid EP-4 artifact,
  loaded (each refused or read back); baseline: the intact artifact, loaded in the same rounds,
  one intact load after each damaged one. Rate = files / summed load time per round.
- **Oversized headers**: an artifact whose member header declares a size far beyond what the
  EP size allows (the fuzz test's 12 cases, up to 800 GB declared) is refused from the header;
  ms per refusal, baseline the intact load measured after each refusal.
- **Bad DeepEP readings**: 1,000 cumulative counter readings of a simulated EP-16 group fed to
  the root's window builder (and the good windows to the diagnoser), every other one bad (NaN,
  wrapped counter, stale, wrong shape), as in the fault test; readings/s, baseline: 1,000 good
  readings, in the same rounds.
- **Scrape with idle and half-sent connections**: a TLS + basic-auth scrape (a new connection
  per scrape, as Prometheus does after an idle spell) with 100 silent TCP connections and 20 TLS
  ones stopped halfway through a request open; baseline: the same scrape with none open,
  in the same rounds (the order of the two blocks alternates between rounds).
- **An unreachable OTLP endpoint**: ``publish()`` per call (EP-16 reports, 200 calls per block)
  while the endpoint refuses connections or accepts and never answers; baseline: a hub without
  OTLP, in alternating blocks. And the slowest call of each block.
- **Connection flood**: 140 silent connections (past the server's cap of 128): how long a new
  scrape takes to be closed (or answered), and how long after the flood closes a scrape is
  answered again; baseline: the plain scrape.

``median`` is the median over all rounds' figures, ``spread`` the max - min of the round medians.
Run: ``python -m bench.bench_hostile_inputs``.
"""

from __future__ import annotations

import ast
import contextlib
import os
import socket
import ssl
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.run_all import row
from rankwatch.diagnosis.deepep.artifact import ArtifactError, load_window_artifact
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from tests.diagnosis.deepep.test_fuzz_artifacts import (
    OVERSIZED,
    damaged_copies,
    good_artifact,
    members,
    write_zip,
)
from tests.e2e.test_faults_deepep_windows import Feeder, feed_readings
from tests.exporter.publish.test_publish_failures import black_hole_port, publish_timed
from tests.exporter.publish.test_security_metrics import (
    PASSWORD,
    USER,
    basic,
    guarded_server,
    idle_and_half_sent,
    published_hub,
    request,
    scrape_outcome,
)
from tests.servers import free_port, self_signed_cert

ROUNDS = 5
DAMAGED = 800  # as many as the fuzz test, split over the rounds
REFUSALS = 4  # loads of each oversized case per round
SCRAPES = 10  # per block
FLOOD = 140
READINGS = 1000  # DeepEP counter readings per round, as in the fault test
PUBLISHES = 200  # publish() calls per block, as in the failure test


def _load_seconds(path: Path) -> float:
    t0 = time.perf_counter()
    with contextlib.suppress(ArtifactError):  # refused or read back: both are timed
        load_window_artifact(path)
    return time.perf_counter() - t0


def artifacts(folder: Path) -> list[dict[str, Any]]:
    """The damaged-file load rate and the per-file cost of an oversized-header refusal."""
    intact, _ = good_artifact(folder)
    data = intact.read_bytes()
    bad = folder / "damaged.npz"
    copies = list(damaged_copies(data, DAMAGED))
    per_round = DAMAGED // ROUNDS
    rates: list[list[float]] = []
    base_rates: list[list[float]] = []
    for i in range(ROUNDS):
        took = base = 0.0
        for damaged in copies[i * per_round : (i + 1) * per_round]:
            bad.write_bytes(damaged)
            took += _load_seconds(bad)
            base += _load_seconds(intact)
        rates.append([per_round / took])
        base_rates.append([per_round / base])
    parts = members(intact)
    oversized = [
        write_zip(folder / f"oversized-{n}.npz", {**parts, key + ".npy": member})
        for n, (key, member) in enumerate(OVERSIZED)
    ]
    refusals: list[list[float]] = []
    base_loads: list[list[float]] = []
    by_case: list[list[list[float]]] = [[] for _ in oversized]  # case -> rounds -> ms
    for _ in range(ROUNDS):
        got, base_got = [], []
        for n, path in enumerate(oversized):
            mine = [_load_seconds(path) * 1e3 for _ in range(REFUSALS)]
            base_got += [_load_seconds(intact) * 1e3 for _ in range(REFUSALS)]
            by_case[n].append(mine)
            got += mine
        refusals.append(got)
        base_loads.append(base_got)
    worst = max(
        range(len(oversized)), key=lambda n: statistics.median(x for r in by_case[n] for x in r)
    )
    key, member = OVERSIZED[worst]
    header = ast.literal_eval(member[10 : member.index(b"}") + 1].decode("latin-1"))
    declared = f"{header['descr']} {header['shape']}"
    return [
        row(
            f"damaged EP-4 window artifacts loaded ({DAMAGED} seeded copies; "
            "baseline: the intact one)",
            "files/s",
            rates,
            base_rates,
            target=DAMAGED / 60,  # the fuzz test's former bound: 800 files within 60 s
        ),
        row(
            f"oversized member header refused ({len(OVERSIZED)} cases; "
            "baseline: loading the intact artifact)",
            "ms",
            refusals,
            base_loads,
            target=1000.0,  # the fuzz test's former bound: 1 s per file
        ),
        row(
            f"slowest oversized case: {key!r} declaring {declared}",
            "ms",
            by_case[worst],
            base_loads,
        ),
    ]


def _timed(call: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def _settle(port: int, ctx: ssl.SSLContext) -> None:
    """Wait until the server has let go of the connections just closed (a scrape is answered)."""
    given_up = time.monotonic() + 30
    while scrape_outcome(port, ctx) != "answered 200":
        if time.monotonic() > given_up:
            raise RuntimeError("the server did not recover after the connections closed")
        time.sleep(0.05)


def scrapes(folder: Path) -> list[dict[str, Any]]:
    """Scrape latency with idle and half-sent connections open, beside none open; a flood."""
    cert, key = self_signed_cert(folder)
    hub = published_hub()
    server, ctx = guarded_server(cert, key, hub)
    port, auth = server.port, basic(USER, PASSWORD)

    def scrape() -> None:
        status, _ = request(port, headers=auth, context=ctx)
        if status != 200:
            raise RuntimeError(f"scrape failed: {status}")

    try:
        scrape()  # warm up
        loaded: list[list[float]] = []
        quiet: list[list[float]] = []
        flood_during: list[list[float]] = []
        flood_after: list[list[float]] = []
        for i in range(ROUNDS):
            if i % 2 == 0:  # alternate which block comes first
                plain = [_timed(scrape) for _ in range(SCRAPES)]
            with idle_and_half_sent(port, ctx):
                busy = [_timed(scrape) for _ in range(SCRAPES)]
            _settle(port, ctx)
            if i % 2 == 1:
                plain = [_timed(scrape) for _ in range(SCRAPES)]
            loaded.append(busy)
            quiet.append(plain)
            flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(FLOOD)]
            try:
                time.sleep(0.3)  # let the server take them
                flood_during.append([_timed(lambda: scrape_outcome(port, ctx))])
            finally:
                for s in flood:
                    s.close()
            t0 = time.perf_counter()
            _settle(port, ctx)
            flood_after.append([(time.perf_counter() - t0) * 1e3])
        return [
            row(
                "scrape (TLS, basic auth, new connection) with 100 idle and 20 half-sent "
                "connections open (baseline: none open)",
                "ms",
                loaded,
                quiet,
                target=2000.0,  # the security test's former bound
            ),
            row(
                f"scrape during a {FLOOD}-connection flood, closed or answered "
                "(baseline: plain scrape)",
                "ms",
                flood_during,
                quiet,
                target=1000.0,
            ),
            row(
                "first scrape answered after the flood closed (baseline: plain scrape)",
                "ms",
                flood_after,
                quiet,
                target=1000.0,
            ),
        ]
    finally:
        server.close(2)
        hub.close(2)


def publishing() -> list[dict[str, Any]]:
    """``publish()`` per call while the OTLP endpoint refuses or black-holes connections,
    beside a hub without OTLP, in alternating blocks of the same calls."""
    rows = []
    names = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TIMEOUT")
    saved = {name: os.environ.get(name) for name in names}
    with black_hole_port() as hole:
        for kind, port in (("refusing connections", free_port()), ("black-holing them", hole)):
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
            os.environ["OTEL_EXPORTER_OTLP_TIMEOUT"] = "1"  # seconds, as in the test
            failing = PublisherHub(
                RankwatchConfig(metrics_port=0, otlp_export_interval_seconds=0.2),
            )
            quiet = PublisherHub(RankwatchConfig(metrics_port=0), otlp=False)
            try:
                mine, base = [], []
                for _ in range(ROUNDS):
                    mine.append([t * 1e6 for t in publish_timed(failing, PUBLISHES)])
                    base.append([t * 1e6 for t in publish_timed(quiet, PUBLISHES)])
            finally:
                failing.close(2)
                quiet.close(2)
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            rows.append(
                row(
                    f"publish() per call, EP-16 reports, OTLP endpoint {kind} (baseline: OTLP off)",
                    "us",
                    mine,
                    base,
                    target=200.0,  # the failure test's former bound (median)
                )
            )
            worst = [[max(r) / 1e3] for r in mine]
            rows.append(
                row(
                    f"slowest publish() of {PUBLISHES} per round, endpoint {kind} "
                    "(baseline: OTLP off)",
                    "ms",
                    worst,
                    [[max(r) / 1e3] for r in base],
                    target=50.0,  # the failure test's former bound (worst call)
                )
            )
    return rows


def readings() -> list[dict[str, Any]]:
    """DeepEP counter readings through the root's window builder and the diagnoser, every
    other one bad, beside the same number of good readings, in alternating rounds."""
    rates: list[list[float]] = []
    base: list[list[float]] = []
    for _ in range(ROUNDS):
        for bad, into in ((True, rates), (False, base)):
            feeder = Feeder(seed=11)
            t0 = time.perf_counter()
            feed_readings(feeder, READINGS, bad=bad)
            into.append([READINGS / (time.perf_counter() - t0)])
    return [
        row(
            f"DeepEP EP-16 counter readings, every other one bad ({READINGS // 2} rejected, "
            f"{READINGS // 2} diagnosed; baseline: all {READINGS} good)",
            "readings/s",
            rates,
            base,
            target=READINGS / 60,  # the fault test's former bound: 1,000 readings within 60 s
        )
    ]


def run() -> list[dict[str, Any]]:
    """The artifact rows, the scrape rows, and the machine's load average at start and end."""
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = artifacts(folder) + readings() + scrapes(folder) + publishing()
    rows.append(
        {
            "name": "machine load average, start of the run / end",
            "median": load_start,
            "unit": "processes",
            "baseline": os.getloadavg()[0],
        }
    )
    return rows


if __name__ == "__main__":
    for result in run():
        print(result)
