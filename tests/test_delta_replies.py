"""Replies that carry only what a worker lacks (plug_asgd/ps/changes.py, HeldModel in plug_asgd/worker/client.py).

The worker's copy, patched with each delta, must be the central model bit for bit; a delta
carries the current values of the coordinates changed since the worker's version, and its
bytes are what the wire's sparse layout says. Quick tests drive the stores without a socket;
the last test runs a real PS process and two clients over loopback.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from plug_asgd.protocol.wire import Sparse, WireError, decode, encode, message_bytes, num_blocks
from plug_asgd.ps import PSConfig
from plug_asgd.ps.changes import ChangeLog, parse_have
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.reference_store import ReferenceStore
from plug_asgd.ps.store_records import PushIn
from plug_asgd.worker.client import HeldModel, PSClient, PSError
from plug_asgd.worker.errors import REPLY_KINDS

SHAPES = {"w": (300, 400), "b": (400,)}  # w: 120,000 coordinates, two sparse blocks


def sparse(shape: tuple[int, ...], idx: list[int] | np.ndarray, values: list[float] | np.ndarray) -> Sparse:
    return Sparse(np.asarray(idx, dtype=np.int64), np.asarray(values, dtype=np.float32), shape)


# -- the log ------------------------------------------------------------------------------------


def test_a_delta_is_the_union_of_the_coordinates_changed_since_the_version_held_with_their_current_values():
    log = ChangeLog()
    log.reset(0)
    central = {"w": np.zeros(100, np.float32), "b": np.zeros(3, np.float32)}
    central["w"][[5, 7]] = 1.0
    log.record(1, {"w": sparse((100,), [5, 7], [1, 1])})
    central["w"][[7, 9]] += 2.0
    log.record(2, {"w": sparse((100,), [7, 9], [2, 2])})
    central["b"] += 1.0
    log.record(3, {"b": np.ones(3, np.float32), "w": sparse((100,), [1], [0.5])})
    central["w"][1] += 0.5

    since1 = log.delta((log.model_id, 1), 3, central)
    assert set(since1) == {"w", "b"}
    assert since1["w"].indices.tolist() == [1, 7, 9]  # 5 changed at version 1 only, which the worker holds
    assert since1["w"].values.tolist() == [0.5, 3.0, 2.0]  # current values, not the changes' sum
    assert since1["b"] is central["b"]  # a dense change: the tensor whole
    since2 = log.delta((log.model_id, 2), 3, central)
    assert since2["w"].indices.tolist() == [1]
    assert log.delta((log.model_id, 3), 3, central) == {}  # holds the current version: nothing to send
    assert log.delta((log.model_id, 0), 3, central)["w"].indices.tolist() == [1, 5, 7, 9]
    # another model (a PS restarted or resumed), a version the log no longer reaches, or none held: all of it
    assert log.delta(("another", 2), 3, central) is None
    assert log.delta(None, 3, central) is None
    log.everything(4)
    assert log.delta((log.model_id, 3), 4, central) is None
    assert log.delta((log.model_id, 4), 4, central) == {}


def test_a_tensor_whose_changed_coordinates_cost_more_than_the_tensor_goes_whole():
    log = ChangeLog()
    log.reset(0)
    numel = 1000  # dense: 4,000 bytes; sparse: 4 * 1 block + 6 bytes a coordinate
    central = {"w": np.arange(numel, dtype=np.float32)}
    log.record(1, {"w": sparse((numel,), np.arange(0, 666), np.ones(666))})  # 4 + 3,996 = 4,000: not less
    assert log.delta((log.model_id, 0), 1, central)["w"] is central["w"]
    log.everything(1)
    log.record(2, {"w": sparse((numel,), np.arange(0, 665), np.ones(665))})  # 3,994 bytes: sparse
    assert isinstance(log.delta((log.model_id, 1), 2, central)["w"], Sparse)


def test_the_log_forgets_its_oldest_versions_past_its_bounds_and_then_sends_the_whole_model():
    log = ChangeLog(max_versions=3, max_indices=10)
    log.reset(0)
    central = {"w": np.zeros(50, np.float32)}
    for v in range(1, 5):
        log.record(v, {"w": sparse((50,), [v], [1.0])})
    assert log.since == 1  # version 1's entry is gone: a worker at 0 cannot be brought up to date
    assert log.delta((log.model_id, 0), 4, central) is None
    assert log.delta((log.model_id, 1), 4, central)["w"].indices.tolist() == [2, 3, 4]
    log.record(5, {"w": sparse((50,), np.arange(10, 19), np.ones(9))})  # 1 + 1 + 1 + 9 = 12 indices > 10
    assert log.since == 3 and len(log.entries) == 2 and log.indices == 10  # versions 2 and 3 pushed out
    assert log.delta((log.model_id, 3), 5, central)["w"].indices.tolist() == [4, *range(10, 19)]
    assert log.delta((log.model_id, 2), 5, central) is None


def test_have_is_checked_like_any_field():
    assert parse_have(None) is None
    assert parse_have(["a" * 32, 7]) == ("a" * 32, 7)
    for bad in (["a", -1], ["a", True], ["a" * 33, 1], [1, 1], "a", ["a", 1, 2], {"a": 1}):
        with pytest.raises(WireError) as exc:
            parse_have(bad)
        assert exc.value.code == "bad_field"


# -- the stores, as the serving loop drives them -----------------------------------------------------


def reply_to(store, held: HeldModel) -> tuple[dict[str, np.ndarray], int, bool]:
    """A pull's reply as the serving loop makes it, decoded as the client does: (model, bytes, was a delta)."""
    model, nbytes, fields = answer(store, held, None, push=False, status="pulled")
    return model, nbytes, bool(fields.get("delta"))


