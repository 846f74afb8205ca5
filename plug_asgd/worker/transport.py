"""The transport under :class:`~plug_asgd.worker.client.PSClient`: one request at a time, timeouts, reconnection.

A DEALER socket sends one request at a time and waits for the reply that carries the same
request id (a late reply to an abandoned request is discarded). Every frame sent and received
is counted, so the byte figures that the callbacks and benchmarks report are what crossed the
wire, not estimates.

ZeroMQ reconnects by itself when the PS comes back (restarted from its checkpoint, say), but
a request in flight when the PS died is lost. The transport watches its socket's connection
events: after a reconnection it says hello again (the new PS does not know it yet) and sends
the request it is waiting on once more.

Once the worker has said hello, a heartbeat goes every ``heartbeat_s`` seconds from a thread
with a socket of its own, so the PS can tell a worker busy with a long step (heartbeats go on)
from one that died, froze or was cut off (they stop): see the PS's ``worker_timeout``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from plug_asgd.protocol.monitor import monitor_socket, stop_on_drop
from plug_asgd.protocol.security import KEYGEN_HINT, load_worker_keys
from plug_asgd.protocol.wire import (
    DEFAULT_LIMITS,
    Limits,
    Message,
    Tensor,
    WireError,
    decode,
    encode,
    frame_summary,
    message_bytes,
)
from plug_asgd.worker.errors import CommCounters, PSError, PSUnreachableError
from plug_asgd.worker.leader_watch import LeaderWatch

__all__ = ["CommCounters", "PSError", "PSUnreachableError", "Transport"]

DEFAULT_HEARTBEAT_S = 2.0
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Transport(LeaderWatch):
    """Requests to one parameter server, with timeouts that end in a clear error, never a hang.

    Args:
        address: the PS's ZeroMQ address (``tcp://host:port``), or its members' separated by ``|`` (the primary's
            first, then its standby's): a worker that hears nothing from the first asks the next to lead, and
            moves to one that leads (:mod:`plug_asgd.worker.leader_watch`).
        rank: this worker's rank, which its heartbeats carry.
        request_timeout: seconds a request may wait for its reply before :class:`PSUnreachableError`.
        lost_timeout: seconds a dropped connection may stay away before a waiting request gives up.
        heartbeat_s: seconds between heartbeats once the worker has said hello; None: no heartbeats.
        limits: the largest messages accepted from the PS.
        context: the ZeroMQ context to make sockets in (None: the process's shared one).
        keys: the worker's CURVE keys (``DIR/worker`` or ``DIR`` of ``plug-asgd keygen``), for a keyed PS;
            None: no encryption.

    Raises:
        ValueError: where ``heartbeat_s`` is not None and not within (0, 3600) seconds.
    """

    def __init__(self, address: str, *, rank: int, request_timeout: float = 600.0, lost_timeout: float = 60.0,
                 heartbeat_s: float | None = DEFAULT_HEARTBEAT_S, limits: Limits = DEFAULT_LIMITS,
                 context: zmq.Context | None = None, keys: str | os.PathLike[str] | None = None) -> None:
        if heartbeat_s is not None and not 0 < heartbeat_s < 3600:
            raise ValueError(f"heartbeat_s must be in (0, 3600) seconds or None, got {heartbeat_s}")
        worker_keys = load_worker_keys(keys) if keys is not None else None
        self.address = address
        self.rank = rank
        self.request_timeout = request_timeout
        self.lost_timeout = lost_timeout
        self.heartbeat_s = heartbeat_s
        self.limits = limits
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_stop = threading.Event()
        self.session = uuid.uuid4().hex
        self.token: str | None = None  # the PS's proof that this worker holds its rank (from the hello reply)
        self.counters = CommCounters()
        self._rids = itertools.count(1)
        self._ctx = context or zmq.Context.instance()
        self._worker_keys = worker_keys
        self.keyed = worker_keys is not None
        self.max_message_bytes: int | None = None  # the PS's limit, learnt from its hello reply
        self._init_watch(address.split("|"))
        self._open(self.members[0])
        self._closed = False
        self._admitted = False
        self._lost = False
        self._lost_since = 0.0
        self._hello_fields: dict[str, Any] | None = None  # said again after a reconnection
        self.reconnections = 0

    def _open(self, address: str) -> None:
        """The request socket to the PS at ``address``, and its connection events' monitor."""
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        self._secure(self._sock)
        self._monitor = monitor_socket(
            self._sock, zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
        self._unmonitor = stop_on_drop(self, self._sock, self._monitor)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._send_poller = zmq.Poller()  # while a request waits to be sent (_send)
        self._send_poller.register(self._sock, zmq.POLLOUT)
        self._send_poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(address)
        self.address = address

    def _close_sockets(self) -> None:
        self._close_probe()
        self._unmonitor()
        self._sock.close(0)

    def _switch(self, address: str, msg_type: str, frames: list[Any]) -> None:
        """Move to the PS at ``address`` (a standby that leads now): hello again, and resend the request in flight."""
        self._close_sockets()
        self._open(address)
        self.standby = None  # until the new leader's replies name one
        self._lost, self._admitted = False, False
        self._heard = time.monotonic()
        self.reconnections += 1
        self._resend(msg_type, frames)

    def request(self, msg_type: str, fields: Mapping[str, Any] | None = None,
                tensors: Mapping[str, Tensor] | None = None, *, timeout: float | None = None,
                alive: Callable[[], str | None] | None = None, local: Mapping[str, int] | None = None,
                while_waiting: Callable[[], None] | None = None) -> Message:
        """Send one request and wait for its reply; ``alive`` may explain a silent PS (a dead process).

        A refusal by the PS comes as :class:`PSError`; a reply the PS asks to repeat after a reconnection
        (``not_member``) is repeated first.

        Args:
            msg_type: the request's type (``hello``, ``push``, ``pull``, ``gather``, ...).
            fields: the request's fields; its request id is added.
            tensors: the tensors it carries, by name (None: none).
            timeout: seconds to wait for the reply; None: ``request_timeout``.
            alive: says why the PS cannot answer (its process died), or None while it may.
            local: tensors that are in this client's shared segment, by their offset in it (pushes only).
            while_waiting: work to do once the request is sent, before its reply is awaited (its
                time is not counted as waiting).

        Raises:
            PSUnreachableError: where this transport is closed, no reply comes within the timeout, or ``alive``
                says the PS is gone.
        """
        if self._closed:
            raise PSUnreachableError("this PSClient is closed")
        rid = next(self._rids)
        frames = encode(msg_type, {**(fields or {}), "rid": rid}, tensors, local=local)
        self._count_up(msg_type, message_bytes(frames), tensors, local)
        start = self._heard = time.monotonic()
        limit = self.request_timeout if timeout is None else timeout
        if self._send(msg_type, frames, limit, start, alive):
            start = time.monotonic()  # sent by a reconnection's resend: its reply is awaited from now
        if while_waiting is not None:
            began = time.monotonic()
            while_waiting()
            start += time.monotonic() - began
        try:
            return self._await(rid, msg_type, frames, limit, start, alive)
        finally:
            self.counters.wait_seconds += time.monotonic() - start

    def _send(self, msg_type: str, frames: list[Any], limit: float, start: float,
              alive: Callable[[], str | None] | None) -> bool:
        """Send a request without ever blocking past ``limit``: a DEALER queues nothing while it has no
        connection to queue on (between a refused handshake and the next attempt, say), and a blocking send
        would then wait for one forever. Waits for one, raising the PS's refusal as soon as the monitor
        reports it. True if a reconnection's resend (``_on_connection_event``) sent the frames instead."""
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return False
            except zmq.Again:
                pass
            ready = self._poll(self._send_poller, msg_type, limit, start, "could not send to")
            if self._monitor in ready and self._on_connection_event(msg_type, frames):
                return True
            if self._sock not in ready:
                address = self.address
                self._watch(msg_type, frames)
                if self.address != address:  # moved to the standby, the request sent there
                    return True
                self._check_alive(msg_type, alive)

    def _poll(self, poller: zmq.Poller, msg_type: str, limit: float, start: float, failure: str) -> dict[Any, int]:
        """One poll of at most 0.5 s within the request's ``limit`` (from ``start``); past it, ``failure``
        (what did not happen) is raised with what to check."""
        left = limit - (time.monotonic() - start)
        if left <= 0:
            raise PSUnreachableError(
                f"{failure} the parameter server at {self.address} within {limit:g} s (request {msg_type!r}). "
                "Is it running and reachable? Start one with `plug-asgd serve-ps`, or check the address, port and "
                "firewall.")
        return dict(poller.poll(int(min(left, 0.5, self._watch_due()) * 1000) + 1))

    def _count_up(self, msg_type: str, size: int, tensors: Mapping[str, Tensor] | None,
                  local: Mapping[str, int] | None) -> None:
        """Refuses a request over the PS's size limit; counts the bytes of one that goes."""
        if self.max_message_bytes is not None and size > self.max_message_bytes:
            raise PSError("too_large", f"this {msg_type!r} request is {size} bytes; the parameter server at "
                                       f"{self.address} accepts at most {self.max_message_bytes} (its "
                                       "--max-message-bytes): raise that limit or send less (a compressor)")
        self.counters.bytes_up += size
        self.counters.requests += 1
        if msg_type == "push":
            self.counters.push_bytes_up += size
            self.counters.pushes += 1
            if local:
                self.counters.push_local_bytes_up += sum(np.asarray(tensors[n]).nbytes for n in local)  # type: ignore[index]

    def _await(self, rid: int, msg_type: str, frames: list[Any], limit: float, start: float,
               alive: Callable[[], str | None] | None) -> Message:
        """The reply to request ``rid``, sent at ``start``; ``frames`` are sent again after a reconnection."""
        rejoins = 0
        while True:
            ready = self._poll(self._poller, msg_type, limit, start, "no reply from")
            if self._monitor in ready:
                self._on_connection_event(msg_type, frames)
            if self._sock not in ready:
                self._watch(msg_type, frames)
                self._check_alive(msg_type, alive)
                continue
            reply_frames = self._sock.recv_multipart(copy=False)
            self.counters.bytes_down += message_bytes(reply_frames)
            try:
                reply = decode(reply_frames, self.limits)
            except WireError as exc:  # what came, said, so that a peer's fault can be told from ours
                raise WireError(exc.code, f"{exc}: a reply from the parameter server at {self.address} to "
                                          f"{msg_type!r} ({frame_summary(reply_frames)}) that is not the "
                                          "protocol's; the PS and this worker must run the same plug-asgd") from None
            self._learn(reply)
            if self._follow(reply, msg_type, frames):  # whatever its rid: it says the PS was replaced, and by whom
                continue
            if reply.fields.get("rid") != rid:
                continue  # the late answer to a request that timed out
            if reply.type == "error" and self._rejoin(msg_type, reply, frames, rejoins):
                rejoins += 1
                continue
            if reply.type == "error":
                raise PSError(str(reply.fields.get("code")), f"parameter server at {self.address}: "
                                                             f"{reply.fields.get('message')}")
            return reply

    def _check_alive(self, msg_type: str, alive: Callable[[], str | None] | None) -> None:
        """Raises if ``alive`` says the PS is gone, or it dropped and stayed away past ``lost_timeout``."""
        reason = alive() if alive is not None else None
        if reason:
            raise PSUnreachableError(reason)
        if self._lost and time.monotonic() - self._lost_since > self.lost_timeout:
            raise PSUnreachableError(
                f"the parameter server at {self.address} went away (connection lost) and did not "
                f"come back within {self.lost_timeout:g} s (request {msg_type!r}); restart it "
                "(`plug-asgd serve-ps --resume DIR`) and run again")

    def _on_connection_event(self, msg_type: str, frames: list[Any]) -> bool:
        """After the PS dropped and came back: hello again, then resend the request in flight (True: resent)."""
        resent = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            # PROTOCOL/AUTH: the keys do not match (or one side has none). NO_DETAIL is what a worker without
            # keys often sees when a keyed PS hangs up on it, but it also ends a handshake cut short by a PS
            # that died; so it means refusal only before this worker was ever admitted.
            if event & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH) or (
                    event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not self._admitted):
                raise PSUnreachableError(self._handshake_failure(event))
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._admitted = True
                self._heard = time.monotonic()
            if event == zmq.EVENT_DISCONNECTED:
                if not self._lost:
                    self._lost_since = time.monotonic()
                self._lost = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._lost:
                self._lost = False
                self.reconnections += 1
                self._resend(msg_type, frames)
                resent = True
        return resent

    def _resend(self, msg_type: str, frames: list[Any]) -> None:
        """Hello again (its reply, rid 0, is not awaited), then the request in flight: the PS takes them in order."""
        if self._hello_fields is not None and msg_type != "hello":
            hello = encode("hello", {**self._hello_fields, "rid": 0})
            self.counters.bytes_up += message_bytes(hello)
            self._sock.send_multipart(hello, copy=False)
        self.counters.bytes_up += message_bytes(frames)
        self._sock.send_multipart(frames, copy=False)

    def _rejoin(self, msg_type: str, reply: Message, frames: list[Any], rejoins: int) -> bool:
        """After ``not_member`` (a restarted PS got the request before this worker's hello, sent on reconnection),
        hello and send it again, twice at most; False to raise the error."""
        if reply.fields.get("code") != "not_member" or self._hello_fields is None or msg_type == "hello":
            return False
        if rejoins >= 2:
            return False
        self._resend(msg_type, frames)
        return True

    def _secure(self, sock: zmq.Socket) -> None:
        """CURVE on one of this worker's sockets, when it has keys (the heartbeat's too)."""
        keys = self._worker_keys
        if keys is not None:
            sock.curve_publickey = keys.public
            sock.curve_secretkey = keys.secret
            sock.curve_serverkey = keys.server_public

    def _start_heartbeat(self) -> None:
        if self.heartbeat_s is None or self._heartbeat is not None:
            return
        self._heartbeat = threading.Thread(target=self._beat, name=f"plug_asgd-heartbeat-{self.rank}", daemon=True)
        self._heartbeat.start()

    def side_socket(self, hwm: int) -> zmq.Socket:
        """Another connection to the PS, for messages that must not wait behind a request (heartbeats,
        notices): at most ``hwm`` messages queue either way while the PS is away or slow.

        Args:
            hwm: the most messages that queue in either direction (ZeroMQ's high-water mark).
        """
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        self._secure(sock)
        sock.connect(self.address)
        return sock

    def _beat(self) -> None:
        """Fire and forget: no reply is awaited, and at most one beat waits while the PS is away."""
        sock, address = self.side_socket(hwm=1), self.address
        try:
            frames = encode("heartbeat", {"rank": self.rank, "session": self.session, "token": self.token})
            while not self._heartbeat_stop.wait(self.heartbeat_s):
                if self.address != address:  # moved to the standby that leads now
                    sock.close(0)
                    sock, address = self.side_socket(hwm=1), self.address
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close(0)

    def _handshake_failure(self, event: int) -> str:
        """Why the PS refused the connection, in words: almost always keys that do not match."""
        if self.keyed:
            why = ("the PS refused this worker's key" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else
                   "the secure handshake failed (a server.key that is not this PS's, or a PS without keys)")
            return (f"cannot connect to the parameter server at {self.address}: {why}. Check that --ps-keys "
                    "points at the worker folder made together with the PS's keys and that the worker's public "
                    f"key is in the PS's authorized_workers folder; {KEYGEN_HINT}")
        return (f"cannot connect to the parameter server at {self.address}: it requires authentication "
                f"(CURVE keys) and this worker has none. Pass --ps-keys DIR/worker (ps_keys= on the strategy, "
                f"keys= on PSClient); {KEYGEN_HINT}")

    def close(self) -> None:
        """Stop the heartbeats and close the sockets; a later request raises :class:`PSUnreachableError`."""
        if not self._closed:
            self._closed = True
            self._heartbeat_stop.set()
            if self._heartbeat is not None:
                self._heartbeat.join(5.0)
            self._close_sockets()
