"""The corpus of bad configuration values: each one is refused at load with a one-line error
naming the variable, the value as written and what is allowed.

Two parts. ``REVIEWED`` is written out by hand: the values a reliability review tried (huge but
finite intervals and timeouts, an empty bind address, a user with ':', pairs that disagree),
each with the fragment its error must hold. ``swept()`` derives, for every declared option, the
kinds of bad text people put in variables: non-numbers, negatives, zero where it is invalid,
NaN and infinities, values beyond the top of the range, a wrong switch or choice, text that is
not UTF-8 or far too long. docs/configuration.md states the size of the corpus; a test below
keeps that figure true.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

import pytest

from rankwatch.diagnosis.config import MAX_TEXT_CHARS
from rankwatch.exporter.config import RankwatchConfig, config_options
from tests.servers import REPO

PASSWORD = "hunter2-s3cret"
AUTH = {"RANKWATCH_METRICS_BASIC_AUTH_USER": "prom", "RANKWATCH_METRICS_BASIC_AUTH_PASSWORD": "pw"}

# (environment, the variable the error must name, the fragment it must hold)
REVIEWED: list[tuple[dict[str, str], str, str]] = [
    # huge but finite values that used to pass and then kill a thread or the start-up
    ({"RANKWATCH_OTLP_EXPORT_INTERVAL_SECONDS": "1e10"}, "", "must be > 0, <= 3600, got '1e10'"),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "1e13"}, "", "<= 3600000, got '1e13' (milliseconds)"),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "x"}, "", "expected a number of milliseconds, got 'x'"),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "0"}, "", "must be > 0, <= 3600000, got '0'"),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "-5"}, "", "got '-5' (milliseconds)"),
    ({"OTEL_METRIC_EXPORT_INTERVAL": "nan"}, "", "must be a finite number > 0"),
    ({"RANKWATCH_INTERVAL_SECONDS": "1e10"}, "", "must be > 0, <= 3600, got '1e10'"),
    ({"RANKWATCH_GATHER_TIMEOUT_SECONDS": "1e300"}, "", "<= 3600, got '1e300'"),
    ({"RANKWATCH_SUMMARY_WINDOW_STEPS": "1000000000000"}, "", "<= 100000"),
    ({"RANKWATCH_SUMMARY_WINDOW_STEPS": "1e12"}, "", "expected an int >= 2, <= 100000"),
    ({"RANKWATCH_SHUTDOWN_TIMEOUT_SECONDS": "1e9"}, "", "<= 600, got '1e9'"),
    ({"DEEPEP_DIAGNOSE_INTERVAL": "1e10"}, "", "<= 3600, got '1e10'"),
    ({"DEEPEP_DIAGNOSE_WARMUP_SECONDS": "1e12"}, "", "<= 86400"),
    ({"RANKWATCH_MAX_BUFFERED_STEPS": "99999999999"}, "", "<= 1000000"),
    ({"RANKWATCH_LIVE_WINDOW_STEPS": "50000"}, "", "<= 10000, got '50000'"),
    ({"RANKWATCH_CELL_BUDGET": "16777216"}, "", "<= 1048576"),
    # ranges, as before
    ({"RANKWATCH_METRICS_PORT": "70000"}, "", "must be >= 0, <= 65535, got '70000'"),
    ({"RANKWATCH_METRICS_PORT": "-1"}, "", ">= 0, <= 65535, got '-1'"),
    ({"RANKWATCH_INTERVAL_SECONDS": "-2.5"}, "", "> 0, <= 3600, got '-2.5'"),
    ({"RANKWATCH_INTERVAL_SECONDS": "nan"}, "", "must be a finite number"),
    ({"RANKWATCH_GATHER_TIMEOUT_SECONDS": "inf"}, "", "must be a finite number"),
    ({"RANKWATCH_SYNC_STEP": "2.5"}, "", "expected an int >= 1, <= 1000000, got '2.5'"),
    ({"RANKWATCH_OTLP_PROCESS_MIN_POINTS": "1e3"}, "", "expected an int >= 0"),
    ({"RANKWATCH_ARTIFACT_RETENTION": "-1"}, "", ">= 0, <= 100000, got '-1'"),
    ({"RANKWATCH_STRATEGY": "zero3"}, "", "must be one of ['', 'ddp', 'fsdp'], got 'zero3'"),
    ({"RANKWATCH_ENABLE": "maybe"}, "", "expected a boolean (1/0, true/false, on/off)"),
    ({"RANKWATCH_CAUSE_COVERAGE_MIN": "1.5"}, "", "must be > 0, <= 1, got '1.5'"),
    ({"RANKWATCH_STRAGGLER_WARNING_SCORE": "2"}, "", "must be > 0, <= 1, got '2'"),
    ({"DEEPEP_DIAGNOSE_AXIS_SLOWDOWN": "1.0"}, "", "must be > 1, <= 100, got '1.0'"),
    ({"DEEPEP_DIAGNOSE_EXCLUDING_ZEROS": "2"}, "", "must be >= 0, <= 1, got '2'"),
    ({"DEEPEP_DIAGNOSE_THRESHOLD_COL": "-3"}, "", "> 0, <= 100000, got '-3'"),
    # the bind address: empty is refused by name, a port or a scheme is not an address
    ({"RANKWATCH_METRICS_ADDR": ""}, "", "must not be empty (an empty address listens on every"),
    ({"RANKWATCH_METRICS_ADDR": "  "}, "", "must not be empty"),
    ({"RANKWATCH_METRICS_ADDR": "0.0.0.0:9464"}, "", "must be an IP address or a host name"),
    ({"RANKWATCH_METRICS_ADDR": "http://node-1"}, "", "(no port, scheme or spaces)"),
    ({"RANKWATCH_METRICS_ADDR": "node 1"}, "", "must be an IP address or a host name"),
    # text options
    ({"RANKWATCH_NODE_NAME_ENV": "spec.nodeName"}, "", "must name an environment variable"),
    ({"RANKWATCH_RUN_ID": "r" * 300}, "", "must be at most 256 characters"),
    ({"RANKWATCH_GROUP": "bad\udcff"}, "", "must be valid UTF-8 text"),
    ({"RANKWATCH_ARTIFACT_DIR": "d" * 5000}, "", "must be at most 4096 characters"),
    (
        {**AUTH, "RANKWATCH_METRICS_BASIC_AUTH_USER": "pro:m"},
        "RANKWATCH_METRICS_BASIC_AUTH_USER",
        "must not contain ':', got 'pro:m'",
    ),
    # pairs: the error names the variables, never the password
    (
        {"RANKWATCH_METRICS_BASIC_AUTH_USER": "prom"},
        "RANKWATCH_METRICS_BASIC_AUTH_PASSWORD",
        "set both or neither, got user='prom' and no password",
    ),
    (
        {"RANKWATCH_METRICS_BASIC_AUTH_PASSWORD": PASSWORD},
        "RANKWATCH_METRICS_BASIC_AUTH_USER",
        "set both or neither, got user='' and a password",
    ),
    (
        {"RANKWATCH_METRICS_TLS_CERT_FILE": "cert.pem"},
        "RANKWATCH_METRICS_TLS_KEY_FILE",
        "set both or neither, got cert='cert.pem' key=''",
    ),
    (
        {"RANKWATCH_INCIDENT_OPEN_K": "4", "RANKWATCH_INCIDENT_OPEN_N": "3"},
        "RANKWATCH_INCIDENT_OPEN_K",
        "must be <= incident_open_n (RANKWATCH_INCIDENT_OPEN_N) 3, got 4",
    ),
    (
        {"RANKWATCH_STRAGGLER_WARNING_SCORE": "0.3", "RANKWATCH_STRAGGLER_CRITICAL_SCORE": "0.2"},
        "RANKWATCH_STRAGGLER_CRITICAL_SCORE",
        "must be >= straggler_warning_score (0.3), got 0.2",
    ),
    (
        {"RANKWATCH_MIN_STEPS_WARNING": "30"},
        "RANKWATCH_MIN_STEPS_CRITICAL",
        "must be >= min_steps_warning (30), got 20",
    ),
    (
        {"RANKWATCH_NORMAL_HISTORY_BOOTSTRAP": "17"},
        "RANKWATCH_NORMAL_HISTORY_HORIZON",
        "must be >= history_bootstrap (17), got 16",
    ),
]


def _kind(label: str) -> str:
    """The declared type of option ``Class.field`` (``int``, ``float``, ``bool`` or ``str``)."""
    owner, _, name = label.partition(".")
    holders: list[Any] = [RankwatchConfig()]
    while holders:
        obj = holders.pop()
        for f in fields(obj):
            value = getattr(obj, f.name)
            if type(obj).__name__ == owner and f.name == name:
                return str(f.type)
            if hasattr(value, "__dataclass_fields__"):
                holders.append(value)
    raise AssertionError(label)


def swept() -> list[tuple[dict[str, str], str, str]]:
    """Bad text of every kind for every declared option, with what its error must say."""
    cases: list[tuple[dict[str, str], str, str]] = []
    for opt in config_options():
        env, kind = opt.env, _kind(opt.label)
        extra = AUTH if env in AUTH else {}

        def add(raw: str, fragment: str, env: str = env, extra: dict[str, str] = extra) -> None:
            cases.append(({**extra, env: raw}, env, fragment))

        if kind == "bool":
            for raw in ("maybe", "2", "-1", "nan", "enable"):
                add(raw, "expected a boolean")
            continue
        if kind == "str":
            add("x\udcfe", "must be valid UTF-8 text")
            add("x" * (MAX_TEXT_CHARS + 1), "characters")
            if env == "RANKWATCH_STRATEGY":
                for raw in ("zero3", "DDP", "ddp,fsdp"):
                    add(raw, "must be one of")
            continue
        lo_text, _, hi_text = opt.allowed.partition(", ")
        lo = float(lo_text.split()[1])
        hi = float(hi_text.split()[1])
        noun = "an int" if kind == "int" else "a number"
        for raw in ("soon", "", "0x10", "1,5"):
            add(raw, f"expected {noun} {opt.allowed}")
        for raw in ("nan", "inf", "-inf"):
            add(raw, f"must be a finite number {opt.allowed}" if kind == "float" else noun)
        for raw in sorted({str(int(lo) - 1), "-1"}):
            if float(raw) < lo:
                add(raw, f"must be {opt.allowed}")
        if lo_text.startswith(">") and not lo_text.startswith(">="):
            add(str(int(lo)), f"must be {opt.allowed}")
        add(str(int(hi) + 1), f"must be {opt.allowed}")
        add("9" * 40, f"must be {opt.allowed}")
        if kind == "float":
            add("1e300", f"must be {opt.allowed}")
        else:
            add("1.5", f"expected an int {opt.allowed}")
    return cases


CORPUS = [*REVIEWED, *swept()]


def _case_id(case: tuple[dict[str, str], str, str]) -> str:
    env, _, _ = case
    return ",".join(f"{k}={v[:12]!r}" for k, v in env.items() if k not in AUTH or len(env) == 1)


@pytest.mark.parametrize("case", CORPUS, ids=[_case_id(c) for c in CORPUS])
def test_bad_value_is_refused_naming_variable_value_and_range(
    case: tuple[dict[str, str], str, str],
) -> None:
    env, variable, fragment = case
    with pytest.raises((ValueError, TypeError)) as err:
        RankwatchConfig.from_env(env)
    message = str(err.value)
    assert "\n" not in message, message
    assert fragment in message, message
    named = variable or next(iter(env))
    assert named in message, message
    # The value as written, when it fits on a line (long text is shown cut, with its length).
    raw = env.get(named)
    if raw is not None and len(raw) <= 60 and not named.endswith("_PASSWORD"):
        assert repr(raw) in message or raw in message, message
    # No password is ever printed.
    password = env.get("RANKWATCH_METRICS_BASIC_AUTH_PASSWORD")
    if password:
        assert password not in message, message


def test_every_numeric_option_has_a_range_with_a_top() -> None:
    for opt in config_options():
        if _kind(opt.label) in ("int", "float"):
            assert re.fullmatch(r">=? -?[\d.]+, <= [\d.]+", opt.allowed), (opt.env, opt.allowed)


def test_the_corpus_size_in_the_docs_is_the_measured_one() -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    found = re.findall(r"(\d[\d,]*) of (\d[\d,]*) bad values", text)
    assert found, "docs/configuration.md states no tally of bad values"
    for given, total in found:
        assert int(given.replace(",", "")) == int(total.replace(",", "")) == len(CORPUS)
