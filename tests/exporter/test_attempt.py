"""The attempt: a restart of the same run counts up (``exporter/attempt.py``, the config)."""

from __future__ import annotations

import pytest

from rankwatch.exporter.attempt import MAX_ATTEMPT, Attempt, attempt_from_env
from rankwatch.exporter.config import RankwatchConfig

CASES = [
    ({}, Attempt(0, "")),
    ({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3"}, Attempt(0, "")),
    (
        {"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3"},
        Attempt(2, "TORCHELASTIC_RESTART_COUNT"),
    ),
    ({"SLURM_RESTART_COUNT": "1"}, Attempt(1, "SLURM_RESTART_COUNT")),
    ({"JOBSET_RESTART_ATTEMPT": "4"}, Attempt(4, "JOBSET_RESTART_ATTEMPT")),
    # A requeued Slurm job whose torchrun may restart twice: 3, 4, 5 in its second allocation.
    (
        {
            "SLURM_RESTART_COUNT": "1",
            "TORCHELASTIC_RESTART_COUNT": "1",
            "TORCHELASTIC_MAX_RESTARTS": "2",
        },
        Attempt(4, "SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT"),
    ),
    ({"SLURM_RESTART_COUNT": " ", "TORCHELASTIC_RESTART_COUNT": ""}, Attempt(0, "")),
]


@pytest.mark.parametrize(("env", "want"), CASES)
def test_the_attempt_comes_from_the_launchers_restart_count(env, want):
    assert attempt_from_env(env) == want


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT: expected"),
        ({"SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT: expected"),
        ({"JOBSET_RESTART_ATTEMPT": "1.5"}, "JOBSET_RESTART_ATTEMPT: expected"),
        ({"SLURM_RESTART_COUNT": "+1"}, "SLURM_RESTART_COUNT: expected"),
        ({"SLURM_RESTART_COUNT": str(MAX_ATTEMPT + 1)}, "SLURM_RESTART_COUNT: expected"),
        (
            {
                "SLURM_RESTART_COUNT": str(MAX_ATTEMPT),
                "TORCHELASTIC_RESTART_COUNT": "1",
                "TORCHELASTIC_MAX_RESTARTS": "1",
            },
            "combined attempt",
        ),
        (
            # Read only beside a scheduler's count: the product needs it.
            {
                "SLURM_RESTART_COUNT": "1",
                "TORCHELASTIC_RESTART_COUNT": "1",
                "TORCHELASTIC_MAX_RESTARTS": "many",
            },
            "TORCHELASTIC_MAX_RESTARTS: expected",
        ),
    ],
)
def test_a_count_that_is_not_one_is_refused_naming_the_variable(env, named):
    with pytest.raises(ValueError, match=named) as err:
        attempt_from_env(env)
    assert "\n" not in str(err.value)


def test_attempt_from_env_refuses_what_is_not_a_mapping():
    with pytest.raises(TypeError, match="env: expected a mapping"):
        attempt_from_env(["SLURM_RESTART_COUNT=1"])  # type: ignore[arg-type]


def test_the_config_takes_the_launchers_attempt_and_ours_wins():
    assert RankwatchConfig.from_env({}).attempt == 0
    assert RankwatchConfig.from_env({"TORCHELASTIC_RESTART_COUNT": "2"}).attempt == 2
    env = {"TORCHELASTIC_RESTART_COUNT": "2", "RANKWATCH_ATTEMPT": "7"}
    assert RankwatchConfig.from_env(env).attempt == 7
    assert RankwatchConfig.from_env(env, attempt=3).attempt == 3


@pytest.mark.parametrize("value", ["-1", "x", "1000001", "1e3"])
def test_a_bad_rankwatch_attempt_names_the_field_and_value(value):
    with pytest.raises(ValueError, match="RANKWATCH_ATTEMPT") as err:
        RankwatchConfig.from_env({"RANKWATCH_ATTEMPT": value})
    assert value in str(err.value)
