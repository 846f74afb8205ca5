"""A sharded PS (issue 21, phase 1): the partition, the fold on every slice, the handshake, a sharded fit.

The expected values come from one PS given the same pushes, never from the sharded code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.ports import free_port_block
from plug_asgd import compressors, modes
from plug_asgd.protocol.partition import PIECES_PER_SHARD, Partition, parse_shard
from plug_asgd.protocol.wire import Sparse
from plug_asgd.sharding.client import ShardedClient, ShardVersions
from plug_asgd.sharding.config import SHARDED_CODECS, SHARDED_MODES, check_sharded, shard_count
from plug_asgd.worker.client import PSClient, PSError
from plug_asgd.worker.errors import REPLY_KINDS
from tests.conftest import (
    ACCURACY_THRESHOLD,
    PLUG_ASGD,
    PYTHON,
    ProcessGroups,
    needs_fashion,
    params_to_run,
)
from tests.test_training import run_recipe

# a small CNN's shapes and an odd mix: one tensor much larger than the rest, one empty-ish, one scalar
SHAPES = {"conv.weight": (16, 3, 5, 5), "conv.bias": (16,), "fc.weight": (10, 400), "fc.bias": (10,),
          "bn.running_mean": (16,), "scale": (), "big": (300, 70)}


# -- 1. the partition (no processes) ----------------------------------------------------------------------

@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_every_coordinate_of_every_tensor_is_held_exactly_once(shards):
    part = Partition(SHAPES, shards)
    for name, shape in SHAPES.items():
        covered = np.zeros(math.prod(shape), dtype=np.int64)
        for p in part.pieces:
            if p.name == name:
                covered[p.start:p.stop] += 1
                assert 0 <= p.shard < shards
        assert (covered == 1).all(), name
    assert sum(part.loads) == sum(math.prod(s) for s in SHAPES.values())
    assert all(part.by_shard), "every shard holds something"
    keys = [p.key for p in part.pieces]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("shards", [2, 3, 4, 8])
def test_the_shards_are_balanced_within_the_stated_bound(shards):
    # the bound of the module's docstring: max load / mean <= 1 + 1 / PIECES_PER_SHARD (1.25)
    part = Partition(SHAPES, shards)
    mean = sum(part.loads) / shards
    assert max(part.loads) / mean <= 1 + 1 / PIECES_PER_SHARD
    # a model of many equal tensors: balanced by whole tensors, none cut
    even = Partition({f"t{i}": (1000,) for i in range(4 * shards)}, shards)
    assert max(even.loads) == min(even.loads)


def test_a_large_tensor_is_cut_into_contiguous_slices_over_every_shard():
    part = Partition(SHAPES, 2)
    big = [p for p in part.pieces if p.name == "big"]
    assert len(big) > 2 and not any(p.whole for p in big)
    assert {p.shard for p in big} == {0, 1}
    assert [p.start for p in big] == [0, *(p.stop for p in big[:-1])] and big[-1].stop == 300 * 70
    assert all(p.size <= part.max_piece for p in part.pieces)
    # small tensors stay whole, under their own name
    assert [p.key for p in part.pieces if p.name == "fc.bias"] == ["fc.bias"]


def test_the_partition_is_deterministic_and_independent_of_dict_order():
    one = Partition(SHAPES, 3)
    other = Partition(dict(reversed(list(SHAPES.items()))), 3)
    assert one.pieces == other.pieces and one.digest == other.digest
    assert Partition({k: list(v) for k, v in SHAPES.items()}, 3).digest == one.digest


def test_the_digest_changes_with_the_shapes_the_names_and_the_shard_count():
    base = Partition(SHAPES, 2).digest
    assert Partition(SHAPES, 3).digest != base
    assert Partition({**SHAPES, "fc.bias": (11,)}, 2).digest != base
    assert Partition({**SHAPES, "fc.weight": (400, 10)}, 2).digest != base  # same size, other shape
    renamed = {("head" if k == "fc.bias" else k): v for k, v in SHAPES.items()}
    assert Partition(renamed, 2).digest != base


def test_split_and_assemble_give_back_the_model_and_sparse_updates_keep_their_coordinates():
    rng = np.random.default_rng(0)
    part = Partition(SHAPES, 3)
    model = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    back = part.assemble(part.split(model))
    assert list(back) == sorted(SHAPES) and all(np.array_equal(back[n], model[n]) for n in SHAPES)
    indices = np.sort(rng.choice(300 * 70, 500, replace=False)).astype(np.int64)
    sparse = Sparse(indices=indices, values=rng.standard_normal(500).astype(np.float32), shape=(300, 70))
    dense = np.zeros(300 * 70, dtype=np.float32)
    for shard, pieces in enumerate(part.split({"big": sparse})):
        for key, piece in pieces.items():
            (p,) = [p for p in part.by_shard[shard] if p.key == key]
            assert isinstance(piece, Sparse) and piece.shape == (p.size,)
            dense[p.start:p.stop] += piece.to_dense()
    assert np.array_equal(dense.reshape(300, 70), sparse.to_dense())


def test_some_tensors_are_assembled_from_the_shards_that_hold_them_alone():
    """A fragment's reply: the named tensors from the parts of the shards asked, the others' parts empty."""
    rng = np.random.default_rng(1)
    part = Partition(SHAPES, 3)
    model = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    name = min(SHAPES, key=lambda n: int(np.prod(SHAPES[n])))  # the smallest tensor: whole, on one shard
    (held_by,) = {p.shard for p in part.pieces if p.name == name}
    parts = [pieces if shard == held_by else {} for shard, pieces in enumerate(part.split({name: model[name]}))]
    back = part.assemble(parts, {name})
    assert list(back) == [name] and np.array_equal(back[name], model[name])
    cut = next(n for n in SHAPES if len({p.shard for p in part.pieces if p.name == n}) > 1)  # over several shards
    parts = part.split({cut: model[cut]})
    assert np.array_equal(part.assemble(parts, {cut})[cut], model[cut])
    parts[next(i for i, p in enumerate(parts) if p)] = {}  # a shard that holds a piece of it did not answer
    with pytest.raises(KeyError, match="sent no"):
        part.assemble(parts, {cut})


def test_shard_specs_and_counts_are_checked():
    assert parse_shard("1/2") == (1, 2)
    for bad in ("2/2", "0", "a/b", "-1/2", "0/0"):
        with pytest.raises(ValueError, match="I/N"):
            parse_shard(bad)
    assert shard_count(None, None) == 1 and shard_count(None, 3) == 3
    assert shard_count(["tcp://a:1", "tcp://b:1"], None) == 2
    with pytest.raises(ValueError, match="lists 2 shards"):
        shard_count(["tcp://a:1", "tcp://b:1"], 3)
    with pytest.raises(ValueError, match="fewer shards"):
        Partition({"x": (2,)}, 3)


def test_only_hogwild_is_refused_sharded_saying_why_and_every_codec_is_taken():
    for name in modes.MODES:
        mode = modes.get(name)
        if name == "hogwild":  # its workers share one model in memory: the PS holds none, nothing to shard
            with pytest.raises(ValueError, match="holds no model at all: there is nothing to shard"):
                check_sharded(mode, compressors.get("none"), 2)
        else:
            assert name in SHARDED_MODES
            check_sharded(mode, compressors.get("none"), 2)
        check_sharded(mode, compressors.get("none"), 1)  # one PS: anything goes
    check_sharded(modes.get({"name": "asgd", "overlap": True}), compressors.get("none"), 2)
    assert set(SHARDED_CODECS) == set(compressors.COMPRESSORS)
    for name in compressors.COMPRESSORS:
        check_sharded(modes.get("asgd"), compressors.get(name), 2)


def test_the_strategy_refuses_a_sharded_setting_when_it_is_built():
    from plug_asgd import AsyncPSStrategy

    with pytest.raises(ValueError, match="mode='hogwild' takes no sharded PS"):
        AsyncPSStrategy(mode="hogwild", ps_shards=2)
    with pytest.raises(ValueError, match="ps_shards must be an integer >= 1"):
        AsyncPSStrategy(ps_shards=0)
    s = AsyncPSStrategy(mode="adacomp", ps_shards=2)
    assert s.ps_shards == 2
    assert AsyncPSStrategy(ps_address=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]).ps_shards == 2
    assert AsyncPSStrategy(mode="osp", ps_shards=2, compressor="qsgd", downlink_fraction=0.1).ps_shards == 2


def test_a_sharded_version_is_the_newest_shards_and_keeps_each_shards():
    v = ShardVersions([4, 6])
    assert v == 6 and v - 5 - 1 == 0 and v.per_shard == (4, 6)
    assert json.dumps({"version": v}) == '{"version": 6}'


# -- 2. the fold on every slice: two shards and one PS given the same pushes -------------------------------

FOLD_SHAPES = {"w": (48, 40), "b": (40,), "v": (7,), "k": (3, 3, 4)}


def push_sequence(seed: int = 0) -> list[tuple[int, object]]:
    """(rank, update) pushes of 3 ranks in turn, dense and sparse, all fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(12):
        rank = step % 3
        update = {}
        for name, shape in FOLD_SHAPES.items():
            size = math.prod(shape)
            if step % 4 == 1 and name == "b":
                continue  # a push that leaves a tensor out
            if step % 2:  # sparse: a few coordinates (none of a small tensor, sometimes)
                k = int(rng.integers(0, max(1, size // 8)))
                idx = np.sort(rng.choice(size, k, replace=False)).astype(np.int64)
                update[name] = Sparse(indices=idx, values=rng.standard_normal(k).astype(np.float32),
                                      shape=shape)
            else:
                update[name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        out.append((rank, update))
    return out


def drive(clients: list, initial: dict) -> tuple[list, dict]:
    """Hello, init by rank 0, then the push sequence, each rank based on its own last reply (so stale):
    every reply's (status, version, model) and the final model."""
    for c in clients:
        c.hello(stage=1, training=True, timeout=30)
    assert clients[0].init(initial)
    last = [c.pull() for c in clients]
    seen = []
    for rank, update in push_sequence():
        reply = clients[rank].push(last[rank].version, update, want_model=True)
        last[rank] = reply
        seen.append((reply.status, int(reply.version), {n: np.array(t) for n, t in reply.tensors.items()}))
    final = clients[0].pull()
    return seen, {n: np.array(t) for n, t in final.tensors.items()}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].shape == b[n].shape and a[n].tobytes() == b[n].tobytes() for n in a)


@contextmanager
def one_ps_and_shards(one: str, shards: list[str], part: Partition, mode: str,
                      ranks: int = 3) -> Iterator[tuple[list[PSClient], list[ShardedClient]]]:
    """``ranks`` clients of the one PS at ``one`` and as many of the ``shards``, closed at the end."""
    options = {"world_size": ranks, "mode": mode, "request_timeout": 30, "heartbeat_s": None}
    plain = [PSClient(one, rank=r, **options) for r in range(ranks)]
    sharded = [ShardedClient(shards, part, rank=r, **options) for r in range(ranks)]
    try:
        yield plain, sharded
    finally:
        for c in plain + sharded:
            c.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["asgd", "adacomp", "dynsgd", "ssp"])
def test_two_shards_fold_a_push_sequence_into_the_bits_of_one_ps(start_ps, mode):
    rng = np.random.default_rng(1)
    initial = {n: rng.standard_normal(s).astype(np.float32) for n, s in FOLD_SHAPES.items()}
    one = start_ps(mode)
    shards = [start_ps(mode, shard=f"{i}/2") for i in range(2)]
    part = Partition(FOLD_SHAPES, 2)
    assert any(not p.whole for p in part.pieces), "the test must cut a tensor"
    with one_ps_and_shards(one, shards, part, mode) as (plain, sharded):
        expected, expected_final = drive(plain, initial)
        got, got_final = drive(sharded, initial)
        for i, ((es, ev, em), (gs, gv, gm)) in enumerate(zip(expected, got, strict=True)):
            assert (gs, gv) == (es, ev), f"push {i}"
            assert same_bits(gm, em), f"push {i}: the assembled model differs from one PS's"
        assert same_bits(got_final, expected_final)
        assert not same_bits(got_final, initial)
        # versions are per shard: every push reached both, and each counts its own
        assert [s["version"] for s in sharded[0].stats()["shards"]] == [12, 12]
        # the sparse pushes made replies that carried only what changed, per shard
        assert sharded[0].counters.delta_replies > 0



@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_push_answered_own_by_one_shard_and_raced_on_the_other_gets_the_model_assembled(start_ps):
    """Shard 1 saw another push first: its pieces come back folded; shard 0 said "own", so its are pulled."""
    shards = [start_ps("asgd", shard=f"{i}/2") for i in range(2)]
    part = Partition(FOLD_SHAPES, 2)
    rng = np.random.default_rng(2)
    initial = {n: rng.standard_normal(s).astype(np.float32) for n, s in FOLD_SHAPES.items()}
    update = {n: rng.standard_normal(s).astype(np.float32) for n, s in FOLD_SHAPES.items()}
    raced = {n: rng.standard_normal(s).astype(np.float32) for n, s in FOLD_SHAPES.items()}
    options = {"world_size": 2, "mode": "asgd", "request_timeout": 20, "heartbeat_s": None}
    a, b = (ShardedClient(shards, part, rank=r, **options) for r in range(2))
    try:
        for c in (a, b):
            c.hello(stage=1, training=True, timeout=20)
        assert a.init(initial)
        base = a.pull().version
        b.pull()
        # a lone push, nothing raced: "own" from both shards, no model
        alone = a.push(base, update, want_model="unless_own")
        assert alone.own and not alone.tensors and alone.version.per_shard == (1, 1)
        held = {n: update[n] + initial[n] for n in FOLD_SHAPES}  # what "own" means: base + update, float32
        # rank b pushes to shard 1 alone, then a pushes to both, based on what it holds
        b.clients[1].push(1, part.split(raced)[1], want_model=False)
        reply = a.push(alone.version, update, want_model="unless_own")
        assert not reply.own and reply.status == "applied" and reply.version.per_shard == (2, 3)
        on_1 = {p.name for p in part.by_shard[1]}
        for name in FOLD_SHAPES:
            once = update[name] + held[name]
            twice = update[name] + (raced[name] + held[name])
            expected = once.reshape(-1).copy()
            for p in part.pieces:
                if p.name == name and p.shard == 1:
                    expected[p.start:p.stop] = twice.reshape(-1)[p.start:p.stop]
            assert reply.tensors[name].tobytes() == expected.reshape(FOLD_SHAPES[name]).tobytes(), name
        assert on_1 and a.counters.own_replies == 1 and a.counters.pushes == 2
        # each shard's replies by kind: the pull after the init (nothing changed), the lone push's "own" from both,
        # the raced push's "own" from shard 0 and its pieces whole from shard 1, then shard 0's pulled
        assert a.counters.replies == {**dict.fromkeys(REPLY_KINDS, 0), "pulled_delta": 2, "own": 3, "whole": 1,
                                      "pulled": 1}
    finally:
        a.close()
        b.close()



@pytest.mark.integration  # sockets (no PS behind them: the requests are stand-ins)
@pytest.mark.timeout(30)
def test_a_push_goes_to_every_shard_at_once_not_one_after_the_other(monkeypatch):
    import threading
    import time

    from plug_asgd.worker.model_reply import ModelReply

    calls: list[tuple[str, float, float, str]] = []

    def slow(kind):
        def request(self, *args, **kwargs):
            start = time.monotonic()
            time.sleep(0.4)  # a slow shard's round trip
            calls.append((self.address, start, time.monotonic(), threading.current_thread().name))
            return ModelReply(version=3, status="applied" if kind == "push" else "pulled", stop=False,
                              tensors=part.split(model)[int(self.address[-1]) - 1] if kind == "pull" else {})
        return request

    part = Partition(FOLD_SHAPES, 2)
    model = {n: np.zeros(s, np.float32) for n, s in FOLD_SHAPES.items()}
    monkeypatch.setattr(PSClient, "push", slow("push"))
    monkeypatch.setattr(PSClient, "pull", slow("pull"))
    client = ShardedClient(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], Partition(FOLD_SHAPES, 2), rank=0,
                           world_size=1, mode="asgd", heartbeat_s=None)
    try:
        start = time.monotonic()
        reply = client.push(ShardVersions([2, 2]), model, want_model=False)
        pulled = client.pull()
        took = time.monotonic() - start
    finally:
        client.close()
    assert reply.version.per_shard == (3, 3) and pulled.tensors.keys() == model.keys()
    assert took < 1.2, f"two requests of 0.4 s to each of 2 shards took {took:.2f} s: one shard after the other"
    for first, second in (calls[0:2], calls[2:4]):  # each request's two shards overlapped, in two threads
        assert {first[0], second[0]} == {"tcp://127.0.0.1:1", "tcp://127.0.0.1:2"}
        assert max(first[1], second[1]) < min(first[2], second[2]) and first[3] != second[3]


