"""``/metrics`` as an attacker or a careless neighbour sees it: the default bind address, basic
auth on every path and method behind TLS, many idle connections, and label values taken from
hostnames and user configuration, round-tripped through real scrapes.

The publisher tests already check the basic 401/200 cases, HTTPS-only serving and a few
hostnames; these extend them to the whole surface.
"""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.publish.prometheus import MetricsServer, start_metrics_server
from tests.publish_reports import rank_infos, step_report, window
from tests.servers import self_signed_cert

# Real TLS servers, floods of connections and scrapes waited out: seconds, not in `make test-fast`.
pytestmark = pytest.mark.slow

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# How long a scrape may go unanswered before it counts as left waiting: half the 10 s after
# which the server drops a silent connection, so a scrape served only once the silent ones
# were dropped fails. A time-out against a hang, not a speed target (those are benchmarks).
WAITED_S = 5.0
USER, PASSWORD = "prometheus", "pä:ss wörd"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1, made for this run."""
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


def published_hub() -> PublisherHub:
    """A hub (no server of its own, no OTLP) holding one 4-rank straggler window."""
    h = PublisherHub(RankwatchConfig(metrics_enabled=False), otlp=False, hostname="trainer-0")
    h.publish(window(0, n=4, step_time=step_report(4, culprit=2)))
    if not h.flush(10):
        raise RuntimeError("the hub did not publish the window")
    return h


@pytest.fixture(scope="module")
def hub() -> Iterator[PublisherHub]:
    h = published_hub()
    yield h
    h.close(2)


def request(
    port: int,
    method: str = "GET",
    path: str = "/metrics",
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    conn: http.client.HTTPConnection
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=context)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


# ---- the default bind address ----------------------------------------------------------------


def test_the_default_bind_address_is_loopback_only(hub: PublisherHub) -> None:
    """Metrics name hosts, ranks and the job: by default only this machine may read them. All
    of 127/8 is loopback on Linux, so a server bound to 0.0.0.0 answers on 127.0.0.2 while one
    bound to 127.0.0.1 refuses it: the test sees the difference without a second interface."""
    assert RankwatchConfig().metrics_addr == "127.0.0.1"
    assert RankwatchConfig.from_env(env={}).metrics_addr == "127.0.0.1"
    default = start_metrics_server(RankwatchConfig(metrics_port=0), 0, hub.state.parts)
    everywhere = start_metrics_server(
        RankwatchConfig(metrics_port=0, metrics_addr="0.0.0.0"), 0, hub.state.parts
    )
    try:
        assert default.url.startswith("http://127.0.0.1:")
        assert request(default.port)[0] == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", default.port), timeout=5).close()
        with socket.create_connection(("127.0.0.2", everywhere.port), timeout=5):
            pass
    finally:
        default.close(2)
        everywhere.close(2)


# ---- basic auth over TLS, on every path and method -------------------------------------------


def guarded_server(cert: str, key: str, hub: PublisherHub) -> tuple[MetricsServer, ssl.SSLContext]:
    """``hub``'s series served behind TLS and basic auth, and a client context trusting it."""
    config = RankwatchConfig(
        metrics_port=0,
        metrics_tls_cert_file=cert,
        metrics_tls_key_file=key,
        metrics_basic_auth_user=USER,
        metrics_basic_auth_password=PASSWORD,
    )
    server = start_metrics_server(config, 0, hub.state.parts)
    return server, ssl.create_default_context(cafile=cert)


@pytest.fixture(scope="module")
def guarded(tls: tuple[str, str], hub: PublisherHub) -> Iterator[tuple[int, ssl.SSLContext]]:
    server, ctx = guarded_server(*tls, hub)
    yield server.port, ctx
    server.close(2)


