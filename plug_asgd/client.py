"""PSClient: one worker's connection to the parameter server.

A DEALER socket sends one request at a time and waits for the reply that carries the same
request id (a late reply to an abandoned request is discarded). Every frame sent and received
is counted, so the byte figures that the callbacks and benchmarks report are what crossed the
wire, not estimates.

ZeroMQ reconnects by itself when the PS comes back (restarted from its checkpoint, say), but
a request in flight when the PS died is lost. The client watches its socket's connection
events: after a reconnection it says hello again (the new PS does not know it yet) and sends
the request it is waiting on once more. Pushes carry a sequence number, so one that the PS had
already applied is refused as a duplicate and never counted twice.

On the PS's machine the client can push through shared memory (:meth:`PSClient.push_buffers`,
:mod:`plug_asgd.push_memory`); should the PS lose the segment (a restart), the push is sent again
as bytes, and so are all later ones.

Once it has said hello, the client sends a heartbeat every ``heartbeat_s`` seconds from a
thread with a socket of its own, so the PS can tell a worker busy with a long step (heartbeats
go on) from one that died, froze or was cut off (they stop): see the PS's ``worker_timeout``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from plug_asgd import push_memory
from plug_asgd.security import KEYGEN_HINT, load_worker_keys
from plug_asgd.wire import DEFAULT_LIMITS, Limits, Message, Tensor, decode, encode, message_bytes

log = logging.getLogger("plug_asgd.client")

DEFAULT_HEARTBEAT_S = 2.0
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class PSError(RuntimeError):
    """The parameter server refused a request; ``code`` says why (see the PS's error codes)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PSUnreachableError(ConnectionError):
    """No reply from the parameter server within the timeout."""


@dataclass
class CommCounters:
    """What this worker moved: bytes by direction, request counts and time spent waiting."""

    bytes_up: int = 0
    bytes_down: int = 0
    push_bytes_up: int = 0
    push_local_bytes_up: int = 0  # written to shared memory for the PS instead of sent (see push_buffers)
    requests: int = 0
    pushes: int = 0
    own_replies: int = 0  # pushes answered without the model (see PSClient.push)
    weights_not_current: int = 0  # pushes of weights the PS did not take: not counted in pushes
    wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"bytes_up": self.bytes_up, "bytes_down": self.bytes_down, "push_bytes_up": self.push_bytes_up,
                "push_local_bytes_up": self.push_local_bytes_up,
                "requests": self.requests, "pushes": self.pushes, "own_replies": self.own_replies,
                "weights_not_current": self.weights_not_current, "wait_seconds": round(self.wait_seconds, 6)}


@dataclass
class ModelReply:
    """The PS's answer to a pull or a push: central version and tensors, and whether to stop."""

    version: int
    status: str
    stop: bool
    tensors: dict[str, np.ndarray]
    own: bool = False  # no tensors: the central model is exactly the worker's base plus its update (or its weights)


