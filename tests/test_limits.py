"""The PS's bounds on what senders choose (plug_asgd/ps/limits.py), without a socket."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import zmq

from plug_asgd.protocol.wire import Limits, Message, Sparse, WireError, encode, message_bytes
from plug_asgd.ps import limits
from plug_asgd.ps import replies as replies_module
from plug_asgd.ps.gathers import Gathers, reply_size, share
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.replies import Replies
from plug_asgd.ps.stats import Stats


def nested(levels: int) -> list:
    obj: list = []
    for _ in range(levels - 1):
        obj = [obj]
    return obj


def test_depth_counts_containers_and_stops_past_its_limit():
    assert limits.depth(None, 10) == 0
    assert limits.depth({"a": [1, {"b": 2}]}, 10) == 3
    assert limits.depth(nested(1022), limits.MAX_OBJ_DEPTH) == limits.MAX_OBJ_DEPTH + 1


def test_a_gather_object_too_deep_or_too_large_is_refused_with_limit():
    for obj in (nested(limits.MAX_OBJ_DEPTH + 1), "x" * (limits.MAX_OBJ_BYTES + 1)):
        with pytest.raises(WireError) as err:
            limits.gather_obj(Message("gather", {"obj": obj}))
        assert err.value.code == "limit"
    assert limits.gather_obj(Message("gather", {"obj": nested(limits.MAX_OBJ_DEPTH)}))[1] == limits.MAX_OBJ_DEPTH


def test_a_resumed_checkpoint_keeps_the_most_recent_sessions_per_rank_of_its_world():
    last_seq = {f"s{i}": i for i in range(20)}  # the store keeps the most recent last
    limits.trim_sessions(last_seq, 3)
    assert list(last_seq) == [f"s{i}" for i in range(20 - 3 * limits.SESSIONS_PER_RANK, 20)]


def test_completed_collectives_are_kept_by_bytes_as_held(monkeypatch):
    monkeypatch.setattr(limits, "COMPLETED_MAX_BYTES", 5 * (1 << 20) // 2)
    members = Membership(60.0, Stats())
    sent = []
    collectives = Gathers(members, members.stats, lambda *a: sent.append(a), lambda *a: sent.append(a))
    members.hello(b"id", Message("hello", {"rank": 0, "world_size": 1, "stage": 1, "session": "s"}), 0)
    for seq in range(5):
        collectives.gather(b"id", seq, Message("gather", {"rank": 0, "stage": 1, "seq": seq},
                                               {"x": np.zeros(1 << 18, np.float32)}))
    # the reply's header as sent (with the largest request id), the tensor's bytes, and what the PS holds per tensor
    header = encode("gathered", {"ranks": [0], "objs": [None], "rid": (1 << 64) - 1},
                    {"0/x": np.zeros(1 << 18, np.float32)})[0]
    one = len(header) + (1 << 20) + limits.HELD_PER_TENSOR
    assert len(sent) == 5 and list(collectives.completed) == [(1, 3), (1, 4)]
    assert collectives.completed_bytes == 2 * one


def _gatherers(world: int) -> tuple[Gathers, list]:
    members = Membership(60.0, Stats())
    sent: list = []
    collectives = Gathers(members, members.stats, lambda *a: sent.append(("reply", *a)),
                          lambda *a: sent.append(("error", *a)))
    for rank in range(world):
        members.hello(b"%d" % rank, Message("hello", {"rank": rank, "world_size": world, "stage": 1,
                                                      "session": f"s{rank}"}), 0)
    return collectives, sent


def _empties(count: int, pad: int = 8) -> dict:
    return {f"t{i:0{pad}d}": np.zeros(0, np.float32) for i in range(count)}


def test_a_gather_reply_is_sized_exactly_as_it_is_encoded():
    tensors = [{}, {"x": np.ones(3, np.float32)}, _empties(20),
               {"s": Sparse(np.array([1, 5]), np.ones(2, np.float32), (70000,)), "d": np.ones((2, 2), np.float16)}]
    objs = [None, "x" * 40, [[1, 2], {"a": 3}], {"k": "v" * 300}]
    for count in (1, 3, 17):
        ranks = list(range(count))
        shares = [share(r, len(msgpack.packb(objs[r % 4])), tensors[r % 4]) for r in ranks]
        frames = encode("gathered", {"ranks": ranks, "objs": [objs[r % 4] for r in ranks], "rid": (1 << 64) - 1},
                        {f"{r}/{n}": t for r in ranks for n, t in tensors[r % 4].items()})
        assert reply_size(shares) == (len(frames[0]), len(frames), message_bytes(frames))


def test_the_largest_contribution_of_a_reply_too_large_to_read_is_refused_naming_its_rank(monkeypatch):
    monkeypatch.setattr(limits, "REPLY_LIMITS", Limits(max_header_bytes=4096))
    collectives, sent = _gatherers(2)
    x = {"x": np.ones(4, np.float32)}
    with pytest.raises(WireError) as err:  # too large alone (its names carry its rank in the reply)
        collectives.gather(b"1", 7, Message("gather", {"rank": 1, "stage": 1, "seq": 0}, _empties(200)))
    assert err.value.code == "limit" and "rank 1's contribution" in str(err.value)
    fits_alone = 1
    while reply_size([share(1, 1, _empties(fits_alone + 1))])[0] <= 4096:
        fits_alone += 1
    collectives.gather(b"1", 8, Message("gather", {"rank": 1, "stage": 1, "seq": 0}, _empties(fits_alone)))
    assert sent == [] and collectives.counters()["gather_contributions_pending"] == 1
    collectives.gather(b"0", 9, Message("gather", {"rank": 0, "stage": 1, "seq": 0}, x))  # rank 1's is refused
    assert [(s[0], s[1], s[3]) for s in sent] == [("error", b"1", "limit")] and "rank 1's" in sent[0][4]
    collectives.gather(b"1", 10, Message("gather", {"rank": 1, "stage": 1, "seq": 0}, x))
    assert [(s[0], s[1], s[3]) for s in sent[1:]] == [("reply", b"0", "gathered"), ("reply", b"1", "gathered")]
    assert sorted(sent[1][5]) == ["0/x", "1/x"] and collectives.stats.refused == {"limit": 1}


def test_contributions_waiting_are_bounded_in_total_the_largest_refused(monkeypatch):
    collectives, sent = _gatherers(3)
    small, big = {"x": np.ones(4, np.float32)}, {"x": np.ones(1 << 16, np.float32)}
    held = share(2, 1, big).held
    monkeypatch.setattr(limits, "GATHERS_PENDING_MAX_BYTES", held + 2 * share(0, 1, small).held)
    collectives.gather(b"2", 1, Message("gather", {"rank": 2, "stage": 1, "seq": 5}, big))  # another collective
    collectives.gather(b"0", 2, Message("gather", {"rank": 0, "stage": 1, "seq": 0}, small))
    assert sent == [] and collectives.counters()["gather_pending_bytes"] == held + share(0, 1, small).held
    medium = {"x": np.ones(1 << 15, np.float32)}  # past the total, and smaller than rank 2's
    collectives.gather(b"1", 3, Message("gather", {"rank": 1, "stage": 1, "seq": 0}, medium))
    assert [(s[0], s[1], s[3]) for s in sent] == [("error", b"2", "limit")] and "rank 2's" in sent[0][4]
    with pytest.raises(WireError) as err:  # the largest is the newcomer's: refused itself
        collectives.gather(b"2", 4, Message("gather", {"rank": 2, "stage": 1, "seq": 0},
                                            {"x": np.ones(1 << 17, np.float32)}))
    assert err.value.code == "limit" and "rank 2's" in str(err.value)
    collectives.gather(b"2", 5, Message("gather", {"rank": 2, "stage": 1, "seq": 0}, small))
    assert [s[1] for s in sent[1:]] == [b"0", b"1", b"2"] and collectives.stats.refused == {"limit": 1}
    assert collectives.counters()["gather_pending_bytes"] == 0


def test_replies_queued_are_bounded_over_all_connections_but_a_rank_gets_its_own(monkeypatch):
    monkeypatch.setattr(replies_module, "REPLIES_QUEUED_MAX_BYTES", 3000)
    queue = Replies(copy_threshold=64)
    held = []

    def reply(identity: bytes, member: bool = False) -> bool:
        frames = [b"header", np.ones(250, np.float32).data]  # 1,006 bytes
        ready = queue.admit(identity, frames, 1006, member)
        if ready is not None:
            queue.sent(identity, ready, 1006)
            held.append(ready)  # not freed: as a reply a connection does not read
        return ready is not None

    assert [reply(b"a"), reply(b"b"), reply(b"a"), reply(b"c")] == [True, True, False, False]
    allowed = replies_module.MEMBER_QUEUED_REPLIES
    assert [reply(b"w", member=True) for _ in range(allowed + 1)] == [True] * allowed + [False]
    queued = (2 + allowed) * 1006
    assert queue.counters() == {"replies_queued_bytes": queued, "replies_queued_peak": queued}
    held.clear()  # ZeroMQ lets them go: pyzmq's thread marks them done
    deadline = time.monotonic() + 10
    while queue.bytes and time.monotonic() < deadline:
        queue.tick()
        time.sleep(0.01)
    assert queue.counters() == {"replies_queued_bytes": 0, "replies_queued_peak": queued}
    assert reply(b"c")


class LaggingTracker:
    """A reply's tracker whose pyzmq thread marks it let go only once the PS waits for it (the thread held back by
    a loaded machine), or never (``read=False``: a rank that does not read)."""

    def __init__(self, read: bool) -> None:
        self.read, self.done, self.waits = read, False, 0

    def wait(self, timeout: float) -> None:
        self.waits += 1
        if not self.read:
            raise zmq.NotDone
        self.done = True


def test_a_ranks_reply_waits_for_pyzmqs_thread_before_it_is_dropped_and_a_rank_that_does_not_read_once(monkeypatch):
    monkeypatch.setattr(replies_module, "REPLIES_QUEUED_MAX_BYTES", 3000)
    allowed = replies_module.MEMBER_QUEUED_REPLIES
    queue = Replies(copy_threshold=64)
    queue.sent(b"flood", [SimpleNamespace(tracker=LaggingTracker(read=False))], 2000)  # a non-member's, unread

    def fill(identity: bytes, read: bool, count: int) -> list[LaggingTracker]:
        trackers = [LaggingTracker(read) for _ in range(count)]
        for t in trackers:
            queue.sent(identity, [SimpleNamespace(tracker=t)], 100)
        return trackers

    def admitted(identity: bytes) -> bool:
        return queue.admit(identity, [b"header", np.ones(250, np.float32).data], 1006, member=True) is not None

    lagging = fill(b"w", read=True, count=allowed)  # read by the worker, not yet marked so: 2,000 + 4 x 100 queued
    assert admitted(b"w")  # over the total and at its allowance: the oldest waited for, let go, room for this one
    assert [t.waits for t in lagging] == [1] + [0] * (allowed - 1)
    unread = fill(b"v", read=False, count=allowed)
    assert not admitted(b"v") and not admitted(b"v")  # dropped: waited for once, not at every request
    assert [t.waits for t in unread] == [1] + [0] * (allowed - 1)
    unread[0].done = True  # it reads one: room for one more reply, then a wait again at the allowance
    assert admitted(b"v")
    fill(b"v", read=False, count=1)
    assert not admitted(b"v") and unread[1].waits == 1


def test_objects_that_would_make_a_gather_reply_too_large_to_read_are_refused():
    members = Membership(60.0, Stats())
    sent = []
    collectives = Gathers(members, members.stats, lambda *a: sent.append(a), lambda *a: sent.append(a))
    for rank in range(3):
        members.hello(b"%d" % rank, Message("hello", {"rank": rank, "world_size": 3, "stage": 1,
                                                      "session": f"s{rank}"}), 0)
    big = "x" * (limits.MAX_GATHER_OBJ_BYTES // 2 - 8)  # two fit, a third would pass the bound
    for rank in (0, 1):
        collectives.gather(b"%d" % rank, rank, Message("gather", {"rank": rank, "stage": 1, "seq": 0, "obj": big}))
    with pytest.raises(WireError) as err:
        collectives.gather(b"2", 2, Message("gather", {"rank": 2, "stage": 1, "seq": 0, "obj": big}))
    assert err.value.code == "limit" and sent == []
    collectives.gather(b"2", 2, Message("gather", {"rank": 2, "stage": 1, "seq": 0, "obj": None}))
    assert [s[0] for s in sent] == [b"0", b"1", b"2"]
