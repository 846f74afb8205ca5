"""The compressor family: each codec's stated error, unbiasedness, error feedback, wire sizes, and refusals."""

import inspect
import math
from pathlib import Path

import msgpack
import numpy as np
import pytest

from plug_asgd import compressors
from plug_asgd.compressors import (
    BF16,
    COMPRESSORS,
    FP16,
    QSGD,
    Codec,
    ErrorFeedback,
    NoCompression,
    PowerSGD,
    RandomK,
    Sign,
    TopK,
    TopKResidual,
    decode,
)
from plug_asgd.protocol.wire import PROTOCOL_VERSION, Packed, Sparse, WireError, encode
from plug_asgd.protocol.wire import decode as wire_decode


def _frames(tensor):
    return encode("push", None, {"t": tensor})


def _frame_bytes(tensor) -> int:
    return sum(len(memoryview(f).cast("B")) for f in _frames(tensor)[1:])


def _through_wire(tensor):
    return wire_decode(_frames(tensor)).tensors["t"]


def _dense(tensor, dtype=np.float32) -> np.ndarray:
    out = decode(tensor, dtype)
    return out.to_dense() if isinstance(out, Sparse) else out


def _codec(name: str, **knobs) -> Codec:
    """The codec called ``name`` with those of ``knobs`` it takes (the family's tests share one set)."""
    accepted = inspect.signature(COMPRESSORS[name]).parameters
    return compressors.get({"name": name, **{k: v for k, v in knobs.items() if k in accepted}})


def _blocks(numel: int) -> int:
    return max(1, math.ceil(numel / 65536))


# -- the wire's Packed tensor ---------------------------------------------------------------------------


def test_packed_round_trip_is_exact_with_its_spec_and_frames():
    arrays = (np.arange(5, dtype=np.uint8), np.array([[1, 65535]], dtype=np.uint16),
              np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), np.array(2.5, dtype=np.float64),
              np.zeros((0, 4), dtype=np.int64), np.array([True, False, True]))
    meta = {"bits": 3, "norm": 1.5, "tag": "x", "low": -(2 ** 63), "f32": np.float32(0.1)}
    packed = Packed("demo-1", (3, 4), meta, arrays)
    frames = encode("push", {"seq": 1}, {"p": packed, "d": np.ones(2, np.float32)})
    header = msgpack.unpackb(frames[0])
    assert header["tensors"][0] == {
        "name": "p", "enc": "packed", "codec": "demo-1", "shape": [3, 4],
        "meta": {"bits": 3, "norm": 1.5, "tag": "x", "low": -(2 ** 63), "f32": float(np.float32(0.1))},
        "arrays": [{"dtype": "uint8", "shape": [5]}, {"dtype": "uint16", "shape": [1, 2]},
                   {"dtype": "float32", "shape": [2, 3]}, {"dtype": "float64", "shape": []},
                   {"dtype": "int64", "shape": [0, 4]}, {"dtype": "bool", "shape": [3]}]}
    assert len(frames) == 1 + 6 + 1
    for frame, a in zip(frames[1:7], arrays, strict=True):
        assert bytes(frame) == a.astype(a.dtype.newbyteorder("<")).tobytes()
    assert packed.nbytes == 5 + 4 + 24 + 8 + 0 + 3 == _frame_bytes(packed)
    msg = wire_decode(frames)
    got = msg.tensors["p"]
    assert isinstance(got, Packed) and got.codec == "demo-1" and got.shape == (3, 4)
    assert got.meta == header["tensors"][0]["meta"]
    assert len(got.arrays) == len(arrays)
    for g, a in zip(got.arrays, arrays, strict=True):
        assert g.dtype == a.dtype and g.shape == a.shape
        np.testing.assert_array_equal(g, a)
    np.testing.assert_array_equal(msg.tensors["d"], np.ones(2, np.float32))


def _packed_header(**overrides):
    spec = {"name": "t", "enc": "packed", "codec": "qsgd", "shape": [4], "meta": {"bits": 2},
            "arrays": [{"dtype": "uint8", "shape": [2]}]}
    spec.update(overrides)
    for key in [k for k, v in overrides.items() if v is _DROP]:
        del spec[key]
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": "push", "fields": {}, "tensors": [spec]})


_DROP = object()
_OK_FRAME = b"\x00\x00"


