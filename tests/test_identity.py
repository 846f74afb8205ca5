"""Who a session, a world size and a partition digest belong to, and refusals that change nothing (issue 47).

The attacks of issue 47, each against a real PS process from raw sockets, with the honest run's outcome
asserted (its pushes applied, its collectives answered, its world size) and the exact refusals counted:

1. a session another rank holds: refused (``session_taken``), before and after a ``--resume``; a push number
   past its session's last by more than :data:`~plug_asgd.ps.store_records.MAX_SEQ_STEP` is refused (``seq_gap``);
   checkpoints are 0600 and keep a hash of each session's token, never the token;
3. refused messages fix no partition digest on a fresh shard;
4. a world claimed by a squatter that went away passes once it is declared lost; a hello for another world
   cannot take the world of live workers; a PS given its world size (the embedded one is) refuses every other.

Then every refusal code, one message each: the PS's state before and after is the same. The quick tests at the
end check the same rules in process (membership, shard guard, store, checkpoint files, the embedded PS's config).
"""

from __future__ import annotations

import hashlib
import stat
import threading
import time
from collections import Counter

import msgpack
import numpy as np
import pytest
import zmq

from plug_asgd.protocol.checkpoint import list_checkpoints, read_checkpoint, write_checkpoint
from plug_asgd.protocol.partition import Partition
from plug_asgd.protocol.wire import PROTOCOL_VERSION, WireError, decode, encode
from plug_asgd.ps import PSConfig, embedded_command, limits
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.reference_store import ReferenceStore
from plug_asgd.ps.shard_guard import ShardGuard
from plug_asgd.ps.stats import Stats
from plug_asgd.ps.store_records import MAX_SEQ_STEP, PushIn
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.worker.client import PSClient

ONES = {"w": np.ones(4, np.float32)}


