"""plug_asgd.protocol.monitor: a socket's event monitor that cannot freeze its ZeroMQ context.

A DEALER whose connection keeps dropping (a TCP server that accepts and closes at once; reconnecting every
millisecond, 3,000 times or until the drops stop) while nothing reads its monitor: with pyzmq's
``get_monitor_socket``, libzmq's I/O thread blocks on the full events' pipe and no socket of the context carries a
message any more; with ``monitor_socket`` the pipe takes every event and the context goes on. Each case runs in a
process of its own (a frozen context cannot be ended): it prints whether a round trip through the same context still
works, and how many events were queued.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = r"""
import json, os, socket, sys, threading, time
import zmq
from plug_asgd.protocol.monitor import monitor_socket

server = socket.create_server(("127.0.0.1", 0), backlog=128)
accepted = [0]
def drop_every_connection():
    while True:
        connection, _ = server.accept()
        connection.close()
        accepted[0] += 1
threading.Thread(target=drop_every_connection, daemon=True).start()

ctx = zmq.Context()
dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 0)
dealer.setsockopt(zmq.RECONNECT_IVL, 1)
events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
monitor = monitor_socket(dealer, events) if sys.argv[1] == "ours" else dealer.get_monitor_socket(events)
dealer.connect(f"tcp://127.0.0.1:{server.getsockname()[1]}")
deadline, seen, still_since = time.monotonic() + 40, 0, time.monotonic()
while accepted[0] < 3000 and time.monotonic() < deadline and time.monotonic() - still_since < 2:
    time.sleep(0.05)  # until past the 2,000 events a pipe with high-water marks holds, or the drops stop
    if accepted[0] != seen:
        seen, still_since = accepted[0], time.monotonic()

router, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
for s in (router, client):
    s.setsockopt(zmq.LINGER, 0)
client.connect(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
client.send(b"ping")
carried = bool(router.poll(5000))
queued = 0
while monitor.poll(0):
    monitor.recv_multipart()
    queued += 1
print(json.dumps({"carried": carried, "queued": queued, "accepted": accepted[0]}), flush=True)
os._exit(0)  # a frozen context would hang the interpreter's exit
"""


def flap(monitor: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, monitor], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_monitor_nobody_reads_takes_every_event_and_the_context_still_carries_messages():
    ours = flap("ours")
    assert ours["carried"] and ours["accepted"] >= 3000, ours
    assert ours["queued"] >= 3000, ours  # an event at least each drop: more than a pipe with marks would hold


def test_pyzmqs_own_monitor_freezes_the_context_in_the_same_case():
    """Why the module exists: the case above with pyzmq's monitor (the pipe's marks at 1,000 + 1,000)."""
    theirs = flap("pyzmq")
    assert not theirs["carried"] and theirs["queued"] <= 2_100, theirs