# -- 3. the handshake: a worker that cuts the model otherwise is refused, saying what to do -----------------

@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_worker_with_another_partition_is_refused_with_what_to_do(start_ps):
    shards = [start_ps("asgd", shard=f"{i}/2") for i in range(2)]
    lone = start_ps("asgd")
    options = {"world_size": 2, "mode": "asgd", "request_timeout": 20, "heartbeat_s": None}
    opened: list = []

    def sharded(addresses, shapes, rank=1, count=2):
        client = ShardedClient(addresses, Partition(shapes, count), rank=rank, **options)
        opened.append(client)
        return client

    def refusal(client) -> str:
        with pytest.raises(PSError) as info:
            client.hello(stage=1, training=True, timeout=20)
        assert info.value.code == "partition_mismatch"
        return str(info.value)

    try:
        first = sharded(shards, FOLD_SHAPES, rank=0)
        first.hello(stage=1, training=True, timeout=20)
        assert first.init({n: np.zeros(s, np.float32) for n, s in FOLD_SHAPES.items()})
        # other shapes: the digest differs from the one the shards were first given
        message = refusal(sharded(shards, {**FOLD_SHAPES, "b": (41,)}))
        assert "names or shapes differ" in message and "same compressor on every worker" in message
        # another shard count (three addresses, the first again as the third)
        message = refusal(sharded([*shards, shards[0]], FOLD_SHAPES, count=3))
        assert "is shard 0 of 2" in message and "over 3 shards" in message
        # the shards listed out of order
        assert "in the order of their --shard" in refusal(sharded(shards[::-1], FOLD_SHAPES))
        # a worker that asks one shard for the whole model, and a sharded one pointed at a lone PS
        plain = PSClient(shards[0], rank=1, **options)
        opened.append(plain)
        assert "give the strategy every shard's address" in refusal(plain)
        assert "started without --shard" in refusal(sharded([lone, shards[1]], FOLD_SHAPES))
        # the worker that agrees still trains: none of the refusals changed the shards
        assert first.pull().version.per_shard == (0, 0)
    finally:
        for c in opened:
            c.close()


