"""Well-formed messages that lie: a PS on loopback without keys, attacked as a local user could (issue 19).

Each case sends real messages from raw sockets to a real PS process and asserts the exact refusals it
counts, that the PS keeps serving, and that the honest workers see nothing change: their ranks, the
world size, and a central model that moves only by their own pushes. Most cases share one PS (world of
3: ranks 0 and 1 are PSClients that heartbeat, rank 2 is held by a raw socket, ``member``), so each
takes the refusal counters before and after.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import msgpack
import numpy as np
import pytest
import zmq

from plug_asgd.protocol.wire import PROTOCOL_VERSION, decode, encode
from plug_asgd.ps import PSConfig, embedded_command, limits
from plug_asgd.worker.client import PSClient
from tests.conftest import ProcessGroups, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BIG = 1 << 18  # floats of the model's second tensor: a model reply is about 1 MB
W0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "big": np.zeros(BIG, np.float32)}
ONE = {"w": np.ones((2, 3), np.float32)}


class Raw:
    """A raw DEALER socket that speaks the protocol by hand: what a local user could write."""

    def __init__(self, address: str, rcvhwm: int | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.connect(address)

    def send(self, msg_type: str, fields: dict, tensors: dict | None = None) -> None:
        self.sock.send_multipart(encode(msg_type, {"rid": 1, **fields}, tensors))

    def ask(self, msg_type: str, fields: dict, tensors: dict | None = None) -> tuple[str, dict]:
        """Send one request and wait for its reply: (type, fields); an error's fields hold its code."""
        self.send(msg_type, fields, tensors)
        return self.reply()

    def reply(self) -> tuple[str, dict]:
        assert self.sock.poll(20_000), "the PS did not answer"
        msg = decode(self.sock.recv_multipart())
        return msg.type, msg.fields

    def code(self, msg_type: str, fields: dict, tensors: dict | None = None) -> str:
        kind, reply = self.ask(msg_type, fields, tensors)
        assert kind == "error", (kind, reply)
        return reply["code"]

    def close(self) -> None:
        self.sock.close(0)


def hello(rank: int, session: str, world_size: int = 3, **extra) -> dict:
    return {"rank": rank, "world_size": world_size, "stage": 1, "session": session, "mode": "asgd",
            "training": True, **extra}


@pytest.fixture(scope="module")
def run():
    """One PS, two honest workers (ranks 0, 1) and ``member`` (rank 2, a raw socket in session ``raw``)."""
    groups = ProcessGroups()
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = groups.start(embedded_command(PSConfig(bind=address, worker_timeout=60)))
    honest = [PSClient(address, rank=r, world_size=3, mode="asgd", request_timeout=20, heartbeat_s=0.2)
              for r in (0, 1)]
    member = Raw(address)
    state = {"session": "raw", "seq": 0, "central": {k: v.copy() for k, v in W0.items()}}
    try:
        for c in honest:
            c.hello(stage=1, training=True, timeout=30)
        assert honest[0].init(W0)
        assert member.ask("hello", hello(2, "raw"))[0] == "welcome"
        assert honest[0].stats()["world_held"]  # by its live workers: a hello of another size is refused
        yield address, honest, member, state
    finally:
        member.close()
        for c in honest:
            c.close()
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        finally:
            left = groups.leftovers()
            for p in groups.procs:
                groups.kill(p)
        assert proc.returncode == 0, proc.returncode
        assert not left, left


def refused(client: PSClient) -> Counter:
    return Counter(client.stats()["refused"])


def honest_push_moves_the_model_by_itself(run) -> None:
    """Rank 0 pushes ONE: applied, one version more, the central model its own plus ONE, all ranks still there."""
    _, honest, _, state = run
    before = honest[0].stats()
    reply = honest[0].push(before["version"], ONE)
    state["central"]["w"] += 1
    assert reply.status == "applied" and reply.version == before["version"] + 1
    np.testing.assert_array_equal(reply.tensors["w"], state["central"]["w"])
    np.testing.assert_array_equal(reply.tensors["big"], state["central"]["big"])
    after = honest[0].stats()
    assert after["workers"] == [0, 1, 2] and after["world_size"] == 3 and after["lost"] == []
    assert set(after["pushes_by_rank"]) <= {"0", "1", "2"}


