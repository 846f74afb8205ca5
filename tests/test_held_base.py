"""Pushing from the held central model (plug_asgd.worker.exchange.held_base) and encoding a difference chunk by chunk
(plug_asgd.compressors.difference): the same selections, values and residuals as the plain computation on the
difference made whole, the held model's copies, the merges by hand, and a lone worker's fit against the exchange's
own base."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from plug_asgd.compressors import QSGD, PowerSGD, RandomK, Sign, TopK, TopKResidual, largest_magnitudes, native
from plug_asgd.compressors.difference import (
    CHUNK,
    FACTORS,
    SAMPLE,
    ascending_top,
    largest_differences,
    sample_threshold,
    top_k,
)
from plug_asgd.protocol.wire import Sparse
from plug_asgd.worker.client import HeldModel
from plug_asgd.worker.exchange.held_base import CENTRAL, RESIDUAL, HeldBase, HeldPush
from plug_asgd.worker.exchange.push import PushExchange
from plug_asgd.worker.model_reply import Changes, ModelReply
from tests.threaded_fit import fit_in_threads


def _pair(n: int, seed: int, spread: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(np.float32)
    return w, (w + rng.standard_normal(n).astype(np.float32) * np.float32(spread))


@pytest.mark.parametrize("n, fraction", [(1000, 0.01), (70_000, 0.01), (3 * CHUNK + 17, 0.0033), (300_000, 0.05)])
def test_the_largest_differences_are_the_largest_magnitudes_of_the_difference_made_whole(n, fraction):
    w, c = _pair(n, seed=n)
    k = math.ceil(fraction * n)
    v = w - c
    indices, values = largest_differences(w, c, k)
    np.testing.assert_array_equal(indices, largest_magnitudes(v, k))
    np.testing.assert_array_equal(values, v[indices])
    assert indices.dtype == np.int64 and np.all(np.diff(indices) > 0)


def test_with_a_residual_the_sum_is_made_in_the_residual_and_selected_as_topk_residual_selects_it():
    w, c = _pair(200_000, seed=3)
    residual = np.random.default_rng(4).standard_normal(w.size).astype(np.float32) * np.float32(1e-3)
    expected = residual + np.float32(0.5) * (w - c)  # the same float operations, whole
    kept = residual.copy()
    indices, values = largest_differences(w, c, 2000, residual=kept, scale=0.5)
    np.testing.assert_array_equal(kept, expected)
    np.testing.assert_array_equal(indices, largest_magnitudes(expected, 2000))
    np.testing.assert_array_equal(values, expected[indices])


def test_the_threshold_selection_counted_by_hand():
    # a permutation of 1..n: the top k are the values n-k+1..n, wherever they lie, whatever the sample says
    n, k = 131_072, 1311
    rng = np.random.default_rng(0)
    mag = rng.permutation(np.arange(1, n + 1, dtype=np.float32))
    chosen = np.sort(top_k(mag, k))
    np.testing.assert_array_equal(np.sort(mag[chosen]), np.arange(n - k + 1, n + 1, dtype=np.float32))
    # the sample's threshold: the value about FACTORS[0] * k of n exceed, read off every (n // SAMPLE)-th
    sample = mag[:: n // SAMPLE]
    above = math.ceil(FACTORS[0] * k * sample.size / n)
    assert sample_threshold(sample, n, k, FACTORS[0]) == np.sort(sample)[sample.size - 1 - above]


@pytest.mark.parametrize("case", ["distinct", "ties", "nan", "all_equal", "all"])
def test_the_ascending_top_is_the_stable_sorts_first_k_ties_to_the_lowest_positions(case):
    rng = np.random.default_rng(5)
    mag = np.abs(rng.standard_normal(40_000)).astype(np.float32)
    k = 500
    if case == "ties":  # a few dozen distinct values: the k-th is tied with hundreds
        mag = np.round(mag, 1)
    elif case == "nan":  # NaN ranks largest, as argpartition ranks it
        mag[[3, 20_000, 39_999]] = np.nan
    elif case == "all_equal":
        mag[:] = 2.0
    elif case == "all":
        k = mag.size
    # by hand: a stable sort of the magnitudes, largest first (NaN first of all), keeps tied values in position order
    expected = np.sort(np.argsort(-np.nan_to_num(mag, nan=np.inf), kind="stable")[:k])
    chosen = ascending_top(mag, k)
    np.testing.assert_array_equal(chosen, expected)
    if case == "ties":
        kth = np.sort(mag)[mag.size - k]
        assert np.count_nonzero(mag > kth) < k < np.count_nonzero(mag >= kth)  # the tie crosses the boundary
    if case == "all_equal":
        np.testing.assert_array_equal(chosen, np.arange(k))


def test_a_sample_that_misjudges_the_threshold_is_read_again_and_the_selection_stays_exact():
    # every sampled position holds a large difference, the rest small ones: the first threshold lets through
    # only the sampled positions, fewer than k, and the second pass finds the rest
    n, k = 262_144, 4000
    w = np.zeros(n, np.float32)
    c = np.zeros(n, np.float32)
    stride = n // SAMPLE
    w[::stride] = 10.0
    rng = np.random.default_rng(1)
    w[rng.choice(np.setdiff1d(np.arange(n), np.arange(0, n, stride)), 20_000, replace=False)] = 5.0 + rng.random(
        20_000).astype(np.float32)
    indices, values = largest_differences(w, c, k)
    np.testing.assert_array_equal(indices, largest_magnitudes(w - c, k))
    assert indices.size == k and np.all(values >= 5.0)


def test_nan_is_chosen_as_the_largest_as_argpartition_ranks_it():
    w, c = _pair(100_000, seed=9)
    w[123] = np.nan
    indices, values = largest_differences(w, c, 100)
    assert 123 in indices and np.isnan(values[list(indices).index(123)])


def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, Sparse):
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.values, b.values)
        assert a.values.dtype == b.values.dtype
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a.codec == b.codec and a.meta == b.meta and a.shape == b.shape
        for x, y in zip(a.arrays, b.arrays, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("make", [
    lambda: TopKResidual(0.01), lambda: TopKResidual(0.0033, "float16"), lambda: TopK(0.01).encoder(),
    lambda: TopK(0.01, error_feedback=False).encoder(), lambda: RandomK(0.01).encoder(),
    lambda: RandomK(0.01, error_feedback=False).encoder(), lambda: Sign().encoder(), lambda: QSGD().encoder(),
    lambda: QSGD(bits=3).encoder(), lambda: QSGD(error_feedback=True).encoder(), lambda: PowerSGD().encoder(),
], ids=["adacomp", "adacomp-fp16", "topk", "topk-raw", "randomk", "randomk-raw", "sign", "qsgd", "qsgd3",
        "qsgd-ef", "powersgd"])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_encode_difference_sends_and_keeps_what_encode_does_with_the_difference_made_whole(make, scale):
    a, b = make(), make()  # two encoders with the same state (seeds, residuals)
    rng = np.random.default_rng(5)
    for _push in range(3):
        w = rng.standard_normal((300, 700)).astype(np.float32)
        c = w + rng.standard_normal(w.shape).astype(np.float32) * np.float32(1e-2)
        whole = w - c
        if scale != 1.0:
            whole *= np.float32(scale)
        _same(a.encode_difference("w", w, c, scale), b.encode("w", whole))
        if hasattr(a, "pending"):
            np.testing.assert_array_equal(a.pending("w"), b.pending("w"))


@pytest.mark.parametrize("make, raw", [
    (lambda: TopKResidual(0.01), lambda: TopK(0.01, error_feedback=False)),
    (lambda: TopK(0.01).encoder(), lambda: TopK(0.01, error_feedback=False)),
    (lambda: Sign().encoder(), lambda: Sign(error_feedback=False)),
    (lambda: RandomK(0.02).encoder(), lambda: RandomK(0.02, error_feedback=False, unbiased=False))],
    ids=["adacomp", "topk", "sign", "randomk"])
def test_an_implicit_residual_sends_the_codec_of_w_minus_c_and_keeps_nothing(make, raw):
    encoder = make()
    w, c = _pair(210_000, seed=6, spread=1e-2)
    encoder.encode_difference("w", w + 1, c)  # a residual kept from an earlier push: dropped
    sent = encoder.encode_difference("w", w, c, implicit_residual=True)
    assert encoder.pending("w") is None
    codec = raw()
    codec.encode("w", w - c)  # (randomk: its generator drew for the earlier push too)
    _same(sent, codec.encode("w", w - c))
    with pytest.raises(ValueError, match="cannot be scaled"):
        encoder.encode_difference("w", w, c, 0.5, implicit_residual=True)


# -- the held model -----------------------------------------------------------------------------------------


def test_the_held_model_writes_in_place_only_what_no_reply_returned():
    held = HeldModel()
    received = np.zeros(4, np.float32)
    held.keep("m", 1, {"w": received})
    held.add({"w": Sparse(indices=np.array([1]), values=np.array([2.0], np.float32), shape=(4,))}, 2)
    assert received.tolist() == [0, 0, 0, 0]  # returned by the reply: the change went into a copy
    own = held.tensors["w"]
    held.add({"w": np.ones(4, np.float32)}, 3)
    assert held.tensors["w"] is own and own.tolist() == [1, 3, 1, 1]  # its own copy: in place
    lent = held.lend()["w"]
    held.add({"w": np.ones(4, np.float32)}, 4)
    assert lent is held.tensors["w"] and lent.tolist() == [2, 4, 2, 2]  # lent: add writes it (the lender asked)
    out = held.patch({"w": Sparse(indices=np.array([0]), values=np.array([9.0], np.float32), shape=(4,))}, 5)
    assert lent.tolist() == [2, 4, 2, 2]  # lent: a reply's change goes into a copy
    assert out["w"].tolist() == [9, 4, 2, 2] and not out["w"].flags.writeable
    patched = held.tensors["w"]
    held.add({"w": np.ones(4, np.float32)}, 6)
    assert out["w"].tolist() == [9, 4, 2, 2] and held.tensors["w"] is not patched  # returned: a copy again
    assert held.version == 6 and held.tensors["w"].tolist() == [10, 5, 3, 3]


def test_an_own_add_makes_the_bits_the_ps_makes():
    # the PS folds a decoded sparse update as flat[i] += (values * scale).astype(...); AdaComp's scale is an array of
    # ones there (1 / max(1, 0)): the same float32 additions
    rng = np.random.default_rng(7)
    central = rng.standard_normal(1000).astype(np.float32)
    values = rng.standard_normal(10).astype(np.float32) * np.float32(1e-3)
    idx = np.sort(rng.choice(1000, 10, replace=False))
    ps = central.copy()
    ps[idx] += (values * (1.0 / np.maximum(1, np.zeros(10, np.int64)))).astype(np.float32)
    held = HeldModel()
    held.keep("m", 0, {"w": central.copy()})
    held.add({"w": Sparse(indices=idx, values=values, shape=(1000,))}, 1)
    np.testing.assert_array_equal(held.tensors["w"], ps)


# -- settling a push from the held base, by hand ------------------------------------------------------------


def _reply(version, own=False, tensors=None, changed=None):
    return ModelReply(version, "applied", False, tensors or {}, own=own, changed=changed)


def test_an_own_reply_leaves_the_weights_and_adds_what_was_sent_to_the_held_model():
    w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    c = np.array([0.5, 2.0, 2.0, 4.0], np.float32)
    held = HeldModel()
    held.keep("m", 3, {"t": c.copy()})
    base = HeldBase()
    base.kind = RESIDUAL
    central = held.lend()
    sent = Sparse(indices=np.array([0, 2]), values=np.array([0.5, 1.0], np.float32), shape=(4,))
    base.settle(_reply(4, own=True), held, {"t": w}, central, {"t": sent})
    assert w.tolist() == [1, 2, 3, 4] and held.tensors["t"].tolist() == [1, 2, 3, 4] and held.version == 4
    base.kind = CENTRAL  # the base is the central model: the weights become it
    w2 = np.zeros(4, np.float32)
    base.settle(_reply(5, own=True), held, {"t": w2}, held.lend(), {"t": np.ones(4, np.float32)})
    assert w2.tolist() == [2, 3, 4, 5] == held.tensors["t"].tolist()


def test_a_raced_reply_is_merged_as_w_plus_the_central_change_less_what_was_sent():
    # w - c_old = r + sent; the PS folded another worker's change at 1 and 3, and ours at 0 (scaled by 1/2)
    w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    c_old = np.array([0.5, 2.0, 2.0, 4.0], np.float32)
    c_new = np.array([0.75, 2.5, 2.0, 3.0], np.float32)
    sent = Sparse(indices=np.array([0]), values=np.array([0.5], np.float32), shape=(4,))
    for changed in (Changes(3, {"t": np.array([0, 1, 3])}), None):  # a delta reply, and the whole model
        weights = {"t": w.copy()}
        base = HeldBase()
        base.kind = RESIDUAL
        base.settle(_reply(5, tensors={"t": c_new}, changed=changed), HeldModel(), weights, {"t": c_old},
                    {"t": sent})
        # by hand: w + (c_new - c_old) - sent = [1 + 0.25 - 0.5, 2 + 0.5, 3, 4 - 1]
        assert weights["t"].tolist() == [0.75, 2.5, 3.0, 3.0]
        np.testing.assert_array_equal(weights["t"] - c_new, (w - c_old) - _dense(sent))  # the residual kept
        assert base.raced == 1


def test_after_a_guess_an_own_reply_leaves_the_weights_and_a_raced_one_keeps_the_step_since():
    # CENTRAL: the weights were made c_old + sent (the guess), then an optimizer step moved them by -0.25 each
    c_old = np.array([0.5, 2.0, 2.0, 4.0], np.float32)
    sent = np.array([0.5, -1.0, 0.25, 0.0], np.float32)
    stepped = c_old + sent - np.float32(0.25)
    held = HeldModel()
    held.keep("m", 3, {"t": c_old.copy()})
    base = HeldBase()
    base.kind = CENTRAL
    weights = {"t": stepped.copy()}
    base.settle(_reply(4, own=True), held, weights, held.lend(), {"t": sent}, guessed=True)
    assert weights["t"].tolist() == stepped.tolist()  # not the held model: the step is kept
    assert held.tensors["t"].tolist() == [1.0, 1.0, 2.25, 4.0] and held.version == 4
    # another worker's push came first: w = c_new + the step, c_new = [1.25, 1.5, 2.25, 3.0]
    c_new = np.array([1.25, 1.5, 2.25, 3.0], np.float32)
    weights = {"t": stepped.copy()}
    base.settle(_reply(5, tensors={"t": c_new}), HeldModel(), weights, {"t": c_old}, {"t": sent}, guessed=True)
    assert weights["t"].tolist() == [1.0, 1.25, 2.0, 2.75] and base.raced == 1
    weights = {"t": stepped.copy()}  # not guessed: the reply was taken before any step, the weights are it
    base.settle(_reply(5, tensors={"t": c_new}), HeldModel(), weights, {"t": c_old}, {"t": sent})
    assert weights["t"].tolist() == c_new.tolist()
    # the guess made the held model's next arrays beside the weights: an own reply takes them as they are
    held.keep("m", 3, {"t": c_old.copy()})
    before, made = held.tensors["t"], {"t": c_old + sent}
    weights = {"t": stepped.copy()}
    base.settle(_reply(4, own=True), held, weights, held.lend(), {}, guessed=True, made=made)
    assert held.tensors["t"] is made["t"] and held.version == 4 and weights["t"].tolist() == stepped.tolist()
    assert before.tolist() == c_old.tolist()  # the arrays held before are not written
    with pytest.raises(ValueError, match="made float64"):
        held.adopt({"t": np.zeros(4)}, 5)


class _StubClient:
    """A client whose push runs ``while_waiting`` as a sent push does, then answers with ``reply``; it records what
    the momentum mask had done by the time the PS would fold."""

    def __init__(self, held: HeldModel, reply: ModelReply, masks: list) -> None:
        self.held, self.reply, self.masks, self.seen_at_fold = held, reply, masks, None

    def push(self, base, update, want_model, scaled_for, while_waiting, rate=None):
        while_waiting()
        self.seen_at_fold = len(self.masks)
        return self.reply


@pytest.mark.parametrize("own", [True, False])
def test_the_pushs_thread_masks_while_the_ps_folds_and_takes_an_own_reply_into_the_held_model(own):
    rng = np.random.default_rng(7)
    c = rng.standard_normal(1000).astype(np.float32)
    w = c + rng.standard_normal(1000).astype(np.float32)
    held = HeldModel()
    held.keep("m", 3, {"t": c.copy()})
    base = HeldBase()
    base.kind = RESIDUAL
    masks: list = []
    c_new = c + np.float32(1.0)
    reply = _reply(4, own=True) if own else _reply(5, tensors={"t": c_new})
    client = _StubClient(held, reply, masks)
    push = HeldPush(base, TopK(0.01).encoder(), client, {"t": w}, held.lend(), 3, None,  # type: ignore[arg-type]
                    mask=lambda update: masks.append(update["t"].indices.copy()))
    push.answered()
    sent = push.update["t"]
    k = math.ceil(0.01 * 1000)
    np.testing.assert_array_equal(sent.indices, np.sort(np.argsort(-np.abs(w - c), kind="stable")[:k]))
    assert push.masked and client.seen_at_fold == 1  # masked before the reply, once
    np.testing.assert_array_equal(masks[0], sent.indices)
    expected = c.copy()
    expected[sent.indices] += sent.values  # by hand: the held model plus what was sent, the PS's float additions
    if own:  # taken by the push's thread: the held model is the reply's before anything settles it
        assert push.added and held.version == 4
        np.testing.assert_array_equal(held.tensors["t"], expected)
    else:  # raced: nothing taken there; the training thread merges it
        assert not push.added and held.version == 3
        np.testing.assert_array_equal(held.tensors["t"], c)
    weights_before = w.copy()
    push.settle(held)
    assert held.version == (4 if own else 3) and len(masks) == 1
    if own:
        np.testing.assert_array_equal(held.tensors["t"], expected)  # not added twice
        np.testing.assert_array_equal(w, weights_before)  # the residual implicit: the weights stay
    else:
        np.testing.assert_array_equal(w, weights_before + c_new - c - _dense(sent))  # the merge's order


def _dense(sparse: Sparse) -> np.ndarray:
    out = np.zeros(sparse.shape, np.float32)
    out[sparse.indices] = sparse.values
    return out


def test_entering_makes_the_weights_what_the_own_base_would_push_and_leaving_gives_the_residual_back():
    w = np.array([2.0, 2.0], np.float32)
    b = torch.tensor([1.0, 1.5])  # the weights at the last load: c + r
    c = np.array([0.5, 1.5], np.float32)
    r = np.array([0.5, 0.0], np.float32)
    base = HeldBase()
    weights = {"t": w}
    base.enter(RESIDUAL, weights, {"t": b}, {"t": c}, lambda name: r, 0)
    assert w.tolist() == [2.0, 2.0]  # (w - b) + c + r: the progress kept, the residual in the model
    kept = {}
    base.leave(weights, {"t": b}, {"t": c}, kept.__setitem__)
    assert kept["t"].tolist() == [1.5, 0.5] and b.tolist() == [2.0, 2.0] and base.kind is None


def test_leaving_the_central_base_with_steps_pending_keeps_them_for_the_next_push():
    # w = c + p: DiLoCo's exchange leaves the held base at a push, a round of inner steps after the last merge
    c = np.array([0.5, 1.5], np.float32)
    w = np.array([0.75, 1.0], np.float32)  # p = (0.25, -0.5)
    b = torch.tensor([9.0, 9.0])
    base = HeldBase()
    base.kind = CENTRAL  # (entered at an earlier push, whose reply was merged: the weights are c plus the steps since)
    base.leave({"t": w}, {"t": b}, {"t": c}, None)
    # the own base's next update, w - b, is the steps since the held model: 0.25 and -0.5, not nothing
    assert (w - b.numpy()).tolist() == [0.25, -0.5] and w.tolist() == [0.75, 1.0] and base.kind is None


# -- a lone worker's fit ---------------------------------------------------------------------------------------


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("strategy", [{"mode": "adacomp"}, {"mode": "asgd", "compressor": "sign"},
                                      {"mode": "asgd", "compressor": "powersgd"}],
                         ids=["adacomp", "sign", "powersgd"])
def test_a_lone_workers_fit_from_the_held_base_is_its_own_bases_with_own_replies(strategy, monkeypatch):
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(512, 64), torch.randn(512, 4))
    stats: list = []
    held = fit_in_threads(_Regression, data, epochs=2, batch_size=16, workers=1, stats=stats, **strategy)
    assert stats[0]["held_base_pushes"] == stats[0]["pushes"] == stats[0]["own_replies"] == 64
    assert stats[0]["held_base_raced"] == 0
    monkeypatch.setattr(PushExchange, "held_base_for", lambda self, tensors, want_model: None)
    stats = []
    own = fit_in_threads(_Regression, data, epochs=2, batch_size=16, workers=1, stats=stats, **strategy)
    assert stats[0]["held_base_pushes"] == 0
    # the same rule, computed in another order: the fits part by their rounding, which 64 steps of momentum SGD
    # (and, for adacomp, which coordinate wins a near tie) carry to about 1e-3 of a tensor (measured up to 1.4e-3)
    for a, b in zip(held.parameters(), own.parameters(), strict=True):
        assert (a - b).norm() <= 1e-2 * b.norm()
    x, y = data.tensors
    losses = [torch.nn.functional.mse_loss(m.net(x), y).item() for m in (held, own)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)


@pytest.mark.parametrize("codec", ["fp16", "qsgd"])
def test_every_async_diloco_round_reaches_the_ps_whichever_base_its_push_goes_from(codec, monkeypatch):
    """A worker whose staleness estimate rises above 0 goes from the held base back to its own at a push, a round of
    inner steps pending (beside a 2x slower worker its estimate moves between 0 and 0.5, push after push): here the
    exchange's choice is made to alternate at every push, whatever the timing. Every push carries its round's
    steps: none is all zeros (before the fix each push after a held one was)."""
    from plug_asgd.modes.diloco_async import AsyncDiLoCoRule

    pushed: list[float] = []
    push, chosen, calls = AsyncDiLoCoRule.push, PushExchange.held_base_for, itertools.count()

    def spy(self, state, update):
        pushed.append(max(float(np.abs(np.asarray(u, np.float32)).max()) for u in update.update.values()))
        return push(self, state, update)

    def alternate(self, tensors, want_model):
        found = chosen(self, tensors, want_model)
        return found if next(calls) % 2 == 0 else None

    monkeypatch.setattr(AsyncDiLoCoRule, "push", spy)
    monkeypatch.setattr(PushExchange, "held_base_for", alternate)
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(512, 64), torch.randn(512, 4))
    stats: list = []
    fit_in_threads(_Regression, data, epochs=1, batch_size=8, workers=1, stats=stats, compressor=codec,
                   mode={"name": "async_diloco", "inner_steps": 4, "outer": {"name": "sgd", "lr": 1.0,
                                                                             "momentum": 0}})
    # 64 steps, 16 rounds: every other push from the held base (the first's reply makes the held model)
    assert stats[0]["pushes"] == len(pushed) == 16 and stats[0]["held_base_pushes"] >= 7, stats[0]
    assert min(pushed) > 0, pushed


def test_a_lone_downpour_worker_fetching_between_its_pushes_keeps_its_steps_from_the_held_base(monkeypatch):
    """DOWNPOUR's fetch (pull_every 3, push_every 4) leaves the held base with steps not yet pushed: they stay in the
    weights and go with the next push, as from the exchange's own base (fp16: the base is the central model held)."""
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(512, 64), torch.randn(512, 4))
    strategy = {"mode": {"name": "downpour", "push_every": 4, "pull_every": 3}, "compressor": "fp16"}
    stats: list = []
    held = fit_in_threads(_Regression, data, epochs=2, batch_size=16, workers=1, stats=stats, **strategy)
    assert stats[0]["held_base_pushes"] > 0, stats[0]
    monkeypatch.setattr(PushExchange, "held_base_for", lambda self, tensors, want_model: None)
    own = fit_in_threads(_Regression, data, epochs=2, batch_size=16, workers=1, **strategy)
    # the same rule, computed in another order (measured: the same bits here; with the steps lost at each fetch the
    # first tensor was 25% of its norm apart)
    for a, b in zip(held.parameters(), own.parameters(), strict=True):
        assert (a - b).norm() <= 1e-2 * b.norm()