# -- 4. a sharded fit: 2 Lightning workers, embedded shards (ps_shards=2) or shards started by hand ----------

# the fits of tests/scripts/shard_fit.py's FITS: every mode that works sharded, the codecs and downlink_fraction
# spread over them (sync: bf16, localsgd: qsgd and downlink_codec int4, sagn: sign, osp: powersgd, agn:
# downlink_fraction)
FIT_MODES = ["asgd", "adacomp", "dynsgd", "ssp", "downpour", "agn", "asgd_overlap", "sync", "sync_backup", "localsgd",
             "sagn", "osp", "losp", "easgd", "eamsgd", "diloco_fragments"]
# 2 workers x 40 steps (2 epochs of 20), a push every step but every push_every (tau) steps in these
# (agn: as many steps as its 2 workers, its default)
PUSH_EVERY = {"downpour": 4, "agn": 2, "localsgd": 4, "sagn": 4, "losp": 4, "easgd": 4, "eamsgd": 4}
# a synchronous round is one version for both workers' pushes
ROUNDS = {"sync", "localsgd", "sagn", "osp", "losp", "diloco_fragments"}
# diloco_fragments (H = 8, F = 2): a fragment every 4 steps, and at the fit's end fragment 1 (last pushed at step 36)
PUSHES = {"diloco_fragments": 11}
# every fit's bar, at shard_fit's common step size (0.4; no fit has settings of its own). Measured on 2
# loaded cores, 5 launches: every fit but sagn's ended at 0.924-0.977 (the lowest: agn 0.924, eamsgd 0.930, easgd
# 0.955, downpour 0.963; the others 0.961 or more); the bar is bn_sched's for this model (test_training's BatchNorm
# test), 2.4 points under the lowest. sagn cannot reach it: its 10 synchronous rounds, each the workers' 4 steps
# averaged and divided by 4, end at 0.811 in all 5 (deterministic: bit for bit the same on one PS), 0.64 at a step
# size of 0.1 and 0.84 at 0.8. It is marked xfail with these numbers (no settings of its own here); with its own step
# size (lr 0.003) sagn reaches the suite's Fashion-MNIST threshold (test_training's scheme launch)
FIT_ACCURACY = 0.9
SHORT_OF_THE_BAR = {"sagn": "sagn ends this model's 40 steps at 0.811 at the common step size (0.64 at 0.1, 0.84 at "
                            "0.8), on one PS too: under the common 0.9"}