def member_push(run, tensors: dict | None, **fields) -> tuple[str, dict]:
    _, _, member, state = run
    state["seq"] += 1
    base = {"rank": 2, "base_version": 0, "seq": state["seq"], "session": state["session"]}
    return member.ask("push", {**base, **fields}, tensors)


@pytest.mark.faults
def test_a_connection_that_never_said_hello_can_neither_push_pull_gather_leave_nor_heartbeat(run, fault_report):
    address, honest, _, _ = run
    stranger = Raw(address)
    try:
        before, version = refused(honest[0]), honest[0].stats()["version"]
        codes = [stranger.code("push", {"rank": 0, "base_version": 0, "seq": 10**6, "session": honest[0].session},
                               ONE),
                 stranger.code("push", {"rank": 7, "base_version": 0, "seq": 1, "session": "x"}, ONE),
                 stranger.code("bye", {"rank": 0, "stage": 1}), stranger.code("bye", {"rank": 1, "stage": 1}),
                 stranger.code("gather", {"rank": 0, "stage": 1, "seq": 0, "kind": "barrier:"})]
        stranger.send("heartbeat", {"rank": 0, "session": "guess", "token": "0" * 32})  # no reply: counted
        codes.append(stranger.code("pull", {"rank": 1}))  # answered after the heartbeat: the PS took both
        assert codes == ["not_member"] * 6
        assert refused(honest[0]) - before == Counter(not_member=7)
        kind, fields = stranger.ask("pull", {})  # a bystander's pull (no rank) is answered, as `status` is
        assert kind == "model" and fields["version"] == version
        honest_push_moves_the_model_by_itself(run)
    finally:
        stranger.close()
    fault_report(fault="forged push, pull, gather, heartbeat and bye (for ranks 0 and 1) from a connection that "
                       "never said hello", injected=7, handled=7, pushes_lost=0, recovery_s=None,
                 detail="each refused (not_member, 7 counted); both ranks stayed, model moved only by rank 0")


@pytest.mark.faults
def test_a_member_speaks_only_for_its_own_rank_and_session(run, fault_report):
    _, honest, member, state = run
    before = refused(honest[0])
    codes = [member_push(run, ONE, rank=0)[1]["code"], member_push(run, ONE, session="another")[1]["code"],
             member.code("bye", {"rank": 0, "stage": 1}), member.code("bye", {"rank": 1, "stage": 1}),
             member.code("gather", {"rank": 1, "stage": 1, "seq": 0, "kind": "barrier:"}),
             member.code("hello", hello(0, state["session"]))]
    assert codes == ["not_owner"] * 6
    assert refused(honest[0]) - before == Counter(not_owner=6)
    honest_push_moves_the_model_by_itself(run)
    fault_report(fault="a member's push, bye, gather and hello naming another rank or session", injected=6,
                 handled=6, pushes_lost=0, recovery_s=None,
                 detail="each refused (not_owner, 6 counted); the other ranks stayed, nothing folded")


@pytest.mark.faults
def test_a_live_rank_is_not_taken_without_its_token_and_claims_beyond_the_limits_are_refused(run, fault_report):
    address, honest, member, state = run
    stranger = Raw(address)
    try:
        before = refused(honest[0])
        codes = [stranger.code("hello", hello(0, "thief")),
                 stranger.code("hello", hello(0, "thief", token="f" * 32)),
                 stranger.code("hello", hello(0, "thief", token="short")),
                 stranger.code("hello", hello(0, "thief", world_size=2**40)),
                 stranger.code("hello", hello(0, "thief", world_size=4)),
                 stranger.code("hello", hello(5, "thief")),
                 member.code("hello", hello(2, "s" * (limits.MAX_SESSION_CHARS + 1)))]
        assert codes == ["rank_taken", "rank_taken", "bad_field", "limit", "world_held", "bad_field", "limit"]
        assert refused(honest[0]) - before == Counter(rank_taken=2, bad_field=2, limit=2, world_held=1)
        assert honest[0].stats()["world_size"] == 3
        honest_push_moves_the_model_by_itself(run)  # rank 0's connection still holds rank 0
    finally:
        stranger.close()
    fault_report(fault="hello for a live rank without its token, world_size 2**40, rank beyond the world, "
                       "a 129-character session", injected=7, handled=7, pushes_lost=0, recovery_s=None,
                 detail="refused (rank_taken 2, limit 2, bad_field 2, world_held 1); the worker kept its rank")


