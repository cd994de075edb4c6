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
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import socket
import sys
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import rankwatch

__all__ = [
    "DEFAULT_NODE_NAME_ENV",
    "build_labels",
    "current_gpu",
    "gpu_labels",
    "k8s_attributes",
    "local_identity",
    "local_rank_from_env",
    "node_hostname",
    "rank_from_env",
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
