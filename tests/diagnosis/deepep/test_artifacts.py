"""NPZ window artifacts: round trip, every rejection on load, bounded retention."""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from rankwatch.diagnosis.deepep.artifact import (
    ARTIFACT_PREFIX,
    MAX_EP_SIZE,
    SCHEMA_VERSION,
    ArtifactError,
    ArtifactStore,
    artifact_keys,
    artifact_name,
    check_artifact_name,
    load_window_artifact,
    save_window_artifact,
)
from rankwatch.diagnosis.deepep.normal import NormalWindow
from rankwatch.diagnosis.deepep.normal.report import Anomaly, Incident, NormalReport, ProbeResult
from rankwatch.diagnosis.deepep.normal.schema import COMPLETION_PROBES, NOTIFY_PROBES, PROBES
from tests.servers import REPO


def _window(
    ep: int = 16, rpn: int = 8, seed: int = 0, index: int = 3, probes: tuple[str, ...] = PROBES
) -> NormalWindow:
    rng = np.random.default_rng(seed)
    notify = {
        p: (rng.integers(100_000, 200_000, ep) * 50.0, np.full(ep, 50.0))
        for p in NOTIFY_PROBES
        if p in probes
    }
    completion = {}
    for p in COMPLETION_PROBES:
        if p not in probes:
            continue
        samples = rng.integers(0, 40, (ep, ep)).astype(np.float64)
        samples[0, 1] = 0.0  # a cell without samples: NaN in the derived arrays
        completion[p] = (samples * rng.uniform(900, 1100, (ep, ep)), samples, samples * 12.0)
    return NormalWindow(
        ep_size=ep,
        ranks_per_node=rpn,
        notify=notify,
        completion=completion,
        window_index=index,
        instance_id="job-7f3a",
        start_time_s=1_700_000_000.25,
        end_time_s=1_700_000_010.5,
        extra={"note": "hand-built", "iterations": 512},
    )


def _report(window: NormalWindow) -> NormalReport:
    ratio = np.linspace(0.1, 1.9, window.ep_size)
    probes = {
        p: ProbeResult(
            probe=p,
            kind="notify",
            status="anomalous" if p == "notify_dispatch" else "ok",
            anomalies=(
                (Anomaly(p, "rank", 0, None, 0.1, ranks=(0,)),) if p == "notify_dispatch" else ()
            ),
            notify_ratio=ratio,
            mean_duration_ns=window.notify_avg_ns(p),
        )
        for p in NOTIFY_PROBES
    }
    for p in COMPLETION_PROBES:
        probes[p] = ProbeResult(
            probe=p,
            kind="completion",
            status="ok",
            cost_per_sample=window.cost_per_sample(p),
            global_factor=None,
            global_status="bootstrapping",
            aggregate=1000.0,
        )
    return NormalReport(
        window_index=window.window_index,
        ep_size=window.ep_size,
        ranks_per_node=window.ranks_per_node,
        probes=probes,
        incidents=(
            Incident("pre_stage_arrival_skew", ("notify_dispatch",), "rank", (0,), {"ratio": 0.1}),
        ),
        instance_id=window.instance_id,
    )


def _assert_same_window(a: NormalWindow, b: NormalWindow) -> None:
    assert (a.ep_size, a.ranks_per_node, a.window_index) == (
        b.ep_size,
        b.ranks_per_node,
        b.window_index,
    )
    assert (a.instance_id, a.start_time_s, a.end_time_s) == (
        b.instance_id,
        b.start_time_s,
        b.end_time_s,
    )
    assert set(a.notify) == set(b.notify) and set(a.completion) == set(b.completion)
    for p in a.notify:
        for x, y in zip(a.notify[p], b.notify[p], strict=True):
            np.testing.assert_array_equal(x, y)
    for p in a.completion:
        for x, y in zip(a.completion[p], b.completion[p], strict=True):
            np.testing.assert_array_equal(x, y)


