"""Thresholds and defaults of the diagnosis engines, in one place.

Every field is named as in the specification it comes from, carries the environment variable
that overrides it, and is validated when the object is built: a bad value raises ``ValueError``
naming the field (and the variable) and the value. ``DiagnosisConfig.from_env()`` is the one
entry point the exporter uses; tests build the dataclasses directly.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields, is_dataclass
from typing import Any, TypeVar, get_type_hints

__all__ = [
    "MAX_TEXT_CHARS",
    "DeclaredOption",
    "DiagnosisConfig",
    "EnvOptions",
    "LowLatencyConfig",
    "NormalConfig",
    "StepTimeConfig",
    "allowed_range",
    "check_value",
    "config_or_default",
    "declared_options",
    "from_env",
    "option",
    "option_env",
    "option_label",
    "parse_bool",
    "shown_value",
    "validate_options",
]


# Strings are bounded too: a label value or a path longer than this is a mistake (a file pasted
# into a variable), and every series would carry it.
MAX_TEXT_CHARS = 4096


def option(
    env: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    choices: tuple[str, ...] | None = None,
    max_chars: int = MAX_TEXT_CHARS,
    rule: Callable[[str], str | None] | None = None,
    secret: bool = False,
) -> Any:
    """Field metadata: the overriding environment variable and what values it allows.

    Numbers: the range ``lo`` (exclusive with ``lo_open``) to ``hi``, both inclusive by
    default. Text: ``choices``, at most ``max_chars`` characters, and ``rule`` (a function
    returning what is wrong with a value, or None). ``secret``: the value is never printed (not
    in errors, ``repr`` or ``rankwatch config``); declare such a field with ``repr=False``.
    """
    return {
        "env": env,
        "lo": lo,
        "hi": hi,
        "lo_open": lo_open,
        "choices": choices,
        "max_chars": max_chars,
        "rule": rule,
        "secret": secret,
    }


def parse_bool(name: str, raw: str) -> bool:
    """Parse an on/off switch the way DeepXTrace callers write it (1/0, true/false, on/off)."""
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no", ""):
        return False
    raise ValueError(f"{name}: expected a boolean (1/0, true/false, on/off), got {raw!r}")


def allowed_range(meta: Mapping[str, Any]) -> str:
    """The range an option's metadata allows, as errors and the docs say it (``> 0, <= 3600``)."""
    parts = []
    if meta["lo"] is not None:
        parts.append(f"{'>' if meta['lo_open'] else '>='} {_number_text(meta['lo'])}")
    if meta["hi"] is not None:
        parts.append(f"<= {_number_text(meta['hi'])}")
    return ", ".join(parts)


def _number_text(bound: float) -> str:
    # 3600 rather than 3600.0; fractions as they are
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def shown_value(meta: Mapping[str, Any], value: Any) -> str:
    """How an error shows an option's value: its repr, or ``(hidden)`` for a secret."""
    return "(hidden)" if meta.get("secret") else repr(value)


def check_value(label: str, meta: Mapping[str, Any], kind: type, value: Any, shown: str) -> None:
    """Check one option's value against its declaration; ``shown`` is what errors print of it
    (the text as written in the environment, or the value's repr). Raises ``ValueError`` /
    ``TypeError`` naming ``label`` (field and variable), the value and what is allowed."""
    if kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{label}: expected a boolean, got {shown}")
        return
    if kind is str:
        _check_text(label, meta, value, shown)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{label}: expected a number, got {shown}")
    if kind is int and not isinstance(value, int):
        raise TypeError(f"{label}: expected an int, got {shown}")
    span = allowed_range(meta)
    if not math.isfinite(value):
        raise ValueError(f"{label}: must be a finite number {span}, got {shown}")
    lo, hi = meta["lo"], meta["hi"]
    too_low = lo is not None and (value <= lo if meta["lo_open"] else value < lo)
    if too_low or (hi is not None and value > hi):
        raise ValueError(f"{label}: must be {span}, got {shown}")


