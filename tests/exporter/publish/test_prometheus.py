"""The pull path: ``/metrics`` over real HTTP(S), and a real Prometheus scraping it."""

from __future__ import annotations

import base64
import gzip
import http.client
import socket
import ssl
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.registry import CollectorRegistry

from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from rankwatch.exporter.publish.prometheus import (
    MetricsServer,
    RankwatchCollector,
    families_from_samples,
    start_metrics_server,
)
from rankwatch.exporter.publish.samples import Sample
from tests.publish_reports import T0, full_report, rank_infos, step_report, window
from tests.servers import free_port, prom_query, prometheus, self_signed_cert, wait_until

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def get(url: str, headers: dict[str, str] | None = None, context=None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def series(text: str, name: str) -> list[dict[str, str]]:
    """Label sets of every sample of ``name`` in a text-format scrape."""
    out = []
    for fam in parse_text(text):
        for s in fam.samples:
            if s.name == name:
                out.append(dict(s.labels))
    return out


@pytest.fixture
def hub():
    h = PublisherHub(
        RankwatchConfig(metrics_port=0, run_id="run-1"),
        otlp=False,
        clock=lambda: T0 + 1000.0,
        hostname="trainer-0",
    )
    yield h
    h.close(5)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1, made by openssl for this test run."""
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


def test_scrape_serves_the_latest_report_in_text_format(hub):
    hub.publish(window(0, n=4, step_time=step_report(4, culprit=2)))
    assert hub.flush(10)
    status, headers, body = get(hub.metrics_url)
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    (info,) = series(text, "rankwatch_diagnosis_info")
    assert info["culprit_rank"] == "2" and info["kind"] == "INPUT_STRAGGLER"
    assert "# TYPE rankwatch_diagnosis_info gauge" in text
    assert "# TYPE rankwatch_incidents_total counter" in text
    assert "rankwatch_incidents_total{" in text and "_created" not in text
    assert "nan" not in text.lower().replace("rankwatch", "")
    ages = [
        s for f in parse_text(text) for s in f.samples if s.name == "rankwatch_window_age_seconds"
    ]
    assert ages[0].value == pytest.approx(1000.0)


def test_openmetrics_negotiation_and_gzip(hub):
    hub.publish(full_report(ep=16))
    assert hub.flush(10)
    status, headers, body = get(hub.metrics_url, {"Accept": OPENMETRICS})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = body.decode()
    assert text.endswith("# EOF\n")
    fams = {f.name: f for f in parse_openmetrics(text)}
    assert fams["rankwatch_incidents"].type == "counter"
    assert fams["rankwatch_diagnosis"].type == "info"
    assert fams["rankwatch_phase_seconds"].unit == "seconds"
    assert fams["rankwatch_deepep_notify_ratio"].unit == "ratio"
    # the same series in both formats
    _, _, plain = get(hub.metrics_url)
    plain_series = {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for f in parse_text(plain.decode())
        for s in f.samples
    }
    om_series = {
        (s.name, tuple(sorted(s.labels.items())), s.value) for f in fams.values() for s in f.samples
    }
    assert plain_series == om_series
    status, headers, zipped = get(hub.metrics_url, {"Accept-Encoding": "gzip"})
    assert headers.get("Content-Encoding") == "gzip"
    assert gzip.decompress(zipped) == plain


def test_hostname_label_values_are_escaped():
    hosts = {0: 'Rack"7\\Node\nA', 1: "GPU-B.example.COM", 2: "ünï-host"}
    report = window(0, n=3, step_time=step_report(3, culprit=0), ranks=rank_infos(3, 8, hosts))
    hub = PublisherHub(
        RankwatchConfig(metrics_port=0, incident_open_k=1, incident_open_n=1),
        otlp=False,
        clock=lambda: T0,
    )
    try:
        hub.publish(report)
        assert hub.flush(10)
        _, _, body = get(hub.metrics_url)
        text = body.decode("utf-8")
        # the raw exposition escapes backslash, quote and newline inside the label value
        assert 'hostname="rack\\"7\\\\node\\na"' in text
        got = {(d["rank"], d["hostname"]) for d in series(text, "rankwatch_phase_seconds")}
        assert got == {("0", 'rack"7\\node\na'), ("1", "gpu-b.example.com"), ("2", "ünï-host")}
        (active,) = series(text, "rankwatch_incident_active")
        assert active["hostname"] == 'rack"7\\node\na'
        _, _, om = get(hub.metrics_url, {"Accept": OPENMETRICS})
        om_hosts = {
            s.labels["hostname"]
            for f in parse_openmetrics(om.decode())
            for s in f.samples
            if s.name == "rankwatch_phase_seconds"
        }
        assert om_hosts == {'rack"7\\node\na', "gpu-b.example.com", "ünï-host"}
    finally:
        hub.close(5)


def test_departed_rank_and_closed_incident_disappear_after_the_next_window():
    hub = PublisherHub(
        RankwatchConfig(metrics_port=0, incident_open_k=1, incident_open_n=1, incident_close_m=1),
        otlp=False,
    )
    try:
        hub.publish(window(0, n=4, step_time=step_report(4, culprit=3)))
        assert hub.flush(10)
        text = get(hub.metrics_url)[2].decode()
        assert {d["rank"] for d in series(text, "rankwatch_phase_seconds")} == {"0", "1", "2", "3"}
        assert [d["culprit_rank"] for d in series(text, "rankwatch_incident_active")] == ["3"]
        assert series(text, "rankwatch_incident_score")
        # rank 3 left the group; the straggler is gone with it
        hub.publish(window(1, n=3, step_time=step_report(3, culprit=None), ranks=rank_infos(3)))
        assert hub.flush(10)
        text = get(hub.metrics_url)[2].decode()
        assert {d["rank"] for d in series(text, "rankwatch_phase_seconds")} == {"0", "1", "2"}
        assert series(text, "rankwatch_incident_active") == []
        assert series(text, "rankwatch_incident_score") == []
        assert 'rank="3"' not in text
    finally:
        hub.close(5)


def test_tls_serves_https_only(hub, tls_files):
    cert, key = tls_files
    server = start_metrics_server(
        RankwatchConfig(metrics_port=0, metrics_tls_cert_file=cert, metrics_tls_key_file=key),
        0,
        hub.state.parts,
    )
    try:
        assert server.url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=cert)
        status, _, body = get(server.url, context=ctx)
        assert status == 200 and b"rankwatch_exporter_up" in body
        # an untrusting client refuses the self-signed certificate
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(server.url, context=ssl.create_default_context())
        # plain HTTP to the TLS port gets no HTTP answer
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            conn.request("GET", "/metrics")
            conn.getresponse().read()
        conn.close()
        # a client that connects and says nothing does not block other scrapes
        with socket.create_connection(("127.0.0.1", server.port)):
            assert get(server.url, context=ctx)[0] == 200
    finally:
        server.close(2)


def test_connections_beyond_the_bound_are_closed_not_queued_forever():
    registry = CollectorRegistry()
    server = MetricsServer(registry, "127.0.0.1", 0, max_connections=4)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        time.sleep(0.3)  # all four now hold a serving thread
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            answer = extra.recv(100)
        except ConnectionResetError:
            answer = b""
        assert answer == b""  # closed without an answer
        extra.close()
        for s in idle:
            s.close()
        wait_until(
            lambda: get(f"http://127.0.0.1:{server.port}/metrics")[0] == 200,
            10,
            what="a slot to free up",
        )
    finally:
        for s in idle:
            s.close()
        server.close(2)


def _basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def test_basic_auth_rejects_missing_and_wrong_credentials(hub, tls_files):
    cert, key = tls_files
    config = RankwatchConfig(
        metrics_port=0,
        metrics_basic_auth_user="prom",
        metrics_basic_auth_password="s3cr:et",
        metrics_tls_cert_file=cert,
        metrics_tls_key_file=key,
    )
    server = start_metrics_server(config, 0, hub.state.parts)
    ctx = ssl.create_default_context(cafile=cert)
    try:
        status, headers, _ = get(server.url, context=ctx)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
        for user, password in (("prom", "wrong"), ("other", "s3cr:et"), ("prom", "")):
            assert get(server.url, _basic(user, password), context=ctx)[0] == 401
        assert get(server.url, {"Authorization": "Bearer s3cr:et"}, context=ctx)[0] == 401
        status, _, body = get(server.url, _basic("prom", "s3cr:et"), context=ctx)
        assert status == 200 and b"rankwatch_exporter_up" in body
    finally:
        server.close(2)


def test_port_is_base_plus_local_rank_and_a_busy_port_is_a_clear_error():
    port = free_port()
    source = PublisherHub(RankwatchConfig(metrics_enabled=False), otlp=False)
    try:
        server = start_metrics_server(RankwatchConfig(metrics_port=port - 2), 2, source.state.parts)
        try:
            assert server.port == port
            assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200
            assert get(f"http://127.0.0.1:{port}/nope")[0] == 404
            with pytest.raises(OSError, match="metrics_port"):
                start_metrics_server(RankwatchConfig(metrics_port=port), 0, source.state.parts)
        finally:
            server.close(2)
    finally:
        source.close(2)


def test_collector_caches_report_families_and_rebuilds_the_rest():
    hub = PublisherHub(RankwatchConfig(metrics_enabled=False), otlp=False)
    try:
        hub.publish(full_report(ep=16))
        assert hub.flush(10)
        registry = CollectorRegistry(auto_describe=False)
        collector = RankwatchCollector(hub.state.parts)
        registry.register(collector)
        first = {m.name: m for m in registry.collect()}
        second = {m.name: m for m in registry.collect()}
        # per-report families are the very same objects; the live ones are rebuilt
        assert (
            first["rankwatch_deepep_completion_cycles_per_sample"]
            is (second["rankwatch_deepep_completion_cycles_per_sample"])
        )
        assert first["rankwatch_exporter_up"] is not second["rankwatch_exporter_up"]
        hub.publish(full_report(index=8, ep=16))
        assert hub.flush(10)
        third = {m.name: m for m in registry.collect()}
        assert third["rankwatch_window_index"].samples[0].value == 8.0
        total = sum(len(m.samples) for m in third.values())
        assert total == len(hub.state.samples())
    finally:
        hub.close(2)


def test_bad_input_is_refused_by_name(tls_files):
    registry = CollectorRegistry()
    with pytest.raises(ValueError, match="port"):
        MetricsServer(registry, "127.0.0.1", 70000)
    with pytest.raises(ValueError, match="port"):
        MetricsServer(registry, "127.0.0.1", True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="addr"):
        MetricsServer(registry, 127, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="certfile/keyfile"):
        MetricsServer(registry, "127.0.0.1", 0, certfile=tls_files[0])
    with pytest.raises(ValueError, match="certfile/keyfile"):
        MetricsServer(registry, "127.0.0.1", 0, certfile=tls_files[1], keyfile=tls_files[1])
    with pytest.raises(ValueError, match="max_connections"):
        MetricsServer(registry, "127.0.0.1", 0, max_connections=0)
    with pytest.raises(ValueError, match="basic_auth"):
        MetricsServer(registry, "127.0.0.1", 0, basic_auth=("a:b", "c"))
    with pytest.raises(TypeError, match="source"):
        RankwatchCollector("samples")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_rank"):
        start_metrics_server(RankwatchConfig(metrics_port=0), -1, lambda: ([], []))
    with pytest.raises(TypeError, match="config"):
        start_metrics_server({"metrics_port": 0}, 0, lambda: ([], []))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="65535"):
        start_metrics_server(RankwatchConfig(metrics_port=65535), 3, lambda: ([], []))
    with pytest.raises(ValueError, match="rankwatch_unknown"):
        families_from_samples([Sample("rankwatch_unknown", ("", ""), 1.0)])


def test_configured_tls_files_that_cannot_be_loaded_are_named_by_variable(tls_files, tmp_path):
    """A TLS file error names both variables and the files; no server starts (serving without
    the TLS that was asked for would be worse than not serving)."""
    missing = str(tmp_path / "missing.pem")
    for cert, key in ((missing, tls_files[1]), (tls_files[1], tls_files[1])):
        cfg = RankwatchConfig(metrics_port=0, metrics_tls_cert_file=cert, metrics_tls_key_file=key)
        with pytest.raises(ValueError) as err:
            start_metrics_server(cfg, 0, lambda: ([], []))
        message = str(err.value)
        assert "(RANKWATCH_METRICS_TLS_CERT_FILE/RANKWATCH_METRICS_TLS_KEY_FILE)" in message
        assert f"cannot load {cert!r} / {key!r}" in message


def test_a_busy_port_names_variables_and_values():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(OSError) as err:
            start_metrics_server(RankwatchConfig(metrics_port=port), 0, lambda: ([], []))
    message = str(err.value)
    assert f"RANKWATCH_METRICS_ADDR='127.0.0.1'/RANKWATCH_METRICS_PORT={port}" in message


PROM_CONFIG = """
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: rankwatch
    static_configs:
      - targets: ["127.0.0.1:{plain}"]
  - job_name: rankwatch-secure
    scheme: https
    tls_config:
      ca_file: {cert}
    basic_auth:
      username: prom
      password: hunter2
    static_configs:
      - targets: ["127.0.0.1:{secure}"]
"""


@pytest.mark.servers
@pytest.mark.parallel_safe
def test_real_prometheus_answers_the_culprit_rank(tls_files):
    cert, key = tls_files
    hosts = {5: 'Node"B'}
    config = RankwatchConfig(metrics_port=0, run_id="job-42", group_name="dp")
    plain = PublisherHub(config, otlp=False)
    secure = PublisherHub(
        RankwatchConfig(
            metrics_port=0,
            run_id="job-42",
            group_name="dp",
            metrics_tls_cert_file=cert,
            metrics_tls_key_file=key,
            metrics_basic_auth_user="prom",
            metrics_basic_auth_password="hunter2",
        ),
        otlp=False,
    )
    try:
        for hub in (plain, secure):
            for i in range(2):  # two agreeing windows open the incident (k=2 of n=3)
                hub.publish(
                    window(
                        i,
                        n=8,
                        step_time=step_report(8, culprit=5),
                        ranks=rank_infos(8, 4, hosts),
                        run="job-42",
                        group="dp",
                        created_at_s=time.time(),
                    )
                )
            assert hub.flush(10)
        assert plain.metrics_server is not None and secure.metrics_server is not None
        yml = PROM_CONFIG.format(
            plain=plain.metrics_server.port, secure=secure.metrics_server.port, cert=cert
        )
        with prometheus(yml) as prom:

            def culprits():
                res = prom_query(prom, "rankwatch_diagnosis_info")
                return len(res) == 2 and res

            res = wait_until(culprits, 30, what="both targets scraped")
            assert {r["metric"]["job"] for r in res} == {"rankwatch", "rankwatch-secure"}
            assert {r["metric"]["culprit_rank"] for r in res} == {"5"}
            assert {(r["metric"]["run"], r["metric"]["group"]) for r in res} == {("job-42", "dp")}
            incidents = prom_query(
                prom,
                "max by (job, culprit_rank, hostname, cause) "
                '(rankwatch_incident_score{class="step_time_straggler"})',
            )
            assert {
                (r["metric"]["culprit_rank"], r["metric"]["hostname"], r["metric"]["cause"])
                for r in incidents
            } == {("5", 'node"b', "input_straggler")}
            assert len(incidents) == 2
            score = prom_query(prom, 'rankwatch_straggler_score{job="rankwatch"}')
            assert float(score[0]["value"][1]) > 0.2
            up = prom_query(prom, "up")
            assert {r["metric"]["job"]: r["value"][1] for r in up} == {
                "rankwatch": "1",
                "rankwatch-secure": "1",
            }
            # the server was scraped in OpenMetrics: the counter keeps its _total name
            totals = prom_query(prom, 'rankwatch_incidents_total{class="step_time_straggler"}')
            assert {r["value"][1] for r in totals if r["metric"]["severity"] == "critical"} == {"1"}
    finally:
        plain.close(5)
        secure.close(5)
