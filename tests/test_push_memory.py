"""Pushes through shared memory: real PS processes, real sockets, real sealed memfds."""

from __future__ import annotations

import fcntl
import os
import threading

import numpy as np
import pytest

from plug_asgd.protocol import push_memory
from plug_asgd.protocol.push_memory import HEADER_BYTES, PushSegment
from plug_asgd.protocol.wire import Local, Sparse
from plug_asgd.ps import ParameterServer, PSConfig, embedded_command
from plug_asgd.worker.client import PSClient, PSError

pytestmark = pytest.mark.skipif(not push_memory.available(), reason="no sealed shared memory here (memfd: Linux)")

SHAPES = {"w": (3, 5), "b": (5,)}


def client(address: str, rank: int = 0, world: int = 1, mode: str = "asgd") -> PSClient:
    c = PSClient(address, rank=rank, world_size=world, mode=mode, request_timeout=10, heartbeat_s=None)
    c.hello(stage=1, training=True, timeout=20)
    return c


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def buffers(c: PSClient) -> dict[str, np.ndarray]:
    out = c.push_buffers({n: (s, np.float32) for n, s in SHAPES.items()})
    assert out is not None
    return out


@pytest.mark.parametrize("mode", ["asgd", "dynsgd", "sync", "adacomp"])
def test_a_push_through_shared_memory_folds_the_bits_of_the_same_push_over_the_socket(start_ps, mode):
    """Two PSes get the same pushes, one as bytes, one through a segment: their models stay equal bit
    for bit, the segment's pushes carry a header and no tensor bytes, and what the worker writes
    into its buffers afterwards never reaches the central model (the PS keeps no view of them)."""
    over_socket, shared = client(start_ps(mode), mode=mode), client(start_ps(mode), mode=mode)
    try:
        w0 = model()
        over_socket.init(w0)
        shared.init(w0)
        mine = buffers(shared)
        rng = np.random.default_rng(1)
        version = 0
        for _ in range(4):
            for n, s in SHAPES.items():
                mine[n][...] = rng.standard_normal(s).astype(np.float32) * 1e-2
            sent = shared.counters.push_bytes_up
            a = over_socket.push(version, {n: mine[n].copy() for n in SHAPES})
            b = shared.push(version, mine)
            assert shared.counters.push_bytes_up - sent < 300  # the header only
            assert a.version == b.version
            for n in SHAPES:
                np.testing.assert_array_equal(b.tensors[n].view(np.uint32), a.tensors[n].view(np.uint32))
            version = b.version
        per_push = sum(4 * int(np.prod(s)) for s in SHAPES.values())
        assert shared.counters.push_local_bytes_up == 4 * per_push
        stats = shared.stats()
        assert stats["push_local_bytes_in"] == 4 * per_push and stats["shm_segments"] == 1
        assert over_socket.stats()["push_local_bytes_in"] == 0
        before = shared.pull().tensors
        for n in SHAPES:
            mine[n][...] = np.nan
        after = shared.pull().tensors
        for n in SHAPES:
            np.testing.assert_array_equal(after[n], before[n])
    finally:
        over_socket.close()
        shared.close()


def test_the_memory_cannot_shrink_under_the_ps_and_its_descriptor_closes_with_the_client(start_ps):
    """A worker that truncated its memory would make the PS fault on its next read: the seals forbid it.
    Nothing is named in a file system, and the descriptor goes with the client."""
    c = client(start_ps())
    try:
        c.init(model())
        mine = buffers(c)
        fd = c._segment.fd
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:plug_asgd_push")
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 30)
        mine["w"][...] = 1.0
        mine["b"][...] = 0.0
        reply = c.push(0, mine)
        np.testing.assert_array_equal(reply.tensors["w"], model()["w"] + np.float32(1.0))
    finally:
        c.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    mine["w"][...] = 2.0  # still mapped: the strategy's buffers outlive the descriptor