# the suite's fits: one for each way a worker exchanges with the shards (a push each step, dense and sparse, pushes
# overlapped, sync rounds with and without a backup, local steps, rounds overlapped, elastic) and the codecs and
# downlink_fraction spread over them; the full tier fits the others (dynsgd, ssp, downpour, sagn, losp, eamsgd,
# diloco's fragments: shown to fold on 2 shards what one PS folds, bit for bit, in tests/test_sharding_modes.py)
SUITE_FIT_MODES = ("asgd", "adacomp", "asgd_overlap", "sync", "sync_backup", "localsgd", "osp", "easgd", "agn")


def fit_param(mode: str, xfail: bool = False) -> Any:
    """``mode`` as a parameter of the sharded fits' tests: the full tier's where the suite leaves it out, and, where
    ``xfail``, expected under the common bar (SHORT_OF_THE_BAR)."""
    marks = [] if mode in SUITE_FIT_MODES else [pytest.mark.full]
    if xfail and mode in SHORT_OF_THE_BAR:
        marks.append(pytest.mark.xfail(reason=SHORT_OF_THE_BAR[mode], strict=True))
    return pytest.param(mode, marks=marks)


def fit_versions(mode: str) -> int:
    """Each shard's version after a fit: one per push, or per round of the two workers' pushes."""
    pushes = fit_pushes(mode)
    return pushes if mode in ROUNDS else 2 * pushes


