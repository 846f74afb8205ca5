"""Every mode and codec on a sharded PS (issue 21, phase 3): sync rounds, elastic and overlapped exchanges, packing.

The expected values come from one PS given the same pushes (or the same worker's steps), never from the
sharded code. The Lightning fit of every mode on two embedded shards is tests/test_sharding.py's.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np
import pytest

from plug_asgd import compressors, modes
from plug_asgd.compressors import decode, slice_packed
from plug_asgd.protocol.partition import Partition
from plug_asgd.protocol.wire import Packed, Sparse
from plug_asgd.sharding.client import PARTLY_APPLIED, ShardedClient, ShardVersions, combined_status
from plug_asgd.sharding.config import make_partition
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.exchange.push import PushExchange
from tests.test_sharding import one_ps_and_shards, same_bits

FOLD_SHAPES = {"w": (48, 40), "b": (40,), "v": (7,), "k": (3, 3, 4)}


# -- 1. packed updates cut by their codec; PowerSGD's matrices kept whole (no processes) -------------------------

@pytest.mark.parametrize("name", ["bf16", "qsgd", "sign"])
def test_a_packed_update_cut_into_slices_decodes_to_the_slices_of_the_whole_bit_for_bit(name):
    rng = np.random.default_rng(3)
    codec = compressors.get(name).encoder(0)
    for size in (1, 7, 8, 9, 1000, 1003):
        x = rng.standard_normal(size).astype(np.float32) * 0.01
        x[::5] = 0.0
        packed = codec.encode("t", x)
        assert isinstance(packed, Packed)
        whole = decode(packed, np.float32, shape=(size,))
        cuts = sorted({0, size, *(rng.integers(1, size, 4).tolist() if size > 1 else [])})
        pieces = []
        for start, stop in zip(cuts, cuts[1:], strict=False):
            part = slice_packed(packed, start, stop)
            assert part.shape == (stop - start,) and part.codec == packed.codec
            got = decode(part, np.float32, shape=(stop - start,))
            assert got.tobytes() == whole.reshape(-1)[start:stop].tobytes(), (name, size, start, stop)
            pieces.append(part)
        # each slice costs at most one byte more than its share of the whole (bits packed again)
        assert sum(p.nbytes for p in pieces) <= packed.nbytes + len(pieces)


def test_powersgd_keeps_the_matrices_it_factors_whole_and_the_partition_says_so():
    shapes = {"fc.weight": (300, 70), "fc.bias": (300,), "head": (10, 300), "vec": (5000,)}
    plain = make_partition(shapes, 2)
    assert any(p.name == "fc.weight" and not p.whole for p in plain.pieces), "the test must cut the matrix"
    low = make_partition(shapes, 2, compressors.get({"name": "powersgd", "rank": 4}))
    kept = {p.name for p in low.pieces if p.whole}
    assert {"fc.weight", "head"} <= kept  # factored: 4 * (300 + 70) < 300 * 70, 4 * (10 + 300) < 10 * 300
    assert any(p.name == "vec" and not p.whole for p in low.pieces)  # sent dense: still cut
    assert low.digest != plain.digest  # a worker that cuts otherwise is refused by the shards
    # every worker computes the same partition from the same codec
    assert make_partition(dict(reversed(list(shapes.items()))), 2, compressors.get("powersgd")).digest == low.digest
    # a codec that cuts everything leaves the partition as it was
    assert make_partition(shapes, 2, compressors.get("sign")).digest == plain.digest


def test_the_partition_cuts_a_packed_update_through_its_codec_and_refuses_one_it_cannot_cut():
    part = Partition({"big": (300, 70)}, 2)
    x = np.random.default_rng(4).standard_normal((300, 70)).astype(np.float32)
    packed = compressors.get("sign").encoder(0).encode("big", x)
    parts = part.split({"big": packed}, compressors.slice_packed)
    whole = decode(packed, np.float32).reshape(-1)
    for shard, pieces in enumerate(parts):
        for key, piece in pieces.items():
            (p,) = [p for p in part.by_shard[shard] if p.key == key]
            assert decode(piece, np.float32, shape=(p.size,)).tobytes() == whole[p.start:p.stop].tobytes()
    factors = compressors.get("powersgd").encoder(0).encode("big", x)
    with pytest.raises(ValueError, match="packs a tensor as a whole.*whole tensors"):
        part.split({"big": factors}, compressors.slice_packed)


def test_the_status_of_a_push_is_the_shards_where_they_agree_and_partly_applied_where_not():
    assert combined_status(["applied", "applied"]) == "applied"
    assert combined_status(["dropped", "dropped"]) == "dropped"
    assert combined_status(["applied", "dropped"]) == PARTLY_APPLIED
    assert combined_status(["dropped", "applied", "applied"]) == PARTLY_APPLIED
    assert combined_status(["applied", "stopped"]) == "stopped"


def test_a_fragments_reply_counts_its_staleness_on_the_shards_it_came_from():
    base = ShardVersions([7, 3])  # the worker's version: shard 0 at 7, shard 1 at 3
    # a fragment held by shard 1 alone, pushed from there; 2 pushes of others landed on shard 1 before it
    reply = ShardVersions([7, 6], asked=[1])
    assert int(reply) == 7 and reply.asked == (1,)
    assert reply.since(base) == 2  # the newest shard's count would give 7 - 7 - 1 = -1
    # a reply of every shard (a fragment across both, or a whole push) counts the newest shard's, as one PS counts
    # its own: 9 - 7 - 1
    assert ShardVersions([9, 4], asked=[1, 0]).since(base) == 1
    assert ShardVersions([9, 4]).asked == (0, 1) and ShardVersions([9, 4]).since(base) == 1


# -- 2. synchronous rounds on every shard: two shards and one PS given the same pushes, in the same order -----

def test_a_sync_round_sums_its_updates_in_rank_order_whatever_order_they_came_in():
    """So two shards, each of which may receive the workers' pushes in another order, make one PS's bits."""
    from plug_asgd.modes import CentralState, Push, SyncRule

    rng = np.random.default_rng(6)
    start = rng.standard_normal(1000).astype(np.float32)
    ups = [(rng.standard_normal(1000) * 10.0 ** rng.integers(-4, 4, 1000)).astype(np.float32) for _ in range(4)]
    results = set()
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        state, rule = CentralState({"w": start.copy()}), SyncRule()
        rule.set_trainers(state, frozenset(range(4)))
        for rank in order:
            rule.push(state, Push(rank, rank, 0, {"w": ups[rank]}))
        assert state.version == 1
        results.add(state.tensors["w"].tobytes())
    assert len(results) == 1
    arrival = np.zeros(1000, np.float32)  # the sum in another order rounds otherwise: the test can tell
    for rank in [3, 2, 1, 0]:
        arrival += ups[rank]
    assert (start + arrival / 4).tobytes() not in results

def round_pushes(seed: int = 0, rounds: int = 4) -> list[list[tuple[int, dict]]]:
    """Per round, (rank, update) of 3 ranks in an order that changes from round to round; dense and sparse."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(rounds):
        order = [(r + i) % 3 for i in range(3)] if r % 2 == 0 else [(r - i) % 3 for i in range(3)]
        pushes = []
        for rank in order:
            update: dict[str, Any] = {}
            for name, shape in FOLD_SHAPES.items():
                size = math.prod(shape)
                if (rank + r) % 2:
                    k = int(rng.integers(1, max(2, size // 6)))
                    idx = np.sort(rng.choice(size, k, replace=False)).astype(np.int64)
                    update[name] = Sparse(indices=idx, values=rng.standard_normal(k).astype(np.float32), shape=shape)
                else:
                    update[name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
            pushes.append((rank, update))
        out.append(pushes)
    return out


def wait_for(condition, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def drive_rounds(clients: list, watchers: list[PSClient], initial: dict) -> tuple[list, dict]:
    """The rounds of round_pushes, each rank's push from a thread of its own (a sync push waits for its round),
    asking for the model ahead (async_diloco's momentum lookahead; the other rules anticipate nothing);
    the next rank pushes only once every PS (``watchers``: one per PS or shard) has received the last one, so
    every PS sees the same order. Returns each push's (rank, status, version, model) in order, and the final
    model."""
    for c in clients:
        c.hello(stage=1, training=True, timeout=30)
    assert clients[0].init(initial)
    last = [c.pull() for c in clients]
    seen = []
    received = 0
    for pushes in round_pushes():
        threads, replies = [], {}
        for rank, update in pushes:
            def push(rank: int = rank, update: dict = update, replies: dict = replies) -> None:
                replies[rank] = clients[rank].push(last[rank].version, update, want_model=True, ahead=True)

            thread = threading.Thread(target=push)
            thread.start()
            threads.append(thread)
            received += 1
            wait_for(lambda count=received: all(w.stats()["push_messages"] >= count for w in watchers),
                     what=f"push {received}")
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a push of a complete round is still waiting"
        for rank, _ in pushes:
            last[rank] = replies[rank]
            seen.append((rank, replies[rank].status, int(replies[rank].version),
                         {n: np.array(t) for n, t in replies[rank].tensors.items()}))
    final = clients[0].pull()
    return seen, {n: np.array(t) for n, t in final.tensors.items()}


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "replicas"), [("sync", None), ("sync", 2), ("diloco", None),
                                               ("async_diloco", None)],
                         ids=["every_worker", "backup_worker", "diloco", "async_diloco"])
def test_two_shards_run_the_sync_rounds_of_one_ps_bit_for_bit(start_ps, mode, replicas):
    """sync's rounds, and diloco's (whose outer optimizer, elementwise, steps each shard's slices on its own)."""
    rng = np.random.default_rng(1)
    initial = {n: rng.standard_normal(s).astype(np.float32) for n, s in FOLD_SHAPES.items()}
    one = start_ps(mode, replicas_to_aggregate=replicas)
    shards = [start_ps(mode, shard=f"{i}/2", replicas_to_aggregate=replicas) for i in range(2)]
    part = Partition(FOLD_SHAPES, 2)
    assert any(not p.whole for p in part.pieces), "the test must cut a tensor"
    options = {"world_size": 3, "mode": mode, "request_timeout": 30, "heartbeat_s": None}
    watchers = [PSClient(a, rank=0, **options) for a in (one, *shards)]
    try:
        with one_ps_and_shards(one, shards, part, mode) as (plain, sharded):
            expected, expected_final = drive_rounds(plain, watchers[:1], initial)
            got, got_final = drive_rounds(sharded, watchers[1:], initial)
            statuses = [s for _, s, _, _ in expected]
            assert statuses.count("applied") == (12 if replicas is None else 8), statuses
            for i, ((er, es, ev, em), (gr, gs, gv, gm)) in enumerate(zip(expected, got, strict=True)):
                assert (gr, gs, gv) == (er, es, ev), f"push {i}"
                assert same_bits(gm, em), f"push {i}: the assembled model differs from one PS's"
            assert same_bits(got_final, expected_final) and not same_bits(got_final, initial)
            versions = 12 if mode == "async_diloco" else 4  # one per push as it arrives; else one per round
            assert [s["version"] for s in sharded[0].stats()["shards"]] == [versions, versions]
            # 3 workers, a cycle of 3 arrivals: its first 2 are answered ahead, on each shard as on one PS
            ahead = 8 if mode == "async_diloco" else 0
            assert [w.stats()["ahead_replies"] for w in watchers] == [ahead] * 3
    finally:
        for c in watchers:
            c.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_sync_push_one_shard_takes_into_its_round_and_another_drops_is_partly_applied(start_ps):
    """replicas_to_aggregate=2 of 3: each shard averages the first two pushes it received, other ones per shard."""
    shards = [start_ps("sync", shard=f"{i}/2", replicas_to_aggregate=2) for i in range(2)]
    part = Partition(FOLD_SHAPES, 2)
    rng = np.random.default_rng(5)
    initial = {n: rng.standard_normal(s).astype(np.float32) for n, s in FOLD_SHAPES.items()}
    ups = [{n: rng.standard_normal(s).astype(np.float32) for n, s in FOLD_SHAPES.items()} for _ in range(3)]
    options = {"world_size": 3, "mode": "sync", "request_timeout": 20, "heartbeat_s": None}
    a, b, c = clients = [ShardedClient(shards, part, rank=r, **options) for r in range(3)]
    watchers = [PSClient(s, rank=0, **options) for s in shards]
    replies: dict[str, Any] = {}
    try:
        for client in clients:
            client.hello(stage=1, training=True, timeout=20)
        assert a.init(initial)
        base = a.pull().version
        for client in (b, c):
            client.pull()
        first = threading.Thread(target=lambda: replies.setdefault("a", a.push(base, ups[0])))
        first.start()
        wait_for(lambda: all(w.stats()["push_messages"] >= 1 for w in watchers), what="a's push")
        # c reaches shard 0 alone: shard 0's round is a and c
        c_split = part.split(ups[2], compressors.slice_packed)
        replies["c0"] = c.clients[0].push(0, c_split[0])
        # b reaches both: late on shard 0 (dropped at once), second on shard 1 (its round is a and b)
        replies["b"] = b.push(base, ups[1])
        first.join(20)
        # c's push reaches shard 1 late: dropped
        replies["c1"] = c.clients[1].push(0, c_split[1])
        assert replies["a"].status == "applied" and replies["a"].version.per_shard == (1, 1)
        assert replies["b"].status == PARTLY_APPLIED and replies["b"].version.per_shard == (1, 1)
        assert b.counters.partly_applied == 1 and a.counters.partly_applied == 0  # in comm_stats()
        assert (replies["c0"].status, replies["c1"].status) == ("applied", "dropped")
        on_0 = {p.key for p in part.by_shard[0]}
        for name, shape in FOLD_SHAPES.items():
            expected = np.empty(math.prod(shape), np.float32)
            for p in part.pieces:
                if p.name != name:
                    continue
                other = ups[2] if p.key in on_0 else ups[1]  # shard 0 averaged a and c, shard 1 a and b
                total = np.zeros(shape, np.float32)
                total += ups[0][name]
                total += other[name]
                model = initial[name].copy()
                model += total / 2
                expected[p.start:p.stop] = model.reshape(-1)[p.start:p.stop]
            assert replies["b"].tensors[name].tobytes() == expected.reshape(shape).tobytes(), name
    finally:
        for client in clients + watchers:
            client.close()


# -- 3. a worker's exchange over two shards makes the bits it makes with one PS ----------------------------------

def worker_steps(client: Any, mode: Any, codec: Any, steps: int, stats: dict | None = None) -> tuple[dict, dict]:
    """One worker (world size 1) training a small model through ``mode``'s exchange: its final weights and the
    central model (and its exchange's ``stats()`` into ``stats``). Deterministic: the same bits on one PS and on
    shards if the sharded fold is the PS's (a fragment's reply is waited for before the next step, so that it is
    merged after that step in every run)."""
    import torch

    from plug_asgd.worker.compensation import resolve
    from plug_asgd.worker.exchange import Link, make_exchange
    from plug_asgd.worker.exchange.fragments import FragmentExchange

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    data = torch.randn(steps, 16, 20, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 3, (steps, 16), generator=torch.Generator().manual_seed(2))
    exchange = make_exchange(mode, codec=codec, compensation=resolve(None, mode.name, mode.compensate),
                             shm_pushes=False)
    link = Link(client=client, tensors=lambda: dict(model.named_parameters()), rank=0, world_size=1, stage=1,
                fitting=True, barrier=lambda name: None, stop=lambda: None)
    exchange.attach(link)
    exchange.start_fit([opt], 0, 1)
    client.hello(1, True, timeout=30)
    exchange.join(init=True)
    for i in range(steps):
        def run(i: int = i) -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(data[i]), target[i]).backward()
            opt.step()

        exchange.step(run, opt)
        in_flight = getattr(exchange, "pending", None) if isinstance(exchange, FragmentExchange) else None
        if in_flight is not None:  # a fragment's reply merged after the next step, whenever it came: the same bits
            in_flight[0].thread.join(30)
    exchange.flush()
    exchange.let_go()
    if stats is not None:
        stats.update(exchange.stats())
    held = {n: t.detach().numpy().copy() for n, t in model.named_parameters()}
    return held, {n: np.array(t) for n, t in client.pull().tensors.items()}


EXCHANGES = {  # id: (the mode, its codec)
    "easgd": ({"name": "easgd", "tau": 2}, "none"),
    "eamsgd": ({"name": "eamsgd", "tau": 3}, "none"),
    "asgd_overlap": ({"name": "asgd", "overlap": True}, "none"),
    "osp": ("osp", "none"),
    "losp": ({"name": "losp", "push_every": 2}, "none"),
    "bf16": ("asgd", "bf16"),
    "qsgd": ("asgd", {"name": "qsgd", "bits": 4}),
    "sign": ("asgd", "sign"),
    "powersgd": ("asgd", {"name": "powersgd", "rank": 2}),
    # streaming DiLoCo: each fragment's tensors cut over both shards (the next test: each on one shard)
    "diloco_fragments": ({"name": "diloco", "inner_steps": 4, "fragments": 2}, "none"),
    "async_diloco_fragments_qsgd8": ({"name": "async_diloco", "inner_steps": 4, "fragments": 2,
                                      "dynamic_steps": False}, {"name": "qsgd", "bits": 8}),
}


@pytest.mark.integration
@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(EXCHANGES))
def test_a_workers_exchange_over_two_shards_makes_the_bits_of_one_ps(start_ps, case, monkeypatch):
    # the same exchange on both sides: a sharded client holds no central model to push from (held_base)
    monkeypatch.setattr(PushExchange, "held_base_for", lambda self, tensors, want_model: None)
    mode_spec, codec_spec = EXCHANGES[case]
    mode, codec = modes.get(mode_spec), compressors.get(codec_spec)
    one = start_ps(mode.name)
    shards = [start_ps(mode.name, shard=f"{i}/2") for i in range(2)]
    options = {"rank": 0, "world_size": 1, "mode": mode.name, "request_timeout": 30, "heartbeat_s": None}
    plain = PSClient(one, **options)
    plain.takes_weights = False  # as a sharded client: the updates themselves, not the weights, are pushed
    shapes = {"0.weight": (30, 20), "0.bias": (30,), "2.weight": (3, 30), "2.bias": (3,)}
    part = make_partition(shapes, 2, codec)
    sharded = ShardedClient(shards, part, **options)
    try:
        if case == "powersgd":
            assert [p.whole for p in part.pieces if p.name == "0.weight"] == [True]
        else:
            assert any(not p.whole for p in part.pieces), "the test must cut a tensor"
        expected_held, expected_central = worker_steps(plain, mode, codec, 8)
        held, central = worker_steps(sharded, mode, codec, 8)
        assert same_bits(central, expected_central), "the central model assembled from the shards"
        assert same_bits(held, expected_held), "the worker's weights"
        versions = [s["version"] for s in sharded.stats()["shards"]]
        assert versions[0] == versions[1] == plain.stats()["version"] > 1
        assert isinstance(sharded.pull().version, ShardVersions)
    finally:
        plain.close()
        sharded.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode_spec", [{"name": "diloco", "inner_steps": 4, "fragments": 2},
                                       {"name": "async_diloco", "inner_steps": 4, "fragments": 2,
                                        "dynamic_steps": False}], ids=["diloco", "async_diloco"])
