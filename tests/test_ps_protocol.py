"""A real PS process on loopback, driven over real ZeroMQ sockets."""

from __future__ import annotations

import itertools
import re
import threading
import time

import numpy as np
import pytest
import zmq

from plug_asgd.protocol.wire import PROTOCOL_VERSION, Sparse, decode, encode
from plug_asgd.ps import ParameterServer, PSConfig
from plug_asgd.worker.client import PSClient, PSError
from plug_asgd.worker.errors import REPLY_KINDS

BEAT = 0.25  # heartbeat of the clients in the liveness tests, whose PSes time out after 1 s
# A worker lost after 1 s of silence releases what waits for it no sooner than about 1 s (the PS checks
# liveness every few tenths) and, on a loaded machine, some seconds later: the bound is only that it comes
# well before the clients' 10 s request timeout, which is what a PS that never released would run into.
# The exact rule (silent > worker_timeout, heartbeats keep an idle worker) is tested on an injected clock
# in test_liveness_clock.py.
RELEASED_WITHIN_S = (0.7, 8.0)


_opened: list[PSClient] = []  # every client a test made, closed after it: none is left to the collector


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _opened:
        _opened.pop().close()


def client(address: str, rank: int = 0, world: int = 1, mode: str = "asgd", training: bool = True,
           heartbeat_s: float | None = None) -> PSClient:
    c = PSClient(address, rank=rank, world_size=world, mode=mode, request_timeout=10, heartbeat_s=heartbeat_s)
    _opened.append(c)
    c.hello(stage=1, training=training, timeout=20)
    return c


W0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.float32)}


def test_asgd_push_is_folded_in_and_answered_with_the_central_model(start_ps):
    c = client(start_ps())
    assert c.init(W0) is True
    assert c.init({"w": np.ones((2, 3), np.float32)}) is False  # the first worker's model wins
    delta = {"w": np.full((2, 3), 0.5, np.float32), "b": Sparse(np.array([1]), np.array([2.0], np.float32), (2,))}
    reply = c.push(0, delta)
    assert reply.version == 1 and reply.status == "applied" and not reply.stop
    np.testing.assert_array_equal(reply.tensors["w"], W0["w"] + 0.5)
    np.testing.assert_array_equal(reply.tensors["b"], [0, 2])
    assert c.counters.push_bytes_up > 6 * 4  # counted on the wire: header + frames
    c.close()


def test_a_compressed_push_is_decoded_into_the_central_dtype_before_the_fold(start_ps):
    from plug_asgd.compressors import QSGD, decode

    c = client(start_ps())
    c.init(W0)
    payload = QSGD(bits=3, seed=1).encode("w", np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    reply = c.push(0, {"w": payload, "b": np.array([1, 2], np.float16)})
    np.testing.assert_array_equal(reply.tensors["w"], W0["w"] + decode(payload, np.float32))
    np.testing.assert_array_equal(reply.tensors["b"], [1, 2])
    assert reply.tensors["w"].dtype == np.float32
    c.close()


def test_malformed_messages_get_error_replies_and_the_model_is_untouched(start_ps):
    address = start_ps()
    good = client(address, 0, 2)
    good.init(W0)
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)

    def ask(frames):
        raw.send_multipart(frames)
        assert raw.poll(10_000), "the PS did not answer"
        return decode(raw.recv_multipart())

    assert ask(encode("hello", {"rid": 1, "rank": 1, "world_size": 2, "stage": 1, "session": "x",
                                "mode": "asgd"})).type == "welcome"  # the PS checks what rank 1 sends

    bad_version = encode("pull", {"rid": 1})
    bad_version[0] = bad_version[0].replace(bytes([0xA1, 0x76, PROTOCOL_VERSION]), bytes([0xA1, 0x76, 99]))
    cases = {
        "bad_header": [b"\x93\x01\x02"],
        "bad_version": bad_version,
        "unknown_type": encode("steal", {"rid": 1}),
        "frame_count": encode("push", {"rid": 1}, {"w": np.zeros(6, np.float32)})[:1],
        "bad_tensor": encode("push", {"rid": 1, "rank": 1, "base_version": 0, "seq": 1, "session": "x"},
                             {"w": np.zeros(5, np.float32)}),
        "unknown_tensor": encode("push", {"rid": 1, "rank": 1, "base_version": 0, "seq": 2, "session": "x"},
                                 {"nope": np.zeros(5, np.float32)}),
        "not_finite": encode("push", {"rid": 1, "rank": 1, "base_version": 0, "seq": 3, "session": "x"},
                             {"w": np.full((2, 3), np.nan, np.float32)}),
        "bad_field": encode("push", {"rid": 1, "rank": 1, "base_version": "zero", "seq": 4, "session": "x"},
                            {"w": np.zeros((2, 3), np.float32)}),
    }
    for code, frames in cases.items():
        reply = ask(frames)
        assert reply.type == "error" and reply.fields["code"] == code, (code, reply.fields)
    for seq, model in enumerate(["fragment", 1]):  # what a push's reply is to carry: a bool, unless_own or pushed
        reply = ask(encode("push", {"rid": 1, "rank": 1, "base_version": 0, "seq": 5 + seq, "session": "x",
                                    "model": model}, {"w": np.zeros((2, 3), np.float32)}))
        assert reply.type == "error" and reply.fields["code"] == "bad_field" and "'model'" in reply.fields["message"]
    np.testing.assert_array_equal(good.pull().tensors["w"], W0["w"])
    assert good.pull().version == 0
    refused = good.stats()["refused"]
    assert sum(refused.values()) == len(cases) + 2
    raw.close()
    good.close()