def fit_pushes(mode: str) -> int:
    """Each worker's pushes in a fit: one every push_every steps, or PUSHES's."""
    return PUSHES.get(mode, 40 // PUSH_EVERY.get(mode, 1))


def fit_results(out: Path, mode: str, log: str) -> list[dict]:
    missing = [r for r in (0, 1) if not (out / mode / f"rank{r}.json").exists()]
    assert not missing, f"{mode}: rank(s) {missing} wrote no result:\n{log[-4000:]}"
    return [json.loads((out / mode / f"rank{r}.json").read_text()) for r in (0, 1)]


def check_fit(ranks: list[dict], mode: str, accuracy: bool = True) -> None:
    """What a sharded fit must show: its steps, each shard's version, its pushes, the same model on both workers and
    the central one; and (``accuracy``) the test accuracy of FIT_ACCURACY."""
    partly = sum(r["comm"]["partly_applied"] for r in ranks)
    for r in ranks:
        assert r["steps"] == 40
        # every push reached both shards: each shard's own version counts them all (or their rounds)
        if mode == "sync_backup":
            # a round of the first push each shard got, the other dropped there: which worker's came first, and
            # so how many rounds there were, is each shard's own (measured 62/63 and 64/63 on 2 loaded cores).
            # Every shard got all 80 pushes, took each or dropped it, and made a round of each one it took.
            for version, pushes in zip(r["shard_versions"], r["shard_pushes"], strict=True):
                assert pushes["by_rank"] == {"0": 40, "1": 40}, r["shard_pushes"]
                assert pushes["applied"] + pushes["dropped"] == 80 and version == pushes["applied"], r
                assert 40 <= version <= 80, r["shard_versions"]
            # and a push one shard took and the other dropped (partly applied) is the one way their rounds part
            assert abs(r["shard_versions"][0] - r["shard_versions"][1]) <= partly, (r["shard_versions"], partly)
        else:
            assert r["shard_versions"] == [fit_versions(mode)] * 2, r["shard_versions"]
            assert partly == 0, partly
        if accuracy:
            assert r["test_acc"] >= FIT_ACCURACY, r["test_acc"]
        assert r["comm"]["pushes"] == fit_pushes(mode)
        # downlink_fraction (agn's fit): the shards answered pushes with only the largest differences; downlink_codec
        # (localsgd's): every reply to a push in 4-bit differences, on each shard to each of the 2 workers
        approx = {"agn": r["approx_replies"] > 0, "localsgd": r["approx_replies"] == 2 * 2 * fit_pushes(mode)}
        assert approx.get(mode, r["approx_replies"] == 0), r["approx_replies"]
    # both workers ended on the same model, and it is the central one assembled from the shards
    assert ranks[0]["held"] == ranks[1]["held"]
    assert ranks[0]["held"] == ranks[0]["central"]


@pytest.fixture(scope="module")
def sharded_fits(request, tmp_path_factory):
    """tests/scripts/shard_fit.py under each of FIT_MODES this session's tests check, with ps_shards=2, one fit after
    another in one launch."""
    modes = params_to_run(request, "mode")
    out = tmp_path_factory.mktemp("shard_fit")
    base = free_port_block(2 * len(modes))
    ports = ",".join(str(base + 2 * i) for i in range(len(modes)))
    groups = ProcessGroups()
    try:
        code, log = groups.run([PYTHON, "tests/scripts/shard_fit.py", "--modes", ",".join(modes), "--ps-ports",
                                ports, "--out", str(out)], timeout=270)
    finally:
        left = groups.leftovers()
        for p in groups.procs:
            groups.kill(p)
    assert not left, f"processes left running: {left}"
    assert code == 0, log[-4000:]
    return out, log


@pytest.mark.integration
@pytest.mark.timeout(300)  # the launch, when this test is the first to need it
@pytest.mark.parametrize("mode", [fit_param(m) for m in FIT_MODES])
def test_two_workers_fit_on_two_embedded_shards(sharded_fits, mode):
    out, log = sharded_fits
    check_fit(fit_results(out, mode, log), mode, accuracy=False)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [fit_param(m, xfail=True) for m in FIT_MODES])
