"""The PS's liveness rule on an injected clock (plug_asgd.ps.liveness, through plug_asgd.ps.membership): a
heartbeating worker is lost once silent for more than ``worker_timeout`` seconds, and not a moment before, whatever
the load on the machine running the test. The real-socket tests in test_ps_protocol.py check the same rule end to end
with wide margins; the boundary is checked here. Pure logic: quick."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plug_asgd.protocol.wire import decode, encode
from plug_asgd.ps import liveness, membership
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.stats import Stats

TIMEOUT = 1.0
TOKENS: dict[int, str] = {}


@pytest.fixture
def clock(monkeypatch):
    now = SimpleNamespace(t=1000.0)
    fake = SimpleNamespace(time=lambda: now.t, monotonic=lambda: now.t)
    for module in (membership, liveness):  # hello and bye read the clock, and the liveness rule
        monkeypatch.setattr(module, "time", fake)
    return now


def hello(members: Membership, rank: int, heartbeat_s: float | None, session: str = "s") -> None:
    msg = decode(encode("hello", {"rid": 1, "rank": rank, "world_size": 2, "stage": 1, "training": True,
                                  "mode": "asgd", "session": f"{session}{rank}", "heartbeat_s": heartbeat_s}))
    worker, _ = members.hello(f"id{rank}".encode(), msg, version=0)
    TOKENS[rank] = worker.token  # what the hello reply gives the worker, and its heartbeats carry


def beat(members: Membership, rank: int, session: str = "s") -> bool:
    fields = {"rank": rank, "session": f"{session}{rank}", "token": TOKENS[rank]}
    return members.heartbeat(decode(encode("heartbeat", fields)))


def test_an_idle_worker_that_heartbeats_stays_a_member_and_one_that_stops_is_lost_after_the_timeout(clock):
    members = Membership(TIMEOUT, Stats())
    hello(members, 0, 0.25)
    hello(members, 1, 0.25)
    for _ in range(8):  # 2 s of rank 1 sending heartbeats only, rank 0 nothing after its hello
        clock.t += 0.25
        beat(members, 1)
        if clock.t <= 1000.0 + TIMEOUT:
            assert members.check_liveness() == []
    assert members.check_liveness() == [0] and members.trainers() == frozenset({1})
    clock.t += TIMEOUT  # rank 1's last beat was at 1002.0: silent exactly the timeout now, not more
    assert members.check_liveness() == [] and members.trainers() == frozenset({1})
    assert members.check_liveness(now=clock.t + 0.001) == [1]  # the PS's own injected clock, check_liveness(now=)
    assert members.stats.workers_lost == 2 and members.trainers() == frozenset()


def test_a_lost_worker_that_beats_again_is_taken_back_and_one_without_heartbeats_is_never_lost(clock):
    members = Membership(TIMEOUT, Stats())
    hello(members, 0, 0.25)
    hello(members, 1, None)  # announced no heartbeat: nothing to time out on
    assert members.check_liveness(now=clock.t + 1e6) == [0]
    clock.t += 5.0
    assert beat(members, 0, session="other") is False  # another process's session: not the lost worker
    assert beat(members, 0) is True and members.trainers() == frozenset({0, 1}) and members.stats.workers_back == 1
    assert members.check_liveness(now=clock.t + TIMEOUT) == []  # its silence counts from the beat


def test_a_new_leader_counts_the_ranks_that_trained_at_its_primary_until_they_come_or_the_timeout_passes(clock):
    # a standby that leads now: rank 0 moves first; rank 1 is still counted as training (a sync round waits for
    # it), until it says hello here or stays away for worker_timeout
    members = Membership(TIMEOUT, Stats())
    members.await_ranks(frozenset({0, 1, 2}))
    hello(members, 0, 0.25)
    assert members.trainers() == frozenset({0, 1, 2}) and set(members.awaited) == {1, 2}
    clock.t += TIMEOUT / 2
    beat(members, 0)
    hello(members, 1, 0.25)
    assert members.check_liveness() == [] and set(members.awaited) == {2}
    clock.t += TIMEOUT / 2 + 0.001  # rank 2 never came: past the timeout since the failover
    assert members.check_liveness() == [2] and members.trainers() == frozenset({0, 1})
    assert members.stats.workers_lost == 1
