"""The configuration loaders: every variable is read, every bad value is refused by name."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import pytest

import rankwatch.diagnosis.config as diagnosis_config
import rankwatch.exporter.config as exporter_config
from rankwatch.diagnosis.config import (
    DiagnosisConfig,
    LowLatencyConfig,
    NormalConfig,
    StepTimeConfig,
    declared_options,
    option,
    parse_bool,
)
from rankwatch.exporter.config import (
    DeepEPConfig,
    RankwatchConfig,
    all_env_variables,
    config_options,
    redacted_url,
)
from rankwatch.exporter.identity import local_identity, local_rank_from_env, rank_from_env

# Each option's class, by its label (``Class.field``): the type of the object holding it.
OWNER_CLASSES: dict[str, type] = {}
for _opt in config_options():
    _holder: Any = RankwatchConfig()
    for _name in _opt.path[:-1]:
        _holder = getattr(_holder, _name)
    OWNER_CLASSES[_opt.label.partition(".")[0]] = type(_holder)


def _load(env: dict[str, str]) -> dict[str, Any]:
    """Load the one config object from ``env``; every option's value keyed by its label."""
    cfg = RankwatchConfig.from_env(env)
    return {opt.label: opt.value_in(cfg) for opt in config_options()}


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
        if path == "RankwatchConfig.node_leaders":
            return "on", "on"
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
    and path
    not in (
        "RankwatchConfig.strategy",
        "RankwatchConfig.node_name_env",
        "RankwatchConfig.node_leaders",
    )
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
        "RANKWATCH_AGGREGATOR_HOST",
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
        ({"RANKWATCH_MIN_STEPS_WARNING": "30"}, "min_steps_critical"),
        ({"RANKWATCH_NORMAL_HISTORY_BOOTSTRAP": "17"}, "history_horizon"),
    ],
)
def test_inconsistent_pairs_are_refused(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        _load(env)


def test_the_password_is_never_in_repr_or_errors() -> None:
    secret = "hunter2-s3cret"
    cfg = RankwatchConfig(metrics_basic_auth_user="prom", metrics_basic_auth_password=secret)
    for text in (repr(cfg), str(cfg), repr(config_options())):
        assert secret not in text
    assert "metrics_basic_auth_user='prom'" in repr(cfg)
    assert [o.env for o in config_options() if o.secret] == [
        "RANKWATCH_METRICS_BASIC_AUTH_PASSWORD"
    ]
    # Every error that can see it shows "(hidden)" instead: bad text, bad type, a missing user.
    for kwargs in (
        {"metrics_basic_auth_password": "x" * 5000 + secret},
        {"metrics_basic_auth_password": secret + "\udcff"},
        {"metrics_basic_auth_password": secret},
    ):
        with pytest.raises(ValueError) as err:
            RankwatchConfig(**kwargs)
        assert secret not in str(err.value)
    with pytest.raises(ValueError, match=r"\(hidden\)"):
        RankwatchConfig.from_env({"RANKWATCH_METRICS_BASIC_AUTH_PASSWORD": secret + "\udcff"})


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://127.0.0.1:4318", "http://127.0.0.1:4318"),
        ("https://otel:tok3n@collector:4318/v1", "https://otel:(hidden)@collector:4318/v1"),
        ("https://user@collector", "https://user@collector"),
        ("http://[::1", "(unparseable URL, hidden)"),
    ],
)
def test_endpoint_credentials_are_hidden(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


def test_the_bind_address_is_loopback_unless_a_wildcard_is_written_out() -> None:
    assert RankwatchConfig().metrics_addr == "127.0.0.1"
    assert RankwatchConfig.from_env({}).metrics_addr == "127.0.0.1"
    for addr in ("0.0.0.0", "::", "::1", "10.0.0.7", "localhost", "node-1.cluster.local"):
        assert RankwatchConfig.from_env({"RANKWATCH_METRICS_ADDR": addr}).metrics_addr == addr
    for addr in ("", " ", "0.0.0.0:9464", "http://node", "[::]", "a b"):
        with pytest.raises(ValueError, match=r"metrics_addr \(RANKWATCH_METRICS_ADDR\)"):
            RankwatchConfig.from_env({"RANKWATCH_METRICS_ADDR": addr})
        with pytest.raises(ValueError, match="RANKWATCH_METRICS_ADDR"):
            RankwatchConfig(metrics_addr=addr)


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
    with pytest.raises(
        ValueError, match=r"NormalConfig\.notify_ratio .*must be a finite number > 0, <= 1, got inf"
    ):
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


# --------------------------------------------------------------------------- one object


def test_no_variable_is_declared_twice() -> None:
    options = config_options()
    names = [o.env for o in options]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    assert len({o.label for o in options}) == len(options)
    assert len({o.path for o in options}) == len(options)
    assert all_env_variables() == {o.env: (o.label, o.default) for o in options}


def test_every_settings_class_is_part_of_the_one_object() -> None:
    # A settings class RankwatchConfig does not nest would be read by a from_env of its own: a
    # second object that can disagree with the first, and variables left out of the docs.
    declared = {o.label for o in config_options()}
    option_fields = 0
    for module in (diagnosis_config, exporter_config):
        for name in dir(module):
            cls = getattr(module, name)
            if not (isinstance(cls, type) and is_dataclass(cls)):
                continue
            for f in fields(cls):
                if "env" in f.metadata:
                    assert f"{cls.__name__}.{f.name}" in declared, f"{module.__name__}.{name}"
                    option_fields += 1
    assert option_fields == len(declared)


@dataclass(frozen=True)
class _NestedTwice:
    first: NormalConfig = field(default_factory=NormalConfig)
    second: NormalConfig = field(default_factory=NormalConfig)


@dataclass(frozen=True)
class _SameVariable:
    port: int = field(default=1, metadata=option("RANKWATCH_METRICS_PORT"))
    inner: RankwatchConfig = field(default_factory=RankwatchConfig)


def test_a_variable_declared_twice_is_refused_naming_both_fields() -> None:
    with pytest.raises(
        ValueError,
        match=r"DEEPEP_DIAGNOSE_NOTIFY_RATIO: declared by both NormalConfig\.notify_ratio "
        r"\(at first\.notify_ratio\) and NormalConfig\.notify_ratio \(at second\.notify_ratio\)",
    ):
        declared_options(_NestedTwice)
    with pytest.raises(
        ValueError,
        match=r"RANKWATCH_METRICS_PORT: declared by both _SameVariable\.port \(at port\) and "
        r"RankwatchConfig\.metrics_port \(at inner\.metrics_port\)",
    ):
        declared_options(_SameVariable)


def test_deepep_settings_are_part_of_the_one_object() -> None:
    env = {
        "DEEPEP_DIAGNOSE_ENABLE": "1",
        "DEEPEP_DIAGNOSE_SYNC_STEP": "7",
        "DEEPEP_DIAGNOSE_NOTIFY_RATIO": "0.3",
    }
    cfg = RankwatchConfig.from_env(env)
    assert cfg.deepep == DeepEPConfig(enable=True, sync_step=7) == DeepEPConfig.from_env(env)
    assert cfg.diagnosis.normal.notify_ratio == 0.3
    assert RankwatchConfig().deepep == DeepEPConfig()
    # An override replaces the nested object whole: the environment's DeepEP values are unused.
    mine = DeepEPConfig(enable=True, async_mode=False, sync_step=3)
    assert RankwatchConfig.from_env(env, deepep=mine).deepep is mine
    # A bad DeepEP value fails the load of the one object, by name.
    with pytest.raises(
        ValueError, match=r"DeepEPConfig\.sync_step \(DEEPEP_DIAGNOSE_SYNC_STEP\).*'soon'"
    ):
        RankwatchConfig.from_env({"DEEPEP_DIAGNOSE_SYNC_STEP": "soon"})


@pytest.mark.parametrize("bad", [None, {"enable": True}, DiagnosisConfig(), "deepep"])
def test_deepep_must_be_a_deepep_config(bad: Any) -> None:
    message = rf"RankwatchConfig\.deepep: expected a DeepEPConfig, got {re.escape(repr(bad))}"
    with pytest.raises(TypeError, match=message):
        RankwatchConfig.from_env({}, deepep=bad)
    with pytest.raises(TypeError, match=message):
        RankwatchConfig(deepep=bad)


# --------------------------------------------------------------------------- launcher variables


@pytest.mark.parametrize("bad", ["one", "-1", "+2", "1_0", "1.0", "٣"])
def test_local_rank_is_strict_for_init_and_lenient_elsewhere(
    bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(
        ValueError,
        match=rf"LOCAL_RANK: expected a non-negative integer, got {re.escape(repr(bad))}",
    ):
        local_rank_from_env({"LOCAL_RANK": bad}, strict=True)
    with caplog.at_level(logging.WARNING, logger="rankwatch.exporter.identity"):
        assert local_rank_from_env({"LOCAL_RANK": bad}) is None
    assert f"LOCAL_RANK: expected a non-negative integer, got {bad!r}" in caplog.text


def test_local_rank_and_rank_values(monkeypatch: pytest.MonkeyPatch) -> None:
    for strict in (False, True):
        assert local_rank_from_env({}, strict=strict) is None
        assert local_rank_from_env({"LOCAL_RANK": " "}, strict=strict) is None
        assert local_rank_from_env({"LOCAL_RANK": " 3 "}, strict=strict) == 3
        assert local_rank_from_env({"LOCAL_RANK": "0"}, strict=strict) == 0
    # The process environment by default; the labels' reader falls back to local rank 0.
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert local_rank_from_env() == 5 == local_identity()[1]
    monkeypatch.setenv("LOCAL_RANK", "-1")
    assert local_identity()[1] == 0
    assert rank_from_env({}) is None
    assert rank_from_env({"RANK": "12"}) == 12
    for bad in ("x", "-1", "1e3"):
        with pytest.raises(
            ValueError, match=rf"RANK: expected a non-negative integer, got '{bad}'"
        ):
            rank_from_env({"RANK": bad})
