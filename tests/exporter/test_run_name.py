"""The run name: ``RANKWATCH_RUN_ID``, else the launcher's job (``identity.run_name_from_env``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rankwatch.exporter.cli.main import main
from rankwatch.exporter.config import MAX_LABEL_CHARS, RankwatchConfig
from rankwatch.exporter.identity import RunName, run_name_from_env
from rankwatch.exporter.run_name import (
    IN_CODE,
    ResolvedRunName,
    made_run_name,
    made_source,
    resolve_run_name,
    share_run_name,
)

K8S = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}

CASES = [
    ({}, RunName("", "")),
    ({"RANKWATCH_RUN_ID": "mine"}, RunName("mine", "RANKWATCH_RUN_ID")),
    (
        {"RANKWATCH_RUN_ID": "mine", "SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "t"},
        RunName("mine", "RANKWATCH_RUN_ID"),
    ),
    ({"RANKWATCH_RUN_ID": "  ", "SLURM_JOB_ID": "7"}, RunName("slurm-7", "SLURM_JOB_ID")),
    ({"TORCHELASTIC_RUN_ID": "exp-42"}, RunName("exp-42", "TORCHELASTIC_RUN_ID")),
    # torchrun without --rdzv-id writes the literal "none": no name
    ({"TORCHELASTIC_RUN_ID": "none"}, RunName("", "")),
    ({"SLURM_JOB_ID": "123456"}, RunName("slurm-123456", "SLURM_JOB_ID")),
    (
        {"SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "pretrain"},
        RunName("pretrain-123456", "SLURM_JOB_ID, SLURM_JOB_NAME"),
    ),
    (
        {"SLURM_JOB_ID": "123460", "SLURM_ARRAY_JOB_ID": "123456", "SLURM_ARRAY_TASK_ID": "4"},
        RunName("slurm-123456_4", "SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID"),
    ),
    # the scheduler's name wins over torchrun's (often a UUID torchrun made up)
    (
        {"SLURM_JOB_ID": "9", "TORCHELASTIC_RUN_ID": "0b6f2c1e-6a1c-4d4e-9a57-1f7f0e3c2b11"},
        RunName("slurm-9", "SLURM_JOB_ID"),
    ),
    ({"JOBSET_NAME": "llm-pretrain"}, RunName("llm-pretrain", "JOBSET_NAME")),
    (
        {**K8S, "HOSTNAME": "train-7b-3", "JOB_COMPLETION_INDEX": "3"},
        RunName("train-7b", "Kubernetes Indexed Job pod (HOSTNAME, JOB_COMPLETION_INDEX)"),
    ),
    (
        {
            **K8S,
            "HOSTNAME": "pytorch-workers-1-2",
            "JOB_COMPLETION_INDEX": "2",
            "REPLICATED_JOB_NAME": "workers",
            "JOB_INDEX": "1",
        },
        RunName("pytorch", "JobSet pod (HOSTNAME, REPLICATED_JOB_NAME, JOB_INDEX)"),
    ),
    # a JobSet's pod without the JobSet's variables: its Job's name differs between the
    # JobSet's Jobs, so nothing is derived
    ({**K8S, "HOSTNAME": "pytorch-workers-1-2", "JOB_COMPLETION_INDEX": "2"}, RunName("", "")),
    # outside a cluster, or a hostname that does not end in the index: nothing derived
    ({"HOSTNAME": "train-7b-3", "JOB_COMPLETION_INDEX": "3"}, RunName("", "")),
    ({**K8S, "HOSTNAME": "train-7b-x1y2z", "JOB_COMPLETION_INDEX": "3"}, RunName("", "")),
    (
        {**K8S, "HOSTNAME": "bert-ft-worker-2", "MASTER_ADDR": "bert-ft-master-0"},
        RunName("bert-ft", "Kubeflow PyTorchJob (MASTER_ADDR)"),
    ),
    ({**K8S, "MASTER_ADDR": "10.1.2.3"}, RunName("", "")),
    ({"MASTER_ADDR": "bert-ft-master-0"}, RunName("", "")),
]


@pytest.mark.parametrize(("env", "want"), CASES)
def test_run_name_from_the_environment(env, want):
    assert run_name_from_env(env) == want
    assert RankwatchConfig.from_env(env).run_id == want.name


@pytest.mark.parametrize(("env", "want"), CASES)
def test_every_rank_of_a_job_gets_the_same_name(env, want):
    # what differs between the ranks of one job must not change the name
    for rank in range(3):
        per_rank = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "SLURM_PROCID": str(rank)}
        assert run_name_from_env(per_rank) == want


def test_a_bad_environment_is_named():
    with pytest.raises(TypeError, match="env: expected a mapping"):
        run_name_from_env(["SLURM_JOB_ID=7"])  # type: ignore[arg-type]


def test_an_override_wins_over_the_environment():
    env = {"SLURM_JOB_ID": "7"}
    assert RankwatchConfig.from_env(env, run_id="given").run_id == "given"
    assert RankwatchConfig.from_env(env, run_id="").run_id == ""


def test_rankwatch_config_shows_the_name_and_its_source(monkeypatch, capsys):
    for name in [v for v in os.environ if v.startswith(("SLURM_", "TORCHELASTIC_", "RANKWATCH_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "555")
    assert main(["config"]) == 0
    assert "Run name: slurm-555 (from SLURM_JOB_ID)" in capsys.readouterr().out
    assert main(["config", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"] == {"name": "slurm-555", "source": "SLURM_JOB_ID"}
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["config"]) == 0
    assert "Run name: none in the environment (" in capsys.readouterr().out


_PRINT_RUN = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from rankwatch.exporter.config import RankwatchConfig
    # A file per rank: the ranks share torchrun's stdout, where two lines can run together.
    out = Path(sys.argv[1], "rank-" + os.environ["RANK"] + ".json")
    out.write_text(json.dumps([os.environ["RANK"], RankwatchConfig.from_env().run_id]))
    """
)


