"""Who is in a group and where a rank runs."""

from __future__ import annotations

import pytest

from rankwatch.exporter.identity import local_identity
from rankwatch.exporter.layout import GroupLayout


def test_group_layout() -> None:
    layout = GroupLayout((1, 3), 3)
    assert layout.root == 1 and layout.is_member and not layout.is_root
    assert layout.peers == (3,)
    assert not GroupLayout((1, 3), 2).is_member
    with pytest.raises(ValueError, match="ranks"):
        GroupLayout((), 0)
    with pytest.raises(ValueError, match="ranks"):
        GroupLayout((3, 1), 1)
    with pytest.raises(ValueError, match="ranks"):
        GroupLayout((1, 1), 1)


def test_local_identity_reads_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("NODE_NAME", raising=False)
    host, local, gpu, uuid = local_identity()
    assert local == 3 and host == host.lower() and host
    assert (gpu, uuid) == ("", "")  # CPU: no GPU labels
    # On Kubernetes the node name (downward API spec.nodeName) is the hostname, lower case.
    monkeypatch.setenv("NODE_NAME", "GPU-Node-07")
    assert local_identity()[0] == "gpu-node-07"
    monkeypatch.setenv("MY_NODE", "other-node")
    assert local_identity("MY_NODE")[0] == "other-node"
    assert local_identity("")[0] == host
    monkeypatch.setenv("LOCAL_RANK", "x")
    assert local_identity()[1] == 0