def test_a_replayed_push_is_applied_once(start_ps):
    c = client(start_ps())
    c.init(W0)
    fields = {"rank": 0, "base_version": 0, "seq": 7, "session": c.session}
    c.request("push", fields, {"w": np.ones((2, 3), np.float32)})
    with pytest.raises(PSError) as err:
        c.request("push", fields, {"w": np.ones((2, 3), np.float32)})
    assert err.value.code == "duplicate"
    np.testing.assert_array_equal(c.pull().tensors["w"], W0["w"] + 1)


def test_the_client_counts_each_reply_by_what_it_carried(start_ps):
    """CommCounters.replies: one kind a reply, so that a count of models received that does not add up names the
    reply (the communication monitor records them). Here every kind of an asgd PS without a downlink fraction; a
    delta of some tensors and an approximate reply are counted in test_delta_replies.py."""
    address = start_ps()
    a, b = client(address, 0, 2), client(address, 1, 2)
    try:
        one = {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}
        a.init(W0)
        assert a.pull().version == 0  # a holds version 0 (its init): nothing changed since, a delta of nothing
        b.pull()  # b holds no model: the whole one
        assert a.push(0, one, want_model="unless_own").own  # version 1, nothing raced it: no model
        b.push(0, one, want_model=False)  # version 2, no model asked for
        assert a.push(1, one, want_model="unless_own", weights=True).status == "not_current"  # raced: nothing folded
        assert a.push(1, one).tensors.keys() == one.keys()  # version 3: the whole model (a holds version 0)
        a._seq = itertools.count(3)  # the last push's number again, as its resend around a reconnection
        reply = a.push(1, one)
        assert reply.status == "duplicate" and reply.version == 3  # not folded again: the model pulled instead
        kinds = dict.fromkeys(REPLY_KINDS, 0)
        assert a.counters.replies == {**kinds, "pulled_delta": 2, "own": 1, "not_current": 1, "whole": 1,
                                      "duplicate": 1}
        assert b.counters.replies == {**kinds, "pulled": 1, "no_model": 1}
        # every push counted is answered by one of own, whole, delta, approx, no_model and duplicate
        assert a.counters.pushes == 3 and b.counters.pushes == 1
        assert a.counters.as_dict()["replies"] == a.counters.replies  # as comm_stats() and the monitor have them
    finally:
        a.close()
        b.close()


def test_wrong_mode_is_refused_with_a_clear_message(start_ps):
    address = start_ps("sync")
    c = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=20)
    with pytest.raises(PSError, match="runs mode 'sync'"):
        c.hello(stage=1, training=True)
    c.close()


