"""The requests on the central model itself: ``init``, ``pull`` and ``push``, and the model replies they get.

:class:`ModelRequests` is the part of :class:`~plug_asgd.ps.server.ParameterServer` that turns these requests into
calls on its store (:mod:`plug_asgd.ps.store`) and answers them: at once, or, for a push the mode holds back (a
``sync`` round, an ``ssp`` bound), when the store resolves it. The serving loop dispatches to its ``_on_*`` methods
by message type, as to its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plug_asgd.modes import APPLIED
from plug_asgd.protocol.wire import RATE_RANGE, Message, WireError, encode
from plug_asgd.ps.changes import parse_have
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.refusals import check_model
from plug_asgd.ps.shard_guard import ShardGuard
from plug_asgd.ps.stats import Stats
from plug_asgd.ps.store_records import FOLDED, MAX_SCALED_FOR, NOT_CURRENT, PushIn

log = logging.getLogger("plug_asgd.ps")


@dataclass
class _Reply:
    """Where a push's answer goes, and what it should carry (``want``: all, none, unless_own or pushed)."""

    identity: bytes
    rid: Any
    want: str
    own_version: int | None = None  # the version this push alone made, when it was folded in exactly
    have: tuple[str, int] | None = None  # the central model its worker holds (ps/changes.py) ...
    held: tuple[str, int] | None = None  # ... or the copy it holds of one (ps/downlink.py)
    rank: int | None = None
    ahead: bool = False  # the push asks for the model its rule anticipates (FoldRule.ahead), where there is one
    only: frozenset[str] | None = None  # want "pushed": the tensors the push carried, the only ones its reply has
    paced: bool = False  # the push said its worker's steps per second: its reply says its pace (Membership.pace)


def _holds(msg: Message) -> dict[str, tuple[str, int] | None]:
    """What a request says its worker holds: the central model of a version (``have``), or a copy (``held``)."""
    return {"have": parse_have(msg.fields.get("have")), "held": parse_have(msg.fields.get("held"), "held")}