class Raw:
    """A raw DEALER socket that speaks the protocol by hand: what a local user could write."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send_frames(self, frames: list) -> tuple[str, dict]:
        """Send frames as they are and wait for the reply: (type, fields)."""
        self.sock.send_multipart(frames)
        assert self.sock.poll(20_000), "the PS did not answer"
        msg = decode(self.sock.recv_multipart())
        return msg.type, msg.fields

    def ask(self, msg_type: str, fields: dict, tensors: dict | None = None) -> tuple[str, dict]:
        return self.send_frames(encode(msg_type, {"rid": 1, **fields}, tensors))

    def code(self, msg_type: str, fields: dict, tensors: dict | None = None) -> str:
        kind, reply = self.ask(msg_type, fields, tensors)
        assert kind == "error", (kind, reply)
        return reply["code"]

    def stats(self) -> dict:
        kind, reply = self.ask("stats", {})
        assert kind == "stats"
        return reply["stats"]

    def close(self) -> None:
        self.sock.close(0)


def hello(rank: int, session: str, world_size: int = 2, **extra) -> dict:
    return {"rank": rank, "world_size": world_size, "stage": 1, "session": session, "mode": "asgd",
            "training": True, **extra}


def push(rank: int, session: str, seq: int, base: int = 0) -> dict:
    return {"rank": rank, "session": session, "seq": seq, "base_version": base}


def wait_for(what, timeout: float = 30.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(step)
    return value


def _closing(*things) -> None:
    for t in things:
        t.close()


# -- attack 1: a session another rank holds ---------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(120)
def test_a_session_another_worker_holds_is_refused_before_and_after_a_resume(start_ps, tmp_path, fault_report):
    ck = tmp_path / "ck"
    address = start_ps("asgd", checkpoint_dir=ck, checkpoint_every_updates=1, worker_timeout=60)
    victim = PSClient(address, rank=0, world_size=2, mode="asgd", request_timeout=20, heartbeat_s=0.5)
    attacker, observer = Raw(address), Raw(address)
    try:
        victim.hello(stage=1, training=True, timeout=30)
        assert victim.init({"w": np.zeros(4, np.float32)})
        for _ in range(10):
            assert victim.push(victim.pull().version, ONES).status == "applied"
        # the checkpoint lists the session, but is the owner's only, and holds a hash of the token, not the token
        newest = wait_for(lambda: [p for p in list_checkpoints(ck) if "v0000000010" in p.name])[0]
        assert stat.S_IMODE(newest.stat().st_mode) == 0o600
        fields = read_checkpoint(newest).fields
        assert fields["last_seq"] == {victim.session: 10}
        assert fields["session_owners"] == {victim.session: [0, hashlib.sha256(victim.token.encode()).hexdigest()]}
        assert victim.token.encode() not in newest.read_bytes()

        before = Counter(observer.stats()["refused"])
        codes = [attacker.code("hello", hello(1, victim.session)),  # a free rank, the victim's session
                 attacker.code("hello", hello(1, victim.session, token="f" * 32))]
        assert attacker.ask("hello", hello(1, "attacker"))[0] == "welcome"  # a free rank: its own session
        codes += [attacker.code("push", push(1, victim.session, 2**64 - 1), {"w": np.zeros(4, np.float32)}),
                  attacker.code("push", push(1, "attacker", 2**64 - 1), {"w": np.zeros(4, np.float32)}),
                  attacker.code("push", push(1, "attacker", MAX_SEQ_STEP + 1), {"w": np.zeros(4, np.float32)})]
        assert codes == ["session_taken", "session_taken", "not_owner", "seq_gap", "seq_gap"]
        assert Counter(observer.stats()["refused"]) - before == Counter(session_taken=2, not_owner=1, seq_gap=2)
        for _ in range(10):  # every one of the victim's next pushes is applied
            assert victim.push(victim.pull().version, ONES).status == "applied"
        reply = victim.pull()
        assert reply.version == 20
        np.testing.assert_array_equal(reply.tensors["w"], np.full(4, 20, np.float32))
        attacker.close()

        # the PS restarts from its checkpoint: the session still belongs to the victim's token
        start_ps.stop(address)
        start_ps.started[address] = start_ps.procs.start(embedded_command(PSConfig(bind=address, resume=ck)))
        attacker = Raw(address)
        codes = [attacker.code("hello", hello(0, victim.session)),  # rank 0 is free: the PS knows no worker yet
                 attacker.code("hello", hello(1, victim.session, token="f" * 32))]
        assert codes == ["session_taken", "session_taken"]
        victim.hello(stage=1, training=True, timeout=30)  # its token proves the session
        assert victim.push(victim.pull().version, ONES).status == "applied"
        reply = victim.pull()
        assert reply.version == 21
        np.testing.assert_array_equal(reply.tensors["w"], np.full(4, 21, np.float32))
        assert victim.stats()["refused"] == {"session_taken": 2}
    finally:
        _closing(victim, attacker, observer)
    fault_report(fault="hello under a live worker's session (read from a checkpoint) on a free rank, and pushes "
                       "numbered 2**64-1, before and after --resume", injected=7, handled=7, pushes_lost=0,
                 recovery_s=None, detail="refused: session_taken 2+2 (after the resume too), not_owner 1, seq_gap 2; "
                                         "all 21 of the victim's pushes applied (w = 21); checkpoints 0600, no token")


# -- attack 3: refused messages fix no partition digest -----------------------------------------------------------

@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(120)
def test_refused_messages_fix_no_partition_digest_and_the_honest_shards_train(start_ps, tmp_path, fault_report):
    shapes = {"w": (8, 5), "b": (5,)}
    part = Partition(shapes, 2)
    assert {p.shard for p in part.pieces} == {0, 1}, "every shard must hold a piece"
    ck = tmp_path / "ck"
    addresses = [start_ps("asgd", shard="0/2", checkpoint_dir=ck, checkpoint_every_updates=1),
                 start_ps("asgd", shard="1/2")]
    bogus = {"shards": 2, "shard": 0, "digest": "bogus"}
    attacker = Raw(addresses[0])
    workers = [ShardedClient(addresses, part, rank=r, world_size=2, mode="asgd", request_timeout=20)
               for r in (0, 1)]
    try:
        codes = [attacker.code("hello", hello(5, "attacker", partition=bogus)),
                 attacker.code("init", {"partition": bogus})]
        assert codes == ["bad_field", "bad_tensor"]
        stats = attacker.stats()
        assert (stats["partition_digest"], stats["world_size"], stats["sessions_owned"]) == (None, None, 0)
        for w in workers:
            w.hello(stage=1, training=True, timeout=30)
        w0 = {"w": np.arange(40, dtype=np.float32).reshape(8, 5), "b": np.zeros(5, np.float32)}
        assert workers[0].init(w0)
        for w in workers:
            assert w.push(w.pull().version, {n: np.ones(s, np.float32) for n, s in shapes.items()}).status == "applied"
        reply = workers[1].pull()
        assert reply.version.per_shard == (2, 2)
        for name, t in w0.items():
            np.testing.assert_array_equal(reply.tensors[name], t + 2)
        shard0, shard1 = workers[0].stats()["shards"]
        assert shard0["partition_digest"] == shard1["partition_digest"] == part.digest
        assert shard0["refused"] == {"bad_field": 1, "bad_tensor": 1} and shard1["refused"] == {}
        newest = wait_for(lambda: [p for p in list_checkpoints(ck) if "v0000000002" in p.name])[0]
        assert read_checkpoint(newest).fields["partition_digest"] == part.digest
    finally:
        _closing(attacker, *workers)
    fault_report(fault="on a fresh shard, a hello for rank 5 of world 2 and an init without tensors, both with a "
                       "bogus partition digest", injected=2, handled=2, pushes_lost=0, recovery_s=None,
                 detail="refused (bad_field 1, bad_tensor 1), no digest fixed; the honest workers' digest fixed, "
                        "checkpointed, both pushes applied on both shards")


# -- attack 4: the world size ----------------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(120)
def test_a_world_claimed_by_a_squatter_that_went_away_passes_once_it_is_lost(start_ps, fault_report):
    address = start_ps("asgd", worker_timeout=2)
    squatter, beats, probe = Raw(address), Raw(address), Raw(address)
    workers = [PSClient(address, rank=r, world_size=2, mode="asgd", request_timeout=20, heartbeat_s=0.5)
               for r in (0, 1)]
    try:
        kind, welcome = squatter.ask("hello", hello(2, "squat", world_size=3, heartbeat_s=0.5))
        assert kind == "welcome"
        beats.sock.send_multipart(encode("heartbeat", {"rank": 2, "session": "squat", "token": welcome["token"]}))
        assert probe.code("hello", hello(0, "probe")) == "world_held"  # its world holds while it may be alive ...
        squatter.close()
        beats.close()
        wait_for(lambda: probe.stats()["lost"] == [2])  # ... and passes once it is declared lost (2 s)
        for w in workers:
            w.hello(stage=1, training=True, timeout=30)
        assert workers[0].init({"w": np.zeros(4, np.float32)})
        for w in workers:
            assert w.push(w.pull().version, ONES).status == "applied"
        results = _gather(workers)
        assert [[r for r, _, _ in results[w.rank]] for w in workers] == [[0, 1], [0, 1]]
        stats = probe.stats()
        assert (stats["world_size"], stats["workers"], stats["lost"], stats["version"]) == (2, [0, 1], [], 2)
        assert stats["refused"] == {"world_held": 1}
    finally:
        _closing(squatter, beats, probe, *workers)
    fault_report(fault="a first hello claiming world 3, one heartbeat, then gone", injected=1, handled=1,
                 pushes_lost=0, recovery_s=None,
                 detail="world_held 1 while it might live; once it was declared lost (2 s) the world of 2 was "
                        "taken, both pushes applied, the all_gather of ranks 0 and 1 answered")


@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(120)
def test_a_hello_for_another_world_cannot_take_the_world_of_live_workers(start_ps, fault_report):
    address = start_ps("asgd", worker_timeout=30)
    fixed = start_ps("asgd", world_size=2)  # as the embedded PS is started: the strategy's world size
    attacker, observer = Raw(address), Raw(fixed)
    workers = [PSClient(address, rank=r, world_size=2, mode="asgd", request_timeout=20, heartbeat_s=2)
               for r in (0, 1)]
    try:
        for w in workers:  # their first heartbeat comes 2 s after their hello
            w.hello(stage=1, training=True, timeout=30)
        assert attacker.code("hello", hello(16383, "attacker", world_size=16384)) == "world_held"
        assert workers[0].init({"w": np.zeros(4, np.float32)})
        results = _gather(workers)
        assert [[r for r, _, _ in results[w.rank]] for w in workers] == [[0, 1], [0, 1]]
        stats = workers[0].stats()
        assert (stats["world_size"], stats["workers"], stats["refused"]) == (2, [0, 1], {"world_held": 1})

        stats = observer.stats()  # the world is the config's before any hello
        assert (stats["world_size"], stats["world_held"]) == (2, True)
        codes = [observer.code("hello", hello(2, "attacker", world_size=3)),
                 observer.code("hello", hello(16383, "attacker", world_size=16384))]
        assert codes == ["world_mismatch", "world_mismatch"]
        stats = observer.stats()
        assert (stats["world_size"], stats["workers"], stats["refused"]) == (2, [], {"world_mismatch": 2})
    finally:
        _closing(attacker, observer, *workers)
    fault_report(fault="a hello for rank 16383 of world 16384 before the workers' first heartbeat; hellos of other "
                       "worlds at a PS given its world size", injected=3, handled=3, pushes_lost=0, recovery_s=None,
                 detail="world_held 1 (the world of the live workers), world_mismatch 2 (the configured one); the "
                        "world stayed 2 and the all_gather of ranks 0 and 1 was answered")


def _gather(workers: list[PSClient]) -> dict[int, list]:
    """Every worker's ``all_gather`` (collective 1 of stage 1), each from a thread: their results by rank."""
    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda w=w: results.setdefault(w.rank, w.gather(1, 1, w.rank)))
               for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == len(workers), "an all_gather was not answered"
    return results


