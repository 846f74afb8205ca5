"""Coded replies (``--downlink-codec``, plug_asgd/ps/downlink.py, plug_asgd/compressors/reply_codecs.py): a reply to a
push carries every difference between the central model and the copy the PS keeps of its worker's, cast to float16
or in levels of 8 or 4 bits, whose decoding the worker adds to its copy as the PS adds it to its own.

The worker's copy must equal the PS's bit for bit after every reply; a reply's tensors must be the differences coded
by hand; what the coding rounds off must stay in the next difference (no drift over many replies), a reply must cost
a half (a quarter, an eighth) of float32's bytes, and a pull must make the copy exact again. On a real PS process in
async_diloco, the replies, those ahead included, against the hand computation of tests/test_diloco_lookahead.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from plug_asgd.compressors.reply_codecs import decode_difference, encode_difference
from plug_asgd.protocol.wire import Packed, decode, encode, message_bytes
from plug_asgd.ps import PSConfig
from plug_asgd.ps.downlink import Downlink
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.reference_store import ReferenceStore
from plug_asgd.ps.store_records import PushIn
from plug_asgd.worker.client import HeldModel, PSClient, PSError
from plug_asgd.worker.errors import REPLY_KINDS
from tests.test_diloco_lookahead import W0, U, expected

F16, F32 = np.float16, np.float32
SHAPES = {"w": (300, 400), "b": (400,)}


def answer(store, held: HeldModel, rank: int, push: bool) -> tuple[dict[str, np.ndarray], int, dict, dict]:
    """A reply to rank ``rank`` as the serving loop makes it, taken as the client takes it; also the tensors sent."""
    frames = store.reply_payload({"status": "applied", "version": store.version}, held.have if held.exact else None,
                                 rank=rank, held=None if held.exact else held.have, push=push)
    msg = decode([bytes(memoryview(f)) for f in frames])
    sent = dict(msg.tensors)
    if msg.fields.get("delta"):
        model = held.patch(dict(sent), store.version, exact=not msg.fields.get("approx"),
                           add=msg.fields.get("add") is True)
        return model, message_bytes(frames), msg.fields, sent
    held.keep(msg.fields["model_id"], store.version, dict(sent))
    return dict(sent), message_bytes(frames), msg.fields, sent


def by_hand(codec: str, diff: np.ndarray, sent) -> tuple[np.ndarray, float]:
    """What ``sent`` must decode to, from ``diff`` by hand (checking what was sent on the way), and the most a
    coordinate may be off after it."""
    if codec == "fp16":
        cast = diff.astype(F16)
        assert sent.dtype == F16 and sent.tobytes() == cast.tobytes()
        return cast.astype(F32), np.spacing(np.abs(cast)).astype(F32) / 2
    bits = {"int8": 8, "int4": 4}[codec]
    top = 2 ** (bits - 1) - 1
    scale = F32(np.abs(diff).max()) / F32(top)
    codes = np.clip(np.rint(diff / scale), -top, top).astype(np.int8).reshape(-1)
    assert isinstance(sent, Packed) and sent.codec == "qdiff" and sent.meta == {"bits": bits, "scale": float(scale)}
    if bits == 8:
        assert sent.arrays[0].dtype == np.int8 and sent.arrays[0].tobytes() == codes.tobytes()
    else:  # two codes a byte, + 8, the first in the low half
        nibbles = np.append(codes + 8, [8] * (codes.size % 2)).astype(np.uint8)
        assert sent.arrays[0].tobytes() == (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()
    return (codes.astype(F32) * scale).reshape(diff.shape), scale / 2


@pytest.mark.quick
@pytest.mark.parametrize("store_cls", [ReferenceStore, FastStore])
@pytest.mark.parametrize(("codec", "share"), [("fp16", 0.51), ("int8", 0.26), ("int4", 0.135)])
def test_replies_carry_the_coded_differences_the_copies_stay_equal_and_nothing_drifts(store_cls, codec, share):
    rng = np.random.default_rng(3)
    store = store_cls(PSConfig(mode="asgd", downlink_codec=codec))
    store.init({n: rng.standard_normal(s).astype(F32) for n, s in SHAPES.items()})
    held, worst = HeldModel(), 0.0
    _, whole, _, _ = answer(store, held, 0, push=False)  # the first pull: exact, whole, and the PS keeps its copy
    for i in range(40):
        update = {n: (0.01 * rng.standard_normal(s)).astype(F32) for n, s in SHAPES.items()}
        before = {n: t.copy() for n, t in held.tensors.items()}
        msg = decode([zmq.Frame(bytes(memoryview(f))) for f in encode("push", {}, update)])
        store.fold(PushIn(token=0, rank=0, session="s0", seq=i + 1, base_version=i, frames=msg.frames,
                          tensors=dict(msg.tensors)))
        central = {n: t.copy() for n, t in store.state.tensors.items()}
        model, nbytes, fields, sent = answer(store, held, 0, push=True)
        assert fields["approx"] and fields["delta"] and fields["add"] and not held.exact
        for name in SHAPES:
            added, off = by_hand(codec, central[name] - before[name], sent[name])
            assert model[name].tobytes() == (before[name] + added).tobytes()
            assert store.downlink.copies[0].tensors[name].tobytes() == model[name].tobytes()  # the PS's copy
            # what the coding rounded off of this difference, and nothing older
            assert (np.abs(central[name] - model[name]) <= off + np.spacing(np.abs(central[name]))).all()
            worst = max(worst, float(np.max(off + np.spacing(np.abs(central[name])))))
        assert nbytes < share * whole  # 2 bytes a coordinate against 4 (1, a half)
    model, _, fields, _ = answer(store, held, 0, push=False)  # before evaluating: a pull, exact
    assert held.exact and not fields.get("approx")
    for name, central in store.state.tensors.items():
        assert model[name].tobytes() == central.tobytes()
    assert store.stats.approx_replies == 40 and 0 < store.downlink.gap_max <= worst


@pytest.mark.quick
def test_a_difference_beyond_fp16s_range_goes_in_the_copys_type_and_the_copies_stay_equal():
    link = Downlink(codec="fp16")
    copy = {"w": np.array([0.0, 1.0, 2.0], F32), "b": np.zeros(2, F32)}
    link.holds(0, "m", 0, copy)
    central = {"w": np.array([1e5, 1.0, 2.5], F32), "b": np.zeros(2, F32)}
    out = link.reply(0, ("m", 0), "m", 1, central)
    assert set(out) == {"w"}  # b did not change: left out
    assert out["w"].dtype == F32 and out["w"].tobytes() == (central["w"] - copy["w"]).tobytes()
    held = HeldModel()
    held.keep("m", 0, copy)
    model = held.patch(out, 1, exact=False, add=True)
    assert model["w"].tobytes() == link.copies[0].tensors["w"].tobytes() == central["w"].tobytes()
    assert link.reply(0, ("m", 0), "m", 2, central) is None  # a copy the PS no longer knows: the whole model


@pytest.mark.quick
def test_a_coded_difference_the_client_cannot_read_is_refused_and_nothing_of_the_reply_is_kept():
    good = encode_difference("int4", np.array([0.6, -1.0, 0.2], F32))  # 3 codes: the last byte's high half padded
    scale = F32(1.0) / F32(7)
    assert good.arrays[0].tobytes() == bytes([(4 + 8) | ((-7 + 8) << 4), (1 + 8) | (8 << 4)])  # 8: a code of 0
    assert decode_difference(good, F32).tobytes() == (np.array([4, -7, 1], F32) * scale).tobytes()
    held = HeldModel()
    held.keep("m", 0, {"w": np.zeros(3, F32), "b": np.zeros(2, F32)})
    bad = Packed("qdiff", (2,), {"bits": 4, "scale": 0.5}, (np.zeros(2, np.uint8),))  # 2 bytes for 2 codes
    with pytest.raises(PSError) as exc:
        held.patch({"w": good, "b": bad}, 1, exact=False, add=True)
    assert exc.value.code == "bad_reply" and "cannot read" in str(exc.value)
    assert held.have is None and held.tensors == {}  # w's difference was not added either
    held.keep("m", 0, {"w": np.zeros(3, F32)})
    with pytest.raises(PSError):  # a coded tensor to set, not to add
        held.patch({"w": good}, 1)


@pytest.mark.quick
def test_the_options_refuse_an_unknown_codec_and_a_fraction_beside_a_codec():
    from plug_asgd import AsyncPSStrategy
    from plug_asgd.recipes.common import make_strategy
    from plug_asgd.recipes.mnist import build_parser

    with pytest.raises(ValueError, match=r"downlink_codec must be one of \['fp16', 'int8', 'int4'\], got 'bf16'"):
        PSConfig(mode="diloco", downlink_codec="bf16")
    with pytest.raises(ValueError, match="give one"):
        PSConfig(mode="diloco", downlink_codec="fp16", downlink_fraction=0.1)
    with pytest.raises(ValueError, match="give one"):
        AsyncPSStrategy(mode="diloco", downlink_codec="fp16", downlink_fraction=0.1)
    with pytest.raises(ValueError, match="a fraction or a codec"):
        Downlink()
    strategy = make_strategy(build_parser().parse_args(["--mode", "diloco", "--downlink-codec", "fp16"]))
    assert strategy.connection.settings.downlink["downlink_codec"] == "fp16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--downlink-codec", "bf16"])


def test_a_real_ps_answers_async_dilocos_pushes_ahead_and_not_in_fp16_differences_and_pulls_exactly(start_ps):
    """Two workers on an async_diloco PS process with ``--downlink-codec fp16``, the arrivals of
    tests/test_diloco_lookahead.py (rank 0 opening each cycle and asking ahead): each reply is the worker's copy
    plus the difference from it cast to fp16, by hand from the models ``expected()`` computes; the first reply to
    rank 0 is the model ahead whole, which its client keeps as the PS's copy of it; the pulls at the end are the
    central model, bit for bit."""
    address = start_ps("async_diloco", downlink_codec="fp16")
    clients = [PSClient(address, rank=r, world_size=2, mode="async_diloco", request_timeout=30, heartbeat_s=None)
               for r in (0, 1)]
    hand = expected()

    def added(copy: np.ndarray, target: np.ndarray) -> bytes:
        return (copy + (target - copy).astype(F16).astype(F32)).tobytes()

    try:
        for c in clients:
            c.hello(stage=1, training=True, timeout=30)
        assert clients[0].init({"w": W0.copy()})
        first = clients[0].push(0, {"w": U[0].copy()}, ahead=True)  # no copy of rank 0's yet: whole
        assert first.ahead and first.approx and first.tensors["w"].tobytes() == hand[0][1].tobytes()
        assert clients[0].held.model_id is not None and not clients[0].held.exact  # kept: the PS's copy of it
        assert clients[1].pull().tensors["w"].tobytes() == hand[0][0].tobytes()
        second = clients[1].push(0, {"w": U[1].copy()}, ahead=True)  # closes the cycle: the central model
        assert not second.ahead and second.approx and second.tensors["w"].tobytes() == added(hand[0][0], hand[1][0])
        third = clients[0].push(1, {"w": U[2].copy()}, ahead=True)  # opens one: the model ahead, from its copy
        assert third.ahead and third.approx and third.tensors["w"].tobytes() == added(hand[0][1], hand[2][1])
        fourth = clients[1].push(2, {"w": U[3].copy()})
        assert fourth.tensors["w"].tobytes() == added(second.tensors["w"], hand[3][0])
        assert not np.array_equal(fourth.tensors["w"], hand[3][0])  # fp16's rounding: near, not equal
        for c in clients:
            pulled = c.pull()
            assert not pulled.approx and c.held.exact and pulled.tensors["w"].tobytes() == hand[3][0].tobytes()
        assert clients[0].counters.replies == {**dict.fromkeys(REPLY_KINDS, 0), "approx": 2, "pulled_delta": 1}
        stats = clients[0].stats()
        assert stats["approx_replies"] == 4 and stats["ahead_replies"] == 2 and stats["version"] == 4
    finally:
        for c in clients:
            c.close()


def test_a_push_that_wants_its_own_tensors_gets_their_differences_and_the_rest_of_the_copy_stays(start_ps):
    """Streaming's fragments and ``overlap=True`` (``want_model="pushed"``) on a PS process with ``--downlink-codec
    fp16``: a model of two tensors, pushes of ``w`` only. Rank 0, whose copy the PS keeps since its pull, gets ``w``
    alone, its copy's ``w`` plus the difference in fp16 (the model ahead where it opens a cycle), and its ``v`` stays
    as it was; rank 1, of which the PS keeps no copy, gets ``w`` whole. A pull is then exact."""
    address = start_ps("async_diloco", downlink_codec="fp16")
    clients = [PSClient(address, rank=r, world_size=2, mode="async_diloco", request_timeout=30, heartbeat_s=None)
               for r in (0, 1)]
    hand, v0 = expected(), np.arange(4, dtype=F32)

    def added(copy: np.ndarray, target: np.ndarray) -> bytes:
        return (copy + (target - copy).astype(F16).astype(F32)).tobytes()

    try:
        for c in clients:
            c.hello(stage=1, training=True, timeout=30)
        assert clients[0].init({"w": W0.copy(), "v": v0})
        clients[0].pull()  # the PS keeps rank 0's copy from here
        first = clients[0].push(0, {"w": U[0].copy()}, want_model="pushed", ahead=True)
        assert first.part and first.ahead and first.approx and list(first.tensors) == ["w"]
        assert first.tensors["w"].tobytes() == added(W0, hand[0][1])
        assert clients[0].held.tensors["v"].tobytes() == v0.tobytes() and not clients[0].held.exact
        second = clients[1].push(0, {"w": U[1].copy()}, want_model="pushed", ahead=True)
        assert second.part and not second.approx and second.tensors["w"].tobytes() == hand[1][0].tobytes()
        third = clients[0].push(1, {"w": U[2].copy()}, want_model="pushed", ahead=True)
        assert list(third.tensors) == ["w"] and third.tensors["w"].tobytes() == added(first.tensors["w"], hand[2][1])
        pulled = clients[0].pull()
        assert pulled.tensors["w"].tobytes() == hand[2][0].tobytes() and pulled.tensors["v"].tobytes() == v0.tobytes()
        assert clients[0].held.exact
    finally:
        for c in clients:
            c.close()