def test_a_worker_whose_mode_sets_other_knobs_than_the_ps_folds_with_is_refused_saying_which(start_ps):
    """A PS started without ``--outer`` folds async_diloco's pushes with Nesterov (lr 0.7, momentum 0.9): a worker
    whose mode sets SGD is refused, told the flag to give; the same for an ssp worker that sets a bound other than
    the PS's ``--staleness-bound``. A worker whose mode leaves the knob at its default joins: the PS's flag decides
    (``serve-ps --staleness-bound 3`` serves ``mode="ssp"``), as does one that sends none (an earlier client)."""
    from plug_asgd import SSP, AsyncDiLoCo
    from plug_asgd.modes import chosen_knobs, server_knobs

    sgd = {"name": "sgd", "lr": 1.0, "momentum": 0.0}
    diloco_ps, ssp_ps = start_ps("async_diloco"), start_ps("ssp", staleness_bound=3)
    cases = [(diloco_ps, "async_diloco", AsyncDiLoCo(outer=sgd), "--outer '{\"beta1\""),
             (ssp_ps, "ssp", SSP(staleness_bound=5), "with staleness_bound=3 but the worker's mode has "
                                                     "staleness_bound=5: start the PS with --staleness-bound '5' or "
                                                     "give the mode staleness_bound=3")]
    for address, name, mode, says in cases:
        refused = PSClient(address, rank=0, world_size=1, mode=name, request_timeout=20,
                           mode_options=chosen_knobs(mode))
        with pytest.raises(PSError, match=re.escape(says)) as exc:
            refused.hello(stage=1, training=True)
        assert exc.value.code == "options_mismatch"
        refused.close()
    assert server_knobs(AsyncDiLoCo(outer={"name": "sgd", "lr": 1, "momentum": 0})) == server_knobs(
        "async_diloco", {"outer": '{"name": "sgd", "lr": 1.0, "momentum": 0.0}'})  # the same optimizer, one JSON
    assert chosen_knobs(AsyncDiLoCo(inner_steps=7)) == chosen_knobs(SSP()) == {}  # nothing set away from defaults
    joined = [PSClient(diloco_ps, rank=0, world_size=2, mode="async_diloco", request_timeout=20,
                       mode_options=chosen_knobs(AsyncDiLoCo(inner_steps=7))),  # inner_steps: the worker's own
              PSClient(diloco_ps, rank=1, world_size=2, mode="async_diloco", request_timeout=20),
              PSClient(ssp_ps, rank=0, world_size=2, mode="ssp", request_timeout=20,
                       mode_options=chosen_knobs(SSP(staleness_bound=3))),
              PSClient(ssp_ps, rank=1, world_size=2, mode="ssp", request_timeout=20, mode_options=chosen_knobs(SSP()))]
    try:
        for c in joined:
            assert "version" in c.hello(stage=1, training=True)
    finally:
        for c in joined:
            c.close()


def test_sync_workers_wait_for_the_round_then_get_the_average(start_ps):
    address = start_ps("sync")
    a, b = client(address, 0, 2, "sync"), client(address, 1, 2, "sync")
    a.init(W0)
    replies = {}
    t = threading.Thread(target=lambda: replies.setdefault("a", a.push(0, {"w": np.full((2, 3), 2, np.float32)})))
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "a sync push was answered before its round was complete"
    replies["b"] = b.push(0, {"w": np.full((2, 3), 4, np.float32)})
    t.join(10)
    for r in replies.values():
        assert r.version == 1 and r.status == "applied"
        np.testing.assert_array_equal(r.tensors["w"], W0["w"] + 3)
    stale = a.push(0, {"w": np.full((2, 3), 100, np.float32)})  # based on version 0, now 1
    assert stale.status == "dropped" and stale.version == 1
    np.testing.assert_array_equal(stale.tensors["w"], W0["w"] + 3)
    a.close()
    b.close()


def test_an_ssp_worker_ahead_of_the_bound_blocks_until_the_slow_one_pushes(start_ps):
    address = start_ps("ssp", staleness_bound=1)
    fast, slow = client(address, 0, 2, "ssp"), client(address, 1, 2, "ssp")
    fast.init(W0)
    one = {"w": np.ones((2, 3), np.float32)}
    assert fast.push(0, one).version == 1  # 1 ahead of the slow worker: allowed
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fast.push(1, one)))
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "a worker 2 pushes ahead with staleness_bound=1 was not held"
    slow.push(0, one)
    t.join(10)
    assert not t.is_alive() and out["r"].status == "applied"
    np.testing.assert_array_equal(out["r"].tensors["w"], W0["w"] + 3)
    fast.close()
    slow.close()