@pytest.mark.parametrize("store_cls", [ReferenceStore, FastStore])
@pytest.mark.parametrize("mode", ["asgd", "adacomp", "dynsgd", "ssp", "sync"])
def test_a_worker_patched_with_deltas_holds_the_central_model_bit_for_bit(store_cls, mode):
    rng = np.random.default_rng(3)
    store = store_cls(PSConfig(mode=mode))
    store.init({n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()})
    store.set_trainers(frozenset({0, 1}))
    held = [HeldModel(), HeldModel()]
    base = [0, 0]
    for w in (0, 1):
        reply_to(store, held[w])
    deltas = 0
    for i in range(60):
        w = int(rng.integers(2))
        update = {}
        for name, shape in SHAPES.items():
            numel = int(np.prod(shape))
            idx = np.sort(rng.choice(numel, size=numel // 100, replace=False))
            update[name] = Sparse(idx, rng.standard_normal(idx.size).astype(np.float32), shape)
        if i % 17 == 16:  # now and then a dense update of one tensor
            update["b"] = rng.standard_normal(SHAPES["b"]).astype(np.float32)
        frames = encode("push", {}, update)
        store.fold(PushIn(token=w, rank=w, session=f"s{w}", seq=i, base_version=base[w],
                          tensors=dict(decode(frames).tensors), frames={}))
        moved = held[w].version != store.version
        model, _, was_delta = reply_to(store, held[w])
        deltas += was_delta and moved
        base[w] = store.version
        for name, central in store.state.tensors.items():
            assert model[name].tobytes() == central.tobytes(), (i, name)
    if mode == "sync":  # a synchronous round may change any coordinate: the whole model once it moved
        assert deltas == 0
    else:
        assert deltas >= 50  # all but the replies after a dense update of b are deltas


def test_a_delta_reply_has_exactly_the_bytes_of_its_sparse_layout():
    store = FastStore(PSConfig(mode="asgd"))
    store.init({n: np.zeros(s, np.float32) for n, s in SHAPES.items()})
    held = HeldModel()
    _, full_bytes, _ = reply_to(store, held)
    idx = np.array([3, 70_000, 119_999])  # in blocks 0, 1 and 1 of w
    store.fold(PushIn(token=0, rank=0, session="s", seq=1, base_version=0, frames={},
                      tensors={"w": sparse(SHAPES["w"], idx, [1.0, 2.0, 3.0])}))
    model, nbytes, was_delta = reply_to(store, held)
    assert was_delta and model["w"].reshape(-1)[idx].tolist() == [1.0, 2.0, 3.0]
    header = encode("model", {"status": "pulled", "version": 1, "model_id": store.changes.model_id, "delta": True})[0]
    # the header names w's layout; then counts (uint32 per block of 65,536), offsets (uint16), values (float32);
    # b did not change, so it is absent
    spec = len(encode("model", {}, {"w": sparse(SHAPES["w"], idx, [0, 0, 0])})[0]) - len(encode("model", {})[0])
    assert nbytes == len(header) + spec + 4 * num_blocks(120_000) + 3 * (2 + 4)
    assert full_bytes > 4 * 120_400


def test_a_resumed_or_restarted_model_is_never_patched_from_the_old_one():
    store = ReferenceStore(PSConfig(mode="asgd"))
    store.init({"w": np.zeros(10, np.float32)})
    held = HeldModel()
    reply_to(store, held)
    snap = store.snapshot()
    other = ReferenceStore(PSConfig(mode="asgd"))
    other.restore(snap)  # the same version number, another model id
    _, _, was_delta = reply_to(other, held)
    assert not was_delta


# -- a real PS over loopback -------------------------------------------------------------------------


def test_over_sockets_sparse_pushes_are_answered_with_deltas_and_both_workers_hold_the_central_model(start_ps):
    address = start_ps("adacomp")
    clients = [PSClient(address, rank=r, world_size=2, mode="adacomp", request_timeout=10, heartbeat_s=None)
               for r in (0, 1)]
    whole = PSClient(address, rank=0, world_size=2, mode="adacomp", request_timeout=10, heartbeat_s=None,
                     delta_replies=False)  # a bystander that always takes the whole model
    try:
        for c in clients:
            c.hello(stage=1, training=True, timeout=20)
        rng = np.random.default_rng(0)
        assert clients[1].pull_once_initialized(0.2) is None  # nobody sent a model yet
        init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
        later = threading.Timer(0.5, clients[0].init, args=(init,))
        later.start()
        first = clients[1].pull_once_initialized(20.0)  # waits for rank 0's model instead of sending its own
        later.join()
        assert first is not None and first.tensors["w"].tobytes() == init["w"].tobytes()
        down = clients[0].counters.bytes_down
        assert clients[0].pull().tensors["w"].tobytes() == init["w"].tobytes()
        assert clients[0].counters.delta_replies == 1  # it holds the model it sent: nothing changed since
        assert clients[0].counters.bytes_down - down < 300  # a header
        versions = [0, 0]
        for i in range(40):
            r = i % 2
            update = {n: Sparse(np.sort(rng.choice(int(np.prod(s)), 120, replace=False)),
                                rng.standard_normal(120).astype(np.float32), s) for n, s in SHAPES.items()}
            down = clients[r].counters.bytes_down
            reply = clients[r].push(versions[r], update)
            versions[r] = reply.version
            # own push and the other's, 120 + 120 coordinates in each tensor at most: far below the 481,600-byte model
            assert clients[r].counters.bytes_down - down < 2 * 240 * 6 + 2000
        truth = whole.pull()
        for c in clients:
            model = c.pull()
            assert model.version == truth.version == 40
            for name in SHAPES:
                assert model.tensors[name].tobytes() == truth.tensors[name].tobytes()
        # rank 0: every reply (it holds the model it sent); rank 1: every reply after its first pull
        assert [c.counters.delta_replies for c in clients] == [22, 21]
        kinds = dict.fromkeys(REPLY_KINDS, 0)  # by request: 20 pushes each, answered with deltas, and the pulls
        assert [c.counters.replies for c in clients] == [{**kinds, "delta": 20, "pulled_delta": 2},
                                                         {**kinds, "delta": 20, "pulled": 1, "pulled_delta": 1}]
        stats = whole.stats()
        assert stats["delta_replies"] == 43 and stats["model_replies"] == 43 + 1 + 1
        assert stats["bytes_out_by_rank"]["1"] == clients[1].counters.bytes_down
    finally:
        for c in (*clients, whole):
            c.close()


# -- approximate replies: the downlink fraction ---------------------------------------------------------


def answer(store, held: HeldModel, rank: int | None, push: bool,
           status: str = "applied") -> tuple[dict[str, np.ndarray], int, dict]:
    """A reply to rank ``rank`` as the serving loop makes it, taken as the client takes it."""
    have = held.have
    frames = store.reply_payload({"status": status, "version": store.version}, have if held.exact else None,
                                 rank=rank, held=None if held.exact else have, push=push)
    msg = decode([bytes(memoryview(f)) for f in frames])
    if msg.fields.get("delta"):
        return held.patch(dict(msg.tensors), store.version, exact=not msg.fields.get("approx")), \
            message_bytes(frames), msg.fields
    held.keep(msg.fields["model_id"], store.version, dict(msg.tensors))
    return dict(msg.tensors), message_bytes(frames), msg.fields


@pytest.mark.parametrize("store_cls", [ReferenceStore, FastStore])
@pytest.mark.parametrize("bound", [None, 0.05])
def test_approximate_replies_send_the_largest_differences_and_a_pull_makes_the_copy_exact(store_cls, bound):
    rng = np.random.default_rng(5)
    store = store_cls(PSConfig(mode="asgd", downlink_fraction=0.01, downlink_bound=bound))
    store.init({n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()})
    held, base, widened = [HeldModel(), HeldModel()], [0, 0], 0
    for w in (0, 1):
        answer(store, held[w], w, push=False)  # the worker's first pull: exact, and the PS keeps its copy
    for i in range(40):
        w = i % 2
        update = {n: (0.01 * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()}
        before = {n: t.copy() for n, t in held[w].tensors.items()}
        msg = decode([zmq.Frame(bytes(memoryview(f))) for f in encode("push", {}, update)])  # as the socket hands it
        store.fold(PushIn(token=w, rank=w, session=f"s{w}", seq=i, base_version=base[w], frames=msg.frames,
                          tensors=dict(msg.tensors)))
        central = {n: t.copy() for n, t in store.state.tensors.items()}
        model, nbytes, fields = answer(store, held[w], w, push=True)
        base[w] = store.version
        assert fields["approx"] and fields["delta"] and not held[w].exact
        for name, shape in SHAPES.items():
            numel = int(np.prod(shape))
            diff = np.abs(central[name] - before[name]).reshape(-1)
            k = int(0.01 * numel)
            gap = np.sort(diff)[-k - 1]  # the largest difference a reply of the top k leaves out
            sent = np.flatnonzero(model[name].reshape(-1) != before[name].reshape(-1))
            left = np.abs(central[name] - model[name]).max()
            assert set(sent) >= set(np.argsort(diff)[-k:][diff[np.argsort(diff)[-k:]] > gap])  # the k largest
            assert np.array_equal(model[name].reshape(-1)[sent], central[name].reshape(-1)[sent])  # set exactly
            if bound is None or gap <= bound:
                assert sent.size <= k and left == gap
            else:  # the top k leave out more than the bound: every coordinate beyond it goes too
                assert left <= bound and sent.size > k
                widened += 1
            # the PS's copy of this worker is what the worker holds, bit for bit
            assert store.downlink.copies[w].tensors[name].tobytes() == model[name].tobytes()
            assert store.downlink.gap_max >= left
        if bound is None:
            assert nbytes < 2 * (6 * 1200 + 6 * 4 + 8) + 400  # k coordinates of w and of b, 6 bytes each
    for w in (0, 1):  # before evaluating: a pull, exact
        model, _, fields = answer(store, held[w], w, push=False)
        assert held[w].exact and not fields.get("approx")
        for name, central in store.state.tensors.items():
            assert model[name].tobytes() == central.tobytes()
    assert store.stats.approx_replies == 40
    assert (widened > 0) == (bound is not None)


def test_over_sockets_a_ps_with_a_downlink_fraction_answers_pushes_approximately_and_pulls_exactly(start_ps):
    address = start_ps("asgd", downlink_fraction=0.01)
    worker = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=10, heartbeat_s=None)
    whole = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=10, heartbeat_s=None,
                     delta_replies=False)
    try:
        worker.hello(stage=1, training=True, timeout=20)
        rng = np.random.default_rng(1)
        worker.init({n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()})
        version = worker.pull().version
        for _ in range(10):
            down = worker.counters.bytes_down
            reply = worker.push(version, {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()})
            version = reply.version
            assert reply.approx and worker.counters.bytes_down - down < 6 * (1200 + 4) + 1000
        model, truth = worker.pull(), whole.pull()
        assert not model.approx and model.version == truth.version == 10
        # the pushes' replies approximate; the pulls' exact (after the init: nothing changed; then what did)
        assert worker.counters.replies == {**dict.fromkeys(REPLY_KINDS, 0), "approx": 10, "pulled_delta": 2}
        assert whole.counters.replies == {**dict.fromkeys(REPLY_KINDS, 0), "pulled": 1}
        for name in SHAPES:
            assert model.tensors[name].tobytes() == truth.tensors[name].tobytes()
        stats = whole.stats()
        assert stats["approx_replies"] == 10 and stats["downlink_gap_max"] > 0
    finally:
        worker.close()
        whole.close()


def test_the_strategy_and_the_recipes_refuse_a_downlink_fraction_out_of_range():
    from plug_asgd import AsyncPSStrategy
    from plug_asgd.recipes.common import make_strategy
    from plug_asgd.recipes.mnist import build_parser

    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match="downlink_fraction must be between"):
            AsyncPSStrategy(downlink_fraction=bad)
    with pytest.raises(ValueError, match="downlink_bound must be >= 0"):
        AsyncPSStrategy(downlink_fraction=0.01, downlink_bound=-1)
    strategy = make_strategy(build_parser().parse_args(["--downlink-fraction", "0.01", "--downlink-bound", "0.1"]))
    assert strategy.connection.settings.downlink == {"downlink_fraction": 0.01, "downlink_bound": 0.1,
                                                     "downlink_codec": None}


def test_a_change_the_client_cannot_apply_is_refused_whole_and_the_next_request_asks_for_all():
    held = HeldModel()
    held.keep("m", 3, {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)})
    with pytest.raises(PSError) as exc:
        held.patch({"w": sparse((4,), [1], [5.0]), "x": np.ones(3, np.float32)}, 4)
    assert exc.value.code == "bad_reply"
    assert held.have is None and held.tensors == {}  # nothing half applied: w's change was not kept either