PATHS = ["/metrics", "/", "/healthz", "/nope", "/metrics?name[]=x", "/../../etc/passwd"]
WRONG: list[dict[str, str]] = [
    {},
    basic(USER, PASSWORD[:-1]),
    basic(USER, PASSWORD + "x"),
    basic(USER, PASSWORD.upper()),
    basic(USER.upper(), PASSWORD),
    basic(USER, ""),
    basic("", PASSWORD),
    basic(f"{USER}:{PASSWORD}", ""),
    {"Authorization": "Basic"},
    {"Authorization": "Basic "},
    {"Authorization": "Basic !!!not-base64!!!"},
    {"Authorization": "Bearer " + PASSWORD},
    {"Authorization": basic(USER, PASSWORD)["Authorization"] + " "},
    {"Authorization": basic(USER, PASSWORD)["Authorization"] + "=="},
    {
        "Authorization": "Basic "
        + base64.b64encode(f"{USER}:{PASSWORD}".encode("latin-1", "replace")).decode()
    },
    {"Authorization": "Basic " + "A" * 60_000},
]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("path", PATHS)
def test_every_path_and_method_needs_the_credentials(
    guarded: tuple[int, ssl.SSLContext], path: str, method: str
) -> None:
    port, ctx = guarded
    refused = 0
    for headers in WRONG:
        status, body = request(port, method, path, headers, ctx)
        assert status == 401, (headers, status)
        # Nothing about the job leaks into a refusal.
        assert b"rankwatch_" not in body and b"trainer" not in body
        refused += 1
    status, body = request(port, method, path, basic(USER, PASSWORD), ctx)
    assert status in (200, 404), status
    if method == "GET" and path.startswith("/metrics"):
        assert b"rankwatch_phase_seconds" in body
    assert refused == len(WRONG)


def test_plain_http_on_the_tls_port_gets_nothing(guarded: tuple[int, ssl.SSLContext]) -> None:
    port, ctx = guarded
    with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
        request(port, headers=basic(USER, PASSWORD))
    # The server is unharmed: the next proper scrape works.
    assert request(port, headers=basic(USER, PASSWORD), context=ctx)[0] == 200


@contextmanager
def idle_and_half_sent(
    port: int, ctx: ssl.SSLContext, idle: int = 100, half: int = 20
) -> Iterator[None]:
    """``idle`` TCP connections that never speak and ``half`` TLS ones stopped halfway through
    a request's headers, open for the ``with`` block."""
    held: list[socket.socket] = []
    try:
        held += [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(idle)]
        for _ in range(half):
            tls = ctx.wrap_socket(
                socket.create_connection(("127.0.0.1", port), timeout=5),
                server_hostname="127.0.0.1",
            )
            held.append(tls)
            tls.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never ends the headers
        yield
    finally:
        for conn in held:
            conn.close()


def test_idle_and_half_open_connections_do_not_starve_scrapes(
    guarded: tuple[int, ssl.SSLContext],
) -> None:
    """100 TCP connections that never speak plus 20 that stop halfway through a request (below
    the server's 128-connection cap): each holds only its own thread, dropped after 10 s of
    silence, and a scrape is still answered. How fast, beside a scrape with none open, is
    measured by ``bench/bench_hostile_inputs.py`` (docs/benchmarks.md)."""
    port, ctx = guarded
    with idle_and_half_sent(port, ctx):
        status, body = request(port, headers=basic(USER, PASSWORD), context=ctx, timeout=WAITED_S)
    assert status == 200 and b"rankwatch_exporter_up" in body


def scrape_outcome(port: int, ctx: ssl.SSLContext) -> str:
    """``answered <status>``, ``closed (<error>)``, or ``left waiting`` when no answer and no
    close came within ``WAITED_S``."""
    try:
        status = request(port, headers=basic(USER, PASSWORD), context=ctx, timeout=WAITED_S)[0]
    except TimeoutError:
        return "left waiting"
    except (OSError, http.client.HTTPException) as exc:
        return f"closed ({type(exc).__name__})"
    return f"answered {status}"


