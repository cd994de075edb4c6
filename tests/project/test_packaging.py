"""Both install modes work: the editable install the suite runs on, and a plain `pip install .`.

The plain install is checked for real: build a wheel, install it into a fresh virtual
environment that borrows only third-party packages from this one, and import from there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.servers import REPO


def _third_party_paths() -> str:
    """The site-packages folders this interpreter reads, one a line (a .pth file's body): its
    own and any another .pth file chains in, since a borrowed folder's .pth files are not read."""
    folders = [sysconfig.get_paths()["purelib"]]
    folders += [p for p in sys.path if p.endswith("site-packages") and p not in folders]
    return "".join(f"{folder}\n" for folder in folders)


def test_editable_install_imports_from_the_source_tree() -> None:
    import rankwatch.diagnosis.config as cfg
    import rankwatch.exporter.publish.catalogue as cat

    assert Path(cfg.__file__).resolve().parent == REPO / "diagnosis"
    assert Path(cat.__file__).resolve().parent == REPO / "exporter" / "publish"


@pytest.mark.slow
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
    # Every module of the source folders ships (a subpackage missing from pyproject's package
    # list would be left out of the wheel while the editable install still finds it).
    sources = [p for top in ("diagnosis", "exporter") for p in (REPO / top).rglob("*.py")]
    assert len(sources) > 50
    for source in sources:
        required = "rankwatch/" + source.relative_to(REPO).as_posix()
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
    (site / "borrowed.pth").write_text(_third_party_paths())
    probe = (
        "import rankwatch.diagnosis.config as c, rankwatch.exporter.publish.catalogue as k;"
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


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]


@pytest.mark.slow
def test_release_build_installs_exports_the_assets_and_runs_the_demo(tmp_path: Path) -> None:
    """`python -m build` (sdist, then the wheel built from that sdist) passes `twine check`;
    the wheel, installed into a fresh virtual environment, writes out exactly the repository's
    dashboards, rules and manifests and runs the demo to its summary."""
    dist = tmp_path / "dist"
    # No build isolation: the build backend comes from this environment, not from the network.
    _run([sys.executable, "-m", "build", "--no-isolation", "-o", str(dist), str(REPO)])
    (wheel,) = dist.glob("rankwatch-*.whl")
    (sdist,) = dist.glob("rankwatch-*.tar.gz")
    import rankwatch

    assert wheel.name.startswith(f"rankwatch-{rankwatch.__version__}-")
    checked = _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)])
    assert checked.stdout.count("PASSED") == 2, checked.stdout

    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "rankwatch/__init__.py",
        "rankwatch/_assets/dashboards/rules/rankwatch.rules.yml",
        "rankwatch/_assets/deploy/kubernetes/podmonitor.yaml",
    ):
        assert required in names, f"{required} missing from {wheel.name}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = zipfile.ZipFile(wheel).read(f"rankwatch-{rankwatch.__version__}.dist-info/METADATA")
    text = metadata.decode()
    assert "License-Expression: Apache-2.0" in text
    for dep in ("rich", "matplotlib", "pillow", "grpc"):
        # only behind their extras: every rank carries nothing it does not need
        lines = [ln for ln in text.splitlines() if ln.startswith("Requires-Dist:") and dep in ln]
        assert lines and all("extra ==" in ln for ln in lines), (dep, lines)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    site = next((venv / "lib").glob("python*/site-packages"))
    _run(
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
        ]
    )
    # Third-party packages (torch included) come from this environment, as in the test above.
    (site / "borrowed.pth").write_text(_third_party_paths())
    python = str(venv / "bin" / "python")
    where = _run([python, "-c", "import rankwatch; print(rankwatch.__file__)"], cwd=tmp_path)
    assert str(site) in where.stdout

    # PyYAML is not a runtime dependency: the export must not import it (it is blocked here,
    # since the borrowed third-party packages include it).
    def export(out: Path, *options: str) -> None:
        argv = ["assets", "export", str(out), *options]
        script = (
            "import sys; sys.modules['yaml'] = None\n"
            "from rankwatch.exporter.cli import main\n"
            f"sys.exit(main({argv!r}))\n"
        )
        done = subprocess.run(
            [python, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr

    out = tmp_path / "exported"
    export(out)
    from rankwatch.exporter.cli.assets import list_assets

    expected = {a.relative: a.source.read_bytes() for a in list_assets(REPO)}
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert sorted(got) == sorted(expected)
    assert got == expected  # byte for byte
    for key in (
        "dashboards/rankwatch-overview.json",
        "dashboards/rules/rankwatch.rules.yml",
        "deploy/kubernetes/prometheusrule.yaml",
        "deploy/compose/compose.yaml",
    ):
        assert key in got
    assert not any(name.endswith(".py") for name in got if name.startswith("dashboards/"))

    # Alert timing changed from the installed package: only the for: lines move.
    timed = tmp_path / "exported-timing"
    export(timed, "--for", "RankwatchStepTimeStragglerCritical=30s")
    rules = "dashboards/rules/rankwatch.rules.yml"
    changed = (timed / rules).read_text()
    assert changed != got[rules].decode()
    import yaml

    from rankwatch.exporter.assets import ALERT_TIMING

    alerts = {
        r["alert"]: r for g in yaml.safe_load(changed)["groups"] for r in g["rules"] if "alert" in r
    }
    assert alerts["RankwatchStepTimeStragglerCritical"]["for"] == "30s"
    assert alerts["RankwatchExporterDown"]["for"] == ALERT_TIMING["RankwatchExporterDown"].for_
    assert (timed / "deploy/kubernetes/prometheusrule.yaml").read_bytes() != got[
        "deploy/kubernetes/prometheusrule.yaml"
    ]
    assert (timed / "dashboards/rankwatch-overview.json").read_bytes() == got[
        "dashboards/rankwatch-overview.json"
    ]

    demo_out = tmp_path / "demo-out"
    demo = subprocess.run(
        [
            *(python, "-m", "rankwatch.exporter.cli", "demo", "--duration", "20"),
            *("--ranks", "2", "--port", "0", "--plain", "--out", str(demo_out)),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=240,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    summary = json.loads((demo_out / "summary.json").read_text())
    assert summary["run"]["steps"] > 0
    assert (demo_out / "summary.txt").read_text().strip()


@pytest.mark.slow
def test_commands_name_the_extra_to_install_when_it_is_missing() -> None:
    # rich and matplotlib are optional extras: blocked here as if they were not installed.
    for blocked, argv, extra in (
        ("rich", ["demo", "--duration", "1"], "demo"),
        ("matplotlib", ["heatmap", "--all", "window.npz"], "heatmap"),
    ):
        script = (
            f"import sys; sys.modules[{blocked!r}] = None\n"
            "from rankwatch.exporter.cli import main\n"
            f"sys.exit(main({argv!r}))\n"
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert done.returncode == 2, done.stderr
        assert f"pip install 'rankwatch[{extra}]'" in done.stderr, done.stderr
        assert blocked in done.stderr


def test_assets_export_refuses_to_overwrite_edited_files(tmp_path: Path) -> None:
    from rankwatch.exporter.cli import main

    assert main(["assets", "export", str(tmp_path)]) == 0
    rules = tmp_path / "dashboards" / "rules" / "rankwatch.rules.yml"
    original = rules.read_bytes()
    assert original == (REPO / "dashboards" / "rules" / "rankwatch.rules.yml").read_bytes()
    assert main(["assets", "export", str(tmp_path)]) == 0  # identical files: nothing to do
    rules.write_text("# edited by an operator\n")
    assert main(["assets", "export", str(tmp_path)]) == 2
    assert rules.read_text() == "# edited by an operator\n"
    assert main(["assets", "export", "--force", str(tmp_path)]) == 0
    assert rules.read_bytes() == original