@pytest.mark.parametrize(
    ("args", "want"),
    [(["--rdzv-id", "exp-7"], {"exp-7"}), ([], None)],
    ids=["rdzv-id", "standalone-uuid"],
)
def test_a_real_torchrun_launch_names_every_rank_alike(tmp_path: Path, args, want):
    script = tmp_path / "print_run.py"
    script.write_text(_PRINT_RUN)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "RANKWATCH_", "KUBERNETES_"))
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    if args:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", *args]
    proc = subprocess.run(
        [*cmd, str(script), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert sorted(rank for rank, _ in rows) == ["0", "1"]
    names = {name for _, name in rows}
    assert len(names) == 1 and "" not in names and "none" not in names
    if want is not None:
        assert names == want


# --- a name for a run no launcher names (exporter/run_name.py) ---------------------------------


def test_a_made_name_is_the_host_and_the_start_time_in_utc():
    assert made_run_name("node-a", 1796275851.0) == "node-a-20261203-053051"
    long = made_run_name("h" * 400, 0.0)
    assert len(long) == MAX_LABEL_CHARS and long.endswith("-19700101-000000")


def test_rank_0_stores_the_name_and_every_other_rank_takes_it():
    from torch.distributed import HashStore

    store = HashStore()
    assert share_run_name(store, 0, lambda: "root-name", 0.1) == ("root-name", 0)
    for rank in (1, 2, 3):
        assert share_run_name(store, rank, lambda r=rank: f"rank-{r}", 0.1) == ("root-name", 0)


def test_without_rank_0_the_first_other_rank_names_it_and_rank_0_takes_that():
    from torch.distributed import HashStore

    store = HashStore()
    assert share_run_name(store, 2, lambda: "rank-2", 0.05) == ("rank-2", 2)
    assert share_run_name(store, 1, lambda: "rank-1", 0.05) == ("rank-2", 0)
    assert share_run_name(store, 0, lambda: "root", 0.05) == ("rank-2", 0)


def test_the_source_of_every_name_is_said():
    env = {"SLURM_JOB_ID": "7"}
    cfg = RankwatchConfig.from_env(env)
    assert resolve_run_name(cfg, env=env) == ResolvedRunName("slurm-7", "SLURM_JOB_ID")
    cfg = RankwatchConfig.from_env(env, run_id="mine")
    assert resolve_run_name(cfg, {"run_id": "mine"}, env) == ResolvedRunName("mine", IN_CODE)
    # run_id="" given on purpose, or no torch.distributed to share a name over: no name
    cfg = RankwatchConfig.from_env({}, run_id="")
    assert resolve_run_name(cfg, {"run_id": ""}, {}) == ResolvedRunName("", "")
    assert resolve_run_name(RankwatchConfig.from_env({}), env={}) == ResolvedRunName("", "")


_PLAIN_TORCHRUN_JOB = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import torch.distributed as dist
    from rankwatch import exporter

    dist.init_process_group("gloo")
    rw = exporter.init(metrics_enabled=False, interval_seconds=0.2)
    for _ in range(3):
        with rw.step():
            pass
        rw.collect()
    name = rw.config.run_id
    rw.close(10.0)
    out = Path(sys.argv[1], "rank-" + os.environ["RANK"] + ".json")  # a file per rank (see above)
    out.write_text(json.dumps([os.environ["RANK"], name]))
    dist.destroy_process_group()
    """
)


@pytest.mark.multiproc
@pytest.mark.parallel_safe
def test_plain_torchrun_without_a_run_id_shares_one_readable_name(tmp_path: Path):
    """torchrun with ``--master-port`` and no ``--rdzv-id`` (its run id is ``none``): rank 0
    names the run after its host and start time, and both ranks publish that one name."""
    import socket

    from tests.servers import free_port

    script = tmp_path / "job.py"
    script.write_text(_PLAIN_TORCHRUN_JOB)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC_", "RANKWATCH_", "KUBERNETES_", "JOBSET_"))
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(script), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank-*.json"))]
    assert sorted(rank for rank, _ in rows) == ["0", "1"], proc.stdout
    (name,) = {name for _, name in rows}
    host = socket.gethostname().lower()
    assert re.fullmatch(re.escape(host) + r"-\d{8}-\d{6}", name), name
    # The end-of-run block (the root's) names the run and says where the name came from.
    assert f"rankwatch: run {name} ended" in proc.stderr, proc.stderr[-3000:]
    assert f"  Run name: {made_source(0)}" in proc.stderr, proc.stderr[-3000:]
