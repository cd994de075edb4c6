"""Real OTLP receivers for tests: HTTP/protobuf and gRPC, metrics and logs, on 127.0.0.1.

VictoriaMetrics takes OTLP metrics but not logs, and no OpenTelemetry Collector can be installed
here, so incident log records (and the gRPC path) are received by these small servers. They are
real network servers: the exporters under test speak OTLP to them over sockets, and every
request body is decoded with the ``opentelemetry-proto`` message classes
(``ExportMetricsServiceRequest`` / ``ExportLogsServiceRequest``), exactly as a collector would.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def any_value(v: AnyValue) -> Any:
    """A protobuf AnyValue as plain Python data."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind)


def attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class Received:
    """Everything a receiver got, decoded."""

    metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = field(
        default_factory=list
    )
    log_requests: list[logs_service_pb2.ExportLogsServiceRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def add_metrics(self, req: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self.changed:
            self.metric_requests.append(req)
            self.changed.notify_all()

    def add_logs(self, req: logs_service_pb2.ExportLogsServiceRequest) -> None:
        with self.changed:
            self.log_requests.append(req)
            self.changed.notify_all()

    def log_records(self) -> list[dict[str, Any]]:
        """Every log record: event name, severity, body, attributes, resource attributes."""
        out = []
        with self.lock:
            for req in self.log_requests:
                for rl in req.resource_logs:
                    res = attrs(rl.resource.attributes)
                    for sl in rl.scope_logs:
                        for rec in sl.log_records:
                            out.append(
                                {
                                    "event_name": rec.event_name,
                                    "severity_number": rec.severity_number,
                                    "severity_text": rec.severity_text,
                                    "body": any_value(rec.body),
                                    "attributes": attrs(rec.attributes),
                                    "resource": res,
                                    "scope": sl.scope.name,
                                    "time_unix_nano": rec.time_unix_nano,
                                }
                            )
        return out

    def metric_points(self, request_index: int = -1) -> dict[str, list[dict[str, Any]]]:
        """One export request's points by metric name: attributes, value, kind, unit."""
        with self.lock:
            req = self.metric_requests[request_index]
        out: dict[str, list[dict[str, Any]]] = {}
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    data = getattr(m, kind)
                    for p in data.data_points:
                        value = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                        out.setdefault(m.name, []).append(
                            {
                                "attributes": attrs(p.attributes),
                                "value": value,
                                "kind": kind,
                                "unit": m.unit,
                                "monotonic": getattr(data, "is_monotonic", None),
                                "resource": attrs(rm.resource.attributes),
                                "scope": sm.scope.name,
                            }
                        )
        return out

    def wait(self, predicate: Any, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self), timeout)


class _Handler(BaseHTTPRequestHandler):
    server: _HttpServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        if self.path == "/v1/metrics":
            req = metrics_service_pb2.ExportMetricsServiceRequest()
            req.ParseFromString(body)
            self.server.received.add_metrics(req)
            reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        elif self.path == "/v1/logs":
            logs_req = logs_service_pb2.ExportLogsServiceRequest()
            logs_req.ParseFromString(body)
            self.server.received.add_logs(logs_req)
            reply = logs_service_pb2.ExportLogsServiceResponse().SerializeToString()
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        return


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received = Received()


class HttpReceiver:
    """OTLP/HTTP receiver at ``endpoint`` (``/v1/metrics`` and ``/v1/logs``)."""

    def __init__(self) -> None:
        self._server = _HttpServer()
        self.received = self._server.received
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HttpReceiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:
        self.received.add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _LogsService(logs_service_pb2_grpc.LogsServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: Any, context: Any) -> Any:
        self.received.add_logs(request)
        return logs_service_pb2.ExportLogsServiceResponse()


class GrpcReceiver:
    """OTLP/gRPC receiver (metrics and logs services) on an insecure 127.0.0.1 port."""

    def __init__(self) -> None:
        self.received = Received()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _MetricsService(self.received), self._server
        )
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(
            _LogsService(self.received), self._server
        )
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> GrpcReceiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
