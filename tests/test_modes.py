"""The PS's fold-in rules against hand-computed central models."""

import numpy as np
import pytest

from plug_asgd import modes
from plug_asgd.modes import APPLIED, DROPPED, AdaCompRule, AsgdRule, CentralState, Push, SyncRule
from plug_asgd.protocol.wire import Sparse


def sparse(idx, val, n=8):
    idx = np.array(idx, dtype=np.int64)
    return Sparse(idx, np.full(idx.size, val, np.float32), (n,))


def test_asgd_adds_every_update_at_once_whatever_its_base():
    state = CentralState({"w": np.zeros(3, np.float32)})
    rule = AsgdRule()
    assert rule.push(state, Push("a", 0, 0, {"w": np.array([1, 2, 3], np.float32)})) == [("a", APPLIED)]
    assert rule.push(state, Push("b", 1, 0, {"w": sparse([2], 10.0, 3)})) == [("b", APPLIED)]
    np.testing.assert_array_equal(state.tensors["w"], [1, 2, 13])
    assert state.version == 2


def test_adacomp_scales_each_coordinate_by_its_own_staleness():
    state = CentralState({"w": np.zeros(8, np.float32)})
    rule = AdaCompRule()
    # Three fresh updates (each based on the version current when it was sent): scale 1.
    rule.push(state, Push("u1", 0, 0, {"w": sparse([1, 2, 3], 1.0)}))  # -> version 1
    rule.push(state, Push("u2", 1, 1, {"w": sparse([2, 3], 1.0)}))  # -> version 2
    rule.push(state, Push("u3", 0, 2, {"w": sparse([3, 5], 1.0)}))  # -> version 3
    np.testing.assert_array_equal(state.tensors["w"], [0, 1, 2, 3, 0, 1, 0, 0])
    # A push based on version 0 touching {0, 2, 3, 5}. Updates since: u1{1,2,3}, u2{2,3}, u3{3,5}.
    # By hand: s_0 = 0, s_2 = 2 (u1, u2), s_3 = 3 (u1, u2, u3), s_5 = 1 (u3).
    np.testing.assert_array_equal(rule.staleness(0, "w", np.array([0, 2, 3, 5])), [0, 2, 3, 1])
    rule.push(state, Push("p", 1, 0, {"w": sparse([0, 2, 3, 5], 6.0)}))
    # increments 6/max(1,0)=6, 6/2=3, 6/3=2, 6/1=6
    np.testing.assert_allclose(state.tensors["w"], [6, 1, 5, 5, 0, 7, 0, 0])
    assert state.version == 4


def test_adacomp_counts_a_dense_update_as_touching_everything():
    state = CentralState({"w": np.zeros(4, np.float32)})
    rule = AdaCompRule()
    rule.push(state, Push("d", 0, 0, {"w": np.ones(4, np.float32)}))
    rule.push(state, Push("s", 1, 0, {"w": sparse([1], 4.0, 4)}))
    np.testing.assert_allclose(state.tensors["w"], [1, 5, 1, 1])  # s_1 = 1 -> scale 1


def test_adacomp_history_bound_is_counted():
    state = CentralState({"w": np.zeros(4, np.float32)})
    rule = AdaCompRule(history=2)
    for v in range(4):
        rule.push(state, Push(v, 0, v, {"w": sparse([0], 1.0, 4)}))
    rule.push(state, Push("old", 1, 0, {"w": sparse([0], 2.0, 4)}))
    assert rule.truncated == 1
    assert state.tensors["w"][0] == pytest.approx(4 + 2 / 2)  # only 2 of the 4 remembered


def test_sync_averages_a_full_round_and_releases_it_together():
    state = CentralState({"w": np.zeros(2, np.float32)})
    rule = SyncRule()
    rule.set_trainers(state, frozenset({0, 1, 2}))
    assert rule.push(state, Push("a", 0, 0, {"w": np.array([3, 0], np.float32)})) == []
    assert rule.push(state, Push("b", 1, 0, {"w": np.array([0, 3], np.float32)})) == []
    assert state.version == 0 and not state.tensors["w"].any()
    done = rule.push(state, Push("c", 2, 0, {"w": np.array([3, 3], np.float32)}))
    assert sorted(done) == [("a", APPLIED), ("b", APPLIED), ("c", APPLIED)]
    np.testing.assert_allclose(state.tensors["w"], [2, 2])
    assert state.version == 1


