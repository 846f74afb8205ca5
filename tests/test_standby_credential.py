"""The standby is a role that proves itself, and its link cannot be flooded off (issue 59): real PS processes on
loopback, raw sockets as the strangers, workers (tests/scripts/ps_worker.py processes, or clients in this process)
whose pushes the final model must hold exactly once.

A keyed PS admits as its standby only the standby key keygen makes (DIR/standby); a keyless one only a request
that proves the secret it wrote in a file its user alone can read. A refused request changes nothing and costs
the serving loop what any refused message costs. The standby's records come on a socket of its own that only the
primary can write to, and garbage at the standby's other socket delays none of them by more than one message.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import statistics
import threading
import time

import numpy as np
import pytest
import zmq
from zmq.auth import load_certificate

from plug_asgd.protocol.security import KeysError, generate_keys, load_server_keys, load_standby_keys
from plug_asgd.protocol.wire import decode, encode
from plug_asgd.ps.curve_auth import standby_keys
from plug_asgd.ps.standby_credential import PROOF_WINDOW_S, prove, read_secret, secret_path
from plug_asgd.worker.client import PSClient
from tests.conftest import free_port
from tests.test_faults import finish, pushes, read_log, start_worker, wait_for
from tests.test_standby import STATE_KEYS, _answers, ask, joined_workers, signal_ps, start_pair, stats

pytestmark = pytest.mark.faults

FLOOD_JOINS = 2000  # refused joins sent while an honest worker pushes
SLOWEST_PUSH_S = 0.5  # a push during that flood: milliseconds each, where one blocking join held the loop 60 s
PUSHES = 400  # each worker's, in the flood test: enough to last through the flood and the failover
GARBAGE = 30, 22_000  # messages, and empty tensors in each: the issue's flood, which had the primary drop its standby


@pytest.fixture
def start_ps(start_ps):
    start_ps.env["PLUG_ASGD_LOG"] = "INFO"
    return start_ps


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _state(address: str, keys=None) -> dict:
    client = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=10, heartbeat_s=None, keys=keys)
    try:
        got = client.stats(timeout=10)
    finally:
        client.close()
    return {k: v for k, v in got.items() if k in STATE_KEYS}, got


def _curve_socket(address: str, public: bytes, secret: bytes, server: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
    sock.connect(address)
    return sock


def _answer(sock: zmq.Socket, fields: dict, msg_type: str = "standby", wait_ms: int = 10_000) -> str | None:
    """Send one message; the error's code (or the reply's type), None where nothing came back within ``wait_ms``."""
    sock.send_multipart(encode(msg_type, {**fields, "rid": 3}))
    if not sock.poll(wait_ms):
        return None
    reply = decode(sock.recv_multipart())
    return reply.fields.get("code", reply.type)


def test_keygen_makes_a_standby_key_admitted_for_that_role_alone_and_adds_one_to_older_keys(tmp_path):
    keys = tmp_path / "k"
    generate_keys(keys)
    folder = keys / "standby"
    assert _mode(folder) == 0o700
    assert _mode(folder / "standby.key_secret") == _mode(folder / "server.key_secret") == 0o600
    server, standby = load_server_keys(keys), load_standby_keys(keys)
    # the PS admits the standby's public key for the standby role, and no worker's; the standby holds the PS's
    # keypair besides its own (it leads as the PS: workers check the PS's key)
    assert standby_keys(server) == {standby.standby_public} and standby.standby_public != server.public
    assert (keys / "server" / "authorized_standby" / "standby.key").read_text() == (folder / "standby.key").read_text()
    assert (standby.public, standby.secret) == (server.public, server.secret)
    assert standby.standby_public not in {p.read_bytes() for p in (keys / "server" / "authorized_workers").iterdir()}
    # keys made before the standby's: keygen adds it, and touches nothing else
    kept = {f: f.read_bytes() for f in (keys / "server" / "server.key_secret", keys / "worker" / "worker.key_secret")}
    for made in (folder / "standby.key_secret", folder / "standby.key", folder / "server.key_secret",
                 folder / "server.key", keys / "server" / "authorized_standby" / "standby.key"):
        made.unlink()
    with pytest.raises(KeysError, match=r"standby\.key_secret not found.*keygen DIR` again"):
        load_standby_keys(keys)
    added = generate_keys(keys)
    assert set(added) == {"standby_public", "standby_secret", "authorized_standby"}
    assert {f: f.read_bytes() for f in kept} == kept
    assert standby_keys(load_server_keys(keys)) == {load_standby_keys(keys).standby_public}
    with pytest.raises(FileExistsError, match="never overwrites"):
        generate_keys(keys)


def test_a_worker_key_or_the_ps_key_cannot_join_as_standby_nor_write_to_its_record_socket(start_ps, tmp_path):
    keys = tmp_path / "k"
    generate_keys(keys)
    server, standby_pair = load_server_keys(keys), load_standby_keys(keys)
    worker_pub, worker_sec = load_certificate(keys / "worker" / "worker.key_secret")
    primary = start_ps("asgd", keys=keys / "server")
    worker = PSClient(primary, rank=0, world_size=1, mode="asgd", request_timeout=20, heartbeat_s=None,
                      keys=keys / "worker")
    try:
        worker.hello(0, True, timeout=30)
        worker.init({"w": np.zeros(4, np.float32)})
        assert worker.push(0, {"w": np.ones(4, np.float32)}).version == 1
        before, _ = _state(primary, keys / "worker")
        bait = f"tcp://127.0.0.1:{free_port()}"
        join = {"step": "join", "address": bait, "link_address": bait, "link": "c" * 32}
        for public, secret in ((worker_pub, worker_sec), (server.public, server.secret)):  # a worker's key, the PS's
            sock = _curve_socket(primary, public, secret, server.public)
            assert _answer(sock, {"step": "config"}) == "bad_standby"
            assert _answer(sock, join) == "bad_standby"
            sock.close(0)
        after, counters = _state(primary, keys / "worker")
        assert after == before and after["standby_joining"] is None and counters["refused"]["bad_standby"] == 4
        # the standby key joins, and the standby holds every push from then on
        standby = start_ps("asgd", keys=keys / "standby", standby_of=primary)
        wait_for(lambda: _state(primary, keys / "worker")[0]["standby"] == standby, 30, "the standby to join")
        assert worker.push(1, {"w": np.ones(4, np.float32)}).version == 2
        held, counters = _state(standby, keys / "worker")
        assert held["version"] == 2 and held["role"] == "standby"
        # its record socket admits the PS's key alone: a worker's key, or the standby's, is refused in the
        # handshake, so a record sent there is never even read (no answer), and nothing changes
        for public, secret in ((worker_pub, worker_sec), (standby_pair.standby_public, standby_pair.standby_secret)):
            sock = _curve_socket(counters["record_socket"], public, secret, server.public)
            assert _answer(sock, {"kind": "end", "link": "0" * 32}, "replicate", wait_ms=1500) is None
            sock.close(0)
        assert _state(standby, keys / "worker")[0] == held and _state(primary, keys / "worker")[0]["standby"] == standby
        assert worker.push(2, {"w": np.ones(4, np.float32)}).version == 3
        assert worker.pull().tensors["w"].tolist() == [3.0] * 4
    finally:
        worker.close()


def _flood_joins(address: str, fields: dict, count: int, answered: list[int]) -> None:
    """Send ``count`` refused joins on one connection as fast as they are answered (a few in flight)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    frames = encode("standby", {**fields, "rid": 1})
    sent = got = 0
    try:
        while got < count:
            while sent < count and sent - got < 8:
                sock.send_multipart(frames)
                sent += 1
            if not sock.poll(10_000):
                return
            if decode(sock.recv_multipart()).fields.get("code") == "bad_standby":
                answered[0] += 1
            got += 1
    finally:
        sock.close(0)