def _members(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def _rewrite(src: Path, dst: Path, **changes: object) -> Path:
    """A copy of an artifact with members replaced (value) or removed (None)."""
    members = _members(src)
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            members.pop(key)
        else:
            members[key] = np.asarray(value)
    with open(dst, "wb") as fh:
        np.savez_compressed(fh, **members)
    return dst


# --- round trip ---------------------------------------------------------------------------


def test_round_trip_with_report(tmp_path: Path) -> None:
    window = _window()
    report = _report(window)
    path = save_window_artifact(tmp_path, window, report, created_at_s=42.0)
    assert path == tmp_path / "deepep-normal-job-7f3a-w00000003.npz"
    assert path.parent == tmp_path and not list(tmp_path.glob(".tmp-*"))
    loaded, diagnosis, meta = load_window_artifact(path)
    _assert_same_window(window, loaded)
    assert dict(loaded.extra) == {"note": "hand-built", "iterations": 512}
    assert diagnosis == json.loads(json.dumps(report.to_dict(include_arrays=False)))
    assert diagnosis["incidents"][0]["class"] == "pre_stage_arrival_skew"
    assert meta.schema_version == SCHEMA_VERSION and meta.created_at_s == 42.0
    assert (meta.ep_size, meta.ranks_per_node, meta.window_index) == (16, 8, 3)
    assert meta.probes == PROBES
    # Derived arrays: the report's Notify ratio, the window's per-sample metrics.
    np.testing.assert_array_equal(
        meta.derived["notify.notify_dispatch.ratio"], np.linspace(0.1, 1.9, 16)
    )
    np.testing.assert_array_equal(
        meta.derived["notify.cached_notify_combine.avg_ns"],
        window.notify_avg_ns("cached_notify_combine"),
    )
    cps = meta.derived["completion.dispatch_final.cost_per_sample"]
    np.testing.assert_array_equal(cps, window.cost_per_sample("dispatch_final"))
    assert np.isnan(cps[0, 1])
    np.testing.assert_array_equal(
        meta.derived["completion.combine_logical_recv.tokens_per_sample"],
        window.tokens_per_sample("combine_logical_recv"),
    )
    with pytest.raises(ValueError):
        cps[0, 0] = 1.0  # read-only


def test_file_is_compressed_and_self_describing(tmp_path: Path) -> None:
    path = save_window_artifact(tmp_path / "w.npz", _window(ep=64, rpn=8))
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in infos)
        names = sorted(i.filename[: -len(".npy")] for i in infos)
    assert names == sorted(artifact_keys())
    members = _members(path)
    assert members["schema_version"].dtype == np.int64
    assert str(members["kind"]) == "rankwatch.deepep_normal_window"
    assert str(members["diagnosis_json"]) == ""  # no report given
    assert members["completion.dispatch_final.cost"].shape == (64, 64)


def test_without_report_the_ratio_is_the_peer_median_rule(tmp_path: Path) -> None:
    window = _window()
    _, diagnosis, meta = load_window_artifact(save_window_artifact(tmp_path, window))
    assert diagnosis is None
    avg = window.notify_avg_ns("notify_dispatch")
    expected = [avg[r] / np.median(np.delete(avg, r)) for r in range(16)]
    np.testing.assert_allclose(meta.derived["notify.notify_dispatch.ratio"], expected)


def test_missing_probes_stay_missing(tmp_path: Path) -> None:
    window = _window(probes=("notify_dispatch", "dispatch_final"))
    path = save_window_artifact(tmp_path, window)
    loaded, _, meta = load_window_artifact(path)
    assert meta.probes == ("notify_dispatch", "dispatch_final")
    assert set(loaded.notify) == {"notify_dispatch"}
    assert set(loaded.completion) == {"dispatch_final"}
    assert "completion.combine_logical_recv.cost" not in _members(path)