class ModelRequests:
    """The ``init``, ``pull`` and ``push`` handlers of :class:`~plug_asgd.ps.server.ParameterServer`, a base of it.

    It holds no state of its own: it works on the server's store, membership, counters and shard guard, and sends
    through the server's socket (the attributes and methods annotated below, which the server sets and defines).
    """

    store: FastStore
    members: Membership
    stats: Stats
    shard: ShardGuard
    address: str
    _send: Callable[..., None]
    _send_frames: Callable[[bytes, list[Any]], int]
    _before_reply: Callable[[bytes], None]
    replicate: Callable[..., None]
    stream_state: Callable[[], None]
    config: Any
    epoch: int
    replication: Any
    leadership: Callable[[], dict[str, str]]

    def _send_model(self, identity: bytes, rid: Any, fields: dict[str, Any], with_tensors: bool = True,
                    token: _Reply | None = None, push: bool = False) -> None:
        fields = {**fields, "version": self.store.version, "stop": self.store.stopped, "rid": rid,
                  "epoch": self.epoch, **self.leadership()}
        if token is not None and token.paced and token.rank is not None:
            pace = self.members.pace(token.rank)
            if pace is not None:
                fields["pace"] = pace
        if with_tensors:
            frames = self.store.reply_payload(fields, token and token.have, rank=token and token.rank,
                                              held=token and token.held, push=push,
                                              ahead=token is not None and token.ahead,
                                              only=token.only if token is not None else None)
            self.stats.model_bytes_out += self._send_frames(identity, frames)
        else:
            self._before_reply(identity)
            self._send_frames(identity, encode("model", fields))

    def _resolve(self, resolutions: list[tuple[Any, str]]) -> None:
        for token, status in resolutions:
            applied = status == APPLIED
            self.stats.pushes_applied += applied
            self.stats.pushes_dropped += not applied
            if token is None:  # held from a record or a checkpoint: its worker sent it again, or is answered so
                continue
            if applied and token.want == "unless_own" and token.own_version == self.store.version:
                # nothing but this push changed the model since the worker's base: it adds its update to
                # its base itself (same float additions, same bits); the model stays here
                self.stats.own_replies += 1
                self._send_model(token.identity, token.rid, {"status": status, "own": True}, False, token)
            else:
                self._send_model(token.identity, token.rid, {"status": status}, token.want != "none" or not applied,
                                 token, push=True)

    def _on_init(self, identity: bytes, rid: Any, msg: Message) -> None:
        held = self.members.claimed()
        digest = self.shard.check(msg.fields, self.address, held=held)
        if not self.store.initialized and self.replication.linked:
            check_model(msg.tensors)  # a model refused here is not the standby's either
            self.replicate("init", {**self.shard.checkpoint_fields(), "partition_digest": digest}, msg.tensors)
        accepted = self.store.init(msg.tensors)
        self.shard.fix(digest, final=True, held=held)  # not refused: the model is cut by this digest from now on
        if accepted:
            log.info("central model initialised by rank %s: %d tensors, %d values", msg.fields.get("rank"),
                     len(msg.tensors), sum(t.size for t in self.store.state.tensors.values()))
        self._send(identity, rid, "init_ok", {"accepted": accepted, "version": self.store.version,
                                              "model_id": self.store.changes.model_id})

    def _on_pull(self, identity: bytes, rid: Any, msg: Message) -> None:
        rank = None
        if "rank" in msg.fields or identity in self.members.by_identity:  # else a bystander's (a Supervisor's)
            rank = self.members.member(identity, msg).rank
        self.store.require_init()
        token = _Reply(identity, rid, "all", rank=rank, **_holds(msg))
        self._send_model(identity, rid, {"status": "pulled"}, True, token)

    def _on_push(self, identity: bytes, rid: Any, msg: Message) -> None:
        worker = self.members.member(identity, msg, session=True)
        if not msg.tensors:
            raise WireError("empty", "a push must carry at least one tensor")
        self.store.require_init()
        rank, session = worker.rank, worker.session
        base = msg.int_field("base_version", minimum=0)
        seq = msg.int_field("seq", minimum=0)
        scaled_for = msg.float_field("scaled_for", minimum=0.0, maximum=MAX_SCALED_FOR, optional=True)
        rate = msg.float_field("rate", minimum=RATE_RANGE[0], maximum=RATE_RANGE[1], optional=True)
        model = msg.fields.get("model", True)
        flags = {name: msg.fields.get(name, False) for name in ("weights", "lend", "ahead")}
        for name, value in flags.items():
            if not isinstance(value, bool):  # (1 == True: a membership test would let 1 through)
                raise WireError("bad_field", f"field {name!r} must be true or false, got {value!r:.40}")
        if not (isinstance(model, bool) or model in ("unless_own", "pushed")):  # (1 == True: not a bool)
            raise WireError("bad_field", "field 'model' must be true, false, 'unless_own' or 'pushed', "
                                         f"got {model!r:.40}")
        want = "none" if model is False else "all" if model is True else model
        only = frozenset(msg.tensors) if model == "pushed" else None  # the tensors its reply carries, no others
        token = _Reply(identity, rid, want, rank=worker.rank, ahead=flags.pop("ahead"), only=only,
                       paced=rate is not None, **_holds(msg))
        if rate is not None:
            worker.rate = rate  # (a push refused below has said it as well: the worker's pace stands)
        if self.replication.linked and not self.config.standby_window:  # the standby folds it first: what a
            # worker is answered, the standby holds (with a window, the whole state goes every N pushes instead; to
            # a standby being taken, it goes without waiting: the standby is named only once it holds it all)
            self.replicate("push", {"rank": rank, "session": session, "seq": seq, "base_version": base,
                                    "scaled_for": scaled_for, "weights": flags["weights"]},
                           self.store.read_local(session, msg.tensors))
        try:
            folded = self.store.fold(PushIn(token, rank, session, seq, base, msg.tensors, msg.frames,
                                            request=self.stats.messages_in, scaled_for=scaled_for, **flags))
        except WireError as exc:
            if exc.code == "duplicate" and self.store.adopt(session, seq, token):
                return  # held in a round (a standby's record, a reconnection): answered as it completes
            raise
        if folded.status != FOLDED:  # not_current, or stopped
            self._send_model(identity, rid, {"status": folded.status}, folded.status != NOT_CURRENT
                             and model is not False, token)
            return
        token.own_version = folded.own_version
        self.stats.staleness[folded.staleness] += 1
        self.stats.pushes_by_rank[rank] += 1
        worker.pushes += 1
        self.store.last_seq[session] = self.store.last_seq.pop(session)  # most recent last: see trim_sessions
        self.stream_state()
        self._resolve(folded.resolutions)
