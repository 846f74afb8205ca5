"""The PS's bounds on what senders choose (plug_asgd/ps/limits.py), without a socket."""

from __future__ import annotations

import numpy as np
import pytest

from plug_asgd.protocol.wire import Message, WireError
from plug_asgd.ps import limits
from plug_asgd.ps.gathers import Gathers
from plug_asgd.ps.membership import Membership
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


def test_completed_collectives_are_kept_by_bytes(monkeypatch):
    monkeypatch.setattr(limits, "COMPLETED_MAX_BYTES", 5 * (1 << 20) // 2)
    members = Membership(60.0, Stats())
    sent = []
    collectives = Gathers(members, members.stats, lambda *a: sent.append(a), lambda *a: sent.append(a))
    members.hello(b"id", Message("hello", {"rank": 0, "world_size": 1, "stage": 1, "session": "s"}), 0)
    for seq in range(5):
        collectives.gather(b"id", seq, Message("gather", {"rank": 0, "stage": 1, "seq": seq},
                                               {"x": np.zeros(1 << 18, np.float32)}))
    one = (1 << 20) + 2  # the tensor's bytes, and [None] packed
    assert len(sent) == 5 and list(collectives.completed) == [(1, 3), (1, 4)]
    assert collectives.completed_bytes == 2 * one


def test_objects_that_would_make_a_gather_reply_too_large_to_read_are_refused():
    members = Membership(60.0, Stats())
    sent = []
    collectives = Gathers(members, members.stats, lambda *a: sent.append(a), lambda *a: sent.append(a))
    for rank in range(3):
        members.hello(b"%d" % rank, Message("hello", {"rank": rank, "world_size": 3, "stage": 1, "session": "s"}), 0)
    big = "x" * (limits.MAX_GATHER_OBJ_BYTES // 2 - 8)  # two fit, a third would pass the bound
    for rank in (0, 1):
        collectives.gather(b"%d" % rank, rank, Message("gather", {"rank": rank, "stage": 1, "seq": 0, "obj": big}))
    with pytest.raises(WireError) as err:
        collectives.gather(b"2", 2, Message("gather", {"rank": 2, "stage": 1, "seq": 0, "obj": big}))
    assert err.value.code == "limit" and sent == []
    collectives.gather(b"2", 2, Message("gather", {"rank": 2, "stage": 1, "seq": 0, "obj": None}))
    assert [s[0] for s in sent] == [b"0", b"1", b"2"]
