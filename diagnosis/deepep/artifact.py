"""One DeepEP normal-mode window as a compressed, versioned, self-describing NPZ file.

An artifact holds everything needed to look at a window again offline: the window's identity
(EP size, ranks per node, window index, instance id, start/end time), every present probe's raw
counter deltas and derived arrays, and the diagnosis as a JSON string. It is written atomically
(temporary file, then rename) and read back with ``allow_pickle=False``; every array's declared
shape and dtype are checked against the declared EP size *before* its data is decompressed, so
a damaged or hostile file is rejected with an :class:`ArtifactError` naming the key instead of
exhausting memory. Before that, the file itself must be a regular file within
:data:`MAX_FILE_BYTES`, its zip directory may list at most :data:`MAX_MEMBERS` members, and the
uncompressed sizes the directory declares must add up to at most :data:`MAX_DECLARED_BYTES`.
``docs/artifacts.md`` lists the keys and the bounds.

Probes absent from the window are absent from the file (listed in ``probes``): a missing
measurement is never written as zeros.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import struct
import tempfile
import threading
import time
import tokenize
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np

from rankwatch.diagnosis.deepep.normal.notify import notify_ratios
from rankwatch.diagnosis.deepep.normal.report import NormalReport, json_ready
from rankwatch.diagnosis.deepep.normal.schema import COMPLETION_PROBES, NOTIFY_PROBES, PROBES
from rankwatch.diagnosis.deepep.normal.window import NormalWindow
from rankwatch.diagnosis.retention import files_oldest_first, prune_oldest
from rankwatch.diagnosis.untrusted_files import ArtifactError, open_regular_file, parse_json

__all__ = [
    "ARTIFACT_KIND",
    "ARTIFACT_PREFIX",
    "MAX_DECLARED_BYTES",
    "MAX_EP_SIZE",
    "MAX_FILE_BYTES",
    "SCHEMA_VERSION",
    "ArtifactError",
    "ArtifactMeta",
    "ArtifactStore",
    "artifact_keys",
    "artifact_name",
    "check_artifact_name",
    "load_window_artifact",
    "save_window_artifact",
]

# Version 2: ``dispatch_rdma_recv`` is stored as DeepEP's internode kernel writes it, [RDMA
# sender, receiving rank with the same GPU index] plus the diagonal local lane. Version 1 stored
# it as [relay rank, destination on the relay's node], a different quantity that cannot be
# converted (it summed the senders of a GPU index), so version-1 files are refused.
SCHEMA_VERSION = 2
ARTIFACT_KIND = "rankwatch.deepep_normal_window"
ARTIFACT_PREFIX = "deepep-normal-"
# Largest EP group an artifact may declare. DeepEP's internode normal mode reaches 160 ranks
# (20 RDMA peers of 8 NVLink ranks each); 1,024 keeps room for a later DeepEP and for the sizes
# the benchmarks diagnose. One float64 [EP, EP] matrix is then 8 MiB, a whole file's arrays
# 120 MiB (a file declaring EP 4,096 would ask for 1.9 GiB).
MAX_EP_SIZE = 1024
MAX_INSTANCE_ID_CHARS = 256
# A stored diagnosis is a few kB (verdicts, not arrays); extra_json is the caller's small dict.
MAX_JSON_CHARS = 2**20
MAX_JSON_ITEMS = 100_000
COMPRESS_LEVEL = 1
# An artifact has at most 12 scalar keys + 4 per Notify probe + 5 per Completion probe.
MAX_MEMBERS = 64
# What a whole EP-MAX_EP_SIZE artifact may declare uncompressed: every Completion array, every
# Notify array, both JSON strings (4 bytes per character in a .npy) and 1 MiB for the rest.
MAX_DECLARED_BYTES = (
    (3 * 5 * MAX_EP_SIZE + 3 * 4) * MAX_EP_SIZE * 8 + 2 * 4 * MAX_JSON_CHARS + 2**20
)
# Deflate never makes data much larger: the compressed file fits in the same budget.
MAX_FILE_BYTES = MAX_DECLARED_BYTES
# 64 members with their names and ZIP64 fields take under 8 KiB of zip directory.
MAX_DIRECTORY_BYTES = 64 * 2**10

NOTIFY_RAW = ("duration_ns", "count")
NOTIFY_DERIVED = ("avg_ns", "ratio")
COMPLETION_RAW = ("cost", "samples", "tokens")
COMPLETION_DERIVED = ("cost_per_sample", "tokens_per_sample")

# Scalar keys: name -> numpy dtype kind ("i" int64, "f" float64, "U" string).
_SCALARS: dict[str, str] = {
    "schema_version": "i",
    "kind": "U",
    "ep_size": "i",
    "ranks_per_node": "i",
    "window_index": "i",
    "instance_id": "U",
    "start_time_s": "f",
    "end_time_s": "f",
    "created_at_s": "f",
    "diagnosis_json": "U",
    "extra_json": "U",
}

_SAFE_ID = re.compile(r"[^A-Za-z0-9_-]+")
# What reading a damaged archive can raise. Besides the obvious ones, zipfile raises
# NotImplementedError for a member that claims an unknown zip version, compression method or
# patched data, and RuntimeError for one whose header says it is encrypted; numpy parses a
# garbled .npy header with ast.literal_eval and then the tokenize module, which raise
# SyntaxError, TypeError or tokenize.TokenError. One damaged byte is enough for any of them,
# and the caller must still get an ArtifactError naming the file.
_READ_ERRORS = (
    ValueError,
    OSError,
    EOFError,
    zipfile.BadZipFile,
    zlib.error,
    NotImplementedError,
    RuntimeError,
    SyntaxError,
    TypeError,
    tokenize.TokenError,
)


@dataclass(frozen=True)
class ArtifactMeta:
    """What an artifact says about itself, plus its derived arrays.

    ``derived`` maps keys such as ``"notify.notify_dispatch.ratio"`` or
    ``"completion.dispatch_final.cost_per_sample"`` to read-only float64 arrays (NaN where a
    rank or cell had no sample).
    """

    path: Path
    schema_version: int
    ep_size: int
    ranks_per_node: int
    window_index: int
    instance_id: str
    start_time_s: float
    end_time_s: float
    created_at_s: float
    probes: tuple[str, ...]
    derived: Mapping[str, np.ndarray]


def artifact_keys(probes: tuple[str, ...] = PROBES) -> list[str]:
    """Every key an artifact holding ``probes`` contains, in the order they are written."""
    keys = [*_SCALARS, "probes"]
    for p in probes:
        if p in NOTIFY_PROBES:
            keys += [f"notify.{p}.{f}" for f in NOTIFY_RAW + NOTIFY_DERIVED]
        else:
            keys += [f"completion.{p}.{f}" for f in COMPLETION_RAW + COMPLETION_DERIVED]
    return keys


def artifact_name(window: NormalWindow) -> str:
    """The default file name: ``deepep-normal-<instance>-w<index, 8 digits>.npz``.

    The instance id is reduced to letters, digits, ``_`` and ``-`` (at most 64 characters;
    ``local`` when empty) so the name is always safe inside the artifact folder.
    """
    inst = _SAFE_ID.sub("_", window.instance_id).strip("_")[:64] or "local"
    return f"{ARTIFACT_PREFIX}{inst}-w{window.window_index:08d}.npz"


def check_artifact_name(name: object) -> str:
    """Accept a bare file name ending in ``.npz``; reject anything that could leave the folder."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a file name string, got {type(name).__name__}")
    if (
        not name
        or len(name) > 200
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or ".." in name
        or name.startswith(".")
        or not name.endswith(".npz")
        or name == ".npz"
    ):
        raise ValueError(
            f"name: must be a plain file name ending in .npz (no path separators, no '..', "
            f"not hidden), got {name!r}"
        )
    return name