def test_sync_drops_stale_updates_and_backup_workers_are_not_waited_for():
    state = CentralState({"w": np.zeros(1, np.float32)})
    rule = SyncRule(replicas_to_aggregate=2)
    rule.set_trainers(state, frozenset({0, 1, 2}))
    rule.push(state, Push("a", 0, 0, {"w": np.array([2], np.float32)}))
    assert rule.push(state, Push("b", 1, 0, {"w": np.array([4], np.float32)})) == [("a", APPLIED), ("b", APPLIED)]
    assert rule.push(state, Push("slow", 2, 0, {"w": np.array([100], np.float32)})) == [("slow", DROPPED)]
    np.testing.assert_allclose(state.tensors["w"], [3])
    assert state.version == 1


def test_sync_round_completes_when_a_worker_leaves():
    state = CentralState({"w": np.zeros(1, np.float32)})
    rule = SyncRule()
    rule.set_trainers(state, frozenset({0, 1}))
    assert rule.push(state, Push("a", 0, 0, {"w": np.array([2], np.float32)})) == []
    assert rule.set_trainers(state, frozenset({0})) == [("a", APPLIED)]
    np.testing.assert_allclose(state.tensors["w"], [2])


def test_sync_refuses_a_second_update_from_the_same_worker_in_one_round():
    state = CentralState({"w": np.zeros(1, np.float32)})
    rule = SyncRule()
    rule.set_trainers(state, frozenset({0, 1}))
    rule.push(state, Push("a1", 0, 0, {"w": np.array([2], np.float32)}))
    assert rule.push(state, Push("a2", 0, 0, {"w": np.array([2], np.float32)})) == [("a2", DROPPED)]


def test_a_sync_round_held_in_a_checkpoint_completes_to_the_same_bits_and_answers_the_push_sent_again():
    # a standby that joins mid-round, or a PS resumed from a checkpoint taken then, holds the round's pushes
    # (their tokens do not travel: a worker sends its push again, and is answered as the round completes)
    def round_so_far():
        state = CentralState({"w": np.arange(8, dtype=np.float32), "b": np.ones(3, np.float32)})
        rule = SyncRule()
        rule.set_trainers(state, frozenset({0, 1, 2}))
        rule.push(state, Push("a", 2, 0, {"w": np.linspace(-1, 1, 8, dtype=np.float32),
                                          "b": np.array([0.1, 0.2, 0.3], np.float32)}, session="s2"))
        rule.push(state, Push("b", 0, 0, {"w": sparse([1, 6], 0.7), "b": np.full(3, 1 / 3, np.float32)},
                              session="s0"))
        return state, rule

    state, rule = round_so_far()
    fields, arrays = rule.state()
    copy_state, _ = round_so_far()
    copy = SyncRule()
    copy.set_trainers(copy_state, frozenset({0, 1, 2}))
    copy.restore(fields, {k: v.copy() for k, v in arrays.items()})
    assert [(p.token, p.rank, p.session) for p in copy.pending] == [(None, 2, "s2"), (None, 0, "s0")]
    assert copy.adopt("s2", "a again") and not copy.adopt("s1", "never pushed")
    last = {"w": np.full(8, 0.25, np.float32), "b": np.zeros(3, np.float32)}
    done = rule.push(state, Push("c", 1, 0, dict(last), session="s1"))
    again = copy.push(copy_state, Push("c", 1, 0, dict(last), session="s1"))
    assert sorted(done) == [("a", APPLIED), ("b", APPLIED), ("c", APPLIED)]
    assert sorted(again, key=str) == sorted([(None, APPLIED), ("a again", APPLIED), ("c", APPLIED)], key=str)
    for name in ("w", "b"):  # summed in rank order on both: the same bits
        assert state.tensors[name].tobytes() == copy_state.tensors[name].tobytes()
    # by hand: w = 0..7 + (0.7 at 1 and 6, + linspace, + 0.25) / 3
    expected = np.arange(8, dtype=np.float32) + (np.where(np.isin(np.arange(8), [1, 6]), 0.7, 0)
                                                  + np.linspace(-1, 1, 8) + 0.25) / 3
    np.testing.assert_allclose(state.tensors["w"], expected, rtol=1e-6)


def test_unknown_mode_lists_the_modes():
    with pytest.raises(ValueError, match="asgd, adacomp, .*sync"):
        modes.get("nope")