# -- every refusal code changes nothing ----------------------------------------------------------------------------

LIMIT = 4096  # the PS's --max-message-bytes
W0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.float32)}
OK = {"w": np.ones((2, 3), np.float32)}
# what a refused message must not change: the counters of traffic and refusals may move, nothing else
STATE = ("version", "initialized", "partition_digest", "world_size", "world_held", "workers", "trainers", "lost",
         "sessions_kept", "sessions_owned", "pushes_applied", "pushes_dropped", "pushes_by_rank", "staleness",
         "gather_contributions_pending", "collectives_kept", "weights_pushes", "shm_segments", "workers_lost",
         "workers_back")


def _state(observer: Raw) -> dict:
    stats = observer.stats()
    state = {k: stats[k] for k in STATE}
    state["worker_details"] = [{k: v for k, v in d.items() if k != "last_seen_s"} for d in stats["worker_details"]]
    if stats["initialized"]:  # and the model, bit for bit (a bystander's pull)
        observer.sock.send_multipart(encode("pull", {"rid": 1}))
        assert observer.sock.poll(20_000), "the PS did not answer"
        reply = decode(observer.sock.recv_multipart())
        assert reply.type == "model"
        state["model"] = (reply.fields["version"], {n: t.tobytes() for n, t in reply.tensors.items()})
    return state


