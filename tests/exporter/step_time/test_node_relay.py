"""A node's leader relaying its node over real sockets: a follower's Unix socket to the leader,
the leader's TCP connection to a real aggregator intake."""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from rankwatch.diagnosis.step_time import ROW_WIDTH
from rankwatch.exporter.aggregator.intake import Event, Intake
from rankwatch.exporter.aggregator.wire import (
    FLAG_END_OF_ROUND,
    FLAG_FINAL,
    WireError,
    encode_rows,
    rows_final,
)
from rankwatch.exporter.step_time.node_relay import (
    NODE_LEADERS_FROM,
    NodeRelay,
    leader_socket_name,
    node_leader,
)
from rankwatch.exporter.step_time.shipping import UNIX, Connection

TOKEN = "ab" * 16
IDENTITY = ("node-a", 0, "", "")


@pytest.fixture
def intake() -> Iterator[Intake]:
    selector = selectors.DefaultSelector()
    server = Intake("127.0.0.1", TOKEN, (0, 1, 2, 3), selector)
    yield server
    server.close()
    selector.close()


@pytest.fixture
def relay(intake: Intake) -> Iterator[NodeRelay]:
    host, port = intake.address
    leader = Connection(0, IDENTITY, lambda: (host, port, TOKEN))
    name = leader_socket_name(f"test-{os.getpid()}-{time.monotonic_ns()}", 0)
    node = NodeRelay(name, leader)
    leader.relayed = node.hellos
    yield node
    node.close()
    leader.close()


def follower(relay: NodeRelay, rank: int) -> Connection:
    return Connection(rank, ("node-a", rank, "", ""), lambda: (relay.name, UNIX, TOKEN))


def rows(n: int) -> np.ndarray:
    out = np.zeros((n, ROW_WIDTH))
    out[:, 0] = np.arange(n)
    return out


def turn(
    intake: Intake,
    relay: NodeRelay,
    ranks: list[Connection],
    until: Callable[[list[Event]], bool],
) -> list[Event]:
    """Pump every side until ``until(events so far)`` (or five seconds); the intake's events."""
    out: list[Event] = []
    deadline = time.monotonic() + 5.0
    while not until(out) and time.monotonic() < deadline:
        for conn in ranks:
            conn.pump()
        relay.pump()
        relay.upstream.pump()
        for key, events in intake.selector.select(0.01):
            out += intake.ready(key, events)
    return out


def test_a_followers_frames_go_up_under_its_rank_and_its_answer_comes_back(
    intake: Intake, relay: NodeRelay
) -> None:
    rank_two = follower(relay, 2)
    rank_two.queue(
        encode_rows(rows(3), rank=2, seq=1, flags=FLAG_END_OF_ROUND, strategy=None, lost=0)
    )
    seen = turn(intake, relay, [rank_two], lambda out: any(e.kind == "rows" for e in out))
    assert [(e.kind, e.rank) for e in seen if e.kind != "hello"] == [("rows", 2)]
    assert {e.hello.rank for e in seen if e.hello is not None} == {0, 2}
    # The aggregator's WELCOME for rank 2 reaches rank 2 through its leader.
    turn(intake, relay, [rank_two], lambda _: rank_two._welcomed)
    assert rank_two._welcomed and rank_two.peer == (relay.name, UNIX)
    assert relay.forwarded == 2  # its hello and its rows
    rank_two.close()


def test_a_leader_waits_for_each_followers_final_rows(intake: Intake, relay: NodeRelay) -> None:
    ranks = [follower(relay, 1), follower(relay, 3)]
    turn(intake, relay, ranks, lambda _: len(relay.hellos()) == 2)
    assert relay.waiting()  # two ranks connected, neither has sent its final rows
    ranks[0].queue(encode_rows(rows(2), rank=1, seq=2, flags=FLAG_FINAL, strategy=None, lost=0))
    turn(intake, relay, ranks, lambda _: ranks[0].pending_bytes == 0 and relay.forwarded >= 3)
    assert relay.waiting()  # rank 3 still owes its final rows
    final = encode_rows(rows(1), rank=3, seq=2, flags=FLAG_FINAL, strategy=None, lost=0)
    ranks[1].queue(final)
    turn(intake, relay, ranks, lambda _: not relay.waiting())
    assert not relay.waiting()
    for conn in ranks:
        conn.close()


def test_a_follower_that_hangs_up_is_gone_upstream_and_owes_nothing(
    intake: Intake, relay: NodeRelay
) -> None:
    rank_one = follower(relay, 1)
    turn(intake, relay, [rank_one], lambda out: any(e.rank == 1 for e in out))
    rank_one.close()
    seen = turn(intake, relay, [], lambda out: any(e.kind == "closed" for e in out))
    assert [(e.kind, e.rank) for e in seen if e.kind == "closed"] == [("closed", 1)]
    assert relay.hellos() == [] and not relay.waiting()


def test_a_follower_speaking_for_a_rank_it_did_not_introduce_is_dropped(
    intake: Intake, relay: NodeRelay, caplog: pytest.LogCaptureFixture
) -> None:
    rank_one = follower(relay, 1)
    turn(intake, relay, [rank_one], lambda _: len(relay.hellos()) == 1)
    rank_one.queue(encode_rows(rows(1), rank=3, seq=1, flags=0, strategy=None, lost=0))
    turn(intake, relay, [rank_one], lambda _: not relay.hellos())
    assert relay.hellos() == []
    assert "field rank: value 3 did not say hello here" in caplog.text
    rank_one.close()


def test_rows_final_reads_the_flag_and_refuses_a_short_header() -> None:
    frame = encode_rows(rows(1), rank=1, seq=1, flags=FLAG_FINAL, strategy=None, lost=0)
    assert rows_final(frame[5:])  # the payload after the frame's kind and length
    plain = encode_rows(rows(1), rank=1, seq=1, flags=FLAG_END_OF_ROUND, strategy=None, lost=0)
    assert not rows_final(plain[5:])
    with pytest.raises(WireError, match="rows: field length: value 3 is too short"):
        rows_final(b"abc")


GROUP = tuple(range(NODE_LEADERS_FROM))


@pytest.mark.parametrize(
    ("rank", "mode", "env", "leader"),
    [
        (9, "on", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}, 8),
        (8, "on", {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}, 8),
        (9, "auto", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}, 8),
        (9, "off", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}, None),
        (9, "on", {}, None),  # the launcher did not say who shares a node
        (9, "on", {"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "8"}, None),
        (9, "on", {"LOCAL_RANK": "9", "LOCAL_WORLD_SIZE": "8"}, None),
        (9, "on", {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, None),  # a node of one
    ],
)
def test_node_leader(rank: int, mode: str, env: dict[str, str], leader: int | None) -> None:
    assert node_leader(rank, GROUP, mode, env) == leader


def test_auto_leaves_small_groups_alone_and_a_node_leader_is_a_member() -> None:
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}
    assert node_leader(9, tuple(range(64)), "auto", env) is None
    # The group holds only odd ranks: the lowest member of rank 9's node leads it.
    assert node_leader(11, tuple(range(1, 2048, 2)), "on", {**env, "LOCAL_RANK": "3"}) == 9