def test_mapping_report_and_explicit_file_path(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "dir" / "window.npz"
    path = save_window_artifact(target, _window(), {"ep_size": 16, "score": np.float64("nan")})
    assert path == target
    _, diagnosis, _ = load_window_artifact(path)
    assert diagnosis == {"ep_size": 16, "score": None}


def test_default_name_is_safe_for_any_instance_id(tmp_path: Path) -> None:
    w = NormalWindow(
        ep_size=2,
        ranks_per_node=1,
        notify={"notify_dispatch": ([10.0, 10.0], [1.0, 1.0])},
        completion={},
        window_index=12,
        instance_id="../../etc/passwd",
    )
    assert artifact_name(w) == "deepep-normal-etc_passwd-w00000012.npz"
    path = save_window_artifact(tmp_path, w)
    assert path.parent == tmp_path
    anonymous = NormalWindow(2, 1, {"notify_dispatch": ([1.0, 1.0], [1.0, 1.0])}, {})
    assert artifact_name(anonymous) == "deepep-normal-local-w00000000.npz"


# --- bad input when saving ----------------------------------------------------------------


def test_save_rejects_bad_input(tmp_path: Path) -> None:
    window = _window()
    with pytest.raises(TypeError, match="window: expected NormalWindow, got dict"):
        save_window_artifact(tmp_path, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="report: expected NormalReport, a mapping or None"):
        save_window_artifact(tmp_path, window, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"report.ep_size: 8 does not match window.ep_size=16"):
        save_window_artifact(tmp_path, window, {"ep_size": 8})
    with pytest.raises(ValueError, match="created_at_s: must be a finite number, got nan"):
        save_window_artifact(tmp_path, window, created_at_s=float("nan"))
    with pytest.raises(TypeError, match="path_or_dir: expected a path, got int"):
        save_window_artifact(3, window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name: must be a plain file name"):
        save_window_artifact(tmp_path, window, name="../escape.npz")
    with pytest.raises(ValueError, match="name: give a folder when naming the file"):
        save_window_artifact(tmp_path / "a.npz", window, name="b.npz")
    with pytest.raises(ValueError, match="report: not JSON-serialisable"):
        save_window_artifact(tmp_path, window, {"ep_size": 16, "obj": object()})
    with pytest.raises(ValueError, match=r"report: \d+ characters as JSON, more than 1048576"):
        save_window_artifact(tmp_path, window, {"ep_size": 16, "note": "x" * 2**20})
    assert list(tmp_path.iterdir()) == []  # nothing half-written


# --- rejections on load -------------------------------------------------------------------


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return save_window_artifact(tmp_path / "good.npz", _window(), _report(_window()))


def _load_error(path: Path) -> str:
    with pytest.raises(ArtifactError) as info:
        load_window_artifact(path)
    return str(info.value)


def test_wrong_schema_version_is_rejected(good: Path, tmp_path: Path) -> None:
    bad = _rewrite(good, tmp_path / "v3.npz", schema_version=np.int64(SCHEMA_VERSION + 1))
    msg = _load_error(bad)
    assert "'schema_version'" in msg and "unsupported version 3" in msg and str(bad) in msg


def test_version_1_relay_layout_is_refused_with_the_reason(good: Path, tmp_path: Path) -> None:
    old = _rewrite(good, tmp_path / "v1.npz", schema_version=np.int64(1))
    msg = _load_error(old)
    assert "'schema_version'" in msg and "old relay layout" in msg and str(old) in msg


@pytest.mark.parametrize(
    "key", ["schema_version", "ep_size", "instance_id", "probes", "completion.dispatch_final.cost"]
)
def test_missing_key_is_rejected_by_name(good: Path, tmp_path: Path, key: str) -> None:
    bad = _rewrite(good, tmp_path / "missing.npz", **{key.replace(".", "__"): None})
    assert f"missing key {key!r}" in _load_error(bad)


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("notify.notify_dispatch.count", np.ones(15), "expected float64 of shape (16,)"),
        ("completion.dispatch_rdma_recv.samples", np.ones((16, 8)), "shape (16, 16)"),
        ("completion.dispatch_final.cost", np.ones((16, 16), np.float32), "got float32"),
        ("ep_size", np.float64(16), "expected int64 of shape ()"),
        ("window_index", np.array([3]), "of shape (1,)"),
        ("instance_id", np.int64(5), "expected a string"),
        ("notify.notify_dispatch.ratio", np.array(["x"] * 16), "got <U1"),
    ],
)
def test_wrong_shape_or_dtype_is_rejected_by_name(
    good: Path, tmp_path: Path, key: str, value: np.ndarray, needle: str
) -> None:
    bad = _rewrite(good, tmp_path / "shape.npz", **{key.replace(".", "__"): value})
    msg = _load_error(bad)
    assert f"key {key!r}" in msg and needle in msg


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("ep_size", np.int64(MAX_EP_SIZE + 1), f"must be in 1..{MAX_EP_SIZE}"),
        ("ep_size", np.int64(0), "must be in 1.."),
        ("ranks_per_node", np.int64(5), "positive divisor of 'ep_size' (16), got 5"),
        ("window_index", np.int64(-1), "must be >= 0"),
        ("end_time_s", np.float64("inf"), "must be finite"),
        ("kind", np.array("something.else"), "expected 'rankwatch.deepep_normal_window'"),
        ("probes", np.array(["notify_dispatch", "bogus"]), "unknown or repeated probe names"),
        ("probes", np.array(["notify_dispatch", "notify_dispatch"]), "unknown or repeated"),
        ("diagnosis_json", np.array("{not json"), "not valid JSON"),
        ("diagnosis_json", np.array("[1, 2]"), "expected a JSON object, got list"),
        ("diagnosis_json", np.array('{"ep_size": 8}'), "ep_size 8 does not match ep_size=16"),
    ],
)
def test_bad_declared_values_are_rejected_by_name(
    good: Path, tmp_path: Path, key: str, value: np.ndarray, needle: str
) -> None:
    bad = _rewrite(good, tmp_path / "value.npz", **{key: value})
    msg = _load_error(bad)
    assert f"key {key!r}" in msg and needle in msg


