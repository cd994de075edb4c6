"""deploy/slurm: per-node port blocks that do not collide between jobs, and file-SD targets a
real Prometheus reads.

Two "jobs" share this machine as two jobs share a node: ``rankwatch_slurm.py`` runs in front of
a stand-in launcher that starts the real rankwatch metrics server for each local rank on
``RANKWATCH_METRICS_PORT + local_rank``. Their job ids map to the same preferred block, so the
second must move. ``promtool check config`` validates the target files they write, and a real
Prometheus scrapes every rank through file service discovery. One job is stopped with SIGTERM
(as ``scancel`` does), the other ends on its own; both remove their files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.servers import REPO, http_get, prom_query, prometheus, require_binary, wait_until

SCRIPT = REPO / "deploy" / "slurm" / "rankwatch_slurm.py"
RANKS = 3
PORT_MIN, PORT_MAX = 23000, 23029  # ten blocks of three

# The launcher: one real rankwatch /metrics server per local rank, until the stop file appears.
LAUNCHER = textwrap.dedent(
    """
    import os, signal, sys, time
    from rankwatch.exporter.config import RankwatchConfig
    from rankwatch.exporter.publish.prometheus import start_metrics_server
    config = RankwatchConfig.from_env()
    servers = [start_metrics_server(config, r, lambda: ([], [])) for r in range(int(sys.argv[1]))]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.1)
    """
)


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("rankwatch_slurm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rankwatch_slurm"] = module
    spec.loader.exec_module(module)
    return module


def _start_job(job_id: int, sd_dir: Path, claim_dir: Path, stop: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NAME": f"train-{job_id}",
        "SLURM_CLUSTER_NAME": "hpc1",
        "RANKWATCH_METRICS_ADDR": "127.0.0.1",
    }
    argv = [
        sys.executable,
        str(SCRIPT),
        "--sd-dir",
        str(sd_dir),
        "--claim-dir",
        str(claim_dir),
        "--ranks-per-node",
        str(RANKS),
        "--port-min",
        str(PORT_MIN),
        "--port-max",
        str(PORT_MAX),
        "--host",
        "127.0.0.1",
        "--",
        sys.executable,
        "-c",
        LAUNCHER,
        str(RANKS),
        str(stop),
    ]
    return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)


def _targets(path: Path) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = json.loads(path.read_text())
    return groups


def test_two_jobs_on_one_node_get_disjoint_ports_and_prometheus_scrapes_them(
    tmp_path: Path,
) -> None:
    sd_dir, claim_dir = tmp_path / "file_sd", tmp_path / "claims"
    blocks = (PORT_MAX - PORT_MIN + 1) // RANKS
    jobs = (7, 7 + blocks)  # the same preferred block
    stops = {j: tmp_path / f"stop-{j}" for j in jobs}
    procs = {j: _start_job(j, sd_dir, claim_dir, stops[j]) for j in jobs}
    try:
        files = {j: sd_dir / f"rankwatch-{j}-127.0.0.1.json" for j in jobs}
        for j, p in procs.items():
            wait_until(
                lambda p=p, f=files[j]: f.exists() or p.poll() is not None, 30, what="target files"
            )
            assert p.poll() is None, p.communicate()
        groups = {j: _targets(f) for j, f in files.items()}
        ports = {}
        for j, (group,) in groups.items():
            assert group["labels"] == {
                "slurm_job_id": str(j),
                "slurm_job_name": f"train-{j}",
                "cluster": "hpc1",
            }
            ports[j] = [int(t.rsplit(":", 1)[1]) for t in group["targets"]]
            assert len(ports[j]) == RANKS
            assert ports[j] == list(range(ports[j][0], ports[j][0] + RANKS))
            assert ports[j][0] >= PORT_MIN and ports[j][-1] <= PORT_MAX
        assert not set(ports[jobs[0]]) & set(ports[jobs[1]]), ports
        # Every target is a rankwatch endpoint of its job (the launcher got the block's port).
        for j in jobs:
            for port in ports[j]:
                wait_until(
                    lambda port=port: http_get(f"http://127.0.0.1:{port}/metrics") is not None,
                    30,
                    what=f"job {j}'s rank on {port}",
                )

        # promtool validates the target files as Prometheus will read them.
        config = {
            "scrape_configs": [
                {
                    "job_name": "rankwatch",
                    "scrape_interval": "1s",
                    "file_sd_configs": [
                        {"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}
                    ],
                }
            ]
        }
        config_file = tmp_path / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        check = subprocess.run(
            [require_binary("promtool"), "check", "config", str(config_file)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert check.returncode == 0, check.stdout + check.stderr

        # A real Prometheus discovers and scrapes all six ranks, labelled by job.
        with prometheus(yaml.safe_dump(config)) as prom:

            def up() -> dict[str, list[str]] | None:
                result = prom_query(prom, 'up{job="rankwatch"} == 1')
                by_job: dict[str, list[str]] = {}
                for r in result:
                    by_job.setdefault(r["metric"]["slurm_job_id"], []).append(
                        r["metric"]["instance"]
                    )
                return by_job if sum(map(len, by_job.values())) == 2 * RANKS else None

            seen = wait_until(up, 60, what="Prometheus scraping both jobs' ranks")
            for j in jobs:
                assert sorted(seen[str(j)]) == sorted(f"127.0.0.1:{p}" for p in ports[j])
                assert prom_query(prom, f'up{{slurm_job_id="{j}", cluster="hpc1"}}')

        # scancel: SIGTERM reaches the launcher; the other job ends on its own.
        procs[jobs[0]].send_signal(signal.SIGTERM)
        stops[jobs[1]].touch()
        codes = {j: p.wait(timeout=30) for j, p in procs.items()}
        assert codes == {jobs[0]: 143, jobs[1]: 0}, {j: p.stderr.read() for j, p in procs.items()}
        assert not any(f.exists() for f in files.values())
        # Every claim is gone; the node-wide lock file stays (removing it could race a claimer).
        assert [p.name for p in claim_dir.iterdir()] == [".lock"]
    finally:
        for j, p in procs.items():
            stops[j].touch()
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_stale_claims_are_reused_and_live_ones_skipped(tmp_path: Path) -> None:
    mod = _module()
    claims = tmp_path / "claims"
    claims.mkdir()
    size, blocks = 4, 5
    first = PORT_MIN + (3 % blocks) * size  # job 3's preferred block
    # A job killed hard left its claim: its process is gone, so the block is free again.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (claims / f"{first}-{size}").write_text(json.dumps({"pid": dead.pid, "start": "1"}))
    block = mod.claim_block(3, size, PORT_MIN, PORT_MIN + blocks * size - 1, claims)
    assert block.first == first
    # While that claim is held by a live process, the next job with the same slot moves on.
    other = mod.claim_block(3 + blocks, size, PORT_MIN, PORT_MIN + blocks * size - 1, claims)
    assert other.first == first + size
    # A block with a port something else listens on is skipped (and not left claimed): the
    # third job of that slot wraps around to block 0, where a port is taken, so it gets block 1.
    busy = PORT_MIN + 1
    sleeper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, time; s = socket.socket(); "
            f"s.bind(('127.0.0.1', {busy})); s.listen(); time.sleep(30)",
        ]
    )
    try:
        wait_until(lambda: not mod._bindable(busy, "0.0.0.0"), 10, what="the listener")
        third = mod.claim_block(
            3 + 2 * blocks, size, PORT_MIN, PORT_MIN + blocks * size - 1, claims
        )
        assert third.first == PORT_MIN + size
        assert not (claims / f"{PORT_MIN}-{size}").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks-per-node", "40", "--port-min", "20000", "--port-max", "20009"], "do not fit"),
        (["--label", "bad label=x"], "NAME=VALUE"),
        ([], "give the launcher"),
    ],
)
def test_bad_arguments_name_the_problem(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _module()
    os.environ["SLURM_JOB_ID"] = "12"
    try:
        command = [] if message == "give the launcher" else ["--", "true"]
        with pytest.raises(SystemExit):
            mod.main(
                ["--sd-dir", str(tmp_path), "--claim-dir", str(tmp_path / "c"), *argv, *command]
            )
    finally:
        del os.environ["SLURM_JOB_ID"]
    assert message in capsys.readouterr().err


def test_sbatch_example_runs_the_wrapper_once_per_node() -> None:
    text = (REPO / "deploy/slurm/rankwatch.sbatch").read_text()
    result = subprocess.run(
        ["bash", "-n", "-c", text], capture_output=True, timeout=10, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "srun --ntasks-per-node=1" in text
    assert 'python3 "$RANKWATCH_SLURM" --ranks-per-node "$GPUS_PER_NODE" --' in text
    assert "RANKWATCH_FILE_SD_DIR" in text and "RANKWATCH_RUN_ID" in text


def _claim_in_process(args: tuple[int, str, str]) -> int:
    job_id, claim_dir, go = args
    mod = _module()
    while not Path(go).exists():  # start together, to race for the same preferred block
        pass
    block = mod.claim_block(job_id, RANKS, PORT_MIN, PORT_MAX, Path(claim_dir), "127.0.0.1")
    return int(block.first)


def test_jobs_claiming_at_the_same_moment_never_share_a_block(tmp_path: Path) -> None:
    """Eight jobs with the same preferred block claim at once: each gets its own block (the
    claim is written whole before any other claimer looks at it)."""
    import multiprocessing as mp

    blocks = (PORT_MAX - PORT_MIN + 1) // RANKS
    go = tmp_path / "go"
    jobs = [(5 + k * blocks, str(tmp_path / "claims"), str(go)) for k in range(8)]
    with mp.get_context("fork").Pool(len(jobs)) as pool:
        pending = pool.map_async(_claim_in_process, jobs)
        go.touch()
        firsts = pending.get(timeout=60)
    assert len(set(firsts)) == len(firsts), firsts
