"""The ``rankwatch`` command as a user runs it: a real process, real files, exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rankwatch.diagnosis.deepep.artifact import ArtifactStore
from rankwatch.diagnosis.deepep.normal import NormalDiagnoser
from rankwatch.diagnosis.deepep.normal.simulator import NormalSimulator, phase_timeline
from rankwatch.diagnosis.step_time.artifact import example_window, save_window
from rankwatch.exporter.config import all_env_variables
from tests.servers import free_port

CLI = Path(sys.executable).with_name("rankwatch")


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run the installed console script; the environment is the test's plus ``env``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKWATCH_", "DEEPEP_"))}
    full_env.update(env or {})
    return subprocess.run(
        [str(CLI), *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


@pytest.fixture(scope="module")
def windows_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of saved windows: simulated EP16 DeepEP windows and two step-time windows."""
    root = tmp_path_factory.mktemp("windows")
    sim, diagnoser = NormalSimulator(seed=3), NormalDiagnoser()
    store = ArtifactStore(root / "deepep")
    for index, phase in phase_timeline(windows_per_phase=3, baseline_windows=4):
        window = sim.window(phase, index)
        store.save(window, diagnoser.diagnose(window))
    straggling = example_window(ranks=4, slow_rank=2, seed=1)
    (root / "steps").mkdir()
    save_window(
        root / "steps" / "slow.json",
        straggling.per_rank,
        strategy="ddp",
        meta={"window_index": 1},
        report=straggling.diagnose(),
    )
    balanced = example_window(ranks=4, slow_rank=None, seed=2)
    save_window(root / "steps" / "even.json", balanced.per_rank, strategy="ddp", meta={})
    (root / "notes.json").write_text('{"not": "a window"}')
    return root


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("rankwatch ")


def test_no_command_is_a_usage_error() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "COMMAND" in result.stderr


def test_help_lists_every_subcommand() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("demo", "diagnose", "heatmap", "replay", "config"):
        assert command in result.stdout


# --- config ----------------------------------------------------------------------------------


def test_config_lists_every_variable_with_its_default() -> None:
    result = run_cli("config")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in all_env_variables():
        assert any(line[2:].startswith(name + " ") for line in lines), name


def test_config_shows_the_environment_it_read() -> None:
    result = run_cli("config", env={"RANKWATCH_METRICS_PORT": "9600"})
    assert result.returncode == 0, result.stderr
    (line,) = [ln for ln in result.stdout.splitlines() if "RANKWATCH_METRICS_PORT" in ln]
    assert line.startswith("*")
    assert line.split()[1:3] == ["RANKWATCH_METRICS_PORT", "9600"]


def test_config_json_is_complete() -> None:
    result = run_cli("config", "--json", env={"DEEPEP_DIAGNOSE_LOG_DETAILS": "1"})
    assert result.returncode == 0, result.stderr
    rows = {r["variable"]: r for r in json.loads(result.stdout)["variables"]}
    assert set(rows) == set(all_env_variables())
    assert rows["DEEPEP_DIAGNOSE_LOG_DETAILS"]["value"] is True
    assert rows["DEEPEP_DIAGNOSE_LOG_DETAILS"]["set"] is True
    assert rows["RANKWATCH_CELL_BUDGET"] == {
        "variable": "RANKWATCH_CELL_BUDGET",
        "option": "RankwatchConfig.cell_budget",
        "value": 1024,
        "default": 1024,
        "set": False,
    }