@pytest.mark.parametrize("strategy", [{"mode": "adacomp"}, {"mode": "adacomp", "values": "float16"},
                                      {"mode": "asgd", "compressor": "topk"}],
                         ids=["adacomp", "adacomp-fp16", "topk"])
def test_the_device_path_on_cpu_tensors_trains_the_bits_of_the_numpy_path(strategy, monkeypatch):
    """The held base on the device (plug_asgd.worker.exchange.held_device: torch's topk, torch's indexing) run on CPU
    tensors, against numpy's on the same fit: the same selections, merges and momentum masks, bit for bit."""
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(512, 64), torch.randn(512, 4))
    mode = {"mode": {"name": "adacomp", "values": strategy["values"]}} if "values" in strategy else strategy
    runs = {}
    for on_device in (False, True):
        monkeypatch.setattr(PushExchange, "held_on_device", on_device)
        stats: list = []
        runs[on_device] = fit_in_threads(_Regression, data, epochs=2, batch_size=16, workers=1, stats=stats, **mode)
        assert stats[0]["held_base_pushes"] == stats[0]["own_replies"] == 64
    for a, b in zip(runs[False].parameters(), runs[True].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_device_selection_is_the_hosts():
    from plug_asgd.worker.exchange.held_device import largest_differences as on_device

    w, c = _pair(200_000, seed=11)
    chosen, values = on_device(torch.from_numpy(w), torch.from_numpy(c), 2000)
    indices, expected = largest_differences(w, c, 2000)
    np.testing.assert_array_equal(chosen.numpy(), indices)
    np.testing.assert_array_equal(values.numpy(), expected)


def _tied(n: int, k: int, nans: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """w, c with |w - c| = 1 at k - 10 spread coordinates, 0.5 at 50 (the k-th largest tied 50 ways), below elsewhere,
    and NaN at ``nans`` more; the indices the rule must choose, by hand: the NaNs and the ones (the lowest NaNs
    where they are k or more), then the lowest halves."""
    rng = np.random.default_rng(n + nans)
    c = (rng.integers(-4096, 4096, n) / 64).astype(np.float32)  # c + 1 and c + 0.5 exact: so are the differences
    w = c + (rng.random(n).astype(np.float32) * np.float32(0.25) + np.float32(0.01))  # differences under 0.27
    spots = rng.permutation(n)[: k - 10 + 50 + nans]
    ones, halves, nan_spots = np.sort(spots[: k - 10]), np.sort(spots[k - 10:k + 40]), np.sort(spots[k + 40:])
    w[ones], w[halves], w[nan_spots] = c[ones] + 1, c[halves] + np.float32(0.5), np.nan
    if nans >= k:
        return w, c, nan_spots[:k].tolist()
    top = np.concatenate([ones, nan_spots])
    return w, c, sorted([*top.tolist(), *halves[: k - top.size].tolist()])


@pytest.mark.parametrize("n, k, nans", [(300, 40, 0), (200_000, 2000, 0), (200_000, 2000, 3), (300, 40, 45),
                                        (200_000, 2000, 2100)])
def test_values_tied_with_the_kth_largest_are_taken_at_the_lowest_indices_on_every_path(n, k, nans, monkeypatch):
    from plug_asgd.worker.exchange.held_device import largest_differences as on_device

    w, c, expected = _tied(n, k, nans)
    for name, got in [("host", largest_differences(w, c, k)[0]), ("whole", largest_magnitudes(w - c, k)),
                      ("device", on_device(torch.from_numpy(w), torch.from_numpy(c), k)[0].numpy())]:
        assert got.tolist() == expected, name
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        assert largest_differences(w, c, k)[0].tolist() == expected
    residual = np.zeros(n, np.float32)
    assert largest_differences(w, c, k, residual=residual)[0].tolist() == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on the project's own machines)")
def test_the_selection_on_a_gpu_is_the_hosts():
    from plug_asgd.worker.exchange.held_device import largest_differences as on_device

    w, c = _pair(2_000_000, seed=12)
    chosen, values = on_device(torch.from_numpy(w).cuda(), torch.from_numpy(c).cuda(), 20_000)
    indices, expected = largest_differences(w, c, 20_000)
    np.testing.assert_array_equal(chosen.cpu().numpy(), indices)
    np.testing.assert_array_equal(values.cpu().numpy(), expected)


def test_a_push_the_error_feedback_decoded_is_not_decoded_again_and_gives_the_ps_bits(monkeypatch):
    from plug_asgd.compressors import decode
    from plug_asgd.worker.exchange import held_base

    rng = np.random.default_rng(4)
    w, c = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((64, 48)).astype(np.float32)
    encoder = PowerSGD(rank=2).encoder()
    sent = encoder.encode_difference("w", w, c)
    calls = []
    monkeypatch.setattr(held_base, "decode", lambda *a, **k: calls.append(a) or decode(*a, **k))
    got = HeldBase.decoded({"w": sent}, {"w": w}, encoder)
    assert calls == []  # the product P @ Q.T the error feedback made for its residual
    ps = decode(sent, np.float32, shape=(64, 48))  # as the PS decodes it
    assert np.array_equal(got["w"].view(np.uint32), ps.view(np.uint32))
    again = HeldBase.decoded({"w": sent}, {"w": w}, encoder)  # given once: a second asking decodes
    assert len(calls) == 1 and np.array_equal(again["w"], ps)
    other = encoder.encode_difference("w", w, c)
    assert HeldBase.decoded({"w": sent}, {"w": w}, encoder) and len(calls) == 2  # not what was last sent: decoded
    assert other is not sent


# 64 steps. asgd: a push each, all from the held base, every one but the last guessed (the fit's end takes it).
# downpour every 3rd step, pulling every 2nd between: a cycle of 6 steps (a pull at 2, a push without the model at 3,
# a pull at 4, a push taking the model at 6, from the held base), so 10 held pushes (6 to 60, each guessed), 11
# others (3 to 63) and the last step's at the end: 22
@pytest.mark.parametrize("mode, codec, counts", [("asgd", "qsgd", (64, 64, 63)), ("asgd", "powersgd", (64, 64, 63)),
                                                 ({"name": "downpour", "push_every": 3, "pull_every": 2}, "qsgd",
                                                  (22, 10, 10))],
                         ids=["qsgd", "powersgd", "downpour-qsgd"])
def test_a_lone_workers_guess_of_its_own_reply_trains_the_bits_of_waiting_for_it(mode, codec, counts, monkeypatch):
    """A codec whose weights become the central model at an "own" reply (CENTRAL): the weights made ``c + sent``
    before the optimizer's step, the reply taken after it, against the reply taken before the step (downpour's
    pulls between its pushes too)."""
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(512, 64), torch.randn(512, 4))
    guesses, fused = [], []
    guess_own, add_decoded = HeldPush.guess_own, QSGD.add_decoded

    def counted(self, local_steps):
        first = not self.guessed
        guesses.append((first, guess_own(self, local_steps)))
        return guesses[-1][1]

    def spied(packed, *arrays):
        fused.append(add_decoded(packed, *arrays))
        return fused[-1]

    monkeypatch.setattr(QSGD, "add_decoded", spied)

    runs = []
    for guessing in (counted, lambda self, local_steps: False):
        monkeypatch.setattr(HeldPush, "guess_own", guessing)
        stats: list = []
        runs.append(fit_in_threads(_Regression, data, epochs=2, batch_size=16, workers=1, stats=stats,
                                   mode=mode, compressor=codec))
        assert (stats[0]["pushes"], stats[0]["held_base_pushes"]) == counts[:2]
    # asked before and after the step where the optimizer is stepped without a closure, as here
    assert sum(first for first, _ in guesses) == counts[2] and all(made for _, made in guesses)
    # qsgd's guesses add each tensor's decoding in the pass that decodes it, where the C library is (4 tensors)
    fusing = codec == "qsgd" and native.library() is not None
    assert fused == ([True] * 4 * counts[2] if fusing else [])
    for a, b in zip(runs[0].parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(a, b)