@pytest.mark.parametrize(
    "overrides, frames, code",
    [
        ({}, [b"\x00"], "bad_frame_size"),  # 1 byte for uint8[2]
        ({}, [b"\x00" * 3], "bad_frame_size"),
        ({"arrays": [{"dtype": "uint16", "shape": [2]}]}, [_OK_FRAME], "bad_frame_size"),
        ({}, [], "frame_count"),
        ({}, [_OK_FRAME, _OK_FRAME], "frame_count"),
        ({"arrays": [{"dtype": "uint8", "shape": [2]}] * 2}, [_OK_FRAME], "frame_count"),
        ({"codec": 5}, [_OK_FRAME], "bad_packed"),
        ({"codec": ""}, [_OK_FRAME], "bad_packed"),
        ({"codec": "q" * 33}, [_OK_FRAME], "bad_packed"),
        ({"codec": "q sgd"}, [_OK_FRAME], "bad_packed"),
        ({"codec": _DROP}, [_OK_FRAME], "bad_packed"),
        ({"meta": [1]}, [_OK_FRAME], "bad_packed"),
        ({"meta": _DROP}, [_OK_FRAME], "bad_packed"),
        ({"meta": {"k": [1]}}, [_OK_FRAME], "bad_packed"),
        ({"meta": {"k": {"a": 1}}}, [_OK_FRAME], "bad_packed"),
        ({"meta": {"k": True}}, [_OK_FRAME], "bad_packed"),
        ({"meta": {"k": None}}, [_OK_FRAME], "bad_packed"),
        ({"meta": {"k": b"raw"}}, [_OK_FRAME], "bad_packed"),
        ({"meta": {"k": "x" * 257}}, [_OK_FRAME], "bad_packed"),
        ({"meta": {"": 1}}, [_OK_FRAME], "bad_packed"),
        ({"meta": {f"k{i}": i for i in range(33)}}, [_OK_FRAME], "bad_packed"),
        ({"arrays": "uint8"}, [_OK_FRAME], "bad_packed"),
        ({"arrays": _DROP}, [_OK_FRAME], "bad_packed"),
        ({"arrays": [5]}, [_OK_FRAME], "bad_packed"),
        ({"arrays": [{"dtype": "uint8", "shape": [2]}] * 17}, [_OK_FRAME] * 17, "bad_packed"),
        ({"arrays": [{"dtype": "object", "shape": [2]}]}, [_OK_FRAME], "bad_dtype"),
        ({"arrays": [{"dtype": ["uint8"], "shape": [2]}]}, [_OK_FRAME], "bad_dtype"),
        ({"arrays": [{"shape": [2]}]}, [_OK_FRAME], "bad_dtype"),
        ({"arrays": [{"dtype": "uint8", "shape": [-2]}]}, [_OK_FRAME], "bad_shape"),
        ({"arrays": [{"dtype": "uint8"}]}, [_OK_FRAME], "bad_shape"),
        ({"arrays": [{"dtype": "uint8", "shape": [1] * 9}]}, [b"\x00"], "bad_shape"),
        ({"shape": [True]}, [_OK_FRAME], "bad_shape"),
        ({"shape": _DROP}, [_OK_FRAME], "bad_shape"),
        ({"shape": [1 << 40]}, [_OK_FRAME], "bad_shape"),
    ],
)
def test_malformed_packed_tensors_are_refused(overrides, frames, code):
    wire_decode([_packed_header(), _OK_FRAME])  # the unmodified message is valid
    with pytest.raises(WireError) as err:
        wire_decode([_packed_header(**overrides), *frames])
    assert err.value.code == code


@pytest.mark.parametrize(
    "packed",
    [
        Packed("q sgd", (2,), {}, ()),
        Packed("", (2,), {}, ()),
        Packed("qsgd", (2,), {"k": [1]}, ()),
        Packed("qsgd", (2,), {"k": True}, ()),
        Packed("qsgd", (2,), {"k": 1 << 64}, ()),
        Packed("qsgd", (2,), {}, (np.zeros(2, np.complex64),)),
        Packed("qsgd", (2,), {}, (np.zeros(2, np.uint32),)),
        Packed("qsgd", (2,), {}, tuple(np.zeros(1, np.uint8) for _ in range(17))),
        Packed("qsgd", (-1,), {}, ()),
    ],
)
def test_encode_refuses_packed_tensors_that_cannot_travel(packed):
    with pytest.raises(WireError):
        encode("push", None, {"t": packed})


# -- decode: what the parameter server folds in --------------------------------------------------------


def test_decode_casts_dense_and_sparse_and_checks_the_shape():
    half = np.array([[1.5, -2.25], [65504, 2.0 ** -24]], np.float16)
    got = decode(half, np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [[1.5, -2.25], [65504, 2.0 ** -24]])
    assert decode(got, np.float32, shape=(2, 2)) is got  # nothing to do
    sparse = Sparse(np.array([0, 7]), np.array([0.5, -1], np.float16), (2, 4))
    got = decode(sparse, np.float64)
    assert isinstance(got, Sparse) and got.values.dtype == np.float64 and got.shape == (2, 4)
    np.testing.assert_array_equal(got.indices, [0, 7])
    np.testing.assert_array_equal(got.values, [0.5, -1.0])
    with pytest.raises(WireError) as err:
        decode(half, np.float32, shape=(4,))
    assert err.value.code == "bad_payload"


def _valid_payloads():
    x = np.random.default_rng(5).standard_normal((6, 5)).astype(np.float32)
    return {"bf16": BF16().encode("w", x), "qsgd": QSGD(3).encode("w", x),
            "sign": Sign().encode("w", x), "powersgd": PowerSGD(2).encode("w", x)}


