"""What a hot standby's records hold, and how the standby takes each one: the whole state (at the join, and every
``standby_window`` pushes), a push, an ``init``, the training ranks, a worker's session, a completed collective, a
posted notice, a beat, the run's end. They come on the standby's record socket alone
(:mod:`plug_asgd.ps.standby_link`), each with the link's token, and are acknowledged there.

:class:`StandbyRecords` is a base of :class:`~plug_asgd.ps.failover.Failover`: the primary makes the state record
(:meth:`StandbyRecords.state_record`), the standby's ``_apply_KIND`` applies a record of kind ``KIND`` to its own
store, membership, counters and collectives (the attributes annotated below, which the server sets), as the
primary changed its own.
"""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

import numpy as np

from plug_asgd.modes import APPLIED
from plug_asgd.protocol.wire import Limits, Message, Tensor, WireError, decode, encode, message_bytes
from plug_asgd.ps import limits as bounds
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.gathers import Gathers
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.shard_guard import ShardGuard
from plug_asgd.ps.standby_link import StandbyLink
from plug_asgd.ps.stats import Stats
from plug_asgd.ps.store_records import FOLDED, MAX_SCALED_FOR, PushIn, Snapshot

log = logging.getLogger("plug_asgd.ps")


class StandbyRecords:
    """The state record a primary sends, and the records a standby reads from its record socket and applies."""

    config: PSConfig
    limits: Limits
    link: StandbyLink | None
    _link: str | None
    role: str
    primary_heard: float
    primary_version: int | None
    store: FastStore
    members: Membership
    collectives: Gathers
    stats: Stats
    shard: ShardGuard
    persistence: Any
    epoch: int
    failovers: int
    fence_proof: dict[str, Any]
    _stop: bool

    def state_record(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The whole state a standby starts from (and, with ``standby_window``, takes again every N pushes): a
        checkpoint's, plus the epoch, who trains, the sessions' owners and the posted notices. Read in place."""
        fields: dict[str, Any] = {
            "initialized": self.store.initialized, "resumed": self.store.resumed, "epoch": self.epoch,
            "failovers": self.failovers, "world_size": self.members.world_size,
            "run_id": self.persistence.run_id, "stats": self.stats.saved(), "trainers": sorted(self.members.trainers()),
            "owners": self.members.owner_fields(self.members.owners), **self.shard.checkpoint_fields(),
            "notices": [[*where, value] for where, value in self.collectives.board.posted.items()]}
        tensors: dict[str, Tensor] = {}
        if self.store.initialized:
            snap = self.store.snapshot()
            fields.update(version=snap.version, last_seq=snap.last_seq, rule=snap.rule_fields)
            tensors = {f"model/{n}": t for n, t in snap.tensors.items()}
            tensors.update((f"rule/{n}", a) for n, a in snap.rule_arrays.items())
        return fields, tensors

    def serve_link(self) -> None:
        """A standby's records waiting on its record socket, handled now (first, and before each message of the
        workers' socket: garbage there delays a record by one message at most)."""
        if self.link is not None:
            self.link.drain(self._on_link_frames)

    def _on_link_frames(self, identity: bytes, frames: list[Any]) -> None:
        """A message on the record socket: a record of the primary's applied (or ``fenced``), anything else
        refused and counted; answered on that socket."""
        rid = None
        try:
            msg = decode(frames, self.limits)
            rid = bounds.rid(msg.fields)
            if msg.type != "replicate":
                raise WireError("bad_link", f"a standby's record socket takes records, not {msg.type!r:.40}")
            self._apply_record(identity, rid, msg)
        except WireError as exc:
            self.stats.refused[exc.code] += 1
            self._link_reply(identity, rid, "error", {"code": exc.code, "message": str(exc)})

    def _link_reply(self, identity: bytes, rid: Any, msg_type: str, fields: dict[str, Any]) -> None:
        if self.link is not None:
            self.link.send(identity, msg_type, {**fields, "rid": rid, "epoch": self.epoch})

    def _apply_record(self, identity: bytes, rid: Any, msg: Message) -> None:
        link = msg.fields.get("link")
        expected = self._link or ""
        if not isinstance(link, str) or not link.isascii() or not expected or not hmac.compare_digest(link, expected):
            raise WireError("bad_link", "a record must come over the link this standby opened with its primary")
        if self.role != "standby":  # it leads: the old primary is told so, with the majority's ballots as proof
            self._link_reply(identity, rid, "fenced", {"epoch": self.epoch, **self.fence_proof})
            return
        kind = msg.str_field("kind")
        apply = getattr(self, f"_apply_{kind}", None)
        if apply is None:
            raise WireError("bad_field", f"unknown record kind {kind!r:.40}")
        self.primary_heard = time.monotonic()
        if kind == "push":  # held once here: acknowledged first, folded while the primary folds its own copy (a
            # request to lead is read only after the fold, so a standby that leads has folded every record it held)
            self._link_reply(identity, rid, "ack", {"version": self.store.version, "status": "held"})
        status = "ok"
        try:
            apply(msg)
        except WireError as exc:  # a push the primary refuses as well (the same code on the same state)
            status = exc.code
        self.primary_version = self.store.version
        if kind != "push":
            self._link_reply(identity, rid, "ack", {"version": self.store.version, "status": status})


    def _apply_snapshot(self, msg: Message) -> None:
        f = msg.fields
        self.epoch = int(f["epoch"])
        self.failovers = int(f.get("failovers", 0))
        if f.get("initialized"):
            tensors = {n[len("model/"):]: t for n, t in msg.tensors.items() if n.startswith("model/")}
            arrays = {n[len("rule/"):]: np.array(t) for n, t in msg.tensors.items() if n.startswith("rule/")}
            last_seq = {str(k): int(v) for k, v in f.get("last_seq", {}).items()}
            self.store.restore(Snapshot(int(f["version"]), tensors, last_seq, f.get("rule", {}), arrays))
            self.store.resumed = bool(f.get("resumed"))
        self.members.restore_owners(f.get("owners"))
        self.members.world_size = f.get("world_size")
        self.stats.restore(f.get("stats", {}))
        self.shard.restore(f, "the primary's state")
        self.persistence.run_id = f.get("run_id") or self.persistence.run_id
        self.store.set_trainers(frozenset(f.get("trainers", [])))
        self.collectives.board.posted.update(((int(s), int(r), int(k)), v) for s, r, k, v in f.get("notices", []))
        log.info("standby: holding the primary's state at version %d (epoch %d)", self.store.version, self.epoch)

    def _apply_gathered(self, msg: Message) -> None:
        f = msg.fields
        fields = {"ranks": f["ranks"], "objs": f["objs"]}
        size = message_bytes(encode("gathered", fields, msg.tensors))  # the reply's bytes, counted as the primary's
        self.collectives.keep((int(f["stage"]), int(f["seq"])), fields, dict(msg.tensors), size)

    def _apply_notice(self, msg: Message) -> None:
        f = msg.fields
        self.collectives.board.posted[(int(f["stage"]), int(f["src"]), int(f["key"]))] = f["value"]

    def _apply_push(self, msg: Message) -> None:
        scaled_for = msg.float_field("scaled_for", minimum=0.0, maximum=MAX_SCALED_FOR, optional=True)
        rank, session = msg.int_field("rank", minimum=0), msg.str_field("session")
        folded = self.store.fold(PushIn(None, rank, session, msg.int_field("seq", minimum=0),
                                        msg.int_field("base_version", minimum=0), msg.tensors, msg.frames,
                                        scaled_for=scaled_for, weights=msg.fields.get("weights") is True))
        if folded.status == FOLDED:  # counted as the primary counts it
            self.store.last_seq[session] = self.store.last_seq.pop(session)
            self.stats.pushes_by_rank[rank] += 1
            self.stats.staleness[folded.staleness] += 1
            self.stats.pushes_applied += sum(status == APPLIED for _, status in folded.resolutions)

    def _apply_init(self, msg: Message) -> None:
        self.store.init(msg.tensors)
        self.shard.restore(msg.fields, "the primary's init")

    def _apply_trainers(self, msg: Message) -> None:
        self.store.set_trainers(frozenset(int(r) for r in msg.fields.get("ranks", [])))

    def _apply_member(self, msg: Message) -> None:
        self.members.restore_owners(msg.fields.get("owners"))
        self.members.world_size = msg.fields.get("world_size")

    def _apply_beat(self, msg: Message) -> None:
        pass

    def _apply_end(self, msg: Message) -> None:
        log.info("standby: the primary's run is over; stopping")
        self._stop = True
