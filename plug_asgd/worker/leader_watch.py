"""The worker's side of a hot standby: it learns the standby from the PS's replies, and moves to it when the PS is gone.

Every reply of a PS says which epoch it leads and where its standby is (``epoch``, ``standby``). While a request
waits, the worker tells a PS that is slow to answer (a sync round, a barrier) from one that is gone: past a quarter
of ``failover_timeout`` without a word from it, a ``ping`` goes on a socket of its own, which any live PS answers at
once. Past ``failover_timeout`` without a word (a killed process, a frozen one, a host cut off), the worker asks the
standby to lead (``lead``, with its session and token: only a worker of the run may). The standby leads only if it
has not heard from the primary either (docs/design.md, "Hot standby"); the worker then connects to it, says hello
again with its token, and sends the request in flight once more. Pushes carry sequence numbers: one the primary had
already handed to the standby is refused as a duplicate and answered with the current model
(:meth:`~plug_asgd.worker.client.PSClient.push`), so none is applied twice.

A worker may be given the addresses of one PS's members (``tcp://ps0:2223|tcp://ps1:2224``: the primary's first,
then its standby's): until a reply names the standby, the second is the one it asks to lead, and a member asked in
vain gives way to the next after another ``failover_timeout`` of silence. So a worker (or ``plug-asgd status``) that
starts after the primary has died reaches the standby that leads now: a standby that leads answers ``leading`` to
anyone of an earlier epoch, token or not, and the worker moves to it. It cannot make a standby lead (its session is
not one of the run's yet): that is for the run's workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from plug_asgd.protocol.wire import DEFAULT_LIMITS, Message, WireError, decode, encode

log = logging.getLogger("plug_asgd.worker.client")

DEFAULT_FAILOVER_TIMEOUT = 3.0  # the PS's, until its hello reply says
VOTE_RETRY = 1 / 30  # of failover_timeout: a vote the standby answered ``pending`` is cast again this often


class LeaderWatch:
    """The epoch and the standby a worker knows, the pings of a silent PS, and the request to its standby to lead.

    A base of :class:`~plug_asgd.worker.transport.Transport`, which calls :meth:`_learn` with every reply and
    :meth:`_watch` while a request waits, and defines :meth:`_switch` (the move to another address).
    """

    address: str
    rank: int
    session: str
    token: str | None
    _ctx: zmq.Context
    _secure: Callable[[zmq.Socket], None]  # CURVE where the worker has keys
    _sock: zmq.Socket  # the request socket
    _switch: Callable[[str, str, list[Any]], None]  # the move to another address, the request in flight resent

    def _init_watch(self, members: list[str]) -> None:
        self.members = members  # the addresses this worker was given: one PS's members, the primary's first
        self.epoch = 1
        self.standby: str | None = members[1] if len(members) > 1 else None  # until a reply names one
        self.failover_timeout = DEFAULT_FAILOVER_TIMEOUT
        self.failovers = 0
        self.seen_version = 0  # the highest central version a reply named: a standby behind it must not lead
        self._heard = time.monotonic()  # the last word from the PS (a reply, a pong, a handshake)
        self._pinged = 0.0
        self._probe: zmq.Socket | None = None

    def _learn(self, reply: Message) -> None:
        """A word from the PS: it is alive, and says which epoch it leads and where its standby is."""
        self._heard = time.monotonic()
        epoch, standby = reply.fields.get("epoch"), reply.fields.get("standby")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= self.epoch:
            self.epoch = epoch
            self.standby = standby if isinstance(standby, str) and standby else None
        version = reply.fields.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and reply.type != "error":
            self.seen_version = max(self.seen_version, version)
        timeout = reply.fields.get("failover_timeout")
        if isinstance(timeout, float | int) and not isinstance(timeout, bool) and 0 < timeout <= 3600:
            self.failover_timeout = float(timeout)

    def _follow(self, reply: Message, msg_type: str, frames: list[Any]) -> bool:
        """A PS that was replaced refuses every request, naming its successor: move there (True), and the request
        in flight goes with it. A worker busy past the failover (a long step) learns it so."""
        leader = reply.fields.get("leader")
        if reply.type != "error" or reply.fields.get("code") != "replaced" or not isinstance(leader, str):
            return False
        log.warning("rank %d: the parameter server at %s was replaced by %s; moving to it", self.rank, self.address,
                    leader)
        self.failovers += 1
        self._switch(leader, msg_type, frames)
        return True

    def _watch(self, msg_type: str, frames: list[Any]) -> None:
        """While a request waits: ping a PS silent for a quarter of ``failover_timeout``; past it, ask the
        standby to lead, and move to it if it does (the request in flight is sent again there)."""
        if self.standby is None:  # (a bystander, without a token, follows a standby that leads already)
            return
        now = time.monotonic()
        self._read_pongs()
        silent = now - self._heard
        if silent >= self.failover_timeout:
            if self._ask_to_lead(silent):
                self._switch(self.standby, msg_type, frames)
            else:
                self._heard = time.monotonic()  # ask again after another failover_timeout of silence
                self._next_member()
        elif silent >= self.failover_timeout / 4 and now - self._pinged >= self.failover_timeout / 4:
            self._ping()

    def _next_member(self) -> None:
        """The member after the standby asked in vain, where the worker was given more than two (not its own PS)."""
        others = [m for m in self.members if m != self.address]
        if self.standby in others and len(others) > 1:
            self.standby = others[(others.index(self.standby) + 1) % len(others)]

    def _ping(self) -> None:
        if self._probe is None:
            self._probe = self._ctx.socket(zmq.DEALER)
            self._probe.setsockopt(zmq.LINGER, 0)
            self._probe.setsockopt(zmq.SNDHWM, 1)
            self._probe.setsockopt(zmq.RCVHWM, 4)
            self._secure(self._probe)
            self._probe.connect(self.address)
        try:
            self._probe.send_multipart(encode("ping", {"rid": 0}), zmq.NOBLOCK)
        except zmq.Again:
            pass
        self._pinged = time.monotonic()

    def _read_pongs(self) -> None:
        while self._probe is not None and self._probe.poll(0):
            self._probe.recv_multipart()
            self._heard = time.monotonic()

    def _close_probe(self) -> None:
        if self._probe is not None:
            self._probe.close(0)
            self._probe = None

    def _ask_to_lead(self, silent: float) -> bool:
        """Vote for the standby; True if it leads now (its epoch is then this worker's). While it waits for a
        majority's votes, or still hears its primary (:meth:`_undecided`), the vote is cast again every
        :data:`VOTE_RETRY` of ``failover_timeout``, for one ``failover_timeout`` at most, and no more once the PS
        speaks again."""
        standby = self.standby
        assert standby is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._secure(sock)
        vote = encode("lead", {"epoch": self.epoch, "session": self.session, "token": self.token or "",
                               "rank": self.rank, "version": self.seen_version, "rid": 0})
        until = time.monotonic() + self.failover_timeout
        try:
            sock.connect(standby)
            while True:
                sock.send_multipart(vote)
                if not sock.poll(int(max(until - time.monotonic(), 0.01) * 1000)):
                    log.warning("rank %d: no word from the parameter server at %s for %.1f s, nor from its standby "
                                "%s", self.rank, self.address, silent, standby)
                    return False
                reply = decode(sock.recv_multipart(), DEFAULT_LIMITS)
                if not self._undecided(reply) or not self._vote_again(until):
                    break
        except (zmq.ZMQError, WireError) as exc:
            log.warning("rank %d: the standby %s cannot be asked to lead: %s", self.rank, standby, exc)
            return False
        finally:
            sock.close(0)
        if reply.type != "leading":
            log.warning("rank %d: no word from the parameter server at %s for %.1f s; its standby %s does not lead: "
                        "%s", self.rank, self.address, silent, standby,
                        reply.fields.get("message") or f"{reply.fields.get('votes')} of the "
                        f"{reply.fields.get('needed')} votes it needs")
            return False
        log.warning("rank %d: no word from the parameter server at %s for %.1f s: its standby %s leads now (epoch "
                    "%s); moving to it", self.rank, self.address, silent, standby, reply.fields.get("epoch"))
        self.epoch = int(reply.fields["epoch"])
        self.failovers += 1
        return True

    @staticmethod
    def _undecided(reply: Message) -> bool:
        """The standby waits for more votes (``pending``), or has heard its primary less than ``failover_timeout``
        ago (``primary_alive``: a worker whose request went out before the primary's last record counts its
        silence from earlier than the standby does)."""
        return reply.type == "pending" or (reply.type == "error" and reply.fields.get("code") == "primary_alive")

    def _vote_again(self, until: float) -> bool:
        """Wait a little and vote again (True), unless the time is up or the PS spoke (False)."""
        pause = min(VOTE_RETRY * self.failover_timeout, max(until - time.monotonic(), 0.0))
        if pause <= 0 or self._sock.poll(int(pause * 1000)):
            return False  # the PS answered the request in flight meanwhile: it is not gone
        return time.monotonic() < until

    def _watch_due(self) -> float:
        """Seconds until :meth:`_watch` has something to do (a ping, a vote): a waiting request polls no longer,
        so that the workers' votes reach the standby close together."""
        if self.standby is None:
            return 0.5
        silent = time.monotonic() - self._heard
        quarter = self.failover_timeout / 4
        due = self.failover_timeout - silent if silent < quarter * 4 else 0.0
        if silent < quarter:
            due = min(due, quarter - silent)
        return max(due, 0.005)