def _mutate(codec, *, shape=None, meta=None, arrays=None, **meta_updates):
    p = _valid_payloads()[codec]
    new_meta = dict(p.meta if meta is None else meta)
    new_meta.update(meta_updates)
    return Packed(codec, p.shape if shape is None else shape, new_meta, p.arrays if arrays is None else arrays)


_P, _Q = np.ones((6, 2), np.float32), np.ones((5, 2), np.float32)
_BAD_PAYLOADS = {
    "unknown codec": lambda: Packed("zip", (4,), {}, ()),
    "not a tensor": lambda: [1.0, 2.0],
    "dense ints": lambda: np.arange(4),
    "dense uint16": lambda: np.arange(4, dtype=np.uint16),
    "sparse ints": lambda: Sparse(np.array([1]), np.array([3]), (4,)),
    "sparse index out of range": lambda: Sparse(np.array([1, 4]), np.ones(2, np.float32), (4,)),
    "sparse negative index": lambda: Sparse(np.array([-1]), np.ones(1, np.float32), (4,)),
    "sparse descending": lambda: Sparse(np.array([3, 1]), np.ones(2, np.float32), (4,)),
    "sparse duplicate": lambda: Sparse(np.array([1, 1]), np.ones(2, np.float32), (4,)),
    "sparse count mismatch": lambda: Sparse(np.array([1, 2]), np.ones(3, np.float32), (4,)),
    "bf16 meta": lambda: _mutate("bf16", extra=1),
    "bf16 no array": lambda: _mutate("bf16", arrays=()),
    "bf16 int16": lambda: _mutate("bf16", arrays=(np.zeros(30, np.int16),)),
    "bf16 short": lambda: _mutate("bf16", arrays=(np.zeros(29, np.uint16),)),
    "qsgd bits 0": lambda: _mutate("qsgd", bits=0),
    "qsgd bits 17": lambda: _mutate("qsgd", bits=17),
    "qsgd bits float": lambda: _mutate("qsgd", bits=3.0),
    "qsgd bits str": lambda: _mutate("qsgd", bits="3"),
    "qsgd bits bool": lambda: _mutate("qsgd", bits=True),
    "qsgd norm NaN": lambda: _mutate("qsgd", norm=float("nan")),
    "qsgd norm Inf": lambda: _mutate("qsgd", norm=float("inf")),
    "qsgd norm negative": lambda: _mutate("qsgd", norm=-1.0),
    "qsgd norm str": lambda: _mutate("qsgd", norm="1"),
    "qsgd no norm": lambda: _mutate("qsgd", meta={"bits": 3}),
    "qsgd codes short": lambda: _mutate("qsgd", arrays=(np.zeros(14, np.uint8),)),  # ceil(30 * 4 / 8) = 15
    "qsgd codes long": lambda: _mutate("qsgd", arrays=(np.zeros(16, np.uint8),)),
    "qsgd codes 2-D": lambda: _mutate("qsgd", arrays=(np.zeros((1, 15), np.uint8),)),
    "qsgd codes for other bits": lambda: _mutate("qsgd", bits=4),  # needs 19 bytes
    "qsgd two arrays": lambda: _mutate("qsgd", arrays=(np.zeros(15, np.uint8),) * 2),
    "sign scale NaN": lambda: _mutate("sign", scale=float("nan")),
    "sign scale negative": lambda: _mutate("sign", scale=-0.5),
    "sign bits long": lambda: _mutate("sign", arrays=(np.zeros(5, np.uint8),)),  # ceil(30 / 8) = 4
    "sign no array": lambda: _mutate("sign", arrays=()),
    "powersgd 1-D": lambda: _mutate("powersgd", shape=(30,)),
    "powersgd rank = min(n, m)": lambda: _mutate("powersgd", arrays=(np.ones((6, 5)), np.ones((5, 5)))),
    "powersgd rank 0": lambda: _mutate("powersgd", arrays=(np.ones((6, 0)), np.ones((5, 0)))),
    "powersgd P rows": lambda: _mutate("powersgd", arrays=(np.ones((5, 2), np.float32), _Q)),
    "powersgd Q rows": lambda: _mutate("powersgd", arrays=(_P, np.ones((6, 2), np.float32))),
    "powersgd ranks differ": lambda: _mutate("powersgd", arrays=(_P, np.ones((5, 1), np.float32))),
    "powersgd int P": lambda: _mutate("powersgd", arrays=(np.ones((6, 2), np.int32), _Q)),
    "powersgd 1-D P": lambda: _mutate("powersgd", arrays=(np.ones(12, np.float32), _Q)),
    "powersgd three arrays": lambda: _mutate("powersgd", arrays=(_P, _Q, _Q)),
    "powersgd empty": lambda: Packed("powersgd", (0, 5), {}, (np.ones((0, 1), np.float32), np.ones((5, 1)))),
    "powersgd meta": lambda: _mutate("powersgd", rank=2),
}


