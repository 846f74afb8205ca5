"""The PS's fold of a packed push in one pass (plug_asgd/compressors/fused.py, the codecs' ``fold_packed``): the bits
of decoding with numpy's path, then adding as the fold adds (``u * s + c`` in float32), its NaN/Inf refusal, and the
cases it leaves to decoding. The stores' sequences with packed pushes are in tests/test_store.py."""

from __future__ import annotations

import numpy as np
import pytest

from plug_asgd.compressors import QSGD, PowerSGD, Sign, decode, native
from plug_asgd.compressors.decoding import Undecoded
from plug_asgd.modes import CentralState, Push
from plug_asgd.modes.fold import _fold_all
from plug_asgd.modes.slices import SlicePool
from plug_asgd.protocol.wire import Packed, WireError

FLAT = [(1,), (7,), (8,), (9,), (63,), (64,), (65,), (1000,), (40_003,)]  # the tails of 8 and 64 values
MATRICES = [(3, 3), (5, 13), (7, 9), (64, 3), (20, 50), (19, 2_105)]  # PowerSGD packs a rank below both sides
CODECS = {"qsgd8": lambda: QSGD(bits=8, seed=3), "qsgd16": lambda: QSGD(bits=16, seed=3), "sign": Sign,
          "powersgd": lambda: PowerSGD(rank=2, seed=3)}


def _library_or_skip():
    if native.library() is None:
        pytest.skip("no C compiler here: the PS decodes, then folds")


def _numpy_decoding(monkeypatch, packed: Packed) -> np.ndarray:
    """What the PS folded before this pass: numpy's decoding (the C decodings give its bits: test_native*)."""
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        return decode(packed, np.float32)


def _expected(decoded: np.ndarray, central: np.ndarray, scale: float) -> np.ndarray:
    """The fold's float32 operations, by numpy: ``decoded * scale`` rounded, then ``+ central`` rounded."""
    if scale == 1.0:
        return decoded + central
    return np.float32(scale) * decoded + central


def _packed(name: str, shape: tuple[int, ...], seed: int) -> Packed:
    rng = np.random.default_rng(seed)
    update = rng.standard_normal(shape).astype(np.float32) * np.float32(0.01)
    sent = CODECS[name]().encode("t", update)
    assert isinstance(sent, Packed), "each codec packs this tensor"
    return sent


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("name, shape", [(n, s) for n in ("qsgd8", "qsgd16", "sign") for s in FLAT + MATRICES]
                         + [("powersgd", s) for s in MATRICES[1:]])  # (3 x 3 is sent dense: no smaller)
def test_the_fold_gives_the_bits_of_decoding_then_adding(monkeypatch, name, shape, scale):
    _library_or_skip()
    n = int(np.prod(shape))
    packed = _packed(name, shape, n)
    central = np.random.default_rng(n + 1).standard_normal(shape).astype(np.float32)
    central.reshape(-1)[0] = -0.0  # a decoded +0.0 or -0.0 added to it keeps IEEE's sign rule
    out = np.full_like(central, np.nan)
    before = central.copy()
    assert Undecoded(packed, np.dtype(np.float32)).fold(central, out, scale) is True
    want = _expected(_numpy_decoding(monkeypatch, packed), central, scale)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(central.view(np.uint32), before.view(np.uint32))  # only out is written


def test_a_zero_sign_scale_adds_plus_zero_by_hand():
    _library_or_skip()
    packed = Packed("sign", (9,), {"scale": 0.0}, (np.array([0b10101010, 1], np.uint8),))
    central = np.array([-0.0, -0.0, 1, -1, 2, -2, 0.0, 0.0, -0.0], np.float32)
    out = np.empty_like(central)
    assert Sign.fold_packed(packed, central, out, 1.0) is True
    # every value decodes to +0.0 (numpy's value - 2 * value): -0.0 + +0.0 is +0.0, so no -0.0 is left
    assert out.tolist() == [0, 0, 1, -1, 2, -2, 0, 0, 0] and not np.signbit(out[[0, 1, 6, 7, 8]]).any()


