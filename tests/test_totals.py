"""Bounds that hold in total, not only per connection (issue 47, attacks 2 and 5), on a real PS over raw sockets.

A gather whose reply an honest worker could not read (its names prefixed with the rank push it past the
header a client reads) is refused, naming the rank, and the honest rank's all_gather is answered; gathers
of many tensors are kept by the memory they hold, not by their tensor bytes alone; replies queued for
connections that never read are bounded in bytes over all of them, and their memory goes back to the
system when those connections close, without another push. Each test asserts the honest worker's outcome
and the exact refusal counts.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from plug_asgd.protocol.wire import DEFAULT_LIMITS, decode, encode
from plug_asgd.ps import limits, replies
from plug_asgd.ps.gathers import reply_size, share
from plug_asgd.worker.client import PSClient
from tests.test_hardening import Raw as HardeningRaw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(170)]

BIG = 1 << 18  # floats of the model's second tensor: a model reply is about 1 MB
W0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "big": np.zeros(BIG, np.float32)}
HEADER_LIMIT = DEFAULT_LIMITS.max_header_bytes  # what a PSClient reads


class Raw(HardeningRaw):
    """test_hardening's raw socket, whose replies are whole messages (a gather's tensors too), read as a worker reads
    them (DEFAULT_LIMITS)."""

    def reply(self, timeout_ms: int = 30_000):  # type: ignore[override]
        assert self.sock.poll(timeout_ms), "the PS did not answer"
        return decode(self.sock.recv_multipart())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def empties(count: int, width: int) -> dict:
    """``count`` empty tensors whose names are ``width`` characters long."""
    return {f"t{i:0{width - 1}d}": np.zeros(0, np.float32) for i in range(count)}


def refused(client: PSClient) -> Counter:
    return Counter(client.stats()["refused"])


def push_one(client: PSClient, central: dict) -> None:
    """The honest worker pushes ones into every tensor: applied, and the model is its own plus that."""
    before = client.stats()["version"]
    reply = client.push(before, {name: np.ones_like(t) for name, t in central.items()})
    for name in central:
        central[name] += 1
    assert reply.status == "applied" and reply.version == before + 1
    for name in central:
        np.testing.assert_array_equal(reply.tensors[name], central[name])


@pytest.mark.faults
def test_a_gather_whose_reply_no_worker_could_read_is_refused_and_the_honest_all_gather_is_answered(start_ps,
                                                                                                    fault_report):
    address = start_ps("asgd", worker_timeout=60)
    honest = PSClient(address, rank=0, world_size=2, mode="asgd", request_timeout=30, heartbeat_s=0.2)
    attacker = Raw(address)
    central = {k: v.copy() for k, v in W0.items()}
    mine, theirs = np.arange(4, dtype=np.float32), np.full(4, 7, np.float32)
    try:
        honest.hello(stage=1, training=True, timeout=30)
        assert honest.init(W0)
        assert attacker.ask("hello", {"rank": 1, "world_size": 2, "stage": 1, "session": "attacker",
                                      "mode": "asgd", "training": True}).type == "welcome"
        gather = {"rank": 1, "stage": 1, "seq": 0, "kind": "all_gather"}
        # 22,000 empty tensors: a request under the 1 MiB header a PS reads, a reply over the one a worker reads
        flood = empties(22_000, 8)
        request = encode("gather", {"rid": 1, **gather}, flood)[0]
        assert 1_000_000 < len(request) <= HEADER_LIMIT < reply_size([share(1, 1, flood)])[0] == 1_078_065
        error = attacker.ask("gather", gather, flood)
        assert (error.type, error.fields["code"]) == ("error", "limit") and "rank 1's" in error.fields["message"]
        assert honest.stats()["gather_contributions_pending"] == 0
        # one that fits alone, within a few bytes, and not beside the honest rank's tensor: refused once that comes
        fits, obj = empties(20_000, 8), ""
        while (room := HEADER_LIMIT - reply_size([share(1, len(msgpack.packb(obj)), fits)])[0]) > 8:
            obj += "x" * (room - 4)
        assert 0 <= room <= 8
        attacker.send("gather", {**gather, "obj": obj}, fits)
        deadline = time.monotonic() + 30
        while honest.stats()["gather_contributions_pending"] != 1:
            assert time.monotonic() < deadline, "the PS did not take the contribution"
            time.sleep(0.05)
        answer: dict = {}
        thread = threading.Thread(target=lambda: answer.setdefault("x", honest.gather(1, 0, None, {"x": mine},
                                                                                      kind="all_gather")))
        thread.start()
        error = attacker.reply()
        assert (error.type, error.fields["code"]) == ("error", "limit") and "rank 1's" in error.fields["message"]
        gathered = attacker.ask("gather", gather, {"x": theirs})  # the attacker plays by the rules again
        thread.join(30)
        assert gathered.type == "gathered" and gathered.fields["ranks"] == [0, 1]
        assert [(r, o, sorted(t)) for r, o, t in answer["x"]] == [(0, None, ["x"]), (1, None, ["x"])]
        np.testing.assert_array_equal(answer["x"][0][2]["x"], mine)
        np.testing.assert_array_equal(answer["x"][1][2]["x"], theirs)
        assert refused(honest) == Counter(limit=2)
        push_one(honest, central)
    finally:
        honest.close()
        attacker.close()
    fault_report(fault="a gather of 22,000 empty tensors (request header under 1 MiB, reply's over it), then one "
                       "that fits alone but not beside the honest rank's", injected=2, handled=2, pushes_lost=0,
                 recovery_s=None,
                 detail="both refused (limit, 2 counted), naming rank 1: the first on arrival, the second when the "
                        "honest all_gather came; that all_gather was then answered, and the honest push applied")


@pytest.mark.faults
def test_completed_gathers_of_many_tensors_are_kept_by_the_memory_they_hold(start_ps, fault_report):
    address = start_ps("asgd", worker_timeout=60)
    pid = start_ps.started[address].pid
    lone = Raw(address)
    # 16 gathers: 3 of 20.5 MB each fit the 64 MiB bound; kept without it, 16 would grow the PS by 328 MB, over the
    # 250 MB below
    rounds, tensors = 16, empties(20_000, 8)
    try:
        assert lone.ask("hello", {"rank": 0, "world_size": 1, "stage": 1, "session": "lone", "mode": "asgd",
                                  "training": True}).type == "welcome"
        assert lone.ask("init", {}, W0).type == "init_ok"
        before = rss_mb(pid)
        frames = encode("gather", {"rid": 1, "rank": 0, "stage": 1, "seq": 0, "kind": "all_gather"}, tensors)
        for seq in range(rounds):  # each completes at once (a lone worker), and is kept for a late rank
            header = frames[0].replace(b"\xa3seq\x00", b"\xa3seq" + msgpack.packb(seq), 1)
            lone.sock.send_multipart([header, *frames[1:]])
            assert lone.sock.poll(30_000), "the PS did not answer"
            reply = lone.sock.recv_multipart()
            assert msgpack.unpackb(reply[0])["type"] == "gathered" and len(reply) == 1 + len(tensors)
        grown = rss_mb(pid) - before
        stats = lone.ask("stats", {}).fields["stats"]
    finally:
        lone.close()
    one = share(0, 1, tensors)
    held = reply_size([one])[0] + len(tensors) * limits.HELD_PER_TENSOR
    kept = limits.COMPLETED_MAX_BYTES // held
    assert (stats["collectives_kept"], stats["collectives_kept_bytes"]) == (kept, kept * held)
    assert stats["refused"] == {}
    assert grown < 250, f"the PS grew by {grown:.0f} MB"  # it grew by 20.5 MB a gather, 490 MB in all, before
    fault_report(fault=f"a lone worker's {rounds} gathers of 20,000 empty tensors each", injected=rounds,
                 handled=rounds, pushes_lost=0, recovery_s=None,
                 detail=f"each answered; {kept} kept for late ranks ({kept * held / 2**20:.0f} MB as held, tensors at "
                        f"{limits.HELD_PER_TENSOR} B each, the bound {limits.COMPLETED_MAX_BYTES >> 20} MiB); the PS "
                        f"grew by {grown:.0f} MB")


MODEL_4MB = {"w": np.zeros((2, 3), np.float32), "big": np.zeros(1 << 20, np.float32)}  # as the recipe CNN's 4.8 MB


def _flood(address: str, clients: int, rounds: int, honest: PSClient, central: dict) -> tuple[list[Raw], int]:
    """``clients`` connections that never read; in each of ``rounds`` one of them asks for the model (as a
    bystander) and the honest worker pushes, so that each reply queued holds a version of its own. Then each
    asks for rank 1's (refused ``not_member``: once each is counted, the PS has handled every pull before it)."""
    slow = [Raw(address, rcvhwm=1) for _ in range(clients)]
    marks = refused(honest)["not_member"] + clients
    for k in range(rounds):
        slow[k % clients].send("pull", {})
        push_one(honest, central)
    for s in slow:
        s.send("pull", {"rank": 1})
    deadline = time.monotonic() + 60
    while refused(honest)["not_member"] < marks:
        assert time.monotonic() < deadline, "the PS did not get to the end of the pulls"
        time.sleep(0.05)
    return slow, marks