def test_the_valid_payloads_the_bad_ones_derive_from_decode():
    for codec, p in _valid_payloads().items():
        assert decode(_through_wire(p), np.float32, shape=(6, 5)).shape == (6, 5), codec
        assert decode(_mutate(codec), np.float32).shape == (6, 5), codec


@pytest.mark.parametrize("why", list(_BAD_PAYLOADS))
def test_decode_refuses_bad_payloads(why):
    payload = _BAD_PAYLOADS[why]()
    with pytest.raises(WireError) as err:
        decode(payload, np.float32)
    assert err.value.code == "bad_payload"
    if isinstance(payload, Packed) and why != "qsgd bits bool":  # the wire refuses bool meta itself
        # the wire carries it (it does not read codecs); decode on the other side still refuses it
        with pytest.raises(WireError) as err:
            decode(_through_wire(payload), np.float32)
        assert err.value.code == "bad_payload"


# -- each codec's error ---------------------------------------------------------------------------------


def test_none_is_exact():
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    sent = NoCompression().encode("w", x)
    assert sent is x
    np.testing.assert_array_equal(_dense(_through_wire(sent)), x)


def _magnitudes(rng, low_exp, high_exp, size):
    return (rng.choice([-1.0, 1.0], size) * 2.0 ** rng.uniform(low_exp, high_exp, size)).astype(np.float32)


def test_fp16_relative_error_on_normal_range_values_and_saturation():
    x = _magnitudes(np.random.default_rng(1), -14, 15.99, 5000)  # half's normal range
    sent = FP16().encode("w", x)
    assert isinstance(sent, np.ndarray) and sent.dtype == np.float16
    got = _dense(_through_wire(sent))
    assert np.all(np.abs(got - x) <= 1e-3 * np.abs(x))
    assert np.all(np.abs(got.astype(np.float64) - x) <= 2.0 ** -11 * np.abs(x))  # half an ulp of 11 bits
    special = np.array([1e5, -1e6, np.inf, -np.inf, np.nan, 0.0], np.float32)
    got = _dense(FP16().encode("w", special))
    np.testing.assert_array_equal(got, [65504, -65504, np.inf, -np.inf, np.nan, 0.0])


def _bf16_reference(x):
    """Nearest bfloat16 of float32 ``x``, ties to even, from the two candidates around it (finite values)."""
    bits = x.view(np.uint32)
    low_bits = bits & np.uint32(0xFFFF0000)  # truncation towards zero
    high_bits = low_bits + np.uint32(0x10000)  # next one away from zero
    low, high = low_bits.view(np.float32).astype(np.float64), high_bits.view(np.float32).astype(np.float64)
    d_low, d_high = np.abs(x - low), np.abs(high - x)
    low_is_even = (low_bits >> np.uint32(16)) % 2 == 0
    take_low = (d_low < d_high) | ((d_low == d_high) & low_is_even)
    return np.where(take_low, low, high)


def test_bf16_is_round_to_nearest_even_within_two_to_the_minus_8():
    x = _magnitudes(np.random.default_rng(2), -100, 100, 20000)
    sent = BF16().encode("w", x)
    assert isinstance(sent, Packed) and sent.codec == "bf16" and sent.arrays[0].dtype == np.uint16
    got = _dense(_through_wire(sent))
    assert np.all(np.abs(got.astype(np.float64) - x) <= 2.0 ** -8 * np.abs(x))
    np.testing.assert_array_equal(got, _bf16_reference(x))
    # 1 + 2**-8 lies halfway between 1 (even) and 1 + 2**-7 (odd); 1 + 3 * 2**-8 between odd and even.
    ties = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20], np.float32)
    np.testing.assert_array_equal(_dense(BF16().encode("w", ties)), [1, 1 + 2 ** -6, -1, 1 + 2 ** -7])
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    got = _dense(BF16().encode("w", special))
    np.testing.assert_array_equal(got, special)
    assert np.signbit(got[4]) and not np.signbit(got[3])


def test_topk_sends_the_exact_top_fraction_and_keeps_nothing():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 40)).astype(np.float32)
    comp = TopK(0.03)
    k = math.ceil(0.03 * 2000)  # 60
    want = np.sort(np.argsort(-np.abs(x.reshape(-1)), kind="stable")[:k])
    for _ in range(2):  # no state: the same update gives the same result
        sent = comp.encode("w", x)
        assert isinstance(sent, Sparse) and sent.nnz == k
        np.testing.assert_array_equal(sent.indices, want)
        got = _dense(_through_wire(sent)).reshape(-1)
        np.testing.assert_array_equal(got[want], x.reshape(-1)[want])
        assert np.count_nonzero(np.delete(got, want)) == 0