def _header(msg_type: str = "push", fields: dict | None = None, tensors: list | None = None) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": msg_type, "fields": {"rid": 1, **(fields or {})},
                          "tensors": tensors or []})


def _push(seq: int, tensors: dict | None, **fields) -> list:
    return encode("push", {"rid": 1, **push(1, "raw", seq), **fields}, tensors)


def _dense(name: str = "w", dtype: str = "float32", shape: list | None = None) -> dict:
    return {"name": name, "enc": "dense", "dtype": dtype, "shape": [2, 3] if shape is None else shape}


def _bad_version() -> list:
    frames = encode("pull", {"rid": 1})
    frames[0] = frames[0].replace(bytes([0xA1, 0x76, PROTOCOL_VERSION]), bytes([0xA1, 0x76, 99]))
    return frames


def _refusals(honest: PSClient) -> list[tuple[str, str, list, str]]:
    """(what, who sends it, frames, the code it gets): every code one message can get from a PS of world 3 given
    its size and run, ranks 0 (``honest``) and 1 (``member``, session ``raw``) held, rank 2 free."""
    other_run = hello(2, "s", 3, run=8)
    return [
        ("garbage header", "stranger", [b"\xc1\xff not msgpack"], "bad_header"),
        ("a tensor frame missing", "member", _push(2, OK)[:1], "frame_count"),
        ("unknown type", "stranger", encode("steal", {"rid": 1}), "unknown_type"),
        ("protocol version 99", "stranger", _bad_version(), "bad_version"),
        ("unknown tensor", "member", _push(2, {"nope": np.ones((2, 3), np.float32)}), "unknown_tensor"),
        ("frame shorter than its shape", "member", [_header(fields=push(1, "raw", 2), tensors=[_dense()]),
                                                    b"\x00" * 20], "bad_frame_size"),
        ("wrong numel", "member", _push(2, {"w": np.ones(5, np.float32)}), "bad_tensor"),
        ("integer dtype", "member", _push(2, {"w": np.ones((2, 3), np.int32)}), "bad_payload"),
        ("complex dtype", "member", [_header(fields=push(1, "raw", 2), tensors=[_dense(dtype="complex64")]),
                                     b"\x00" * 48], "bad_dtype"),
        ("negative dimension", "member", [_header(fields=push(1, "raw", 2), tensors=[_dense(shape=[-2, 3])]),
                                          b""], "bad_shape"),
        ("sparse index out of range", "member", [
            _header(fields=push(1, "raw", 2), tensors=[
                {"name": "w", "enc": "sparse", "dtype": "float32", "shape": [2, 3], "nnz": 1}]),
            np.array([1], "<u4").tobytes(), np.array([6], "<u2").tobytes(), np.ones(1, "<f4").tobytes()],
         "bad_sparse"),
        ("packed without a codec", "member", [_header(fields=push(1, "raw", 2), tensors=[
            {"name": "w", "enc": "packed", "codec": "", "shape": [2, 3], "arrays": []}])], "bad_packed"),
        ("NaN", "member", _push(2, {"w": np.full((2, 3), np.nan, np.float32)}), "not_finite"),
        ("base_version not an int", "member", _push(2, OK, base_version="0"), "bad_field"),
        ("hello for a rank beyond the world", "stranger", encode("hello", {"rid": 1, **hello(5, "new", 3)}),
         "bad_field"),
        ("over the size limit", "member", _push(2, {f"t{i}": np.zeros(300, np.float32) for i in range(4)}),
         "too_large"),
        ("65,537 frames", "stranger", [b""] * 65537, "too_many_frames"),
        ("a pull naming shared memory", "stranger", [_header("pull", tensors=[
            {"name": "w", "enc": "local", "dtype": "float32", "shape": [2, 3], "offset": 0}])], "bad_local"),
        ("a push with no tensors", "member", _push(2, None), "empty"),
        ("a push received already", "member", _push(1, OK), "duplicate"),
        ("a push numbered far past its session's last", "member", _push(2 + MAX_SEQ_STEP, OK), "seq_gap"),
        ("a push from a connection without a rank", "stranger",
         encode("push", {"rid": 1, **push(0, honest.session, 9)}, OK), "not_member"),
        ("a member's push for another rank", "member", _push(2, OK, rank=0), "not_owner"),
        ("hello for a live rank without its token", "stranger", encode("hello", {"rid": 1, **hello(0, "s", 3)}),
         "rank_taken"),
        ("hello for another world", "stranger", encode("hello", {"rid": 1, **hello(2, "s", 4)}), "world_mismatch"),
        ("hello under rank 0's session", "stranger", encode("hello", {"rid": 1, **hello(2, honest.session, 3)}),
         "session_taken"),
        ("a 129-character session", "stranger",
         encode("hello", {"rid": 1, **hello(2, "s" * (limits.MAX_SESSION_CHARS + 1), 3)}), "limit"),
        ("hello for another mode", "stranger", encode("hello", {"rid": 1, **hello(2, "s", 3), "mode": "sync"}),
         "mode_mismatch"),
        ("hello for another run", "stranger", encode("hello", {"rid": 1, **other_run}), "run_mismatch"),
        # a previous Trainer's PS of another mode on the port: the run is told first, which the worker waits out
        ("hello for another run and mode", "stranger", encode("hello", {"rid": 1, **other_run, "mode": "sync"}),
         "run_mismatch"),
        ("hello with a partition at a whole model's PS", "stranger", encode("hello", {
            "rid": 1, **hello(2, "s", 3), "partition": {"shards": 2, "shard": 0, "digest": "d"}}),
         "partition_mismatch"),
    ]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_refused_message_changes_nothing_whatever_its_code(start_ps):
    address = start_ps("asgd", world_size=3, run=7, max_message_bytes=LIMIT, shm_pushes=False, worker_timeout=60)
    honest = PSClient(address, rank=0, world_size=3, mode="asgd", request_timeout=20, heartbeat_s=0.2, run=7)
    raw = {"member": Raw(address), "stranger": Raw(address)}
    observer = Raw(address)
    try:
        honest.hello(stage=1, training=True, timeout=30)
        assert honest.init(W0)
        assert raw["member"].ask("hello", hello(1, "raw", 3, run=7))[0] == "welcome"
        assert raw["member"].send_frames(_push(1, OK))[1]["status"] == "applied"
        cases = _refusals(honest)
        for what, sender, frames, code in cases:
            before, refused = _state(observer), Counter(observer.stats()["refused"])
            kind, fields = raw[sender].send_frames(frames)
            assert (kind, fields.get("code")) == ("error", code), (what, fields)
            assert Counter(observer.stats()["refused"]) - refused == Counter({code: 1}), what
            assert _state(observer) == before, what
        assert len({c for *_, c in cases}) == 29  # and not_initialized, world_held: below

        # a collective two members call differently is refused to both: the one refusal that ends something
        member2 = raw["stranger"]
        assert member2.ask("hello", hello(2, "raw2", 3, run=7))[0] == "welcome"
        raw["member"].sock.send_multipart(encode("gather", {"rid": 5, "rank": 1, "stage": 1, "seq": 9,
                                                            "kind": "barrier:"}))
        wait_for(lambda: observer.stats()["gather_contributions_pending"] == 1)
        assert member2.code("gather", {"rank": 2, "stage": 1, "seq": 9, "kind": "broadcast"}) == "collective_mismatch"
        assert raw["member"].sock.poll(20_000)
        assert decode(raw["member"].sock.recv_multipart()).fields["code"] == "collective_mismatch"
        assert observer.stats()["gather_contributions_pending"] == 0
        assert honest.push(honest.pull().version, OK).status == "applied"  # the PS serves on
    finally:
        _closing(honest, observer, *raw.values())


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_refused_message_changes_nothing_at_a_fresh_shard(start_ps):
    address = start_ps("asgd", shard="0/2", worker_timeout=60)
    digest = Partition({"w": (2, 3)}, 2).digest
    mine = {"shards": 2, "shard": 0, "digest": digest}
    honest, stranger, observer = Raw(address), Raw(address), Raw(address)
    fresh = [("a pull before any init", encode("pull", {"rid": 1}), "not_initialized"),
             ("hello for rank 5 of 2", encode("hello", {"rid": 1, **hello(5, "s", partition=mine)}), "bad_field"),
             ("init without tensors", encode("init", {"rid": 1, "partition": mine}), "bad_tensor")]
    joined = [("hello without a partition", encode("hello", {"rid": 1, **hello(1, "s")}), "partition_mismatch"),
              ("hello for another world", encode("hello", {"rid": 1, **hello(1, "s", 3, partition=mine)}),
               "world_held"),
              ("hello with another digest", encode("hello", {
                  "rid": 1, **hello(1, "s", partition={**mine, "digest": "other"})}), "partition_mismatch")]
    try:
        state = _state(observer)
        assert (state["world_size"], state["partition_digest"], state["sessions_owned"]) == (None, None, 0)
        for what, frames, code in fresh:
            kind, fields = stranger.send_frames(frames)
            assert (kind, fields.get("code")) == ("error", code), (what, fields)
            assert _state(observer) == state, what
        # a worker of world 2 with a digest: both hold while it may be alive
        assert honest.ask("hello", hello(0, "honest", partition=mine, heartbeat_s=1))[0] == "welcome"
        state = _state(observer)
        assert (state["world_size"], state["partition_digest"], state["sessions_owned"]) == (2, digest, 1)
        for what, frames, code in joined:
            kind, fields = stranger.send_frames(frames)
            assert (kind, fields.get("code")) == ("error", code), (what, fields)
            assert _state(observer) == state, what
        assert observer.stats()["refused"] == {"not_initialized": 1, "bad_field": 1, "bad_tensor": 1,
                                               "partition_mismatch": 2, "world_held": 1}
    finally:
        _closing(honest, stranger, observer)