def test_an_ssp_worker_held_for_a_slow_one_is_released_when_the_slow_one_is_lost(start_ps):
    address = start_ps("ssp", staleness_bound=0, worker_timeout=1)
    # the rank that waits announces no heartbeat, so that its own thread's timing cannot get it declared lost
    fast, slow = client(address, 0, 2, "ssp"), client(address, 1, 2, "ssp", heartbeat_s=BEAT)
    fast.init(W0)
    slow.close()  # dies before its first push: its heartbeats stop
    start = time.monotonic()
    reply = fast.push(0, {"w": np.ones((2, 3), np.float32)})  # 1 ahead with bound 0: held until then
    assert reply.status == "applied" and RELEASED_WITHIN_S[0] <= time.monotonic() - start <= RELEASED_WITHIN_S[1]
    assert fast.stats()["lost"] == [1]
    fast.close()


def test_collectives_complete_when_every_rank_present_contributes(start_ps):
    address = start_ps()
    a, b = client(address, 0, 2), client(address, 1, 2)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("a", a.gather(1, 0, "hello", {"x": np.array([1.0])})))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()
    out["b"] = b.gather(1, 0, None, {"x": np.array([2.0])})
    t.join(10)
    for res in out.values():
        assert [(r, o) for r, o, _ in res] == [(0, "hello"), (1, None)]
        assert [float(ts["x"][0]) for _, _, ts in res] == [1.0, 2.0]
    # rank 1 leaves: rank 0's next collective completes alone instead of hanging
    b.bye(1)
    assert [r for r, _, _ in a.gather(1, 1)] == [0]
    a.close()
    b.close()


def test_a_lost_worker_is_not_waited_for_and_its_restart_gets_what_it_missed(start_ps):
    address = start_ps("asgd", worker_timeout=1)

    def member(rank: int) -> PSClient:
        return client(address, rank, 2, heartbeat_s=BEAT)

    # rank 0, which waits, announces no heartbeat: nothing in this process's timing can get it declared lost
    a, b = client(address, 0, 2), member(1)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("a", a.gather(1, 0, "log_dir", kind="broadcast")))
    t.start()
    b.gather(1, 0, None, kind="broadcast")
    t.join(10)
    assert a.stats()["lost"] == []  # that heartbeats keep an idle rank a member: test_liveness_clock.py
    b.close()  # gone without a bye: its heartbeats stop, as when its process dies
    start = time.monotonic()
    assert [r for r, _, _ in a.gather(1, 1, kind="barrier:x")] == [0]  # not waited for past the timeout
    assert RELEASED_WITHIN_S[0] <= time.monotonic() - start <= RELEASED_WITHIN_S[1]
    assert a.stats()["lost"] == [1]
    c = member(1)  # restarted: a new session for rank 1, in a stage the others are well into
    assert a.stats()["lost"] == []
    # it replays the stage's collectives: those held without it are answered from the record ...
    assert [(r, o) for r, o, _ in c.gather(1, 0, None, kind="broadcast")] == [(0, "log_dir"), (1, None)]
    # ... and the rest are its own, while rank 0's go on without waiting for it
    assert [r for r, _, _ in c.gather(1, 7, kind="barrier:y")] == [1]
    start = time.monotonic()
    assert [r for r, _, _ in a.gather(1, 2, kind="barrier:z")] == [0]
    # waiting for the restarted rank 1 (alive: forever) would end in the 10 s request timeout
    assert time.monotonic() - start < RELEASED_WITHIN_S[1]
    a.close()
    c.close()


def test_a_rank_in_a_later_stage_has_left_the_earlier_ones(start_ps):
    address = start_ps()
    a, b = client(address, 0, 2), client(address, 1, 2)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("a", a.gather(1, 3, kind="barrier:")))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()
    b.hello(stage=2, training=False)  # e.g. what a PS restarted mid-run hears from a rank already testing
    t.join(10)
    assert [r for r, _, _ in out["a"]] == [0]
    a.close()
    b.close()