def _assert_unbiased(samples, x, sigma):
    """The mean of N independent draws is within 5 standard errors of x on every coordinate.

    ``sigma`` is the exact per-coordinate standard deviation of one draw, so the standard error
    of the mean is ``sigma / sqrt(N)``; a 5-sigma miss has probability below 6e-7 per coordinate.
    Also the sum of squared z-scores is a chi-square with one degree per random coordinate
    (mean d, sd sqrt(2 d)): checked within 6 sd, it says the variance is the one stated.
    """
    n = samples.shape[0]
    mean = samples.astype(np.float64).mean(axis=0)
    stderr = sigma / math.sqrt(n)
    rounding = 1e-6 * np.abs(x).max()  # float32 values: the mean of exact draws is exact up to this
    assert np.all(np.abs(mean - x) <= 5 * stderr + rounding)
    random = sigma > 0
    d = int(random.sum())
    chi2 = float((((mean - x)[random] / stderr[random]) ** 2).sum())
    assert d - 6 * math.sqrt(2 * d) < chi2 < d + 6 * math.sqrt(2 * d)


N_DRAWS = 2000


def test_randomk_is_unbiased_with_the_stated_variance():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(40).astype(np.float32)
    x[7] = 0.0
    fraction, d = 0.25, 40
    k = math.ceil(fraction * d)  # 10
    samples = np.empty((N_DRAWS, d), np.float32)
    for seed in range(N_DRAWS):
        sent = RandomK(fraction, seed=seed, error_feedback=False).encode("w", x)
        assert isinstance(sent, Sparse) and sent.nnz == k
        np.testing.assert_array_equal(sent.values, x[sent.indices] * np.float32(d / k))
        samples[seed] = _dense(sent)
    sigma = np.abs(x.astype(np.float64)) * math.sqrt(d / k - 1)  # x * d/k with probability k/d, else 0
    _assert_unbiased(samples, x.astype(np.float64), sigma)


def test_qsgd_is_unbiased_with_the_stated_variance_and_brackets_each_value():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(64).astype(np.float32)
    x[3] = 0.0
    bits = 2
    s = 2 ** bits - 1
    norm = float(np.float32(np.linalg.norm(x.astype(np.float64))))
    r = np.abs(x.astype(np.float64)) / norm * s
    low = np.floor(r)
    p = r - low  # probability of the upper level
    lower, upper = np.sign(x) * norm * low / s, np.sign(x) * norm * (low + 1) / s
    samples = np.empty((N_DRAWS, 64), np.float32)
    for seed in range(N_DRAWS):
        sent = QSGD(bits, seed=seed).encode("w", x)
        assert sent.meta == {"bits": bits, "norm": norm}
        got = _dense(sent)
        tol = 1e-6 * norm
        assert np.all((np.abs(got - lower) <= tol) | (np.abs(got - upper) <= tol))
        samples[seed] = got
    np.testing.assert_array_equal(_dense(_through_wire(sent)), got)
    sigma = norm / s * np.sqrt(p * (1 - p))
    _assert_unbiased(samples, x.astype(np.float64), sigma)


def test_qsgd_levels_are_exact_at_the_grid_points():
    # ||x|| = 3 and |x_i| / ||x|| is 2/3, 2/3, 1/3 or 0: with s divisible by 3, r_i = s |x_i| / ||x|| is an
    # integer, so nothing is random and every value is sent exactly
    x = np.array([2, -2, 1, 0, 0, 0, 0, 0], np.float32)
    for bits in (2, 4, 16):  # s = 3, 15, 65535
        for seed in range(5):
            np.testing.assert_allclose(_dense(QSGD(bits, seed=seed).encode("w", x)), x, rtol=1e-6, atol=0)


def test_sign_sends_signs_and_the_mean_magnitude():
    x = np.array([[0.5, -2.0, 0.0], [3.5, -0.25, 1e-9]], np.float32)
    sent = Sign().encode("w", x)
    scale = np.float32(np.abs(x.astype(np.float64)).mean())
    assert sent.meta == {"scale": float(scale)}
    np.testing.assert_array_equal(_dense(_through_wire(sent)), [[scale, -scale, scale], [scale, -scale, scale]])


def _low_rank(rng, shape, rank):
    n, m = shape[0], math.prod(shape[1:])
    return (rng.standard_normal((n, rank)) @ rng.standard_normal((rank, m))).astype(np.float32).reshape(shape)


def _rank_r_error(x, r):
    s = np.linalg.svd(x.reshape(x.shape[0], -1).astype(np.float64), compute_uv=False)
    return math.sqrt(float((s[r:] ** 2).sum()))


@pytest.mark.parametrize("true_rank", [1, 3, 4])
def test_powersgd_is_exact_for_a_matrix_of_rank_at_most_r(true_rank):
    x = _low_rank(np.random.default_rng(true_rank), (40, 3, 10), true_rank)
    sent = PowerSGD(rank=4).encode("w", x)
    assert isinstance(sent, Packed) and [a.shape for a in sent.arrays] == [(40, 4), (30, 4)]
    got = _dense(_through_wire(sent))
    assert got.shape == x.shape
    assert np.linalg.norm(got - x) <= 1e-5 * np.linalg.norm(x)  # float32 rounding only