def test_a_keyless_join_without_the_secret_changes_nothing_and_a_flood_of_them_costs_a_push_nothing(start_ps,
                                                                                                  fault_report):
    primary = start_ps("asgd")
    wait_for(lambda: _answers(primary), 30, "the primary to answer")
    path = secret_path(primary)  # its user's alone: a file 0600 in a folder 0700
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700 and path.stat().st_uid == os.getuid()
    secret = read_secret(primary)
    dead = f"tcp://127.0.0.1:{free_port()}"
    join = {"step": "join", "address": dead, "link_address": dead, "link": "b" * 32}
    forged = {
        "no proof": join,
        "another secret": prove(os.urandom(32), "join", join),
        "a signed field changed": {**prove(secret, "join", join), "link_address": f"tcp://127.0.0.1:{free_port()}"},
        "stale": prove(secret, "join", join, issued=time.time() - 2 * PROOF_WINDOW_S),
        "options without proof": {"step": "config"},
        "the secret itself as proof": {**join, "issued": time.time(), "proof": secret.hex()},
    }
    with joined_workers(primary, "asgd", request_timeout=30) as workers:
        worker = workers[0]
        before, _ = _state(primary)
        for why, fields in forged.items():
            assert ask(primary, "standby", fields)[0] == "bad_standby", why
        assert _state(primary)[0] == before
        alone = [_timed_push(worker, i) for i in range(40)]
        answered = [0]
        flood = threading.Thread(target=_flood_joins, args=(primary, join, FLOOD_JOINS, answered))
        flood.start()
        during = []
        while flood.is_alive():
            during.append(_timed_push(worker, len(alone) + len(during)))
        flood.join(60)
        after, counters = _state(primary)
        pushed = len(alone) + len(during)
        # every join refused; each refusal answered, or dropped and counted where the flood's connection had a full
        # queue (ps/limits.py's REPLY_HWM: while the PS is busy, libzmq sees the flood's reads late), as a PS drops
        # replies to any connection that does not keep up
        dropped = sum(counters["replies_dropped"].values())
        assert answered[0] + dropped == FLOOD_JOINS and counters["refused"]["bad_standby"] == FLOOD_JOINS + len(forged)
        assert after == {**before, "version": before["version"] + pushed}  # the pushes alone changed anything
        assert worker.pull().tensors["w"].tolist() == [float(pushed)] * 4
        assert len(during) >= 5 and max(during) < SLOWEST_PUSH_S, (len(during), max(during))
        # the real standby proves the secret, and joins
        standby = start_ps("asgd", standby_of=primary)
        wait_for(lambda: stats(primary)["standby"] == standby, 30, "the real standby to join")
        assert worker.push(pushed, {"w": np.ones(4, np.float32)}).version == pushed + 1
        assert stats(standby)["version"] == pushed + 1
    start_ps.stop(standby)
    start_ps.stop(primary)
    assert not path.exists()  # its secret goes with it
    fault_report(fault=f"{FLOOD_JOINS} joins without the keyless PS's secret, while a worker pushes",
                 injected=FLOOD_JOINS + len(forged), handled=FLOOD_JOINS + len(forged), pushes_lost=0,
                 recovery_s=None,
                 detail=f"each refused (bad_standby) and nothing changed; {len(during)} pushes meanwhile, median "
                        f"{statistics.median(during) * 1000:.1f} ms (alone {statistics.median(alone) * 1000:.1f} ms), "
                        f"slowest {max(during) * 1000:.1f} ms; then the real standby joined")


