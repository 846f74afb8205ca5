"""The PS's side of the collectives: the ``gather`` that carries Lightning's barriers, broadcasts and metric reductions.

A gather of ``(stage, seq)`` is answered, to every rank at once, when every rank still in the
stage has contributed (lost and departed ranks are not waited for). A rank that comes back after
the others finished one gets the recorded result; a rank restarted mid-stage gathers alone.

Only the connection that holds a rank contributes for it (:meth:`Membership.member`), its object
within :mod:`plug_asgd.ps.limits`' bounds (so the reply, which carries every rank's, can be
encoded). A rank waits on one collective at a time: its contribution to another one drops the
earlier (abandoned after a timeout), so contributions to gathers never completed are at most one
per rank. Completed results are kept by number and by bytes.

Every bound is a total as well as a share. A gather's reply carries every rank's objects and tensors,
each tensor's name prefixed with its rank: the PS works out what each contribution adds to that reply
(:class:`Share`) and refuses, naming its rank, the largest contribution of a gather whose reply a
worker could not read (:data:`~plug_asgd.ps.limits.REPLY_LIMITS`); of the contributions waiting over
all gathers, the largest where their total would pass
:data:`~plug_asgd.ps.limits.GATHERS_PENDING_MAX_BYTES`. What the PS holds is counted as held: the
reply's header and tensor bytes, and :data:`~plug_asgd.ps.limits.HELD_PER_TENSOR` per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from plug_asgd.protocol.wire import PROTOCOL_VERSION, Message, Tensor, WireError, encode, message_bytes
from plug_asgd.ps import limits
from plug_asgd.ps.board import Board
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.stats import Stats

Send = Callable[[bytes, Any, str, dict[str, Any], dict[str, Tensor]], None]
Error = Callable[[bytes, Any, str, str], None]
Record = Callable[[str, dict[str, Any], dict[str, Tensor]], None]


@dataclass(frozen=True)
class Share:
    """What one rank's contribution adds to its gather's reply, and holds in the PS while kept.

    Attributes:
        header: bytes of the reply's header: the rank, its object and its tensors' entries (names prefixed).
        frames: frames of its tensors.
        data: bytes of those frames.
        tensors: its tensors.
    """

    header: int
    frames: int
    data: int
    tensors: int

    @property
    def held(self) -> int:
        """Bytes the PS holds for it: header, frames and :data:`~plug_asgd.ps.limits.HELD_PER_TENSOR` a tensor."""
        return self.header + self.data + limits.HELD_PER_TENSOR * self.tensors


def _array_extra(n: int) -> int:
    """Bytes a msgpack array of ``n`` items takes for its length beyond the one byte of an empty array's."""
    return 0 if n < 16 else 2 if n < 1 << 16 else 4


# the reply's header without ranks, objects or tensors; a request id packs to 9 bytes at most
_EMPTY_REPLY = len(msgpack.packb({"v": PROTOCOL_VERSION, "type": "gathered", "tensors": [],
                                  "fields": {"ranks": [], "objs": [], "rid": (1 << 64) - 1}}))
_EMPTY_HEADER = len(encode("gathered")[0])


def share(rank: int, obj_bytes: int, tensors: dict[str, Tensor]) -> Share:
    """What rank ``rank``'s contribution (its object ``obj_bytes`` packed, ``tensors``) adds to a gather's reply.

    Args:
        rank: the contributing rank (its tensors go out as ``"{rank}/{name}"``).
        obj_bytes: its object's bytes, packed.
        tensors: its tensors by name, as received.
    """
    frames = encode("gathered", None, {f"{rank}/{n}": t for n, t in tensors.items()})
    entries = len(frames[0]) - _EMPTY_HEADER - _array_extra(len(tensors))
    return Share(len(msgpack.packb(rank)) + obj_bytes + entries, len(frames) - 1, message_bytes(frames[1:]),
                 len(tensors))


def reply_size(shares: list[Share]) -> tuple[int, int, int]:
    """The header bytes, frames and bytes of a gather reply made of ``shares`` (the header's at most).

    Args:
        shares: each rank's share of it.
    """
    tensors = sum(s.tensors for s in shares)
    header = (_EMPTY_REPLY + sum(s.header for s in shares) + 2 * _array_extra(len(shares))
              + _array_extra(tensors))
    return header, 1 + sum(s.frames for s in shares), header + sum(s.data for s in shares)