def test_ranks_that_disagree_on_a_collective_get_an_error_not_a_wrong_pairing(start_ps):
    address = start_ps()
    a, b = client(address, 0, 2), client(address, 1, 2)
    errors = {}

    def call(c, kind, key):
        try:
            c.gather(1, 0, kind=kind)
        except PSError as exc:
            errors[key] = exc

    t = threading.Thread(target=call, args=(a, "broadcast", "a"))
    t.start()
    time.sleep(0.3)
    call(b, "barrier:plug_asgd.fit_end", "b")
    t.join(10)
    assert {e.code for e in errors.values()} == {"collective_mismatch"} and len(errors) == 2
    assert "rank 1 called barrier:plug_asgd.fit_end where rank 0 called broadcast" in str(errors["b"])
    # two barriers of different names are the same collective (names are labels, as in DDP)
    t = threading.Thread(target=lambda: a.gather(1, 1, kind="barrier:x"))
    t.start()
    b.gather(1, 1, kind="barrier:y")
    t.join(10)
    a.close()
    b.close()


def test_max_updates_tells_workers_to_stop_and_freezes_the_model(start_ps):
    c = client(start_ps("asgd", max_updates=2))
    c.init(W0)
    assert not c.push(0, {"w": np.ones((2, 3), np.float32)}).stop
    r = c.push(1, {"w": np.ones((2, 3), np.float32)})
    assert r.stop and r.version == 2
    r = c.push(2, {"w": np.ones((2, 3), np.float32)})
    assert r.stop and r.status == "stopped" and r.version == 2
    np.testing.assert_array_equal(r.tensors["w"], W0["w"] + 2)


@pytest.mark.integration
def test_the_ps_answers_with_the_frames_a_push_came_in_and_copies_them_before_any_write_in_place():
    """The asgd PS folds a dense push into its own received buffers and resends those frames; a
    later fold that writes in place (a sparse update) must first copy them, since a frame already
    resent cannot be tracked. The PS runs in a thread here so the test can hold its frames."""
    server = ParameterServer(PSConfig(bind="tcp://127.0.0.1:*"))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    thread.start()
    c = client(server.address)
    try:
        c.init(W0)
        delta = {"w": np.full((2, 3), 0.5, np.float32), "b": np.ones(2, np.float32)}
        reply = c.push(0, delta)
        np.testing.assert_array_equal(reply.tensors["w"], W0["w"] + 0.5)
        frames = server.store.resent_frames()
        assert set(frames) == {"w", "b"} and server.stats.copies_on_write == 0
        resent = {n: f.bytes for n, f in frames.items()}
        assert resent["w"] == (W0["w"] + 0.5).astype("<f4").tobytes()
        reply = c.push(1, {"w": Sparse(np.array([4]), np.array([2.0], np.float32), (2, 3))})
        np.testing.assert_array_equal(reply.tensors["w"].reshape(-1), (W0["w"] + 0.5).reshape(-1) + [0, 0, 0, 0, 2, 0])
        assert server.stats.copies_on_write == 1 and server.store.resent_frames() == {}
        assert {n: f.bytes for n, f in frames.items()} == resent  # what was resent was never written
        np.testing.assert_array_equal(c.pull().tensors["b"], W0["b"] + 1)
    finally:
        c.close()
        server.request_stop()
        thread.join(10)


@pytest.mark.integration
def test_a_stop_request_wakes_the_serving_loop_from_its_poll():
    """A signal handler's request_stop ends serve_forever while its poll sleeps: with a poll of 10 minutes here,
    only the wake can end it within the join's 10 s (it took up to 200 ms, the default poll, before)."""
    server = ParameterServer(PSConfig(bind="tcp://127.0.0.1:*"))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 600_000}, daemon=True)
    thread.start()
    c = client(server.address)
    try:
        c.init(W0)  # the loop has polled and served: it is in its next poll now
    finally:
        c.close()
    server.request_stop()
    thread.join(10)
    assert not thread.is_alive()
    server.request_stop()  # once stopped (its pipe closed), a second signal is harmless


