"""The quantisers' C passes (plug_asgd/compressors/kernels/quantize.c): sign's and qsgd's encodings and decodings give
the bits numpy's path gives, and both follow the rules written down in plug_asgd.compressors.quantize, checked here
against computations by hand (the lanes' sum, the draws' hash in Python integers)."""

from __future__ import annotations

import numpy as np
import pytest

from plug_asgd.compressors import QSGD, Sign, decode, native
from plug_asgd.compressors.bitpack import unpack_levels
from plug_asgd.compressors.quantize import draws, lane_sum
from plug_asgd.protocol.wire import Packed

SIZES = [1, 7, 8, 63, 64, 65, 1000, 65536 + 13, 200_003]


def _library_or_skip():
    if native.library() is None:
        pytest.skip("no C compiler here")


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _numpy_only(monkeypatch, fn, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        return fn(*args, **kwargs)


def _pair(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w, c = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    w[: min(n, 3)] = c[: min(n, 3)]  # differences of 0.0
    return w, c


def _mix32(x: int) -> int:
    """Wellons' lowbias32, in Python integers."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_draws_are_the_hash_of_the_index_by_hand_and_uniform():
    keys = (0xDEADBEEF, 12345)
    for i in (0, 1, 2, 1000, (1 << 32) + 5):
        h = _mix32(_mix32((i & 0xFFFFFFFF) ^ keys[0]) ^ (((i >> 32) + keys[1]) & 0xFFFFFFFF))
        assert draws(i, i + 1, keys)[0] == np.float32((h >> 8) / 2**24)
    u = draws(0, 1 << 20, keys)
    assert u.dtype == np.float32 and 0.0 <= u.min() and u.max() < 1.0
    counts = np.bincount((u * 16).astype(np.int64), minlength=16)
    expected = (1 << 20) / 16
    assert ((counts - expected) ** 2 / expected).sum() < 50  # chi-square, 15 degrees of freedom (p ~ 1e-5)
    assert abs(float(np.corrcoef(u[:-1], u[1:])[0, 1])) < 0.01  # neighbours unrelated
    assert not np.array_equal(draws(0, 64, keys), draws(0, 64, (keys[0] + 1, keys[1])))


def test_the_lanes_sum_adds_coordinate_i_into_lane_i_mod_8_in_order():
    x = np.array([1e16, 1.0, 3.0, -1e16, 2.0, 5.0, 7.0, 11.0, -1e16, 13.0, 1.5], dtype=np.float32)
    lanes = [0.0] * 8
    for i, v in enumerate(x.tolist()):
        lanes[i % 8] += abs(v)
    total = 0.0
    for lane in lanes:
        total += lane
    assert lane_sum(x, None, 1.0, np.abs) == total


@pytest.mark.parametrize("n", SIZES)
def test_signs_encoding_gives_numpys_bits_and_sum(n, monkeypatch):
    _library_or_skip()
    w, c = _pair(n, n)
    for central, scale in ((None, 1.0), (c, 1.0), (c, 0.37)):
        bits, total = native.sign_encode(w, central, scale)
        x = w if central is None else (w - central) * np.float32(scale) if scale != 1.0 else w - central
        assert bits.tolist() == np.packbits(x < 0, bitorder="little").tolist()
        assert total == lane_sum(w, central, scale, np.abs)
        ours = Sign().encode_difference("w", w, central) if central is not None and scale == 1.0 else None
        if ours is not None:
            theirs = _numpy_only(monkeypatch, Sign().encode_difference, "w", w, central)
            assert ours.meta == theirs.meta and ours.arrays[0].tolist() == theirs.arrays[0].tolist()


def test_sign_by_hand_and_a_zero_scale_decodes_to_plus_zero(monkeypatch):
    _library_or_skip()
    sent = Sign().encode("w", np.array([0.5, -2.0, 0.25, 1.0, -0.0, 0.0, -1.0, 3.0, -0.25], dtype=np.float32))
    # mean |x| = 8 / 9; set bits where x < 0 (not -0.0): 1, 6 and 8
    assert sent.meta == {"scale": float(np.float32(8 / 9))}
    assert sent.arrays[0].tolist() == [0b01000010, 0b00000001]
    s = np.float32(8 / 9)
    _same_bits(decode(sent, np.float32), np.array([s, -s, s, s, s, s, -s, s, -s], dtype=np.float32))
    zero = Sign().encode("w", np.zeros(5, dtype=np.float32))
    zero.arrays[0][0] = 0b10101  # bits set with a scale of 0: +0.0 everywhere, as numpy's value - 2 * value
    _same_bits(decode(zero, np.float32), np.zeros(5, dtype=np.float32))
    _same_bits(_numpy_only(monkeypatch, decode, zero, np.float32), np.zeros(5, dtype=np.float32))


@pytest.mark.parametrize("n", SIZES)
def test_signs_decoding_gives_numpys_bits(n, monkeypatch):
    _library_or_skip()
    w, c = _pair(n, n + 1)
    sent = Sign().encode_difference("w", w, c)
    _same_bits(decode(sent, np.float32), _numpy_only(monkeypatch, decode, sent, np.float32))


@pytest.mark.parametrize("bits", [8, 16, 4])
@pytest.mark.parametrize("n", SIZES)
def test_qsgds_encoding_gives_numpys_bits(bits, n, monkeypatch):
    _library_or_skip()
    w, c = _pair(n, bits * n)
    for central in (None, c):
        ours = QSGD(bits=bits, seed=n).encode_difference("w", w, central) if central is not None else \
            QSGD(bits=bits, seed=n).encode("w", w)
        make = QSGD(bits=bits, seed=n)
        theirs = _numpy_only(monkeypatch, make.encode_difference, "w", w, central) if central is not None else \
            _numpy_only(monkeypatch, make.encode, "w", w)
        assert ours.meta == theirs.meta
        for a, b in zip(ours.arrays, theirs.arrays, strict=True):
            _same_bits(np.asarray(a), np.asarray(b))
        _same_bits(decode(ours, np.float32), _numpy_only(monkeypatch, decode, theirs, np.float32))


def test_qsgds_levels_by_hand_from_the_draws():
    # 4 bits (15 levels), x = (2, -3, 6): norm 7 exactly, r = |x| * float32(15 / 7), one level up where the
    # coordinate's draw is below r's fraction; the keys are the generator's first two draws
    x = np.array([2.0, -3.0, 6.0], dtype=np.float32)
    sent = QSGD(bits=4, seed=3).encode("w", x)
    assert sent.meta == {"bits": 4, "norm": 7.0}
    generator = np.random.default_rng(3)
    keys = (int(generator.integers(1 << 32, dtype=np.uint64)), int(generator.integers(1 << 32, dtype=np.uint64)))
    want = []
    for i, v in enumerate(x.tolist()):
        r = np.float32(abs(v)) * np.float32(15 / 7.0)
        low = np.floor(r)
        want.append(int(low) + int(draws(i, i + 1, keys)[0] < r - low))
    assert unpack_levels(np.asarray(sent.arrays[0]), 3, 4).tolist() == want
    assert np.unpackbits(np.asarray(sent.arrays[1]), count=3, bitorder="little").tolist() == [0, 1, 0]


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("n", SIZES)
def test_qsgds_decoding_added_twice_gives_the_bits_of_decoding_then_adding(bits, n, monkeypatch):
    # a worker's guess of an "own" reply: decode(sent) + c with the PS's float32 addition, to the weights and the
    # held model's next arrays, the decoding never written; numpy's decoding and add are the reference
    _library_or_skip()
    w, c = _pair(n, seed=n + bits)
    sent = QSGD(bits=bits, seed=1).encode_difference("w", w, c)
    out, again = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
    assert QSGD.add_decoded(sent, c, out, again)
    expected = _numpy_only(monkeypatch, decode, sent, np.float32) + c
    _same_bits(out, expected)
    _same_bits(again, expected)
    plain_out, plain_again = np.empty_like(out), np.empty_like(out)
    native.add_twice(decode(sent, np.float32), c, plain_out, plain_again)
    _same_bits(plain_out, expected)
    _same_bits(plain_again, expected)
    _numpy_only(monkeypatch, native.add_twice, decode(sent, np.float32), c, plain_out, plain_again)  # numpy's
    _same_bits(plain_again, expected)


def test_qsgds_decoding_added_twice_by_hand_and_where_it_cannot_be(monkeypatch):
    _library_or_skip()
    # 8 bits, norm 255 * 0.5: level l decodes to l * 0.5 exactly; levels 3, 0, 255 with signs +, +, -
    signs = np.packbits(np.array([0, 0, 1], np.uint8), bitorder="little")
    sent = Packed("qsgd", (3,), {"bits": 8, "norm": 127.5}, (np.array([3, 0, 255], np.uint8), signs))
    c = np.array([1.0, -2.0, 0.25], np.float32)
    out, again = np.empty(3, np.float32), np.empty(3, np.float32)
    assert QSGD.add_decoded(sent, c, out, again)
    assert out.tolist() == again.tolist() == [2.5, -2.0, -127.25]
    four_bits = QSGD(bits=4).encode("w", np.array([1.5, 0.0, -127.5], np.float32))
    assert not QSGD.add_decoded(four_bits, c, out, again)  # levels of 4 bits: decoded, then added
    assert not QSGD.add_decoded(sent, c.astype(np.float64), out, again)
    assert not _numpy_only(monkeypatch, QSGD.add_decoded, sent, c, out, again)
