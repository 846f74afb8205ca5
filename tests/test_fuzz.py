"""Thousands of generated bad messages over a real DEALER socket to a live PS process.

Hypothesis builds each example's messages from four families: random frames, a valid header
whose type is real but whose required fields are mutated (missing, mistyped, out of range), a
valid push whose tensors are corrupted (frames cut, extended, dropped or added; NaN/Inf written
into a coordinate; dtype, shape, name, encoding or codec changed; sparse indices that lie), and
random message types. Every message is built to be bad, so the oracle is exact: each gets exactly
one ``error`` reply, the PS's refusal counters add up to the number of messages sent, no push is
applied, and afterwards a normal worker's pull returns the central tensors it was initialised
with, byte for byte. (``pull``, ``stats`` and ``init`` take no fields a mutation could break, so
they only appear with a wrong protocol version.)
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plug_asgd.compressors import QSGD
from plug_asgd.protocol.wire import PROTOCOL_VERSION, Sparse, decode, encode
from tests.conftest import serving_pair

pytestmark = pytest.mark.timeout(120)

W0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([0.5, -1.0], np.float32),
      "big": np.linspace(-1, 1, 70_000, dtype=np.float32)}  # two sparse blocks
PER_EXAMPLE = 8
EXAMPLES = 400  # 3200 messages
REAL_TYPES = ("hello", "push", "pull", "init", "bye", "gather", "stats")
REQUIRED = {"hello": ("rank", "world_size", "stage", "session", "mode"),
            "push": ("rank", "base_version", "seq", "session"),
            "gather": ("rank", "stage", "seq"), "bye": ("rank", "stage")}
# the raw socket holds rank 1 of 2 in session "fuzz" (tests.conftest.serving_pair)
VALID = {"hello": {"rank": 1, "world_size": 2, "stage": 1, "session": "fuzz", "mode": "asgd", "training": True},
         "push": {"rank": 1, "base_version": 0, "seq": 1, "session": "fuzz"},
         "gather": {"rank": 1, "stage": 1, "seq": 0, "kind": "barrier:"},
         "bye": {"rank": 1, "stage": 1}}

ints = st.integers(-(1 << 63), (1 << 64) - 1)  # what msgpack can carry
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)


@st.composite
def random_frames(draw) -> list[bytes]:
    """Frames of random bytes (the first is the 'header')."""
    return draw(st.lists(st.binary(max_size=256), min_size=1, max_size=5))


@st.composite
def mutated_fields(draw) -> list[bytes]:
    """A real type whose fields are valid but one required field is removed, mistyped or out of range."""
    msg_type = draw(st.sampled_from(sorted(REQUIRED)))
    fields = dict(VALID[msg_type])
    fields.update(draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in fields), values,
                                       max_size=3)))
    victim = draw(st.sampled_from(REQUIRED[msg_type]))
    how = draw(st.sampled_from(["drop", "retype", "negative"] + (["future"] if victim == "base_version" else [])
                               + (["other_mode"] if victim == "mode" else [])))
    if how == "drop":
        del fields[victim]
    elif how == "retype":
        want_str = victim in ("session", "mode")
        fields[victim] = draw(values.filter(
            lambda v: (not isinstance(v, str)) if want_str else (not isinstance(v, int) or isinstance(v, bool))))
    elif how == "negative":
        if victim in ("session", "mode"):
            fields[victim] = draw(st.one_of(ints, st.none()))
        else:
            fields[victim] = draw(st.integers(-(1 << 63), -1))
    elif how == "future":
        fields[victim] = draw(st.integers(1, (1 << 63) - 1))
    else:
        fields[victim] = draw(st.text(max_size=10).filter(lambda m: m != "asgd"))
    tensors = {"w": np.ones((2, 3), np.float32)} if msg_type == "push" else None
    return encode(msg_type, {"rid": 1, **fields}, tensors)


def _float_bits(draw, dtype: str) -> bytes:
    """The bytes of a NaN or an Inf of ``dtype`` (any NaN payload, either sign)."""
    if dtype == "float32":
        exp, mant_bits, width = 0xFF, 23, 32
    else:
        exp, mant_bits, width = 0x7FF, 52, 64
    mantissa = draw(st.integers(0, (1 << mant_bits) - 1))
    sign = draw(st.integers(0, 1))
    bits = (sign << (width - 1)) | (exp << mant_bits) | mantissa
    return bits.to_bytes(width // 8, "little")


@st.composite
def corrupted_push(draw) -> list:
    """A valid push (dense, sparse or QSGD-packed tensors) with one corruption that must be refused."""
    kind = draw(st.sampled_from(["dense", "sparse", "packed"]))
    if kind == "dense":
        name = draw(st.sampled_from(["w", "b"]))
        dtype = draw(st.sampled_from(["float32", "float64"]))
        tensors = {name: np.zeros(W0[name].shape, dtype)}
    elif kind == "sparse":
        name = "big"
        nnz = draw(st.integers(1, 20))
        idx = np.array(sorted(draw(st.sets(st.integers(0, 69_999), min_size=nnz, max_size=nnz))))
        tensors = {name: Sparse(idx, np.ones(nnz, np.float32), (70_000,))}
    else:
        name = "w"
        tensors = {name: QSGD(bits=4, seed=1).encode("w", np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))}
    frames = [bytes(f) for f in encode("push", {"rid": 1, **VALID["push"]}, tensors)]
    header = msgpack.unpackb(frames[0])
    spec = header["tensors"][0]
    choices = ["cut", "extend", "drop_frame", "add_frame", "rename", "shape", "dtype", "encoding"]
    if kind == "dense":
        choices.append("not_finite")
    elif kind == "sparse":
        choices += ["not_finite", "index_out_of_range", "not_ascending", "counts"]
    else:
        choices += ["codec", "arrays"]
    how = draw(st.sampled_from(choices))
    last = len(frames) - 1
    if how == "cut":
        i = draw(st.integers(1, last))
        if len(frames[i]) == 0:
            how = "add_frame"
        else:
            frames[i] = frames[i][:draw(st.integers(0, len(frames[i]) - 1))]
    if how == "extend":
        i = draw(st.integers(1, last))
        frames[i] += draw(st.binary(min_size=1, max_size=64))
    elif how == "drop_frame":
        del frames[draw(st.integers(1, last))]
    elif how == "add_frame":
        frames.insert(draw(st.integers(1, len(frames))), draw(st.binary(max_size=64)))
    elif how == "rename":
        spec["name"] = draw(st.text(max_size=10).filter(lambda n: n not in W0))
    elif how == "shape":
        spec["shape"] = draw(st.lists(st.integers(0, 9), max_size=4).filter(lambda s: s != spec["shape"]))
    elif how == "dtype":
        bad = ["int8", "int32", "int64", "uint8", "uint16", "bool", "object", "complex64", "float128", "<f4"]
        if kind == "packed":
            spec["arrays"][0]["dtype"] = draw(st.sampled_from(bad[6:]))
        else:
            spec["dtype"] = draw(st.sampled_from(bad))
    elif how == "encoding":
        spec["enc"] = draw(st.sampled_from(["pickle", "raw", "", "Dense", None]))
    elif how == "not_finite":
        i = last  # the values frame (the only one of a dense tensor)
        itemsize = 4 if kind == "sparse" or spec["dtype"] == "float32" else 8
        at = draw(st.integers(0, len(frames[i]) // itemsize - 1)) * itemsize
        bits = _float_bits(draw, "float32" if itemsize == 4 else "float64")
        frames[i] = frames[i][:at] + bits + frames[i][at + itemsize:]
    elif how == "index_out_of_range":  # the last block's last offset pushed past numel (70000 = 65536 + 4464)
        counts = np.frombuffer(frames[1], "<u4").copy()
        offsets = np.frombuffer(frames[2], "<u2").copy()
        counts[:] = 0
        counts[1] = len(offsets)
        offsets[:] = np.arange(len(offsets)) + draw(st.integers(70_000 - 65_536 - len(offsets) + 1, 65_535
                                                                 - len(offsets) + 1))
        frames[1], frames[2] = counts.tobytes(), offsets.tobytes()
    elif how == "not_ascending":
        offsets = np.frombuffer(frames[2], "<u2").copy()
        counts = np.frombuffer(frames[1], "<u4").copy()
        if len(offsets) < 2:
            offsets = np.array([7, 7], "<u2")
            counts[:] = 0
            counts[0] = 2
            spec["nnz"] = 2
            frames[3] = np.ones(2, "<f4").tobytes()
        else:
            counts[:] = 0
            counts[0] = len(offsets)
            offsets = offsets[::-1].copy() if len(set(offsets.tolist())) > 1 else offsets
            offsets[0] = offsets[1]  # at least one repeat or descent
        frames[1], frames[2] = counts.tobytes(), offsets.tobytes()
    elif how == "counts":
        counts = np.frombuffer(frames[1], "<u4").copy()
        counts[draw(st.integers(0, len(counts) - 1))] += draw(st.integers(1, 1000))
        frames[1] = counts.tobytes()
    elif how == "codec":
        spec["codec"] = draw(st.sampled_from(["nope", "", "pickle", "q$gd", "x" * 40]))
    elif how == "arrays":
        spec["arrays"] = spec["arrays"][:-1]
        frames = frames[:-1]
    frames[0] = msgpack.packb(header)
    return frames


@st.composite
def random_type(draw) -> list:
    """A well-formed message of a type the PS does not have (or any type, at a wrong protocol version)."""
    if draw(st.booleans()):
        msg_type = draw(st.one_of(st.text(max_size=20), st.sampled_from(
            ["_on_push", "__class__", "serve_forever", "save_checkpoint", "request_stop", "PUSH", "push "])))
        msg_type = msg_type if msg_type not in REAL_TYPES else msg_type + "!"
        return encode(msg_type, {"rid": 1})
    header = {"v": draw(st.one_of(ints, st.none(), st.text(max_size=3)).filter(
        lambda v: v != PROTOCOL_VERSION or isinstance(v, bool))),
        "type": draw(st.sampled_from(REAL_TYPES)), "fields": {"rid": 1}, "tensors": []}
    return [msgpack.packb(header)]


messages = st.one_of(random_frames(), mutated_fields(), corrupted_push(), random_type())


@pytest.mark.faults
def test_thousands_of_bad_messages_leave_the_ps_serving_and_its_model_untouched(start_ps, fault_report):
    good, raw = serving_pair(start_ps("asgd"), W0, session="fuzz")
    sent = [0]
    codes: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(messages, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    def throw(batch: list[list]) -> None:
        for frames in batch:
            raw.send_multipart(frames)
        for frames in batch:
            assert raw.poll(10_000), "the PS stopped answering"
            reply = decode(raw.recv_multipart())
            assert reply.type == "error", (reply.type, reply.fields, frames)
            codes[reply.fields["code"]] = codes.get(reply.fields["code"], 0) + 1
        sent[0] += len(batch)

    try:
        throw()
        stats = good.stats()
        print(f"{sent[0]} messages, refused by code: {dict(sorted(codes.items()))}")
        assert sent[0] >= 3000
        assert stats["refused"] == codes  # every refusal counted under the code its reply carried
        assert sum(stats["refused"].values()) == sent[0]
        assert stats["pushes_applied"] == 0 and stats["version"] == 0
        reply = good.pull()
        assert reply.version == 0
        assert {k: v.tobytes() for k, v in reply.tensors.items()} == {k: v.tobytes() for k, v in W0.items()}
        # a normal push after the storm is folded in as usual
        assert good.push(0, {"b": np.ones(2, np.float32)}).version == 1
        assert len(codes) >= 10, codes  # the families reach many different checks
        fault_report(fault="fuzzed messages (hypothesis) from a raw socket", injected=sent[0],
                     handled=sum(stats["refused"].values()), pushes_lost=0, recovery_s=None,
                     detail=f"each refused with an error reply under {len(codes)} codes; model byte-identical")
    finally:
        raw.close(0)
        good.close()