@pytest.mark.integration
def test_the_ps_counts_the_time_it_spends_handling_requests_and_pushes():
    """``busy_s`` / ``push_busy_s``: each push here takes at least the 50 ms its fold is made to
    sleep, and nothing is counted that the client did not wait for; their CPU time does not hold
    the sleeps. The PS runs in a thread so that its rule can be slowed."""
    server = ParameterServer(PSConfig(bind="tcp://127.0.0.1:*"))
    fold = server.store.rule.push

    def slow_fold(state, push):
        time.sleep(0.05)
        return fold(state, push)

    server.store.rule.push = slow_fold
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    thread.start()
    began = time.monotonic()
    c = client(server.address)
    try:
        c.init(W0)
        for version in range(3):
            c.push(version, {"w": np.ones((2, 3), np.float32)})
        with pytest.raises(PSError, match="unknown_tensor|has no tensor"):  # refused before any fold
            c.push(3, {"nope": np.ones(2, np.float32)})
        c.pull()
        stats = c.stats()
        waited = time.monotonic() - began
        assert stats["push_messages"] == 4
        assert 3 * 0.05 <= stats["push_busy_s"] < stats["busy_s"] <= waited  # init and pull count too
        # a sleep takes no time on a core: the CPU time stays well below the wall time
        assert 0 < stats["push_busy_cpu_s"] < stats["push_busy_s"] - 3 * 0.05 + 0.01
        assert stats["push_busy_cpu_s"] < stats["busy_cpu_s"] <= stats["busy_s"]
        assert stats["busy_fraction"] == pytest.approx(stats["busy_s"] / stats["uptime_s"], abs=0.01)
    finally:
        c.close()
        server.request_stop()
        thread.join(10)


@pytest.mark.parametrize("mode", ["asgd", "dynsgd"])
def test_a_push_nothing_else_raced_is_answered_without_the_model_which_the_worker_then_has_bit_for_bit(
        start_ps, mode):
    address = start_ps(mode)
    a, b = client(address, 0, 2, mode), client(address, 1, 2, mode)
    try:
        rng = np.random.default_rng(5)
        w0 = {"w": rng.standard_normal((2, 3)).astype(np.float32), "b": rng.standard_normal(2).astype(np.float32)}
        a.init(w0)
        delta = {n: (rng.standard_normal(t.shape) * 1e-3).astype(np.float32) for n, t in w0.items()}
        down = a.counters.bytes_down
        reply = a.push(0, delta, want_model="unless_own")
        assert reply.own and reply.tensors == {} and reply.version == 1
        assert a.counters.bytes_down - down < 200  # a header, no model
        mine = {n: w0[n] + delta[n] for n in w0}  # what the worker computes: float32 + float32, as the PS did
        central = a.pull().tensors
        for n in w0:
            np.testing.assert_array_equal(central[n].view(np.uint32), mine[n].view(np.uint32))
        b.push(1, delta)  # version 2: a's next push, based on 1, is raced
        reply = a.push(1, delta, want_model="unless_own")
        assert not reply.own and set(reply.tensors) == {"w", "b"}
        # an encoded update too, where the worker can decode it as the PS does (a sparse update, an update in
        # another dtype than the central one): the model is what it held plus that, bit for bit
        for version, update in ((3, {"w": Sparse(np.array([0]), np.array([1.0], np.float32), (2, 3))}),
                                (4, {"b": np.ones(2, np.float16)})):
            before = {n: np.array(t) for n, t in a.pull().tensors.items()}
            reply = a.push(version, update, want_model="unless_own")
            assert reply.own and reply.tensors == {} and reply.version == version + 1
            after = a.pull().tensors
            if "w" in update:
                before["w"].reshape(-1)[0] += np.float32(1.0)
            else:
                before["b"] += np.ones(2, np.float16).astype(np.float32)
            for n in before:
                np.testing.assert_array_equal(after[n].view(np.uint32), before[n].view(np.uint32))
        assert a.stats()["own_replies"] == 3
        with pytest.raises(ValueError, match="unless_own"):
            a.push(5, delta, want_model="yes")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode", ["asgd", "dynsgd", "ssp"])