def test_negative_raw_counter_is_rejected_naming_the_probe(good: Path, tmp_path: Path) -> None:
    cost = _members(good)["completion.combine_logical_recv.cost"].copy()
    cost[2, 3] = -5.0
    bad = _rewrite(good, tmp_path / "neg.npz", completion__combine_logical_recv__cost=cost)
    msg = _load_error(bad)
    assert "completion[combine_logical_recv].cost" in msg and "negative" in msg


def test_array_larger_than_the_ep_size_allows_is_rejected_before_loading(
    good: Path, tmp_path: Path
) -> None:
    # A member whose header declares 10^5 x 10^5 float64 (80 GB) but holds only a few bytes:
    # loading it would fail or exhaust memory; the header check must stop it first.
    bad = tmp_path / "huge.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename == "completion.dispatch_final.cost.npy":
                buf = io.BytesIO()
                np.lib.format.write_array_header_1_0(
                    buf, {"descr": "<f8", "fortran_order": False, "shape": (100_000, 100_000)}
                )
                dst.writestr(info.filename, buf.getvalue() + b"\0" * 64)
            else:
                dst.writestr(info, src.read(info.filename))
    msg = _load_error(bad)
    assert "'completion.dispatch_final.cost'" in msg and "(100000, 100000)" in msg


def test_pickled_member_is_rejected(good: Path, tmp_path: Path) -> None:
    members = _members(good)
    members["instance_id"] = np.array([{"evil": 1}], dtype=object)
    bad = tmp_path / "pickle.npz"
    with open(bad, "wb") as fh:
        np.savez_compressed(fh, **members)
    msg = _load_error(bad)
    assert "'instance_id'" in msg and "expected a string" in msg


def test_too_long_strings_are_rejected(good: Path, tmp_path: Path) -> None:
    bad = _rewrite(good, tmp_path / "long.npz", instance_id=np.array("x" * 1000))
    assert "more than 256 allowed" in _load_error(bad)


@pytest.mark.parametrize("keep", [0.3, 0.7, 0.98])
def test_truncated_file_is_rejected(good: Path, tmp_path: Path, keep: float) -> None:
    data = good.read_bytes()
    bad = tmp_path / "cut.npz"
    bad.write_bytes(data[: int(len(data) * keep)])
    assert _load_error(bad) == f"{bad}: not an NPZ (zip) archive, or truncated"


def test_corrupt_member_data_is_rejected(good: Path, tmp_path: Path) -> None:
    data = bytearray(good.read_bytes())
    with zipfile.ZipFile(good) as zf:
        info = zf.getinfo("completion.dispatch_rdma_recv.cost.npy")
    # Damage the compressed data in the middle of that member.
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + info.compress_size // 2, start + info.compress_size // 2 + 16):
        data[i] ^= 0xFF
    bad = tmp_path / "corrupt.npz"
    bad.write_bytes(bytes(data))
    msg = _load_error(bad)
    assert "'completion.dispatch_rdma_recv.cost': corrupt or truncated" in msg