@pytest.mark.faults
def test_an_empty_push_is_refused_and_moves_no_version(run, fault_report):
    _, honest, _, _ = run
    before, stats = refused(honest[0]), honest[0].stats()
    codes = [member_push(run, None)[1]["code"] for _ in range(3)]
    assert codes == ["empty"] * 3
    after = honest[0].stats()
    assert after["version"] == stats["version"] and after["pushes_by_rank"] == stats["pushes_by_rank"]
    assert refused(honest[0]) - before == Counter(empty=3)
    honest_push_moves_the_model_by_itself(run)
    fault_report(fault="pushes with no tensors", injected=3, handled=3, pushes_lost=0, recovery_s=None,
                 detail="refused (empty, 3 counted); the version did not move")


def _gather_frames(seq: int, obj_bytes: bytes) -> list[bytes]:
    """A gather of rank 2 whose object is ``obj_bytes`` (msgpack, spliced in: msgpack-python will not nest so deep)."""
    placeholder = "@" * 40
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": "gather", "tensors": [], "fields": {
        "rid": 1, "rank": 2, "stage": 1, "seq": seq, "kind": "broadcast", "obj": placeholder}})
    return [header.replace(msgpack.packb(placeholder), obj_bytes)]


@pytest.mark.faults
def test_a_gather_whose_reply_could_not_be_encoded_is_refused_and_the_collective_completes(run, fault_report):
    _, honest, member, _ = run
    before = refused(honest[0])
    member.sock.send_multipart(_gather_frames(50, b"\x91" * 1022 + b"\xc0"))  # [[[...None...]]] 1,022 deep
    codes = [member.reply()[1]["code"],
             member.code("gather", {"rank": 2, "stage": 1, "seq": 50, "kind": "broadcast",
                                    "obj": "x" * (limits.MAX_OBJ_BYTES + 1)}),
             member.code("gather", {"rank": 2, "stage": 1, "seq": 50, "kind": "k" * 300})]
    assert codes == ["limit"] * 3
    assert honest[0].stats()["gather_contributions_pending"] == 0  # nothing of them was kept
    results = {}
    threads = [threading.Thread(target=lambda c=c: results.setdefault(c.rank, c.gather(1, 50, None, kind="broadcast")))
               for c in honest]
    for t in threads:
        t.start()
    kind, fields = member.ask("gather", {"rank": 2, "stage": 1, "seq": 50, "kind": "broadcast", "obj": [[1]]})
    for t in threads:
        t.join(30)
    assert kind == "gathered" and fields["ranks"] == [0, 1, 2] and fields["objs"] == [None, None, [[1]]]
    assert [r for r, _, _ in results[0]] == [0, 1, 2] and results[0] == results[1]
    assert refused(honest[0]) - before == Counter(limit=3)
    honest_push_moves_the_model_by_itself(run)
    fault_report(fault="gather objects nested 1,022 deep or over 256 KiB, kinds of 300 characters", injected=3,
                 handled=3, pushes_lost=0, recovery_s=None,
                 detail="refused on arrival (limit, 3 counted); the collective of all 3 ranks then completed")


def test_abandoned_gathers_are_freed_and_sessions_kept_per_rank_are_bounded(run):
    _, honest, member, state = run
    for seq in range(1000, 1300):  # never completed: each contribution replaces the rank's previous one
        member.send("gather", {"rank": 2, "stage": 1, "seq": seq, "kind": "barrier:", "obj": "x" * 1000})
    assert member.ask("stats", {})[0] == "stats"  # answered after the 300 gathers
    assert honest[0].stats()["gather_contributions_pending"] == 1
    for c in honest:  # one session each that pushed
        c.push(c.pull().version, ONE)
        state["central"]["w"] += 1
    for i in range(6):  # rank 2 in 6 new sessions (a process restarted again and again), a push in each
        state["session"] = f"again-{i}"
        assert member.ask("hello", hello(2, state["session"]))[0] == "welcome"
        assert member_push(run, ONE)[1]["status"] == "applied"
        state["central"]["w"] += 1
    assert honest[0].stats()["sessions_kept"] == 2 + limits.SESSIONS_PER_RANK
    honest_push_moves_the_model_by_itself(run)