class PSClient:
    """Requests to one parameter server, with timeouts that end in a clear error, never a hang."""

    def __init__(
        self,
        address: str,
        *,
        rank: int,
        world_size: int,
        mode: str,
        request_timeout: float = 600.0,
        lost_timeout: float = 60.0,
        heartbeat_s: float | None = DEFAULT_HEARTBEAT_S,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context | None = None,
        keys: str | os.PathLike[str] | None = None,
    ) -> None:
        """``keys``: the worker's CURVE keys (``DIR/worker`` or ``DIR`` of ``plug-asgd keygen``), for a keyed PS."""
        if heartbeat_s is not None and not 0 < heartbeat_s < 3600:
            raise ValueError(f"heartbeat_s must be in (0, 3600) seconds or None, got {heartbeat_s}")
        worker_keys = load_worker_keys(keys) if keys is not None else None
        self.address = address
        self.rank = rank
        self.world_size = world_size
        self.mode = mode
        self.request_timeout = request_timeout
        self.lost_timeout = lost_timeout
        self.heartbeat_s = heartbeat_s
        self.limits = limits
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_stop = threading.Event()
        self.session = uuid.uuid4().hex
        self.counters = CommCounters()
        self._rids = itertools.count(1)
        self._seq = itertools.count(1)
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        self._worker_keys = worker_keys
        self._secure(self._sock)
        self.keyed = worker_keys is not None
        self.max_message_bytes: int | None = None  # the PS's limit, learnt from its hello reply
        self.shm_offered = False  # the PS takes pushes through shared memory (its hello reply says)
        self._segment: push_memory.PushSegment | None = None
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(address)
        self._closed = False
        self._admitted = False
        self._lost = False
        self._lost_since = 0.0
        self._hello_fields: dict[str, Any] | None = None
        self.reconnections = 0

    # -- transport -----------------------------------------------------------------------------

    def request(self, msg_type: str, fields: Mapping[str, Any] | None = None,
                tensors: Mapping[str, Tensor] | None = None, *, timeout: float | None = None,
                alive: Callable[[], str | None] | None = None, local: Mapping[str, int] | None = None,
                while_waiting: Callable[[], None] | None = None) -> Message:
        """Send one request and wait for its reply; ``alive`` may explain a silent PS (a dead process).

        ``local``: tensors that are in this client's shared segment, by their offset in it (pushes only).
        ``while_waiting``: work to do once the request is sent, before its reply is awaited (its
        time is not counted as waiting).
        """
        if self._closed:
            raise PSUnreachableError("this PSClient is closed")
        rid = next(self._rids)
        frames = encode(msg_type, {**(fields or {}), "rid": rid}, tensors, local=local)
        size = message_bytes(frames)
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
        start = time.monotonic()
        self._sock.send_multipart(frames, copy=False)
        if while_waiting is not None:
            began = time.monotonic()
            while_waiting()
            start += time.monotonic() - began
        limit = self.request_timeout if timeout is None else timeout
        try:
            while True:
                left = limit - (time.monotonic() - start)
                if left <= 0:
                    raise PSUnreachableError(
                        f"no reply from the parameter server at {self.address} within {limit:g} s "
                        f"(request {msg_type!r}). Is it running and reachable? Start one with "
                        "`plug-asgd serve-ps`, or check the address, port and firewall.")
                ready = dict(self._poller.poll(int(min(left, 0.5) * 1000) + 1))
                if self._monitor in ready:
                    self._on_connection_event(msg_type, frames)
                if self._sock not in ready:
                    reason = alive() if alive is not None else None
                    if reason:
                        raise PSUnreachableError(reason)
                    if self._lost and time.monotonic() - self._lost_since > self.lost_timeout:
                        raise PSUnreachableError(
                            f"the parameter server at {self.address} went away (connection lost) and did not "
                            f"come back within {self.lost_timeout:g} s (request {msg_type!r}); restart it "
                            "(`plug-asgd serve-ps --resume DIR`) and run again")
                    continue
                reply_frames = self._sock.recv_multipart(copy=False)
                self.counters.bytes_down += message_bytes(reply_frames)
                reply = decode(reply_frames, self.limits)
                if reply.fields.get("rid") != rid:
                    continue  # the late answer to a request that timed out
                if reply.type == "error":
                    raise PSError(str(reply.fields.get("code")), f"parameter server at {self.address}: "
                                                                 f"{reply.fields.get('message')}")
                return reply
        finally:
            self.counters.wait_seconds += time.monotonic() - start

    def _on_connection_event(self, msg_type: str, frames: list[Any]) -> None:
        """After the PS dropped and came back: hello again, then resend the request in flight."""
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
            if event == zmq.EVENT_DISCONNECTED:
                if not self._lost:
                    self._lost_since = time.monotonic()
                self._lost = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._lost:
                self._lost = False
                self.reconnections += 1
                if self._hello_fields is not None and msg_type != "hello":
                    hello = encode("hello", {**self._hello_fields, "rid": 0})
                    self.counters.bytes_up += message_bytes(hello)
                    self._sock.send_multipart(hello, copy=False)
                self.counters.bytes_up += message_bytes(frames)
                self._sock.send_multipart(frames, copy=False)

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

    def _beat(self) -> None:
        """Fire and forget: no reply is awaited, and at most one beat waits while the PS is away."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 1)
            sock.setsockopt(zmq.RCVHWM, 1)
            self._secure(sock)
            sock.connect(self.address)
            frames = encode("heartbeat", {"rank": self.rank, "session": self.session})
            while not self._heartbeat_stop.wait(self.heartbeat_s):
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
        if not self._closed:
            self._closed = True
            self._heartbeat_stop.set()
            if self._heartbeat is not None:
                self._heartbeat.join(5.0)
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
            if self._segment is not None:
                self._segment.close()  # the buffers stay mapped while the worker holds them

    # -- protocol ------------------------------------------------------------------------------

    def hello(self, stage: int, training: bool, *, timeout: float | None = None,
              alive: Callable[[], str | None] | None = None) -> dict[str, Any]:
        fields = {"rank": self.rank, "world_size": self.world_size, "stage": stage, "training": training,
                  "mode": self.mode, "session": self.session, "heartbeat_s": self.heartbeat_s}
        reply = self.request("hello", fields, timeout=timeout, alive=alive)
        self._hello_fields = fields
        self._start_heartbeat()
        limit = reply.fields.get("max_message_bytes")
        self.max_message_bytes = limit if isinstance(limit, int) and limit > 0 else None
        self.shm_offered = reply.fields.get("shm") is True
        return reply.fields

    def push_buffers(self, shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray] | None:
        """Buffers (name -> shape, dtype) that :meth:`push` hands the PS through shared memory, not the socket.

        None where the PS cannot take them: it is on another machine, runs as another user, does
        not offer it, or this system has no sealed shared memory (Linux's memfd). An update made in
        these buffers must not change until its push has been answered; another array is sent as
        bytes, as always.
        """
        if not (self.shm_offered and push_memory.available()):
            return None
        try:
            segment = push_memory.PushSegment(shapes)
        except OSError as exc:
            log.info("pushing over the socket: cannot get shared memory for the updates (%s)", exc)
            return None
        if self.max_message_bytes is not None and segment.size > self.max_message_bytes:
            segment.close()
            return None
        try:
            self.request("attach", {"session": self.session, "pid": os.getpid(), "fd": segment.fd,
                                    "token": segment.token})
        except PSError as exc:
            segment.close()
            log.info("pushing over the socket: the parameter server cannot map this worker's memory (%s)", exc)
            return None
        self._segment = segment
        return segment.buffers

    @property
    def shares_memory(self) -> bool:
        """Whether the PS maps this client's :meth:`push_buffers` (until it loses them, in a restart)."""
        return self._segment is not None

    def init(self, tensors: Mapping[str, np.ndarray]) -> bool:
        """Offer this worker's tensors as the initial central model; False if another came first."""
        return bool(self.request("init", {"rank": self.rank}, tensors).fields.get("accepted"))

    def pull(self) -> ModelReply:
        return self._model(self.request("pull", {"rank": self.rank}))

    def push(self, base_version: int, update: Mapping[str, Tensor],
             want_model: bool | Literal["unless_own"] = True,
             while_waiting: Callable[[], None] | None = None, weights: bool = False,
             lend: bool = False) -> ModelReply:
        """Push an update; the reply carries the central model unless ``want_model`` is False.

        ``"unless_own"``: no tensors either when the PS folded the update, as sent, into a model
        that nothing else had changed since ``base_version`` (``reply.own``). The worker then
        makes the central model itself, ``base + update`` with the same float additions as the
        PS: the same bits, without the model's bytes on the wire. Dense updates of the central
        dtype only; the PS decides, and answers with the whole model otherwise.

        ``while_waiting`` runs once the push is sent, while the PS folds it (see :meth:`request`);
        not again if the push has to be sent a second time.

        ``weights``: ``update`` holds the worker's weights ``w``, not ``w - base``. If nothing else
        changed the model since ``base_version`` (a lone worker), the PS takes them as its model:
        ``base + (w - base)`` without the rounding of that sum, and without the two passes over
        the model that computing it takes on each side. Otherwise it folds nothing and answers
        ``status == "not_current"``: push ``w - base`` instead. Dense tensors of the central dtype,
        in modes whose PS folds ``w += delta`` (asgd, dynsgd, ssp); other modes answer "not_current".

        ``lend`` (with ``weights`` held in :meth:`push_buffers`): the PS may keep these very
        buffers as its model, checked but not copied, until it has answered this client's next
        push or pull. Do not write them before that answer: the next push of weights goes from
        another set of buffers (the strategy keeps two and swaps them). The PS keeps them only if
        it took them as its model, and copies them first if it must send or change the model
        meanwhile.
        """
        if want_model not in (True, False, "unless_own"):
            raise ValueError(f"want_model must be True, False or 'unless_own', got {want_model!r}")
        fields = {"rank": self.rank, "base_version": base_version, "seq": next(self._seq),
                  "session": self.session, "model": want_model}
        if weights:
            fields["weights"] = True
        if lend:
            fields["lend"] = True
        local = None
        if self._segment is not None:
            local = {n: o for n, t in update.items() if (o := self._segment.offset(t)) is not None} or None
        try:
            try:
                reply = self._model(self.request("push", fields, update, local=local, while_waiting=while_waiting))
            except PSError as exc:
                if exc.code != "bad_local" or not local:
                    raise
                log.warning("the parameter server no longer maps this worker's memory (%s); pushing over the socket "
                            "from now on", exc)
                self._segment = local = None
                reply = self._model(self.request("push", fields, update))
            self.counters.own_replies += reply.own
            if reply.status == "not_current":  # sent, but neither folded nor dropped: the PS read nothing
                self.counters.pushes -= 1
                self.counters.weights_not_current += 1
                if local:
                    self.counters.push_local_bytes_up -= sum(np.asarray(update[n]).nbytes for n in local)
            return reply
        except PSError as exc:
            if exc.code != "duplicate":
                raise
            # sent twice around a reconnection and applied the first time: take the model as it is now
            reply = self.pull()
            return ModelReply(reply.version, "duplicate", reply.stop, reply.tensors)

    def gather(self, stage: int, seq: int, obj: Any = None, tensors: Mapping[str, np.ndarray] | None = None,
               kind: str = "") -> list[tuple[int, Any, dict[str, np.ndarray]]]:
        """Contribute to collective ``seq`` of ``stage``; returns every rank's (rank, obj, tensors).

        ``kind`` ("barrier:NAME", "broadcast", ...) lets the PS refuse ranks that disagree on what
        this collective is, instead of pairing one rank's broadcast with another's barrier.
        """
        fields = {"rank": self.rank, "stage": stage, "seq": seq, "obj": obj, "kind": kind}
        reply = self.request("gather", fields, tensors)
        out = []
        for r, o in zip(reply.fields["ranks"], reply.fields["objs"], strict=True):
            prefix = f"{r}/"
            out.append((r, o, {k[len(prefix):]: v for k, v in reply.tensors.items() if k.startswith(prefix)}))
        return out

    def bye(self, stage: int, timeout: float = 5.0) -> None:
        self.request("bye", {"rank": self.rank, "stage": stage}, timeout=timeout)

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return dict(self.request("stats", timeout=timeout).fields["stats"])

    @staticmethod
    def _model(reply: Message) -> ModelReply:
        return ModelReply(version=int(reply.fields["version"]), status=str(reply.fields.get("status")),
                          stop=bool(reply.fields.get("stop")), tensors=dict(reply.tensors),  # type: ignore[arg-type]
                          own=reply.fields.get("own") is True)