def test_the_store_folds_into_a_copy_while_a_zero_copy_reply_is_in_flight():
    from plug_asgd.ps import PSConfig
    from plug_asgd.ps.fast_store import FastStore
    from plug_asgd.ps.store_records import PushIn

    store = FastStore(PSConfig(), copy_threshold=0)  # (every frame of a reply tracked, however small)
    store.init({"w": np.zeros(4, np.float32)})
    sent = store.state.tensors["w"]
    reply = store.reply_payload({"rid": 1})  # not sent yet: ZeroMQ may still read its frames
    one = Sparse(np.array([1]), np.ones(1, np.float32), (4,))  # a sparse update is folded in place

    def push(seq: int) -> None:
        folded = store.fold(PushIn("token", 0, "session", seq, store.version, {"w": one}))
        assert folded.resolutions == [("token", APPLIED)]

    push(0)
    assert store.state.tensors["w"] is not sent and store.stats.copies_on_write == 1
    assert not sent.any()  # what the reply in flight references is untouched
    now = store.state.tensors["w"]
    del reply  # its frames released: nothing in flight any more, so the next fold writes in place
    push(1)
    assert store.state.tensors["w"] is now and store.stats.copies_on_write == 1
    np.testing.assert_array_equal(now, [0, 2, 0, 0])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("into", ["update", "spares"])
@pytest.mark.parametrize("rule_name", ["asgd", "dynsgd", "ssp"])
def test_folding_out_of_place_gives_the_same_bits_and_never_writes_the_old_model_or_the_update(
        rule_name, into, threads):
    """Into the push's own buffers (received frames), or into spare arrays while the update is read-only
    (a worker's shared memory): the bits of an in-place fold, and nothing but ``out`` is written."""
    from plug_asgd.modes import MODES
    from plug_asgd.modes.slices import SlicePool

    rng = np.random.default_rng(3)
    w0 = {"w": rng.standard_normal((5, 7)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    pushes = [(rank, base, {n: (rng.standard_normal(t.shape) * 1e-3).astype(np.float32) for n, t in w0.items()})
              for rank, base in [(0, 0), (1, 0), (0, 1), (1, 1), (0, 4)]]
    in_place = CentralState({n: t.copy() for n, t in w0.items()})
    # a pool of 3 threads splits every tensor of more than 4 values in 3 slices
    folded = CentralState({n: t.copy() for n, t in w0.items()}, pool=SlicePool(threads, min_split=4))
    rule_a, rule_b = MODES[rule_name]().make_rule(), MODES[rule_name]().make_rule()
    assert rule_b.folds_into_update
    rule_a.set_trainers(in_place, frozenset({0, 1}))
    rule_b.set_trainers(folded, frozenset({0, 1}))
    first = folded.tensors["w"]
    for i, (rank, base, update) in enumerate(pushes):
        rule_a.push(in_place, Push(i, rank, base, {n: u.copy() for n, u in update.items()}))
        mine = {n: u.copy() for n, u in update.items()}
        if into == "update":
            out = mine
        else:
            for u in mine.values():
                u.flags.writeable = False  # as a view of a worker's shared memory is
            out = {n: np.full_like(u, np.nan) for n, u in mine.items()}
        rule_b.push(folded, Push(i, rank, base, mine, out))
        assert all(folded.tensors[n] is out[n] for n in mine)  # the new model is in the buffers given
        if into == "spares":
            for n in mine:
                np.testing.assert_array_equal(mine[n], update[n])
    for n in w0:  # bit for bit
        np.testing.assert_array_equal(folded.tensors[n].view(np.uint32), in_place.tensors[n].view(np.uint32))
    np.testing.assert_array_equal(first, w0["w"])  # the model a reply may still be sending is untouched


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e38])
def test_a_push_folded_out_of_place_that_is_or_would_make_the_model_non_finite_is_refused_whole(bad, threads):
    from plug_asgd.modes.slices import SlicePool
    from plug_asgd.protocol.wire import WireError

    state = CentralState({"a": np.ones(3, np.float32), "b": np.full(4, 3e38, np.float32)}, version=7,
                         pool=SlicePool(threads, min_split=2))
    before = {n: t.copy() for n, t in state.tensors.items()}
    update = {"a": np.ones(3, np.float32), "b": np.array([0, 0, 0, bad], np.float32)}  # in the last slice
    with pytest.raises(WireError) as err:
        AsgdRule().push(state, Push("t", 0, 7, update, update))
    assert err.value.code == "not_finite"
    assert state.version == 7
    for n in before:
        np.testing.assert_array_equal(state.tensors[n], before[n])