def test_a_fragment_held_by_one_shard_is_pushed_to_that_shard_alone_with_the_bits_of_one_ps(start_ps, mode_spec):
    """Tensors kept whole: fragment 0 (``0.weight``) lies on shard 0, fragment 1 (the three others) on shard 1.
    Over 8 steps at H = 4, F = 2 the worker pushes fragment 1 at steps 2 and 6, fragment 0 at 4 and 8, and its
    flush pushes fragment 1 once more (steps 7 and 8 not pushed): one PS counts 5 versions, shard 0 the 2 of
    fragment 0 and shard 1 the 3 of fragment 1. Each shard is asked for its fragment only, and the weights and
    the central model are one PS's, bit for bit."""
    options = {"rank": 0, "world_size": 1, "request_timeout": 30, "heartbeat_s": None}
    mode = modes.get(mode_spec)
    one = start_ps(mode.name)
    shards = [start_ps(mode.name, shard=f"{i}/2") for i in range(2)]
    shapes = {"0.weight": (30, 20), "0.bias": (30,), "2.weight": (3, 30), "2.bias": (3,)}
    part = Partition(shapes, 2, max_piece=10**6)
    assert {p.name: p.shard for p in part.pieces} == {"0.weight": 0, "0.bias": 1, "2.weight": 1, "2.bias": 1}
    plain = PSClient(one, mode=mode.name, **options)
    sharded = ShardedClient(shards, part, mode=mode.name, **options)
    try:
        on_one, on_shards = {}, {}
        expected_held, expected_central = worker_steps(plain, mode, compressors.get("none"), 8, on_one)
        held, central = worker_steps(sharded, mode, compressors.get("none"), 8, on_shards)
        assert same_bits(central, expected_central), "the central model assembled from the shards"
        assert same_bits(held, expected_held), "the worker's weights"
        # a lone worker's pushes are never stale, on shards as on one PS (async_diloco's pace is set by it)
        staleness = [(s["staleness_mean"], s["staleness_max"]) for s in (on_one, on_shards)]
        assert staleness == [(0, 0), (0, 0)], staleness
        assert plain.stats()["version"] == 5
        assert [s["version"] for s in sharded.stats()["shards"]] == [2, 3]
        assert [c.counters.pushes for c in sharded.clients] == [2, 3]
    finally:
        plain.close()
        sharded.close()


