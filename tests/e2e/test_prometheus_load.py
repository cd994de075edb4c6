"""50 concurrent scrapers for 10 s against a full EP16 report: every scrape answered, whole."""

from __future__ import annotations

import gzip
import http.client
import threading
import time

import pytest

from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from tests.publish_reports import full_report

pytestmark = pytest.mark.parallel_safe

SCRAPERS = 50
SECONDS = 10.0
ACCEPTS = (
    ("", ""),
    ("application/openmetrics-text; version=1.0.0", ""),
    ("", "gzip"),
)


def test_fifty_concurrent_scrapers_for_ten_seconds():
    hub = PublisherHub(RankwatchConfig(metrics_port=0), otlp=False)
    assert hub.metrics_server is not None
    port = hub.metrics_server.port
    # Two windows before the scrapers start: incidents open at the second (k=2 of n=3), so
    # the set of series is the same for every scrape that follows.
    hub.publish(full_report(index=1, ep=16))
    hub.publish(full_report(index=2, ep=16))
    assert hub.flush(10)
    errors: list[str] = []
    done: list[int] = [0] * SCRAPERS
    sizes: set[int] = set()
    lock = threading.Lock()
    stop = time.monotonic() + SECONDS

    def scraper(i: int) -> None:
        accept, encoding = ACCEPTS[i % len(ACCEPTS)]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {k: v for k, v in (("Accept", accept), ("Accept-Encoding", encoding)) if v}
        while time.monotonic() < stop:
            try:
                conn.request("GET", "/metrics", headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                if resp.status != 200:
                    raise AssertionError(f"status {resp.status}")
                if encoding:
                    body = gzip.decompress(body)
                text = body.decode()
                # a whole exposition, never a torn one
                if "rankwatch_exporter_start_time_seconds" not in text:
                    raise AssertionError("truncated exposition")
                if accept and not text.endswith("# EOF\n"):
                    raise AssertionError("OpenMetrics body without # EOF")
                done[i] += 1
                if not accept and not encoding:
                    with lock:
                        sizes.add(text.count("\n"))
            except Exception as exc:
                with lock:
                    errors.append(f"scraper {i}: {exc!r}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.close()

    threads = [threading.Thread(target=scraper, args=(i,)) for i in range(SCRAPERS)]
    try:
        for t in threads:
            t.start()
        # windows keep arriving while the scrapers run
        i = 3
        while time.monotonic() < stop - 1.0:
            hub.publish(full_report(index=i, ep=16))
            i += 1
            time.sleep(1.0)
        for t in threads:
            t.join(SECONDS + 30)
    finally:
        hub.close(5)
    total = sum(done)
    print(f"{total} scrapes by {SCRAPERS} scrapers in {SECONDS:.0f} s, {len(errors)} errors")
    assert errors == []
    assert all(n > 0 for n in done), done
    assert total >= SCRAPERS * 2
    assert len(sizes) == 1  # every plain scrape had the same number of lines
