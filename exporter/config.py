"""rankwatch's one configuration object: collection, publishing and diagnosis settings.

``RankwatchConfig.from_env(**overrides)`` reads environment variables, applies keyword
overrides, and validates everything on load (``ValueError``/``TypeError`` naming the field, the
variable and the value). Its nested objects hold the diagnosis thresholds
(``RankwatchConfig.diagnosis``) and the DeepEP collector's settings under DeepXTrace's
``DEEPEP_DIAGNOSE_*`` names (``RankwatchConfig.deepep``), so the step-time collector and the
DeepEP collector of one process read the same object. Every variable is declared once, by the
``option(...)`` metadata of one field; :func:`all_env_variables` walks the object to list them.
``docs/configuration.md`` lists every option; a test keeps it in step with this file.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rankwatch.diagnosis.config import (
    DeclaredOption,
    DiagnosisConfig,
    EnvOptions,
    declared_options,
    from_env,
    option,
    option_env,
    validate_options,
)

__all__ = [
    "DeepEPConfig",
    "RankwatchConfig",
    "all_env_variables",
    "config_fields",
    "config_options",
]


@dataclass(frozen=True)
class DeepEPConfig(EnvOptions):
    """DeepXTrace-compatible settings of the DeepEP collector (``DEEPEP_DIAGNOSE_*``).

    Part of the one configuration object, as ``RankwatchConfig.deepep``;
    ``Diagnose.create_from_env(config=...)`` reads it from there.
    """

    enable: bool = field(default=False, metadata=option("DEEPEP_DIAGNOSE_ENABLE"))
    async_mode: bool = field(default=True, metadata=option("DEEPEP_DIAGNOSE_ASYNC"))
    interval_seconds: float = field(
        default=10.0, metadata=option("DEEPEP_DIAGNOSE_INTERVAL", 0.0, lo_open=True)
    )
    sync_step: int = field(default=580, metadata=option("DEEPEP_DIAGNOSE_SYNC_STEP", 1))
    warmup_seconds: float = field(
        default=0.0, metadata=option("DEEPEP_DIAGNOSE_WARMUP_SECONDS", 0.0)
    )
    log_path: str = field(default=".", metadata=option("DEEPEP_DIAGNOSE_LOG_PATH"))
    log_details: bool = field(default=False, metadata=option("DEEPEP_DIAGNOSE_LOG_DETAILS"))
    export_npz: bool = field(default=False, metadata=option("DEEPEP_DIAGNOSE_EXPORT_NPZ"))
    npz_retention: int = field(default=100, metadata=option("DEEPEP_DIAGNOSE_NPZ_RETENTION", 1))


@dataclass(frozen=True)
class RankwatchConfig:
    """Settings of the in-process exporter (step timer, windows, publishers)."""

    # identity
    run_id: str = field(default="", metadata=option("RANKWATCH_RUN_ID"))
    group_name: str = field(default="world", metadata=option("RANKWATCH_GROUP"))
    # Kubernetes identity: the variable holding the node name (downward API spec.nodeName), as
    # dcgm-exporter reads it; the `hostname` label and k8s.node.name come from it when set.
    node_name_env: str = field(default="NODE_NAME", metadata=option("RANKWATCH_NODE_NAME_ENV"))
    # collection
    enabled: bool = field(default=True, metadata=option("RANKWATCH_ENABLE"))
    async_mode: bool = field(default=True, metadata=option("RANKWATCH_ASYNC"))
    interval_seconds: float = field(
        default=5.0, metadata=option("RANKWATCH_INTERVAL_SECONDS", 0.0, lo_open=True)
    )
    sync_step: int = field(default=100, metadata=option("RANKWATCH_SYNC_STEP", 1))
    gather_timeout_seconds: float = field(
        default=30.0, metadata=option("RANKWATCH_GATHER_TIMEOUT_SECONDS", 0.0, lo_open=True)
    )
    max_buffered_steps: int = field(
        default=20_000, metadata=option("RANKWATCH_MAX_BUFFERED_STEPS", 2)
    )
    # How rankwatch's Gloo group connects (see ``gloo.create_gloo_group``): lazily, a rank
    # connects to its root only, and the root admits as many as its open-file limit has room
    # for; off, every member to every member (a full mesh takes 4,096 sockets per rank at
    # 4,096 ranks, over common open-file limits).
    gloo_lazy_connect: bool = field(default=True, metadata=option("RANKWATCH_GLOO_LAZY_CONNECT"))
    strategy: str = field(
        default="", metadata=option("RANKWATCH_STRATEGY", choices=("", "ddp", "fsdp"))
    )
    # watch(): fetched batches without an optimizer step before one warning says so
    optimizer_silent_batches: int = field(
        default=50, metadata=option("RANKWATCH_OPTIMIZER_SILENT_BATCHES", 1)
    )
    # Prometheus pull path
    metrics_enabled: bool = field(default=True, metadata=option("RANKWATCH_METRICS_ENABLE"))
    metrics_addr: str = field(default="127.0.0.1", metadata=option("RANKWATCH_METRICS_ADDR"))
    metrics_port: int = field(default=9464, metadata=option("RANKWATCH_METRICS_PORT", 0, 65535))
    metrics_tls_cert_file: str = field(
        default="", metadata=option("RANKWATCH_METRICS_TLS_CERT_FILE")
    )
    metrics_tls_key_file: str = field(default="", metadata=option("RANKWATCH_METRICS_TLS_KEY_FILE"))
    metrics_basic_auth_user: str = field(
        default="", metadata=option("RANKWATCH_METRICS_BASIC_AUTH_USER")
    )
    metrics_basic_auth_password: str = field(
        default="", metadata=option("RANKWATCH_METRICS_BASIC_AUTH_PASSWORD")
    )
    cell_budget: int = field(default=1024, metadata=option("RANKWATCH_CELL_BUDGET", 1))
    # OTLP push path (endpoint, protocol, headers: the standard OTEL_EXPORTER_OTLP_* variables)
    otlp_enabled: bool = field(default=True, metadata=option("RANKWATCH_OTLP_ENABLE"))
    otlp_export_interval_seconds: float = field(
        default=10.0, metadata=option("RANKWATCH_OTLP_EXPORT_INTERVAL_SECONDS", 0.0, lo_open=True)
    )
    # OTLP exports of at least this many points run in a child process, off the training
    # process's interpreter lock (the SDK's Python per point would otherwise stall training on
    # a large group's root); 0 keeps every export in the process.
    otlp_process_min_points: int = field(
        default=2000, metadata=option("RANKWATCH_OTLP_PROCESS_MIN_POINTS", 0)
    )
    # Publish through the application's global OTel MeterProvider/LoggerProvider when it has set
    # them (the library guideline), instead of providers and exporters of rankwatch's own.
    otlp_use_global_providers: bool = field(
        default=False, metadata=option("RANKWATCH_OTLP_USE_GLOBAL_PROVIDERS")
    )
    shutdown_timeout_seconds: float = field(
        default=5.0, metadata=option("RANKWATCH_SHUTDOWN_TIMEOUT_SECONDS", 0.0, lo_open=True)
    )
    # incidents: open after k of the last n windows agree, close after m clean windows
    incident_open_k: int = field(default=2, metadata=option("RANKWATCH_INCIDENT_OPEN_K", 1))
    incident_open_n: int = field(default=3, metadata=option("RANKWATCH_INCIDENT_OPEN_N", 1))
    incident_close_m: int = field(default=3, metadata=option("RANKWATCH_INCIDENT_CLOSE_M", 1))
    # artifacts and logs
    artifact_dir: str = field(default="", metadata=option("RANKWATCH_ARTIFACT_DIR"))
    artifact_retention: int = field(default=100, metadata=option("RANKWATCH_ARTIFACT_RETENTION", 0))
    log_json: bool = field(default=True, metadata=option("RANKWATCH_LOG_JSON"))
    # Nested objects: their fields declare their own variables (walked by all_env_variables).
    # The DeepEP collector's settings (Diagnose.create_from_env(config=...) reads them here).
    deepep: DeepEPConfig = field(default_factory=DeepEPConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)

    def __post_init__(self) -> None:
        validate_options(self)  # options and the nested objects' types
        if self.incident_open_k > self.incident_open_n:
            raise ValueError(
                "RankwatchConfig.incident_open_k (RANKWATCH_INCIDENT_OPEN_K): must be <= "
                f"incident_open_n ({self.incident_open_n}), got {self.incident_open_k}"
            )
        if self.node_name_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.node_name_env):
            raise ValueError(
                "RankwatchConfig.node_name_env (RANKWATCH_NODE_NAME_ENV): must name an "
                f"environment variable (letters, digits, _), got {self.node_name_env!r}"
            )
        if bool(self.metrics_tls_cert_file) != bool(self.metrics_tls_key_file):
            raise ValueError(
                "RankwatchConfig.metrics_tls_cert_file/metrics_tls_key_file "
                "(RANKWATCH_METRICS_TLS_CERT_FILE/RANKWATCH_METRICS_TLS_KEY_FILE): set both or "
                f"neither, got cert={self.metrics_tls_cert_file!r} "
                f"key={self.metrics_tls_key_file!r}"
            )
        if bool(self.metrics_basic_auth_user) != bool(self.metrics_basic_auth_password):
            raise ValueError(
                "RankwatchConfig.metrics_basic_auth_user/metrics_basic_auth_password "
                "(RANKWATCH_METRICS_BASIC_AUTH_USER/RANKWATCH_METRICS_BASIC_AUTH_PASSWORD): set "
                f"both or neither, got user={self.metrics_basic_auth_user!r} and "
                f"{'a' if self.metrics_basic_auth_password else 'no'} password"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> RankwatchConfig:
        """Environment first, then keyword overrides; the nested objects too.

        ``deepep`` and ``diagnosis`` are read from the same environment unless given as
        overrides (a ``DeepEPConfig`` / ``DiagnosisConfig``, e.g.
        ``RankwatchConfig.from_env(deepep=DeepEPConfig(enable=True))``).
        """
        source = os.environ if env is None else env
        if "deepep" not in overrides:
            overrides["deepep"] = DeepEPConfig.from_env(source)
        if "diagnosis" not in overrides:
            overrides["diagnosis"] = DiagnosisConfig.from_env(source)
        interval = _otel_metric_export_interval(source)
        if interval is not None and "otlp_export_interval_seconds" not in overrides:
            overrides["otlp_export_interval_seconds"] = interval
        return from_env(cls, source, **overrides)

    def metrics_port_for(self, local_rank: int) -> int:
        """One port per local rank under torchrun: base + local_rank (0 stays 0: ephemeral)."""
        return 0 if self.metrics_port == 0 else self.metrics_port + local_rank


def _otel_metric_export_interval(env: Mapping[str, str]) -> float | None:
    """The standard ``OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds) in seconds, when it is set and
    rankwatch's own ``RANKWATCH_OTLP_EXPORT_INTERVAL_SECONDS`` is not (ours wins)."""
    ours = option_env(RankwatchConfig, "otlp_export_interval_seconds")
    raw = env.get("OTEL_METRIC_EXPORT_INTERVAL", "").strip()
    if not raw or env.get(ours, "").strip():
        return None
    try:
        millis = float(raw)
    except ValueError:
        millis = float("nan")
    if not math.isfinite(millis) or millis <= 0:
        raise ValueError(
            "RankwatchConfig.otlp_export_interval_seconds (OTEL_METRIC_EXPORT_INTERVAL): "
            f"expected a number of milliseconds > 0, got {raw!r}"
        )
    return millis / 1000.0


def config_options() -> tuple[DeclaredOption, ...]:
    """Every option of ``RankwatchConfig``, its nested objects included, in field order: each
    environment variable once, with the field that declares it and its path in the object
    (``option.value_in(config)``). Raises ``ValueError`` if a variable is declared twice."""
    return declared_options(RankwatchConfig)


def all_env_variables() -> dict[str, tuple[str, Any]]:
    """Every environment variable rankwatch reads: ``{name: (Class.field, default)}``, walked
    from ``RankwatchConfig`` (see :func:`config_options`); for the docs, their test and
    ``rankwatch config``."""
    return {o.env: (o.label, o.default) for o in config_options()}


def config_fields() -> list[str]:
    """Names of the top-level exporter options (keyword overrides of ``from_env``)."""
    return [f.name for f in fields(RankwatchConfig)]
