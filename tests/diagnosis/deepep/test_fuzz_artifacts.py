"""Fuzzing the NPZ window loader: damaged, oversized, wrong-dtype, pickled and wrong-version
files are all rejected with an ``ArtifactError`` naming the file, nothing is ever unpickled,
and memory stays bounded because sizes are checked from the headers before any data is read.

A window artifact is something a user is handed and opens offline (``rankwatch heatmap``), so
the loader treats every file as hostile. The pickle payloads here would create a marker file
if anything unpickled them; each test first proves that the payload works.
"""

from __future__ import annotations

import io
import pickle
import random
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.deepep.artifact import (
    MAX_JSON_CHARS,
    MAX_MEMBERS,
    SCHEMA_VERSION,
    ArtifactError,
    artifact_keys,
    load_window_artifact,
    save_window_artifact,
)
from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
from rankwatch.diagnosis.deepep.normal.window import NormalWindow

# Hundreds of damaged files written and read: not in `make test-fast`.
pytestmark = pytest.mark.slow

EP = 4
# Loading a valid EP-4 artifact allocates well under this; a hostile file must not do more.
PEAK_BYTES = 4 * 2**20


class Marker:
    """Unpickling this opens (creates) ``path``: proof that something was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (open, (str(self.path), "w"))


def good_artifact(folder: Path) -> tuple[Path, NormalWindow]:
    """A valid EP-4 window artifact saved in ``folder``, and its window."""
    sim = NormalSimulator(EP, 2, seed=1, slow_rank=1)
    window = sim.window("pre_dispatch_delay", 0)
    report = NormalDiagnoser().diagnose(window)
    return save_window_artifact(folder, window, report), window


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NormalWindow]:
    return good_artifact(tmp_path_factory.mktemp("good"))


def members(path: Path) -> dict[str, bytes]:
    """Raw member bytes of an archive (uncompressed .npy files)."""
    with zipfile.ZipFile(path) as zf:
        return {info.filename: zf.read(info.filename) for info in zf.infolist()}


def write_zip(path: Path, parts: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in parts.items():
            zf.writestr(name, data)
    return path


def npy(arr: Any, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asanyarray(arr), allow_pickle=allow_pickle)
    return buf.getvalue()


def header_only(descr: str, shape: tuple[int, ...], tail: bytes = b"\0" * 64) -> bytes:
    """A .npy member whose header declares ``shape`` but which holds only ``tail``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    return buf.getvalue() + tail


def rejected(path: Path) -> str:
    """Load ``path``; it must fail with ArtifactError naming the file. Returns the message."""
    with pytest.raises(ArtifactError) as info:
        load_window_artifact(path)
    message = str(info.value)
    assert str(path) in message
    return message


def same_window(a: NormalWindow, b: NormalWindow) -> bool:
    if (a.ep_size, a.ranks_per_node, a.window_index) != (
        b.ep_size,
        b.ranks_per_node,
        b.window_index,
    ):
        return False
    pairs = [(a.notify[p], b.notify[p]) for p in a.notify] + [
        (a.completion[p], b.completion[p]) for p in a.completion
    ]
    return set(a.notify) == set(b.notify) and all(
        np.array_equal(x, y) for u, v in pairs for x, y in zip(u, v, strict=True)
    )


# ---- random damage ---------------------------------------------------------------------------


def mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    op = rng.choice(["flip", "cut", "insert", "delete", "splice"])
    if op == "flip":
        for _ in range(rng.choice([1, 2, 8, 40])):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == "cut":
        del b[rng.randrange(len(b)) :]
    elif op == "insert":
        pos = rng.randrange(len(b))
        b[pos:pos] = rng.randbytes(rng.randrange(1, 40))
    elif op == "delete":
        pos = rng.randrange(len(b))
        del b[pos : pos + rng.randrange(1, 40)]
    else:  # a chunk of the file copied over another place
        src, dst, n = rng.randrange(len(b)), rng.randrange(len(b)), rng.randrange(1, 200)
        chunk = b[src : src + n]
        b[dst : dst + len(chunk)] = chunk
    return bytes(b)


def damaged_copies(data: bytes, count: int, seed: int = 7) -> Iterator[bytes]:
    """``count`` damaged copies of ``data``, the same ones for the same seed."""
    rng = random.Random(seed)
    for _ in range(count):
        yield mutate(data, rng)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1))
def test_randomly_damaged_files_are_rejected_or_read_back_unchanged(
    good: tuple[Path, NormalWindow], tmp_path: Path, seed: int
) -> None:
    path, window = good
    bad = tmp_path / f"damaged-{seed}.npz"
    bad.write_bytes(mutate(path.read_bytes(), random.Random(seed)))
    try:
        got, _, _ = load_window_artifact(bad)
    except ArtifactError as exc:
        assert str(bad) in str(exc)
    else:
        # Damage in bytes the loader never uses (timestamps, trailing junk) is harmless; damage
        # in the data is caught by the members' CRC. Either way no altered window comes back.
        assert same_window(got, window)


