"""Thresholds and durations as the dashboards' and alerts' prose writes them."""

from __future__ import annotations

from rankwatch.diagnosis.config import StepTimeConfig

__all__ = ["count_words", "duration_words", "number", "percent", "straggler_percents"]


def percent(ratio: float) -> str:
    """A ratio as a percentage for prose: 0.1 -> ``"10"``, 0.125 -> ``"12.5"``."""
    return f"{ratio * 100:g}"


def straggler_percents(policy: StepTimeConfig) -> tuple[str, str]:
    """The warning and critical straggler scores as percentages for prose."""
    return percent(policy.straggler_warning_score), percent(policy.straggler_critical_score)


def number(value: float) -> str:
    """A threshold for prose: 1.3 -> ``"1.3"``, 2.0 -> ``"2"``."""
    return f"{value:g}"


def duration_words(seconds: float) -> str:
    """A duration for prose: 60 -> ``"a minute"``, 180 -> ``"3 minutes"``, 90 -> ``"90 s"``."""
    if seconds == 60:
        return "a minute"
    if seconds > 0 and seconds % 60 == 0:
        return f"{seconds / 60:g} minutes"
    return f"{seconds:g} s"


_SMALL_NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def count_words(n: int) -> str:
    """A small count for prose: 3 -> ``"three"``; 10 and more in digits."""
    return _SMALL_NUMBERS[n] if 0 <= n < len(_SMALL_NUMBERS) else str(n)