@pytest.mark.faults
def test_a_client_that_never_reads_its_replies_costs_a_bounded_queue_and_nothing_else(run, fault_report):
    address, honest, _, _ = run
    sent = 200  # pulls of a 1 MB model, unread: more than the queue (32) and the kernel's buffers hold
    slow = Raw(address, rcvhwm=1)
    try:
        before = honest[0].stats()
        for _ in range(sent):
            slow.send("pull", {})
        slow.send("pull", {"rank": 0})  # refused and counted once the PS has handled the 200 before it
        honest_push_moves_the_model_by_itself(run)  # served meanwhile
        deadline = time.monotonic() + 60
        while refused(honest[0])["not_member"] == before["refused"].get("not_member", 0):
            assert time.monotonic() < deadline, "the PS did not get to the end of the pulls"
            time.sleep(0.05)
        dropped = honest[0].stats()["replies_dropped"].get("queue_full", 0) - before["replies_dropped"].get(
            "queue_full", 0)
        received = 0
        while slow.sock.poll(2000):
            slow.sock.recv_multipart()
            received += 1
        assert dropped > 0 and received + dropped == sent + 1  # each reply delivered or dropped and counted
    finally:
        slow.close()
    fault_report(fault="a client that never reads its replies (200 pulls of a 1 MB model)", injected=sent,
                 handled=sent, pushes_lost=0, recovery_s=None,
                 detail=f"of the {sent + 1} replies (the pulls, then one refusal) {received} were delivered once "
                        f"it read (the PS queues {limits.REPLY_HWM}), {dropped} dropped and counted; the honest "
                        "worker served meanwhile")


@pytest.mark.faults
def test_a_silent_first_hello_holds_the_world_until_lost_and_a_token_proves_the_same_worker(start_ps, fault_report):
    address = start_ps("asgd", worker_timeout=2)
    squatter, thief = Raw(address), Raw(address)
    # rank 0 without heartbeats: the test takes its rank over, and its heartbeats would then be refused too
    workers = [PSClient(address, rank=r, world_size=2, mode="asgd", request_timeout=20, heartbeat_s=beat)
               for r, beat in ((0, None), (1, 0.2))]
    try:
        assert squatter.code("hello", hello(0, "squat", world_size=2**40)) == "limit"
        assert squatter.ask("hello", hello(2, "squat", world_size=3, heartbeat_s=1))[0] == "welcome"  # no beats
        # its world holds while it may be alive: a hello of another size waits (PSClient asks again) ...
        assert thief.code("hello", hello(0, "probe", world_size=2)) == "world_held"
        deadline = time.monotonic() + 30
        while workers[1].stats()["lost"] != [2]:  # ... until it is declared lost (worker_timeout 2 s)
            assert time.monotonic() < deadline, "the silent worker was not declared lost"
            time.sleep(0.05)
        for w in workers:  # the first accepted hello of world 2 drops rank 2
            w.hello(stage=1, training=True, timeout=30)
        assert workers[0].init(W0)
        assert squatter.code("push", {"rank": 2, "base_version": 0, "seq": 1, "session": "squat"}, ONE) == "not_member"
        assert squatter.code("hello", hello(1, "squat", world_size=3)) == "world_held"
        # a hello with rank 0's token takes the rank over (what a reconnected worker does) ...
        assert thief.ask("hello", hello(0, "other", world_size=2, token=workers[0].token))[0] == "welcome"
        # ... and the worker, refused once (not_member), says hello with its token and gets it back
        assert workers[0].push(0, ONE).status == "applied"
        assert thief.code("push", {"rank": 0, "base_version": 0, "seq": 1, "session": "other"}, ONE) == "not_member"
        stats = workers[0].stats()
        assert stats["workers"] == [0, 1] and stats["world_size"] == 2 and stats["version"] == 1
        assert stats["lost"] == []
        assert stats["refused"] == {"limit": 1, "not_member": 3, "world_held": 2}
        np.testing.assert_array_equal(workers[1].pull().tensors["w"], W0["w"] + 1)
    finally:
        for w in workers:
            w.close()
        squatter.close()
        thief.close()
    fault_report(fault="a first hello with world_size 2**40 or 3 and no heartbeat; a rank taken over with its "
                       "token", injected=3, handled=3, pushes_lost=0, recovery_s=None,
                 detail="the hello of world 3 held it until declared lost (2 s), then the run's world of 2 was "
                        "taken; the worker whose rank was taken said hello again and pushed; refused: limit 1, "
                        "not_member 3, world_held 2")
