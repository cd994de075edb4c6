"""The step-time entry points on arbitrary Python objects, the step-window JSON loader on
damaged files, and the metric samples of any step-time report.

The engine's own property tests cover well-typed inputs (finite and extreme means and rows,
permutations, bad times); these add what a caller can get wrong in type and shape, and check
that whatever is accepted reaches ``/metrics`` without NaN.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time import SIGNALS, diagnose_arrays, diagnose_means, diagnose_steps
from rankwatch.diagnosis.step_time.artifact import example_window, load_window, window_from_dict
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.samples import report_samples

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

# Words the engine's errors use to point at what was wrong.
FIELD_WORDS = (
    "field",
    "rank",
    "per_rank",
    "config",
    "strategy",
    "window",
    "steps",
    "clock",
    "means",
)

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.complex_numbers(),
    st.text(max_size=5),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.builds(object),
)
keys = st.one_of(
    st.integers(-2, 5),
    st.integers(2**63, 2**70),
    st.none(),
    st.booleans(),
    st.text(max_size=3),
    st.floats(allow_nan=False),
    st.builds(object),
)
mean_keys = st.sampled_from([*SIGNALS, "residual"])


def check_report_and_samples(report: Any) -> None:
    """JSON without NaN, and every metric sample built from it finite with string labels."""
    data = report.to_dict()
    json.dumps(data, allow_nan=False)
    ranks = tuple(RankInfo(r, f"Host-{r}", r % 8) for r in report.ranks)
    wr = WindowReport(group="g", window_index=0, created_at_s=1.7e9, ranks=ranks, step_time=report)
    for s in report_samples(wr, RankwatchConfig()):
        assert math.isfinite(s.value), s
        assert all(isinstance(v, str) for v in s.labels), s


def refused_by_name(exc: BaseException) -> None:
    assert isinstance(exc, (ValueError, TypeError)), repr(exc)
    assert any(w in str(exc) for w in FIELD_WORDS), repr(exc)


arrays = st.one_of(
    junk,
    hnp.arrays(
        st.sampled_from([np.float64, np.int64, np.float32, np.complex128, np.bool_, np.str_]),
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=14),
    ),
    hnp.arrays(
        np.float64,
        st.tuples(st.integers(0, 12), st.just(13)),
        elements=st.one_of(st.floats(0, 1.7e308), st.just(math.nan), st.integers(0, 20)),
    ),
)


@SETTINGS
@given(
    per_rank=st.one_of(junk, st.dictionaries(keys, st.one_of(st.none(), arrays), max_size=3)),
    strategy=st.one_of(st.sampled_from([None, "ddp", "fsdp"]), junk),
    window=st.one_of(st.integers(-2, 200), junk),
    config=st.one_of(st.none(), junk),
)
def test_diagnose_arrays_on_anything(per_rank: Any, strategy: Any, window: Any, config: Any):
    try:
        report = diagnose_arrays(per_rank, strategy=strategy, window=window, config=config)
    except Exception as exc:
        refused_by_name(exc)
        return
    check_report_and_samples(report)


@SETTINGS
@given(
    means=st.one_of(
        junk,
        st.dictionaries(
            keys,
            st.one_of(
                st.none(),
                junk,
                st.dictionaries(
                    st.one_of(mean_keys, keys),
                    st.one_of(st.floats(allow_nan=True), st.floats(0, 1.7e308), junk),
                    max_size=7,
                ),
            ),
            max_size=4,
        ),
    ),
    steps=st.one_of(st.integers(-2, 100), junk),
    clock=st.one_of(st.sampled_from(["cpu", "gpu"]), junk),
)
def test_diagnose_means_on_anything(means: Any, steps: Any, clock: Any) -> None:
    try:
        report = diagnose_means(means, steps=steps, clock=clock)
    except Exception as exc:
        refused_by_name(exc)
        return
    check_report_and_samples(report)


row = st.one_of(
    junk,
    st.dictionaries(
        st.one_of(st.sampled_from(["step_id", "cpu", "gpu"]), keys),
        st.one_of(
            st.integers(-1, 20),
            junk,
            st.dictionaries(
                st.one_of(st.sampled_from(SIGNALS), keys),
                st.one_of(st.floats(allow_nan=True), st.floats(0, 1e300), junk),
                max_size=6,
            ),
        ),
        max_size=3,
    ),
)


@SETTINGS
@given(
    rows=st.one_of(
        junk,
        st.dictionaries(keys, st.one_of(st.none(), junk, st.lists(row, max_size=5)), max_size=3),
    )
)
def test_diagnose_steps_on_anything(rows: Any) -> None:
    try:
        report = diagnose_steps(rows)
    except Exception as exc:
        refused_by_name(exc)
        return
    check_report_and_samples(report)


# ---- the step-window JSON artifact -----------------------------------------------------------

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**64), 2**64),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=4),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@SETTINGS
@given(data=st.data())
def test_any_edit_of_a_step_window_loads_or_names_the_key(data: Any) -> None:
    doc = json.loads(json.dumps(example_window().to_dict()))
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(doc)))
        target = doc
        if isinstance(doc[key], dict) and doc[key] and data.draw(st.booleans()):
            target, key = doc[key], data.draw(st.sampled_from(sorted(doc[key])))
        target[key] = data.draw(json_values)
    try:
        window = window_from_dict(doc)
    except ValueError as exc:
        assert str(exc), "an empty message names nothing"
        return
    check_report_and_samples(window.diagnose())


def test_damaged_step_window_files_are_refused_cleanly(tmp_path: Path) -> None:
    """Random damage to a saved step window: the loader parses it or raises ValueError (a
    UnicodeDecodeError is one) naming the file; 500 files, no other exception type."""
    good = json.dumps(example_window().to_dict()).encode()
    rng = random.Random(3)
    path = tmp_path / "window.json"
    outcomes = {"refused": 0, "loaded": 0}
    for _ in range(500):
        b = bytearray(good)
        for _ in range(rng.choice([1, 2, 10])):
            b[rng.randrange(len(b))] = rng.randrange(256)
        path.write_bytes(bytes(b))
        try:
            window = load_window(path)
        except ValueError as exc:
            outcomes["refused"] += 1
            assert isinstance(exc, UnicodeDecodeError) or str(path) in str(exc)
        else:
            outcomes["loaded"] += 1
            check_report_and_samples(window.diagnose())
    print(f"500 damaged step windows: {outcomes}")
    assert outcomes["refused"] >= 250, outcomes