def test_eight_hundred_damaged_files_give_only_artifact_errors(
    good: tuple[Path, NormalWindow], tmp_path: Path
) -> None:
    """A deterministic sweep (fixed seeds) with an outcome count; no other exception type.
    How many damaged files a second are loaded is measured by ``bench/bench_hostile_inputs.py``."""
    path, window = good
    data = path.read_bytes()
    outcomes = {"rejected": 0, "unchanged": 0}
    bad = tmp_path / "damaged.npz"
    tracemalloc.start()
    try:
        for damaged in damaged_copies(data, 800):
            bad.write_bytes(damaged)
            try:
                got, _, _ = load_window_artifact(bad)
            except ArtifactError:
                outcomes["rejected"] += 1
            else:
                assert same_window(got, window)
                outcomes["unchanged"] += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"800 damaged files: {outcomes}, peak {peak / 2**20:.2f} MiB")
    assert outcomes["rejected"] >= 600, outcomes
    assert peak < PEAK_BYTES, peak


# ---- pickles ---------------------------------------------------------------------------------


def test_marker_payload_really_creates_its_file_when_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    pickle.loads(pickle.dumps(Marker(marker)))
    assert marker.exists()


@pytest.mark.parametrize("key", artifact_keys())
def test_pickled_object_array_in_any_member_is_never_unpickled(
    good: tuple[Path, NormalWindow], tmp_path: Path, key: str
) -> None:
    path, _ = good
    marker = tmp_path / "unpickled"
    parts = members(path)
    parts[key + ".npy"] = npy(np.array([Marker(marker)], dtype=object), allow_pickle=True)
    message = rejected(write_zip(tmp_path / "pickled.npz", parts))
    assert repr(key) in message and "object" in message
    assert not marker.exists()


def test_pickles_in_other_shapes_are_never_unpickled(
    good: tuple[Path, NormalWindow], tmp_path: Path
) -> None:
    path, _ = good
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(Marker(marker))
    # 1. the whole file is a pickle
    raw = tmp_path / "raw-pickle.npz"
    raw.write_bytes(payload)
    assert "not an NPZ" in rejected(raw)
    # 2. a single .npy of an object array, named like an artifact
    single = tmp_path / "single.npz"
    single.write_bytes(npy(np.array([Marker(marker)], dtype=object), allow_pickle=True))
    assert "not an NPZ" in rejected(single)
    # 3. a member that is a bare pickle stream instead of a .npy
    parts = members(path)
    parts["schema_version.npy"] = payload
    assert "'schema_version'" in rejected(write_zip(tmp_path / "bare.npz", parts))
    # 4. an extra member with a pickle the loader has no reason to open: ignored, not read
    parts = members(path)
    parts["evil.npy"] = npy(np.array([Marker(marker)], dtype=object), allow_pickle=True)
    load_window_artifact(write_zip(tmp_path / "extra.npz", parts))
    assert not marker.exists()


# ---- sizes -----------------------------------------------------------------------------------

OVERSIZED: list[tuple[str, bytes]] = [
    ("notify.notify_dispatch.duration_ns", header_only("<f8", (EP + 1,))),
    ("notify.notify_dispatch.count", header_only("<f8", (10**9,))),
    ("notify.cached_notify_combine.avg_ns", header_only("<f8", (EP, EP))),
    ("completion.dispatch_final.cost", header_only("<f8", (4096, 4096))),
    ("completion.dispatch_final.samples", header_only("<f8", (EP, 10**8))),
    ("completion.combine_logical_recv.tokens", header_only("<f8", (EP, EP, EP))),
    ("instance_id", header_only("<U1000000", ())),
    ("kind", header_only("<U100000000", ())),
    ("diagnosis_json", header_only(f"<U{MAX_JSON_CHARS + 1}", ())),
    ("extra_json", header_only("<U10", (10**8,))),
    ("probes", header_only("<U1000000", (6,))),
    ("probes", header_only("<U22", (10**7,))),
]


@pytest.mark.parametrize(("key", "member"), OVERSIZED, ids=[k for k, _ in OVERSIZED])
def test_sizes_beyond_what_the_ep_size_allows_are_refused_from_the_header(
    good: tuple[Path, NormalWindow], tmp_path: Path, key: str, member: bytes
) -> None:
    path, _ = good
    parts = members(path)
    parts[key + ".npy"] = member
    bad = write_zip(tmp_path / "oversized.npz", parts)
    tracemalloc.start()
    try:
        message = rejected(bad)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert repr(key) in message
    # The members hold 64 bytes of data: a loader that believed the header would have failed
    # reading, or allocated the declared size first (up to 800 GB here). It read nothing.
    # (What a refusal costs is measured by bench/bench_hostile_inputs.py.)
    assert peak < PEAK_BYTES, f"{key}: peak {peak} bytes"