# -- the same rules in process ---------------------------------------------------------------------------------------

def _msg(msg_type: str, **fields):
    return decode(encode(msg_type, fields))


def test_a_session_belongs_to_the_rank_and_token_that_first_named_it():
    members = Membership(60.0, Stats())
    worker, _ = members.hello(b"a", _msg("hello", **hello(0, "s0", heartbeat_s=1)), 0)
    with pytest.raises(WireError) as other_rank:
        members.hello(b"b", _msg("hello", **hello(1, "s0")), 0)
    members.check_liveness(time.time() + 61)  # rank 0 lost: its rank is free, its session still its own
    with pytest.raises(WireError) as no_token:
        members.hello(b"b", _msg("hello", **hello(0, "s0")), 0)
    assert other_rank.value.code == no_token.value.code == "session_taken"
    assert (members.workers, members.sessions[1], set(members.owners)) == ({}, [], {"s0"})
    again, _ = members.hello(b"c", _msg("hello", **hello(0, "s0", token=worker.token)), 0)  # its token proves it
    assert again.session == "s0" and again.token == worker.token

    resumed = Membership(60.0, Stats())  # a resumed PS knows the owner from the checkpoint, not the token
    resumed.restore_owners(members.owner_fields(["s0", "gone"]))
    assert set(resumed.owners) == {"s0"}
    with pytest.raises(WireError, match="belongs to another worker"):
        resumed.hello(b"d", _msg("hello", **hello(0, "s0", token="f" * 32)), 0)
    assert resumed.hello(b"d", _msg("hello", **hello(0, "s0", token=worker.token)), 0)[0].rank == 0


