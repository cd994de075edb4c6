"""``rankwatch hosts`` on artifact folders: the repeat offenders, the three formats, and one
clear line with exit 2 for every bad input (``exporter/cli/hosts.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rankwatch.exporter.cli.main import main
from tests.exporter.publish.test_attempts_summary import attempt_run

HOSTS = {r: f"node-{'abcd'[r // 2]}" for r in range(8)}  # two ranks per host


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four runs' folders: node-b (ranks 2, 3) is the culprit in r1, r2 and both attempts of
    r3; node-c in r4 only; node-a and node-d never."""
    root = tmp_path_factory.mktemp("runs")
    for run, culprit in (("r1", 2), ("r2", 3), ("r3", 2), ("r4", 4)):
        (root / run).mkdir()
        attempt_run(root / run, 0, culprit, HOSTS, run=run)
    attempt_run(root / "r3", 1, 3, HOSTS, run="r3")
    return root


def hosts(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["hosts", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_host_that_fails_run_after_run_is_listed_with_its_evidence(runs, capsys):
    code, out, err = hosts(capsys, str(runs))
    assert code == 0 and err == ""
    (line,) = out.splitlines()
    assert line.startswith(
        "node-b: culprit in 3 runs (4 attempts), healthy in 1; classes step_time_straggler; "
        "last seen "
    )
    assert line.endswith("; runs r1, r2, r3 (attempts 0, 1)")
    # Each run's folder given one by one reads the same.
    code, out_each, _ = hosts(capsys, *(str(runs / r) for r in ("r1", "r2", "r3", "r4")))
    assert (code, out_each) == (0, out)


def test_slurm_and_kubectl_formats_print_what_to_run(runs, capsys):
    assert hosts(capsys, str(runs), "--format", "slurm")[:2] == (0, "--exclude=node-b\n")
    assert hosts(capsys, str(runs), "--format", "kubectl")[:2] == (0, "kubectl cordon node-b\n")
    code, out, _ = hosts(capsys, str(runs), "--format", "kubectl", "--taint")
    assert code == 0
    assert out == "kubectl taint nodes node-b rankwatch.io/repeat-offender=true:NoSchedule\n"
    code, out, _ = hosts(
        capsys, str(runs), "--format", "kubectl", "--taint", "example.com/bad=yes:NoExecute"
    )
    assert code == 0
    assert out == "kubectl taint nodes node-b example.com/bad=yes:NoExecute\n"


def test_thresholds_change_who_is_listed(runs, capsys):
    code, out, _ = hosts(capsys, str(runs), "--min-runs", "1", "--format", "slurm")
    assert code == 0
    assert out == "--exclude=node-b,node-c\n"
    # node-b took part in 4 runs, 1 without being the culprit.
    code, out, err = hosts(capsys, str(runs), "--max-healthy-runs", "0")
    assert (code, out) == (0, "")
    assert "no host was the culprit in 3 runs or more (with at most 0 healthy)" in err


def test_runs_older_than_the_window_do_not_count(runs, capsys, tmp_path):
    old = tmp_path / "old"
    for run in ("r1", "r2", "r3"):
        (old / run).mkdir(parents=True)
        for f in (runs / run).iterdir():
            (old / run / f.name).write_bytes(f.read_bytes())
            os.utime(old / run / f.name, (1.0, 1.0))
    assert hosts(capsys, str(old), "--format", "slurm")[1] == ""
    assert hosts(capsys, str(old), "--format", "slurm", "--window", "100y")[1] == (
        "--exclude=node-b\n"
    )


def _summary(folder: Path, doc: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "summary.json"
    path.write_text(json.dumps(doc))
    return path


BAD_SUMMARIES = [
    ({"run": {"run_id": "r", "attempt": "1"}}, "run.attempt: expected an int >= 0, got '1'"),
    ({"incidents": "all of them"}, "incidents: expected a list"),
    (
        {
            "run": {"run_id": "r"},
            "incidents": [
                {"class": "hang", "severity": "critical", "ranks": [1], "hostnames": ["$(reboot)"]}
            ],
        },
        "hostname '$(reboot)' is not a host name",
    ),
    (
        {
            "run": {"run_id": "r"},
            "incidents": [],
            "step_time": {"ranks": [{"hostname": "node-a;rm -rf /"}]},
        },
        "hostname 'node-a;rm -rf /' is not a host name",
    ),
]


@pytest.mark.parametrize(("doc", "named"), BAD_SUMMARIES)
def test_a_hostile_summary_is_one_line_naming_the_file_and_field(tmp_path, capsys, doc, named):
    path = _summary(tmp_path / "run", doc)
    code, out, err = hosts(capsys, str(tmp_path / "run"))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and named in err and str(path) in err, err


def test_files_that_are_not_summaries_are_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "summary.json").write_bytes(b"\x00\xff" * 10)
    code, _, err = hosts(capsys, str(folder))
    assert code == 2 and err.count("\n") == 1 and "summary.json" in err
    (folder / "summary.json").unlink()
    os.mkfifo(folder / "summary.json")  # would block a plain open()
    code, _, err = hosts(capsys, str(folder))
    assert code == 2 and err.count("\n") == 1 and "FIFO" in err.upper()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ((), "give either --prometheus URL or artifact folders"),
        (("DIR", "--prometheus", "http://127.0.0.1:9"), "not both"),
        (("/no/such/folder",), "/no/such/folder: not a folder of run summaries"),
        (("DIR", "--window", "a week"), "--window: expected a Prometheus duration"),
        (("DIR", "--min-runs", "0"), "--min-runs: expected 1 to 10000, got 0"),
        (("DIR", "--max-healthy-runs", "-1"), "--max-healthy-runs: expected 0 to 10000"),
        (("DIR", "--taint"), "--taint: only with --format kubectl"),
        (
            ("DIR", "--format", "kubectl", "--taint", "x; reboot"),
            "--taint: expected KEY=VALUE:EFFECT",
        ),
        (("--prometheus", "ftp://host"), "--prometheus: expected an http:// or https:// URL"),
        (("--prometheus", "http://u:pw@host:9090"), "credentials in the URL are refused"),
        (("--prometheus", "http://h:9090", "--user", "me"), "--user 'me': needs --password-file"),
        (
            ("--prometheus", "http://h:9090", "--password-file", "/etc/hostname"),
            "--password-file: needs --user",
        ),
        (
            ("--prometheus", "http://h:9090", "--user", "me", "--password-file", "/no/file"),
            "--password-file /no/file: cannot be read",
        ),
        (
            ("--prometheus", "http://h:9090", "--selector", 'job="x"} or vector(1'),
            "--selector: expected one label matcher",
        ),
        (("--prometheus", "http://h:9090", "--ca-file", "ca.pem"), "--ca-file: only for an https"),
        (("--prometheus", "http://h:9090", "--timeout-seconds", "0"), "--timeout-seconds"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(runs, capsys, args, named):
    args = tuple(str(runs) if a == "DIR" else a for a in args)
    code, out, err = hosts(capsys, *args)
    assert (code, out) == (2, "")
    assert err.startswith("rankwatch hosts: error: ") and err.count("\n") == 1, err
    assert named in err, err
    assert ":pw@" not in err  # a password in a URL is never printed
