"""A Prometheus HTTP API reader for the commands that read one (``rankwatch hosts``).

Only instant queries (``/api/v1/query``), with the authentication a Prometheus behind its own
web configuration or a proxy asks for: basic auth (the password from a file, never from the
command line, where ``ps`` shows it), a bearer token from a file, a CA file for TLS. Every
failure is one :class:`~rankwatch.exporter.cli.exits.UsageError` line naming the option and the
value: an unreachable URL, a refused login, an answer that is not Prometheus' JSON.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankwatch.exporter.cli.exits import UsageError
from rankwatch.exporter.config import redacted_url

__all__ = ["MAX_ANSWER_BYTES", "PrometheusReader", "read_secret_file"]

# A host ledger's answers are small (culprit hosts only); a runaway answer is refused.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
_MAX_SECRET_BYTES = 64 * 1024


def read_secret_file(option: str, path: Path) -> str:
    """The first line of a password or token file, stripped; one clear line when unreadable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > _MAX_SECRET_BYTES:
        raise UsageError(f"{option} {path}: larger than {_MAX_SECRET_BYTES} bytes")
    try:
        text = raw.decode().splitlines()[0].strip() if raw.strip() else ""
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path}: not UTF-8 text") from None
    if not text:
        raise UsageError(f"{option} {path}: is empty")
    return text


@dataclass(frozen=True)
class PrometheusReader:
    """Instant queries against ``url`` (``http(s)://host:port[/prefix]``)."""

    url: str
    user: str = ""
    password: str = ""
    bearer_token: str = ""
    ca_file: str = ""
    timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        try:
            parts = urllib.parse.urlsplit(self.url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            ok = False
        if not ok:
            raise UsageError(
                f"--prometheus: expected an http:// or https:// URL of a Prometheus, got "
                f"{redacted_url(self.url)!r}"
            )
        if parts.username is not None:
            raise UsageError(
                "--prometheus: credentials in the URL are refused (they show in ps and shell "
                "history); use --user and --password-file"
            )
        if self.ca_file and parts.scheme != "https":
            raise UsageError(f"--ca-file: only for an https:// URL, got {self.url!r}")

    def _context(self) -> ssl.SSLContext | None:
        if not self.ca_file:
            return None
        try:
            return ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise UsageError(f"--ca-file {self.ca_file}: not a usable CA file ({exc})") from None

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The ``data.result`` of an instant vector query of ``expr``."""
        endpoint = self.url.rstrip("/") + "/api/v1/query"
        body = urllib.parse.urlencode({"query": expr}).encode()
        request = urllib.request.Request(endpoint, data=body, method="POST")
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
        if self.user:
            pair = f"{self.user}:{self.password}".encode()
            request.add_header("Authorization", "Basic " + base64.b64encode(pair).decode())
        elif self.bearer_token:
            request.add_header("Authorization", "Bearer " + self.bearer_token)
        where = f"--prometheus {self.url}"
        try:
            with urllib.request.urlopen(
                request, timeout=self.timeout_seconds, context=self._context()
            ) as answer:
                raw = answer.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise UsageError(
                    f"{where}: HTTP {exc.code} {exc.reason}: the login was refused (check "
                    "--user and --password-file, or --bearer-token-file)"
                ) from None
            raise UsageError(f"{where}: HTTP {exc.code} {exc.reason} for {expr!r:.120}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise UsageError(f"{where}: cannot be reached ({reason})") from None
        if len(raw) > MAX_ANSWER_BYTES:
            raise UsageError(f"{where}: an answer over {MAX_ANSWER_BYTES} bytes")
        try:
            doc = json.loads(raw)
            result = doc["data"]["result"] if doc.get("status") == "success" else None
        except (ValueError, TypeError, KeyError, AttributeError):
            result = None
        if not isinstance(result, list) or doc.get("data", {}).get("resultType") != "vector":
            raise UsageError(f"{where}: not a Prometheus query API answer ({raw[:120]!r})")
        return result
