"""Where a rank runs, in the terms operators join on: node, GPU, pod, build.

* **Node.** On Kubernetes a pod's hostname is the pod's name, which no node-level exporter
  knows. Like dcgm-exporter, rankwatch takes the node name from an environment variable that
  the pod spec fills from the downward API (``spec.nodeName``): ``NODE_NAME`` unless
  ``RANKWATCH_NODE_NAME_ENV`` names another. Without it, the machine's hostname. Lower case.
* **GPU.** dcgm-exporter labels a GPU's series ``gpu`` (its index) and ``UUID``
  (``GPU-<uuid>``). A rank on CUDA publishes the same two values for its current device, so a
  rank's phase times join that GPU's telemetry. ``UUID`` is the exact key; ``gpu`` is the
  index on the machine when ``CUDA_VISIBLE_DEVICES`` lists indices, else the index the process
  sees (inside a container that sees only its own GPUs these may differ from the host's). Both
  are empty on CPU and when the process has not initialised CUDA itself (rankwatch never
  initialises CUDA on its own).
* **Pod.** ``k8s.node.name``, ``k8s.pod.name``, ``k8s.namespace.name`` for the OTel resource,
  from ``POD_NAME`` / ``POD_NAMESPACE`` (downward API), else the pod's hostname and the service
  account's namespace file when running in a cluster.
* **Build.** The versions of rankwatch, Python and torch (``rankwatch_build_info``).
* **Ranks.** ``LOCAL_RANK`` and ``RANK`` as torchrun sets them are read here only
  (:func:`local_rank_from_env`, :func:`rank_from_env`), so every collector agrees on what a
  bad value means.
* **Run.** The ``run`` label names the job. :func:`run_name_from_env` takes it from
  ``RANKWATCH_RUN_ID`` when set, else from what the launcher or scheduler gives every process
  of the job alike (Slurm, Kubernetes, torchrun; see there). Only job-wide values qualify:
  every rank must publish the same name, and nothing here differs per rank or per start.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import rankwatch

__all__ = [
    "DEFAULT_NODE_NAME_ENV",
    "RUN_ID_ENV",
    "RunName",
    "build_labels",
    "current_gpu",
    "gpu_labels",
    "k8s_attributes",
    "local_identity",
    "local_rank_from_env",
    "node_hostname",
    "rank_from_env",
    "run_name_from_env",
]

log = logging.getLogger(__name__)

DEFAULT_NODE_NAME_ENV = "NODE_NAME"
# Mounted into every pod that has a service account token: the pod's namespace.
_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def node_hostname(
    node_name_env: str = DEFAULT_NODE_NAME_ENV, env: Mapping[str, str] | None = None
) -> str:
    """The ``hostname`` label: the node name from ``node_name_env`` if set, else the machine's
    hostname; lower case."""
    name = _env(env).get(node_name_env, "").strip() if node_name_env else ""
    return (name or socket.gethostname()).lower()


def gpu_labels(index: int, uuid: str, visible_devices: str | None) -> tuple[str, str]:
    """(``gpu``, ``UUID``) as dcgm-exporter writes them, for device ``index`` of this process.

    ``visible_devices`` is ``CUDA_VISIBLE_DEVICES``: when it lists integers, the process's
    device ``index`` is the machine's device ``visible[index]``.
    """
    gpu = str(index)
    if visible_devices:
        listed = [v.strip() for v in visible_devices.split(",")]
        if 0 <= index < len(listed) and listed[index].isdigit():
            gpu = listed[index]
    text = str(uuid).strip()
    if text and not text.startswith(("GPU-", "MIG-")):
        text = "GPU-" + text
    return gpu, text


def current_gpu(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(``gpu``, ``UUID``) of this process's current CUDA device; ("", "") on CPU or before the
    process has initialised CUDA. Never initialises CUDA, never raises."""
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return "", ""
    try:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return "", ""
        index = int(torch.cuda.current_device())
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", "")
    except Exception:  # a broken driver must not stop training: no GPU labels then
        return "", ""
    return gpu_labels(index, str(uuid or ""), _env(env).get("CUDA_VISIBLE_DEVICES"))


