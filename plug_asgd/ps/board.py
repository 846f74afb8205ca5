"""The notice board: what a rank broadcasts inside the training loop, read by the others without waiting.

Lightning's ``Timer`` (``Trainer(max_time=...)``) broadcasts rank 0's decision to stop after every
training batch. Made a gather, that broadcast holds every worker to the slowest, batch by batch:
the lockstep that asynchronous training exists to avoid. Inside the training loop a broadcast
posts the source rank's value here instead, and the other ranks read the latest value posted for
the same call (the worker's side, and why that is safe, is :mod:`plug_asgd.worker.notices`). Bounded:
``NOTICE_KEYS`` calls per batch, ``NOTICE_BYTES`` per value, the stages still running.
"""

from __future__ import annotations

from typing import Any

import msgpack

from plug_asgd.protocol.schema import NOTICE_BYTES, NOTICE_KEYS
from plug_asgd.protocol.wire import Message, WireError

NOTICE_ENTRIES = 4096  # what the board holds at most, stages and ranks together


class Board:
    """The latest value each ``(stage, src, key)`` was posted with."""

    def __init__(self) -> None:
        self.posted: dict[tuple[int, int, int], Any] = {}

    def notice(self, rank: int, world_size: int | None, msg: Message) -> dict[str, Any]:
        """Post ``msg``'s value (from its source rank ``rank``) or read the latest posted; the reply's fields.

        Args:
            rank: the rank of the worker that sent ``msg``; only the notice's source rank may post its value.
            world_size: the run's world size, which bounds the source rank; None while it is not known.
            msg: the ``notice`` request: ``stage``, ``src``, ``key`` and, when it posts, ``value``.

        Raises:
            WireError: where the key or source rank is out of bounds (``bad_field``), a rank posts another's
                notice (``bad_field``), or the value is over ``NOTICE_BYTES`` once packed (``too_large``).
        """
        stage = msg.int_field("stage", minimum=0)
        src = msg.int_field("src", minimum=0)
        key = msg.int_field("key", minimum=0)
        if key >= NOTICE_KEYS or (world_size is not None and src >= world_size):
            raise WireError("bad_field", f"notice ({stage}, {src}, {key}) is out of bounds: key < {NOTICE_KEYS}, "
                                         f"src < world size {world_size}")
        where = (stage, src, key)
        if "value" in msg.fields:
            if rank != src:
                raise WireError("bad_field", f"rank {rank} cannot post the notice of rank {src}")
            value = msg.fields["value"]
            if len(msgpack.packb(value, use_bin_type=True)) > NOTICE_BYTES:
                raise WireError("too_large", f"a broadcast inside the training loop carries at most {NOTICE_BYTES} "
                                             "bytes: broadcast larger objects outside it (at setup, validation)")
            self.posted.pop(where, None)
            self.posted[where] = value  # the newest last: the oldest go first when the board is full
            while len(self.posted) > NOTICE_ENTRIES:
                del self.posted[next(iter(self.posted))]
        found = where in self.posted
        return {"stage": stage, "src": src, "key": key, "found": found, "value": self.posted.get(where)}

    def forget_stage(self, stage: int) -> None:
        """Every rank is done with ``stage``: its notices are dropped.

        Args:
            stage: the stage (a fit, a validation...) whose notices no rank will read again.
        """
        for where in [w for w in self.posted if w[0] == stage]:
            del self.posted[where]
