"""Replies queued for the PS's connections: bounded in bytes over all of them, given back when one closes.

The ROUTER's high-water mark bounds each connection (:data:`~plug_asgd.ps.limits.REPLY_HWM` replies); a
model reply pins a version of the model while it waits, so many connections that never read would
pin many versions between them. The PS tracks each reply it sends (its last frame: ZeroMQ sends a
message's frames in order, so the last one freed means the whole reply has left the queue) and counts
the bytes still queued, over all connections. A reply that would take that count past
:data:`REPLIES_QUEUED_MAX_BYTES` is dropped and counted (``replies_dropped["total"]``) unless its
connection holds a rank and has fewer than :data:`MEMBER_QUEUED_REPLIES` replies queued: a worker is
never starved by a flood, and the total stays below the bound plus that many replies per rank. pyzmq marks a
reply let go from a thread of its own, which a loaded machine may hold back for a few of a worker's round trips:
where a rank's count is at its allowance, the PS waits for that thread (:data:`MEMBER_SETTLE_S` at most) before it
drops the reply, and waits so again for that rank only once one of its replies has been let go since (a rank that
does not read costs the PS one wait, not one a request).

A connection that closes frees its queue in libzmq, but the allocator keeps the freed pages in the
process: the PS hands them back to the system (glibc's ``malloc_trim``) shortly after a connection
closes, at most once every :data:`TRIM_EVERY_S`, instead of leaving them until later allocations reuse them.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import zmq

REPLIES_QUEUED_MAX_BYTES = 128 << 20  # replies queued over all connections (the recipe CNN's: 26 model replies)
# a rank's connection may always have this many queued: a PSClient has 2 unread at most, and pyzmq's thread marks a
# reply freed a moment after ZeroMQ frees it (so a reply already read may still count)
MEMBER_QUEUED_REPLIES = 4
MEMBER_SETTLE_S = 0.5  # the longest a rank's reply waits for pyzmq's thread to mark its earlier ones let go
TRIM_AFTER_S = 0.5  # after a connection closed: libzmq has freed its queue, and pyzmq's thread the buffers it held
TRIM_EVERY_S = 1.0  # connections that come and go make a trim this often at most


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


class Replies:
    """The bytes of the replies each connection has queued, tracked until ZeroMQ has let them go.

    Args:
        copy_threshold: the socket's; a smaller frame that is not already a ZeroMQ frame is copied, as pyzmq
            would (it may be a view of the store's arrays, which change).
    """

    def __init__(self, copy_threshold: int) -> None:
        self.copy_threshold = copy_threshold
        self._queued: dict[bytes, list[tuple[zmq.MessageTracker, int]]] = {}
        self._unread: set[bytes] = set()  # ranks' connections waited for in vain, and none of their replies gone since
        self.bytes = 0  # queued over all connections
        self.peak = 0
        self._trim = _malloc_trim()
        self._trim_at: float | None = None
        self._trimmed_at = 0.0

    def admit(self, identity: bytes, frames: list[Any], size: int, member: bool) -> list[Any] | None:
        """``frames`` ready to send, the last one tracked; None where the reply must be dropped (the total).

        Args:
            identity: the connection the reply goes to.
            frames: the reply's frames.
            size: their bytes.
            member: whether the connection holds a rank.
        """
        mine = self._prune(identity)
        if self.bytes + size > REPLIES_QUEUED_MAX_BYTES:
            if member and mine >= MEMBER_QUEUED_REPLIES:
                mine = self._settle(identity)
            if not (member and mine < MEMBER_QUEUED_REPLIES):
                self.prune()
                if self.bytes + size > REPLIES_QUEUED_MAX_BYTES:
                    return None
        last = frames[-1]
        if not (isinstance(last, zmq.Frame) and last.tracker is not None and not last.tracker.done):
            small = not isinstance(last, zmq.Frame) and memoryview(last).nbytes < self.copy_threshold
            last = zmq.Frame(bytes(last) if small else last, track=True, copy=False)
        return [*frames[:-1], last]

    def sent(self, identity: bytes, frames: list[Any], size: int) -> None:
        """A reply :meth:`admit` made ready went to ``identity``: its bytes count until its last frame is freed.

        Args:
            identity: the connection it went to.
            frames: the frames sent (as :meth:`admit` returned them).
            size: their bytes.
        """
        self._queued.setdefault(identity, []).append((frames[-1].tracker, size))
        self.bytes += size
        self.peak = max(self.peak, self.bytes)

    def _settle(self, identity: bytes) -> int:
        """Wait for pyzmq's thread to mark as let go the replies that would bring a rank's connection under its
        allowance (:data:`MEMBER_SETTLE_S` at most, and not again for a connection waited for in vain until one of
        its replies is let go); how many it still has queued."""
        queued = self._queued.get(identity, [])
        if identity not in self._unread:
            deadline = time.monotonic() + MEMBER_SETTLE_S
            try:
                for tracker, _ in queued[:len(queued) - MEMBER_QUEUED_REPLIES + 1]:
                    tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                self._unread.add(identity)
        return self._prune(identity)

    def _prune(self, identity: bytes) -> int:
        """Forget ``identity``'s replies ZeroMQ has let go; how many it still has queued."""
        queued = self._queued.get(identity)
        if not queued:
            return 0
        left = [(t, n) for t, n in queued if not t.done]
        self.bytes -= sum(n for _, n in queued) - sum(n for _, n in left)
        if len(left) < len(queued):
            self._unread.discard(identity)
        if left:
            self._queued[identity] = left
        else:
            del self._queued[identity]
        return len(left)

    def prune(self) -> None:
        """Forget every reply ZeroMQ has let go."""
        for identity in list(self._queued):
            self._prune(identity)

    def closed(self) -> None:
        """A connection closed: its queue is freed; give the memory back to the system shortly."""
        if self._trim_at is None:
            self._trim_at = max(time.monotonic() + TRIM_AFTER_S, self._trimmed_at + TRIM_EVERY_S)

    def tick(self) -> None:
        """Between requests: forget what has left the queues, and make a trim that is due."""
        self.prune()
        if self._trim_at is not None and time.monotonic() >= self._trim_at:
            self._trim_at, self._trimmed_at = None, time.monotonic()
            if self._trim is not None:
                self._trim(0)

    def counters(self) -> dict[str, int]:
        """The bytes of replies queued now, over all connections, and the most they reached."""
        return {"replies_queued_bytes": self.bytes, "replies_queued_peak": self.peak}
