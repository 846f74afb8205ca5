"""Every kind of bad input, over a real socket to a PS process: one exact error code, one count, no harm.

For each case the raw DEALER gets an ``error`` reply with the expected code, the PS's
``refused[code]`` grows by exactly one (and no other counter of refusals moves), the central
tensors are byte-identical afterwards, and a normal worker's pull is still answered.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from plug_asgd.protocol.wire import PROTOCOL_VERSION, decode, encode
from plug_asgd.worker.client import PSClient, PSError
from tests.conftest import serving_pair

pytestmark = pytest.mark.timeout(60)

LIMIT = 4096  # the PS's --max-message-bytes in these tests
W0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.float32)}


@pytest.fixture
def ps(start_ps):
    good, raw = serving_pair(start_ps("asgd", max_message_bytes=LIMIT), W0)
    yield good, raw
    raw.close(0)
    good.close()


def _push(seq: int, tensors: dict, **fields) -> list:
    return encode("push", {"rid": 1, "rank": 1, "base_version": 0, "seq": seq, "session": "raw", **fields}, tensors)


def _header(**overrides) -> bytes:
    h = {"v": PROTOCOL_VERSION, "type": "push", "fields": {"rid": 1}, "tensors": []}
    h.update(overrides)
    return msgpack.packb(h)


def _sparse_frames(counts, offsets, numel=6, values=None, seq=1) -> list:
    values = np.ones(len(offsets), "<f4") if values is None else np.asarray(values, "<f4")
    spec = {"name": "b" if numel == 2 else "w", "enc": "sparse", "dtype": "float32",
            "shape": [numel] if numel == 2 else [2, 3], "nnz": len(offsets)}
    fields = {"rid": 1, "rank": 1, "base_version": 0, "seq": seq, "session": "raw"}
    return [_header(fields=fields, tensors=[spec]), np.asarray(counts, "<u4").tobytes(),
            np.asarray(offsets, "<u2").tobytes(), values.tobytes()]


def _version(v: int) -> list:
    frames = encode("pull", {"rid": 1})
    frames[0] = frames[0].replace(bytes([0xA1, 0x76, PROTOCOL_VERSION]), bytes([0xA1, 0x76, v]))
    return frames


OK = {"w": np.ones((2, 3), np.float32)}
CASES = {
    # malformed frames
    "garbage header": ([b"\xc1\xff\x00 not msgpack"], "bad_header"),
    "empty frame": ([b""], "bad_header"),
    "header not a map": ([msgpack.packb([1, 2, 3])], "bad_header"),
    "type not a string": ([_header(type=7)], "bad_header"),
    # frame counts
    "a tensor frame missing": (_push(1, OK)[:1], "frame_count"),
    "one frame too many": ([*_push(1, OK), b"\x00" * 4], "frame_count"),
    "sparse with two of its three frames": (_sparse_frames([1], [0])[:3], "frame_count"),
    # type and version
    "unknown message type": (encode("steal", {"rid": 1}), "unknown_type"),
    "dunder type": (encode("__init__", {"rid": 1}), "unknown_type"),
    "protocol version 99": (_version(99), "bad_version"),
    "protocol version 0": (_version(0), "bad_version"),
    # tensors of the wrong name, size, dtype, shape
    "unknown tensor name": (_push(1, {"nope": np.ones((2, 3), np.float32)}), "unknown_tensor"),
    "frame shorter than its shape": ([_header(fields={"rid": 1}, tensors=[
        {"name": "w", "enc": "dense", "dtype": "float32", "shape": [2, 3]}]), b"\x00" * 20], "bad_frame_size"),
    "wrong numel": (_push(1, {"w": np.ones(5, np.float32)}), "bad_tensor"),
    "same numel, wrong shape": (_push(1, {"w": np.ones((3, 2), np.float32)}), "bad_tensor"),
    "integer dtype": (_push(1, {"w": np.ones((2, 3), np.int32)}), "bad_payload"),
    "dtype not allowed on the wire": ([_header(fields={"rid": 1}, tensors=[
        {"name": "w", "enc": "dense", "dtype": "complex64", "shape": [2, 3]}]), b"\x00" * 48], "bad_dtype"),
    "negative dimension": ([_header(fields={"rid": 1}, tensors=[
        {"name": "w", "enc": "dense", "dtype": "float32", "shape": [-2, 3]}]), b""], "bad_shape"),
    "unknown encoding": ([_header(fields={"rid": 1}, tensors=[
        {"name": "w", "enc": "pickle", "dtype": "float32", "shape": [2, 3]}]), b"\x00" * 24], "bad_tensor"),
    # sparse updates whose indices lie
    "sparse index out of range": (_sparse_frames([1], [6]), "bad_sparse"),
    "sparse indices not ascending": (_sparse_frames([2], [4, 1]), "bad_sparse"),
    "sparse counts that do not add up": (_sparse_frames([3], [0, 1]), "bad_sparse"),
    # NaN and Inf
    "NaN dense": (_push(1, {"w": np.full((2, 3), np.nan, np.float32)}), "not_finite"),
    "+Inf dense": (_push(1, {"w": np.full((2, 3), np.inf, np.float32)}), "not_finite"),
    "-Inf in one coordinate": (_push(1, {"b": np.array([0, -np.inf], np.float32)}), "not_finite"),
    "float64 beyond float32": (_push(1, {"b": np.array([0, 1e300])}), "not_finite"),
    "NaN in a sparse update": (_sparse_frames([1], [2], values=[np.nan]), "not_finite"),
    # fields
    "base_version not an int": (_push(1, OK, base_version="0"), "bad_field"),
    "negative seq": (_push(-1, OK), "bad_field"),
    "base_version from the future": (_push(1, OK, base_version=10**6), "bad_field"),
    "hello with a heartbeat of -1 s": (encode("hello", {"rid": 1, "rank": 1, "world_size": 2, "stage": 1,
                                                        "mode": "asgd", "session": "raw", "heartbeat_s": -1}),
                                       "bad_field"),
    "heartbeat without a session": (encode("heartbeat", {"rank": 0}), "bad_field"),
    # oversized (checked by the PS on the whole message: see plug_asgd.ps.limits.frame_cap)
    "message over the limit in many frames": (
        _push(1, {f"t{i}": np.zeros(300, np.float32) for i in range(4)}), "too_large"),
    "one frame over the limit": (_push(1, {"w": np.zeros(LIMIT // 4 + 10, np.float32)}), "too_large"),
}


def _ask(raw: zmq.Socket, frames: list) -> dict:
    raw.send_multipart(frames)
    assert raw.poll(10_000), "the PS did not answer"
    reply = decode(raw.recv_multipart())
    assert reply.type == "error", reply
    return reply.fields


def _central(good: PSClient) -> tuple[int, dict[str, bytes]]:
    reply = good.pull()
    return reply.version, {k: v.tobytes() for k, v in reply.tensors.items()}


@pytest.mark.faults
def test_each_bad_input_gets_its_code_one_count_and_leaves_the_model_alone(ps, fault_report):
    good, raw = ps
    before_model = _central(good)
    for name, (frames, code) in CASES.items():
        before = good.stats()["refused"]
        fields = _ask(raw, frames)
        assert fields["code"] == code, (name, fields)
        assert fields["message"], name
        after = good.stats()["refused"]
        expected = dict(before)
        expected[code] = expected.get(code, 0) + 1
        assert after == expected, (name, before, after)
        assert _central(good) == before_model, f"{name}: the central model changed"
    assert sum(good.stats()["refused"].values()) == len(CASES)
    fault_report(fault="malformed messages, one of each kind (frames, types, version, tensors, sizes, NaN/Inf, "
                       "sparse indices)", injected=len(CASES), handled=sum(good.stats()["refused"].values()),
                 pushes_lost=0, recovery_s=None, detail="each refused with its own code and one count; model untouched")


@pytest.mark.faults
def test_a_replayed_push_is_refused_counted_and_applied_once(ps, fault_report):
    good, raw = ps
    push = _push(5, OK)
    raw.send_multipart(push)
    assert raw.poll(10_000)
    assert decode(raw.recv_multipart()).fields["status"] == "applied"
    applied = _central(good)
    assert applied[0] == 1
    for replay in (push, _push(4, OK), _push(5, {"w": np.full((2, 3), 9, np.float32)})):  # same seq, lower seq
        before = good.stats()["refused"].get("duplicate", 0)
        assert _ask(raw, replay)["code"] == "duplicate"
        assert good.stats()["refused"]["duplicate"] == before + 1
        assert _central(good) == applied
    raw.send_multipart(_push(6, OK))  # the next sequence number is applied
    assert raw.poll(10_000) and decode(raw.recv_multipart()).fields["status"] == "applied"
    assert good.pull().version == 2
    fault_report(fault="replayed and duplicated pushes (same or lower sequence number)", injected=3, handled=3,
                 pushes_lost=0, recovery_s=None, detail="refused as duplicate; each push applied exactly once")


def test_the_client_refuses_a_request_over_the_ps_limit_with_a_clear_error(ps):
    good, _ = ps
    assert good.max_message_bytes == LIMIT  # learnt from the hello reply
    sent = good.counters.bytes_up
    with pytest.raises(PSError, match=rf"accepts at most {LIMIT}.*max-message-bytes") as err:
        good.push(0, {"w": np.zeros(LIMIT, np.float32)})
    assert err.value.code == "too_large"
    assert good.counters.bytes_up == sent  # nothing was sent
    assert good.pull().version == 0


def test_a_frame_beyond_the_hard_cap_drops_only_that_connection(ps):
    """libzmq cuts a connection whose frame exceeds MAXMSGSIZE (2x the limit) and delivers nothing.

    That is not counted as a refusal (libzmq reports a plain disconnect); the PS goes on serving.
    """
    good, raw = ps
    before = good.stats()["refused"]
    raw.send_multipart([b"\x00" * (2 * LIMIT + 1)])
    assert not raw.poll(1000), "a frame beyond the hard cap was answered"
    assert good.stats()["refused"] == before
    assert _central(good)[1] == {k: v.tobytes() for k, v in W0.items()}