def test_a_world_set_by_hellos_holds_while_its_workers_may_live():
    members = Membership(2.0, Stats())
    squatter, _ = members.hello(b"a", _msg("hello", **hello(1, "s1", 3)), 0)  # announces no heartbeats
    with pytest.raises(WireError) as held:
        members.hello(b"b", _msg("hello", **hello(0, "s0", 2)), 0)
    assert held.value.code == "world_held" and members.world_size == 3 and "s0" not in members.owners
    squatter.last_seen -= 3  # silent past worker_timeout: it still holds rank 1, but no longer the world
    assert not members.claimed()
    members.hello(b"b", _msg("hello", **hello(0, "s0", 2, heartbeat_s=1)), 0)
    assert members.world_size == 2 and set(members.workers) == {0, 1}
    bye = members.bye(b"b", _msg("bye", rank=0, stage=1))
    assert bye == 1 and members.claimed()  # between two stages, the world holds for worker_timeout
    fixed = Membership(2.0, Stats(), world_size=2)
    with pytest.raises(WireError, match="this run's is 2") as mismatch:
        fixed.hello(b"a", _msg("hello", **hello(1, "s1", 3)), 0)
    assert mismatch.value.code == "world_mismatch" and fixed.world_size == 2


def test_a_refused_request_fixes_no_digest_and_one_fixed_by_hellos_alone_lapses():
    guard = ShardGuard("0/2")
    mine, other = ({"partition": {"shards": 2, "shard": 0, "digest": d}} for d in ("mine", "other"))
    assert guard.check(other) == "other" and guard.digest is None  # checked only: a refusal after it fixes nothing
    guard.fix("mine", final=False)
    with pytest.raises(WireError, match="cut by partition mine"):
        guard.check(other)
    assert guard.check(other, held=False) == "other"  # its workers are gone and no model was made: it lapses
    guard.fix("other", final=True, held=False)
    assert (guard.digest, guard.final) == ("other", True)
    with pytest.raises(WireError, match="cut by partition other"):
        guard.check(mine, held=False)  # a model is cut by it: final