def test_every_fit_on_two_embedded_shards_reaches_the_common_bar(sharded_fits, mode):
    out, log = sharded_fits
    for r in fit_results(out, mode, log):
        assert r["test_acc"] >= FIT_ACCURACY, r["test_acc"]


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_two_workers_fit_on_shards_started_by_hand_with_serve_ps(procs, tmp_path):
    base = free_port_block(2)
    shards = [procs.start([PLUG_ASGD, "serve-ps", "--port", str(base + i), "--mode", "adacomp", "--shard", f"{i}/2",
                           "--workers", "2", "--linger", "5", "--quiet"]) for i in range(2)]
    addresses = ",".join(f"tcp://127.0.0.1:{base + i}" for i in range(2))
    code, log = procs.run([PYTHON, "tests/scripts/shard_fit.py", "--modes", "adacomp", "--ps-address", addresses,
                           "--out", str(tmp_path)], timeout=120)
    assert code == 0, log[-4000:]
    check_fit(fit_results(tmp_path, "adacomp", log), "adacomp")
    for shard in shards:  # every worker left: each shard exits by itself
        ps_out, _ = shard.communicate(timeout=30)
        assert shard.returncode == 0 and "all 2 workers have left" in ps_out, ps_out[-2000:]
        assert "of a sharded model" in ps_out


# the core modes and every codec train the recipe's Fashion-MNIST runs on 2 shards to the suite's threshold in
# tests/test_training.py (its sharded_runs); this is the recipe's own command line with --ps-shards and a Supervisor
@needs_fashion
@pytest.mark.integration
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["asgd"])
def test_the_recipe_on_two_shards_trains_fashion_mnist_to_the_suites_threshold(procs, tmp_path, mode):
    run = run_recipe(procs, tmp_path, "--workers", "2", "--mode", mode, "--ps-shards", "2", "--supervise-every", "60",
                     timeout=170)
    assert run["test_acc"] >= ACCURACY_THRESHOLD, run
    # the Supervisor evaluated the central model assembled from both shards while the workers trained
    records = [json.loads(line) for line in (Path(run["log_dir"]) / "supervisor.jsonl").read_text().splitlines()]
    assert records and max(r["test_acc"] for r in records) > 0.5, records
    assert run["ps_version"] == 250  # shard 0's: 8000 images / 2 workers / batch 32 = 125 pushes each
    if mode == "asgd":  # the whole model pushed over the sockets (no shared memory sharded), summed over shards
        assert run["push_local_bytes"] == 0 and run["push_bytes"] > 250 * 4_799_528, run
