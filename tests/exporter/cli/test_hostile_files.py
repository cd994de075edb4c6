"""Hostile files on the command line: each one refused in one line, exit code 2, bounded memory.

Every input is built here by the test. One child process (address space limited with
``RLIMIT_AS``) runs ``rankwatch diagnose`` on each file, ``rankwatch heatmap`` on each NPZ and
the step-time module's own command on each JSON, calling the command's ``main`` in-process so
that each refusal can be measured with ``tracemalloc``; then ``rankwatch replay`` on the folder
holding them all. A FIFO that made a reader block would hang the child: the timeout below only
turns that hang into a failure, no figure depends on time.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import socket
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rankwatch.diagnosis.deepep.artifact import (
    MAX_DECLARED_BYTES,
    MAX_EP_SIZE,
    MAX_FILE_BYTES,
    MAX_JSON_CHARS,
    MAX_MEMBERS,
    save_window_artifact,
)
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator
from rankwatch.diagnosis.step_time import artifact as step_artifact
from rankwatch.diagnosis.step_time.artifact import example_window, window_to_dict
from rankwatch.diagnosis.step_time.table import MAX_RANK_ID
from rankwatch.diagnosis.untrusted_files import MAX_JSON_DEPTH, MAX_JSON_INT_DIGITS
from tests.diagnosis.deepep.test_fuzz_artifacts import header_only, members, npy, write_zip

pytestmark = pytest.mark.slow

EP = 4
# A refusal allocates (Python and numpy, as tracemalloc sees them) at most this much.
PEAK_BYTES = 48 * 2**20
# The child's whole address space: the EP-4096 file alone took 2.9 GB before.
ADDRESS_SPACE_BYTES = 3 * 2**30
DEEP = 1_000_000
# Inside an NPZ a JSON string may hold 2**20 characters: as deep as that allows.
DEEP_IN_NPZ = 500_000


@dataclass(frozen=True)
class Case:
    """One hostile file: its name, how to build it in a folder, and what the refusal says."""

    name: str
    build: Callable[[Path], None]
    says: str


# ---- builders ---------------------------------------------------------------------------------


def _good_npz(target: Path) -> Path:
    """A good artifact in the ``good`` folder beside ``target``, named after it."""
    sim = NormalSimulator(EP, 2, seed=1, slow_rank=1)
    good = target.parent / "good" / target.name
    return save_window_artifact(good, sim.window("pre_dispatch_delay", 0))


def npz_with(**replace: Any) -> Callable[[Path], None]:
    """A good artifact with some members replaced (bytes as they are, arrays as .npy)."""

    def build(target: Path) -> None:
        parts = members(_good_npz(target))
        for key, value in replace.items():
            parts[key.replace("__", ".") + ".npy"] = (
                value if isinstance(value, bytes) else npy(value)
            )
        write_zip(target, parts)

    return build


def npz_bytes(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def build(target: Path) -> None:
        target.write_bytes(edit(_good_npz(target).read_bytes()))

    return build


def _flip_in_member(data: bytes) -> bytes:
    """Damage the compressed data of the first Completion cost member."""
    at = data.index(b"completion.dispatch_final.cost.npy") + 60
    return data[:at] + bytes(b ^ 0x5A for b in data[at : at + 16]) + data[at + 16 :]


def _end_record(data: bytes) -> int:
    return data.rindex(b"PK\x05\x06")


def _with_zip64_locator(data: bytes) -> bytes:
    at = _end_record(data)
    return data[:at] + b"PK\x06\x07" + b"\0" * 16 + data[at:]


def _declaring_entries(data: bytes) -> bytes:
    at = _end_record(data)
    return data[: at + 8] + struct.pack("<HHL", 65535, 65535, 40_000_000) + data[at + 16 :]


def _patch_central(data: bytes, offset: int, value: bytes) -> bytes:
    """Patch every central directory header at ``offset`` (flags at 8, method at 10)."""
    out = bytearray(data)
    at = out.find(b"PK\x01\x02")
    while at >= 0:
        out[at + offset : at + offset + len(value)] = value
        at = out.find(b"PK\x01\x02", at + 4)
    return bytes(out)


def _big_ep(target: Path) -> None:
    """The issue's file: EP 4096 with two Completion probes, zero-filled (1.7 MB on disk)."""
    parts = members(_good_npz(target))
    ep = 4096
    probes = ("notify_dispatch", "dispatch_final", "combine_logical_recv")
    parts = {k: v for k, v in parts.items() if not k.startswith(("notify.", "completion."))}
    parts["ep_size.npy"] = npy(np.int64(ep))
    parts["ranks_per_node.npy"] = npy(np.int64(8))
    parts["probes.npy"] = npy(np.array(probes))
    matrix = np.ones((ep, ep))
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, data in parts.items():
            zf.writestr(name, data)
        for p in probes[1:]:
            for f in ("cost", "samples", "tokens", "cost_per_sample", "tokens_per_sample"):
                with zf.open(f"completion.{p}.{f}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, matrix)
        for f in ("duration_ns", "count", "avg_ns", "ratio"):
            zf.writestr(f"notify.notify_dispatch.{f}.npy", npy(np.ones(ep)))


def _over_budget(target: Path) -> None:
    """A good artifact plus one member of zeros declaring more than the whole budget."""
    target.write_bytes(_good_npz(target).read_bytes())
    chunk = b"\0" * 2**24
    with (
        zipfile.ZipFile(target, "a", zipfile.ZIP_DEFLATED, compresslevel=1) as zf,
        zf.open("padding.npy", "w", force_zip64=True) as member,
    ):
        for _ in range(MAX_DECLARED_BYTES // len(chunk) + 1):
            member.write(chunk)


def _too_many_members(target: Path) -> None:
    parts = members(_good_npz(target))
    parts.update({f"extra{i}.npy": npy(np.int64(i)) for i in range(MAX_MEMBERS)})
    write_zip(target, parts)


def _npy_version_3(target: Path) -> None:
    npz_with(kind=b"\x93NUMPY\x03\x00" + npy(np.array("x"))[8:])(target)


class _Payload:
    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (print, ("unpickled",))


def text(content: str | bytes) -> Callable[[Path], None]:
    def build(target: Path) -> None:
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content, encoding="utf-8")

    return build


def _step_doc() -> dict[str, Any]:
    ex = example_window(ranks=2, steps=3)
    return window_to_dict(ex.per_rank, strategy="ddp", window=3)


def step_json(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def build(target: Path) -> None:
        doc = _step_doc()
        result = edit(doc)
        target.write_text(result if isinstance(result, str) else json.dumps(doc))

    return build


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return edit


def _raw_value(path: str, raw: str) -> Callable[[dict[str, Any]], str]:
    """Put a literal (NaN, 1e400, a 400-digit integer) where json.dumps cannot."""

    def edit(doc: dict[str, Any]) -> str:
        _set(path, "@@RAW@@")(doc)
        return json.dumps(doc).replace('"@@RAW@@"', raw)

    return edit


def _rank_key(key: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["ranks"][key] = doc["ranks"].pop("1")

    return edit


def _deep(key: str) -> Callable[[dict[str, Any]], str]:
    return _raw_value(key, "[" * DEEP + "]" * DEEP)


def special(kind: str) -> Callable[[Path], None]:
    def build(target: Path) -> None:
        if kind == "fifo":
            os.mkfifo(target)
        elif kind == "directory":
            target.mkdir()
        elif kind == "loop":
            target.symlink_to(target.name)
        elif kind == "device":
            target.symlink_to("/dev/zero")
        elif kind == "socket":
            # AF_UNIX paths are short: bind from inside the folder.
            here = os.getcwd()
            os.chdir(target.parent)
            try:
                sock = socket.socket(socket.AF_UNIX)
                sock.bind(target.name)
                sock.close()
            finally:
                os.chdir(here)
        elif kind == "dangling":
            target.symlink_to("absent-target")
        elif kind == "sparse":
            with target.open("wb") as fh:
                fh.truncate(max(MAX_FILE_BYTES, step_artifact.MAX_FILE_BYTES) + 1)

    return build


def _nothing(target: Path) -> None:
    """The file is not there at all."""


CASES = [
    # ---- NPZ: not a zip, damaged zip -------------------------------------------------------
    Case("empty.npz", text(b""), "not an NPZ (zip) archive"),
    Case("text.npz", text("hello, not a zip\n"), "not an NPZ (zip) archive"),
    Case("cut-header.npz", npz_bytes(lambda d: d[:200]), "not an NPZ (zip) archive"),
    Case("cut-half.npz", npz_bytes(lambda d: d[: len(d) // 2]), "not an NPZ (zip) archive"),
    Case("flipped.npz", npz_bytes(_flip_in_member), "completion.dispatch_final.cost"),
    Case("encrypted.npz", npz_bytes(lambda d: _patch_central(d, 8, b"\x01")), "key "),
    Case("method-99.npz", npz_bytes(lambda d: _patch_central(d, 10, b"\x63\x00")), "key "),
    Case("zip64-end.npz", npz_bytes(_with_zip64_locator), "ZIP64 end record"),
    Case("directory-65535.npz", npz_bytes(_declaring_entries), "declares 65535 members"),
    Case("npy-as-npz.npz", text(header_only("<f8", (10**6, 10**6))), "not an NPZ (zip)"),
    Case("pickle-as-npz.npz", text(pickle.dumps(_Payload())), "not an NPZ (zip) archive"),
    # ---- NPZ: pickles, types, sizes ----------------------------------------------------------
    Case(
        "pickled-kind.npz",
        npz_with(kind=npy(np.array([_Payload()], dtype=object), allow_pickle=True)),
        "key 'kind': expected a string",
    ),
    Case(
        "pickled-counts.npz",
        npz_with(
            notify__notify_dispatch__count=npy(
                np.array([_Payload()] * EP, dtype=object), allow_pickle=True
            )
        ),
        "key 'notify.notify_dispatch.count': expected float64",
    ),
    Case(
        "float32-cost.npz",
        npz_with(completion__dispatch_final__cost=np.ones((EP, EP), np.float32)),
        "expected float64 of shape (4, 4) ('ep_size' = 4), got float32",
    ),
    Case(
        "huge-shape.npz",
        npz_with(completion__dispatch_final__cost=header_only("<f8", (4096, 4096))),
        "expected float64 of shape (4, 4) ('ep_size' = 4), got float64 of shape (4096, 4096)",
    ),
    Case(
        "huge-string.npz",
        npz_with(extra_json=header_only("<U100000000", ())),
        f"more than {MAX_JSON_CHARS} allowed",
    ),
    Case("ep-4096-two-probes.npz", _big_ep, "more than the"),
    Case("over-budget.npz", _over_budget, f"more than the {MAX_DECLARED_BYTES}"),
    Case("65-plus-members.npz", _too_many_members, "members"),
    Case("npy-version-3.npz", _npy_version_3, "unsupported .npy version (3, 0)"),
    # ---- NPZ: values -------------------------------------------------------------------------
    Case("ep-0.npz", npz_with(ep_size=np.int64(0)), f"must be in 1..{MAX_EP_SIZE}, got 0"),
    Case("ep-negative.npz", npz_with(ep_size=np.int64(-1)), "must be in 1..1024, got -1"),
    Case("ep-2-62.npz", npz_with(ep_size=np.int64(2**62)), f"got {2**62}"),
    Case("ep-2048.npz", npz_with(ep_size=np.int64(2048)), "must be in 1..1024, got 2048"),
    Case("ranks-per-node-3.npz", npz_with(ranks_per_node=np.int64(3)), "positive divisor"),
    Case("window-negative.npz", npz_with(window_index=np.int64(-5)), "must be >= 0, got -5"),
    Case("schema-1.npz", npz_with(schema_version=np.int64(1)), "old relay layout"),
    Case("schema-3.npz", npz_with(schema_version=np.int64(3)), "unsupported version 3"),
    Case("kind-other.npz", npz_with(kind=np.array("something.else")), "expected 'rankwatch"),
    Case("start-nan.npz", npz_with(start_time_s=np.float64("nan")), "must be finite, got nan"),
    Case("end-inf.npz", npz_with(end_time_s=np.float64("inf")), "must be finite, got inf"),
    Case(
        "count-nan.npz",
        npz_with(notify__notify_dispatch__count=np.full(EP, np.nan)),
        "raw arrays rejected",
    ),
    Case(
        "extra-deep.npz",
        npz_with(extra_json=np.array("[" * DEEP_IN_NPZ + "]" * DEEP_IN_NPZ)),
        f"key 'extra_json': JSON nested more than {MAX_JSON_DEPTH} levels",
    ),
    Case(
        "diagnosis-deep.npz",
        npz_with(diagnosis_json=np.array('{"a":' + "[" * DEEP_IN_NPZ + "]" * DEEP_IN_NPZ + "}")),
        "key 'diagnosis_json': JSON nested more than",
    ),
    Case(
        "extra-huge-int.npz",
        npz_with(extra_json=np.array('{"step": 1' + "0" * 400 + "}")),
        "an integer of 401 digits",
    ),
    Case("extra-list.npz", npz_with(extra_json=np.array("[1, 2]")), "expected a JSON object"),
    Case("extra-bad.npz", npz_with(extra_json=np.array("{'a': 1}")), "not valid JSON"),
    Case("extra-nan.npz", npz_with(extra_json=np.array('{"a": NaN}')), "NaN is not a JSON"),
    Case("extra-1e400.npz", npz_with(extra_json=np.array('{"a": 1e400}')), "not finite"),
    # ---- step-time JSON ----------------------------------------------------------------------
    Case("empty.json", text(""), "not valid JSON"),
    Case("latin1.json", text(b'{"format": "caf\xe9"}'), "not UTF-8 text (byte 0xe9"),
    Case("utf16.json", text('{"format": 1}'.encode("utf-16")), "not UTF-8 text (byte 0xff"),
    Case("not-json.json", text("format: yaml\n"), "not valid JSON"),
    Case("a-list.json", text("[1, 2, 3]"), "is not a JSON object"),
    Case("other-format.json", text('{"format": "grafana"}'), "format: value 'grafana'"),
    Case("version-3.json", step_json(_set("version", 3)), "version: value 3 is not supported"),
    Case("version-text.json", step_json(_set("version", "1")), "version: value '1' is not an int"),
    Case("deep.json", step_json(_deep("meta")), "JSON nested more than 64 levels"),
    Case(
        "step-1e400.json",
        step_json(_raw_value("ranks/0/step_id/0", "1" + "0" * 400)),
        f"an integer of 401 digits (at most {MAX_JSON_INT_DIGITS})",
    ),
    Case(
        "step-1e19.json",
        step_json(_set("ranks/0/step_id/0", 10**19)),
        "step_id[0]: value 10000000000000000000 is above 9007199254740992",
    ),
    Case("step-negative.json", step_json(_set("ranks/0/step_id/0", -1)), "not a non-negative"),
    Case("rank-1e22.json", step_json(_rank_key(str(10**22))), f"not an int in 0..{MAX_RANK_ID}"),
    Case("rank-2-31.json", step_json(_rank_key(str(2**31))), f"is above {MAX_RANK_ID}"),
    Case("rank-negative.json", step_json(_rank_key("-1")), "'-1' is not a non-negative int"),
    Case("rank-name.json", step_json(_rank_key("rank-one")), "'rank-one' is not an int"),
    Case(
        "time-nan.json",
        step_json(_raw_value("ranks/0/cpu/forward/0", "NaN")),
        "NaN is not a JSON number",
    ),
    Case(
        "time-infinity.json",
        step_json(_raw_value("ranks/0/cpu/forward/0", "-Infinity")),
        "-Infinity is not a JSON number",
    ),
    Case(
        "time-1e400.json",
        step_json(_raw_value("ranks/0/cpu/forward/0", "1e400")),
        "not finite as float64",
    ),
    Case("time-negative.json", step_json(_set("ranks/0/cpu/forward/0", -3.0)), "is negative"),
    Case(
        "too-many-ranks.json",
        step_json(_set("ranks", {str(r): None for r in range(step_artifact.MAX_RANKS + 1)})),
        f"more than the {step_artifact.MAX_RANKS} allowed",
    ),
    Case(
        "too-many-rows.json",
        step_json(_set("ranks", {"0": {"step_id": list(range(step_artifact.MAX_ROWS + 1))}})),
        f"step rows in all, more than the {step_artifact.MAX_ROWS} allowed",
    ),
    Case(
        "million-lists.json",
        step_json(_raw_value("meta", "[" + ",".join(["[]"] * 1_000_001) + "]")),
        "more than 1000000 JSON objects, arrays and strings",
    ),
    Case(
        "million-strings.json",
        step_json(_raw_value("meta", "[" + ",".join(['"ab"'] * 1_000_001) + "]")),
        "more than 1000000 JSON objects, arrays and strings",
    ),
    Case("long-key.json", step_json(_set("x" * 10**6, 1)), "unknown key in a version 2"),
    Case(
        "long-config-value.json",
        step_json(_set("config", {"straggler_warning_score": "x" * 10**6})),
        "config: ",
    ),
    # ---- not regular files, and files too large to be one --------------------------------------
    Case("fifo.json", special("fifo"), "not a regular file (a FIFO)"),
    Case("fifo.npz", special("fifo"), "not a regular file (a FIFO)"),
    Case("folder.json", special("directory"), "not a regular file (a directory)"),
    Case("folder.npz", special("directory"), "not a regular file (a directory)"),
    Case("loop.json", special("loop"), "Too many levels of symbolic links"),
    Case("loop.npz", special("loop"), "Too many levels of symbolic links"),
    Case("device.npz", special("device"), "not a regular file (a character device)"),
    Case("device.json", special("device"), "not a regular file (a character device)"),
    Case("socket.npz", special("socket"), "not a regular file (a socket)"),
    Case("dangling.json", special("dangling"), "no such file"),
    Case("missing.npz", _nothing, "no such file"),
    Case("sparse-huge.npz", special("sparse"), f"more than the {MAX_FILE_BYTES} allowed"),
    Case(
        "sparse-huge.json",
        special("sparse"),
        f"more than the {step_artifact.MAX_FILE_BYTES} allowed",
    ),
]

# Runs in the child: every command's main() on every file, one tracemalloc peak each.
_CHILD = r"""
import contextlib, io, json, sys, tracemalloc
from rankwatch.exporter.cli.main import main
from rankwatch.diagnosis.step_time import artifact as step_artifact

def run(command, path):
    err, out = io.StringIO(), io.StringIO()
    tracemalloc.start()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            if command == "step-module":
                code = step_artifact.main([path])
            else:
                code = main([command, *(["--all"] if command == "heatmap" else []), path])
    except BaseException as exc:  # the test reports it; nothing may escape main()
        code, err = "raised", io.StringIO(f"{type(exc).__name__}: {exc}"[:2000])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"code": code, "stderr": err.getvalue(), "stdout": out.getvalue(), "peak": peak}

results = {}
for path in json.loads(sys.argv[1]):
    commands = ["diagnose", "heatmap" if path.endswith(".npz") else "step-module"]
    results[path] = {c: run(c, path) for c in commands}
folder = sys.argv[2]
results["replay"] = run("replay", folder)
print(json.dumps(results))
"""


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("hostile")
    for case in CASES:
        case.build(folder / case.name)
    paths = [str(folder / case.name) for case in CASES]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(paths), str(folder)],
        capture_output=True,
        text=True,
        timeout=1800,  # only a hang (a blocking open) comes near this
        preexec_fn=_limit_address_space,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, json.loads(proc.stdout.splitlines()[-1])


def test_the_corpus_is_the_size_of_the_review() -> None:
    assert len(CASES) >= 52
    assert len({c.name for c in CASES}) == len(CASES)


def _one_line(result: dict[str, Any], prefix: str) -> str:
    assert result["code"] == 2, result
    lines = result["stderr"].splitlines()
    assert len(lines) == 1, lines[:5]
    line: str = lines[0]
    assert line.startswith(prefix), line
    assert "Traceback" not in line
    # A value from the file is cut short: the line stays readable.
    assert len(line) < 600, line[:200]
    return line


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_hostile_file_is_refused_in_one_line(
    case: Case, outcomes: tuple[Path, dict[str, Any]]
) -> None:
    folder, results = outcomes
    path = str(folder / case.name)
    per_command = results[path]
    line = _one_line(per_command["diagnose"], "rankwatch diagnose: error: ")
    assert path in line and case.says in line, line
    if case.name.endswith(".npz"):
        other = _one_line(per_command["heatmap"], "rankwatch heatmap: error: ")
    else:
        other = _one_line(per_command["step-module"], "error: ")
    assert case.says in other, other
    for command, result in per_command.items():
        assert result["peak"] < PEAK_BYTES, (command, result["peak"])


def test_memory_of_the_refusals(outcomes: tuple[Path, dict[str, Any]]) -> None:
    _, results = outcomes
    peaks = {
        (Path(path).name, command): r["peak"]
        for path, per_command in results.items()
        if path != "replay"
        for command, r in per_command.items()
    }
    worst = max(peaks, key=lambda k: peaks[k])
    print(
        f"{len(CASES)} of {len(CASES)} hostile files; tracemalloc peak of the worst refusal "
        f"{peaks[worst] / 2**20:.1f} MiB ({worst[0]}, {worst[1]}); replay of the folder "
        f"{results['replay']['peak'] / 2**20:.1f} MiB"
    )
    assert peaks[worst] < PEAK_BYTES


def test_replay_reports_every_file_and_goes_on(outcomes: tuple[Path, dict[str, Any]]) -> None:
    folder, results = outcomes
    replay = results["replay"]
    assert replay["code"] == 2, replay["stderr"]
    lines = replay["stdout"].splitlines()
    # Every hostile file is named once, except the ones that are not there or not ours: a
    # missing file is not in the folder; a step-time JSON is recognised by its format string,
    # so a file that does not carry it (empty, not UTF-8, another document) is not a window.
    named = {c.name for c in CASES if any(f"{folder / c.name}: error: " in ln for ln in lines)}
    not_windows = {
        "missing.npz",
        "empty.json",
        "latin1.json",
        "utf16.json",
        "not-json.json",
        "a-list.json",
        "other-format.json",
        "sparse-huge.json",
    }
    assert named == {c.name for c in CASES} - not_windows
    assert lines[-1].endswith(f"{len(named)} refused"), lines[-1]
    # The good artifacts the NPZ builders started from (in good/) are replayed all the same.
    good = len(list((folder / "good").glob("*.npz")))
    assert good > 20
    assert lines[-1].startswith(f"replayed {good} DeepEP windows"), lines[-1]
    assert "Traceback" not in replay["stderr"]