def k8s_attributes(
    node_name_env: str = DEFAULT_NODE_NAME_ENV,
    env: Mapping[str, str] | None = None,
    namespace_file: Path = _NAMESPACE_FILE,
) -> dict[str, str]:
    """OTel ``k8s.*`` resource attributes that the environment gives (none outside a cluster)."""
    src = _env(env)
    out: dict[str, str] = {}
    node = src.get(node_name_env, "").strip() if node_name_env else ""
    if node:
        out["k8s.node.name"] = node
    in_cluster = bool(src.get("KUBERNETES_SERVICE_HOST", "").strip())
    pod = src.get("POD_NAME", "").strip() or (src.get("HOSTNAME", "").strip() if in_cluster else "")
    if pod:
        out["k8s.pod.name"] = pod
    namespace = src.get("POD_NAMESPACE", "").strip()
    if not namespace and in_cluster:
        try:
            namespace = namespace_file.read_text(encoding="utf-8").strip()
        except OSError:
            namespace = ""
    if namespace:
        out["k8s.namespace.name"] = namespace
    return out


@functools.cache
def build_labels() -> tuple[str, str, str]:
    """(rankwatch, Python, torch) versions; torch empty when it is not installed."""
    torch: Any = sys.modules.get("torch")
    torch_version = str(getattr(torch, "__version__", "")) if torch is not None else ""
    if not torch_version:
        try:
            torch_version = version("torch")
        except PackageNotFoundError:
            torch_version = ""
    return rankwatch.__version__, platform.python_version(), torch_version


def _rank_variable(name: str, env: Mapping[str, str] | None, strict: bool) -> int | None:
    raw = _env(env).get(name, "").strip()
    if not raw:
        return None
    # ASCII digits only: int() would also take "+3", "3_0" and other scripts' digits, which no
    # launcher writes, so they are mistakes to report rather than ranks to guess.
    if raw.isascii() and raw.isdigit():
        return int(raw)
    if strict:
        raise ValueError(f"{name}: expected a non-negative integer, got {raw!r}")
    log.warning("%s: expected a non-negative integer, got %r; treating it as unset", name, raw)
    return None


def local_rank_from_env(
    env: Mapping[str, str] | None = None, *, strict: bool = False
) -> int | None:
    """This process's rank on its node, ``LOCAL_RANK`` (torchrun); None when unset or empty.

    A value that is not a non-negative integer raises ``ValueError`` naming ``LOCAL_RANK`` and
    the value when ``strict`` (``init()``: the metrics port is base + local rank, so a guess
    could collide with another rank's), else logs a warning and counts as unset (labels and
    layouts: each caller documents its fallback).
    """
    return _rank_variable("LOCAL_RANK", env, strict)


def rank_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """This process's global rank, ``RANK`` (torchrun); None when unset or empty.

    Strict: a value that is not a non-negative integer raises ``ValueError`` naming ``RANK`` and
    the value, since it identifies the process in OTLP resources and a wrong one would merge two
    ranks' series.
    """
    return _rank_variable("RANK", env, True)


def local_identity(node_name_env: str = DEFAULT_NODE_NAME_ENV) -> tuple[str, int, str, str]:
    """(hostname, local rank, GPU index, GPU UUID) of this process: the hostname is the node
    name from ``node_name_env`` when set (Kubernetes), else the machine's, in lowercase; the
    local rank is ``LOCAL_RANK`` (0 when unset; a bad value is logged and counts as unset, see
    :func:`local_rank_from_env`: a label must not stop training); the GPU fields are those of
    the current CUDA device as dcgm-exporter labels them, empty on CPU (see
    :func:`current_gpu`)."""
    local_rank = local_rank_from_env()
    gpu, uuid = current_gpu()
    return node_hostname(node_name_env), 0 if local_rank is None else local_rank, gpu, uuid


RUN_ID_ENV = "RANKWATCH_RUN_ID"
# torchrun writes its --rdzv-id into TORCHELASTIC_RUN_ID; without one the id is the literal
# default "none" (a single-node run without --master-port gets a fresh UUID instead).
_TORCHRUN_NO_ID = "none"
# A Kubeflow PyTorchJob's pods reach the master through the service "<job>-master-0".
_PYTORCHJOB_MASTER = re.compile(r"(?P<job>.+)-master-0")


@dataclass(frozen=True)
class RunName:
    """The run's name and where it came from (``source`` names the variables; both are empty
    when nothing in the environment names the job)."""

    name: str
    source: str


