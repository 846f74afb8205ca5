"""A worker given a reply that is not the protocol's, over a real socket: the error says what came; a bye is a courtesy.

A ROUTER on loopback plays the PS: it answers each request with the frames the test gives (the request's own id
put in where the test asks), so the worker's transport reads exactly those bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgpack
import pytest
import zmq

from plug_asgd.compressors import NoCompression
from plug_asgd.modes import MODES
from plug_asgd.placement.connection import PSConnection
from plug_asgd.placement.settings import PSSettings
from plug_asgd.protocol.wire import WireError, encode
from plug_asgd.worker.client import PSClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

Answer = Callable[[str, int], list[bytes]]  # (the request's type, its rid) -> the reply's frames


class FakePS:
    """Answers every request with ``answer(type, rid)``'s frames until closed; runs in a thread of its own."""

    def __init__(self, answer: Answer) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.answer, self.seen = answer, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, header, *_ = self.sock.recv_multipart()
            request = msgpack.unpackb(header)
            self.seen.append(request["type"])
            self.sock.send_multipart([identity, *self.answer(request["type"], request["fields"]["rid"])])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


@pytest.fixture
def fake_ps():
    servers: list[FakePS] = []

    def start(answer: Answer) -> FakePS:
        servers.append(FakePS(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _client(address: str) -> PSClient:
    return PSClient(address, rank=1, world_size=2, mode="asgd", request_timeout=5.0, heartbeat_s=None)


def test_a_reply_that_is_not_msgpack_is_refused_with_its_frames_described(fake_ps):
    # a float32 payload where the header belongs: 0x00 0x00 0x80 0x3f (1.0) unpacks as 0, then "extra data"
    ps = fake_ps(lambda kind, rid: [b"\x00\x00\x80\x3f" * 3, b"\x01" * 40])
    client = _client(ps.address)
    try:
        with pytest.raises(WireError) as err:
            client.stats()
    finally:
        client.close()
    assert err.value.code == "bad_header"
    text = str(err.value)
    assert f"a reply from the parameter server at {ps.address} to 'stats'" in text
    assert "2 frames of 12, 40 bytes, the first opening 00 00 80 3f 00 00 80 3f 00 00 80 3f" in text
    assert ps.seen == ["stats"]


def test_a_bye_answered_with_garbage_is_a_warning_and_the_counters_are_kept(fake_ps, caplog):
    stats = {"version": 7, "pushes_applied": 3}

    def answer(kind: str, rid: int) -> list[bytes]:
        if kind == "stats":
            return encode("stats", {"rid": rid, "stats": stats})
        return [b"\x93\x01\x02\x03\x04"]  # a whole msgpack array, then a byte more

    ps = fake_ps(answer)
    connection = PSConnection(MODES["asgd"](), NoCompression(), PSSettings(ps_address=ps.address))
    connection.client = _client(ps.address)
    try:
        with caplog.at_level(logging.WARNING, logger="plug_asgd.strategy"):
            connection.goodbye(1, failed=False, settle=lambda: None)
    finally:
        connection.client.close()
    assert ps.seen == ["stats", "bye"]
    assert connection.stats_at_exit == stats
    assert "could not say goodbye to the parameter server" in caplog.text
    assert "1 frames of 5 bytes, the first opening 93 01 02 03 04" in caplog.text
