"""The configuration loaders: every variable is read, every bad value is refused by name."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest
from rankwatch.diagnosis.config import (
    DiagnosisConfig,
    LowLatencyConfig,
    NormalConfig,
    StepTimeConfig,
    parse_bool,
)
from rankwatch.exporter.config import DeepEPConfig, RankwatchConfig, all_env_variables

OWNER_CLASSES = {
    "RankwatchConfig": RankwatchConfig,
    "DeepEPConfig": DeepEPConfig,
    "StepTimeConfig": StepTimeConfig,
    "NormalConfig": NormalConfig,
    "LowLatencyConfig": LowLatencyConfig,
}


def _load(env: dict[str, str]) -> dict[str, Any]:
    """Load every config object from ``env``; keyed like ``all_env_variables()`` values."""
    cfg = RankwatchConfig.from_env(env)
    objs: dict[str, Any] = {
        "RankwatchConfig": cfg,
        "DeepEPConfig": DeepEPConfig.from_env(env),
        "StepTimeConfig": cfg.diagnosis.step_time,
        "NormalConfig": cfg.diagnosis.normal,
        "LowLatencyConfig": cfg.diagnosis.low_latency,
    }
    out = {}
    for path in (p for p, _ in all_env_variables().values()):
        owner, _, name = path.partition(".")
        out[path] = getattr(objs[owner], name)
    return out


def _field_type(path: str) -> str:
    owner, _, name = path.partition(".")
    (f,) = [f for f in fields(OWNER_CLASSES[owner]) if f.name == name]
    return str(f.type)


def _other_valid_value(path: str, default: Any) -> tuple[str, Any]:
    """A value different from the default that passes validation: (env text, parsed value)."""
    kind = _field_type(path)
    if kind == "bool":
        return ("0" if default else "1"), (not default)
    if kind == "str":
        if path == "RankwatchConfig.strategy":
            return "fsdp", "fsdp"
        if path == "RankwatchConfig.node_name_env":
            return "CUSTOM_NODE", "CUSTOM_NODE"
        return "custom-value", "custom-value"
    if kind == "int":
        if path == "LowLatencyConfig.excluding_zeros":
            return "1", 1
        return str(default + 1), default + 1
    value = default * 0.9 if default > 0 else 1.5
    return repr(value), value


def test_empty_environment_gives_the_defaults() -> None:
    loaded = _load({})
    for env_name, (path, default) in all_env_variables().items():
        assert loaded[path] == default, env_name


# Options that are only valid together: setting one sets its partner too.
PARTNERS = {
    "RANKWATCH_METRICS_TLS_CERT_FILE": "RANKWATCH_METRICS_TLS_KEY_FILE",
    "RANKWATCH_METRICS_TLS_KEY_FILE": "RANKWATCH_METRICS_TLS_CERT_FILE",
    "RANKWATCH_METRICS_BASIC_AUTH_USER": "RANKWATCH_METRICS_BASIC_AUTH_PASSWORD",
    "RANKWATCH_METRICS_BASIC_AUTH_PASSWORD": "RANKWATCH_METRICS_BASIC_AUTH_USER",
}
# Options any text is valid for: nothing is unparseable.
FREE_TEXT = sorted(
    name
    for name, (path, _) in all_env_variables().items()
    if _field_type(path) == "str"
    and path not in ("RankwatchConfig.strategy", "RankwatchConfig.node_name_env")
)


@pytest.mark.parametrize("env_name", sorted(all_env_variables()))
def test_every_variable_is_read(env_name: str) -> None:
    path, default = all_env_variables()[env_name]
    text, expected = _other_valid_value(path, default)
    env = {env_name: text}
    if env_name in PARTNERS:
        env[PARTNERS[env_name]] = "partner-value"
    loaded = _load(env)
    assert loaded[path] == expected
    assert loaded[path] != default
    # Nothing else moved.
    for other_name, (other_path, other_default) in all_env_variables().items():
        if other_name not in env:
            assert loaded[other_path] == other_default, other_name


def test_free_text_options_are_only_the_expected_ones() -> None:
    # If a new free-text option appears, decide here whether it needs validation.
    assert FREE_TEXT == [
        "DEEPEP_DIAGNOSE_LOG_PATH",
        "RANKWATCH_ARTIFACT_DIR",
        "RANKWATCH_GROUP",
        "RANKWATCH_METRICS_ADDR",
        "RANKWATCH_METRICS_BASIC_AUTH_PASSWORD",
        "RANKWATCH_METRICS_BASIC_AUTH_USER",
        "RANKWATCH_METRICS_TLS_CERT_FILE",
        "RANKWATCH_METRICS_TLS_KEY_FILE",
        "RANKWATCH_RUN_ID",
    ]


def test_node_name_env_must_name_a_variable() -> None:
    assert RankwatchConfig.from_env({"RANKWATCH_NODE_NAME_ENV": "MY_NODE"}).node_name_env == (
        "MY_NODE"
    )
    assert RankwatchConfig.from_env({"RANKWATCH_NODE_NAME_ENV": ""}).node_name_env == ""
    with pytest.raises(ValueError, match=r"RANKWATCH_NODE_NAME_ENV.*'spec.nodeName'"):
        RankwatchConfig.from_env({"RANKWATCH_NODE_NAME_ENV": "spec.nodeName"})


def test_otel_metric_export_interval_is_honoured_in_milliseconds() -> None:
    assert RankwatchConfig.from_env({}).otlp_export_interval_seconds == 10.0
    env = {"OTEL_METRIC_EXPORT_INTERVAL": "2500"}
    assert RankwatchConfig.from_env(env).otlp_export_interval_seconds == 2.5
    # rankwatch's own variable, then a keyword override, win over the standard one
    env["RANKWATCH_OTLP_EXPORT_INTERVAL_SECONDS"] = "3"
    assert RankwatchConfig.from_env(env).otlp_export_interval_seconds == 3.0
    env = {"OTEL_METRIC_EXPORT_INTERVAL": "2500"}
    cfg = RankwatchConfig.from_env(env, otlp_export_interval_seconds=7.0)
    assert cfg.otlp_export_interval_seconds == 7.0
    for bad in ("x", "0", "-5", "nan"):
        with pytest.raises(ValueError, match=f"OTEL_METRIC_EXPORT_INTERVAL.*{bad!r}"):
            RankwatchConfig.from_env({"OTEL_METRIC_EXPORT_INTERVAL": bad})


@pytest.mark.parametrize("env_name", sorted(n for n in all_env_variables() if n not in FREE_TEXT))
def test_unparseable_value_names_variable_and_value(env_name: str) -> None:
    path, _ = all_env_variables()[env_name]
    with pytest.raises(ValueError) as err:
        _load({env_name: "not-a-valid-value"})
    message = str(err.value)
    assert env_name in message
    assert "not-a-valid-value" in message
    assert path.split(".")[1] in message


@pytest.mark.parametrize(
    ("env_name", "raw", "fragment"),
    [
        ("RANKWATCH_METRICS_PORT", "70000", "<= 65535"),
        ("RANKWATCH_METRICS_PORT", "-1", ">= 0"),
        ("RANKWATCH_INTERVAL_SECONDS", "0", "> 0"),
        ("RANKWATCH_INTERVAL_SECONDS", "-2.5", "> 0"),
        ("RANKWATCH_INTERVAL_SECONDS", "nan", "finite"),
        ("RANKWATCH_GATHER_TIMEOUT_SECONDS", "inf", "finite"),
        ("RANKWATCH_SYNC_STEP", "0", ">= 1"),
        ("RANKWATCH_SYNC_STEP", "2.5", "expected int"),
        ("RANKWATCH_MAX_BUFFERED_STEPS", "1", ">= 2"),
        ("RANKWATCH_CELL_BUDGET", "0", ">= 1"),
        ("RANKWATCH_ARTIFACT_RETENTION", "-1", ">= 0"),
        ("RANKWATCH_STRATEGY", "zero3", "must be one of"),
        ("RANKWATCH_ENABLE", "maybe", "expected a boolean"),
        ("DEEPEP_DIAGNOSE_INTERVAL", "0", "> 0"),
        ("DEEPEP_DIAGNOSE_WARMUP_SECONDS", "-1", ">= 0"),
        ("DEEPEP_DIAGNOSE_ASYNC", "2", "expected a boolean"),
        ("RANKWATCH_CAUSE_COVERAGE_MIN", "1.5", "<= 1.0"),
        ("RANKWATCH_CAUSE_COVERAGE_MIN", "0", "> 0.0"),
        ("RANKWATCH_MIN_STEPS_WARNING", "0", ">= 1"),
        ("RANKWATCH_LIVE_WINDOW_STEPS", "1", ">= 2"),
        ("DEEPEP_DIAGNOSE_NOTIFY_RATIO", "1.01", "<= 1.0"),
        ("DEEPEP_DIAGNOSE_AXIS_SLOWDOWN", "1.0", "> 1.0"),
        ("DEEPEP_DIAGNOSE_GLOBAL_SLOWDOWN", "0.5", "> 1.0"),
        ("DEEPEP_DIAGNOSE_EXCLUDING_ZEROS", "2", "<= 1"),
        ("DEEPEP_DIAGNOSE_THRESHOLD_COL", "-3", "> 0.0"),
    ],
)
def test_out_of_range_value_is_refused(env_name: str, raw: str, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        _load({env_name: raw})
    message = str(err.value)
    assert env_name in message
    assert fragment in message
    assert repr(raw) in message or raw in message


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"RANKWATCH_INCIDENT_OPEN_K": "4", "RANKWATCH_INCIDENT_OPEN_N": "3"}, "incident_open_k"),
        ({"RANKWATCH_METRICS_TLS_CERT_FILE": "cert.pem"}, "metrics_tls_cert_file"),
        ({"RANKWATCH_METRICS_TLS_KEY_FILE": "key.pem"}, "metrics_tls_key_file"),
        ({"RANKWATCH_METRICS_BASIC_AUTH_USER": "alice"}, "metrics_basic_auth_user"),
        (
            {
                "RANKWATCH_STRAGGLER_WARNING_SCORE": "0.3",
                "RANKWATCH_STRAGGLER_CRITICAL_SCORE": "0.2",
            },
            "straggler_critical_score",
        ),
        (
            {"RANKWATCH_BOTTLENECK_WARNING_SHARE": "0.5"},
            "bottleneck_critical_share",
        ),
        ({"RANKWATCH_MIN_STEPS_WARNING": "30"}, "min_steps_critical"),
        ({"RANKWATCH_NORMAL_HISTORY_BOOTSTRAP": "17"}, "history_horizon"),
    ],
)
def test_inconsistent_pairs_are_refused(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        _load(env)


def test_keyword_overrides_win_over_the_environment() -> None:
    env = {"RANKWATCH_METRICS_PORT": "9500", "RANKWATCH_RUN_ID": "from-env"}
    cfg = RankwatchConfig.from_env(env, metrics_port=9600)
    assert cfg.metrics_port == 9600
    assert cfg.run_id == "from-env"


def test_overrides_are_validated_too() -> None:
    with pytest.raises(ValueError, match=r"metrics_port .*got 123456"):
        RankwatchConfig.from_env({}, metrics_port=123456)
    with pytest.raises(TypeError, match=r"metrics_port .*expected a number, got '9464'"):
        RankwatchConfig.from_env({}, metrics_port="9464")
    with pytest.raises(TypeError, match=r"interval_seconds .*expected a number, got True"):
        RankwatchConfig.from_env({}, interval_seconds=True)
    with pytest.raises(TypeError, match=r"enabled .*expected a boolean, got 1"):
        RankwatchConfig.from_env({}, enabled=1)


def test_unknown_override_is_named() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['metrics_prot'\]"):
        RankwatchConfig.from_env({}, metrics_prot=9464)
    with pytest.raises(TypeError, match=r"DeepEPConfig: unknown option\(s\) \['enabled'\]"):
        DeepEPConfig.from_env({}, enabled=True)


def test_diagnosis_config_reads_the_same_environment() -> None:
    env = {
        "RANKWATCH_STRAGGLER_WARNING_SCORE": "0.15",
        "DEEPEP_DIAGNOSE_NOTIFY_RATIO": "0.3",
        "DEEPEP_DIAGNOSE_THRESHOLD_POINT": "7",
    }
    diag = DiagnosisConfig.from_env(env)
    assert diag.step_time.straggler_warning_score == 0.15
    assert diag.normal.notify_ratio == 0.3
    assert diag.low_latency.thres_point == 7.0
    assert RankwatchConfig.from_env(env).diagnosis == diag
    assert set(DiagnosisConfig.env_variables()) <= set(all_env_variables())


def test_diagnosis_config_refuses_bad_values_by_name() -> None:
    with pytest.raises(ValueError, match=r"StepTimeConfig\.min_steps_critical .*got 0"):
        StepTimeConfig(min_steps_critical=0)
    with pytest.raises(ValueError, match=r"NormalConfig\.notify_ratio .*must be finite, got inf"):
        NormalConfig(notify_ratio=math.inf)
    with pytest.raises(TypeError, match=r"LowLatencyConfig\.thres_row .*expected a number"):
        LowLatencyConfig(thres_row="3")  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", " on ", "yes"])
def test_switches_accept_the_usual_spellings_of_on(raw: str) -> None:
    assert parse_bool("X", raw) is True
    assert RankwatchConfig.from_env({"RANKWATCH_LOG_JSON": raw}).log_json is True


@pytest.mark.parametrize("raw", ["0", "false", "Off", "no", ""])
def test_switches_accept_the_usual_spellings_of_off(raw: str) -> None:
    assert parse_bool("X", raw) is False
    assert DeepEPConfig.from_env({"DEEPEP_DIAGNOSE_ASYNC": raw}).async_mode is False


def test_metrics_port_per_local_rank() -> None:
    cfg = RankwatchConfig.from_env({"RANKWATCH_METRICS_PORT": "9500"})
    assert [cfg.metrics_port_for(r) for r in range(3)] == [9500, 9501, 9502]
    assert RankwatchConfig.from_env({}, metrics_port=0).metrics_port_for(5) == 0