def _report_dict(report: object, ep_size: int) -> dict[str, Any] | None:
    if report is None:
        return None
    if isinstance(report, NormalReport):
        # Arrays live in the NPZ as arrays; the JSON keeps the verdicts and stays small.
        data = report.to_dict(include_arrays=False)
    elif isinstance(report, Mapping):
        data = json_ready(report)
    else:
        raise TypeError(
            f"report: expected NormalReport, a mapping or None, got {type(report).__name__}"
        )
    declared = data.get("ep_size")
    if declared is not None and declared != ep_size:
        raise ValueError(f"report.ep_size: {declared!r} does not match window.ep_size={ep_size}")
    return data


def _report_ratio(report: object, probe: str, ep_size: int) -> np.ndarray | None:
    if not isinstance(report, NormalReport) or probe not in report.probes:
        return None
    ratio = report.probes[probe].notify_ratio
    if ratio is None or np.shape(ratio) != (ep_size,):
        return None
    return np.asarray(ratio, dtype=np.float64)


def _window_arrays(window: NormalWindow, report: object) -> dict[str, np.ndarray]:
    ep = window.ep_size
    arrays: dict[str, np.ndarray] = {}
    for p in NOTIFY_PROBES:
        if p not in window.notify:
            continue
        duration, count = window.notify[p]
        avg = window.notify_avg_ns(p)
        ratio = _report_ratio(report, p, ep)
        arrays[f"notify.{p}.duration_ns"] = duration
        arrays[f"notify.{p}.count"] = count
        arrays[f"notify.{p}.avg_ns"] = avg
        # Prefer the diagnoser's own ratio so the file shows what the rule saw.
        arrays[f"notify.{p}.ratio"] = notify_ratios(avg) if ratio is None else ratio
    for p in COMPLETION_PROBES:
        if p not in window.completion:
            continue
        cost, samples, tokens = window.completion[p]
        arrays[f"completion.{p}.cost"] = cost
        arrays[f"completion.{p}.samples"] = samples
        arrays[f"completion.{p}.tokens"] = tokens
        arrays[f"completion.{p}.cost_per_sample"] = window.cost_per_sample(p)
        arrays[f"completion.{p}.tokens_per_sample"] = window.tokens_per_sample(p)
    return {k: np.ascontiguousarray(v, dtype=np.float64) for k, v in arrays.items()}


