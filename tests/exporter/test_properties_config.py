"""The config loaders on any environment: a valid config or a ValueError/TypeError naming the
variable (or its field); a loaded config always holds values its own validation accepts.

Covers ``DiagnosisConfig.from_env``, ``RankwatchConfig.from_env`` (environment and keyword
overrides; its nested ``deepep`` and ``diagnosis`` objects included) and
``DeepEPConfig.from_env``, over every variable they read, with the kinds of text
people put in environment variables (spaces, signs, exponents, underscores, other digit scripts,
``nan``/``inf``, very long numbers, control characters).
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.config import DiagnosisConfig, declared_options, validate_options
from rankwatch.exporter.config import (
    DeepEPConfig,
    RankwatchConfig,
    all_env_variables,
    config_options,
)

VARIABLES = all_env_variables()  # {env name: (Class.field, default)}
# Each loader with the variables it reads, found by walking the object it builds.
LOADERS = {
    name: (cls.from_env, {o.env for o in declared_options(cls)})
    for name, cls in (
        ("diagnosis", DiagnosisConfig),
        ("exporter", RankwatchConfig),
        ("deepep", DeepEPConfig),
    )
}
OPTIONS = {o.env: o for o in config_options()}

number_like = st.one_of(
    st.integers(-(10**6), 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        [
            "",
            " ",
            "0",
            "1",
            "-0",
            "+5",
            " 7 ",
            "1e3",
            "1E-3",
            "1_000",
            "0x10",
            "0o7",
            "nan",
            "-inf",
            "Infinity",
            "1e400",
            "9" * 5000,
            "٣",
            "１２",
            "1.5",
            "true",
            "off",
            "YES",
            "\x00",
            "1\n",
            "ddp",
            "fsdp",
            "FSDP",
        ]
    ),
)
env_values = st.one_of(number_like, st.text(max_size=12))


def names_variable(exc: BaseException, names: set[str]) -> None:
    """The message names one of the variables set (or the field behind it)."""
    assert isinstance(exc, (ValueError, TypeError)), repr(exc)
    text = str(exc)
    words = set(names)
    for name in names:
        words.add(VARIABLES[name][0].split(".", 1)[1])  # the field name
    assert any(w in text for w in words), f"{text!r} names none of {sorted(names)}"


def check_valid(config: Any) -> None:
    """Everything in a loaded config passes validation again, and numbers are finite."""
    validate_options(config)
    for f in fields(config):
        value = getattr(config, f.name)
        if hasattr(value, "__dataclass_fields__"):
            check_valid(value)
        elif isinstance(value, float):
            assert math.isfinite(value), (f.name, value)


@settings(max_examples=400, deadline=None)
@given(
    loader=st.sampled_from(sorted(LOADERS)),
    data=st.data(),
)
def test_any_environment_gives_a_valid_config_or_names_the_variable(loader: str, data: Any) -> None:
    load, variables = LOADERS[loader]
    chosen = data.draw(st.sets(st.sampled_from(sorted(variables)), min_size=1, max_size=4))
    env = {name: data.draw(env_values) for name in chosen}
    # Unrelated variables are ignored, whatever they hold.
    env.update(
        data.draw(
            st.dictionaries(st.sampled_from(["PATH", "RANKWATCH", "DEEPEP_X"]), st.text(max_size=5))
        )
    )
    try:
        config = load(env)
    except Exception as exc:
        names_variable(exc, chosen)
        return
    check_valid(config)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(VARIABLES)),
    raw=env_values,
)
def test_every_variable_alone_loads_or_is_refused_by_name(name: str, raw: str) -> None:
    """One variable at a time, through the one object that holds every option; a value that
    loads is the value the loader parsed (no silent default)."""
    try:
        config = RankwatchConfig.from_env({name: raw})
    except Exception as exc:
        names_variable(exc, {name})
        return
    check_valid(config)
    value = OPTIONS[name].value_in(config)
    if isinstance(value, bool):
        assert raw.strip().lower() in ("1", "0", "true", "false", "on", "off", "yes", "no", "")
    elif isinstance(value, (int, float)):
        assert value == type(value)(raw)
    elif name == "RANKWATCH_RUN_ID":
        # The run name is read stripped; blank is unset, and no launcher names this one.
        assert value == raw.strip()
    else:
        assert value == raw


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.builds(object),
)


@settings(max_examples=300, deadline=None)
@given(
    overrides=st.dictionaries(
        st.sampled_from([f.name for f in fields(RankwatchConfig)] + ["no_such_option"]),
        junk,
        min_size=1,
        max_size=3,
    )
)
def test_any_keyword_overrides_give_a_valid_config_or_name_the_field(
    overrides: dict[str, Any],
) -> None:
    try:
        config = RankwatchConfig.from_env(env={}, **overrides)
    except Exception as exc:
        assert isinstance(exc, (ValueError, TypeError)), repr(exc)
        assert any(k in str(exc) for k in overrides), f"{exc!r} names none of {sorted(overrides)}"
        return
    check_valid(config)
    assert isinstance(config.diagnosis, DiagnosisConfig)
    assert isinstance(config.deepep, DeepEPConfig)


@settings(max_examples=100, deadline=None)
@given(
    part=st.sampled_from(["step_time", "normal", "low_latency"]),
    value=junk,
)
def test_diagnosis_parts_must_be_their_config_types(part: str, value: Any) -> None:
    try:
        DiagnosisConfig(**{part: value})
    except TypeError as exc:
        assert f"DiagnosisConfig.{part}" in str(exc)
    else:
        raise AssertionError(f"DiagnosisConfig({part}={value!r}) was accepted")
