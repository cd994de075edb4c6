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

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rankwatch.diagnosis.config import (
    DeclaredOption,
    DiagnosisConfig,
    EnvOptions,
    check_value,
    declared_options,
    from_env,
    option,
    option_env,
    option_label,
    validate_options,
)
from rankwatch.exporter.attempt import MAX_ATTEMPT, attempt_from_env
from rankwatch.exporter.identity import run_name_from_env

__all__ = [
    "DeepEPConfig",
    "RankwatchConfig",
    "all_env_variables",
    "bind_address_problem",
    "config_fields",
    "config_options",
    "redacted_url",
]


# Upper bounds shared by several options: generous for any real job, far below what breaks
# Python's timed waits (about 9.2e9 s) or a timedelta, or what memory can hold.
MAX_INTERVAL_SECONDS = 3600.0  # window intervals, export intervals and gather timeouts
MAX_WARMUP_SECONDS = 86_400.0
MAX_SYNC_STEP = 1_000_000
MAX_WARMUP_STEPS = 100_000
MAX_RETAINED_FILES = 100_000
MAX_INCIDENT_WINDOWS = 1_000
MAX_LABEL_CHARS = 256
MAX_HANG_SECONDS = (
    86_400.0  # hang budgets: a day at most  # run id, group and user: label values on every series
)


# A DNS host name: dot-separated labels of letters, digits and '-', at most 253 characters.
_HOST_NAME = r"(?=.{1,253}$)[A-Za-z0-9][A-Za-z0-9-]{0,62}(\.[A-Za-z0-9-]{1,63})*\.?"


def bind_address_problem(addr: str) -> str | None:
    """What is wrong with ``addr`` as the ``/metrics`` bind address, or None.

    An empty address would make the server listen on every interface without anyone asking
    for it, so it is refused: serving the world must be spelled ``0.0.0.0`` (or ``::``).
    """
    if not addr.strip():
        return (
            "must not be empty (an empty address listens on every interface; write "
            "0.0.0.0 or :: to mean that, or 127.0.0.1 for this host only)"
        )
    try:
        ipaddress.ip_address(addr)
        return None
    except ValueError:
        pass
    if not re.fullmatch(_HOST_NAME, addr):
        return "must be an IP address or a host name (no port, scheme or spaces)"
    return None


def redacted_url(url: str) -> str:
    """``url`` with the password of its user part, if any, shown as ``(hidden)``: an OTLP
    endpoint may carry credentials (``https://user:token@host``), and endpoints are printed by
    ``rankwatch config`` and in export-failure log lines."""
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:  # not a URL at all: nothing of it is known to be safe
        return "(unparseable URL, hidden)"
    if not has_password:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:(hidden)@{host}"))


def _variable_name_problem(name: str) -> str | None:
    if name and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return "must name an environment variable (letters, digits, _)"
    return None


def _optional_address_problem(addr: str) -> str | None:
    return None if addr == "" else bind_address_problem(addr)


def _basic_auth_problem(user: str) -> str | None:
    # Basic auth joins user and password with ':' (RFC 7617), so a user may not contain one.
    return "must not contain ':'" if ":" in user else None


@dataclass(frozen=True)
class DeepEPConfig(EnvOptions):
    """DeepXTrace-compatible settings of the DeepEP collector (``DEEPEP_DIAGNOSE_*``).

    Part of the one configuration object, as ``RankwatchConfig.deepep``;
    ``Diagnose.create_from_env(config=...)`` reads it from there.
    """

    enable: bool = field(default=False, metadata=option("DEEPEP_DIAGNOSE_ENABLE"))
    async_mode: bool = field(default=True, metadata=option("DEEPEP_DIAGNOSE_ASYNC"))
    interval_seconds: float = field(
        default=10.0,
        metadata=option("DEEPEP_DIAGNOSE_INTERVAL", 0.0, MAX_INTERVAL_SECONDS, lo_open=True),
    )
    sync_step: int = field(
        default=580, metadata=option("DEEPEP_DIAGNOSE_SYNC_STEP", 1, MAX_SYNC_STEP)
    )
    warmup_seconds: float = field(
        default=0.0, metadata=option("DEEPEP_DIAGNOSE_WARMUP_SECONDS", 0.0, MAX_WARMUP_SECONDS)
    )
    log_path: str = field(default=".", metadata=option("DEEPEP_DIAGNOSE_LOG_PATH"))
    log_details: bool = field(default=False, metadata=option("DEEPEP_DIAGNOSE_LOG_DETAILS"))
    export_npz: bool = field(default=False, metadata=option("DEEPEP_DIAGNOSE_EXPORT_NPZ"))
    npz_retention: int = field(
        default=100, metadata=option("DEEPEP_DIAGNOSE_NPZ_RETENTION", 1, MAX_RETAINED_FILES)
    )
    # Where the EP root's windows, diagnosis, log lines and NPZ files run (deepep/root_process.py):
    # in a child process of the root from this EP size on, else on a thread of the root's
    # training process; 0 keeps them in the process at any size. 16: every group that runs
    # DeepEP's internode normal mode (bench_deepep_root: a window costs the root's training
    # process 7 ms against 13 ms at EP 16, 34 against 45 at EP 160); a group of 8 or fewer
    # records low-latency counters only, cheap to diagnose, and keeps its windows inspectable.
    root_process_min_ep: int = field(
        default=16, metadata=option("DEEPEP_DIAGNOSE_ROOT_PROCESS_MIN_EP", 0, 1_048_576)
    )
    # A root child that has not answered a snapshot for this long is stuck: killed, said in one
    # line, started again (its windows meanwhile are missing).
    root_stall_seconds: float = field(
        default=60.0, metadata=option("DEEPEP_DIAGNOSE_ROOT_STALL_SECONDS", 1.0, 3600.0)
    )