def test_config_never_prints_the_basic_auth_password() -> None:
    secret = "hunter2-s3cret"
    env = {
        "RANKWATCH_METRICS_BASIC_AUTH_USER": "prom",
        "RANKWATCH_METRICS_BASIC_AUTH_PASSWORD": secret,
    }
    table = run_cli("config", env=env)
    as_json = run_cli("config", "--json", env=env)
    for result in (table, as_json):
        assert result.returncode == 0, result.stderr
        assert secret not in result.stdout + result.stderr
    (line,) = [ln for ln in table.stdout.splitlines() if "_AUTH_PASSWORD" in ln]
    assert line.split()[1:3] == ["RANKWATCH_METRICS_BASIC_AUTH_PASSWORD", "(hidden)"]
    rows = {r["variable"]: r for r in json.loads(as_json.stdout)["variables"]}
    assert rows["RANKWATCH_METRICS_BASIC_AUTH_PASSWORD"]["value"] == "(hidden)"
    assert rows["RANKWATCH_METRICS_BASIC_AUTH_USER"]["value"] == "prom"
    # Unset, it says so (empty), as any other option.
    rows = {r["variable"]: r for r in json.loads(run_cli("config", "--json").stdout)["variables"]}
    assert rows["RANKWATCH_METRICS_BASIC_AUTH_PASSWORD"]["value"] == ""
    # Nor the credentials of an OTLP endpoint.
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"https://otel:{secret}@collector:4318"}
    shown = run_cli("config", env=endpoint)
    assert secret not in shown.stdout
    assert "endpoint https://otel:(hidden)@collector:4318" in shown.stdout
    # A bad configuration's error does not print it either.
    bad = run_cli("config", env={**env, "RANKWATCH_METRICS_BASIC_AUTH_USER": "p:rom"})
    assert bad.returncode == 2
    assert "RANKWATCH_METRICS_BASIC_AUTH_USER" in bad.stderr
    assert secret not in bad.stdout + bad.stderr


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("RANKWATCH_METRICS_PORT", "70000", "must be >= 0, <= 65535, got '70000'"),
        ("RANKWATCH_INTERVAL_SECONDS", "soon", "expected a number > 0, <= 3600, got 'soon'"),
        ("DEEPEP_DIAGNOSE_NOTIFY_RATIO", "0", "must be > 0, <= 1, got '0'"),
    ],
)
def test_config_refuses_a_bad_environment(name: str, value: str, fragment: str) -> None:
    result = run_cli("config", env={name: value})
    assert result.returncode == 2
    assert name in result.stderr
    assert fragment in result.stderr