def too_large(shares: dict[int, Share], newcomer: int) -> tuple[int, str] | None:
    """Where a gather reply of ``shares`` passes what a worker reads: the rank holding the most of the measure
    passed (``newcomer`` on a tie), and the reply's size against the limit, in words; None where it fits.

    Args:
        shares: each contributing rank's share.
        newcomer: the rank whose contribution is being taken.
    """
    header, frames, size = reply_size(list(shares.values()))
    bound = limits.REPLY_LIMITS
    measures: tuple[tuple[int, int, str, Callable[[Share], int]], ...] = (
        (header, bound.max_header_bytes, "a header of {} bytes", lambda s: s.header),
        (frames, bound.max_frames, "{} frames", lambda s: s.frames),
        (size, bound.max_message_bytes, "{} bytes", lambda s: s.header + s.data))
    for value, most, what, part in measures:
        if value > most:
            worst = max(shares, key=lambda r: (part(shares[r]), r == newcomer))
            return worst, f"{what.format(value)}, the limit is {most}"
    return None


class Gathers:
    """Gathers in progress and those recently completed; answers through ``send`` and ``error``.

    Args:
        members: the PS's membership: who holds each rank, who left or came late to a stage.
        stats: the counters it adds to.
        send: sends a reply: ``send(identity, rid, type, fields, tensors)``.
        error: sends an error reply: ``error(identity, rid, code, text)``.
        record: hands a completed gather (``"gathered"``) or a posted notice (``"notice"``) to the hot standby
            before any rank is answered (:mod:`plug_asgd.ps.replication`), so that a rank whose answer was lost
            with the primary gets it from the standby; None: no standby ever.
    """

    def __init__(self, members: Membership, stats: Stats, send: Send, error: Error,
                 record: Record | None = None) -> None:
        self.members = members
        self.stats = stats
        self._send = send
        self._error = error
        self._record = record
        self.gathers: dict[tuple[int, int], dict[int, tuple[bytes, Message, Any, Share]]] = {}
        self.completed: dict[tuple[int, int], tuple[dict[str, Any], dict[str, Tensor]]] = {}
        self.board = Board()  # broadcasts inside the training loop: nothing waits for them
        self._bytes: dict[tuple[int, int], int] = {}  # of each completed result
        self.completed_bytes = 0

    def gather(self, identity: bytes, rid: Any, msg: Message) -> None:
        """One rank's contribution; answered now if it completes the gather (or was completed already).

        Args:
            identity: the ROUTER identity of the connection that sent it (where the reply goes).
            rid: the request's id, echoed in the reply.
            msg: the ``gather`` request: ``stage``, ``seq``, ``kind``, its object and tensors.

        Raises:
            WireError: where the rank has already left the stage (``bad_field``), another rank called a
                different collective at the same point (``collective_mismatch``, which every waiting rank is
                answered too), or the contribution is the largest of a reply too large to read or of the
                contributions waiting past their bound (``limit``, naming the rank).
        """
        rank = self.members.member(identity, msg).rank
        stage = msg.int_field("stage", minimum=0)
        seq = msg.int_field("seq", minimum=0)
        obj, obj_bytes = limits.gather_obj(msg)
        assert stage is not None and seq is not None
        if rank in self.members.left.get(stage, ()):
            raise WireError("bad_field", f"rank {rank} has already left stage {stage}")
        key = (stage, seq)
        if key in self.completed:  # it was lost while the others held this collective: their result
            fields, tensors = self.completed[key]
            self._send(identity, rid, "gathered", fields, tensors)
            return
        mine = share(rank, obj_bytes, msg.tensors)
        if rank in self.members.late.get(stage, ()):
            self._fit(key, rank, mine, {})
            self._send(identity, rid, "gathered", {"ranks": [rank], "objs": [obj]},
                       {f"{rank}/{n}": t for n, t in msg.tensors.items()})
            return
        self._check_objects(key, rank, obj_bytes)
        entries = self.gathers.get(key, {})
        kind = str(msg.fields.get("kind", ""))
        other = next(((r, e[1].fields.get("kind", "")) for r, e in entries.items()
                      if r != rank and e[1].fields.get("kind", "").split(":")[0] != kind.split(":")[0]), None)
        if other is not None:
            del self.gathers[key]
            text = (f"collective mismatch: rank {rank} called {kind or '?'} where rank {other[0]} called "
                    f"{other[1] or '?'} (collective {seq} of stage {stage}). Every rank must reach the same "
                    "collectives in the same order; note that trainer.log_dir is a broadcast")
            self.stats.refused["collective_mismatch"] += 1
            for ident, _, their_rid, _ in entries.values():
                self._error(ident, their_rid, "collective_mismatch", text)
            raise WireError("collective_mismatch", text)
        self._fit(key, rank, mine, entries)
        self._fit_pending(rank, mine)
        self._withdraw(rank, key)  # only now: a refused contribution leaves the rank's others as they were
        # a contribution sent again (after a reconnection) replaces the first: the reply goes to the latest
        self.gathers.setdefault(key, {})[rank] = (identity, msg, rid, mine)
        self._maybe_finish(key)

    def notice(self, identity: bytes, rid: Any, msg: Message) -> None:
        """A broadcast inside the training loop: the source's value posted, or the latest one read, at once.

        Args:
            identity: the ROUTER identity of the connection that sent it (where the reply goes).
            rid: the request's id, echoed in the reply.
            msg: the ``notice`` request (see :meth:`~plug_asgd.ps.board.Board.notice`).
        """
        rank = self.members.sender(msg)
        fields = self.board.notice(rank, self.members.world_size, msg)
        if "value" in msg.fields and self._record is not None:
            self._record("notice", {"stage": msg.fields["stage"], "src": msg.fields["src"], "key": msg.fields["key"],
                                    "value": msg.fields["value"]}, {})
        self._send(identity, rid, "noticed", fields, {})

    def _check_objects(self, key: tuple[int, int], rank: int, obj_bytes: int) -> None:
        """Refuse (``limit``) an object that would take the gather's objects past what its reply may carry."""
        if obj_bytes <= 1:  # None, or an empty container: the common case
            return
        others = sum(len(msgpack.packb(e[1].fields.get("obj"))) for r, e in self.gathers.get(key, {}).items()
                     if r != rank)
        if obj_bytes + others > limits.MAX_GATHER_OBJ_BYTES:
            raise WireError("limit", f"the objects of collective {key[1]} of stage {key[0]} would pass "
                                     f"{limits.MAX_GATHER_OBJ_BYTES} bytes packed: a reply too large to read")

    def _fit(self, key: tuple[int, int], rank: int, mine: Share,
             entries: dict[int, tuple[bytes, Message, Any, Share]]) -> None:
        """Make room in ``key``'s reply for ``rank``'s share ``mine``: while the reply would be too large for a
        worker to read, refuse its largest contribution, answered ``limit`` (or raised, where it is ``rank``'s)."""
        while True:
            shares = {**{r: e[3] for r, e in entries.items() if r != rank}, rank: mine}
            over = too_large(shares, rank)
            if over is None:
                return
            worst, size = over
            text = (f"rank {worst}'s contribution to collective {key[1]} of stage {key[0]} is the largest of a reply "
                    f"too large for a worker to read ({size}): refused")
            if worst == rank:
                raise WireError("limit", text)
            self._refuse(key, worst, text)

    def _fit_pending(self, rank: int, mine: Share) -> None:
        """Make room for ``rank``'s share ``mine`` among the contributions waiting: while they would hold more than
        :data:`~plug_asgd.ps.limits.GATHERS_PENDING_MAX_BYTES`, refuse the largest (``rank``'s on a tie)."""
        while True:
            held = {(k, r): e[3].held for k, entries in self.gathers.items() for r, e in entries.items() if r != rank}
            total = sum(held.values()) + mine.held
            if total <= limits.GATHERS_PENDING_MAX_BYTES:
                return
            worst = max(held, key=lambda kr: held[kr], default=None)
            largest = (worst[1], held[worst]) if worst is not None and held[worst] > mine.held else (rank, mine.held)
            text = (f"rank {largest[0]}'s contribution to a collective holds {largest[1]} bytes, the largest of "
                    f"those waiting, which would hold {total} (the limit is {limits.GATHERS_PENDING_MAX_BYTES}): "
                    "refused")
            if largest[0] == rank:
                raise WireError("limit", text)
            assert worst is not None
            self._refuse(worst[0], worst[1], text)

    def _refuse(self, key: tuple[int, int], rank: int, text: str) -> None:
        """Drop ``rank``'s contribution to ``key``, answering it ``limit`` with ``text`` (counted)."""
        identity, _, rid, _ = self.gathers[key].pop(rank)
        if not self.gathers[key]:
            del self.gathers[key]
        self.stats.refused["limit"] += 1
        self._error(identity, rid, "limit", text)

    def fail(self, text: str, sessions: set[str]) -> None:
        """A job failed (:mod:`plug_asgd.ps.failure`): the contributions of its workers waiting are answered
        ``job_failed``.

        Args:
            text: what failed, quoted in the replies.
            sessions: the failed job's sessions.
        """
        for key, entries in list(self.gathers.items()):
            for rank, (identity, _, rid, _) in list(entries.items()):
                worker = self.members.by_identity.get(identity)
                if worker is not None and worker.session in sessions:
                    del entries[rank]
                    self.stats.refused["job_failed"] += 1
                    self._error(identity, rid, "job_failed", text)
            if not entries:
                del self.gathers[key]

    def pending_bytes(self) -> int:
        """Bytes the contributions waiting for their gathers hold (:attr:`Share.held`)."""
        return sum(e[3].held for entries in self.gathers.values() for e in entries.values())

    def _withdraw(self, rank: int, key: tuple[int, int]) -> None:
        """``rank`` now waits on ``key``: its contributions to other gathers were abandoned."""
        for other in [k for k, entries in self.gathers.items() if k != key and rank in entries]:
            del self.gathers[other][rank]
            if not self.gathers[other]:
                del self.gathers[other]

    def counters(self) -> dict[str, int]:
        """What the PS holds of collectives: contributions waiting, and the bytes of completed results kept."""
        return {"gather_contributions_pending": sum(len(e) for e in self.gathers.values()),
                "gather_pending_bytes": self.pending_bytes(),
                "collectives_kept": len(self.completed), "collectives_kept_bytes": self.completed_bytes}

    def recheck(self, stage: int | None = None) -> None:
        """Fewer ranks to wait for (of ``stage``, or of every stage): finish the gathers now complete.

        Args:
            stage: the stage whose gathers to look at; None: every stage's.
        """
        for key in [k for k in self.gathers if stage is None or k[0] == stage]:
            self._maybe_finish(key)

    def joined(self, rank: int, stage: int) -> None:
        """``rank`` is in ``stage``: it has left every earlier one (what a PS restarted mid-run learns).

        Args:
            rank: the rank that said hello.
            stage: the stage it is in.
        """
        for key in [k for k in self.gathers if k[0] < stage]:
            self.members.left[key[0]].add(rank)
            self._maybe_finish(key)

    def forget_stage(self, stage: int) -> None:
        """Every rank is done with ``stage``: its results are needed no more.

        Args:
            stage: the stage every rank has left.
        """
        for key in [k for k in self.completed if k[0] == stage]:
            self._drop_completed(key)
        self.board.forget_stage(stage)

    def left(self, stage: int) -> None:
        """A rank left ``stage``: finish the gathers it no longer holds up; forget the stage once all have left.

        Args:
            stage: the stage the rank left.
        """
        self.recheck(stage)
        if self.members.stage_done(stage):
            self.forget_stage(stage)

    def keep(self, key: tuple[int, int], fields: dict[str, Any], tensors: dict[str, Tensor], size: int) -> None:
        """Keep a completed gather's result for a rank that asks again, within the bounds on what is kept.

        Args:
            key: the gather's ``(stage, seq)``.
            fields: the reply's fields (``ranks``, ``objs``).
            tensors: the reply's tensors, each name prefixed with its rank.
            size: the bytes it holds.
        """
        self.completed[key] = (fields, tensors)
        self._bytes[key] = size
        self.completed_bytes += size
        while self.completed and (len(self.completed) > limits.COMPLETED_KEPT
                                  or self.completed_bytes > limits.COMPLETED_MAX_BYTES):
            self._drop_completed(next(iter(self.completed)))

    def _drop_completed(self, key: tuple[int, int]) -> None:
        del self.completed[key]
        self.completed_bytes -= self._bytes.pop(key)

    def _maybe_finish(self, key: tuple[int, int]) -> None:
        entries = self.gathers.get(key)
        world_size = self.members.world_size
        if entries is None or world_size is None:
            return
        absent = self.members.absent(key[0]) - set(entries)
        if len(entries) < world_size - len(absent):
            return
        ranks = sorted(entries)
        tensors = {f"{r}/{name}": t for r in ranks for name, t in entries[r][1].tensors.items()}
        fields = {"ranks": ranks, "objs": [entries[r][1].fields.get("obj") for r in ranks]}
        if self._record is not None:
            self._record("gathered", {"stage": key[0], "seq": key[1], **fields}, tensors)
        del self.gathers[key]
        shares = [entries[r][3] for r in ranks]
        self.keep(key, fields, tensors, reply_size(shares)[0] + sum(s.held - s.header for s in shares))
        for r in ranks:
            identity, _, rid, _ = entries[r]
            self._send(identity, rid, "gathered", fields, tensors)

