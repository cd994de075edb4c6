"""Artifact files stay inside their folder whatever the names, ids and links around them.

An artifact's default name comes from the window's instance id (which a peer or a loaded file
may supply); a store prunes files it finds in a folder that other tools also write to. Neither
may write, replace or delete anything outside the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankwatch.diagnosis.deepep.artifact import (
    ARTIFACT_PREFIX,
    ArtifactStore,
    artifact_name,
    check_artifact_name,
    save_window_artifact,
)
from rankwatch.diagnosis.deepep.normal import NormalWindow
from rankwatch.diagnosis.deepep.normal.schema import NOTIFY_PROBES


def small_window(instance_id: str = "job", index: int = 0) -> NormalWindow:
    notify = {p: (np.full(2, 1000.0), np.full(2, 4.0)) for p in NOTIFY_PROBES}
    return NormalWindow(2, 1, notify, {}, window_index=index, instance_id=instance_id)


def inside(path: Path, folder: Path) -> bool:
    return path.resolve().parent == folder.resolve()


def listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


HOSTILE_IDS = st.one_of(
    st.text(max_size=80),
    st.sampled_from(
        [
            "../../etc/passwd",
            "/abs/path",
            "..",
            ".",
            "a/../../b",
            "..\\..\\win",
            "nul\x00byte",
            "\u2215slash\u2044",
            "x" * 1000,
            "deepep-normal-../x",
            "~root",
            "$(touch pwned)",
        ]
    ),
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(instance_id=HOSTILE_IDS, index=st.integers(0, 10**9))
def test_default_names_from_any_instance_id_stay_in_the_folder(
    tmp_path: Path, instance_id: str, index: int
) -> None:
    root = tmp_path / f"case-{abs(hash((instance_id, index)))}"
    folder = root / "artifacts"
    folder.mkdir(parents=True)
    name = artifact_name(small_window(instance_id, index))
    assert check_artifact_name(name) == name
    assert name.startswith(ARTIFACT_PREFIX) and len(name) <= 200
    path = ArtifactStore(folder, retention=3).save(small_window(instance_id, index))
    assert inside(path, folder), path
    # Nothing was written anywhere else under the test's root.
    assert listing(root) == {"artifacts", f"artifacts/{path.name}"}


BAD_NAMES = [
    "../escape.npz",
    "/tmp/escape.npz",
    "..\\escape.npz",
    "sub/escape.npz",
    ".hidden.npz",
    "escape.npz\x00.txt",
    "deepep-normal-../../escape.npz",
    "..",
    ".npz",
    "",
    "a" * 300 + ".npz",
    "not-an-artifact.txt",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_explicit_names_that_could_leave_the_folder_are_refused(tmp_path: Path, name: str):
    folder = tmp_path / "artifacts"
    store = ArtifactStore(folder, retention=3)
    with pytest.raises(ValueError, match="name"):
        store.save(small_window(), name=name)
    with pytest.raises(ValueError, match="name"):
        store.path_for(name)
    with pytest.raises(ValueError, match="name"):
        save_window_artifact(folder, small_window(), name=name)
    assert not folder.exists() or listing(folder) == set()
    assert listing(tmp_path) <= {"artifacts"}


@pytest.mark.parametrize("name", [None, 3, b"x.npz", Path("x.npz")])
def test_names_that_are_not_strings_are_refused(tmp_path: Path, name: object) -> None:
    with pytest.raises(TypeError, match="name"):
        check_artifact_name(name)


def test_pruning_never_follows_links_or_touches_other_files(tmp_path: Path) -> None:
    """A link named like an artifact that points outside, a directory named like one and an
    unrelated file: pruning 30 saves down to 5 files deletes none of them (nor their targets)."""
    folder = tmp_path / "artifacts"
    folder.mkdir()
    outside = tmp_path / "precious.npz"
    outside.write_bytes(b"not yours")
    link = folder / f"{ARTIFACT_PREFIX}aaaa-w00000000.npz"
    link.symlink_to(outside)
    fake_dir = folder / f"{ARTIFACT_PREFIX}dir-w00000001.npz"
    fake_dir.mkdir()
    notes = folder / "notes.txt"
    notes.write_text("keep me")
    store = ArtifactStore(folder, retention=5)
    for i in range(30):
        store.save(small_window("job", i))
    assert outside.read_bytes() == b"not yours"
    assert link.is_symlink() and fake_dir.is_dir() and notes.read_text() == "keep me"
    regular = [p for p in folder.iterdir() if p.is_file() and not p.is_symlink()]
    assert len([p for p in regular if p.name.startswith(ARTIFACT_PREFIX)]) == 5
    assert {p.name for p in store.paths()} == {p.name for p in regular if p.suffix == ".npz"}


def test_saving_over_a_planted_link_replaces_the_link_not_its_target(tmp_path: Path) -> None:
    """Someone plants a link where the next artifact will be written: the write goes to a new
    file in the folder (an atomic rename replaces the link itself), the target is untouched."""
    folder = tmp_path / "artifacts"
    folder.mkdir()
    target = tmp_path / "victim.txt"
    target.write_text("original")
    window = small_window("job", 7)
    planted = folder / artifact_name(window)
    planted.symlink_to(target)
    path = save_window_artifact(folder, window)
    assert path == planted
    assert not path.is_symlink() and path.is_file()
    assert target.read_text() == "original"
    # No temporary file is left behind either.
    assert sorted(os.listdir(folder)) == [path.name]