def test_weights_of_a_lone_worker_become_the_model_bit_for_bit_and_raced_weights_fold_nothing(start_ps, mode):
    address = start_ps(mode)
    a, b = client(address, 0, 2, mode), client(address, 1, 2, mode)
    try:
        w0 = {"w": np.ones((2, 3), np.float32), "b": np.full(2, 3.0, np.float32)}
        a.init(w0)
        # 1e-8 - 1 rounds to -1 in float32, so folding the delta would give 0: the PS keeps the weights as sent
        w1 = {"w": np.full((2, 3), 1e-8, np.float32), "b": np.full(2, 2.5, np.float32)}
        assert (w0["w"] + (w1["w"] - w0["w"]) == 0).all()
        # lent over the socket: the bytes that came are the PS's own already, there is nothing to lend
        reply = a.push(0, w1, want_model="unless_own", weights=True, lend=True)
        assert (reply.status, reply.own, reply.version, reply.tensors) == ("applied", True, 1, {})
        for n, t in a.pull().tensors.items():
            np.testing.assert_array_equal(t.view(np.uint32), w1[n].view(np.uint32))
        b.push(1, {"w": np.ones((2, 3), np.float32)})  # version 2: a's weights based on 1 would undo it
        reply = a.push(1, w0, want_model="unless_own", weights=True)
        assert (reply.status, reply.own, reply.version, reply.tensors) == ("not_current", False, 2, {})
        np.testing.assert_array_equal(a.pull().tensors["w"], w1["w"] + 1)
        # weights in another dtype than the central one are not the PS's bits: not taken either
        reply = a.push(2, {"b": np.ones(2, np.float16)}, want_model="unless_own", weights=True)
        assert reply.status == "not_current" and reply.version == 2
        with pytest.raises(PSError) as err:  # a NaN is refused as in any push, and nothing changes
            a.push(2, {"w": np.full((2, 3), np.nan, np.float32)}, want_model="unless_own", weights=True)
        assert err.value.code == "not_finite"
        stats = a.stats()
        assert stats["version"] == 2 and stats["weights_pushes"] == 1 and stats["weights_not_current"] == 2
        assert stats["weights_lent"] == stats["lent_copies"] == 0
        # the worker's count: what the PS folded or refused as bad (the NaN), not what it left to a delta push
        assert a.counters.pushes == 2 and a.counters.weights_not_current == 2
        with pytest.raises(PSError) as err:  # the flag is true or false, nothing else
            a.request("push", {"rank": 0, "base_version": 2, "seq": 99, "session": a.session, "weights": "yes"},
                      {"b": np.zeros(2, np.float32)})
        assert err.value.code == "bad_field" and a.stats()["version"] == 2
        with pytest.raises(PSError) as err:
            a.request("push", {"rank": 0, "base_version": 2, "seq": 100, "session": a.session, "weights": True,
                               "lend": 1}, {"b": np.zeros(2, np.float32)})
        assert err.value.code == "bad_field" and "'lend'" in str(err.value) and a.stats()["version"] == 2
        np.testing.assert_array_equal(a.pull().tensors["w"], w1["w"] + 1)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode", ["asgd", "ssp", "downpour", "adacomp", "dynsgd"])
def test_a_push_scaled_for_a_staleness_lands_scaled_for_the_larger_of_that_and_its_own(start_ps, mode):
    # A worker that scaled its update by 1/(1 + e) for an estimated staleness e says so (scaled_for); the PS
    # multiplies it by (1 + e) / (1 + max(e, s)), s the staleness it lands with: 1/(1 + max(e, s)) in all.
    # dynsgd's PS scales such a push no further (b's unscaled pushes below land fresh: its 1/(1 + 0) is 1).
    address = start_ps(mode)
    a, b = client(address, 0, 2, mode), client(address, 1, 2, mode)
    try:
        a.init({"w": np.zeros(4, np.float32)})
        one = {"w": np.ones(4, np.float32)}
        # by hand: base 0, nothing raced (s = 0), scaled for 1 by a: never scaled back up, (1 + 1) / (1 + 1) = 1
        assert a.push(0, {"w": np.full(4, 0.5, np.float32)}, scaled_for=1).tensors["w"].tolist() == [0.5] * 4
        b.push(1, one)  # unscaled: 1.5, version 2
        b.push(2, one)  # 2.5, version 3
        # based on 1, it lands with s = 2 (versions 2 and 3 since), scaled for 0 by a: times 1 / (1 + 2), so 2.5 + 1
        reply = a.push(1, {"w": np.full(4, 3.0, np.float32)}, scaled_for=0)
        expected = 3.5 if mode != "adacomp" else 3.0  # adacomp's own scale on top: 1 / max(1, 2 updates touched i)
        assert reply.version == 4
        np.testing.assert_allclose(reply.tensors["w"], np.full(4, expected), rtol=1e-6)
        b.push(4, one)  # expected + 1, version 5
        # based on 4, it lands with s = 1, as a estimated: (1 + 1) / (1 + 1) = 1, folded as sent (adacomp: / max(1, 1))
        reply = a.push(4, {"w": np.full(4, 2.0, np.float32)}, scaled_for=1)
        np.testing.assert_allclose(reply.tensors["w"], np.full(4, expected + 3), rtol=1e-6)
        version = reply.version
        for i, bad in enumerate((-1, float("nan"), float("inf"), "1", True)):  # a number from 0: nothing folded
            with pytest.raises(PSError) as err:
                a.request("push", {"rank": 0, "base_version": version, "seq": 1000 + i,
                                   "session": a.session, "scaled_for": bad}, one)
            assert err.value.code == "bad_field" and "scaled_for" in str(err.value)
        assert a.stats()["version"] == version == 6
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode", ["sync", "sagn"])
def test_a_ps_that_averages_rounds_refuses_a_scaled_push(start_ps, mode):
    c = client(start_ps(mode), mode=mode)
    try:
        c.init(W0)
        with pytest.raises(PSError) as err:
            c.push(0, {"w": np.ones((2, 3), np.float32)}, scaled_for=1)
        assert err.value.code == "bad_field" and "scaled_for" in str(err.value)
        np.testing.assert_array_equal(c.pull().tensors["w"], W0["w"])
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["sync", "adacomp"])
def test_a_ps_that_does_not_fold_deltas_as_sent_takes_no_weights(start_ps, mode):
    c = client(start_ps(mode), mode=mode)
    try:
        c.init(W0)
        reply = c.push(0, {"w": np.ones((2, 3), np.float32)}, want_model="unless_own", weights=True)
        assert reply.status == "not_current" and reply.version == 0
        np.testing.assert_array_equal(c.pull().tensors["w"], W0["w"])
    finally:
        c.close()