def test_dynsgd_scales_by_one_over_staleness_plus_one():
    from plug_asgd.modes import DynSGDRule

    state = CentralState({"w": np.zeros(2, np.float32)})
    rule = DynSGDRule()
    rule.push(state, Push("a", 0, 0, {"w": np.array([6, 0], np.float32)}))  # fresh: 6/1
    rule.push(state, Push("b", 1, 0, {"w": np.array([0, 6], np.float32)}))  # one behind: 6/2
    rule.push(state, Push("c", 0, 0, {"w": np.array([6, 6], np.float32)}))  # two behind: 6/3
    np.testing.assert_allclose(state.tensors["w"], [8, 5])
    # one its worker scaled (scaled_for): the PS's correction (here the store's (1 + 1) / (1 + 3) for a push
    # scaled for 1 landing 3 behind) and nothing more
    rule.push(state, Push("d", 1, 0, {"w": np.array([4, 0], np.float32)}, scale=0.5, scaled_by_worker=True))
    np.testing.assert_allclose(state.tensors["w"], [10, 5])


def test_ssp_holds_a_worker_more_than_the_bound_ahead_until_the_slowest_pushes():
    from plug_asgd.modes import SSPRule

    state = CentralState({"w": np.zeros(1, np.float32)})
    rule = SSPRule(staleness_bound=1)
    rule.set_trainers(state, frozenset({0, 1}))
    one = {"w": np.ones(1, np.float32)}
    assert rule.push(state, Push("a1", 0, 0, one)) == [("a1", APPLIED)]  # clocks 1:0, drift 1
    assert rule.push(state, Push("a2", 0, 1, one)) == []  # clocks 2:0, drift 2 > 1: waits...
    assert state.tensors["w"][0] == 2  # ...but its update is already folded in
    assert sorted(rule.push(state, Push("b1", 1, 0, one))) == [("a2", APPLIED), ("b1", APPLIED)]  # 2:1
    assert rule.push(state, Push("a3", 0, 3, one)) == []  # 3:1
    assert rule.set_trainers(state, frozenset({0})) == [("a3", APPLIED)]  # the slow one left training


def test_a_slice_pool_covers_the_range_once_in_order_and_splits_only_large_ranges():
    from plug_asgd.modes.slices import SlicePool

    pool = SlicePool(3, min_split=10)
    try:
        assert pool.map(lambda s: (s.start, s.stop), 9) == [(0, 9)]
        assert pool.map(lambda s: (s.start, s.stop), 10) == [(0, 3), (3, 6), (6, 10)]
        assert SlicePool(1).map(lambda s: (s.start, s.stop), 1 << 20) == [(0, 1 << 20)]
    finally:
        pool.close()
    with pytest.raises(ValueError, match="threads"):
        SlicePool(0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_all_finite_finds_any_nan_or_inf_and_is_not_fooled_by_squares_that_overflow(dtype):
    from plug_asgd.modes import all_finite

    big = np.finfo(dtype).max / 2
    assert all_finite(np.array([big, -big, 1.0], dtype))  # x . x overflows, yet every value is finite
    assert all_finite(np.zeros((3, 4), dtype)) and all_finite(np.zeros(0, dtype))
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(1000, dtype)
        x[777] = bad
        assert not all_finite(x), bad
        assert not all_finite(x.reshape(10, 100)), bad


# -- the modes as objects -----------------------------------------------------------------------------


def test_get_takes_a_name_an_instance_or_a_dict():
    from plug_asgd.modes import MODES, SSP, Downpour

    ssp = SSP(staleness_bound=3)
    assert modes.get(ssp) is ssp
    assert modes.get({"name": "ssp", "staleness_bound": 3}) == ssp == modes.get(ssp.config())
    assert modes.get("downpour") == Downpour() and Downpour().push_every == 4
    for name, cls in MODES.items():
        assert type(modes.get(name)) is cls and cls.name == name
    with pytest.raises(ValueError, match="mode 'asgd': .*unexpected keyword argument 'tau'"):
        modes.get({"name": "asgd", "tau": 3})
    with pytest.raises(TypeError, match="mode must be a name"):
        modes.get(3)


@pytest.mark.parametrize("mode, knobs, match", [
    ("asgd", {"push_every": 0}, "push_every must be an integer >= 1"),
    ("asgd", {"pull_every": 0}, "pull_every must be an integer >= 1"),  # passed before: `pull_every or 1`
    ("downpour", {"push_every": 2.5}, "push_every must be an integer"),
    ("asgd", {"overlap": True, "pull_every": 2}, "does not go with pull_every"),
    ("ssp", {"staleness_bound": -1}, "staleness_bound must be an integer >= 0"),
    ("sync", {"replicas_to_aggregate": 0}, "replicas_to_aggregate must be an integer >= 1"),
    ("easgd", {"tau": 0}, "tau must be an integer >= 1"),
    ("eamsgd", {"alpha": 0.0}, r"alpha must be in \(0, 1\)"),
    ("adacomp", {"fraction": 0.0}, "fraction must be"),
    ("adacomp", {"values": "int8"}, "values must be one of"),
    ("losp", {"overlap": False}, "use mode='localsgd'"),
])
def test_each_mode_checks_its_own_knobs(mode, knobs, match):
    with pytest.raises(ValueError, match=match):
        modes.get({"name": mode, **knobs})


def test_a_modes_server_knobs_make_its_rule_and_go_to_the_ps_unless_the_ps_sets_its_own():
    from plug_asgd.modes import SSP, LocalSGD, Sync

    assert SSP(staleness_bound=3).server_options() == {"staleness_bound": 3}
    assert SSP(staleness_bound=3).make_rule().staleness_bound == 3
    assert SSP(staleness_bound=3).make_rule({"staleness_bound": 1, "replicas_to_aggregate": None}).staleness_bound == 1
    assert SSP().make_rule({"staleness_bound": None}).staleness_bound == 2
    assert LocalSGD(replicas_to_aggregate=2).make_rule().replicas_to_aggregate == 2
    assert Sync().server_options() == {"replicas_to_aggregate": None}
    assert modes.get("asgd").server_options() == {}


def test_modes_refuse_the_codecs_they_cannot_take_and_adacomp_encodes_with_its_own():
    from plug_asgd.compressors import NoCompression, TopK, TopKResidual
    from plug_asgd.modes import AdaComp

    for name in ("adacomp", "hogwild", "easgd", "eamsgd"):
        with pytest.raises(ValueError, match=f"compressor='topk' does not go with mode='{name}'"):
            modes.get(name).check_compressor(TopK())
        modes.get(name).check_compressor(NoCompression())
    modes.get("sync").check_compressor(TopK())
    encoder = AdaComp(fraction=0.05, values="float16").encoder(NoCompression(), rank=1)
    assert isinstance(encoder, TopKResidual) and encoder.fraction == 0.05 and encoder.values == "float16"


def test_a_new_mode_is_one_class_and_nothing_else():
    from dataclasses import dataclass

    from plug_asgd.modes import MODES, PushMode

    @dataclass(frozen=True, kw_only=True)
    class Halved(PushMode):
        name = "test_halved"
        summary = "asgd at half the rate"
        push_every: int = 2

    try:
        assert modes.get("test_halved") == Halved() and Halved().exchange == "push"
        assert "`test_halved`" in modes.mode_table()
        with pytest.raises(TypeError, match="two modes are called 'test_halved'"):
            type("Again", (PushMode,), {"name": "test_halved"})
    finally:
        del MODES["test_halved"]


def test_the_docs_mode_table_is_the_registry():
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "modes.md").read_text()
    assert modes.mode_table() in page