def test_qsgd_by_hand():
    _library_or_skip()
    # levels 0, 3, 255, 1 with signs -, +, -, +; norm 2.55: a level is worth 0.01 (float64), rounded to float32
    packed = Packed("qsgd", (4,), {"bits": 8, "norm": 2.55}, (np.array([0, 3, 255, 1], np.uint8),
                                                             np.array([0b0101], np.uint8)))
    central = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    out = np.empty_like(central)
    assert QSGD.fold_packed(packed, central, out, 0.5) is True
    step = 2.55 / 255
    decoded = [np.float32(-0 * step), np.float32(3 * step), np.float32(-255 * step), np.float32(1 * step)]
    want = [np.float32(np.float32(d * np.float32(0.5)) + c) for d, c in zip(decoded, central, strict=True)]
    assert out.tolist() == want


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_sum_that_overflows_is_refused(name):
    _library_or_skip()
    packed = _packed(name, (20, 50), 5)
    decoded = decode(packed, np.float32)
    top = np.finfo(np.float32).max
    central = np.zeros((20, 50), np.float32)
    assert Undecoded(packed, np.dtype(np.float32)).fold(central, np.empty_like(central), 1e38) is True
    i = np.flatnonzero(decoded)[0]  # the largest float32 of the value's sign, and a push beyond it
    central.reshape(-1)[i] = top if decoded.reshape(-1)[i] > 0 else -top
    with np.errstate(over="ignore"):
        assert Undecoded(packed, np.dtype(np.float32)).fold(central, np.empty_like(central), 1e38) is False


def test_the_cases_it_leaves_to_decoding(monkeypatch):
    _library_or_skip()
    packed = _packed("qsgd8", (20, 50), 1)
    central = np.ones((20, 50), np.float32)
    out = np.full_like(central, np.nan)
    wide = np.empty((20, 100), np.float32)
    assert QSGD.fold_packed(packed, central, wide[:, ::2], 1.0) is None  # out not contiguous: it would be a copy
    assert QSGD.fold_packed(packed, central[:10], out[:10], 1.0) is None  # not the packed tensor's size
    assert Undecoded(packed, np.dtype(np.float64)).fold(central.astype(np.float64), out, 1.0) is None
    low = _packed("powersgd", (20, 50), 1)
    assert PowerSGD.fold_packed(low, central, central, 1.0) is None  # a row is made in out first
    four = QSGD(bits=4).encode("t", central * np.float32(0.1))
    assert QSGD.fold_packed(four, central, out, 1.0) is None  # levels of other than 8 or 16 bits
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        assert all(CODECS[name]().fold_packed(_packed(name, (20, 50), 2), central, out, 1.0) is None
                   for name in CODECS)
    assert np.isnan(out).all()  # nothing above wrote out


def test_a_malformed_packed_tensor_is_refused_as_its_decoding_refuses_it():
    bad = Packed("qsgd", (4,), {"bits": 8, "norm": 1.0}, (np.zeros(3, np.uint8), np.zeros(1, np.uint8)))
    with pytest.raises(WireError) as fold_error:
        Undecoded(bad, np.dtype(np.float32)).fold(np.zeros(4, np.float32), np.zeros(4, np.float32), 1.0)
    with pytest.raises(WireError) as decode_error:
        decode(bad, np.float32)
    assert fold_error.value.code == decode_error.value.code == "bad_payload"


@pytest.mark.parametrize("threads", [1, 2])
def test_the_rule_folds_an_undecoded_push_as_a_decoded_one(monkeypatch, threads):
    """Through the fold rules' own fold: in one pass on one thread, decoded where the fold is split over threads."""
    shapes = {"a": (40, 30), "b": (30,), "c": (9, 5)}
    rng = np.random.default_rng(threads)
    central = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    sent = {"a": _packed("powersgd", shapes["a"], 1), "b": rng.standard_normal(30).astype(np.float32),
            "c": _packed("sign", shapes["c"], 2)}
    update = {n: decode(t, np.float32, defer=True) for n, t in sent.items()}
    assert isinstance(update["a"], Undecoded) and isinstance(update["c"], Undecoded)
    assert not isinstance(update["b"], Undecoded)
    pool = SlicePool(threads, min_split=100) if threads > 1 else None
    state = CentralState({n: t.copy() for n, t in central.items()}, pool=pool)
    out = {n: np.empty(s, np.float32) for n, s in shapes.items()}
    try:
        _fold_all(state, Push(None, 0, 0, update, out, scale=0.5))
    finally:
        if pool is not None:
            pool.close()
    for n in shapes:
        decoded = _numpy_decoding(monkeypatch, sent[n]) if n != "b" else sent[n]
        assert state.tensors[n] is out[n]
        assert np.array_equal(out[n].view(np.uint32), _expected(decoded, central[n], 0.5).view(np.uint32)), n