def test_a_huge_npy_header_is_refused(good: tuple[Path, NormalWindow], tmp_path: Path) -> None:
    """A version-2 .npy header may declare a 4 GiB header length; nothing is allocated for it."""
    path, _ = good
    parts = members(path)
    parts["ep_size.npy"] = b"\x93NUMPY\x02\x00" + (2**32 - 16).to_bytes(4, "little") + b"{" * 64
    tracemalloc.start()
    try:
        message = rejected(write_zip(tmp_path / "header.npz", parts))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "'ep_size'" in message
    assert peak < PEAK_BYTES, peak


def test_too_many_members_are_refused_before_any_is_read(
    good: tuple[Path, NormalWindow], tmp_path: Path
) -> None:
    path, _ = good
    marker = tmp_path / "unpickled"
    parts = members(path)
    pickled = npy(np.array([Marker(marker)], dtype=object), allow_pickle=True)
    for i in range(MAX_MEMBERS):
        parts[f"filler{i}.npy"] = pickled
    message = rejected(write_zip(tmp_path / "many.npz", parts))
    assert f"declares {len(parts)} members" in message and f"more than {MAX_MEMBERS}" in message
    assert not marker.exists()


# ---- dtypes and versions ---------------------------------------------------------------------

WRONG_DTYPES = ["<f4", ">f8", "<i4", "<u8", "<c16", "|b1", "<M8[s]", "|S8", "<U8", "|V8"]


@pytest.mark.parametrize("key", artifact_keys())
def test_every_member_refuses_every_wrong_dtype(
    good: tuple[Path, NormalWindow], tmp_path: Path, key: str
) -> None:
    path, _ = good
    original = members(path)
    with np.load(path, allow_pickle=False) as npz:
        right = npz[key]
    refused = 0
    for descr in WRONG_DTYPES:
        if np.dtype(descr) == right.dtype or (
            right.dtype.kind == "U" and np.dtype(descr).kind == "U"
        ):
            continue
        parts = dict(original)
        parts[key + ".npy"] = npy(np.zeros(right.shape, dtype=descr))
        message = rejected(write_zip(tmp_path / f"{descr.strip('<>|[]')}.npz", parts))
        assert repr(key) in message, (descr, message)
        refused += 1
    assert refused >= len(WRONG_DTYPES) - 1


@pytest.mark.parametrize("version", [0, SCHEMA_VERSION + 1, -1, 2**62])
def test_other_schema_versions_are_refused_by_name(
    good: tuple[Path, NormalWindow], tmp_path: Path, version: int
) -> None:
    path, _ = good
    parts = members(path)
    parts["schema_version.npy"] = npy(np.int64(version))
    message = rejected(write_zip(tmp_path / "version.npz", parts))
    assert "'schema_version'" in message and f"unsupported version {version}" in message


@pytest.mark.parametrize("npy_version", [(3, 0), (9, 9), (0, 0)])
def test_unknown_npy_format_versions_are_refused(
    good: tuple[Path, NormalWindow], tmp_path: Path, npy_version: tuple[int, int]
) -> None:
    path, _ = good
    parts = members(path)
    data = bytearray(parts["completion.dispatch_final.cost.npy"])
    data[6:8] = bytes(npy_version)
    parts["completion.dispatch_final.cost.npy"] = bytes(data)
    message = rejected(write_zip(tmp_path / "npyversion.npz", parts))
    assert "'completion.dispatch_final.cost'" in message
    assert f"unsupported .npy version {npy_version}" in message


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    key=st.sampled_from(artifact_keys()),
    value=st.one_of(
        st.integers(-(2**63), 2**63 - 1).map(np.int64),
        st.floats(allow_nan=True, allow_infinity=True).map(np.float64),
        st.text(max_size=40).map(np.str_),
        st.lists(st.floats(allow_nan=True), min_size=0, max_size=20).map(np.array),
        st.lists(st.text(max_size=12), min_size=0, max_size=8).map(
            lambda xs: np.array(xs, dtype=np.str_)
        ),
    ),
)
def test_any_value_in_any_member_loads_or_is_refused_naming_it(
    good: tuple[Path, NormalWindow], tmp_path: Path, key: str, value: Any
) -> None:
    path, _ = good
    parts = members(path)
    parts[key + ".npy"] = npy(value)
    bad = write_zip(tmp_path / "value.npz", parts)
    try:
        load_window_artifact(bad)
    except ArtifactError as exc:
        assert repr(key) in str(exc) or "raw arrays rejected" in str(exc), str(exc)