def _timed_push(worker: PSClient, seq: int) -> float:
    start = time.monotonic()
    reply = worker.push(seq, {"w": np.ones(4, np.float32)})
    spent = time.monotonic() - start
    assert reply.status == "applied" and reply.version == seq + 1, reply
    return spent


def test_a_flood_of_large_garbage_at_the_standby_neither_drops_it_nor_loses_a_push(procs, start_ps, tmp_path,
                                                                                  fault_report):
    # failover_timeout 2: the primary waits 1 s at most for an acknowledgement, as where the issue's flood had it
    # drop its standby; 2 workers push PUSHES times each, rank r adding r + 1, through the flood and the failover
    primary, standby = start_pair(start_ps, failover_timeout=2.0)
    logs = [tmp_path / "w0.log", tmp_path / "w1.log"]
    workers = [start_worker(procs, primary, r, logs[r], mode="asgd", pushes=PUSHES, delta=r + 1.0) for r in (0, 1)]
    wait_for(lambda: all(len(pushes(log)) >= 15 for log in logs), 60, "15 pushes of each worker")
    record_socket = stats(standby)["record_socket"]
    count, tensors = GARBAGE
    garbage = encode("replicate", {"kind": "push", "rid": 1, "rank": 0},
                     {f"t{i}": np.zeros(0, np.float32) for i in range(tensors)})  # no link token
    # one message on each of `count` connections to the standby's workers' socket (fair queuing served each before
    # the primary's next record: that dropped the standby), and as many at its record socket, as a stranger (no
    # credentials) and as one that guesses the token
    ctx = zmq.Context.instance()
    at_standby = [ctx.socket(zmq.DEALER) for _ in range(count)]
    at_link, at_link_plain = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    at_link_plain.plain_username, at_link_plain.plain_password = b"primary", b"0" * 32
    for sock in (*at_standby, at_link, at_link_plain):
        sock.setsockopt(zmq.LINGER, 0)
        # a socket refused in the handshake may have nowhere to queue a message: it is not waited for
        sock.setsockopt(zmq.SNDTIMEO, 0 if sock in (at_link, at_link_plain) else 10_000)
        sock.connect(record_socket if sock in (at_link, at_link_plain) else standby)
    time.sleep(0.5)  # connected, so that the messages arrive together
    started, queued = time.time(), 0
    for i in range(count):
        for sock in (at_standby[i], at_link, at_link_plain):
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(garbage)
                queued += 1
    # the standby's other socket refuses each without decoding it; on its record socket none is even read
    refused, deadline = [], time.monotonic() + 120
    for sock in at_standby:
        if sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            refused.append(decode(sock.recv_multipart()).fields.get("code"))
    assert refused == ["standby"] * count, (refused, stats(standby)["refused"])
    assert queued >= count  # every one to the standby's workers' socket, and what its record socket let queue
    assert not at_link.poll(500) and not at_link_plain.poll(500)
    flooded_for = time.time() - started
    for sock in (*at_standby, at_link, at_link_plain):
        sock.close(0)
    during = stats(primary)
    assert during["standby"] == standby and during["standbys_detached"] == 0, during["standby_lost_reason"]
    acknowledged = [len([p for p in pushes(log) if started < p["t"] < started + flooded_for]) for log in logs]
    assert min(acknowledged) > 0, acknowledged  # the primary answered on while the standby was flooded
    now = [len(pushes(log)) for log in logs]
    wait_for(lambda: all(len(pushes(log)) >= n + 10 for log, n in zip(logs, now, strict=True)), 60, "10 more pushes")
    assert max(len(pushes(log)) for log in logs) < PUSHES - 20, "too few pushes left to fail over with"
    signal_ps(start_ps, primary, signal.SIGKILL)  # the standby, still attached, takes over
    start_ps.started.pop(primary).wait(10)
    for w in workers:
        finish(w, timeout=120)
    new = stats(standby)
    assert new["role"] == "primary" and new["epoch"] == 2 and new["pushes_by_rank"] == {"0": PUSHES, "1": PUSHES}
    final = max((r for log in logs for r in read_log(log) if r["event"] == "done"), key=lambda r: r["version"])
    assert final["version"] == 2 * PUSHES and final["w"] == [PUSHES * 1.0 + PUSHES * 2.0] * 4  # each push, once
    fault_report(fault=f"{count} messages of {tensors} empty tensors, without the link's token, at the standby's "
                       f"workers' socket ({count} connections) and its record socket (a stranger, a guessed token)",
                 injected=queued, handled=queued,
                 pushes_lost=0, recovery_s=None,
                 detail=f"over {flooded_for:.1f} s the standby stayed attached (failover_timeout 2 s; "
                        f"{sum(acknowledged)} pushes acknowledged meanwhile); its record socket read none; the primary "
                        f"SIGKILLed after, the standby led with {2 * PUSHES} of {2 * PUSHES} pushes")