def test_weights_in_shared_memory_become_a_copy_of_the_ps_and_later_writes_never_reach_it(start_ps):
    c = client(start_ps())
    try:
        c.init(model())
        mine = buffers(c)
        for n, t in model(3).items():
            mine[n][...] = t
        sent = c.counters.push_bytes_up
        reply = c.push(0, mine, want_model="unless_own", weights=True)
        assert reply.own and reply.version == 1 and c.counters.push_bytes_up - sent < 300  # a header only
        for n in SHAPES:
            mine[n][...] = np.nan  # the worker's next weights, say: the PS keeps what it checked
        central = c.pull().tensors
        for n, t in model(3).items():
            np.testing.assert_array_equal(central[n].view(np.uint32), t.view(np.uint32))
        stats = c.stats()
        assert stats["weights_pushes"] == 1 and stats["push_local_bytes_in"] == sum(
            4 * int(np.prod(s)) for s in SHAPES.values())
        with pytest.raises(PSError) as err:
            c.push(1, mine, want_model="unless_own", weights=True)
        assert err.value.code == "not_finite" and c.pull().version == 1
    finally:
        c.close()


def test_a_nan_in_shared_memory_is_refused_and_the_model_is_untouched(start_ps):
    c = client(start_ps())
    try:
        c.init(model())
        mine = buffers(c)
        mine["w"][...] = 0.5
        mine["b"][...] = 0.0
        mine["b"][3] = np.inf
        with pytest.raises(PSError) as err:
            c.push(0, mine)
        assert err.value.code == "not_finite"
        central = c.pull()
        assert central.version == 0
        for n, t in model().items():
            np.testing.assert_array_equal(central.tensors[n], t)
        mine["b"][3] = 0.0
        assert c.push(0, mine).version == 1  # still serving, still through the segment
        assert c.counters.push_local_bytes_up == 2 * sum(4 * int(np.prod(s)) for s in SHAPES.values())
    finally:
        c.close()