def _json_text(name: str, value: object) -> str:
    try:
        text = json.dumps(json_ready(value), sort_keys=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: not JSON-serialisable ({exc})") from None
    if len(text) > MAX_JSON_CHARS:
        # Never write what the loader would refuse.
        raise ValueError(f"{name}: {len(text)} characters as JSON, more than {MAX_JSON_CHARS}")
    return text


def save_window_artifact(
    path_or_dir: str | os.PathLike[str],
    window: NormalWindow,
    report: NormalReport | Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    created_at_s: float | None = None,
) -> Path:
    """Write ``window`` (and its diagnosis) as one compressed NPZ file; return its path.

    ``path_or_dir`` ending in ``.npz`` is the file itself; anything else is a folder (created
    when missing) that receives ``name`` or :func:`artifact_name`. The write is atomic: readers
    never see a half-written file. ``report`` is a :class:`NormalReport` (stored as
    ``to_dict(include_arrays=False)``; its Notify ratios become the ``ratio`` arrays) or an
    already JSON-ready mapping.
    """
    if not isinstance(window, NormalWindow):
        raise TypeError(f"window: expected NormalWindow, got {type(window).__name__}")
    if not isinstance(path_or_dir, (str, os.PathLike)):
        raise TypeError(f"path_or_dir: expected a path, got {type(path_or_dir).__name__}")
    if created_at_s is None:
        created_at_s = time.time()
    elif (
        isinstance(created_at_s, bool)
        or not isinstance(created_at_s, numbers.Real)
        or not math.isfinite(created_at_s)
    ):
        raise ValueError(f"created_at_s: must be a finite number, got {created_at_s!r}")
    target = Path(path_or_dir)
    if target.suffix == ".npz":
        if name is not None:
            raise ValueError(f"name: give a folder when naming the file, got path {target}")
        check_artifact_name(target.name)
        folder = target.parent
    else:
        folder = target
        target = folder / check_artifact_name(artifact_name(window) if name is None else name)
    diagnosis = _report_dict(report, window.ep_size)
    payload: dict[str, np.ndarray] = {
        "schema_version": np.array(SCHEMA_VERSION, dtype=np.int64),
        "kind": np.array(ARTIFACT_KIND),
        "ep_size": np.array(window.ep_size, dtype=np.int64),
        "ranks_per_node": np.array(window.ranks_per_node, dtype=np.int64),
        "window_index": np.array(window.window_index, dtype=np.int64),
        "instance_id": np.array(str(window.instance_id)[:MAX_INSTANCE_ID_CHARS]),
        "start_time_s": np.array(window.start_time_s, dtype=np.float64),
        "end_time_s": np.array(window.end_time_s, dtype=np.float64),
        "created_at_s": np.array(float(created_at_s), dtype=np.float64),
        "diagnosis_json": np.array("" if diagnosis is None else _json_text("report", diagnosis)),
        "extra_json": np.array(_json_text("window.extra", dict(window.extra))),
        "probes": np.array(
            [p for p in PROBES if p in window.notify or p in window.completion], dtype=np.str_
        ),
    }
    payload.update(_window_arrays(window, report))
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            _write_npz(fh, payload)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def _write_npz(fh: IO[bytes], payload: Mapping[str, np.ndarray]) -> None:
    """The layout ``np.savez_compressed`` writes (one ``<key>.npy`` per array in a zip), at
    deflate level 1: at EP 1,024 the default level takes about 6x longer for ~15% fewer bytes.
    Every array is float64, int64 or str, so nothing is pickled."""
    with zipfile.ZipFile(fh, "w", zipfile.ZIP_DEFLATED, compresslevel=COMPRESS_LEVEL) as zf:
        for key, arr in payload.items():
            with zf.open(key + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(arr), allow_pickle=False)


def _header(path: Path, zf: zipfile.ZipFile, key: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """Declared shape and dtype of one member, read without decompressing its data."""
    try:
        with zf.open(key + ".npy") as fh:
            version = np.lib.format.read_magic(fh)
            reader = _HEADER_READERS.get(version)
            if reader is None:
                raise ArtifactError(f"{path}: key {key!r}: unsupported .npy version {version}")
            shape, _, dtype = reader(fh)
    except ArtifactError:
        raise
    except KeyError:
        raise ArtifactError(f"{path}: missing key {key!r}") from None
    except _READ_ERRORS as exc:
        raise ArtifactError(f"{path}: key {key!r}: corrupt or truncated ({exc})") from None
    return tuple(shape), dtype


def _read_header_1_0(fh: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    return np.lib.format.read_array_header_1_0(fh)


def _read_header_2_0(fh: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    return np.lib.format.read_array_header_2_0(fh)


_HEADER_READERS = {(1, 0): _read_header_1_0, (2, 0): _read_header_2_0}


class _Reader:
    """Checks each member's header, then loads it; every error names the file and key."""

    def __init__(self, path: Path, npz: Any) -> None:
        self.path = path
        self.npz = npz
        self.zip: zipfile.ZipFile = npz.zip

    def fail(self, key: str, message: str) -> ArtifactError:
        return ArtifactError(f"{self.path}: key {key!r}: {message}")

    def load(
        self, key: str, kind: str, shape: tuple[int, ...], max_chars: int = 0, shape_from: str = ""
    ) -> Any:
        """Member ``key`` checked against ``kind`` and ``shape`` before it is read;
        ``shape_from`` says where an expected shape comes from (a mismatch may be that key's)."""
        if key not in self.npz.files:
            raise ArtifactError(f"{self.path}: missing key {key!r}")
        declared_shape, dtype = _header(self.path, self.zip, key)
        if kind == "U":
            if dtype.kind != "U" or declared_shape != shape:
                raise self.fail(
                    key, f"expected a string of shape {shape}, got {dtype} {declared_shape}"
                )
            chars = dtype.itemsize // 4 * max(1, math.prod(declared_shape))
            if chars > max_chars:
                raise self.fail(key, f"declares {chars} characters, more than {max_chars} allowed")
        else:
            want = np.dtype(np.int64 if kind == "i" else np.float64)
            if dtype != want or declared_shape != shape:
                origin = f" ({shape_from})" if shape_from else ""
                raise self.fail(
                    key,
                    f"expected {want} of shape {shape}{origin}, got {dtype} of shape "
                    f"{declared_shape}",
                )
        try:
            arr = self.npz[key]
        except _READ_ERRORS as exc:
            raise self.fail(key, f"corrupt or truncated data ({exc})") from None
        if arr.shape != shape:
            raise self.fail(key, f"expected shape {shape}, got {arr.shape}")
        return arr

    def scalar(self, key: str) -> Any:
        kind = _SCALARS[key]
        max_chars = MAX_INSTANCE_ID_CHARS if key in ("instance_id", "kind") else MAX_JSON_CHARS
        arr = self.load(key, kind, (), max_chars)
        if kind == "U":
            return str(arr[()])
        value = arr[()].item()
        if kind == "f" and not math.isfinite(value):
            raise self.fail(key, f"must be finite, got {value!r}")
        return value


def load_window_artifact(
    path: str | os.PathLike[str],
) -> tuple[NormalWindow, dict[str, Any] | None, ArtifactMeta]:
    """Read an artifact back: ``(window, diagnosis dict or None, meta)``.

    Raises :class:`ArtifactError` (a ``ValueError``) naming the file, the key and the value on
    anything but a regular file within the size bounds, a wrong schema version, a missing key,
    a wrong shape or dtype, an EP size above :data:`MAX_EP_SIZE`, JSON nested too deep, or a
    truncated or corrupt file; ``FileNotFoundError`` when there is no file. Memory stays
    within the declared-size budget whatever the file holds.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a path, got {type(path).__name__}")
    p = Path(path)
    with open_regular_file(p, max_bytes=MAX_FILE_BYTES) as fh:
        _check_directory(p, fh)
        try:
            # NpzFile directly rather than np.load, which would read a .npy (of any declared
            # size) given a file that merely looks like one.
            npz = np.lib.npyio.NpzFile(fh, allow_pickle=False)
        except _READ_ERRORS as exc:
            raise ArtifactError(f"{p}: cannot open as NPZ ({exc})") from None
        with npz:
            return _load(p, npz)


_END_RECORD = struct.Struct("<4s4H2LH")
_END_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
_ZIP64_LOCATOR_BYTES = 20


def _check_directory(p: Path, fh: BinaryIO) -> None:
    """Bound the zip directory before :mod:`zipfile` parses it: it would read as many entries
    as the end record declares, one Python object each. Finds the end record as zipfile does."""
    size = os.fstat(fh.fileno()).st_size
    head = fh.read(4)
    tail_bytes = min(size, _END_RECORD.size + 0xFFFF + _ZIP64_LOCATOR_BYTES)
    fh.seek(size - tail_bytes)
    tail = fh.read(tail_bytes)
    at = len(tail) - _END_RECORD.size
    if not (tail[at : at + 4] == _END_SIGNATURE and tail[-2:] == b"\0\0"):
        at = tail.rfind(_END_SIGNATURE)
    if at < 0 or len(tail) - at < _END_RECORD.size or head != b"PK\x03\x04":
        # Every artifact starts with a local member header and ends with the end record.
        raise ArtifactError(f"{p}: not an NPZ (zip) archive, or truncated")
    if at >= _ZIP64_LOCATOR_BYTES and tail[at - _ZIP64_LOCATOR_BYTES :].startswith(
        _ZIP64_LOCATOR_SIGNATURE
    ):
        raise ArtifactError(
            f"{p}: zip directory: a ZIP64 end record (an artifact has at most {MAX_MEMBERS} "
            "members and is far below 4 GiB, so it never needs one)"
        )
    _, _, _, _, entries, directory_bytes, _, _ = _END_RECORD.unpack_from(tail, at)
    if entries > MAX_MEMBERS or directory_bytes > MAX_DIRECTORY_BYTES:
        raise ArtifactError(
            f"{p}: zip directory: declares {entries} members in {directory_bytes} bytes, more "
            f"than {MAX_MEMBERS} members or {MAX_DIRECTORY_BYTES} bytes"
        )
    fh.seek(0)


def _load(p: Path, npz: Any) -> tuple[NormalWindow, dict[str, Any] | None, ArtifactMeta]:
    if len(npz.files) > MAX_MEMBERS:
        raise ArtifactError(f"{p}: {len(npz.files)} members, more than {MAX_MEMBERS} expected")
    # Checked before any member is decompressed.
    declared = sum(info.file_size for info in npz.zip.infolist())
    if declared > MAX_DECLARED_BYTES:
        raise ArtifactError(
            f"{p}: members declare {declared} bytes uncompressed, more than the "
            f"{MAX_DECLARED_BYTES} an EP-{MAX_EP_SIZE} artifact needs"
        )
    r = _Reader(p, npz)
    if "schema_version" not in npz.files:
        raise ArtifactError(f"{p}: missing key 'schema_version' (not a rankwatch artifact?)")
    version = r.scalar("schema_version")
    if version == 1:
        raise r.fail(
            "schema_version",
            "version 1 stores dispatch_rdma_recv in the old relay layout, which cannot be "
            f"converted to the kernel's layout; this rankwatch reads version {SCHEMA_VERSION}",
        )
    if version != SCHEMA_VERSION:
        raise r.fail(
            "schema_version",
            f"unsupported version {version} (this rankwatch reads {SCHEMA_VERSION})",
        )
    scalars = {k: r.scalar(k) for k in _SCALARS}
    if scalars["kind"] != ARTIFACT_KIND:
        raise r.fail("kind", f"expected {ARTIFACT_KIND!r}, got {scalars['kind']!r}")
    ep, rpn = scalars["ep_size"], scalars["ranks_per_node"]
    if not 1 <= ep <= MAX_EP_SIZE:
        raise r.fail("ep_size", f"must be in 1..{MAX_EP_SIZE}, got {ep}")
    if not 1 <= rpn <= ep or ep % rpn:
        raise r.fail("ranks_per_node", f"must be a positive divisor of 'ep_size' ({ep}), got {rpn}")
    if scalars["window_index"] < 0:
        raise r.fail("window_index", f"must be >= 0, got {scalars['window_index']}")

    if "probes" not in npz.files:
        raise ArtifactError(f"{p}: missing key 'probes'")
    shape, dtype = _header(p, npz.zip, "probes")
    if dtype.kind != "U" or len(shape) != 1 or shape[0] > len(PROBES) or dtype.itemsize > 4 * 64:
        raise r.fail("probes", f"expected at most {len(PROBES)} probe names, got {dtype} {shape}")
    probes = tuple(str(x) for x in r.load("probes", "U", shape, 64 * len(PROBES)))
    unknown = [x for x in probes if x not in PROBES]
    if unknown or len(set(probes)) != len(probes):
        raise r.fail("probes", f"unknown or repeated probe names {list(probes)}")

    arrays: dict[str, np.ndarray] = {}
    for key in artifact_keys(probes)[len(_SCALARS) + 1 :]:
        shape = (ep,) if key.startswith("notify.") else (ep, ep)
        arrays[key] = r.load(key, "f", shape, shape_from=f"'ep_size' = {ep}")

    diagnosis: dict[str, Any] | None = None
    if scalars["diagnosis_json"]:
        diagnosis = _parse_json(r, "diagnosis_json", scalars["diagnosis_json"])
        declared = diagnosis.get("ep_size")
        if declared is not None and declared != ep:
            raise r.fail("diagnosis_json", f"ep_size {declared!r} does not match ep_size={ep}")
    extra = _parse_json(r, "extra_json", scalars["extra_json"] or "{}")

    try:
        window = NormalWindow(
            ep_size=ep,
            ranks_per_node=rpn,
            notify={
                x: (arrays[f"notify.{x}.duration_ns"], arrays[f"notify.{x}.count"])
                for x in probes
                if x in NOTIFY_PROBES
            },
            completion={
                x: tuple(arrays[f"completion.{x}.{f}"] for f in COMPLETION_RAW)
                for x in probes
                if x in COMPLETION_PROBES
            },
            window_index=scalars["window_index"],
            instance_id=scalars["instance_id"],
            start_time_s=scalars["start_time_s"],
            end_time_s=scalars["end_time_s"],
            extra=extra,
        )
    except ValueError as exc:
        raise ArtifactError(f"{p}: raw arrays rejected ({exc})") from None

    derived = {
        k: v
        for k, v in arrays.items()
        if k.rsplit(".", 1)[1] in NOTIFY_DERIVED + COMPLETION_DERIVED
    }
    for v in derived.values():
        v.setflags(write=False)
    meta = ArtifactMeta(
        path=p,
        schema_version=version,
        ep_size=ep,
        ranks_per_node=rpn,
        window_index=scalars["window_index"],
        instance_id=scalars["instance_id"],
        start_time_s=scalars["start_time_s"],
        end_time_s=scalars["end_time_s"],
        created_at_s=scalars["created_at_s"],
        probes=probes,
        derived=derived,
    )
    return window, diagnosis, meta


def _parse_json(r: _Reader, key: str, text: str) -> dict[str, Any]:
    value = parse_json(r.path, f"key {key!r}", text, max_items=MAX_JSON_ITEMS)
    if not isinstance(value, dict):
        raise r.fail(key, f"expected a JSON object, got {type(value).__name__}")
    return value


class ArtifactStore:
    """A folder of artifacts that keeps only the newest ``retention`` files (at least 1).

    The folder is always bounded: a caller configured to keep no artifact (the exporter's
    ``RANKWATCH_ARTIFACT_RETENTION=0``) simply does not build a store.

    Only files named like artifacts (``deepep-normal-*.npz``) are counted and pruned, so other
    files in the folder are never deleted. Newest means latest modification time, ties broken
    by name (the window index is zero-padded in default names). Safe to share between threads.
    """

    def __init__(self, directory: str | os.PathLike[str], retention: int = 100) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise TypeError(f"directory: expected a non-empty path, got {directory!r}")
        if isinstance(retention, bool) or not isinstance(retention, int):
            raise TypeError(f"retention: expected an int, got {retention!r}")
        if retention < 1:
            raise ValueError(f"retention: must be >= 1 (files kept), got {retention}")
        self.directory = Path(directory)
        self.retention = retention
        self._lock = threading.Lock()

    def path_for(self, name: str) -> Path:
        """The path of ``name`` inside the folder; rejects names that would leave it."""
        return self.directory / check_artifact_name(name)

    def save(
        self,
        window: NormalWindow,
        report: NormalReport | Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        created_at_s: float | None = None,
    ) -> Path:
        """Write one window's artifact, then prune beyond the retention; return its path."""
        if name is not None:
            check_artifact_name(name)
            if not name.startswith(ARTIFACT_PREFIX):
                raise ValueError(
                    f"name: store files must start with {ARTIFACT_PREFIX!r}, got {name!r}"
                )
        with self._lock:
            path = save_window_artifact(
                self.directory, window, report, name=name, created_at_s=created_at_s
            )
            self._prune()
        return path

    def paths(self) -> list[Path]:
        """The artifacts in the folder, oldest first."""
        return files_oldest_first(self.directory, ARTIFACT_PREFIX, ".npz")

    def prune(self) -> list[Path]:
        """Delete the oldest artifacts beyond the retention; return what was deleted."""
        with self._lock:
            return self._prune()

    def _prune(self) -> list[Path]:
        return prune_oldest(self.directory, ARTIFACT_PREFIX, ".npz", self.retention)