@dataclass(frozen=True)
class RankwatchConfig:
    """Settings of the in-process exporter (step timer, windows, publishers)."""

    # identity: unset, from_env names the run after the launcher's job (identity.run_name_from_env)
    run_id: str = field(default="", metadata=option("RANKWATCH_RUN_ID", max_chars=MAX_LABEL_CHARS))
    group_name: str = field(
        default="world", metadata=option("RANKWATCH_GROUP", max_chars=MAX_LABEL_CHARS)
    )
    # Which start of the run this is (0 the first; a restart keeps run_id): unset, from_env
    # reads torchrun's, Slurm's or a JobSet's restart count (attempt.attempt_from_env).
    attempt: int = field(default=0, metadata=option("RANKWATCH_ATTEMPT", 0, MAX_ATTEMPT))
    # Kubernetes identity: the variable holding the node name (downward API spec.nodeName), as
    # dcgm-exporter reads it; the `hostname` label and k8s.node.name come from it when set.
    node_name_env: str = field(
        default="NODE_NAME", metadata=option("RANKWATCH_NODE_NAME_ENV", rule=_variable_name_problem)
    )
    # collection
    enabled: bool = field(default=True, metadata=option("RANKWATCH_ENABLE"))
    async_mode: bool = field(default=True, metadata=option("RANKWATCH_ASYNC"))
    interval_seconds: float = field(
        default=5.0,
        metadata=option("RANKWATCH_INTERVAL_SECONDS", 0.0, MAX_INTERVAL_SECONDS, lo_open=True),
    )
    sync_step: int = field(default=100, metadata=option("RANKWATCH_SYNC_STEP", 1, MAX_SYNC_STEP))
    gather_timeout_seconds: float = field(
        default=30.0,
        metadata=option(
            "RANKWATCH_GATHER_TIMEOUT_SECONDS", 0.0, MAX_INTERVAL_SECONDS, lo_open=True
        ),
    )
    max_buffered_steps: int = field(
        default=20_000, metadata=option("RANKWATCH_MAX_BUFFERED_STEPS", 2, 1_000_000)
    )
    # Steps each process times but does not ship: the first steps of a job hold compilation,
    # lazy initialisation, the first collective's start-up skew and loader workers starting.
    warmup_steps: int = field(
        default=5, metadata=option("RANKWATCH_WARMUP_STEPS", 0, MAX_WARMUP_STEPS)
    )
    # How rankwatch's Gloo group connects (see ``gloo.create_gloo_group``): lazily, a rank
    # connects to its root only, and the root admits as many as its open-file limit has room
    # for; off, every member to every member (a full mesh takes 4,096 sockets per rank at
    # 4,096 ranks, over common open-file limits).
    gloo_lazy_connect: bool = field(default=True, metadata=option("RANKWATCH_GLOO_LAZY_CONNECT"))
    # The group's aggregator (see docs/architecture.md): the address the ranks reach it at
    # and it listens on (empty: the address this host reaches the job's c10d store from); how
    # long it may stand still before the root kills and restarts it; and how many ranks' own
    # series the root publishes (every rank of a group up to this size; in a larger group the
    # ranks the diagnosis names and the slowest, and every rank serves its own).
    aggregator_host: str = field(
        default="", metadata=option("RANKWATCH_AGGREGATOR_HOST", rule=_optional_address_problem)
    )
    aggregator_stall_seconds: float = field(
        default=60.0, metadata=option("RANKWATCH_AGGREGATOR_STALL_SECONDS", 1.0, 3600.0)
    )
    root_rank_budget: int = field(
        default=64, metadata=option("RANKWATCH_ROOT_RANK_BUDGET", 1, 1_048_576)
    )
    # Node leaders (exporter/step_time/node_relay.py): the other ranks of a node ship through
    # its lowest rank; "auto" in groups of 1,024 ranks or more.
    node_leaders: str = field(
        default="auto", metadata=option("RANKWATCH_NODE_LEADERS", choices=("auto", "on", "off"))
    )
    strategy: str = field(
        default="", metadata=option("RANKWATCH_STRATEGY", choices=("", "ddp", "fsdp"))
    )
    # watch(): fetched batches without an optimizer step before one warning says so
    optimizer_silent_batches: int = field(
        default=50, metadata=option("RANKWATCH_OPTIMIZER_SILENT_BATCHES", 1, 1_000_000)
    )
    # GPU clock: device errors (an event's record/query/elapsed_time raising) before GPU timing
    # switches itself off with one warning
    gpu_device_errors_before_off: int = field(
        default=3, metadata=option("RANKWATCH_GPU_DEVICE_ERRORS_BEFORE_OFF", 1, 1_000_000)
    )
    # Hang watch (see docs/hang.md): a critical `hang` incident when no rank progressed for the
    # budget: at least hang_budget_seconds and hang_step_multiple times the job's median step,
    # hang_warmup_budget_seconds before hang_warmup_steps steps are done (compilation,
    # warm-up) and for an epoch's first batch, hang_checkpoint_budget_seconds while a
    # torch.distributed.checkpoint save runs. Records are read every hang_poll_seconds.
    hang_enabled: bool = field(default=True, metadata=option("RANKWATCH_HANG_ENABLE"))
    hang_budget_seconds: float = field(
        default=15.0,
        metadata=option("RANKWATCH_HANG_BUDGET_SECONDS", 0.0, MAX_HANG_SECONDS, lo_open=True),
    )
    hang_step_multiple: float = field(
        default=10.0, metadata=option("RANKWATCH_HANG_STEP_MULTIPLE", 0.0, 10_000.0)
    )
    hang_warmup_budget_seconds: float = field(
        default=300.0,
        metadata=option(
            "RANKWATCH_HANG_WARMUP_BUDGET_SECONDS", 0.0, MAX_HANG_SECONDS, lo_open=True
        ),
    )
    hang_warmup_steps: int = field(
        default=2, metadata=option("RANKWATCH_HANG_WARMUP_STEPS", 0, MAX_WARMUP_STEPS)
    )
    hang_checkpoint_budget_seconds: float = field(
        default=900.0,
        metadata=option(
            "RANKWATCH_HANG_CHECKPOINT_BUDGET_SECONDS", 0.0, MAX_HANG_SECONDS, lo_open=True
        ),
    )
    hang_poll_seconds: float = field(
        default=0.5, metadata=option("RANKWATCH_HANG_POLL_SECONDS", 0.01, 60.0)
    )
    hang_stack_frames: int = field(default=8, metadata=option("RANKWATCH_HANG_STACK_FRAMES", 1, 32))
    # Prometheus pull path
    metrics_enabled: bool = field(default=True, metadata=option("RANKWATCH_METRICS_ENABLE"))
    metrics_addr: str = field(
        default="127.0.0.1", metadata=option("RANKWATCH_METRICS_ADDR", rule=bind_address_problem)
    )
    metrics_port: int = field(default=9464, metadata=option("RANKWATCH_METRICS_PORT", 0, 65535))
    metrics_tls_cert_file: str = field(
        default="", metadata=option("RANKWATCH_METRICS_TLS_CERT_FILE")
    )
    metrics_tls_key_file: str = field(default="", metadata=option("RANKWATCH_METRICS_TLS_KEY_FILE"))
    metrics_basic_auth_user: str = field(
        default="",
        metadata=option(
            "RANKWATCH_METRICS_BASIC_AUTH_USER", max_chars=MAX_LABEL_CHARS, rule=_basic_auth_problem
        ),
    )
    # Secret: hidden from repr(), errors and `rankwatch config`.
    metrics_basic_auth_password: str = field(
        default="",
        repr=False,
        metadata=option("RANKWATCH_METRICS_BASIC_AUTH_PASSWORD", secret=True),
    )
    cell_budget: int = field(default=1024, metadata=option("RANKWATCH_CELL_BUDGET", 1, 1_048_576))
    # OTLP push path (endpoint, protocol, headers: the standard OTEL_EXPORTER_OTLP_* variables)
    otlp_enabled: bool = field(default=True, metadata=option("RANKWATCH_OTLP_ENABLE"))
    otlp_export_interval_seconds: float = field(
        default=10.0,
        metadata=option(
            "RANKWATCH_OTLP_EXPORT_INTERVAL_SECONDS", 0.0, MAX_INTERVAL_SECONDS, lo_open=True
        ),
    )
    # OTLP exports of at least this many points run in a child process, off the training
    # process's interpreter lock (the SDK's Python per point would otherwise stall training on
    # a large group's root); 0 keeps every export in the process.
    otlp_process_min_points: int = field(
        default=2000, metadata=option("RANKWATCH_OTLP_PROCESS_MIN_POINTS", 0, 100_000_000)
    )
    # Publish through the application's global OTel MeterProvider/LoggerProvider when it has set
    # them (the library guideline), instead of providers and exporters of rankwatch's own.
    otlp_use_global_providers: bool = field(
        default=False, metadata=option("RANKWATCH_OTLP_USE_GLOBAL_PROVIDERS")
    )
    shutdown_timeout_seconds: float = field(
        default=5.0, metadata=option("RANKWATCH_SHUTDOWN_TIMEOUT_SECONDS", 0.0, 600.0, lo_open=True)
    )
    # incidents: open after k of the last n windows agree, close after m clean windows
    incident_open_k: int = field(
        default=2, metadata=option("RANKWATCH_INCIDENT_OPEN_K", 1, MAX_INCIDENT_WINDOWS)
    )
    incident_open_n: int = field(
        default=3, metadata=option("RANKWATCH_INCIDENT_OPEN_N", 1, MAX_INCIDENT_WINDOWS)
    )
    incident_close_m: int = field(
        default=3, metadata=option("RANKWATCH_INCIDENT_CLOSE_M", 1, MAX_INCIDENT_WINDOWS)
    )
    # artifacts and logs
    artifact_dir: str = field(default="", metadata=option("RANKWATCH_ARTIFACT_DIR"))
    artifact_retention: int = field(
        default=100, metadata=option("RANKWATCH_ARTIFACT_RETENTION", 0, MAX_RETAINED_FILES)
    )
    log_json: bool = field(default=True, metadata=option("RANKWATCH_LOG_JSON"))
    # The root prints the run's verdict and where its summary is when rankwatch closes.
    end_summary: bool = field(default=True, metadata=option("RANKWATCH_END_SUMMARY"))
    # Nested objects: their fields declare their own variables (walked by all_env_variables).
    # The DeepEP collector's settings (Diagnose.create_from_env(config=...) reads them here).
    deepep: DeepEPConfig = field(default_factory=DeepEPConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)

    def __post_init__(self) -> None:
        validate_options(self)  # options and the nested objects' types
        if self.incident_open_k > self.incident_open_n:
            raise ValueError(
                f"{option_label(RankwatchConfig, 'incident_open_k')}: must be <= "
                f"incident_open_n ({option_env(RankwatchConfig, 'incident_open_n')}) "
                f"{self.incident_open_n}, got {self.incident_open_k}"
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
        if "run_id" not in overrides:  # RANKWATCH_RUN_ID, else the launcher's job name
            overrides["run_id"] = run_name_from_env(source).name
        ours = option_env(cls, "attempt")
        if "attempt" not in overrides and not source.get(ours, "").strip():
            overrides["attempt"] = attempt_from_env(source).value
        return from_env(cls, source, **overrides)

    def metrics_port_for(self, local_rank: int) -> int:
        """One port per local rank under torchrun: base + local_rank (0 stays 0: ephemeral)."""
        return 0 if self.metrics_port == 0 else self.metrics_port + local_rank


def _otel_metric_export_interval(env: Mapping[str, str]) -> float | None:
    """The standard ``OTEL_METRIC_EXPORT_INTERVAL`` (milliseconds) in seconds, when it is set and
    rankwatch's own ``RANKWATCH_OTLP_EXPORT_INTERVAL_SECONDS`` is not (ours wins); checked
    against the option's range, in milliseconds."""
    ours = option_env(RankwatchConfig, "otlp_export_interval_seconds")
    raw = env.get("OTEL_METRIC_EXPORT_INTERVAL", "").strip()
    if not raw or env.get(ours, "").strip():
        return None
    label = "RankwatchConfig.otlp_export_interval_seconds (OTEL_METRIC_EXPORT_INTERVAL)"
    millis_option = option(
        "OTEL_METRIC_EXPORT_INTERVAL", 0.0, MAX_INTERVAL_SECONDS * 1000.0, lo_open=True
    )
    try:
        millis = float(raw)
    except ValueError:
        raise ValueError(f"{label}: expected a number of milliseconds, got {raw!r}") from None
    check_value(label, millis_option, float, millis, f"{raw!r} (milliseconds)")
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
