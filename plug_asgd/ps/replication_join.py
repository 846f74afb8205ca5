"""The primary's side of taking a hot standby (:class:`~plug_asgd.ps.replication.Replication`'s join), beside the
serving loop: the whole state and the records of the changes made meanwhile go without waiting (copied as they are
sent), their acknowledgements are read between requests, and the standby is attached once it has acknowledged the
last of them. A link whose ZeroMQ handshake has not succeeded within ``failover_timeout`` (a port nobody answers), a
reply other than an acknowledgement (the primary's own address answers ``bad_link``) or no acknowledgement within
:data:`JOIN_TIMEOUT_S` abandons the join, which changed nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from plug_asgd.protocol.monitor import monitor_socket, stop_on_drop
from plug_asgd.protocol.wire import Limits, Tensor, WireError, decode, encode
from plug_asgd.ps.curve_auth import client_socket

log = logging.getLogger("plug_asgd.ps")

JOIN_TIMEOUT_S = 60.0  # the snapshot's acknowledgement: a standby maps a whole model (and may start slowly)


@dataclass
class Joining:
    """A standby being taken: the state and the records since went to it without waiting, their acknowledgements
    are awaited between requests.

    Attributes:
        address: the standby's address.
        requester: the join request's sender and request id, answered once the join is done or abandoned.
        monitor: the link's monitor, until its ZeroMQ handshake has succeeded (None after).
        stop_monitor: stops the link's events and closes ``monitor`` (also where the PS is dropped unclosed).
        last_rid: the request id of the last record sent: its acknowledgement attaches the standby.
        connect_by: when the handshake must have succeeded (``time.monotonic()``).
        held_by: when the last record must have been acknowledged.
        last_sent: when the last record was sent.
    """

    address: str
    requester: tuple[bytes, Any]
    monitor: zmq.Socket | None
    stop_monitor: Callable[[], Any]
    last_rid: int
    connect_by: float
    held_by: float
    last_sent: float = 0.0


class StandbyJoin:
    """The join half of :class:`~plug_asgd.ps.replication.Replication`, which holds the link's state these methods
    share (its socket, token, request ids, the join under way and its outcome)."""

    _ctx: zmq.Context
    _keys: Any
    failover_timeout: float
    limits: Limits
    address: str | None
    standby_version: int | None
    joined: int
    lost_reason: str | None
    _link: str | None
    _sock: zmq.Socket | None
    _rid: int
    _last_sent: float
    _acked: float
    _joining: Joining | None
    _outcome: tuple[tuple[bytes, Any], str | None] | None

    def attach(self, address: str, link_address: str, link: str,
               snapshot: tuple[dict[str, Any], dict[str, Tensor]], requester: tuple[bytes, Any]) -> None:
        """Begin taking the standby at ``address``: the whole state goes to it now, without waiting; it is attached
        once it has acknowledged that and every record sent since (:meth:`join_done` says when, or why not).

        Args:
            address: the standby's ZeroMQ address, where workers reach it (named in replies).
            link_address: its record socket's, where the records go.
            link: the standby's token for this link (from its join request).
            snapshot: the state's fields and tensors (copied as they are sent: folds may go on).
            requester: the join request's sender and request id, answered once the join is done or abandoned.

        Raises:
            WireError: ``standby_taken`` where a standby is attached, or being taken, already.
        """
        if self._sock is not None:
            raise WireError("standby_taken", f"this parameter server has a standby already "
                                             f"({self.address or self._joining and self._joining.address}): stop "
                                             "it first, or join this one to the standby instead")
        sock = client_socket(self._ctx, self._keys, link=link)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        monitor = monitor_socket(sock, zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(link_address)
        now = time.monotonic()
        self._sock, self._link = sock, link
        self._joining = Joining(address, requester, monitor, stop_on_drop(self, sock, monitor), 0,
                                now + self.failover_timeout, now + JOIN_TIMEOUT_S)
        log.info("a hot standby at %s asks to join: sending it the state", address)
        self._stream("snapshot", *snapshot)

    def _stream(self, kind: str, fields: dict[str, Any] | None, tensors: dict[str, Tensor] | None) -> None:
        """While a standby is being taken: a record sent without waiting, copied as it goes."""
        joining, sock = self._joining, self._sock
        assert joining is not None and sock is not None
        self._rid += 1
        frames = encode("replicate", {**(fields or {}), "kind": kind, "link": self._link, "rid": self._rid}, tensors)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=True)
        except zmq.ZMQError as exc:
            self._abandon(f"cannot send to it ({exc})")
            return
        joining.last_rid, joining.last_sent = self._rid, time.monotonic()

    def join_done(self) -> tuple[tuple[bytes, Any], str | None] | None:
        """Between requests: a join done now (its requester, and None) or abandoned (its requester, and why); None
        while none is being taken, or the one being taken is still under way."""
        joining, sock = self._joining, self._sock
        if joining is not None and sock is not None:
            if joining.monitor is not None and joining.monitor.poll(0):
                self._unmonitor()
            if joining.monitor is not None and time.monotonic() > joining.connect_by:
                self._abandon(f"no connection to it within {self.failover_timeout:g} s (is it listening there?)")
            while self._joining is not None and sock.poll(0):
                try:
                    reply = decode(sock.recv_multipart(copy=False), self.limits)
                except WireError as exc:
                    self._abandon(f"a malformed acknowledgement ({exc})")
                    break
                if reply.type != "ack":
                    self._abandon(f"it answered {reply.fields.get('message', reply.type)!r:.200}")
                elif reply.fields.get("rid") == joining.last_rid:
                    self._joined(joining, reply)
            if self._joining is not None and time.monotonic() > joining.held_by:
                self._abandon(f"it did not take the state within {JOIN_TIMEOUT_S:g} s")
        outcome, self._outcome = self._outcome, None
        return outcome

    def _joined(self, joining: Joining, reply: Any) -> None:
        self._unmonitor()
        self._joining, self.address = None, joining.address
        version = reply.fields.get("version")
        self.standby_version = version if isinstance(version, int) else None
        self.joined += 1
        self.lost_reason = None
        self._last_sent = self._acked = joining.last_sent
        self._outcome = (joining.requester, None)
        log.warning("hot standby %s joined at version %s: every change goes to it first", joining.address,
                    self.standby_version)

    def _abandon(self, reason: str) -> None:
        """The standby being taken is not: the link is closed, nothing else changed; its requester is told why."""
        joining, sock = self._joining, self._sock
        if joining is None or sock is None:
            return
        self._unmonitor()
        sock.close(0)
        self._sock, self._link, self._joining = None, None, None
        self._outcome = (joining.requester, f"the standby at {joining.address} was not taken: {reason}")
        log.warning("%s", self._outcome[1])

    def _unmonitor(self) -> None:
        joining, sock = self._joining, self._sock
        if joining is not None and joining.monitor is not None and sock is not None:
            joining.stop_monitor()
            joining.monitor = None