def test_a_connection_flood_never_leaves_a_scrape_hanging(
    guarded: tuple[int, ssl.SSLContext],
) -> None:
    """Past the cap (140 silent connections), a new scrape is answered or closed, never left
    waiting; once the flood goes, scraping works again without waiting for the silent ones to
    be dropped. How fast both happen is measured by ``bench/bench_hostile_inputs.py``."""
    port, ctx = guarded
    flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(140)]
    try:
        time.sleep(0.3)  # let the server take them
        during = scrape_outcome(port, ctx)
    finally:
        for s in flood:
            s.close()
    # The flood's threads end on EOF; a server that freed them only when it dropped silent
    # connections (10 s) would still refuse scrapes when this gives up.
    given_up = time.monotonic() + WAITED_S
    after = [scrape_outcome(port, ctx)]
    while after[-1] != "answered 200" and time.monotonic() < given_up:
        time.sleep(0.05)
        after.append(scrape_outcome(port, ctx))
    print(f"scrape during a 140-connection flood: {during}; after it: {after}")
    assert during != "left waiting"
    assert after[-1] == "answered 200", after


# ---- label values from hostnames and user configuration -------------------------------------

# Any text a hostname, a run id or a group name could hold (valid Unicode: the config loader
# refuses the rest), with the characters the exposition formats must escape weighted in.
label_text = st.one_of(
    st.text(min_size=1, max_size=24).filter(
        lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)
    ),
    st.sampled_from(
        ['a"b', "a\\b", "a\nb", "\\n", 'rack"7\\Node\nA', "ünï-høst", "a}b,c=d", "\t\r"]
    ),
)


def scrape_labels(port: int, accept: str) -> list[dict[str, str]]:
    status, body = request(port, headers={"Accept": accept} if accept else {})
    assert status == 200
    text = body.decode("utf-8")
    parse = parse_openmetrics if accept else parse_text
    return [dict(s.labels) for fam in parse(text) for s in fam.samples]


@pytest.fixture(scope="module")
def label_hub() -> Iterator[PublisherHub]:
    h = PublisherHub(
        RankwatchConfig(metrics_port=0, incident_open_k=1, incident_open_n=1), otlp=False
    )
    yield h
    h.close(2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hosts=st.lists(label_text, min_size=3, max_size=3), run=label_text, group=label_text)
def test_label_values_round_trip_through_real_scrapes(
    label_hub: PublisherHub, hosts: list[str], run: str, group: str
) -> None:
    """Hostnames (lower-cased, as dcgm-exporter writes them), the run id and the group name go
    out as label values; every one comes back intact through both exposition formats."""
    report = window(
        0,
        n=3,
        step_time=step_report(3, culprit=0),
        ranks=rank_infos(3, 8, dict(enumerate(hosts))),
        run=run,
        group=group,
    )
    label_hub.publish(report)
    assert label_hub.flush(10)
    port = label_hub.metrics_server.port if label_hub.metrics_server else 0
    for accept in ("", OPENMETRICS):
        # The hub keeps the latest window of each group: look at this group's series.
        labels = [d for d in scrape_labels(port, accept) if d.get("group") == group]
        phase = [d for d in labels if "phase" in d]
        assert {(d["rank"], d["hostname"]) for d in phase} == {
            (str(r), h.lower()) for r, h in enumerate(hosts)
        }
        incident = [d for d in labels if "hostname" in d and "culprit_rank" in d]
        assert incident and all(d["hostname"] == hosts[0].lower() for d in incident)
        assert {d["run"] for d in phase + incident} == {run}


def test_a_config_value_that_is_not_text_is_refused_before_anything_is_served() -> None:
    """A non-UTF-8 byte in an environment variable reaches Python as a lone surrogate; as a
    label value it would make every scrape fail, so the loader refuses it by name."""
    for name in ("RANKWATCH_RUN_ID", "RANKWATCH_GROUP"):
        with pytest.raises(ValueError, match=name):
            RankwatchConfig.from_env(env={name: "job\udcff7"})
    # A password is named, never shown, whatever is wrong with it.
    for env in (
        {"RANKWATCH_METRICS_BASIC_AUTH_PASSWORD": "hunter2"},
        {
            "RANKWATCH_METRICS_BASIC_AUTH_USER": "u",
            "RANKWATCH_METRICS_BASIC_AUTH_PASSWORD": "hunter2\udcff",
        },
    ):
        with pytest.raises(ValueError, match="RANKWATCH_METRICS_BASIC_AUTH_PASSWORD") as info:
            RankwatchConfig.from_env(env=env)
        assert "hunter2" not in str(info.value)