def test_not_an_archive_is_rejected(tmp_path: Path) -> None:
    text = tmp_path / "text.npz"
    text.write_text("hello")
    assert "not an NPZ (zip) archive" in _load_error(text)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    assert "not an NPZ (zip) archive" in _load_error(single)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_window_artifact(tmp_path / "absent.npz")
    with pytest.raises(TypeError, match="path: expected a path, got NoneType"):
        load_window_artifact(None)  # type: ignore[arg-type]


def test_foreign_npz_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "foreign.npz"
    np.savez_compressed(path, a=np.zeros(3))
    assert "missing key 'schema_version' (not a rankwatch artifact?)" in _load_error(path)


# --- retention and names ------------------------------------------------------------------


def test_store_keeps_the_newest_files_only(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path, retention=3)
    other = tmp_path / "notes.txt"
    other.write_text("not an artifact")
    paths = []
    for index in range(6):
        paths.append(store.save(_window(ep=8, rpn=4, index=index)))
        # Distinct modification times even on coarse file-system clocks.
        os.utime(paths[-1], ns=(10**18 + index * 10**9, 10**18 + index * 10**9))
    assert len(paths) == 6
    kept = store.paths()
    assert [p.name for p in kept] == [p.name for p in paths[3:]]
    assert all(not p.exists() for p in paths[:3])
    assert other.exists()  # never touches files that are not artifacts
    # Newest by modification time, not by name.
    os.utime(paths[3], ns=(2 * 10**18, 2 * 10**18))
    assert store.paths()[-1] == paths[3]


def test_store_retention_one_keeps_the_last_file_and_prune_is_idempotent(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path, retention=1)
    for index in range(3):
        last = store.save(_window(ep=8, rpn=4, index=index))
        os.utime(last, ns=(10**18 + index * 10**9, 10**18 + index * 10**9))
    assert store.paths() == [last] and store.prune() == []
    assert ArtifactStore(tmp_path / "absent").paths() == []
    assert ArtifactStore(tmp_path).retention == 100  # the exporter's default


def test_store_names_cannot_escape_the_folder(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "arts", retention=2)
    good_name = ARTIFACT_PREFIX + "custom.npz"
    assert store.path_for(good_name) == tmp_path / "arts" / good_name
    assert store.save(_window(ep=8, rpn=4), name=good_name).name == good_name
    for bad in ["../x.npz", "a/b.npz", "a\\b.npz", "..npz", ".hidden.npz", "x.txt", "", "a\0.npz"]:
        with pytest.raises(ValueError, match="name: must be a plain file name"):
            store.path_for(bad)
    with pytest.raises(ValueError, match="store files must start with 'deepep-normal-'"):
        store.save(_window(ep=8, rpn=4), name="custom.npz")
    with pytest.raises(TypeError, match="name: expected a file name string, got int"):
        check_artifact_name(5)
    assert sorted(p.name for p in (tmp_path / "arts").iterdir()) == [good_name]


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"retention": 0}, ValueError, "retention: must be >= 1 (files kept), got 0"),
        ({"retention": -1}, ValueError, "retention: must be >= 1"),
        ({"retention": True}, TypeError, "retention: expected an int"),
        ({"retention": "3"}, TypeError, "retention: expected an int"),
    ],
)
def test_store_rejects_bad_settings(tmp_path: Path, kwargs: dict, exc: type, needle: str) -> None:
    with pytest.raises(exc) as info:
        ArtifactStore(tmp_path, **kwargs)
    assert needle in str(info.value)
    with pytest.raises(TypeError, match="directory: expected a non-empty path"):
        ArtifactStore("")


def test_docs_schema_table_lists_every_key() -> None:
    doc = (REPO / "docs" / "artifacts.md").read_text()
    section = doc.split("### Schema", 1)[1].split("### What loading checks", 1)[0]
    documented = set(re.findall(r"`([a-z_.<>]+)`", section))
    for key in artifact_keys():
        parts = key.split(".")
        generic = key if len(parts) == 1 else f"{parts[0]}.<probe>.{parts[2]}"
        assert generic in documented, generic
    assert f"`{SCHEMA_VERSION}`" in section
