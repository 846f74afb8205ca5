"""A PS's role in a pair of primary and hot standby: who leads, with which epoch, and when a standby takes over.

:class:`Failover` is a base of :class:`~plug_asgd.ps.server.ParameterServer`. A primary (``role == "primary"``)
sends each change of its state to its standby first (:mod:`plug_asgd.ps.replication`); a standby
(``serve-ps --standby-of ADDR``: ``role == "standby"``) applies those records to a store of its own, serves no
worker, and checkpoints nothing. Every reply of either carries the epoch it leads (``epoch``) and the standby's
address (``standby``), so a worker that knows only the primary's address learns where to go.

The rule that makes one leader at a time (docs/design.md, "Hot standby"; the votes: :mod:`plug_asgd.ps.election`):
a standby leads only when a majority of the run's live workers have asked it to (``lead`` requests: each could not
reach the primary for ``failover_timeout``), none of them saw a version it lacks, **and** it has itself heard nothing
from the primary for ``failover_timeout``. A standby cut off from a primary that the workers still reach gets no such
majority; one that hears the primary refuses every vote (``primary_alive``). Leading, it takes the next epoch, and
answers the old primary's records with ``fenced``, which carries the majority's ballots under the link's seal: a
primary that comes back (a SIGSTOP'd process resumed), or was only cut off from its standby, checks them, then folds
in nothing more, since every change waits for the standby's acknowledgement.
A request that claims a later epoch than this PS leads is refused (``bad_epoch``) unless the standby confirms it.

Epochs outlive the processes: each checkpoint holds its writer's epoch, address and standby
(:mod:`plug_asgd.ps.persistence`). A PS resumed from one leads its epoch, unless the other PS it names (the writer,
where that is another PS, and the standby) answers that it leads that epoch or a later one of the run: the resumed
PS then stops (:meth:`Failover.start_role`) instead of leading beside it. A replaced PS writes no checkpoint.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from plug_asgd.protocol.checkpoint import CheckpointError
from plug_asgd.protocol.wire import Message, Tensor, WireError
from plug_asgd.ps.election import Election
from plug_asgd.ps.replication import Fenced, Replication
from plug_asgd.ps.standby_credential import StandbyCredential
from plug_asgd.ps.standby_join import JoinRequest, advertised, ask_peer
from plug_asgd.ps.standby_link import StandbyLink
from plug_asgd.ps.standby_records import StandbyRecords

log = logging.getLogger("plug_asgd.ps")

STANDBY_TYPES = frozenset({"replicate", "lead", "stats", "ping"})  # what a standby answers
REPLACED_TYPES = frozenset({"stats", "ping"})  # what a replaced primary answers


class Failover(Election, StandbyRecords):
    """The roles, the epoch, the link's records and the workers' ``lead`` requests, a base of the server (what
    the records hold and how a standby applies them: its base :class:`StandbyRecords`).

    It works on the server's store, membership, counters and shard guard, and sends through its socket (the
    attributes annotated here and in its base, which the server sets).
    """

    address: str
    replication: Replication
    _send: Callable[..., None]
    _ctx: Any
    close: Callable[[], None]

    def _init_failover(self) -> None:
        self.role = "standby" if self.config.standby_of is not None else "primary"
        self.epoch = 1
        self.failovers = 0
        self.leader: str | None = None  # who replaced this PS, once replaced
        self.primary_heard = time.monotonic()  # a standby: the last record from the primary
        self.primary_version: int | None = None
        self._link: str | None = None  # a standby: the token the primary's records carry
        self._trainers_sent: frozenset[int] | None = None
        self._unsent = 0  # standby_window: pushes folded since the last state sent to the standby
        self._posted_at = 0.0
        self._join: JoinRequest | None = None
        self.join_failed: str | None = None
        self.link: StandbyLink | None = None  # a standby's record socket
        self.credential: StandbyCredential | None = None  # what proves a standby to this PS
        self.peer: Any = None  # the request in hand's first frame (its User-Id: the connection's key)
        self._init_election()

    # -- the primary's side ------------------------------------------------------------------

    def replicate(self, kind: str, fields: dict[str, Any] | None = None,
                  tensors: dict[str, Tensor] | None = None) -> None:
        """Hand a change to the standby before making it (nothing where none is attached).

        Args:
            kind: the record's kind.
            fields: its fields.
            tensors: its tensors.

        Raises:
            WireError: ``replaced`` where the standby proves that it leads a later epoch: this PS changes nothing
                more (and ``standby`` or ``replaced`` where it did not lead already). A standby that says so
                without proof is dropped, and the change is made without it.
        """
        try:
            if self.role == "primary":
                self.replication.send(kind, fields, tensors)
                return
        except Fenced as exc:
            if not self._fenced(exc):
                return
        why = self._not_serving()
        raise WireError(why.code, str(why))

    def replicate_trainers(self, ranks: frozenset[int]) -> bool:
        """The ranks training may have changed: the standby's rule needs them (a sync round) before the store's
        does. False where this PS does not lead (a standby, or replaced now): the store is then left as it is.

        Args:
            ranks: the ranks training now.
        """
        if self.role != "primary":
            return False
        if ranks != self._trainers_sent and self.replication.linked:
            try:
                self.replicate("trainers", {"ranks": sorted(ranks)})
            except WireError:  # replaced
                return False
        self._trainers_sent = ranks if self.replication.linked else None
        return True

    def replicate_member(self, session: str) -> None:
        """A worker said hello: the standby keeps who owns its session (a worker of this run may then ask it to
        lead, and say hello to it with the same token).

        Args:
            session: the worker's session.
        """
        if self.replication.linked:
            self.replicate("member", {"owners": self.members.owner_fields([session]),
                                      "world_size": self.members.world_size})

    def stream_state(self, pushes: int = 1) -> None:
        """``standby_window`` N: after ``pushes`` more folded, the whole state to the standby once N are unsent
        (or, between requests, any unsent for a quarter of ``failover_timeout``), without waiting; one at a time.

        Args:
            pushes: the pushes folded now (0: between requests).
        """
        window = self.config.standby_window
        if not window or not self.replication.linked:
            return
        self._unsent += pushes
        due = self._unsent >= window or (self._unsent and pushes == 0 and time.monotonic() - self._posted_at
                                         >= self.config.failover_timeout / 4)
        if due and self.replication.attached and not self.replication.posting:
            fields, tensors = self.state_record()
            self.replication.post(fields, {n: np.array(t) for n, t in tensors.items()})  # copies: folds go on
            self._unsent, self._posted_at = 0, time.monotonic()

    def failover_tick(self) -> None:
        """Between requests: a standby's records (:meth:`serve_link`); a primary's beat to its standby (or its
        state, with a window); a standby's check of its join."""
        self.serve_link()
        if self.role == "primary":
            try:
                self.replication.beat(self.store.version)
                self.stream_state(0)
            except Fenced as exc:
                self._fenced(exc)
            if (joined := self.replication.join_done()) is not None:
                self._answer_join(*joined)
        elif self.role == "standby":
            self.check_join()

    def _fenced(self, exc: Fenced) -> bool:
        """The standby answered ``fenced``: True where its proof holds (this PS is replaced now); else the standby
        is dropped as one that lies, and this PS leads on (False)."""
        why = self.disproof(exc.proof, exc.link)
        if why is not None:
            self.stats.refused["bad_fenced"] += 1
            self.replication.detach(f"it answered `fenced` without proof that a majority elected it ({why})")
            self.replication.forget_lost()
            log.error("the standby %s says it leads epoch %d, but %s: this parameter server leads on, without that "
                      "standby", exc.leader, exc.epoch, why)
            return False
        self.role, self.leader = "replaced", exc.leader
        self.persistence.replaced = True  # its state is stale: no checkpoint of it over the leader's, even at exit
        self.replication.detach(f"it leads epoch {exc.epoch}")
        self.replication.forget_lost()
        log.error("this parameter server was REPLACED: its standby %s leads epoch %d (this one led epoch %d); it "
                  "folds in nothing more and refuses every request (stop it)", exc.leader, exc.epoch, self.epoch)
        return True

    def _not_serving(self) -> WireError:
        if self.role == "standby":
            return WireError("standby", f"this is the hot standby of the parameter server at {self.config.standby_of}"
                                        ": workers talk to the primary, and come here only when it is gone")
        return WireError("replaced", f"this parameter server was replaced by its standby at {self.leader}, which "
                                     "leads now: talk to it")

    def screen(self, body: list[Any]) -> list[Any]:
        """A request's frames, refused before they are decoded where this PS does not lead: a standby (or a
        replaced PS) answers no request that carries tensors, so a flood of large messages costs it no decoding.

        Args:
            body: the request's frames (header first).

        Raises:
            WireError: ``standby`` or ``replaced``, where it does not lead and the request carries tensors.
        """
        if self.role != "primary" and len(body) > 1:
            why = self._not_serving()
            raise WireError(why.code, str(why))
        return body

    def check_epoch(self, msg: Message) -> None:
        """Refuse a request that claims a later epoch than this PS leads, unless its standby confirms it (the PS
        was replaced: it then refuses everything).

        Args:
            msg: the request.

        Raises:
            WireError: ``bad_epoch`` for a claim nothing proves; ``replaced`` where the standby confirms it.
        """
        claimed = msg.fields.get("epoch")
        if claimed is None or self.role != "primary":
            return
        if not isinstance(claimed, int) or isinstance(claimed, bool) or claimed < 1:
            raise WireError("bad_field", f"field 'epoch' must be a positive integer, got {claimed!r:.40}")
        if claimed <= self.epoch:
            return
        if self.replication.attached:
            self.replicate("beat", {"version": self.store.version})  # Fenced, where the standby leads
        raise WireError("bad_epoch", f"the request claims epoch {claimed}, but this parameter server leads epoch "
                                     f"{self.epoch} and its standby does not lead a later one")

    def _on_standby(self, identity: bytes, rid: Any, msg: Message) -> None:
        """A standby asks for this PS's options (``step: config``), then to join (``step: join``)."""
        if self.role != "primary":
            raise self._not_serving()
        step = msg.str_field("step")
        if self.credential is None:
            raise WireError("bad_standby", "this parameter server takes no standby")
        self.credential.check(step, msg.fields, self.peer)  # before anything changes: bad_standby
        if step == "config":
            self._send(identity, rid, "standby_config", {"config": self.config.to_json(), "epoch": self.epoch})
            return
        if step != "join":
            raise WireError("bad_field", f"field 'step' must be 'config' or 'join', got {step!r:.40}")
        address, link_address, link = msg.str_field("address"), msg.str_field("link_address"), msg.str_field("link")
        if len(link) < 32:
            raise WireError("bad_field", "field 'link' must be the standby's token (32 hex digits at least)")
        self.replication.attach(address, link_address, link, self.state_record(), (identity, rid))  # answered later
        self._trainers_sent = self.members.trainers()

    def _answer_join(self, requester: tuple[bytes, Any], failed: str | None) -> None:
        """A join done (``standby_joined``) or abandoned (``standby_failed``, counted): its requester is told."""
        if failed is None:
            self._send(*requester, "standby_joined", {"epoch": self.epoch, "version": self.store.version})
            return
        self.stats.refused["standby_failed"] += 1
        self._send(*requester, "error", {"code": "standby_failed", "message": failed})

    # -- the roles at start and at the end --------------------------------------------------

    def start_role(self, keys: Any = None) -> None:
        """Once it listens: a standby asks to join its primary; a PS resumed from a checkpoint leads that
        checkpoint's epoch, unless another PS the checkpoint names holds the run at that epoch or a later one.

        Args:
            keys: the PS's CURVE keys (the other PS's too); None: none.

        Raises:
            CheckpointError: where another PS the checkpoint names leads the resumed epoch or a later one, or is
                the run's standby there (at any version: :meth:`_holder`); this PS is closed.
        """
        self.persistence.lineage = self.lineage
        self.credential = StandbyCredential(keys, self.address)  # a keyless PS's secret: written now
        if self.role == "standby":
            self.join_primary(keys)
            return
        resumed = self.persistence.resumed_lineage
        if resumed is None:
            return
        self.epoch, me = resumed["epoch"], advertised(self.address)
        for peer in dict.fromkeys(resumed.get(k) for k in ("leader", "standby")):  # the writer first
            theirs = ask_peer(self._ctx, peer, self.config.failover_timeout, keys) if peer not in (None, me) else None
            there = self._holder(peer, theirs) if theirs else None
            if there is not None:
                self.close()
                raise CheckpointError(
                    f"this parameter server does not lead: it resumed epoch {self.epoch} of run "
                    f"{self.persistence.run_id} at version {self.store.version} ({self.persistence.resumed_from}), "
                    f"and the parameter server at {peer} {there}")

    def _holder(self, peer: str, theirs: dict[str, Any]) -> str | None:
        """What makes the other PS at ``peer`` (its counters: ``theirs``) the run's holder, where it is one: a
        leader or replaced PS of the resumed epoch or a later one, or a standby of this run at that epoch, whatever
        its version (docs/design.md, "Hot standby": a resumed PS cannot fence that standby, so it never leads beside
        it). None: it is not (another run's, an earlier epoch's).

        Args:
            peer: its address.
            theirs: its counters (``stats``).
        """
        epoch, version = theirs.get("epoch"), theirs.get("version")
        if theirs.get("run_id") != self.persistence.run_id or type(epoch) is not int or epoch < self.epoch:
            return None
        role, mine = theirs.get("role"), self.store.version
        restart = f"restart this one as its standby once it leads: `plug-asgd serve-ps --standby-of {peer}`"
        if role == "primary":
            return (f"leads epoch {epoch}; the run's workers are there: restart this one as its standby "
                    f"(`plug-asgd serve-ps --standby-of {peer}`)")
        if role == "replaced":
            return (f"led epoch {epoch} and was replaced by {theirs.get('leader')}, which leads a later one; the "
                    f"run's workers are there: restart this one as its standby (`plug-asgd serve-ps --standby-of "
                    f"{theirs.get('leader')}`)")
        if role != "standby" or type(version) is not int:
            return None
        if version >= mine:
            held = ("later than this checkpoint: it holds the pushes acknowledged since" if version > mine else
                    "as this checkpoint: the same state")
            return (f"is the run's hot standby at epoch {epoch}, version {version}, {held}; it leads when the "
                    f"workers ask it (they cannot reach this one, stopped); {restart}")
        return (f"is the run's hot standby at epoch {epoch}, version {version}, behind this checkpoint (its state "
                f"came in a window, standby_window); it leads when the workers ask it, without the pushes after "
                f"version {version}; to keep them, stop that standby first, then resume this one")

    def lineage(self) -> dict[str, Any]:
        """What a checkpoint says of its writer: the epoch it leads, its address and its standby's (None: none)."""
        return {"epoch": self.epoch, "leader": advertised(self.address), "standby": self.replication.address}

    def close_failover(self) -> None:
        """The PS stops: its standby is told (one that leads a later epoch says so: this PS was replaced, and writes
        no checkpoint), and the links and the join request's socket are dropped."""
        try:
            self.replication.close()
        except Fenced as exc:
            self._fenced(exc)
        if self._join is not None:
            self._join.close()
        if self.link is not None:
            self.link.close()
        if self.credential is not None:
            self.credential.close()

    # -- the standby's side ------------------------------------------------------------------

    def join_primary(self, keys: Any = None) -> None:
        """A standby asks its primary to take it (the answer comes once it holds the state: :meth:`check_join`).

        Args:
            keys: the PS's CURVE keys (the primary's too); None: none.
        """
        self._link = secrets.token_hex(16)
        self.link = StandbyLink(self._ctx, self.address, keys, self._link, self.limits)
        self._join = JoinRequest(self._ctx, self.config.standby_of or "", advertised(self.address),
                                 advertised(self.link.address), self._link, keys)
        log.info("standby of %s: asking to join", self.config.standby_of)

    def check_join(self) -> None:
        """A standby whose primary refused it, or did not take it in time, stops (``join_failed`` says why)."""
        join = self._join
        if join is not None and join.check() is False:
            self.join_failed = join.failed
            log.error("%s; stopping", join.failed)
            self._stop = True

    def _on_replicate(self, identity: bytes, rid: Any, msg: Message) -> None:
        raise WireError("bad_link", "a record must come over the link this standby opened with its primary")

    def _promote(self, why: str) -> None:
        self.role, self.epoch, self.failovers = "primary", self.epoch + 1, self.failovers + 1
        self.members.await_ranks(self.store.rule.training_ranks)
        log.warning("this standby LEADS now, epoch %d, at version %d: %s; serving without a standby (start one "
                    "with `plug-asgd serve-ps --standby-of %s`)", self.epoch, self.store.version, why, self.address)
        self.persistence.lead()

    def leadership(self) -> dict[str, str]:
        """What every reply says besides the epoch: the standby's address, where one is attached (``standby``), and
        the successor, where this PS was replaced (``leader``)."""
        out = {}
        if self.replication.address is not None:
            out["standby"] = self.replication.address
        if self.leader is not None:
            out["leader"] = self.leader
        return out

    def _on_ping(self, identity: bytes, rid: Any, msg: Message) -> None:
        self._send(identity, rid, "pong", {"role": self.role})

    def failover_counters(self) -> dict[str, Any]:
        """What ``status`` shows: the role, the epoch, the failovers so far, the standby and its lag."""
        lag = None
        if self.replication.standby_version is not None:
            lag = self.store.version - self.replication.standby_version
        return {"role": self.role, "epoch": self.epoch, "failovers": self.failovers, "leader": self.leader,
                "record_socket": self.link.address if self.link is not None else None,
                "standby_lag": lag, "standby_of": self.config.standby_of if self.role == "standby" else None,
                **self.replication.counters()}