def test_attach_refuses_memory_that_is_not_the_senders_own_sealed_memfd(start_ps, tmp_path):
    c = client(start_ps())
    try:
        c.init(model())

        def attach(pid: object, fd: object, token: object) -> str:
            with pytest.raises(PSError) as err:
                c.request("attach", {"session": c.session, "pid": pid, "fd": fd, "token": token})
            return err.value.code

        seg = PushSegment({"x": ((4,), np.float32)})
        try:
            me = os.getpid()
            assert attach(me, seg.fd, bytes(16)) == "bad_local"  # not its token: a descriptor seen is not enough
            assert attach(me, seg.fd, seg.token[:8]) == "bad_local"
            assert attach("1", seg.fd, seg.token) == "bad_local"
            assert attach(me, 1 << 30, seg.token) == "bad_local"
            with open(tmp_path / "plain", "wb") as f:  # a plain file that holds the token: not sealed memory
                f.write(seg.token + bytes(112))
                f.flush()
                assert attach(me, f.fileno(), seg.token) == "bad_local"
            unsealed = os.memfd_create("plug_asgd_push", os.MFD_CLOEXEC)
            try:
                os.write(unsealed, seg.token + bytes(112))
                assert attach(me, unsealed, seg.token) == "bad_local"  # could shrink under the PS
            finally:
                os.close(unsealed)
            with pytest.raises(PSError) as err:  # attach belongs to the session that said hello
                c.request("attach", {"session": "another", "pid": me, "fd": seg.fd, "token": seg.token})
            assert err.value.code == "bad_field"
            assert c.stats()["shm_segments"] == 0
            assert fcntl.fcntl(seg.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        finally:
            seg.close()
    finally:
        c.close()


def test_local_references_out_of_bounds_unattached_or_outside_pushes_are_refused(start_ps):
    address = start_ps()
    c, other = client(address, world=2), client(address, rank=1, world=2)
    try:
        c.init(model())
        mine = buffers(c)
        size = c._segment.size

        def push(offset: int, who: PSClient = c, msg: str = "push") -> str:
            fields = {"rank": who.rank, "base_version": 0, "seq": 99, "session": who.session}
            with pytest.raises(PSError) as err:
                who.request(msg, fields, {"w": np.zeros(SHAPES["w"], np.float32)}, local={"w": offset})
            return err.value.code

        assert push(size - 8) == "bad_local"  # runs past the end
        assert push(0) == "bad_local"  # the token, not a tensor
        assert push(HEADER_BYTES + 2) == "bad_local"  # misaligned
        assert push(HEADER_BYTES, who=other) == "bad_local"  # another worker has no segment of its own here
        assert push(HEADER_BYTES, msg="init") == "bad_local"
        assert c.stats()["version"] == 0
        assert c.push(0, mine).version == 1
    finally:
        c.close()
        other.close()


def test_a_ps_without_shared_memory_pushes_over_the_socket(start_ps):
    c = client(start_ps("asgd", shm_pushes=False))
    try:
        assert not c.shm_offered
        assert c.push_buffers({"w": ((3, 5), np.float32)}) is None
        c.shm_offered = True  # a client that asks anyway is refused, and pushes bytes
        assert c.push_buffers({"w": ((3, 5), np.float32)}) is None and c._segment is None
        c.init(model())
        reply = c.push(0, {"w": np.ones((3, 5), np.float32)})
        assert reply.version == 1 and c.counters.push_local_bytes_up == 0
    finally:
        c.close()


def test_after_a_ps_restart_the_worker_pushes_its_buffers_as_bytes(start_ps, tmp_path):
    first = start_ps("asgd", checkpoint_dir=tmp_path, checkpoint_every_updates=1)
    c = PSClient(first, rank=0, world_size=1, mode="asgd", request_timeout=20, lost_timeout=30, heartbeat_s=None)
    try:
        c.hello(stage=1, training=True, timeout=20)
        c.init(model())
        mine = buffers(c)
        mine["w"][...] = 1.0
        mine["b"][...] = 0.0
        assert c.push(0, mine).version == 1
        start_ps.stop(first)
        start_ps.started[first] = start_ps.procs.start(embedded_command(PSConfig(bind=first, resume=tmp_path)))
        mine["w"][...] = 2.0
        calls = []
        reply = c.push(1, mine, while_waiting=lambda: calls.append(1))  # the new PS maps nothing: refused,
        assert reply.version == 2 and c._segment is None  # then sent again as bytes
        assert calls == [1]  # the work meant for the wait ran once, not once per sending
        np.testing.assert_array_equal(reply.tensors["w"], model()["w"] + np.float32(1.0) + np.float32(2.0))
        # handed over twice (the refused push too, as refused requests count in bytes_up), read once
        assert c.counters.pushes == 3
        assert c.counters.push_local_bytes_up == 2 * sum(4 * int(np.prod(s)) for s in SHAPES.values())
    finally:
        c.close()


def test_the_wire_carries_a_local_reference_without_a_frame():
    from plug_asgd.protocol.wire import decode, encode

    seg = PushSegment({"w": ((2, 3), np.float32), "b": ((3,), np.float32)})
    try:
        offset = seg.offset(seg.buffers["b"])
        assert offset is not None and offset % 64 == 0 and offset >= HEADER_BYTES
        assert seg.offset(np.zeros(3, np.float32)) is None  # not in the segment
        assert seg.offset(seg.buffers["w"][:, 1]) is None  # not contiguous
        frames = encode("push", {"rid": 1}, {"b": seg.buffers["b"], "w": np.ones((2, 3), np.float32)},
                        local={"b": offset})
        assert len(frames) == 2  # the header and w's bytes; b travels as a reference
        msg = decode(frames)
        assert msg.tensors["b"] == Local(offset, np.dtype("<f4"), (3,))
        np.testing.assert_array_equal(msg.tensors["w"], np.ones((2, 3), np.float32))
    finally:
        seg.close()


@pytest.fixture
def in_process_ps():
    """A PS serving from a thread of this process (its arrays can be looked at), and a worker of it (of 2)."""
    server = ParameterServer(PSConfig(bind="tcp://127.0.0.1:*"))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    thread.start()
    c = client(server.address, world=2)
    try:
        c.init(model())
        yield server, c
    finally:
        c.close()
        server.request_stop()
        thread.join(10)


@pytest.mark.integration
def test_the_ps_folds_a_shared_push_into_spare_arrays_and_reuses_them(in_process_ps):
    """In-process PS: a push read from a worker's memory is folded into arrays of the PS's own, the
    replaced central arrays become the next fold's spares once no reply holds them, and nothing the
    PS keeps is a view of the worker's segment."""
    server, c = in_process_ps
    mine = buffers(c)
    for n in SHAPES:
        mine[n][...] = 0.25
    c.push(0, mine, want_model="unless_own")
    first = dict(server.store.state.tensors)
    c.push(1, mine, want_model="unless_own")
    assert all(server.store.state.tensors[n] is not first[n] for n in SHAPES)
    c.push(2, mine, want_model="unless_own")  # no reply held the first arrays: kept as spares, and used
    assert all(server.store.state.tensors[n] is first[n] for n in SHAPES)  # two arrays, in turn
    for t in server.store.state.tensors.values():  # (the PS maps the segment read-only, at its own addresses:
        assert t.flags.writeable and t.flags.owndata  # a view of it would be neither)
    quarter = np.float32(0.25)
    np.testing.assert_array_equal(c.pull().tensors["w"], model()["w"] + quarter + quarter + quarter)


def two_sets(c: PSClient) -> dict[str, dict[str, np.ndarray]]:
    """Two sets of buffers in one segment, as the strategy keeps: it lends one while it fills the other."""
    out = c.push_buffers({f"{k}:{n}": (s, np.float32) for n, s in SHAPES.items() for k in "ab"})
    assert out is not None
    return {k: {n: out[f"{k}:{n}"] for n in SHAPES} for k in "ab"}


def fill(buffers: dict[str, np.ndarray], tensors: dict[str, np.ndarray]) -> None:
    for n, t in tensors.items():
        buffers[n][...] = t


def assert_bits(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for n, t in want.items():
        np.testing.assert_array_equal(got[n].view(np.uint32), t.view(np.uint32))


def test_lent_weights_are_the_model_itself_until_a_reply_has_to_carry_them(start_ps):
    """A lent push of weights is kept where it lies, not copied: a write that the contract forbids
    (made here on purpose, to see where the model lives) shows in the next pull, from any client,
    which copies the model first; writes after that pull no longer reach it."""
    address = start_ps()
    c = client(address)
    watcher = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=10, heartbeat_s=None)
    try:
        c.init(model())
        sets = two_sets(c)
        fill(sets["a"], model(3))
        reply = c.push(0, sets["a"], want_model="unless_own", weights=True, lend=True)
        stats = c.stats()
        assert reply.own and reply.version == 1 and stats["weights_lent"] == 1 and stats["lent_copies"] == 0
        sets["a"]["w"][0, 0] = 42.0
        seen = watcher.pull().tensors  # a Supervisor's pull, say: it gets a copy, which the PS keeps
        sets["a"]["w"][0, 0] = 7.0
        want = model(3)
        want["w"][0, 0] = 42.0
        assert_bits(seen, want)
        assert_bits(c.pull().tensors, want)
        assert c.stats()["lent_copies"] == 1
    finally:
        watcher.close()
        c.close()


@pytest.mark.parametrize("then", ["lends_the_other_set", "is_refused", "meets_a_stopped_ps", "pushes_a_delta",
                                  "another_worker_folds_in_place"])
def test_the_ps_gives_lent_weights_back_before_it_answers_the_lenders_next_push(start_ps, then):
    """After a lent push of weights, whatever comes next, the worker's buffers are its own again
    once it has the answer (or as soon as the PS must write its model in place): writing NaN into
    them then changes nothing at the PS. The model is the one the pushes make, bit for bit, and the
    PS copied the lent buffers only where they were still its model."""
    address = start_ps("asgd", max_updates=1) if then == "meets_a_stopped_ps" else start_ps()
    c = client(address, world=2)
    other = client(address, rank=1, world=2)
    try:
        c.init(model())
        sets = two_sets(c)
        fill(sets["a"], model(3))
        assert c.push(0, sets["a"], want_model="unless_own", weights=True, lend=True).own
        want, copies = model(3), 1
        if then == "lends_the_other_set":
            fill(sets["b"], model(4))
            assert c.push(1, sets["b"], want_model="unless_own", weights=True, lend=True).own
            want, copies = model(4), 0  # the PS's model moved to the other set: nothing to copy
        elif then == "is_refused":
            fill(sets["b"], model(4))
            sets["b"]["b"][2] = np.nan
            with pytest.raises(PSError) as err:
                c.push(1, sets["b"], want_model="unless_own", weights=True, lend=True)
            assert err.value.code == "not_finite"
        elif then == "meets_a_stopped_ps":
            fill(sets["b"], model(4))
            reply = c.push(1, sets["b"], want_model=False, weights=True, lend=True)
            assert reply.status == "stopped" and reply.version == 1
        elif then == "pushes_a_delta":
            fill(sets["b"], {n: np.full(s, 0.5, np.float32) for n, s in SHAPES.items()})
            c.push(1, sets["b"], want_model=False)
            want = {n: t + np.float32(0.5) for n, t in want.items()}
            copies = 0  # folded out of place into the PS's own arrays
        else:  # a sparse update is folded in place: the PS copies the lent model before it writes
            other.push(1, {"w": Sparse(np.array([4]), np.array([2.0], np.float32), SHAPES["w"])}, want_model=False)
            want["w"].reshape(-1)[4] += np.float32(2.0)
        for n in SHAPES:
            sets["a"][n][...] = np.nan
        assert c.stats()["lent_copies"] == copies  # (before the pull, which copies a model still lent)
        assert_bits(other.pull().tensors, want)
    finally:
        other.close()
        c.close()


@pytest.mark.integration
def test_lent_weights_leave_the_ps_arrays_they_replace_as_spares_for_the_next_fold(in_process_ps):
    """In-process PS: a lent push replaces the PS's own arrays, which the next fold out of a shared
    segment writes into, so that pushes alternating lent weights and deltas allocate nothing."""
    server, c = in_process_ps
    sets = two_sets(c)
    own = dict(server.store.state.tensors)
    fill(sets["a"], model(3))
    assert c.push(0, sets["a"], want_model="unless_own", weights=True, lend=True).own
    # lent: the model is the PS's read-only map of the worker's buffers, no array of its own
    assert c.stats()["weights_lent"] == 1
    assert all(not server.store.state.tensors[n].flags.writeable for n in SHAPES)
    fill(sets["b"], {n: np.full(s, 0.5, np.float32) for n, s in SHAPES.items()})
    c.push(1, sets["b"], want_model=False)
    assert all(server.store.state.tensors[n] is own[n] for n in SHAPES)  # the delta folded into the spares
    want = {n: t + np.float32(0.5) for n, t in model(3).items()}
    assert_bits(c.pull().tensors, want)
    assert c.stats()["lent_copies"] == 0  # the lent arrays were no longer the model: nothing copied


@pytest.mark.integration
def test_lent_weights_given_back_for_a_fold_in_place_are_copied_once_while_a_reply_is_in_flight(in_process_ps):
    """In-process PS: a fold in place must not write arrays that a reply still being sent reads
    (copy-on-write), nor a lent model (copied back first). The copy that gives the lent model
    back is read by no reply, so it is not copied a second time."""
    server, c = in_process_ps
    other = client(server.address, rank=1, world=2)
    try:
        sets = two_sets(c)
        server.store.copy_threshold = 0  # (every frame of a reply tracked, however small)
        in_flight = server.store.reply_payload({"rid": None})  # a reply of the model before, still being sent
        fill(sets["a"], model(3))
        assert c.push(0, sets["a"], want_model="unless_own", weights=True, lend=True).own
        before = c.stats()["copies_on_write"]
        other.push(1, {"w": Sparse(np.array([4]), np.array([2.0], np.float32), SHAPES["w"])}, want_model=False)
        stats = c.stats()
        assert stats["lent_copies"] == 1 and stats["copies_on_write"] == before
        del in_flight
        for n in SHAPES:
            sets["a"][n][...] = np.nan  # the worker's again
        want = model(3)
        want["w"].reshape(-1)[4] += np.float32(2.0)
        assert_bits(c.pull().tensors, want)
    finally:
        other.close()