@pytest.mark.integration  # a fresh interpreter
def test_modes_and_codecs_import_neither_torch_nor_lightning():
    import subprocess
    import sys
    from pathlib import Path

    pkg = Path(__file__).resolve().parent.parent / "plug_asgd"
    code = (f"import sys, types; pkg = types.ModuleType('plug_asgd'); pkg.__path__ = [{str(pkg)!r}]; "
            "sys.modules['plug_asgd'] = pkg; import plug_asgd.modes, plug_asgd.compressors; "
            "assert not {'torch', 'pytorch_lightning', 'lightning'} & set(sys.modules), 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_agns_window_left_unset_is_the_number_of_workers_and_a_fit_runs_it_so():
    from plug_asgd.modes import AGN, Asgd, Downpour
    from plug_asgd.worker.exchange import make_exchange

    auto = modes.get("agn")
    assert auto == AGN() and auto.push_every is None and modes.get(auto.config()) == auto
    # N workers, each pushing the average of N local steps: one step per N batches, as DDP
    assert [auto.for_workers(n).push_every for n in (1, 2, 4, 7)] == [1, 2, 4, 7]
    assert AGN(push_every=3).for_workers(2).push_every == 3  # given: kept
    assert Downpour().for_workers(2) == Downpour() and Asgd().for_workers(8) == Asgd()
    with pytest.raises(ValueError, match="push_every must be an integer >= 1"):
        Asgd(push_every=None)  # None means something for agn alone
    assert "`push_every` (the number of workers)" in modes.mode_table()
    exchange = make_exchange(auto)
    exchange.start_fit([], rank=1, world_size=3)
    assert exchange.mode == AGN(push_every=3) and exchange.configured_mode is auto
    exchange.start_fit([], rank=0, world_size=2)  # another fit, of another size
    assert exchange.mode == AGN(push_every=2)