# --- demo: bad arguments are refused before anything starts ---------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--duration", "-5"], "argument --duration: must be > 0 seconds, got '-5'"),
        (["--duration", "0"], "argument --duration: must be > 0 seconds, got '0'"),
        (["--duration", "nan"], "argument --duration: must be finite, got 'nan'"),
        (["--addr", ""], "argument --addr: must not be empty (an empty address listens on"),
        (["--addr", "0.0.0.0:9464"], "argument --addr: must be an IP address or a host name"),
        (["--duration", "soon"], "argument --duration: must be a number, got 'soon'"),
        (["--ranks", "1"], "argument --ranks: must be in 2..8, got '1'"),
        (["--ranks", "9"], "argument --ranks: must be in 2..8, got '9'"),
        (["--ranks", "two"], "argument --ranks: must be an integer, got 'two'"),
        (["--port", "65536"], "argument --port: must be in 0..65535, got '65536'"),
        (["--port", "-1"], "argument --port: must be in 0..65535, got '-1'"),
        (["--scenario", "meltdown"], "argument --scenario: invalid choice: 'meltdown'"),
        (["--timeline", "input:10,slow:5"], "unknown phase 'slow'"),
        (["--timeline", "input:ten"], "seconds of 'input' must be a number, got 'ten'"),
        (["--timeline", "input:-3"], "needs a duration > 0 s, got -3.0"),
        (["--timeline", "input"], "expected phase:seconds, got 'input'"),
        (["--straggler-ms", "0"], "argument --straggler-ms: must be > 0 ms, got '0'"),
        (["--interval", "-1"], "argument --interval: must be > 0 seconds, got '-1'"),
        (["--ranks", "2", "--straggler-rank", "2"], "--straggler-rank must be below --ranks (2)"),
        (["--straggler-rank", "-1"], "argument --straggler-rank: must be in 0..7, got '-1'"),
    ],
)
def test_demo_refuses_bad_arguments(args: list[str], fragment: str, tmp_path: Path) -> None:
    result = run_cli("demo", "--out", str(tmp_path / "out"), *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert fragment in result.stderr
    assert not (tmp_path / "out").exists()  # nothing was started or written


def test_demo_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("demo", "--port", str(port), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert not (tmp_path / "out").exists()


def test_demo_refuses_an_address_it_cannot_listen_on(tmp_path: Path) -> None:
    result = run_cli("demo", "--addr", "no-such-host.invalid", "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "--addr/--port: cannot listen on no-such-host.invalid:9464" in result.stderr
    assert not (tmp_path / "out").exists()


def test_demo_refuses_a_bad_environment(tmp_path: Path) -> None:
    result = run_cli(
        "demo", "--port", str(free_port()), "--out", str(tmp_path / "out"),
        env={"RANKWATCH_INCIDENT_OPEN_K": "5"},
    )  # fmt: skip
    assert result.returncode == 2
    assert "RANKWATCH_INCIDENT_OPEN_K" in result.stderr
    assert "must be <= incident_open_n (RANKWATCH_INCIDENT_OPEN_N) 3, got 5" in result.stderr


# --- diagnose --------------------------------------------------------------------------------


def test_diagnose_a_deepep_window(windows_dir: Path) -> None:
    # Window 5 is the second window of the pre-dispatch delay: rank 9 arrives late.
    (path,) = (windows_dir / "deepep").glob("*-w00000005.npz")
    result = run_cli("diagnose", str(path))
    assert result.returncode == 0, result.stderr
    assert "DeepEP normal-mode window 5 (EP16, 8 ranks per node)" in result.stdout
    assert "verdict: rank 9 arrives late at dispatch (pre-stage arrival skew)" in result.stdout
    assert "notify_dispatch          anomalous: rank 9 ratio" in result.stdout
    assert "what to do:" in result.stdout


def test_diagnose_a_deepep_window_as_json(windows_dir: Path) -> None:
    (path,) = (windows_dir / "deepep").glob("*-w00000005.npz")
    result = run_cli("diagnose", "--json", str(path))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kind"] == "deepep_normal"
    assert data["verdict"]["kind"] == "pre_stage_arrival_skew"
    assert data["verdict"]["rank"] == 9
    assert [i["ranks"] for i in data["report"]["incidents"]] == [[9], [9]]
    # The diagnosis stored live agrees with the one made now.
    assert data["saved_diagnosis"]["incidents"] == data["report"]["incidents"]


def test_diagnose_a_step_window(windows_dir: Path) -> None:
    result = run_cli("diagnose", str(windows_dir / "steps" / "slow.json"))
    assert result.returncode == 0, result.stderr
    assert "Step-time window (4 ranks, 100 steps, gpu clock, ddp)" in result.stdout
    assert "verdict: rank 2 is an input-pipeline straggler [critical]" in result.stdout
    assert "Look at rank 2's input pipeline" in result.stdout
    data = json.loads(
        run_cli("diagnose", "--json", str(windows_dir / "steps" / "slow.json")).stdout
    )
    assert data["report"]["findings"][0]["culprit_rank"] == 2
    assert data["saved_report"]["kind"] == data["report"]["kind"] == "INPUT_STRAGGLER"


def test_diagnose_a_balanced_step_window(windows_dir: Path) -> None:
    result = run_cli("diagnose", str(windows_dir / "steps" / "even.json"))
    assert result.returncode == 0, result.stderr
    assert "verdict: no straggler" in result.stdout
    assert "Nothing to do." in result.stdout


def test_diagnose_refuses_what_is_not_a_window(windows_dir: Path, tmp_path: Path) -> None:
    missing = run_cli("diagnose", str(tmp_path / "nope.npz"))
    assert missing.returncode == 2
    assert f"WINDOW '{tmp_path / 'nope.npz'}': no such file" in missing.stderr

    folder = run_cli("diagnose", str(tmp_path))
    assert folder.returncode == 2
    assert "unknown window type" in folder.stderr

    other_json = run_cli("diagnose", str(windows_dir / "notes.json"))
    assert other_json.returncode == 2
    assert "notes.json" in other_json.stderr and "format" in other_json.stderr

    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04 truncated")
    cut = run_cli("diagnose", str(tmp_path / "cut.npz"))
    assert cut.returncode == 2
    assert "cut.npz" in cut.stderr and "Traceback" not in cut.stderr

    (tmp_path / "window.csv").write_text("1,2,3\n")
    csv = run_cli("diagnose", str(tmp_path / "window.csv"))
    assert csv.returncode == 2
    assert "unknown window type '.csv'" in csv.stderr


# --- replay ----------------------------------------------------------------------------------


def test_replay_rediagnoses_in_window_order(windows_dir: Path) -> None:
    result = run_cli("replay", str(windows_dir))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    deepep = [ln for ln in lines if ln.startswith("deepep-normal-")]
    # 4 baseline windows, then 3 windows of each of the four phases, each followed by one
    # baseline window.
    assert len(deepep) == 20
    indices = [int(ln.split("  ")[1].split()[0][1:]) for ln in deepep]
    assert indices == list(range(20))
    # Baseline windows first, then the five phases: the global slowdown needs that history,
    # which only an in-order replay through one diagnoser has.
    assert "global_data_path_slowdown" in "\n".join(deepep)
    assert "localized_data_path_slowdown[0,1,8,9]" in "\n".join(deepep)
    steps = [ln for ln in lines if ln.startswith(("slow.json", "even.json"))]
    assert steps[0].startswith("even.json")  # no window index sorts first
    assert "INPUT_STRAGGLER critical culprit=2" in steps[1]
    assert lines[-1].startswith("replayed 20 DeepEP windows")
    assert "2 step-time windows" in lines[-1]
    assert "0 differ from the saved diagnosis; 0 refused" in lines[-1]


def test_replay_json_lines(windows_dir: Path) -> None:
    result = run_cli("replay", "--json", str(windows_dir / "steps"))
    assert result.returncode == 0, result.stderr
    objects = [json.loads(ln) for ln in result.stdout.splitlines()]
    assert [o.get("kind") for o in objects[:2]] == ["step_time", "step_time"]
    assert objects[-1]["summary"]["step_windows"] == 2
    assert objects[-1]["summary"]["deepep_windows"] == 0


def test_replay_reports_unreadable_files(windows_dir: Path, tmp_path: Path) -> None:
    (npz,) = (windows_dir / "deepep").glob("*-w00000000.npz")
    (tmp_path / npz.name).write_bytes(npz.read_bytes())
    (tmp_path / "deepep-normal-broken-w00000001.npz").write_bytes(npz.read_bytes()[:200])
    result = run_cli("replay", str(tmp_path))
    assert result.returncode == 2
    assert "deepep-normal-broken-w00000001.npz: error: not an NPZ" in result.stdout
    # The readable window is still replayed.
    assert result.stdout.splitlines()[-1].startswith("replayed 1 DeepEP windows")
    assert result.stdout.splitlines()[-1].endswith("1 refused")


def test_replay_refuses_a_folder_without_windows(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("nothing here")
    empty = run_cli("replay", str(tmp_path))
    assert empty.returncode == 2
    assert "no saved windows" in empty.stderr
    missing = run_cli("replay", str(tmp_path / "absent"))
    assert missing.returncode == 2
    assert "argument DIR: no such directory" in missing.stderr


# --- heatmap ---------------------------------------------------------------------------------


def test_heatmap_dispatches_to_the_heatmap_tool(windows_dir: Path, tmp_path: Path) -> None:
    (path,) = (windows_dir / "deepep").glob("*-w00000005.npz")
    result = run_cli("heatmap", "--chart", "notify", "--out", str(tmp_path), str(path))
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == [path.stem + "-notify.png"]
    assert (tmp_path / (path.stem + "-notify.png")).read_bytes()[:4] == b"\x89PNG"


def test_heatmap_bad_input(tmp_path: Path) -> None:
    missing = run_cli("heatmap", "--all", str(tmp_path / "absent.npz"))
    assert missing.returncode == 2
    assert "absent.npz" in missing.stderr
    no_chart = run_cli("heatmap", str(tmp_path / "absent.npz"))
    assert no_chart.returncode == 2
    assert "--all" in no_chart.stderr
