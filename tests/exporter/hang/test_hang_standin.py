"""The stand-in for a root that is gone, over a real c10d store: the other ranks' records written
as their watchers write them, real processes that ended for the ranks that are gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from rankwatch.diagnosis.hang import Collective, HangReport, RankRecord
from rankwatch.exporter.hang.root import HangRoot
from rankwatch.exporter.hang.standin import StandIn
from rankwatch.exporter.hang.watch import record_key
from tests.servers import free_port

HOST = "h"


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))


@pytest.fixture(scope="module")
def gone_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _put(store: Any, record: RankRecord, beat: int, **extra: Any) -> None:
    payload = {**record.to_dict(), "beat": beat, "pidns": 0, **extra}
    store.set(record_key(record.rank), json.dumps(payload))


def _first(rank: int, pid: int, host: str = HOST) -> RankRecord:
    """The record every rank writes when its watcher starts (no frames, not suspect)."""
    return RankRecord(rank=rank, host=host, pid=pid, budget_seconds=3.0, steps=0)


def _waiting(rank: int, stalled: float = 4.0) -> RankRecord:
    return RankRecord(
        rank=rank, host=HOST, pid=os.getpid(), phase="backward", stalled_seconds=stalled,
        since_step_seconds=stalled, budget_seconds=3.0, steps=5, group_seqs={"0": 9},
        collective=Collective(group="0", op="all_reduce", seq=9, seconds=stalled),
        frames=("y.py:2 g",),
    )  # fmt: skip


def _standin(
    store: Any,
    reports: list[HangReport],
    me: int,
    ranks: tuple[int, ...] = (0, 1, 2),
    unreachable: bool = False,
) -> StandIn:
    loop = HangRoot(
        ranks, me, store, 0.05, reports.append, group="world", host=HOST, pidns=0, log_lines=False
    )
    return StandIn(loop, ranks[0], ranks, root_unreachable=lambda: unreachable)


def test_a_rank_stands_in_for_a_root_whose_process_is_gone(store: Any, gone_pid: int) -> None:
    reports: list[HangReport] = []
    _put(store, _first(0, gone_pid), 1)
    _put(store, _waiting(2), 1)
    standin = _standin(store, reports, me=1)
    standin.tick(_waiting(1))
    assert standin.acting
    assert len(reports) == 1 and reports[0].verdict is not None
    v = reports[0].verdict
    assert (v.hang_class, v.ranks) == ("RANK_DEAD", (0,))


def test_nobody_stands_in_while_the_rank_progresses(store: Any, gone_pid: int) -> None:
    reports: list[HangReport] = []
    _put(store, _first(0, gone_pid), 1)
    standin = _standin(store, reports, me=1)
    standin.tick(_waiting(1, stalled=0.5))  # a third of 3 s not reached: not even a look
    assert (standin.acting, standin.looks, reports) == (False, 0, [])


def test_a_living_root_or_one_that_left_is_not_stood_in_for(store: Any, gone_pid: int) -> None:
    reports: list[HangReport] = []
    _put(store, _first(0, os.getpid()), 1)  # alive: this very process
    _put(store, _waiting(2), 1)
    standin = _standin(store, reports, me=1)
    standin.tick(_waiting(1))
    assert (standin.acting, standin.looks, reports) == (False, 1, [])
    # Gone, but it said it left (it closed rankwatch, or exited normally): the run's end.
    _put(store, _first(0, gone_pid), 2, left="its process exited")
    standin.tick(_waiting(1))
    assert (standin.acting, reports) == (False, [])


def test_the_lowest_rank_not_gone_stands_in(store: Any, gone_pid: int) -> None:
    reports: list[HangReport] = []
    _put(store, _first(0, gone_pid), 1)
    _put(store, _first(1, os.getpid()), 1)  # rank 1 alive: it stands in, not rank 2
    _put(store, _waiting(3), 1)
    ranks = (0, 1, 2, 3)
    second = _standin(store, reports, me=2, ranks=ranks)
    second.tick(_waiting(2))
    assert (second.acting, reports) == (False, [])
    _put(store, _first(1, gone_pid), 2)  # rank 1 is gone too: rank 2 is next
    second.tick(_waiting(2))
    assert second.acting and len(reports) == 1 and reports[0].verdict is not None
    assert reports[0].verdict.hang_class == "RANK_DEAD"
    assert set(reports[0].verdict.ranks) == {0, 1}


def test_a_root_elsewhere_whose_connection_failed_is_stood_in_for(store: Any) -> None:
    reports: list[HangReport] = []
    _put(store, _first(0, 1, host="elsewhere"), 1)  # another host: /proc cannot tell
    _put(store, _waiting(2), 1)
    quiet = _standin(store, reports, me=1)
    quiet.tick(_waiting(1))
    assert (quiet.acting, reports) == (False, [])
    failed = _standin(store, reports, me=1, unreachable=True)
    failed.tick(_waiting(1))
    assert failed.acting and len(reports) == 1 and reports[0].verdict is not None
    assert (reports[0].verdict.hang_class, reports[0].verdict.ranks) == ("RANK_DEAD", (0,))


@pytest.mark.parametrize(
    "payload",
    [b"not json", b"[1, 2]", json.dumps({"pid": "7", "host": HOST}).encode(), b"x" * 70_000],
    ids=["not-json", "not-an-object", "pid-not-an-int", "too-large"],
)
def test_an_unreadable_root_record_is_no_reason_to_stand_in(store: Any, payload: bytes) -> None:
    reports: list[HangReport] = []
    store.set(record_key(0), payload)
    standin = _standin(store, reports, me=1)
    standin.tick(_waiting(1))
    assert (standin.acting, standin.looks, reports) == (False, 1, [])


def test_a_store_that_is_gone_is_no_reason_to_stand_in() -> None:
    reports: list[HangReport] = []
    server = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=2))
    client = dist.TCPStore(
        "127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=2)
    )  # fmt: skip
    del server  # the store's host is gone
    standin = _standin(client, reports, me=1)
    standin.tick(_waiting(1))
    assert (standin.acting, reports) == (False, [])
