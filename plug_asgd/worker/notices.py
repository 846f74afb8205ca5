"""Broadcasts inside the training loop, answered without waiting for the other workers.

Lightning's ``Timer`` (``Trainer(max_time=...)``) calls ``strategy.broadcast(should_stop)`` after
every training batch, so that all ranks stop at the same batch, as DDP's collectives need. Through
the PS that broadcast would be a gather: every worker held to the slowest, batch by batch, and the
straggler advantage gone. Inside the training loop a broadcast is a notice instead
(:mod:`plug_asgd.ps.board`): the source rank posts its value and goes on; every other rank sends a
read and goes on, and answers with the latest value of the source that reached it (its own value
until one has). Nothing waits: the requests go out without blocking on a socket of their own, and
their replies are taken in at the next broadcast, so the source's value reaches the others within
a batch or two.

Why that is safe: no worker waits on another during training, so a rank that stops a batch or two
after the source (or before it, on its own value) blocks nobody; the collectives at validation,
checkpoints and the end of the stage are real gathers, and every rank that stops reaches them.
A broadcast call is known by its batch and its place among the batch's broadcasts (the same
callbacks run in the same order on every rank).
"""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from plug_asgd.protocol.schema import NOTICE_BYTES, NOTICE_KEYS
from plug_asgd.protocol.wire import Limits, WireError, decode, encode


class Notices:
    """One worker's training-loop broadcasts, over ``socket`` (a DEALER of its own to the PS).

    Args:
        socket: a DEALER socket of its own, connected to the PS; :meth:`close` closes it.
        rank: this worker's rank.
        session: what the PS knows this worker by (its hello's), as on its heartbeats.
        token: the token of this worker's hello, as on its heartbeats (None: the PS gave none).
        limits: the largest messages accepted from the PS, which its replies are decoded within.
    """

    def __init__(self, socket: zmq.Socket, rank: int, session: str, token: str | None, limits: Limits) -> None:
        self.socket = socket
        self.rank = rank
        self.session, self.token = session, token
        self.limits = limits
        self.latest: dict[tuple[int, int, int], Any] = {}  # (stage, src, key) -> the source's latest value
        self.sent = self.received = self.dropped = 0
        self._batch: Any = None
        self._key = 0

    def broadcast(self, obj: Any, src: int, stage: int, batch: Any) -> Any:
        """``src``'s latest value for this call; ``obj`` itself on ``src``, and until ``src``'s value has come.

        Args:
            obj: this worker's value: the one posted where this worker is ``src``, the answer until then elsewhere.
            src: the rank whose value every worker takes.
            stage: the number of the stage, which keeps one stage's notices from another's.
            batch: what identifies the training batch; the calls within one batch are told apart by their order.

        Raises:
            RuntimeError: where a batch makes more broadcasts than the PS keeps (``NOTICE_KEYS``).
            TypeError: where this worker is ``src`` and ``obj`` is not msgpack data.
            ValueError: where this worker is ``src`` and ``obj`` packs into more than ``NOTICE_BYTES`` bytes.
        """
        if batch != self._batch:
            self._batch, self._key = batch, 0
        key = self._key
        self._key += 1
        if key >= NOTICE_KEYS:
            raise RuntimeError(f"more than {NOTICE_KEYS} broadcasts in one training batch: AsyncPSStrategy answers "
                               "those inside the training loop without waiting, and keeps that many per batch")
        self._take_replies()
        fields: dict[str, Any] = {"rank": self.rank, "session": self.session, "token": self.token, "stage": stage,
                                  "src": src, "key": key}
        if self.rank == src:
            try:
                size = len(msgpack.packb(obj, use_bin_type=True))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"AsyncPSStrategy.broadcast sends msgpack data only (str, numbers, lists, dicts, "
                                f"bytes, None); got {type(obj).__name__}: {exc}") from None
            if size > NOTICE_BYTES:
                raise ValueError(f"a broadcast inside the training loop carries at most {NOTICE_BYTES} bytes "
                                 f"(this one: {size}): broadcast larger objects outside it (setup, validation)")
            fields["value"] = obj
        try:
            self.socket.send_multipart(encode("notice", fields), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:  # the PS is away or slow: this notice is dropped, and the next batch asks again
            self.dropped += 1
        return obj if self.rank == src else self.latest.get((stage, src, key), obj)

    def _take_replies(self) -> None:
        while self.socket.poll(0):
            try:
                reply = decode(self.socket.recv_multipart(copy=False), self.limits)
            except WireError:
                continue
            self.received += 1
            f = reply.fields
            if reply.type == "noticed" and f.get("found"):
                self.latest[(int(f["stage"]), int(f["src"]), int(f["key"]))] = f.get("value")

    def close(self) -> None:
        """Close the socket at once, dropping any notice not yet sent."""
        self.socket.close(0)