def test_a_push_numbered_far_past_its_sessions_last_is_refused():
    store = ReferenceStore(PSConfig(mode="asgd", shm_pushes=False))
    store.init({"w": np.zeros(4, np.float32)})

    def fold(seq: int) -> str:
        return store.fold(PushIn(None, 0, "s", seq, store.version, {"w": np.ones(4, np.float32)})).status

    with pytest.raises(WireError) as first:
        fold(MAX_SEQ_STEP + 1)
    assert first.value.code == "seq_gap" and store.last_seq == {}
    assert fold(MAX_SEQ_STEP) == "folded"
    with pytest.raises(WireError) as gap:
        fold(2 * MAX_SEQ_STEP + 1)
    assert gap.value.code == "seq_gap" and store.last_seq == {"s": MAX_SEQ_STEP} and store.version == 1


def test_a_checkpoint_is_readable_by_its_owner_only_whatever_the_umask(tmp_path):
    import os

    old = os.umask(0)
    try:
        path = write_checkpoint(tmp_path / "ps-v0000000001.ckpt", {"version": 1}, {"model/w": np.ones(2)})
        stale = tmp_path / ".ps-v0000000002.ckpt.tmp"  # left by a crash, with another mode
        stale.write_bytes(b"x")
        stale.chmod(0o666)
        again = write_checkpoint(tmp_path / "ps-v0000000002.ckpt", {"version": 2}, {"model/w": np.ones(2)})
    finally:
        os.umask(old)
    assert [stat.S_IMODE(p.stat().st_mode) for p in (path, again)] == [0o600, 0o600]


def test_the_embedded_ps_is_told_the_jobs_world_size(monkeypatch):
    from plug_asgd import compressors, modes
    from plug_asgd.placement import connection

    ps = connection.PSConnection(modes.get("asgd"), compressors.get("none"), connection.PSSettings())
    configs: list[PSConfig] = []

    class Client:
        def close(self) -> None:
            pass

    monkeypatch.setattr(ps.embedded, "start", lambda *c: configs.extend(c))
    monkeypatch.setattr(ps.embedded, "stop", lambda: None)
    monkeypatch.setattr(ps.embedded, "wait_for_workers", lambda *a: None)
    monkeypatch.setattr(connection, "connect", lambda *a, **k: Client())
    job = connection.Placement(main_address="127.0.0.1", main_port=29500, elastic=False, num_nodes=1, node_rank=0,
                               local_rank=0, global_rank=0, world_size=3)
    try:
        ps.connect(job, lambda: {"w": (4,)}, None)
    finally:
        ps.shutdown()
    assert [c.world_size for c in configs] == [3]
    with pytest.raises(ValueError, match="differ"):
        PSConfig(world_size=2, expected_workers=3)