def _check_text(label: str, meta: Mapping[str, Any], value: Any, shown: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{label}: expected a string, got {shown}")
    try:
        # A byte that is not UTF-8 in an environment variable arrives as a lone surrogate; as a
        # label value it would make every /metrics scrape fail.
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{label}: must be valid UTF-8 text, got {shown}") from None
    if len(value) > meta["max_chars"]:
        shown = shown if meta.get("secret") else f"{value[:40]!r}... ({len(value)} characters)"
        raise ValueError(f"{label}: must be at most {meta['max_chars']} characters, got {shown}")
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ValueError(f"{label}: must be one of {list(meta['choices'])}, got {shown}")
    problem = None if meta["rule"] is None else meta["rule"](value)
    if problem is not None:
        raise ValueError(f"{label}: {problem}, got {shown}")


def option_label(cls: type, name: str) -> str:
    """How errors name field ``name`` of the config class ``cls``: ``Class.field (VARIABLE)``."""
    return f"{cls.__name__}.{name} ({option_env(cls, name)})"


def validate_options(obj: Any) -> None:
    """Check every field that carries ``option`` metadata; raise naming field, variable, value
    and what is allowed (see :func:`check_value`)."""
    for f in fields(obj):
        meta = f.metadata
        if "env" not in meta:
            continue
        value = getattr(obj, f.name)
        label = f"{type(obj).__name__}.{f.name} ({meta['env']})"
        check_value(label, meta, _field_kind(f.type), value, shown_value(meta, value))
    # Nested config objects are read by background threads: a wrong type fails here, by name.
    cls: type = type(obj)
    for name, kind in _nested_configs(cls):
        value = getattr(obj, name)
        if not isinstance(value, kind):
            raise TypeError(f"{cls.__name__}.{name}: expected a {kind.__name__}, got {value!r}")


def option_env(cls: type, name: str) -> str:
    """The environment variable that field ``name`` of the config class ``cls`` declares (for
    code that must mention a variable: it names it through its one declaration)."""
    for f in fields(cls):
        if f.name == name and "env" in f.metadata:
            return str(f.metadata["env"])
    raise ValueError(f"name: {cls.__name__} has no option field {name!r}")


@functools.cache
def _nested_configs(cls: type) -> tuple[tuple[str, type], ...]:
    """The fields of the config dataclass ``cls`` that hold a nested config object (no
    :func:`option` metadata, a dataclass type): ``(name, class)`` in field order."""
    plain = [f for f in fields(cls) if "env" not in f.metadata]
    if not plain:
        return ()
    # Annotations are strings under ``from __future__ import annotations``; resolve them in the
    # module that defines ``cls``.
    hints = get_type_hints(cls)
    return tuple(
        (f.name, kind)
        for f in plain
        if isinstance(kind := hints.get(f.name), type) and is_dataclass(kind)
    )


def _field_kind(annotation: Any) -> type:
    # Annotations are strings under ``from __future__ import annotations``.
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return {"int": int, "float": float, "str": str, "bool": bool}.get(name, float)


def _parse(cls_name: str, f: Field[Any], raw: str) -> Any:
    """One variable's text as the field's value, checked against its declaration; errors show
    the text as written (``'1e10'``, not ``10000000000.0``)."""
    meta, kind = f.metadata, _field_kind(f.type)
    label = f"{cls_name}.{f.name} ({meta['env']})"
    shown = shown_value(meta, raw)
    if kind is bool:
        return parse_bool(label, raw)
    if kind is str:
        value: Any = raw
    else:
        try:
            value = kind(raw)
        except ValueError:
            noun = "an int" if kind is int else "a number"
            raise ValueError(
                f"{label}: expected {noun} {allowed_range(meta)}, got {shown}"
            ) from None
    check_value(label, meta, kind, value, shown)
    return value


_C = TypeVar("_C")


def from_env(cls: type[_C], env: Mapping[str, str] | None = None, **overrides: Any) -> _C:
    """Build a config dataclass from environment variables, then keyword overrides.

    Only fields with ``option`` metadata read the environment; overrides may set any field.
    Unknown override names raise ``TypeError``; bad values raise ``ValueError``.
    """
    source = os.environ if env is None else env
    kwargs: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        name = f.metadata.get("env")
        if name is None or name not in source:
            continue
        kwargs[f.name] = _parse(cls.__name__, f, source[name])
    unknown = set(overrides) - {f.name for f in fields(cls)}  # type: ignore[arg-type]
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown option(s) {sorted(unknown)}")
    kwargs.update(overrides)
    return cls(**kwargs)


@dataclass(frozen=True)
class DeclaredOption:
    """One environment variable and the one config field that declares it."""

    env: str
    # Declaring class and field, e.g. ``NormalConfig.notify_ratio``: what validation errors,
    # the docs tables and ``rankwatch config`` name.
    label: str
    # Attribute path from the object that was walked, e.g. ``("diagnosis", "normal",
    # "notify_ratio")`` from a ``RankwatchConfig``.
    path: tuple[str, ...]
    default: Any
    # Never printed: ``rankwatch config`` and errors show ``(hidden)`` instead.
    secret: bool = False
    # What the option allows, e.g. ``> 0, <= 3600`` (empty for switches and free text).
    allowed: str = ""

    def value_in(self, root: Any) -> Any:
        """This option's value in ``root``, an instance of the class that was walked."""
        value = root
        for name in self.path:
            value = getattr(value, name)
        return value


def declared_options(root: type) -> tuple[DeclaredOption, ...]:
    """Every option of the config dataclass ``root`` and of the config objects nested in it,
    in field order (a nested object's options at its field's place).

    A field with :func:`option` metadata declares its variable; a field without it whose type is
    a dataclass is a nested config object and is walked. A variable declared by two fields (or
    a config class nested twice) raises ``ValueError`` naming both: each variable must have
    exactly one field, or one environment would set two settings that can drift apart.
    """
    found: list[DeclaredOption] = []
    owner: dict[str, str] = {}

    def walk(cls: type, prefix: tuple[str, ...]) -> None:
        nested = dict(_nested_configs(cls))
        for f in fields(cls):
            path = (*prefix, f.name)
            if "env" in f.metadata:
                env, label = f.metadata["env"], f"{cls.__name__}.{f.name}"
                where = f"{label} (at {'.'.join(path)})"
                if env in owner:
                    raise ValueError(
                        f"{env}: declared by both {owner[env]} and {where}; "
                        "a variable must have exactly one field"
                    )
                owner[env] = where
                allowed = "" if _field_kind(f.type) in (bool, str) else allowed_range(f.metadata)
                secret = bool(f.metadata.get("secret"))
                found.append(DeclaredOption(env, label, path, f.default, secret, allowed))
                continue
            if f.name in nested:
                walk(nested[f.name], path)

    walk(root, ())
    return tuple(found)


_O = TypeVar("_O", bound="EnvOptions")


class EnvOptions:
    """Base of the option objects: validated when built, loaded from the environment.

    A subclass is a frozen dataclass whose fields carry :func:`option` metadata; one that checks
    more than the fields one by one extends ``__post_init__`` (calling this one first).
    """

    def __post_init__(self) -> None:
        validate_options(self)

    @classmethod
    def from_env(cls: type[_O], env: Mapping[str, str] | None = None, **overrides: Any) -> _O:
        """The environment's variables first (``os.environ`` by default), then keyword
        overrides; every value validated."""
        return from_env(cls, env, **overrides)


def config_or_default(config: object, kind: type[_O], error: type[Exception] = TypeError) -> _O:
    """``config`` when it is a ``kind``, ``kind()`` when it is None; ``error`` naming the field
    and the type otherwise (the check every engine's public entry point makes)."""
    if config is None:
        return kind()
    if not isinstance(config, kind):
        raise error(f"config: expected {kind.__name__} or None, got {type(config).__name__}")
    return config


# Upper bounds of the diagnosis options: generous for any real use, low enough that no value
# that passes can exhaust memory (the summary window's block sums grow with its steps and the
# ranks) or make a rule meaningless.
MAX_WINDOW_STEPS = 100_000
MAX_LIVE_WINDOW_STEPS = 10_000  # the root keeps about twice this many rows per rank
MAX_FACTOR = 100.0  # slowdown factors and robust scores
MAX_HISTORY_WINDOWS = 1_000
# Low-latency ratios compare a row, column or cell with the matrix mean: above the EP size
# they can never fire, and no EP group is larger than this.
MAX_MATRIX_RATIO = 100_000.0


@dataclass(frozen=True)
class StepTimeConfig(EnvOptions):
    """Step-time rank-straggler policy (TraceML's Step Time rules)."""

    straggler_warning_score: float = field(
        default=0.10, metadata=option("RANKWATCH_STRAGGLER_WARNING_SCORE", 0.0, 1.0, lo_open=True)
    )
    straggler_critical_score: float = field(
        default=0.20, metadata=option("RANKWATCH_STRAGGLER_CRITICAL_SCORE", 0.0, 1.0, lo_open=True)
    )
    cause_coverage_min: float = field(
        default=0.80, metadata=option("RANKWATCH_CAUSE_COVERAGE_MIN", 0.0, 1.0, lo_open=True)
    )
    bottleneck_warning_share: float = field(
        default=0.10, metadata=option("RANKWATCH_BOTTLENECK_WARNING_SHARE", 0.0, 1.0, lo_open=True)
    )
    compute_bound_share: float = field(
        default=0.90, metadata=option("RANKWATCH_COMPUTE_BOUND_SHARE", 0.0, 1.0, lo_open=True)
    )
    min_steps_warning: int = field(
        default=2, metadata=option("RANKWATCH_MIN_STEPS_WARNING", 1, MAX_WINDOW_STEPS)
    )
    min_steps_critical: int = field(
        default=20, metadata=option("RANKWATCH_MIN_STEPS_CRITICAL", 1, MAX_WINDOW_STEPS)
    )
    live_window_steps: int = field(
        default=100, metadata=option("RANKWATCH_LIVE_WINDOW_STEPS", 2, MAX_LIVE_WINDOW_STEPS)
    )
    summary_window_steps: int = field(
        default=10_000, metadata=option("RANKWATCH_SUMMARY_WINDOW_STEPS", 2, MAX_WINDOW_STEPS)
    )
    # Robust windows: a rank's step whose outer step exceeds this factor x the rank's median
    # over the window is left out of its means (a checkpoint save, an evaluation pause, a
    # recompile), when at most ``outlier_steps_max_fraction`` of the window's steps are such;
    # more are the job's normal and stay in. A fraction of 0 keeps every step.
    outlier_step_factor: float = field(
        default=5.0,
        metadata=option("RANKWATCH_OUTLIER_STEP_FACTOR", 1.0, MAX_FACTOR, lo_open=True),
    )
    outlier_steps_max_fraction: float = field(
        default=0.05, metadata=option("RANKWATCH_OUTLIER_STEPS_MAX_FRACTION", 0.0, 0.5)
    )

    # The fault's unit (see step_time.units): a rank of the culprit's host is late with it when
    # its own gap to the victim is at least this fraction of the culprit's; the host is the
    # unit when at least ``slow_host_rank_fraction`` of its ranks (and two) are late together.
    slow_host_gap_fraction: float = field(
        default=0.5,
        metadata=option("RANKWATCH_SLOW_HOST_GAP_FRACTION", 0.0, 1.0, lo_open=True),
    )
    slow_host_rank_fraction: float = field(
        default=0.75,
        metadata=option("RANKWATCH_SLOW_HOST_RANK_FRACTION", 0.5, 1.0, lo_open=True),
    )

    # The run against itself (step_time.pace): warm-up windows, then the windows whose median
    # is the baseline of the group's own pace; a job slowdown after this many windows in a row
    # at the warning ratio or above, critical from the critical ratio.
    pace_warmup_windows: int = field(
        default=3, metadata=option("RANKWATCH_PACE_WARMUP_WINDOWS", 0, MAX_HISTORY_WINDOWS)
    )
    pace_baseline_windows: int = field(
        default=5, metadata=option("RANKWATCH_PACE_BASELINE_WINDOWS", 1, MAX_HISTORY_WINDOWS)
    )
    job_slowdown_windows: int = field(
        default=3, metadata=option("RANKWATCH_JOB_SLOWDOWN_WINDOWS", 1, MAX_HISTORY_WINDOWS)
    )
    job_slowdown_warning_ratio: float = field(
        default=1.15,
        metadata=option("RANKWATCH_JOB_SLOWDOWN_WARNING_RATIO", 1.0, MAX_FACTOR, lo_open=True),
    )
    job_slowdown_critical_ratio: float = field(
        default=1.5,
        metadata=option("RANKWATCH_JOB_SLOWDOWN_CRITICAL_RATIO", 1.0, MAX_FACTOR, lo_open=True),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.job_slowdown_critical_ratio < self.job_slowdown_warning_ratio:
            raise ValueError(
                f"{option_label(StepTimeConfig, 'job_slowdown_critical_ratio')}: must be >= "
                f"job_slowdown_warning_ratio ({self.job_slowdown_warning_ratio}), "
                f"got {self.job_slowdown_critical_ratio}"
            )
        if self.straggler_critical_score < self.straggler_warning_score:
            raise ValueError(
                f"{option_label(StepTimeConfig, 'straggler_critical_score')}: must be >= "
                f"straggler_warning_score ({self.straggler_warning_score}), "
                f"got {self.straggler_critical_score}"
            )
        if self.min_steps_critical < self.min_steps_warning:
            raise ValueError(
                f"{option_label(StepTimeConfig, 'min_steps_critical')}: must be >= "
                f"min_steps_warning ({self.min_steps_warning}), got {self.min_steps_critical}"
            )


@dataclass(frozen=True)
class NormalConfig(EnvOptions):
    """DeepEP normal-mode diagnosis (DeepXTrace's normal-mode decision table).

    The user-facing ratios read ``DEEPEP_DIAGNOSE_*`` variables; the robust-score and history
    constants are policy, overridable only through the ``RANKWATCH_`` names.
    """

    notify_ratio: float = field(
        default=0.25, metadata=option("DEEPEP_DIAGNOSE_NOTIFY_RATIO", 0.0, 1.0, lo_open=True)
    )
    axis_slowdown: float = field(
        default=1.25,
        metadata=option("DEEPEP_DIAGNOSE_AXIS_SLOWDOWN", 1.0, MAX_FACTOR, lo_open=True),
    )
    point_slowdown: float = field(
        default=2.0,
        metadata=option("DEEPEP_DIAGNOSE_POINT_SLOWDOWN", 1.0, MAX_FACTOR, lo_open=True),
    )
    global_slowdown: float = field(
        default=1.3,
        metadata=option("DEEPEP_DIAGNOSE_GLOBAL_SLOWDOWN", 1.0, MAX_FACTOR, lo_open=True),
    )
    robust_score: float = field(
        default=3.5, metadata=option("RANKWATCH_NORMAL_ROBUST_SCORE", 0.0, MAX_FACTOR, lo_open=True)
    )
    history_bootstrap: int = field(
        default=3, metadata=option("RANKWATCH_NORMAL_HISTORY_BOOTSTRAP", 1, MAX_HISTORY_WINDOWS)
    )
    history_horizon: int = field(
        default=16, metadata=option("RANKWATCH_NORMAL_HISTORY_HORIZON", 1, MAX_HISTORY_WINDOWS)
    )
    # The creep guard: a class aggregate further than this factor from its history's median
    # (either way) is never learned, even when it is not slow enough to be a global slowdown.
    history_band: float = field(
        default=1.15,
        metadata=option("RANKWATCH_NORMAL_HISTORY_BAND", 1.0, MAX_FACTOR, lo_open=True),
    )
    # Load context: a slow scope whose tokens per sample exceed its peers' by this factor also
    # carried much more traffic (an expert hot spot rather than a hardware fault).
    hot_load_ratio: float = field(
        default=1.5,
        metadata=option("RANKWATCH_NORMAL_HOT_LOAD_RATIO", 1.0, MAX_FACTOR, lo_open=True),
    )
    # Hang suspect: a rank (or a source) that advanced by nothing is named only when a peer
    # advanced by at least this many Notify launches or Completion samples in the same window.
    hang_min_progress: int = field(
        default=2, metadata=option("RANKWATCH_NORMAL_HANG_MIN_PROGRESS", 1, 1_000_000_000)
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.history_horizon < self.history_bootstrap:
            raise ValueError(
                f"{option_label(NormalConfig, 'history_horizon')}: must be >= "
                f"history_bootstrap ({self.history_bootstrap}), got {self.history_horizon}"
            )


@dataclass(frozen=True)
class LowLatencyConfig(EnvOptions):
    """DeepEP low-latency receive-wait matrix rule (DeepXTrace's names and defaults)."""

    thres_col: float = field(
        default=3.0,
        metadata=option("DEEPEP_DIAGNOSE_THRESHOLD_COL", 0.0, MAX_MATRIX_RATIO, lo_open=True),
    )
    thres_row: float = field(
        default=3.0,
        metadata=option("DEEPEP_DIAGNOSE_THRESHOLD_ROW", 0.0, MAX_MATRIX_RATIO, lo_open=True),
    )
    thres_point: float = field(
        default=5.0,
        metadata=option("DEEPEP_DIAGNOSE_THRESHOLD_POINT", 0.0, MAX_MATRIX_RATIO, lo_open=True),
    )
    excluding_zeros: int = field(
        default=0, metadata=option("DEEPEP_DIAGNOSE_EXCLUDING_ZEROS", 0, 1)
    )


@dataclass(frozen=True)
class DiagnosisConfig:
    """All diagnosis thresholds: one object, built from the environment plus overrides."""

    step_time: StepTimeConfig = field(default_factory=StepTimeConfig)
    normal: NormalConfig = field(default_factory=NormalConfig)
    low_latency: LowLatencyConfig = field(default_factory=LowLatencyConfig)

    def __post_init__(self) -> None:
        validate_options(self)  # the nested objects' types (it has no options of its own)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DiagnosisConfig:
        source = os.environ if env is None else env
        return cls(
            step_time=StepTimeConfig.from_env(source),
            normal=NormalConfig.from_env(source),
            low_latency=LowLatencyConfig.from_env(source),
        )

    @staticmethod
    def env_variables() -> dict[str, tuple[str, Any]]:
        """Every environment variable this object reads: ``{name: (Class.field, default)}``."""
        return {o.env: (o.label, o.default) for o in declared_options(DiagnosisConfig)}
