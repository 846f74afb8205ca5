"""The PS's side of the collectives: the ``gather`` that carries Lightning's barriers, broadcasts and metric reductions.

A gather of ``(stage, seq)`` is answered, to every rank at once, when every rank still in the
stage has contributed (lost and departed ranks are not waited for). A rank that comes back after
the others finished one gets the recorded result; a rank restarted mid-stage gathers alone.

Only the connection that holds a rank contributes for it (:meth:`Membership.member`), its object
within :mod:`plug_asgd.ps.limits`' bounds (so the reply, which carries every rank's, can be
encoded). A rank waits on one collective at a time: its contribution to another one drops the
earlier (abandoned after a timeout), so contributions to gathers never completed are at most one
per rank. Completed results are kept by number and by bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from plug_asgd.protocol.wire import Message, Tensor, WireError
from plug_asgd.ps import limits
from plug_asgd.ps.board import Board
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.stats import Stats

Send = Callable[[bytes, Any, str, dict[str, Any], dict[str, Tensor]], None]
Error = Callable[[bytes, Any, str, str], None]


class Gathers:
    """Gathers in progress and those recently completed; answers through ``send`` and ``error``.

    Args:
        members: the PS's membership: who holds each rank, who left or came late to a stage.
        stats: the counters it adds to.
        send: sends a reply: ``send(identity, rid, type, fields, tensors)``.
        error: sends an error reply: ``error(identity, rid, code, text)``.
    """

    def __init__(self, members: Membership, stats: Stats, send: Send, error: Error) -> None:
        self.members = members
        self.stats = stats
        self._send = send
        self._error = error
        self.gathers: dict[tuple[int, int], dict[int, tuple[bytes, Message, Any]]] = {}
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
            WireError: where the rank has already left the stage (``bad_field``), or another rank called a
                different collective at the same point (``collective_mismatch``, which every waiting rank is
                answered too).
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
        if rank in self.members.late.get(stage, ()):
            self._send(identity, rid, "gathered", {"ranks": [rank], "objs": [obj]},
                       {f"{rank}/{n}": t for n, t in msg.tensors.items()})
            return
        self._withdraw(rank, key)
        self._check_objects(key, rank, obj_bytes)
        entries = self.gathers.setdefault(key, {})
        kind = str(msg.fields.get("kind", ""))
        other = next(((r, e[1].fields.get("kind", "")) for r, e in entries.items()
                      if r != rank and e[1].fields.get("kind", "").split(":")[0] != kind.split(":")[0]), None)
        if other is not None:
            del self.gathers[key]
            text = (f"collective mismatch: rank {rank} called {kind or '?'} where rank {other[0]} called "
                    f"{other[1] or '?'} (collective {seq} of stage {stage}). Every rank must reach the same "
                    "collectives in the same order; note that trainer.log_dir is a broadcast")
            self.stats.refused["collective_mismatch"] += 1
            for ident, _, their_rid in entries.values():
                self._error(ident, their_rid, "collective_mismatch", text)
            raise WireError("collective_mismatch", text)
        # a contribution sent again (after a reconnection) replaces the first: the reply goes to the latest
        entries[rank] = (identity, msg, rid)
        self._maybe_finish(key)

    def notice(self, identity: bytes, rid: Any, msg: Message) -> None:
        """A broadcast inside the training loop: the source's value posted, or the latest one read, at once.

        Args:
            identity: the ROUTER identity of the connection that sent it (where the reply goes).
            rid: the request's id, echoed in the reply.
            msg: the ``notice`` request (see :meth:`~plug_asgd.ps.board.Board.notice`).
        """
        rank = self.members.sender(msg)
        self._send(identity, rid, "noticed", self.board.notice(rank, self.members.world_size, msg), {})

    def _check_objects(self, key: tuple[int, int], rank: int, obj_bytes: int) -> None:
        """Refuse (``limit``) an object that would take the gather's objects past what its reply may carry."""
        if obj_bytes <= 1:  # None, or an empty container: the common case
            return
        others = sum(len(msgpack.packb(e[1].fields.get("obj"))) for r, e in self.gathers.get(key, {}).items()
                     if r != rank)
        if obj_bytes + others > limits.MAX_GATHER_OBJ_BYTES:
            raise WireError("limit", f"the objects of collective {key[1]} of stage {key[0]} would pass "
                                     f"{limits.MAX_GATHER_OBJ_BYTES} bytes packed: a reply too large to read")

    def _withdraw(self, rank: int, key: tuple[int, int]) -> None:
        """``rank`` now waits on ``key``: its contributions to other gathers were abandoned."""
        for other in [k for k, entries in self.gathers.items() if k != key and rank in entries]:
            del self.gathers[other][rank]
            if not self.gathers[other]:
                del self.gathers[other]

    def counters(self) -> dict[str, int]:
        """What the PS holds of collectives: contributions waiting, and the bytes of completed results kept."""
        return {"gather_contributions_pending": sum(len(e) for e in self.gathers.values()),
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
        del self.gathers[key]
        ranks = sorted(entries)
        tensors = {f"{r}/{name}": t for r in ranks for name, t in entries[r][1].tensors.items()}
        fields = {"ranks": ranks, "objs": [entries[r][1].fields.get("obj") for r in ranks]}
        self.completed[key] = (fields, tensors)
        self._bytes[key] = len(msgpack.packb(fields["objs"])) + sum(_nbytes(t) for t in tensors.values())
        self.completed_bytes += self._bytes[key]
        while self.completed and (len(self.completed) > limits.COMPLETED_KEPT
                                  or self.completed_bytes > limits.COMPLETED_MAX_BYTES):
            self._drop_completed(next(iter(self.completed)))
        for r in ranks:
            identity, _, rid = entries[r]
            self._send(identity, rid, "gathered", fields, tensors)


def _nbytes(tensor: Tensor) -> int:
    """Bytes a tensor of a gather holds (its arrays)."""
    if isinstance(tensor, np.ndarray):
        return tensor.nbytes
    arrays = getattr(tensor, "arrays", None) or (getattr(tensor, "indices", None), getattr(tensor, "values", None))
    return sum(int(np.asarray(a).nbytes) for a in arrays if a is not None)
