"""Both install modes work: the editable install the suite runs on, and a plain `pip install .`.

The plain install is checked for real: build a wheel, install it into a fresh virtual
environment that borrows only third-party packages from this one, and import from there.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_editable_install_imports_from_the_source_tree() -> None:
    import rankwatch.diagnosis.config as cfg
    import rankwatch.exporter.catalogue as cat

    assert Path(cfg.__file__).resolve().parent == REPO / "diagnosis"
    assert Path(cat.__file__).resolve().parent == REPO / "exporter"


def test_wheel_installs_and_imports_outside_the_tree(tmp_path: Path) -> None:
    wheel_dir = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(REPO),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheel_dir.glob("rankwatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "rankwatch/diagnosis/__init__.py",
        "rankwatch/diagnosis/normal/schema.py",
        "rankwatch/exporter/catalogue.py",
    ):
        assert required in names, f"{required} missing from {wheel.name}"
    # No top-level `diagnosis`/`exporter` packages may leak into site-packages.
    assert not any(n.startswith(("diagnosis/", "exporter/")) for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
    )
    # Third-party packages come from this environment's site-packages, added as a plain path
    # entry: its .pth files (including the editable finder) are not processed that way.
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = (
        "import rankwatch.diagnosis.config as c, rankwatch.exporter.catalogue as k;"
        "print(c.__file__); print(k.__file__)"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout.split()
    assert all(str(site) in path for path in out), out
