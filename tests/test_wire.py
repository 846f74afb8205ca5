"""The wire codec: exact round trips, the byte counts the docs promise, and refusal of malformed frames."""

import math

import msgpack
import numpy as np
import pytest

from plug_asgd.protocol.wire import PROTOCOL_VERSION, Limits, Sparse, WireError, decode, encode, sparse_wire_bytes


def test_dense_round_trip_keeps_values_dtype_and_shape():
    rng = np.random.default_rng(0)
    tensors = {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "h": rng.standard_normal(5).astype(np.float16),
        "d": rng.standard_normal((2, 2, 2)).astype(np.float64),
        "count": np.array(7, dtype=np.int64),
        "flag": np.array([True, False]),
    }
    msg = decode(encode("push", {"base_version": 3, "note": "x"}, tensors))
    assert msg.type == "push" and msg.fields == {"base_version": 3, "note": "x"}
    assert list(msg.tensors) == list(tensors)
    for name, t in tensors.items():
        got = msg.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape
        np.testing.assert_array_equal(got, t)


def test_dense_frame_is_the_raw_little_endian_bytes():
    t = np.arange(6, dtype=np.float32).reshape(2, 3)
    frames = encode("pull", None, {"t": t})
    assert bytes(frames[1]) == t.astype("<f4").tobytes()
    header = msgpack.unpackb(frames[0])
    assert header["v"] == PROTOCOL_VERSION
    assert header["tensors"] == [{"name": "t", "enc": "dense", "dtype": "float32", "shape": [2, 3]}]


def test_sparse_round_trip_and_its_byte_count():
    # 70000 coordinates = 2 blocks of 65536; 3 values, one in the second block.
    idx = np.array([5, 65535, 69999], dtype=np.int64)
    vals = np.array([1.5, -2.0, 3.25], dtype=np.float32)
    frames = encode("push", None, {"s": Sparse(idx, vals, (700, 100))})
    payload = sum(len(memoryview(f).cast("B")) for f in frames[1:])
    assert payload == 4 * 2 + 2 * 3 + 4 * 3 == 26 == sparse_wire_bytes(70000, 3)
    got = decode(frames).tensors["s"]
    assert isinstance(got, Sparse) and got.shape == (700, 100)
    np.testing.assert_array_equal(got.indices, idx)
    np.testing.assert_array_equal(got.values, vals)
    dense = got.to_dense().reshape(-1)
    assert dense[65535] == -2.0 and dense[69999] == 3.25 and np.count_nonzero(dense) == 3


def test_sparse_wire_bytes_formula():
    assert sparse_wire_bytes(1_179_648, 11_797) == 4 * math.ceil(1_179_648 / 65536) + 6 * 11_797


def _header(**overrides):
    h = {"v": PROTOCOL_VERSION, "type": "push", "fields": {}, "tensors": []}
    h.update(overrides)
    return msgpack.packb(h)


def _spec(**kw):
    base = {"name": "t", "enc": "dense", "dtype": "float32", "shape": [2]}
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "frames, code",
    [
        ([], "empty"),
        ([b"\xc1\xff garbage"], "bad_header"),
        ([msgpack.packb([1, 2, 3])], "bad_header"),
        ([_header(v=PROTOCOL_VERSION + 1)], "bad_version"),
        ([_header(type=5)], "bad_header"),
        ([_header(tensors=[_spec()])], "frame_count"),  # frame missing
        ([_header(), b"extra"], "frame_count"),  # frame too many
        ([_header(tensors=[_spec()]), b"\x00" * 7], "bad_frame_size"),
        ([_header(tensors=[_spec(dtype="object")]), b"\x00" * 8], "bad_dtype"),
        ([_header(tensors=[_spec(enc="pickle")]), b"\x00" * 8], "bad_tensor"),
        ([_header(tensors=[_spec(shape=[-2])]), b""], "bad_shape"),
        ([_header(tensors=[_spec(shape=[True])]), b"\x00" * 4], "bad_shape"),
        ([_header(tensors=[_spec(), _spec()]), b"\x00" * 8, b"\x00" * 8], "bad_tensor"),
        ([_header(tensors=[{"enc": "dense"}])], "bad_tensor"),
    ],
)
def test_malformed_messages_are_refused_with_a_code(frames, code):
    with pytest.raises(WireError) as err:
        decode(frames)
    assert err.value.code == code


def _sparse_frames(counts, offsets, nnz, numel=10, values=None):
    values = np.ones(len(offsets), dtype="<f4") if values is None else values
    spec = _spec(enc="sparse", shape=[numel], nnz=nnz)
    return [_header(tensors=[spec]), np.asarray(counts, "<u4").tobytes(), np.asarray(offsets, "<u2").tobytes(),
            values.tobytes()]


@pytest.mark.parametrize(
    "counts, offsets, nnz, why",
    [
        ([2], [1, 12], 2, "index 12 is out of range for 10 coordinates"),
        ([2], [4, 3], 2, "not ascending"),
        ([2], [3, 3], 2, "duplicate index"),
        ([1], [1, 2], 2, "counts do not add up to nnz"),
        ([11], list(range(11)), 11, "nnz above numel"),
    ],
)
def test_sparse_tensors_that_lie_are_refused(counts, offsets, nnz, why):
    with pytest.raises(WireError) as err:
        decode(_sparse_frames(counts, offsets, nnz))
    assert err.value.code in {"bad_sparse", "bad_frame_size"}, why


def test_limits_are_enforced_before_parsing():
    frames = encode("push", None, {"t": np.zeros(1000, np.float32)})
    with pytest.raises(WireError) as err:
        decode(frames, Limits(max_message_bytes=1000))
    assert err.value.code == "too_large"
    with pytest.raises(WireError) as err:
        decode([_header()] + [b""] * 10, Limits(max_frames=5))
    assert err.value.code == "too_many_frames"
    with pytest.raises(WireError) as err:
        decode([_header(fields={"pad": "x" * 200})], Limits(max_header_bytes=100))
    assert err.value.code == "too_large"


def test_encode_refuses_what_cannot_travel():
    with pytest.raises(WireError):
        encode("push", None, {"t": np.array(["a"], dtype=object)})
    with pytest.raises(WireError):
        encode("push", None, {"s": Sparse(np.array([1, 2]), np.array([1.0], np.float32), (4,))})