@pytest.mark.parametrize("n, m, r", [(64, 48, 4), (100, 30, 2), (50, 200, 8)])
def test_powersgd_on_a_random_matrix_is_close_to_the_best_rank_r(n, m, r):
    x = np.random.default_rng(n).standard_normal((n, m)).astype(np.float32)
    got = _dense(PowerSGD(rank=r, seed=1).encode("w", x))
    err = np.linalg.norm((got - x).astype(np.float64))
    best = _rank_r_error(x, r)
    assert best <= err <= 1.1 * best
    # (any projection is within ||x||, about 1.1-1.2 * best for a Gaussian matrix: also check the warm start)


def test_powersgd_warm_start_converges_to_the_best_rank_r_on_a_decaying_spectrum():
    rng = np.random.default_rng(7)
    u, _ = np.linalg.qr(rng.standard_normal((64, 48)))
    v, _ = np.linalg.qr(rng.standard_normal((48, 48)))
    x = ((u / np.arange(1, 49)) @ v.T).astype(np.float32)  # singular values 1, 1/2, 1/3, ...
    best = _rank_r_error(x, 4)
    assert np.linalg.norm(x) > 2.5 * best  # a projection's trivial bound is loose here
    comp = PowerSGD(rank=4, seed=3)
    errors = [float(np.linalg.norm((_dense(comp.encode("w", x)) - x).astype(np.float64))) for _ in range(10)]
    assert errors[0] <= 2 * best
    assert errors[-1] <= 1.01 * best
    assert errors[-1] < errors[0]


def test_powersgd_sends_dense_where_low_rank_would_not_be_smaller():
    rng = np.random.default_rng(8)
    comp = PowerSGD(rank=4)
    for x in (rng.standard_normal(100).astype(np.float32),  # 1-D
              rng.standard_normal((3, 50)).astype(np.float32),  # rank >= min(n, m)
              rng.standard_normal((8, 8)).astype(np.float32),  # 4 * (8 + 8) >= 64
              np.full((20, 20), np.nan, np.float32)):  # the PS refuses it as not finite
        assert comp.encode("w", x) is x
    assert isinstance(comp.encode("w", rng.standard_normal((9, 9)).astype(np.float32)), Packed)  # 72 < 81


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [(0, 0), (17, 29), (39, 5)])
def test_powersgd_sends_dense_where_one_value_is_not_finite(bad, where):
    # the codec checks its small products, not the matrix: one bad value must still reach them, with a first
    # factor drawn and with a warm-started one (whose column for that value may be anything)
    rng = np.random.default_rng(9)
    comp = PowerSGD(rank=4)
    assert isinstance(comp.encode("w", rng.standard_normal((40, 30)).astype(np.float32)), Packed)  # warm
    for codec in (comp, PowerSGD(rank=4)):
        x = rng.standard_normal((40, 30)).astype(np.float32)
        x[where] = bad
        assert codec.encode("w", x) is x


# -- error feedback --------------------------------------------------------------------------------------

_EXACT = {"none", "fp16", "bf16", "topk", "randomk"}  # decoded values are copies of v, zero, or within 2x of v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_error_feedback_keeps_exactly_what_was_not_sent(name, dtype):
    comp = _codec(name, fraction=0.1, bits=4, rank=2, error_feedback=True, seed=1).encoder()
    assert isinstance(comp, ErrorFeedback) and comp.name == name
    unit = 2.0 ** -24 if dtype == np.float32 else 2.0 ** -53  # unit roundoff of one operation
    rng = np.random.default_rng(9)
    residual = np.zeros((24, 20), dtype)
    terms = [[] for _ in range(residual.size)]  # per coordinate: everything sent, minus every update
    bound = np.zeros(residual.size)
    for _ in range(5):
        update = (rng.standard_normal((24, 20)) * 10.0 ** rng.uniform(-3, 1)).astype(dtype)
        v = update + residual  # what the worker owes the PS this step
        sent = comp.encode("w", update)
        got = _dense(_through_wire(sent), dtype)
        new = comp.residuals["w"]
        assert new.dtype == dtype and new.shape == update.shape
        np.testing.assert_array_equal(new, v - got)  # the definition, bit for bit
        if name in _EXACT:
            np.testing.assert_array_equal(got + new, v)
        else:  # exact up to the rounding of that one subtraction, checked in exact arithmetic (fsum)
            gap = np.array([math.fsum((a, b, -c)) for a, b, c in zip(got.flat, new.flat, v.flat, strict=True)])
            assert np.all(np.abs(gap) <= unit * np.abs(new.reshape(-1)))
        for t, a, g in zip(terms, got.flat, update.flat, strict=True):
            t += [float(a), -float(g)]
        bound += unit * (np.abs(v) + np.abs(new)).reshape(-1)  # rounding of v and of the residual
        residual = new
    # nothing is lost over the steps: all that was sent plus the last residual is all the updates
    total = np.array([math.fsum([*t, float(r)]) for t, r in zip(terms, residual.flat, strict=True)])
    assert np.all(np.abs(total) <= bound)