def _kubernetes_job(src: Mapping[str, str]) -> RunName | None:
    """The Job (or JobSet) a pod belongs to, from what its pods have in common.

    An Indexed Job's pod has the hostname ``<job>-<index>`` and ``JOB_COMPLETION_INDEX`` set;
    a JobSet's Job is named ``<jobset>-<replicated job>-<job index>``, with
    ``REPLICATED_JOB_NAME`` and ``JOB_INDEX`` set, so that suffix is taken off too (it differs
    between the JobSet's Jobs). Without those two variables a Job named ``<...>-<number>`` is
    not used: it may be one of a JobSet's Jobs, whose names differ between its ranks. A
    non-indexed Job's pod names end in a random suffix: not derivable, and not tried.
    """
    if not src.get("KUBERNETES_SERVICE_HOST", "").strip():
        return None
    host = src.get("HOSTNAME", "").strip()
    index = src.get("JOB_COMPLETION_INDEX", "").strip()
    if not (host and index and host.endswith(f"-{index}")):
        return None
    job = host[: -len(index) - 1]
    replicated, job_index = src.get("REPLICATED_JOB_NAME", ""), src.get("JOB_INDEX", "")
    jobset_suffix = f"-{replicated.strip()}-{job_index.strip()}"
    if replicated.strip() and job_index.strip() and job.endswith(jobset_suffix):
        jobset = job[: -len(jobset_suffix)]
        return RunName(jobset, "JobSet pod (HOSTNAME, REPLICATED_JOB_NAME, JOB_INDEX)")
    if re.search(r"-\d+$", job):
        return None
    return RunName(job, "Kubernetes Indexed Job pod (HOSTNAME, JOB_COMPLETION_INDEX)")


def run_name_from_env(env: Mapping[str, str] | None = None) -> RunName:
    """The run's name, the same on every rank of a job; the first of:

    1. ``RANKWATCH_RUN_ID``, when set (not empty);
    2. Slurm: ``<SLURM_JOB_NAME>-<SLURM_JOB_ID>`` (the shipped sbatch example's name), with
       ``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>`` as the id of an array task and ``slurm``
       when the job has no name;
    3. Kubernetes: ``JOBSET_NAME`` (JobSet tooling sets it, or the pod spec from the
       ``jobset.sigs.k8s.io/jobset-name`` label); the JobSet or Indexed Job from the pod's
       hostname (see :func:`_kubernetes_job`); a Kubeflow PyTorchJob's name from
       ``MASTER_ADDR`` (``<job>-master-0``);
    4. torchrun: ``TORCHELASTIC_RUN_ID`` unless it is torchrun's ``none`` (no ``--rdzv-id``).

    The scheduler's name comes before torchrun's because it is the one an operator finds the
    job by (``squeue``, ``kubectl``), and torchrun's is often a random UUID it made itself.
    Nothing found: ``RunName("", "")`` (the caller says so once).
    """
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"env: expected a mapping of variable names to values, got {env!r}")
    src = _env(env)

    def get(name: str) -> str:
        return src.get(name, "").strip()

    if get(RUN_ID_ENV):
        return RunName(get(RUN_ID_ENV), RUN_ID_ENV)
    slurm_name = get("SLURM_JOB_NAME") or "slurm"
    named = ", SLURM_JOB_NAME" if get("SLURM_JOB_NAME") else ""
    if get("SLURM_ARRAY_JOB_ID") and get("SLURM_ARRAY_TASK_ID"):
        return RunName(
            f"{slurm_name}-{get('SLURM_ARRAY_JOB_ID')}_{get('SLURM_ARRAY_TASK_ID')}",
            f"SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID{named}",
        )
    if get("SLURM_JOB_ID"):
        return RunName(f"{slurm_name}-{get('SLURM_JOB_ID')}", f"SLURM_JOB_ID{named}")
    if get("JOBSET_NAME"):
        return RunName(get("JOBSET_NAME"), "JOBSET_NAME")
    job = _kubernetes_job(src)
    if job is not None:
        return job
    master = _PYTORCHJOB_MASTER.fullmatch(get("MASTER_ADDR"))
    if get("KUBERNETES_SERVICE_HOST") and master is not None:
        return RunName(master["job"], "Kubeflow PyTorchJob (MASTER_ADDR)")
    torchrun = get("TORCHELASTIC_RUN_ID")
    if torchrun and torchrun != _TORCHRUN_NO_ID:
        return RunName(torchrun, "TORCHELASTIC_RUN_ID")
    return RunName("", "")
