"""Start the real backends (Prometheus, Alertmanager, VictoriaMetrics) for tests.

The binaries come from ``deploy/install-backends.sh`` (``make backends``), found through
``RANKWATCH_BACKENDS_BIN``, the repository's ``.cache/backends/bin``, or ``PATH``. A test that
needs one calls :func:`require_binary`: it skips on a developer machine without it, and fails
in CI (``CI=true``), where a missing server is a broken set-up, not a reason to skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from rankwatch.exporter.cli.ports import free_port

REPO = Path(__file__).resolve().parent.parent


def find_binary(name: str) -> str | None:
    """Path of a backend binary, or None."""
    candidates = []
    if os.environ.get("RANKWATCH_BACKENDS_BIN"):
        candidates.append(Path(os.environ["RANKWATCH_BACKENDS_BIN"]) / name)
    candidates.append(REPO / ".cache" / "backends" / "bin" / name)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which(name)


def missing_in_ci(reason: str, *, pytrace: bool = True) -> NoReturn:
    """Something a test needs is not on this machine: in CI (``CI=true``) the test fails, since
    CI installs everything; elsewhere it is skipped, saying what is missing."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason, pytrace=pytrace)
    pytest.skip(reason, allow_module_level=True)


def require_binary(name: str) -> str:
    """The binary's path; in CI a missing binary fails the test, elsewhere it skips."""
    path = find_binary(name)
    if path is None:
        missing_in_ci(f"{name} not installed: run `make backends` (deploy/install-backends.sh)")
    return path


def self_signed_cert(directory: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 made by openssl: (cert path, key path)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def http_post(
    url: str, data: bytes, headers: dict[str, str] | None = None, timeout: float = 5.0
) -> bytes:
    req = urllib.request.Request(url, data=data, headers=headers or {}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


def wait_until(
    predicate: Any, timeout: float, interval: float = 0.2, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the server may still be starting
            last_exc = exc
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


@dataclass
class Server:
    """A running backend process on 127.0.0.1."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    workdir: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def _start(
    name: str, argv: list[str], port: int, workdir: Path, ready_path: str, timeout: float = 30.0
) -> Server:
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    server = Server(name, port, proc, workdir, log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}:\n{server.log()}")
        try:
            http_get(server.url + ready_path, timeout=1.0)
            return True
        except urllib.error.HTTPError as exc:  # a server behind basic auth answers 401: it is up
            return exc.code == 401
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    wait_until(ready, timeout, what=f"{name} on port {port}")
    return server


@contextlib.contextmanager
def prometheus(
    config_yaml: str, extra_files: dict[str, str] | None = None, extra_args: list[str] | None = None
) -> Iterator[Server]:
    """A real Prometheus with the given prometheus.yml (and rule files beside it)."""
    binary = require_binary("prometheus")
    with tempfile.TemporaryDirectory(prefix="rw-prom-") as tmp:
        workdir = Path(tmp)
        (workdir / "prometheus.yml").write_text(config_yaml)
        for fname, text in (extra_files or {}).items():
            (workdir / fname).write_text(text)
        port = free_port()
        argv = [
            binary,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            *(extra_args or []),
        ]
        server = _start("prometheus", argv, port, workdir, "/-/ready")
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def alertmanager(config_yaml: str) -> Iterator[Server]:
    """A real Alertmanager with the given alertmanager.yml (no clustering)."""
    binary = require_binary("prometheus-alertmanager")
    with tempfile.TemporaryDirectory(prefix="rw-am-") as tmp:
        workdir = Path(tmp)
        (workdir / "alertmanager.yml").write_text(config_yaml)
        port = free_port()
        argv = [
            binary,
            f"--config.file={workdir / 'alertmanager.yml'}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ]
        server = _start("alertmanager", argv, port, workdir, "/-/ready")
        try:
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def victoria_metrics(extra_args: list[str] | None = None) -> Iterator[Server]:
    """A real single-node VictoriaMetrics; OTLP at ``/opentelemetry/v1/metrics``."""
    binary = require_binary("victoria-metrics")
    with tempfile.TemporaryDirectory(prefix="rw-vm-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        argv = [
            binary,
            f"-storageDataPath={workdir / 'data'}",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-search.latencyOffset=0s",
            *(extra_args or []),
        ]
        server = _start("victoria-metrics", argv, port, workdir, "/health")
        try:
            yield server
        finally:
            server.stop()


def prom_query(server: Server, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    """Instant PromQL query against Prometheus or VictoriaMetrics; returns ``data.result``."""
    params = {"query": expr}
    if at is not None:
        params["time"] = str(at)
    body = http_get(f"{server.url}/api/v1/query?{urllib.parse.urlencode(params)}")
    payload = json.loads(body)
    if payload.get("status") != "success":
        raise AssertionError(f"query {expr!r} failed: {payload}")
    result: list[dict[str, Any]] = payload["data"]["result"]
    return result