@pytest.mark.faults
def test_replies_queued_for_clients_that_never_read_are_bounded_in_total_and_freed_when_they_close(start_ps,
                                                                                                  fault_report):
    address = start_ps("asgd", worker_timeout=60)
    pid = start_ps.started[address].pid
    honest = PSClient(address, rank=0, world_size=2, mode="asgd", request_timeout=30, heartbeat_s=0.2)
    central = {k: v.copy() for k, v in MODEL_4MB.items()}
    clients, rounds, reply = 8, 96, 4 * (1 << 20) + 1024  # 96 versions of 4 MB: 384 MB, where 128 MiB may queue
    bound = replies.REPLIES_QUEUED_MAX_BYTES + replies.MEMBER_QUEUED_REPLIES * reply  # the honest worker's beyond
    slow: list[Raw] = []
    try:
        honest.hello(stage=1, training=True, timeout=30)
        assert honest.init(MODEL_4MB)
        before = rss_mb(pid)
        slow, _ = _flood(address, clients, rounds, honest, central)
        stats = honest.stats()
        dropped = stats["replies_dropped"]
        assert 0 < stats["replies_queued_peak"] <= bound and dropped["total"] > 0 and set(dropped) == {"total"}
        received, poller = 0, zmq.Poller()
        for s in slow:
            poller.register(s.sock, zmq.POLLIN)
        while ready := poller.poll(3000):  # now they read: every reply was either delivered or dropped and counted
            for sock, _ in ready:
                sock.recv_multipart()
                received += 1
        assert received + dropped["total"] == rounds + clients
        for s in slow:
            s.close()
        slow, _ = _flood(address, clients, rounds, honest, central)  # again, and they close without reading
        held, pinned = honest.stats()["replies_queued_bytes"], rss_mb(pid) - before
        assert 64 << 20 < held <= bound and 64 < pinned < (bound >> 20) + 64, (held, pinned)
        for s in slow:
            s.close()
        slow = []
        closed = time.monotonic()  # no push from now on: the memory goes back as they close
        while honest.stats()["replies_queued_bytes"] > 0 or rss_mb(pid) > before + 32:
            assert time.monotonic() < closed + 5, (honest.stats()["replies_queued_bytes"], rss_mb(pid), before)
            time.sleep(0.1)
        freed_s = time.monotonic() - closed
        assert refused(honest) == Counter(not_member=2 * clients)
        push_one(honest, central)
    finally:
        honest.close()
        for s in slow:
            s.close()
    fault_report(fault=f"{clients} clients that never read, asking for a 4 MB model as it moves ({rounds} versions, "
                       "twice)", injected=2 * rounds, handled=2 * rounds, pushes_lost=0, recovery_s=round(freed_s, 2),
                 detail=f"queued at most {stats['replies_queued_peak'] / 2**20:.0f} MB over all connections (bound "
                        f"{replies.REPLIES_QUEUED_MAX_BYTES >> 20} MiB), {dropped['total']} replies dropped and "
                        f"counted, the rest delivered; closed unread with {pinned:.0f} MB held, the PS's memory back "
                        f"{freed_s:.1f} s after, with no push; every honest push applied")
