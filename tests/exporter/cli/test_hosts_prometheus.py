"""``rankwatch hosts --prometheus``: a real Prometheus behind basic auth scrapes the real
``/metrics`` of five attempts of four runs (one process's publisher each, fed real diagnosed
windows), node-b the culprit in three of the four runs; the command names node-b alone, and a
wrong login, an unreachable URL, a server that is not Prometheus and a hostile host label each
give one line and exit 2. The fleet's rules run on the same series (the ledger evaluated every
second here instead of every 5 minutes): RankwatchRepeatOffenderHost fires for node-b alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rankwatch.diagnosis.config import DiagnosisConfig
from rankwatch.exporter.assets.rules import rules_yaml
from rankwatch.exporter.assets.settings import Settings
from rankwatch.exporter.cli.main import main
from rankwatch.exporter.cli.prometheus_api import PrometheusReader
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.publish.hub import PublisherHub
from tests.publish_reports import rank_infos, step_report, window
from tests.servers import Server, free_port, prometheus, wait_until

pytestmark = [pytest.mark.servers, pytest.mark.parallel_safe]  # counts and contents only

USER, PASSWORD = "fleet", "fleet-secret"
# bcrypt of PASSWORD (cost 4: the test's login is checked quickly), as Prometheus' web
# configuration takes it.
PASSWORD_HASH = "$2b$04$DlDWSdo8tHnu/ajjDPA0eeDearYg.bAZGkXVH4.D08CsMuLQPNxGy"
HOSTS = {r: f"node-{'abcd'[r // 2]}" for r in range(8)}  # two ranks per host
# (run, attempt, culprit rank, hostnames): node-b (ranks 2, 3) in r1, r2 and both attempts of
# r3; node-c (rank 4) in r4; a run whose culprit's host label is not a host name.
RUNS = [
    ("r1", 0, 2, HOSTS),
    ("r2", 0, 3, HOSTS),
    ("r3", 0, 2, HOSTS),
    ("r3", 1, 3, HOSTS),
    ("r4", 0, 4, HOSTS),
    ("evil", 0, 6, {**HOSTS, 6: "node-d;reboot"}),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    hubs = []
    try:
        for run, attempt, culprit, hosts in RUNS:
            config = RankwatchConfig(
                metrics_port=0,
                run_id=run,
                attempt=attempt,
                incident_open_k=1,
                incident_open_n=1,
            )
            hub = PublisherHub(config, otlp=False)
            hubs.append(hub)
            ranks = rank_infos(8, hostnames=hosts)
            hub.publish(
                window(0, n=8, step_time=step_report(8, culprit=culprit), ranks=ranks, run=run)
            )
            assert hub.flush(10)
        targets = [h.metrics_url.split("//")[1].split("/")[0] for h in hubs]  # type: ignore[union-attr]
        config_yaml = yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": ["rankwatch.rules.yml"],
                "scrape_configs": [
                    {"job_name": "rankwatch", "static_configs": [{"targets": targets}]}
                ],
            }
        )
        files = {
            "rankwatch.rules.yml": rules_yaml(Settings(ledger_interval="1s"), DiagnosisConfig()),
            "web.yml": yaml.safe_dump({"basic_auth_users": {USER: PASSWORD_HASH}}),
        }
        secrets = tmp_path_factory.mktemp("secrets")
        (secrets / "right").write_text(PASSWORD + "\n")
        (secrets / "wrong").write_text("not-the-password\n")
        with prometheus(config_yaml, files, ["--web.config.file=web.yml"]) as prom:
            reader = PrometheusReader(prom.url, USER, PASSWORD)
            wait_until(
                lambda: len(reader.query("rankwatch:host_culprit:active")) == len(RUNS),
                30,
                what="every attempt's culprit recorded",
            )
            yield prom, secrets
    finally:
        for hub in hubs:
            hub.close(5)


def hosts(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["hosts", *args])
    out, err = capsys.readouterr()
    return code, out, err


def login(stack: tuple[Server, Path], password: str = "right") -> list[str]:
    prom, secrets = stack
    return ["--prometheus", prom.url, "--user", USER, "--password-file", str(secrets / password)]


def test_the_host_that_failed_three_of_four_runs_is_named_alone(stack, capsys):
    code, out, err = hosts(capsys, *login(stack), "--selector", 'run!="evil"')
    assert code == 0 and err == "", err
    (line,) = out.splitlines()
    assert line.startswith(
        "node-b: culprit in 3 runs (4 attempts), healthy in 1; classes step_time_straggler; "
        "last seen "
    )
    assert line.endswith("; runs r1, r2, r3 (attempts 0, 1)")
    code, out, _ = hosts(capsys, *login(stack), "--selector", 'run!="evil"', "--format", "slurm")
    assert (code, out) == (0, "--exclude=node-b\n")
    code, out, _ = hosts(
        capsys, *login(stack), "--selector", 'run!="evil"', "--min-runs", "1", "--format", "kubectl"
    )
    assert (code, out) == (0, "kubectl cordon node-b\nkubectl cordon node-c\n")


def test_the_fleet_rules_record_culprits_and_hosts_per_attempt(stack):
    prom, _ = stack
    reader = PrometheusReader(prom.url, USER, PASSWORD)
    active = {
        (s["metric"]["hostname"], s["metric"]["run"], s["metric"]["attempt"])
        for s in reader.query('rankwatch:host_culprit:active{run!="evil"}')
    }
    assert active == {
        ("node-b", "r1", "0"),
        ("node-b", "r2", "0"),
        ("node-b", "r3", "0"),
        ("node-b", "r3", "1"),
        ("node-c", "r4", "0"),
    }
    present = reader.query('rankwatch:host_run:present{hostname="node-a"}')
    assert len(present) == len(RUNS)  # every attempt of every run had ranks on node-a


def test_the_repeat_offender_alert_fires_for_that_host_alone(stack):
    prom, _ = stack
    reader = PrometheusReader(prom.url, USER, PASSWORD)
    alert = 'ALERTS{alertname="RankwatchRepeatOffenderHost", alertstate="firing"}'
    firing = wait_until(lambda: reader.query(alert), 30, what="the repeat offender alert")
    assert [s["metric"]["hostname"] for s in firing] == ["node-b"]

    def counts() -> tuple[str, str]:
        (runs,) = reader.query('rankwatch:host_culprit_runs:count{hostname="node-b"}')
        (healthy,) = reader.query('rankwatch:host_healthy_runs:count{hostname="node-b"}')
        return runs["value"][1], healthy["value"][1]

    # r1, r2, r3 (both attempts); it took part in r4 and in the hostile run too (the ledger
    # catches up with the last scrapes within a few evaluations).
    wait_until(lambda: counts() == ("3", "2"), 15, what="node-b's ledger")
    firing = reader.query(alert)
    assert [s["metric"]["hostname"] for s in firing] == ["node-b"]


def test_a_wrong_or_missing_login_is_one_line_and_exit_2(stack, capsys):
    code, out, err = hosts(capsys, *login(stack, "wrong"))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "HTTP 401" in err and "login was refused" in err, err
    assert "not-the-password" not in err
    prom, secrets = stack
    code, _, err = hosts(capsys, "--prometheus", prom.url)
    assert code == 2 and "HTTP 401" in err and err.count("\n") == 1
    code, _, err = hosts(
        capsys, "--prometheus", prom.url, "--bearer-token-file", str(secrets / "wrong")
    )
    assert code == 2 and "HTTP 401" in err


def test_unreachable_or_not_prometheus_is_one_line_and_exit_2(stack, capsys):
    code, out, err = hosts(capsys, "--prometheus", f"http://127.0.0.1:{free_port()}")
    assert (code, out) == (2, "") and "cannot be reached" in err and err.count("\n") == 1
    # Prometheus' own web UI answers under this prefix, but not with the query API.
    prom, secrets = stack
    code, _, err = hosts(
        capsys,
        *["--prometheus", prom.url + "/graph", "--user", USER],
        *["--password-file", str(secrets / "right")],
    )
    assert code == 2 and err.count("\n") == 1, err


def test_a_host_label_that_is_not_a_host_name_is_refused(stack, capsys):
    code, out, err = hosts(capsys, *login(stack), "--selector", 'run="evil"', "--min-runs", "1")
    assert (code, out) == (2, "")
    assert "hostname 'node-d;reboot' is not a host name" in err and err.count("\n") == 1, err
