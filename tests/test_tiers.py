"""The quick tier's guard (tests/conftest.py): a quick test may not start a process or open a network socket."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import zmq


def test_a_quick_test_that_opens_a_network_socket_or_starts_a_process_is_told_to_mark_itself():
    sock = zmq.Context.instance().socket(zmq.PAIR)
    try:
        for address in ("tcp://127.0.0.1:0", "ipc:///tmp/plug-asgd-tier-test"):
            with pytest.raises(RuntimeError, match="mark it @pytest.mark.integration"):
                sock.bind(address)
            with pytest.raises(RuntimeError, match="mark it @pytest.mark.integration"):
                sock.connect(address)
    finally:
        sock.close(0)
    with pytest.raises(RuntimeError, match="mark it"), socket.socket() as s:
        s.bind(("127.0.0.1", 0))
    with pytest.raises(RuntimeError, match="mark it"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_zeromqs_in_process_transport_is_memory_and_allowed():
    ctx = zmq.Context.instance()
    server, client = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        server.bind("inproc://plug-asgd-tier-test")
        client.connect("inproc://plug-asgd-tier-test")
        client.send(b"ping")
        assert server.recv() == b"ping"
    finally:
        client.close(0)
        server.close(0)
