"""Collectives: the ``gather`` that carries Lightning's barriers, broadcasts and metric reductions.

A gather of ``(stage, seq)`` is answered, to every rank at once, when every rank still in the
stage has contributed (lost and departed ranks are not waited for). A rank that comes back after
the others finished one gets the recorded result; a rank restarted mid-stage gathers alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plug_asgd.ps.board import Board
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.stats import Stats
from plug_asgd.wire import Message, Tensor, WireError

COMPLETED_KEPT = 1024  # collectives whose result a worker that comes back late can still get

Send = Callable[[bytes, Any, str, dict[str, Any], dict[str, Tensor]], None]
Error = Callable[[bytes, Any, str, str], None]


class Collectives:
    """Gathers in progress and those recently completed; answers through ``send`` and ``error``."""

    def __init__(self, members: Membership, stats: Stats, send: Send, error: Error) -> None:
        self.members = members
        self.stats = stats
        self._send = send
        self._error = error
        self.gathers: dict[tuple[int, int], dict[int, tuple[bytes, Message, Any]]] = {}
        self.completed: dict[tuple[int, int], tuple[dict[str, Any], dict[str, Tensor]]] = {}
        self.board = Board()  # broadcasts inside the training loop: nothing waits for them

    def gather(self, identity: bytes, rid: Any, msg: Message) -> None:
        """One rank's contribution; answered now if it completes the gather (or was completed already)."""
        rank = msg.int_field("rank", minimum=0)
        stage = msg.int_field("stage", minimum=0)
        seq = msg.int_field("seq", minimum=0)
        if rank in self.members.left.get(stage, ()):
            raise WireError("bad_field", f"rank {rank} has already left stage {stage}")
        key = (stage, seq)
        if key in self.completed:  # it was lost while the others held this collective: their result
            fields, tensors = self.completed[key]
            self._send(identity, rid, "gathered", fields, tensors)
            return
        if rank in self.members.late.get(stage, ()):
            self._send(identity, rid, "gathered", {"ranks": [rank], "objs": [msg.fields.get("obj")]},
                       {f"{rank}/{n}": t for n, t in msg.tensors.items()})
            return
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
        """A broadcast inside the training loop: the source's value posted, or the latest one read, at once."""
        rank = self.members.sender(msg)
        self._send(identity, rid, "noticed", self.board.notice(rank, self.members.world_size, msg), {})

    def recheck(self, stage: int | None = None) -> None:
        """Fewer ranks to wait for (of ``stage``, or of every stage): finish the gathers now complete."""
        for key in [k for k in self.gathers if stage is None or k[0] == stage]:
            self._maybe_finish(key)

    def joined(self, rank: int, stage: int) -> None:
        """``rank`` is in ``stage``: it has left every earlier one (what a PS restarted mid-run learns)."""
        for key in [k for k in self.gathers if k[0] < stage]:
            self.members.left[key[0]].add(rank)
            self._maybe_finish(key)

    def forget_stage(self, stage: int) -> None:
        """Every rank is done with ``stage``: its results are needed no more."""
        for key in [k for k in self.completed if k[0] == stage]:
            del self.completed[key]
        self.board.forget_stage(stage)

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
        while len(self.completed) > COMPLETED_KEPT:
            del self.completed[next(iter(self.completed))]
        for r in ranks:
            identity, _, rid = entries[r]
            self._send(identity, rid, "gathered", fields, tensors)