# -- 4. downlink_fraction: each shard keeps its own copy of what each worker holds --------------------------------

@pytest.mark.integration
@pytest.mark.timeout(120)
def test_shards_answer_with_the_approximate_replies_of_one_ps_for_tensors_they_hold_whole(start_ps):
    """Per tensor, the share of coordinates furthest off: the same on a shard as on one PS for a tensor kept whole
    (a cut tensor's share is taken per slice, docs/design.md); pulls stay exact."""
    from tests.test_sharding import drive

    rng = np.random.default_rng(7)
    initial = {n: rng.standard_normal(s).astype(np.float32) for n, s in FOLD_SHAPES.items()}
    one = start_ps("asgd", downlink_fraction=0.25)
    shards = [start_ps("asgd", shard=f"{i}/2", downlink_fraction=0.25) for i in range(2)]
    part = Partition(FOLD_SHAPES, 2, max_piece=10**6)  # nothing cut: every tensor on one shard, whole
    assert all(p.whole for p in part.pieces) and all(part.by_shard)
    with one_ps_and_shards(one, shards, part, "asgd") as (plain, sharded):
        expected, expected_final = drive(plain, initial)
        got, got_final = drive(sharded, initial)
        for i, ((es, ev, em), (gs, gv, gm)) in enumerate(zip(expected, got, strict=True)):
            assert (gs, gv) == (es, ev) and same_bits(gm, em), f"push {i}"
        assert same_bits(got_final, expected_final)
        approx = [s["approx_replies"] for s in sharded[0].stats()["shards"]]
        assert all(a > 0 for a in approx) and sum(approx) == 2 * plain[0].stats()["approx_replies"], approx