def test_error_feedback_around_topk_is_adacomps_topk_residual():
    rng = np.random.default_rng(10)
    ef, adacomp = TopK(0.02).encoder(), TopKResidual(0.02)
    for _ in range(4):
        update = rng.standard_normal((30, 40)).astype(np.float32)
        a, b = ef.encode("w", update), adacomp.encode("w", update)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.values, b.values)
        np.testing.assert_array_equal(ef.residuals["w"].reshape(-1), adacomp.residuals["w"])


def test_error_feedback_residual_stays_bounded_with_unscaled_randomk():
    # Scaled (unbiased) values would make the expected squared residual grow by numel/k - 1 = 9x a step.
    rng = np.random.default_rng(11)
    comp = RandomK(0.1, seed=2).encoder()
    assert not comp.inner.unbiased
    for _ in range(30):
        update = rng.standard_normal(1000).astype(np.float32)
        comp.encode("w", update)
    # E||r_t+1||^2 = (1 - k/n) E||g + r_t||^2: at steady state ||r|| ~ sqrt((1 - d) / d) / (1 - sqrt(1 - d)) ||g||
    delta = 0.1
    steady = math.sqrt(1 - delta) / (1 - math.sqrt(1 - delta)) * math.sqrt(1000)
    assert np.linalg.norm(comp.residuals["w"]) < 2 * steady


# -- wire sizes: each codec's own formula (``wire_bytes``), for every registered codec ----------------

_SHAPES = [(300, 70), (70001,), (16, 3, 5, 5)]


def _variants(name):
    """The registered codec ``name`` at its defaults and at the edges of its knobs, error feedback off and on."""
    for fraction in (0.01, 1.0):
        for bits in (1, 3, 8, 16):
            for error_feedback in (False, True):
                yield _codec(name, fraction=fraction, bits=bits, rank=3, error_feedback=error_feedback)


@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_wire_bytes_match_each_codecs_formula(name, shape):
    x = np.random.default_rng(12).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[:5] = 0.0  # topk does not send exact zeros; with a fraction of 1 they would be in the top k
    nonzero = int(np.count_nonzero(x))
    for codec in _variants(name):
        for comp in (codec, codec.encoder()):  # the codec itself, and as a worker encodes (with error feedback)
            assert _frame_bytes(comp.encode("w", x)) == codec.wire_bytes(shape, 4, nonzero), codec


def test_wire_bytes_worked_examples():
    # the figures the docstrings promise, by hand, for a 9216 x 128 float32 layer (1,179,648 values)
    x = np.random.default_rng(13).standard_normal((9216, 128)).astype(np.float32)
    numel = 9216 * 128
    assert _frame_bytes(Sign().encoder().encode("w", x)) == numel // 8 == 147_456
    assert _frame_bytes(QSGD(bits=8).encoder().encode("w", x)) == numel + numel // 8 == 1_327_104
    assert _frame_bytes(PowerSGD(rank=4).encoder().encode("w", x)) == 4 * 4 * (9216 + 128) == 149_504
    assert _frame_bytes(RandomK(0.01).encoder().encode("w", x)) == 4 * 18 + 6 * 11_797
    assert _frame_bytes(BF16().encoder().encode("w", x)) == 2 * numel
    assert TopK(0.01).wire_bytes((9216, 128)) == 4 * 18 + 6 * 11_797


def test_the_docs_codec_table_is_the_registry():
    page = (Path(__file__).resolve().parent.parent / "docs" / "modes.md").read_text()
    assert compressors.codec_table() in page


# -- the registry, get and encoder --------------------------------------------------------------------

_INNER = {"none": NoCompression, "fp16": FP16, "bf16": BF16, "topk": TopK, "randomk": RandomK, "qsgd": QSGD,
          "sign": Sign, "powersgd": PowerSGD}


def test_get_builds_each_by_name_and_the_encoder_adds_error_feedback_where_biased():
    assert COMPRESSORS == _INNER
    for name, cls in _INNER.items():
        default = compressors.get(name).encoder()
        wrapped = name in {"sign", "topk", "randomk", "powersgd"}
        assert isinstance(default, ErrorFeedback) == wrapped, name
        assert default.name == name
        assert isinstance(default.inner if wrapped else default, cls)
        assert isinstance(compressors.get({"name": name, "error_feedback": True}).encoder(), ErrorFeedback)
        plain = cls(error_feedback=False).encoder()
        assert isinstance(plain, cls) and plain.name == name
        assert compressors.get(default.inner if wrapped else default) is (default.inner if wrapped else default)
    assert compressors.get({"name": "topk", "fraction": 0.2}).encoder().inner.fraction == 0.2
    assert QSGD(bits=3).encoder().bits == 3
    assert PowerSGD(rank=2).encoder().inner.rank == 2
    assert RandomK(error_feedback=False).encoder().unbiased
    assert not RandomK().encoder().inner.unbiased
    assert TopK(0.2) == compressors.get({"name": "topk", "fraction": 0.2}) != TopK(0.3)
    assert repr(QSGD(bits=3)) == "QSGD(bits=3, seed=0, error_feedback=False)"