def test_a_ps_with_two_fold_threads_folds_large_tensors_exactly_and_refuses_a_nan_in_any_slice(start_ps):
    address = start_ps("asgd", threads=2)
    c = client(address)
    try:
        rng = np.random.default_rng(9)
        w0 = {"big": rng.standard_normal(300_000).astype(np.float32), "small": np.zeros(3, np.float32)}
        c.init(w0)
        delta = {"big": (rng.standard_normal(300_000) * 1e-3).astype(np.float32), "small": np.ones(3, np.float32)}
        reply = c.push(0, delta)
        for n in w0:  # split in two slices folded on two threads: the same bits as one numpy addition
            np.testing.assert_array_equal(reply.tensors[n].view(np.uint32), (w0[n] + delta[n]).view(np.uint32))
        bad = delta["big"].copy()
        bad[-1] = np.nan  # in the second thread's slice
        with pytest.raises(PSError) as err:
            c.push(1, {"big": bad})
        assert err.value.code == "not_finite"
        np.testing.assert_array_equal(c.pull().tensors["big"], reply.tensors["big"])
        assert c.stats()["version"] == 1
    finally:
        c.close()


def test_a_resumed_ps_never_answers_own_since_its_versions_may_name_other_models(start_ps, tmp_path):
    """Versions made after a resume reuse the numbers of versions lost in the crash: a worker's base
    of "version 2" may be another model than the resumed PS's version 2, so only whole models go back."""
    first = start_ps("asgd", checkpoint_dir=tmp_path, checkpoint_every_updates=1)
    c = client(first)
    c.init(W0)
    assert c.push(0, {"w": np.ones((2, 3), np.float32)}, want_model="unless_own").own
    c.close()
    start_ps.stop(first)
    second = start_ps("asgd", resume=tmp_path)
    c = client(second)
    try:
        reply = c.push(1, {"w": np.ones((2, 3), np.float32)}, want_model="unless_own")
        assert reply.version == 2 and not reply.own
        np.testing.assert_array_equal(reply.tensors["w"], W0["w"] + 2)
        # nor takes weights as its model: the worker's base may not be its model of that number
        reply = c.push(2, {"w": np.zeros((2, 3), np.float32)}, want_model="unless_own", weights=True)
        assert reply.status == "not_current" and reply.version == 2
    finally:
        c.close()


def test_work_done_while_a_push_is_folded_runs_once_before_the_reply_and_is_not_counted_as_waiting(start_ps):
    c = client(start_ps())
    try:
        c.init(W0)
        seen = []

        def work() -> None:
            seen.append(c.counters.requests)
            time.sleep(0.5)

        wait = c.counters.wait_seconds
        reply = c.push(0, {"w": np.ones((2, 3), np.float32)}, want_model="unless_own", while_waiting=work)
        assert reply.own and seen == [c.counters.requests]  # after the push was sent, once
        assert c.counters.wait_seconds - wait < 0.4
    finally:
        c.close()
