"""The primary's side of a hot standby: one link to it, over which every change of the central state goes first.

A standby (``serve-ps --standby-of ADDR``) asks to join, proving its credential
(:mod:`plug_asgd.ps.standby_credential`); the primary connects a DEALER socket to the standby's record socket
(:mod:`plug_asgd.ps.standby_link`: only the primary can write there, by the PS's key or the link's token) and sends
it the whole state (a ``snapshot`` record), then, before each change it makes, the record of that change. The join
runs beside the serving loop (:mod:`plug_asgd.ps.replication_join`), and changes nothing where it is abandoned. Once
attached, before each change: a push as the primary received it (a sparse codec's push stays sparse), an ``init``,
the set of training ranks, a worker's session. The primary waits for the standby's acknowledgement before it makes
the change itself, and so before it answers the request: a reply a worker has seen is of a state the standby holds.
Both sides run the same deterministic code on the same records (a refused push is refused on both), and the
acknowledgement carries the standby's version, which the primary checks against its own.

While no record goes, a ``beat`` goes every quarter of ``failover_timeout``: the standby takes silence longer than
``failover_timeout`` as the primary possibly gone (it still needs a worker's word, see :mod:`plug_asgd.ps.failover`).
A standby that does not acknowledge within half of ``failover_timeout`` is detached: the primary says so, serves on
without one, and takes a new standby when one asks. Half: a request the primary holds while it waits is answered
before its worker, silent PS or not, could ask the standby to lead (after ``failover_timeout``). A standby that
answers ``fenced`` leads a later epoch: this primary was replaced, and :class:`Fenced` says so to the server, which
then changes nothing more. A detached standby is still asked, every ``failover_timeout``, whether it leads (it may
have been cut off, then asked to lead by workers cut off too): the answer ``fenced`` ends this primary as well.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from plug_asgd.protocol.wire import Limits, Tensor, WireError, decode, encode, message_bytes
from plug_asgd.ps.replication_join import Joining, StandbyJoin

log = logging.getLogger("plug_asgd.ps")

class Fenced(Exception):
    """The standby says it leads a later epoch: where its proof holds (:mod:`plug_asgd.ps.election`), this PS was
    replaced and must change nothing more.

    Args:
        epoch: the epoch the standby leads.
        leader: the standby's address, which now leads.
        proof: the ``fenced`` answer's fields (the epoch, the majority's ballots, the link's seal).
        link: the token of the link it came on.
    """

    def __init__(self, epoch: int, leader: str, proof: dict[str, Any] | None = None, link: str = "") -> None:
        super().__init__(f"replaced by the standby at {leader}, which leads epoch {epoch}")
        self.epoch = epoch
        self.leader = leader
        self.proof = proof or {}
        self.link = link


class Replication(StandbyJoin):
    """The primary's link to its standby (at most one), synchronous: :meth:`send` returns once the standby holds
    the record.

    Args:
        context: the ZeroMQ context to make the link's socket in.
        failover_timeout: seconds the standby waits in silence before it may lead; the link's acknowledgement
            timeout, and four times its beat interval.
        limits: the largest message the link accepts back.
        keys: the PS's CURVE keys, which its standby holds too; None: the link is not encrypted (its token is the
            record socket's PLAIN password).
    """

    def __init__(self, context: zmq.Context, failover_timeout: float, limits: Limits, keys: Any = None) -> None:
        self._ctx = context
        self._keys = keys
        self.failover_timeout = failover_timeout
        self.limits = limits
        self.address: str | None = None  # the standby's, while one is attached
        self._link: str | None = None  # the standby's token for this link: its records carry it
        self._sock: zmq.Socket | None = None
        self._rid = 0
        self._last_sent = 0.0
        self._acked = 0.0  # when the last record the standby acknowledged was sent: it heard this PS then, or later
        self.standby_version: int | None = None  # the version the standby acknowledged last
        self.records = 0
        self.bytes = 0
        self.joined = 0  # standbys taken over the run
        self.detached = 0  # standbys dropped (silent past failover_timeout, or gone)
        self.lost_reason: str | None = None
        self.lost_address: str | None = None
        self._lost: tuple[zmq.Socket, str] | None = None  # a detached standby's link, and its token: asked still
        self._lost_asked = 0.0
        self._posted: tuple[int, float, int] | None = None  # a state sent without waiting: its rid, time, size
        self._joining: Joining | None = None  # a standby being taken
        self._outcome: tuple[tuple[bytes, Any], str | None] | None = None  # a join done or abandoned, to answer

    @property
    def attached(self) -> bool:
        """Whether a standby holds the state now."""
        return self._sock is not None and self._joining is None

    @property
    def linked(self) -> bool:
        """Whether the records of changes go to a standby: one attached, or one being taken."""
        return self._sock is not None

    def send(self, kind: str, fields: dict[str, Any] | None = None, tensors: dict[str, Tensor] | None = None, *,
             timeout: float | None = None) -> int | None:
        """Send one record and wait for the standby to hold it; its version then (None: no standby attached, or
        it was detached now for its silence).

        Args:
            kind: ``snapshot``, ``push``, ``init``, ``trainers``, ``member``, ``gathered``, ``notice``, ``beat`` or
                ``end``.
            fields: the record's fields.
            tensors: its tensors.
            timeout: seconds to wait for the acknowledgement; None: half of ``failover_timeout``.

        Raises:
            Fenced: where the standby leads a later epoch (this PS was replaced).
        """
        sock = self._sock
        if sock is None:
            return None
        if self._joining is not None:
            self._stream(kind, fields, tensors)
            return None
        self._rid += 1
        rid = self._rid
        frames = encode("replicate", {**(fields or {}), "kind": kind, "link": self._link, "rid": rid}, tensors)
        size = message_bytes(frames)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            self.detach(f"cannot send to it ({exc})")
            return None
        sent = self._last_sent = time.monotonic()
        deadline, waited_more = sent + (self.failover_timeout / 2 if timeout is None else timeout), False
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                if time.monotonic() < deadline:
                    continue
                if not waited_more and self.may_lead():
                    deadline, waited_more = max(deadline, sent + self.failover_timeout * 1.5), True
                    log.warning("no acknowledgement from the hot standby %s for %.1f s (was this parameter server "
                                "frozen, or cut off?): it may lead now; waiting for its answer up to %g s before "
                                "serving on without it", self.address, time.monotonic() - self._acked,
                                self.failover_timeout * 1.5)
                    continue
                self.detach(f"no acknowledgement within {time.monotonic() - sent:.3g} s")
                return None
            try:
                reply = decode(sock.recv_multipart(copy=False), self.limits)
            except WireError as exc:
                self.detach(f"a malformed acknowledgement ({exc})")
                return None
            if reply.fields.get("rid") != rid:
                self._took_posted(reply)  # the state sent without waiting (or a record sent before a detach)
                continue
            break
        version = self._took(reply, size)
        if version is not None:
            self._acked = max(self._acked, sent)
        return version

    def may_lead(self) -> bool:
        """Whether the standby may lead now: the last record it acknowledged went ``failover_timeout`` or more ago,
        so it may have heard nothing from this PS for that long (this PS frozen, or cut off), and been asked to lead.
        A late acknowledgement from one that may lead is not taken for a dead standby at half the timeout: the
        primary waits for its answer (``fenced``, or an acknowledgement) up to one and a half times the timeout
        before it drops it and serves on (docs/design.md, "Hot standby")."""
        return time.monotonic() - self._acked >= self.failover_timeout

    def _took(self, reply: Any, size: int) -> int | None:
        """The standby's answer to a record of ``size`` bytes: its version (None: detached now).

        Raises:
            Fenced: where it leads a later epoch.
        """
        if reply.type == "fenced":
            epoch = reply.fields.get("epoch")
            raise Fenced(int(epoch) if isinstance(epoch, int) else -1, self.address or "?", reply.fields,
                         self._link or "")
        if reply.type != "ack":
            self.detach(f"it refused a record: {reply.fields.get('message', reply.type)}")
            return None
        self.records += 1
        self.bytes += size
        version = reply.fields.get("version")
        self.standby_version = version if isinstance(version, int) else None
        return self.standby_version

    def _took_posted(self, reply: Any) -> None:
        if self._posted is not None and reply.fields.get("rid") == self._posted[0]:
            sent, size = self._posted[1], self._posted[2]
            self._posted = None
            if self._took(reply, size) is not None:
                self._acked = max(self._acked, sent)

    @property
    def posting(self) -> bool:
        """Whether a state sent without waiting is not acknowledged yet (the next waits for it)."""
        return self._posted is not None

    def post(self, fields: dict[str, Any], tensors: dict[str, Tensor]) -> None:
        """Send the whole state (a ``snapshot`` record) without waiting: ``standby_window``'s stream. Its
        acknowledgement is read between requests (:meth:`beat`); one is in flight at a time.

        Args:
            fields: the state's fields.
            tensors: its tensors, which nothing may write while they are sent (copies).
        """
        sock = self._sock
        if sock is None or self._posted is not None:
            return
        self._rid += 1
        frames = encode("replicate", {**fields, "kind": "snapshot", "link": self._link, "rid": self._rid}, tensors)
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            self.detach(f"cannot send to it ({exc})")
            return
        self._last_sent = time.monotonic()
        self._posted = (self._rid, self._last_sent, message_bytes(frames))

    def _read_posted(self) -> None:
        """The acknowledgement of the state sent without waiting, if it came; detached where it is late."""
        sock = self._sock
        while sock is not None and self._posted is not None and sock.poll(0):
            try:
                reply = decode(sock.recv_multipart(copy=False), self.limits)
            except WireError as exc:
                self.detach(f"a malformed acknowledgement ({exc})")
                return
            self._took_posted(reply)
        # a state's bytes take their time on a slow link: the standby is late once the timeout has passed
        if self._posted is not None and time.monotonic() - self._posted[1] > self.failover_timeout:
            self.detach(f"no acknowledgement of the state within {self.failover_timeout:g} s")
            self._posted = None

    def beat(self, version: int) -> None:
        """Between requests: a ``beat`` record if none went for a quarter of ``failover_timeout``.

        Args:
            version: the central version now.

        Raises:
            Fenced: where the standby leads a later epoch.
        """
        self._read_posted()
        if self.attached and not self.posting and time.monotonic() - self._last_sent >= self.failover_timeout / 4:
            self.send("beat", {"version": version})
        self._ask_lost(version)

    def _ask_lost(self, version: int) -> None:
        """Whether the detached standby leads now (a ``fenced`` answer raises); a beat every ``failover_timeout``."""
        if self._lost is None:
            return
        sock, link = self._lost
        while sock.poll(0):
            try:
                reply = decode(sock.recv_multipart(copy=False), self.limits)
            except WireError:
                continue
            if reply.type == "fenced":
                epoch = reply.fields.get("epoch")
                raise Fenced(int(epoch) if isinstance(epoch, int) else -1, self.lost_address or "?", reply.fields,
                             link)
        if time.monotonic() - self._lost_asked >= self.failover_timeout:
            self._lost_asked = time.monotonic()
            try:
                sock.send_multipart(encode("replicate", {"kind": "beat", "link": link, "rid": 0, "version": version}),
                                    zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def forget_lost(self) -> None:
        """Stop asking a detached standby whether it leads (this PS knows it was replaced, or it stops)."""
        if self._lost is not None:
            self._lost[0].close(0)
            self._lost = None

    def detach(self, reason: str) -> None:
        """Drop the standby (it stays dropped: a standby rejoins by asking again, and takes the whole state).

        Args:
            reason: why, for the log and the counters.
        """
        if self._joining is not None:
            self._abandon(reason)
        if self._sock is None:
            return
        log.warning("the hot standby %s is detached: %s; serving on WITHOUT a standby (start another with "
                    "`plug-asgd serve-ps --standby-of ADDR`)", self.address, reason)
        self.forget_lost()
        self._lost, self.lost_address = (self._sock, self._link or ""), self.address
        self._sock, self.address, self._link = None, None, None
        self.standby_version = None
        self._posted = None
        self.detached += 1
        self.lost_reason = reason

    def close(self) -> None:
        """The run is over on this PS: tell the standby (an ``end`` record: it stops too), and drop the link.

        Raises:
            Fenced: where the standby answers that it leads a later epoch (the link is dropped all the same).
        """
        fenced = None
        if self._sock is not None:
            try:
                self.send("end", timeout=min(self.failover_timeout, 2.0))
            except Fenced as exc:
                fenced = exc
            self._unmonitor()
            if self._sock is not None:
                self._sock.close(0)
            self._sock, self._joining = None, None
        self.forget_lost()
        if fenced is not None:
            raise fenced

    def counters(self) -> dict[str, Any]:
        """What ``status`` shows of the standby: its address, its lag in updates, and the link's traffic."""
        return {"standby": self.address, "standby_joining": self._joining and self._joining.address,
                "standby_version": self.standby_version,
                "standby_records": self.records, "standby_bytes": self.bytes,
                "standbys_joined": self.joined, "standbys_detached": self.detached,
                "standby_lost_reason": self.lost_reason}