def test_a_new_codec_is_one_class_and_nothing_else():
    class Halves(Codec):
        name = "test_halves"
        sends = "every other coordinate"
        wire_formula = "itemsize * ceil(numel / 2)"

        def encode(self, key, update):
            return np.asarray(update).reshape(-1)[::2].copy()

        def wire_bytes(self, shape, itemsize=4, nonzero=None):
            return itemsize * -(-math.prod(shape) // 2)

    try:
        assert compressors.get("test_halves") == Halves()
        assert "`test_halves`" in compressors.codec_table()
        x = np.ones(7, np.float32)
        assert _frame_bytes(Halves().encode("w", x)) == Halves().wire_bytes(x.shape)
        with pytest.raises(TypeError, match="two codecs are called 'test_halves'"):
            type("Again", (Codec,), {"name": "test_halves"})
    finally:
        del COMPRESSORS["test_halves"]


def test_the_encoders_seeds_make_the_stochastic_ones_reproducible_and_differ_by_rank():
    x = np.random.default_rng(14).standard_normal((20, 30)).astype(np.float32)
    for name in ("randomk", "qsgd", "powersgd"):
        def frames(seed, rank=0, name=name):
            codec = _codec(name, fraction=0.1, seed=seed)
            return [bytes(f) for f in _frames(codec.encoder(rank).encode("w", x))]
        assert frames(3) == frames(3) == frames(2, rank=1), name
        assert frames(3) != frames(4), name


def test_get_refuses_unknown_names_and_bad_parameters():
    with pytest.raises(ValueError) as err:
        compressors.get("gzip")
    for name in _INNER:
        assert name in str(err.value)
    for bits in (0, 17, 2.5, True):
        with pytest.raises(ValueError, match="bits must be an integer"):
            QSGD(bits=bits)
    for fraction in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="fraction"):
            TopK(fraction)
        with pytest.raises(ValueError, match="fraction"):
            RandomK(fraction)
    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="compressor 'fp16'.*unexpected keyword argument 'bits'"):
        compressors.get({"name": "fp16", "bits": 8})
    with pytest.raises(TypeError):
        compressors.get(8)


def test_empty_and_scalar_tensors_go_through_every_compressor():
    for name in COMPRESSORS:
        comp = compressors.get(name).encoder()
        for x in (np.zeros((0, 3), np.float32), np.array(1.5, np.float32), np.zeros(10, np.float32)):
            got = _dense(_through_wire(comp.encode("w", x)))
            assert got.shape == x.shape, name
            assert np.all(np.isfinite(got)), name


def test_randomk_holds_a_coordinate_back_for_its_lag_on_average_and_a_fit_of_few_such_lags_is_warned():
    # every push adds 1 to every coordinate, so a value sent is the number of pushes it waited
    enc, waits = RandomK(0.05, seed=3).encoder(), []
    for push in range(600):
        sent = enc.encode("w", np.ones(2000, np.float32))
        if push >= 200:  # past the first waits, which the start cuts short
            waits.append(sent.values)
    assert abs(np.concatenate(waits).mean() - 20.0) < 1.0  # geometric with p = 0.05: mean 20
    assert RandomK(0.05).lag_pushes() == 20.0
    assert RandomK(0.05, error_feedback=False).lag_pushes() is None  # unbiased: nothing waits
    assert RandomK(1.0).lag_pushes() is None and TopK(0.05).lag_pushes() is None
    note = RandomK(0.05).short_fit_warning(80.0)
    assert "about once in 20 pushes" in note and "about 80 pushes per worker" in note
    assert RandomK(0.05).short_fit_warning(100.0) is None  # 5 lags
    assert RandomK(0.05).short_fit_warning(math.inf) is None  # a fit of unknown length
    assert TopK(0.05).short_fit_warning(1.0) is None


def test_randomks_default_fraction_follows_the_fits_length_and_a_given_one_stays():
    auto = RandomK()
    assert auto.fraction == 0.01 and auto.config()["fraction"] is None and auto == RandomK(None)
    assert auto.encoder().inner.fraction == 0.01  # a worker's copy stays at the default until its fit is known
    # a fraction of at least 10 / pushes: a coordinate's mean wait (1 / fraction) at most a tenth of the fit
    assert auto.for_fit(125) == RandomK(0.08)  # one epoch of 16,000 images at 4 workers, batch 32
    assert auto.for_fit(250) == RandomK(0.04)  # at 2 workers
    assert auto.for_fit(500) == RandomK(0.02)
    assert auto.for_fit(1000) is auto and auto.for_fit(10_000) is auto and auto.for_fit(math.inf) is auto
    assert auto.for_fit(4) == RandomK(1.0)
    assert auto.for_fit(125).short_fit_warning(125) is None
    assert RandomK(0.01).for_fit(125) == RandomK(0.01)  # given: kept, and warned about (above)
    assert RandomK(error_feedback=False).for_fit(125).fraction == 0.01  # unbiased: nothing waits
    assert RandomK(seed=4).for_fit(125).seed == 4
    assert TopK(0.01).for_fit(125) == TopK(0.01)
