"""The pull path: a ``/metrics`` endpoint serving the catalogue's samples to Prometheus.

:class:`RankwatchCollector` is a prometheus-client custom collector: at every scrape it reads
the latest samples from its source and yields one metric family per catalogue entry (counters
as ``_total``, the diagnosis as an info family, OpenMetrics units for ``_seconds`` and ``_ratio``
families). The families built from a window report are cached until the next report, so a scrape
costs about what prometheus-client's own formatting costs; only the incident, health and age
samples are rebuilt per scrape.

:class:`MetricsServer` serves a registry over HTTP on its own threads: configurable address and
port (one port per local rank under torchrun: base + local_rank), optional TLS and optional basic
auth, content negotiation between the Prometheus text format and OpenMetrics (by the ``Accept``
header, as prometheus-client decides), and gzip when the client accepts it. TLS handshakes run
in the per-connection thread, so a slow or silent client cannot stall the accept loop.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hmac
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from rankwatch.diagnosis.config import option_env
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.catalogue import CATALOGUE, MetricSpec
from rankwatch.exporter.publish.samples import Sample

__all__ = [
    "MetricsServer",
    "RankwatchCollector",
    "SampleParts",
    "TlsFilesError",
    "families_from_samples",
    "start_metrics_server",
]

# (samples that change once per window report, samples rebuilt for every read). The first
# list must be the same object for as long as the report is the same: it is the cache key.
SampleParts = tuple[Sequence[Sample], Sequence[Sample]]


class TlsFilesError(ValueError):
    """The TLS certificate or key of ``/metrics`` cannot be loaded (the message says which)."""


def _family(spec: MetricSpec) -> Metric:
    if spec.type == "counter":
        return Metric(spec.name.removesuffix("_total"), spec.help, "counter")
    if spec.type == "info":
        return Metric(spec.name.removesuffix("_info"), spec.help, "info")
    return Metric(spec.name, spec.help, spec.type, unit=spec.openmetrics_unit)


_SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}


def families_from_samples(samples: Sequence[Sample]) -> dict[str, Metric]:
    """One prometheus-client metric family per catalogue name present in ``samples``."""
    families: dict[str, Metric] = {}
    for s in samples:
        fam = families.get(s.name)
        spec = _SPECS.get(s.name)
        if spec is None:
            raise ValueError(f"samples: {s.name!r} is not a catalogue metric name")
        if fam is None:
            fam = families[s.name] = _family(spec)
        # Counter and info sample names already carry their _total / _info suffix.
        fam.add_sample(s.name, dict(zip(spec.all_labels, s.labels, strict=True)), s.value)
    return families


class RankwatchCollector(Collector):
    """Yields the catalogue's families at scrape time from ``source()``.

    ``source`` returns :data:`SampleParts`. Families of the first (per-report) part are cached
    while it is the same list object; the second part is converted at every scrape.
    """

    def __init__(self, source: Callable[[], SampleParts]) -> None:
        if not callable(source):
            raise TypeError(f"source: expected a callable returning sample parts, got {source!r}")
        self._source = source
        self._lock = threading.Lock()
        # Holding the list itself (not its id) keeps the key from being reused by a new list.
        self._cached_key: Sequence[Sample] | None = None
        self._cached: dict[str, Metric] = {}

    def _report_families(self, part: Sequence[Sample]) -> dict[str, Metric]:
        with self._lock:
            if part is not self._cached_key:
                self._cached = families_from_samples(part)
                self._cached_key = part
            return self._cached

    def collect(self) -> Iterator[Metric]:
        """The families of the latest state, in catalogue order (prometheus-client calls this)."""
        per_report, fresh = self._source()
        cached = self._report_families(per_report)
        live = families_from_samples(fresh)
        for spec in CATALOGUE:
            a, b = cached.get(spec.name), live.get(spec.name)
            if a is not None and b is not None:
                merged = _family(spec)
                merged.samples = a.samples + b.samples
                yield merged
            elif a is not None:
                yield a
            elif b is not None:
                yield b

    def describe(self) -> list[Metric]:
        # Registering must not call collect() (the source may not be ready yet).
        return []


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # Seconds a connection may stay silent before it is dropped (slow or stuck clients).
    timeout = 10.0
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if not self._authorized():
            body = b"unauthorized\n"
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="rankwatch", charset="UTF-8"')
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if path == "/metrics":
            try:
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                output = encoder(self.server.registry)
            except Exception as exc:  # a broken collector must not kill the server thread
                self.send_error(500, f"collecting metrics failed: {exc!r}")
                return
            headers = [("Content-Type", content_type)]
            if gzip_accepted(self.headers.get("Accept-Encoding", "")):
                output = gzip.compress(output, compresslevel=1)
                headers.append(("Content-Encoding", "gzip"))
            self._reply(200, output, headers)
        elif path in ("/", "/healthz"):
            body = b"rankwatch exporter: see /metrics\n"
            self._reply(200, body, [("Content-Type", "text/plain")])
        else:
            self._reply(404, b"not found\n", [("Content-Type", "text/plain")])

    def _reply(self, code: int, body: bytes, headers: list[tuple[str, str]]) -> None:
        self.send_response(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET

    def _authorized(self) -> bool:
        expected = self.server.auth_header
        if expected is None:
            return True
        got = self.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode("utf-8", "replace"), expected)

    def log_message(self, format: str, *args: Any) -> None:
        # Scrapes every few seconds are not news; errors reach the client as status codes.
        return


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # handle_request() is called only once the socket is readable: it must never wait.
    timeout = 0
    # Many scrapers may connect at once (e.g. a fleet of Prometheus replicas).
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        registry: Collector,
        tls: ssl.SSLContext | None,
        auth_header: bytes | None,
        max_connections: int,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.registry = registry
        self.tls = tls
        self.auth_header = auth_header
        # Connections served at once; more are closed at once rather than given a thread each,
        # so a flood of idle connections cannot grow the process without bound.
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the connection's own thread: the TLS handshake happens here, not in accept().
        if self.tls is not None:
            request.settimeout(_Handler.timeout)
            try:
                request = self.tls.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                request.close()
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-response are normal during shutdown; stay quiet.
        return


class MetricsServer:
    """An HTTP(S) server for one registry, serving on a daemon thread until :meth:`close`.

    ``port=0`` picks a free port (read it back from :attr:`port`). ``certfile``/``keyfile``
    enable TLS; ``basic_auth=(user, password)`` makes every request need those credentials.
    At most ``max_connections`` connections are served at once (each on its own thread, closed
    after 10 s of silence); further ones are closed straight away.
    """

    def __init__(
        self,
        registry: Collector,
        addr: str = "127.0.0.1",
        port: int = 9464,
        *,
        certfile: str = "",
        keyfile: str = "",
        basic_auth: tuple[str, str] | None = None,
        max_connections: int = 128,
    ) -> None:
        if not isinstance(addr, str):
            raise TypeError(f"addr: expected a string, got {addr!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port: expected an int in 0..65535, got {port!r}")
        if (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or max_connections < 1
        ):
            raise ValueError(f"max_connections: expected an int >= 1, got {max_connections!r}")
        if bool(certfile) != bool(keyfile):
            raise ValueError(f"certfile/keyfile: set both or neither, got {certfile!r}/{keyfile!r}")
        tls: ssl.SSLContext | None = None
        if certfile:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                tls.load_cert_chain(certfile, keyfile)
            except (OSError, ssl.SSLError) as exc:
                raise TlsFilesError(
                    f"certfile/keyfile: cannot load {certfile!r} / {keyfile!r}: {exc}"
                ) from None
        auth: bytes | None = None
        if basic_auth is not None:
            user, password = basic_auth
            if not user or not password or ":" in user:
                raise ValueError(
                    f"basic_auth: expected (user, password), non-empty, no ':' in the user; "
                    f"got user={user!r}"
                )
            token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
            auth = f"Basic {token}".encode()
        try:
            self._server = _Server((addr, port), registry, tls, auth, max_connections)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {addr}:{port}: {exc.strerror}") from None
        self.scheme = "https" if tls is not None else "http"
        # The accepting thread sleeps until a scrape or close() comes: a server that polled for
        # its shutdown flag (socketserver's serve_forever) woke ten times a second in every
        # rank, each wake taking the interpreter lock from training.
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(
            target=self._serve, name=f"rankwatch-metrics-{self.port}", daemon=True
        )
        self._thread.start()
        self._closed = False

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj == self._wake_r:
                        return
                    self._server.handle_request()  # accept; a thread per connection

    @property
    def port(self) -> int:
        """The port actually listened on."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http(s)://host:port/metrics``."""
        host = str(self._server.server_address[0])
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Stop accepting, close the socket; in-flight scrapes finish on their daemon threads."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_seconds
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._server.server_close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def start_metrics_server(
    config: RankwatchConfig, local_rank: int, source: Callable[[], SampleParts]
) -> MetricsServer:
    """Serve ``source``'s samples as configured: address, port base + ``local_rank``, TLS, auth."""
    if not isinstance(config, RankwatchConfig):
        raise TypeError(f"config: expected RankwatchConfig, got {type(config).__name__}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank: expected an int >= 0, got {local_rank!r}")
    port = config.metrics_port_for(local_rank)
    if port > 65535:
        raise ValueError(
            f"RankwatchConfig.metrics_port (RANKWATCH_METRICS_PORT): base {config.metrics_port} "
            f"+ local_rank {local_rank} = {port} is above 65535"
        )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankwatchCollector(source))
    auth = None
    if config.metrics_basic_auth_user:
        auth = (config.metrics_basic_auth_user, config.metrics_basic_auth_password)
    try:
        return MetricsServer(
            registry,
            config.metrics_addr,
            port,
            certfile=config.metrics_tls_cert_file,
            keyfile=config.metrics_tls_key_file,
            basic_auth=auth,
        )
    except TlsFilesError as exc:
        # Serving /metrics without the TLS that was asked for would be worse than not starting.
        raise ValueError(
            f"RankwatchConfig.metrics_tls_cert_file/metrics_tls_key_file "
            f"({option_env(RankwatchConfig, 'metrics_tls_cert_file')}/"
            f"{option_env(RankwatchConfig, 'metrics_tls_key_file')}): {exc}"
        ) from None
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"RankwatchConfig.metrics_addr/metrics_port "
            f"({option_env(RankwatchConfig, 'metrics_addr')}="
            f"{config.metrics_addr!r}/{option_env(RankwatchConfig, 'metrics_port')}={port}): "
            f"{exc.strerror}",
        ) from None
